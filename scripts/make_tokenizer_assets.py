"""Regenerate the small tokenizer vocabularies shipped in instgenie/assets/.

The tiny and full-size random-weight models need tokenizers, and nothing may come from the hub.
This script trains a byte-level BPE (CLIP layout: `</w>` end-of-word suffix) and a Unigram model
(T5 layout: `<pad>`=0, `</s>`=1, `<unk>`=2) on a generated corpus of editing prompts. Output is
deterministic for a given `tokenizers` version; the committed files are what the package uses.

    python scripts/make_tokenizer_assets.py
"""

from __future__ import annotations

import itertools
import json
import string
from pathlib import Path

from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers

ASSETS = Path(__file__).resolve().parents[1] / "instgenie" / "assets"

SUBJECTS = """woman man girl boy model person cat dog bird horse car house tree flower sky sea
mountain city street room table chair sofa lamp window door shirt dress jacket coat hat shoes
bag glasses necklace hair face hand background wall floor garden beach forest river lake""".split()
ADJECTIVES = """red blue green yellow black white pink purple orange brown gray golden silver
bright dark soft warm cold vintage modern elegant casual formal striped floral plain leather
denim silk cotton wool velvet shiny matte smooth rough tiny large small old new beautiful""".split()
STYLES = """photo photograph portrait painting illustration render sketch studio lighting
high quality detailed realistic cinematic professional natural sunlight evening morning night
close-up wide-angle fashion product catalog advertisement 4k 8k sharp focus bokeh""".split()
VERBS = """wearing holding standing sitting walking replace remove add change retouch paint
fill inpaint edit with without in on under near behind""".split()


def corpus() -> list[str]:
    lines = []
    for adj, subj, style in itertools.product(ADJECTIVES, SUBJECTS, STYLES[:12]):
        lines.append(f"a {adj} {subj}, {style}")
    for verb, adj, subj in itertools.product(VERBS, ADJECTIVES[:20], SUBJECTS):
        lines.append(f"{verb} the {adj} {subj} in the photo")
    lines += [line.capitalize() for line in lines[::7]]
    lines += [" ".join(STYLES), " ".join(SUBJECTS), " ".join(string.printable.split()[0])]
    return lines


def make_clip(lines: list[str], vocab_size: int = 2048) -> None:
    tok = Tokenizer(models.BPE(end_of_word_suffix="</w>", continuing_subword_prefix=""))
    tok.normalizer = normalizers.Sequence(
        [normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "), normalizers.Lowercase()]
    )
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(
                Regex(r"""'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""),
                behavior="removed",
                invert=True,
            ),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|startoftext|>", "<|endoftext|>"],
        initial_alphabet=alphabet,
        end_of_word_suffix="</w>",
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    vocab = dict(model["vocab"])
    # every single byte also as a word-final piece, so any text tokenizes without <unk>
    for ch in sorted(alphabet):
        vocab.setdefault(ch + "</w>", len(vocab))
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    (ASSETS / "clip_vocab.json").write_text(json.dumps(vocab, ensure_ascii=False, indent=0))
    (ASSETS / "clip_merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")


def make_t5(lines: list[str], vocab_size: int = 1024) -> None:
    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Metaspace(replacement="▁")]
    )
    trainer = trainers.UnigramTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "</s>", "<unk>"],
        unk_token="<unk>",
        initial_alphabet=list(string.printable.split()[0]),
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer=trainer)
    pieces = json.loads(tok.to_str())["model"]["vocab"]
    (ASSETS / "t5_vocab.json").write_text(json.dumps(pieces, ensure_ascii=False, indent=0))


if __name__ == "__main__":
    ASSETS.mkdir(parents=True, exist_ok=True)
    text = corpus()
    make_clip(text)
    make_t5(text)
    print(f"wrote tokenizer assets to {ASSETS}")

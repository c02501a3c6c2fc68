"""The quality of masked execution on the reference models: held-out edits run on the full path
and on the masked path (the template's cache filling the unmasked rows), with the same seed.

A case is an eval-split scene of the procedural dataset (its garment's colour x pattern was held
out of training) with one of its masks (m <= max_ratio) and its edit prompt (another held-out
colour x pattern). The template is the scene under its caption (or its scene prompt or none:
`capture_prompt`), captured once with TEMPLATE_SEED and no mask, as a served template is; the
edit runs with its own seed on both paths. Metrics compare the two outputs after paste-back
(what a client receives) on the whole image, inside the mask and on a band of BAND pixels
around the mask's edge, plus the raw (un-pasted) whole image; prompt adherence is the region
classifier's reading (dataset/classifier.py) of the template's garment pixels inside the mask,
against the edit's labels, for each path and for the edit target rendered exactly (the
classifier's ceiling).
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import re
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageFilter

from instgenie.dataset import classifier, masks
from instgenie.dataset.render import GARMENT, render
from instgenie.dataset.write import edited_of, entry, scene_of
from instgenie.engine.quality import psnr, region_psnr, ssim, ssim_map

#: dataset seed of the evaluation scenes (the training pool is seed 0, train split only)
EVAL_SEED = 7
TEMPLATE_SEED = 0
#: width of the band around the mask's edge, pixels (on each side of the edge)
BAND = 6


@dataclass(frozen=True)
class Case:
    id: str
    image: np.ndarray  # (S, S, 3) uint8
    mask: np.ndarray  # (S, S) bool, True = edit
    kind: str
    ratio: float
    garment: np.ndarray  # (S, S) bool: the template's garment pixels
    caption: str  # the template's prompt
    prompt: str  # the edit's
    want: dict  # the edit's labels (colour, pattern, garment)
    target: np.ndarray  # the edit rendered exactly (the classifier's ceiling)


def cases(count: int, size: int = 256, seed: int = EVAL_SEED, max_ratio: float = 0.3,
          split: str = "eval") -> list[Case]:  # fmt: skip
    """`count` cases, mask kinds in turn (garment, rect, brush), each mask's ratio <= max_ratio."""
    out: list[Case] = []
    for index in itertools.count():
        if len(out) == count:
            return out
        meta, image, made = entry(seed, index, size)
        kind = masks.KINDS[len(out) % len(masks.KINDS)]
        if meta["split"] != split or kind not in made or made[kind].mean() > max_ratio:
            continue
        _, labels = render(scene_of(meta), size)
        want = meta["edit"]["labels"]
        wanted = {k: want[k] for k in classifier.TARGETS}
        out.append(Case(meta["id"], image, made[kind], kind, float(made[kind].mean()),
                        labels == GARMENT, meta["caption"], meta["edit"]["prompt"], wanted,
                        render(edited_of(meta), size)[0]))  # fmt: skip
    return out


def output_name(model: str, tag: str = "") -> str:
    """A benchmark's file-name stem for `model` (FAMILY:SIZE or FAMILY:/a/directory) + tag."""
    return re.sub(r"[^A-Za-z0-9._]+", "-", model).strip("-") + tag


def experiment_setup(doc: str, default_model: str, variants: tuple[str, ...] = ()):  # noqa: ANN201
    """A quality experiment's (bench/quality_*.py) flags — --model, --cases, --steps, --device,
    --out, and --variants (a subset of `variants`, all by default) where it has some — parsed,
    its pipeline and the region classifier loaded: (args, pipe, classifier)."""
    import argparse
    from pathlib import Path

    from instgenie.engine.pipeline import EditPipeline

    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--model", default=default_model)
    p.add_argument("--cases", type=int, default=24)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tag", default="", help="suffix of the output file's name")
    if variants:
        p.add_argument("--variants", nargs="+", choices=variants, default=list(variants))
    args = p.parse_args()
    pipe = EditPipeline.load(args.model, device=args.device)
    return args, pipe, classifier.RegionClassifier.load(classifier.DEFAULT_WEIGHTS)


def write_experiment(out_dir, prefix: str, args, rows: list[dict], summary: dict,  # noqa: ANN001
                     seconds: float) -> None:  # fmt: skip
    """Write a quality experiment's record (bench/quality_*.py: `args` has model, steps, device)
    as OUT_DIR/PREFIX-<model>.json, with the commit, torch version and command; print the
    summary."""
    import json
    import subprocess
    import sys

    import torch

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()  # fmt: skip
    record = {"model": args.model, "steps": args.steps, "cases": len(rows), "summary": summary,
              "rows": rows, "device": args.device, "torch": torch.__version__, "commit": commit,
              "seconds": round(seconds, 1), "command": " ".join(sys.argv)}  # fmt: skip
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{prefix}-{output_name(args.model, args.tag)}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


def png(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, format="PNG")
    return buf.getvalue()


def band(mask: np.ndarray, width: int = BAND) -> np.ndarray:
    """Pixels within `width` of the mask's edge, on either side."""
    img = Image.fromarray(mask.astype(np.uint8) * 255)
    k = 2 * width + 1
    grown = np.asarray(img.filter(ImageFilter.MaxFilter(k))) > 127
    shrunk = np.asarray(img.filter(ImageFilter.MinFilter(k))) > 127
    return grown & ~shrunk


def compare(full: Image.Image, masked: Image.Image, case: Case) -> dict[str, float]:
    """Masked against full, both pasted back: SSIM and PSNR on the whole image, inside the
    mask, on the edge band; also the whole image's SSIM of the un-pasted outputs is the
    caller's (compare_raw)."""
    smap = ssim_map(full, masked)
    edge = band(case.mask)
    return {
        "ssim": round(ssim(full, masked), 5), "psnr": round(psnr(full, masked), 3),
        "ssim_mask": round(float(smap[case.mask].mean()), 5),
        "psnr_mask": round(region_psnr(full, masked, case.mask), 3),
        "ssim_band": round(float(smap[edge].mean()), 5),
        "psnr_band": round(region_psnr(full, masked, edge), 3),
    }  # fmt: skip


def adherence(clf: classifier.RegionClassifier, image: Image.Image | np.ndarray,
              case: Case) -> dict[str, bool]:  # fmt: skip
    """Whether the classifier reads the edit's colour and pattern (and both) in the template's
    garment pixels inside the mask."""
    pred = clf.predict(np.asarray(image), case.garment & case.mask)
    hit = {t: pred[t] == case.want[t] for t in ("colour", "pattern")}
    return {**hit, "both": hit["colour"] and hit["pattern"]}


def accuracy(hits: list[dict[str, bool]]) -> dict[str, float]:
    """Share of `hits` (adherence's dicts) read as asked: colour, pattern, both."""
    targets = ("colour", "pattern", "both")
    return {t: round(float(np.mean([h[t] for h in hits])), 4) for t in targets}


def vae_round_trip(vae, image: np.ndarray) -> np.ndarray:  # noqa: ANN001
    """`image` (S, S, 3) uint8 encoded by `vae` (its posterior mean) and decoded: what the
    model's VAE can render at best (the ceiling of any edit's colours), uint8."""
    import torch

    x = torch.from_numpy(image).permute(2, 0, 1)[None].to(vae.device, vae.dtype) / 127.5 - 1
    with torch.no_grad():
        rec = vae.decode(vae.encode(x).latent_dist.mode()).sample.float().clamp(-1, 1)
    return ((rec[0].permute(1, 2, 0) + 1) * 127.5).round().byte().cpu().numpy()


def unmasked_equal(out: Image.Image, case: Case) -> bool:
    """The output equals the input outside the mask (paste-back)."""
    return bool((np.asarray(out.convert("RGB"))[~case.mask] == case.image[~case.mask]).all())


@dataclass
class Outputs:
    """One case's images (pasted back unless named raw)."""

    full: Image.Image
    full_raw: Image.Image
    masked: dict[str, Image.Image]  # by cache variant
    masked_raw: dict[str, Image.Image]
    #: by variant with a load planner: the blocks its last step computed in full, of all blocks
    compute_all: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)


def edit_request(case: Case, steps: int, guidance: float | None, seed: int):  # noqa: ANN201
    """The case's edit as a full-path EditRequest (its image and mask; not pasted back)."""
    from instgenie.engine.request import EditRequest

    return EditRequest(uid=case.id, image=png(case.image),
                       mask=png(case.mask.astype(np.uint8) * 255), prompt=case.prompt, seed=seed,
                       num_inference_steps=steps, guidance_scale=guidance,
                       paste_back=False)  # fmt: skip


#: what a template is captured under (bench/quality*.py --capture-prompt; docs/decisions/0056)
CAPTURE_PROMPTS = ("caption", "scene", "empty")


def scene_prompt(case: Case) -> str:
    """The template's caption without its garment's colour and pattern ("a person in a pink
    checked dress on a beige wall" -> "a person in a dress on a beige wall"): what every edit of
    the template keeps."""
    garment = case.want["garment"]  # an edit recolours the template's garment: same kind
    out, n = re.subn(rf"^a person in an? .*?\b{re.escape(garment)}\b", f"a person in a {garment}",
                     case.caption)  # fmt: skip
    if n != 1:
        raise ValueError(f"case {case.id}: no garment {garment!r} in {case.caption!r}")
    return out


def capture_prompt(case: Case, kind: str) -> str:
    """The prompt `case`'s template is captured under: its caption, its scene, or empty."""
    if kind == "caption":
        return case.caption
    if kind == "scene":
        return scene_prompt(case)
    if kind == "empty":
        return ""
    raise ValueError(f"capture prompt {kind!r}: one of {', '.join(CAPTURE_PROMPTS)}")


def run_case(pipes: dict, case: Case, steps: int, guidance: float | None, seed: int,
             capture: str = "caption") -> Outputs:  # fmt: skip
    """Full path on the first pipe; masked path on each (one pipe per cache variant: they share
    the family, their stores differ). Each template is captured into its pipe's store first,
    under capture_prompt(case, capture)."""
    from dataclasses import replace

    from instgenie.engine.imageio import paste_back
    from instgenie.engine.templates import TemplateSpec

    image, mask = Image.fromarray(case.image), Image.fromarray(case.mask.astype(np.uint8) * 255)
    spec = TemplateSpec(image=png(case.image), prompt=capture_prompt(case, capture),
                        seed=TEMPLATE_SEED,
                        num_inference_steps=steps, guidance_scale=guidance)  # fmt: skip
    req = edit_request(case, steps, guidance, seed)
    first = next(iter(pipes.values()))
    full_raw = first.run([req])[0].image
    masked_raw, compute_all = {}, {}
    for name, pipe in pipes.items():
        key = pipe.build_template(spec)
        res = pipe.run([replace(req, image=None, template_id=key)])[0]
        if res.path != "masked":
            raise RuntimeError(f"case {case.id}: the edit ran {res.path} ({res.fallback_reason})")
        masked_raw[name] = res.image
        pipe.store.delete(key)
        pricer = pipe.cost_model
        if pricer is not None and pricer.last_plan is not None:
            chosen = len(pricer.last_plan.compute_all)
            compute_all[name] = (chosen, len(pipe.family.masked.blocks))
    pasted = {n: paste_back(im, image, mask) for n, im in masked_raw.items()}
    return Outputs(paste_back(full_raw, image, mask), full_raw, pasted, masked_raw, compute_all)


def score(outs: Outputs, case: Case, clf: classifier.RegionClassifier) -> dict:
    """One case's row: metrics of each masked variant against the full path, adherence of
    every path and of the exact target, paste-back's exactness."""
    row = {"id": case.id, "kind": case.kind, "ratio": round(case.ratio, 4),
           "prompt": case.prompt, "full": adherence(clf, outs.full, case),
           "target": adherence(clf, case.target, case),
           "unmasked_equal": unmasked_equal(outs.full, case)}  # fmt: skip
    for name, img in outs.masked.items():
        row[name] = {**compare(outs.full, img, case),
                     "ssim_raw": round(ssim(outs.full_raw, outs.masked_raw[name]), 5),
                     "adherence": adherence(clf, img, case),
                     "unmasked_equal": unmasked_equal(img, case)}  # fmt: skip
        if name in outs.compute_all:
            row[name]["compute_all_blocks"] = list(outs.compute_all[name])
    return row


def summary(rows: list[dict], variants: list[str]) -> dict:
    """Means of the metrics and accuracies over the rows."""

    def acc(get) -> dict:  # noqa: ANN001
        return {t: round(float(np.mean([get(r)[t] for r in rows])), 4)
                for t in ("colour", "pattern", "both")}  # fmt: skip

    out = {"cases": len(rows), "full": acc(lambda r: r["full"]),
           "target": acc(lambda r: r["target"]),
           "unmasked_equal": all(r["unmasked_equal"] for r in rows)}  # fmt: skip
    for v in variants:
        keys = [k for k in rows[0][v] if k.startswith(("ssim", "psnr"))]
        out[v] = {k: round(float(np.mean([r[v][k] for r in rows])), 5) for k in keys}
        out[v]["ssim_min"] = round(float(min(r[v]["ssim"] for r in rows)), 5)
        out[v]["adherence"] = acc(lambda r, v=v: r[v]["adherence"])
        out[v]["unmasked_equal"] = all(r[v]["unmasked_equal"] for r in rows)
    return out


def grid(case_list: list[Case], outs: list[Outputs], variant: str) -> Image.Image | None:
    """Rows of (template, mask, full, masked, |full - masked| x 4); None without rows."""
    if not outs:
        return None
    tiles = []
    for case, o in zip(case_list, outs, strict=True):
        full, masked = np.asarray(o.full), np.asarray(o.masked[variant])
        diff = np.clip(np.abs(full.astype(int) - masked.astype(int)) * 4, 0, 255).astype(np.uint8)
        m = np.repeat(case.mask[..., None].astype(np.uint8) * 255, 3, axis=2)
        tiles.append(np.concatenate([case.image, m, full, masked, diff], axis=1))
    return Image.fromarray(np.concatenate(tiles, axis=0))

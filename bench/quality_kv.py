"""Experiment (issue 28, item 4: "cache K/V of unmasked tokens per block instead of recomputing
their projections"): what a K/V cache would cost in quality, before building one.

Today a masked step recomputes, in every Flux block, the AdaLN norm and the key/value projections
of every image token from the cached block input (the template's output of the block before),
under the *edit's* conditioning `temb` (timestep, guidance and the pooled prompt embedding
modulate the norm). A K/V cache would read the template's keys and values instead: the same
inputs under the *template's* `temb`. That difference is the whole approximation (for UNet
families there is none: their self-attention norm is a plain LayerNorm, no conditioning).

This script measures it without a cache: during the template's capture run it records each
block's `temb` per step; during the masked edit the blocks' AdaLN norms return, for unmasked
image tokens, the norm under the template's `temb` (masked tokens and text tokens under the
edit's). The keys and values of unmasked tokens are then exactly what the template's run
computed, as a K/V cache would hold. Same cases, seeds and metrics as bench/quality.py; the full
path is the reference.

    python bench/quality_kv.py --model flux-fill:ref --out docs/benchmarks/data/quality
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from diffusers.models.transformers.transformer_flux import (
    FluxSingleTransformerBlock,
    FluxTransformerBlock,
)
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from instgenie.engine.imageio import paste_back  # noqa: E402
from instgenie.engine.templates import TemplateSpec  # noqa: E402
from instgenie.reference import evaluate  # noqa: E402


class TembSwap:
    """Per Flux block: records `temb` of every call while `mode == "record"`; while
    `mode == "swap"`, its AdaLN norm returns the template's-temb norm for unmasked image tokens
    (`self.keep`: bool (L,), True = masked: computed under the edit's temb)."""

    def __init__(self, backbone: torch.nn.Module) -> None:
        self.mode, self.keep = "off", None
        self.temb: dict[int, list[torch.Tensor]] = {}
        self.calls: dict[int, int] = {}
        self.swapped = 0  # norm calls that took the template's temb (a check that it acted)
        blocks = [m for m in backbone.modules()
                  if isinstance(m, (FluxTransformerBlock, FluxSingleTransformerBlock))]  # fmt: skip
        for i, block in enumerate(blocks):
            block.register_forward_pre_hook(self._pre(i), with_kwargs=True)
            norm = block.norm1 if isinstance(block, FluxTransformerBlock) else block.norm
            norm.forward = self._norm(i, norm.forward, isinstance(block, FluxTransformerBlock))

    def reset(self, mode: str, keep: torch.Tensor | None = None) -> None:
        self.mode, self.keep, self.calls = mode, keep, {}
        if mode == "record":
            self.temb = {}

    def _pre(self, i: int):
        def hook(module, args, kwargs):  # noqa: ANN001, ANN202
            if self.mode == "record":
                self.temb.setdefault(i, []).append(kwargs["temb"].detach().clone())
            self.calls[i] = self.calls.get(i, 0) + 1

        return hook

    def _norm(self, i: int, forward, dual: bool):  # noqa: ANN001, ANN202
        def patched(x: torch.Tensor, *args, emb: torch.Tensor | None = None, **kwargs):  # noqa: ANN002, ANN003, ANN202
            out = forward(x, *args, emb=emb, **kwargs)
            if self.mode != "swap":
                return out
            step = self.calls[i] - 1
            alt = forward(x, *args, emb=self.temb[i][step].to(emb.dtype), **kwargs)
            keep = self.keep.to(x.device)  # (L,) image tokens
            if not dual:  # the joint sequence: text tokens first, always the edit's
                tt = x.shape[1] - keep.numel()
                keep = torch.cat([keep.new_ones(tt), keep])
            mixed = torch.where(keep[None, :, None], out[0], alt[0])
            self.swapped += 1
            return (mixed, *out[1:])

        return patched


def main() -> int:
    args, pipe, clf = evaluate.experiment_setup(__doc__, "flux-fill:ref")
    swap = TembSwap(pipe.family.backbone)
    token_masks, last = pipe.family.token_masks, {}

    def recorded(mask: torch.Tensor) -> dict:
        last.update(token_masks(mask))
        return last.copy()

    pipe.family.token_masks = recorded  # this process's pipeline only
    rows, t0 = [], time.monotonic()
    for i, case in enumerate(evaluate.cases(args.cases)):
        req = evaluate.edit_request(case, args.steps, None, seed=1 + i)
        image, mask = Image.fromarray(case.image), Image.fromarray(case.mask.astype(np.uint8) * 255)
        swap.reset("off")
        full = paste_back(pipe.run([req])[0].image, image, mask)
        swap.reset("record")
        key = pipe.build_template(TemplateSpec(image=evaluate.png(case.image), prompt=case.caption,
                                               seed=evaluate.TEMPLATE_SEED,
                                               num_inference_steps=args.steps))  # fmt: skip
        row = {"id": case.id, "kind": case.kind, "ratio": round(case.ratio, 4),
               "prompt": case.prompt, "full": evaluate.adherence(clf, full, case)}  # fmt: skip
        for name in ("masked", "kv"):
            last.clear()
            swap.reset("off")
            if name == "kv":  # the token mask of this edit (one grid: Flux)
                pipe.family.token_masks(torch.from_numpy(case.mask).float()[None, None])
                (keep,) = last.values()
                swap.reset("swap", keep.bool())
            before = swap.swapped
            res = pipe.run([replace(req, image=None, template_id=key)])[0]
            if res.path != "masked":
                raise RuntimeError(f"case {case.id}: the edit ran {res.path}")
            if name == "kv" and swap.swapped == before:
                raise RuntimeError("the template's temb was never used")
            out = paste_back(res.image, image, mask)
            row[name] = {**evaluate.compare(full, out, case),
                         "adherence": evaluate.adherence(clf, out, case)}  # fmt: skip
        swap.reset("off")
        pipe.store.delete(key)
        rows.append(row)
        print(json.dumps({k: row[k] for k in ("id", "kind")}), flush=True)
    summary = {"full": {t: round(float(np.mean([r["full"][t] for r in rows])), 4)
                        for t in ("colour", "pattern", "both")}}  # fmt: skip
    for v in ("masked", "kv"):
        keys = [k for k in rows[0][v] if k.startswith(("ssim", "psnr"))]
        summary[v] = {k: round(float(np.mean([r[v][k] for r in rows])), 5) for k in keys}
        summary[v]["ssim_min"] = round(float(min(r[v]["ssim"] for r in rows)), 5)
        summary[v]["adherence"] = {t: round(float(np.mean([r[v]["adherence"][t] for r in rows])), 4)
                                   for t in ("colour", "pattern", "both")}  # fmt: skip
    evaluate.write_experiment(args.out, "kv", args, rows, summary, time.monotonic() - t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())

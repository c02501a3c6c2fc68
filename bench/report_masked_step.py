"""Render bench_masked_step.py JSON results as markdown tables (docs/benchmarks/)."""

from __future__ import annotations

import json
import sys


def render(path: str) -> str:
    d = json.load(open(path))
    env = d["env"]
    out = [
        f"### {d['model']} @ {d['size']}², {d['dtype'].removeprefix('torch.')}",
        "",
        f"{env['device']}, torch {env['torch']}, diffusers {env['diffusers']}, "
        f"triton {env.get('triton', '-')}; median of timed steps after warm-up (CUDA events).",
        "",
        "| batch | mask ratio | token ratio | FLOPs masked/full | ms full | ms masked | speedup "
        "| ms non-transformer | GPU busy masked/full |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    graphs = [r for r in d["steps"] if "ms_masked_graph" in r]
    for r in d["steps"]:
        busy = (
            f"{r['gpu_busy_masked']:.2f} / {r['gpu_busy_full']:.2f}"
            if "gpu_busy_masked" in r
            else ""
        )
        out.append(
            f"| {r['batch']} | {r['mask_ratio']} | {r['token_ratio']:.3f} | {r['flop_ratio']:.3f} "
            f"| {r['ms_full']:.1f} | {r['ms_masked']:.1f} | **{r['speedup']:.2f}×** "
            f"| {r['ms_non_transformer']:.1f} | {busy} |"
        )
    if graphs:
        stock = all("ms_full_stock" in r for r in graphs)
        out += [
            "",
            "With CUDA graphs (INSTGENIE_CUDA_GRAPHS=all): speedup of the graphed masked step "
            "against the eager full step and against the graphed full step"
            + (
                "; *stock* = the full step as stock diffusers runs it (eager, torch's "
                "GroupNorm/SiLU, GEGLU and conv bias: INSTGENIE_FUSED_GROUPNORM=off, "
                "INSTGENIE_FUSED_GEGLU=off, INSTGENIE_FUSED_CONV_BIAS=off)."
                if stock
                else " (the eager full step is stock diffusers execution)."
            ),
            "",
            "| batch | mask ratio | ms full eager | ms full graph | ms masked eager "
            "| ms masked graph | vs eager full | vs graphed full |"
            + (" ms full stock | vs stock |" if stock else ""),
            "|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if stock else ""),
        ]
        for r in graphs:
            out.append(
                f"| {r['batch']} | {r['mask_ratio']} | {r['ms_full']:.1f} "
                f"| {r['ms_full_graph']:.1f} | {r['ms_masked']:.1f} | {r['ms_masked_graph']:.1f} "
                f"| **{r['speedup_graph_vs_eager']:.2f}×** "
                f"| **{r['speedup_graph_vs_graph']:.2f}×** |"
                + (
                    f" {r['ms_full_stock']:.1f} | **{r['speedup_graph_vs_stock']:.2f}×** |"
                    if stock
                    else ""
                )
            )
    img = d.get("image")
    if img:
        out += [
            "",
            f"Image level (1 request, pre-process + {img['steps']} steps + post-process, "
            f"m = {img['mask_ratio']}): full {img['s_full']:.2f} s, masked {img['s_masked']:.2f} s "
            f"(**{img['speedup']:.2f}×**); template capture {img['capture_s']:.2f} s, "
            f"cache {img['cache_bytes'] / 1e9:.1f} GB.",
        ]
        if "s_masked_graph" in img:
            out += ["", _image_stages(img)]
    return "\n".join(out)


def _image_stages(img: dict) -> str:
    """Seconds per stage of the image-level runs, eager and with CUDA graphs."""
    rows = [
        "| run | pre-process | steps | VAE decode | encode | total |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    labels = {"full": "full, eager", "full_graph": "full, graphs", "masked": "masked, eager",
              "masked_graph": "masked, graphs", "full_stock": "full, stock diffusers"}  # fmt: skip
    for name, label in labels.items():
        if f"stages_{name}" not in img:
            continue
        st = img[f"stages_{name}"]
        rows.append(
            f"| {label} | {st['preprocess']:.3f} | {st['steps']:.3f} | {st['vae_decode']:.3f} "
            f"| {st['encode']:.3f} | {img[f's_{name}']:.3f} |"
        )
    rows.append("")
    rows.append(
        f"Image-level speedup with graphs: **{img['speedup_graph_vs_eager']:.2f}×** against the "
        f"eager full path, **{img['speedup_graph_vs_graph']:.2f}×** against the graphed one"
        + (
            f", **{img['speedup_graph_vs_stock']:.2f}×** against stock diffusers."
            if "speedup_graph_vs_stock" in img
            else "."
        )
    )
    return "\n".join(rows)


if __name__ == "__main__":
    print("\n\n".join(render(p) for p in sys.argv[1:]))

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
    img = d.get("image")
    if img:
        out += [
            "",
            f"Image level (1 request, pre-process + {img['steps']} steps + post-process, "
            f"m = {img['mask_ratio']}): full {img['s_full']:.2f} s, masked {img['s_masked']:.2f} s "
            f"(**{img['speedup']:.2f}×**); template capture {img['capture_s']:.2f} s, "
            f"cache {img['cache_bytes'] / 1e9:.1f} GB.",
        ]
    return "\n".join(out)


if __name__ == "__main__":
    print("\n\n".join(render(p) for p in sys.argv[1:]))

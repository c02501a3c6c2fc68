"""Benchmark varlen masked-query attention: the Triton kernel against torch SDPA baselines.

Not a test. On CUDA each batch composition is timed with ``triton.testing.do_bench`` (median, in
ms, after its warm-up; the L2 cache is flushed before every call) in fp16 and bf16:

* ``triton``: ``varlen_attention`` on packed q (total_q, H, D).
* ``triton_qidx``: the same kernel reading query rows through ``q_index`` from the unmasked
  (B * L, H, D) activations (no gathered copy of q).
* ``sdpa_loop``: one ``scaled_dot_product_attention`` call per request on (1, H, n_q, D) x
  (1, H, n_k, D) views, each output copied into the packed result.
* ``sdpa_padded``: queries padded to the largest n_q, one batched SDPA call; the padding and
  unpadding copies are inside the timed region (keys need no padding: every request of a
  composition has the same number of keys).
* ``flash_varlen``: ``flash_attn.flash_attn_varlen_func``, only if ``import flash_attn`` works.

Every variant is first checked against the fp32 torch reference (``_reference``) on fresh random
inputs. Lengths are in tokens; a composition's fractions are the masked share of each request's
maskable (image) tokens; keys are all L tokens (for Flux: 4096 image + 512 text).

    python bench/bench_varlen_attention.py [--out PATH] [--cudagraph] [--sweep [--pick]]
        [--precompile N]
    TRITON_INTERPRET=1 python bench/bench_varlen_attention.py --quick   # CPU smoke run

``--cudagraph`` times CUDA-graph replays (``do_bench_cudagraph``), which removes host launch
overhead; the eager default includes it, as eager serving would. On an H200 with torch 2.11
the default SDPA dispatch was cuDNN attention; each row records the dispatched aten op.
``--sweep`` first times the candidate configurations in ``SWEEP`` (tiles, TMA descriptors, warp
specialization; to revisit ``_pick_config``) on the mixed4/full2 batches, each checked against
the reference; ``--pick`` then times the table with each head dim's best candidate (lowest
geometric-mean time) instead of ``_pick_config``'s choice. ``--precompile N`` compiles every
kernel specialization the run needs in N processes first (Triton's disk cache), which cuts the
wall time of a sweep several-fold. Prints a markdown table and writes JSON to ``--out`` (default
``$OUT/varlen_attention.json`` when OUT is set, else ``out/varlen_attention.json`` under the
repository root).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, astuple
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.testing  # noqa: E402

from bench.varlen_problems import Composition, Problem, compositions, make_problem  # noqa: E402
from triton_kernels import varlen_attention as va  # noqa: E402

try:
    from flash_attn import flash_attn_varlen_func
except Exception:  # ImportError, or a build that does not match this torch/CUDA
    flash_attn_varlen_func = None

TOLS = {torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2), torch.float32: (1e-4, 1e-4)}


def run_triton(p: Problem) -> torch.Tensor:
    c = p.comp
    return va.varlen_attention(p.q, p.k, p.v, p.cu_q, p.cu_k, max(c.n_q), c.seq, p.scale)


def run_triton_qidx(p: Problem) -> torch.Tensor:
    c = p.comp
    return va.varlen_attention(
        p.src, p.k, p.v, p.cu_q, p.cu_k, max(c.n_q), c.seq, p.scale, q_index=p.q_index
    )


def run_sdpa_loop(p: Problem) -> torch.Tensor:
    out = torch.empty_like(p.q)
    for qs, qe, ks, ke in p.spans:
        o = F.scaled_dot_product_attention(
            p.q[qs:qe].transpose(0, 1)[None],
            p.k[ks:ke].transpose(0, 1)[None],
            p.v[ks:ke].transpose(0, 1)[None],
            scale=p.scale,
        )
        out[qs:qe] = o[0].transpose(0, 1)
    return out


def run_sdpa_padded(p: Problem) -> torch.Tensor:
    c = p.comp
    n_req = len(c.fracs)
    qp = p.q.new_zeros(n_req, max(c.n_q), c.heads, c.head_dim)
    qp[p.pad_batch, p.pad_pos] = p.q
    kb = p.k.view(n_req, c.seq, c.heads, c.head_dim).transpose(1, 2)
    vb = p.v.view(n_req, c.seq, c.heads, c.head_dim).transpose(1, 2)
    o = F.scaled_dot_product_attention(qp.transpose(1, 2), kb, vb, scale=p.scale)
    return o.transpose(1, 2)[p.pad_batch, p.pad_pos]


def run_flash_varlen(p: Problem) -> torch.Tensor:
    c = p.comp
    return flash_attn_varlen_func(
        p.q, p.k, p.v, p.cu_q, p.cu_k, max(c.n_q), c.seq, softmax_scale=p.scale
    )


VARIANTS: dict[str, Callable[[Problem], torch.Tensor]] = {
    "triton": run_triton,
    "triton_qidx": run_triton_qidx,
    "sdpa_loop": run_sdpa_loop,
    "sdpa_padded": run_sdpa_padded,
}
if flash_attn_varlen_func is not None:
    VARIANTS["flash_varlen"] = run_flash_varlen


def time_ms(fn: Callable[[], object], device: torch.device, cudagraph: bool, quick: bool) -> float:
    """Median milliseconds of one call."""
    if device.type == "cuda":
        if cudagraph:
            return float(triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median"))
        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    fn()  # CPU (interpreter) smoke path: host clock, few repeats
    samples = []
    for _ in range(2 if quick else 5):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def sdpa_ops(prob: Problem) -> list[str]:
    """The aten SDPA backend ops (flash / cudnn / efficient / math) one padded call dispatches."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run_sdpa_padded(prob)
    names = {e.key for e in prof.key_averages()}
    return sorted(n for n in names if n.startswith("aten::_scaled_dot_product"))


def check(name: str, got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOLS[dtype]
    try:
        torch.testing.assert_close(got, ref, atol=atol, rtol=rtol)
    except AssertionError as err:
        raise AssertionError(f"{name} disagrees with the reference:\n{err}") from None


def attention_flops(comp: Composition) -> float:
    # Two matrix products of n_q x n_k x D per request and head, 2 flops per multiply-add.
    pairs = sum(a * b for a, b in zip(comp.n_q, comp.n_k, strict=True))
    return 4.0 * pairs * comp.heads * comp.head_dim


@contextlib.contextmanager
def forced_config(cfg: va._Config) -> Iterator[None]:
    """Make the wrapper launch with ``cfg`` (benchmark-only monkeypatch of the heuristic)."""
    saved = va._pick_config
    va._pick_config = lambda block_d, dtype, gluon=True: cfg if gluon else saved(block_d, dtype)
    try:
        yield
    finally:
        va._pick_config = saved


# Candidate configurations per padded head dim (va._Config). The first of each list is the
# pointer-load configuration that was the default before the TMA / warp-specialized variants.
_C = va._Config
SWEEP = {
    64: [_C(64, 64, 4, 3)],
    128: [_C(128, 64, 8, 3),
          _C(128, 128, 4, 2, kv_desc=2, warp_spec=True, linear_grid=True),
          _C(128, 128, 4, 2, kv_desc=2, warp_spec=True, linear_grid=True, even_n=False),
          _C(128, 64, 4, 2, kv_desc=2, warp_spec=True, linear_grid=True),
          _C(128, 128, 4, 2, linear_grid=True, gluon=True)],
    # --quick (interpreter) smoke coverage of the sweep path only.
    16: [_C(16, 16, 1, 1), _C(32, 16, 1, 1), _C(16, 16, 1, 1, 2, True, linear_grid=True)],
    32: [_C(16, 32, 1, 1), _C(16, 16, 1, 1, 1)],
}  # fmt: skip
# Measured on an H200 (triton 3.6); geometric-mean ms over flux mixed4/full2 x fp16/bf16 (runs
# 1 / 2 / 3). In the list above: pointer 128x64/8/3 0.939 / 0.936 / 0.941; warp-specialized
# 128x128/4/2 with the key mask in every iteration 0.917 / 0.926 / 0.944, without it (EVEN_N)
# 0.864 (run 3); warp-specialized 128x64/4/2 0.976 / 0.970 (masked), 0.929 (EVEN_N).
# Dropped: 128x128/8/3 0.950; TMA host descriptors 128x64/8/3 0.990, 128x128/8/2 1.048;
# in-kernel descriptors 128x64/8/3 1.009, 128x128/8/2 1.074; loop-carried pointers 128x64/8/3
# 0.969; warp-specialized 128x128/4/2 on the 3-D grid 0.929 (masked); warp-specialized with
# num_stages 3 or 4: wrong results (Triton 3.6 compiler). D=64 (sdxl, 4 problems, pointer
# 64x64/4/3 = 0.0860 / 0.0875 / 0.0880): 64x64/4/4 0.0871, in-kernel descriptors 64x64/4/3
# 0.0921, 128x64/8/3 0.0931, loop-carried pointers 0.0923, warp-specialized 128x128/4/2 0.1194,
# 128x64/4/2 0.1288. Lazy rescaling (skip acc *= alpha unless a row max grows by > 8 in log2
# units, as in FlashAttention-4) was not timed: its tile-uniform `if` makes Triton 3.6 wait on
# every wgmma (one HGMMA in flight), which costs more than the multiply it saves.


def _sweep_problems(comps: list[Composition]) -> list[Composition]:
    return [c for c in comps if c.mix in ("mixed4", "full2")]


def _forced(picked: dict[int, va._Config]) -> contextlib.AbstractContextManager:
    """Force ``picked[block_d]`` for those head dims, the heuristic elsewhere."""
    saved = va._pick_config

    @contextlib.contextmanager
    def ctx() -> Iterator[None]:
        va._pick_config = lambda block_d, dtype, gluon=True: (
            (picked.get(block_d) if gluon else None) or saved(block_d, dtype, gluon)
        )
        try:
            yield
        finally:
            va._pick_config = saved

    return ctx()


def _warm_one(job: tuple) -> str:
    """Subprocess: compile (and run once) one kernel specialization into Triton's disk cache."""
    comp, dtype_name, tile, fn_name = job
    dtype = getattr(torch, dtype_name)
    prob = make_problem(comp, dtype, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    fn = VARIANTS[fn_name]
    try:
        if tile is None:
            fn(prob)
        else:
            with forced_config(va._Config(*tile)):
                fn(prob)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return "ok"
    except Exception as err:  # reported by the timing pass too
        return f"{type(err).__name__}: {str(err)[:200]}"


def precompile(jobs: list[tuple], workers: int) -> None:
    """Populate Triton's on-disk kernel cache in parallel processes (compiles are CPU-bound)."""
    import concurrent.futures
    import multiprocessing

    t0 = time.perf_counter()
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
        results = list(pool.map(_warm_one, jobs))
    bad = [(j[0].name, j[1], j[2], r) for j, r in zip(jobs, results, strict=True) if r != "ok"]
    print(f"precompiled {len(jobs)} specializations in {time.perf_counter() - t0:.1f} s "
          f"with {workers} processes; {len(bad)} failed: {bad}", flush=True)  # fmt: skip


def sweep(comps: list[Composition], dtypes: list[torch.dtype], device: torch.device, args):
    rows = []
    for comp in _sweep_problems(comps):
        for dtype in dtypes:
            prob = make_problem(comp, dtype, device)
            ref = va._reference(prob.q, prob.k, prob.v, prob.cu_q, prob.cu_k, prob.scale)
            for cfg in SWEEP.get(comp.head_dim, []):
                tile = astuple(cfg)
                with forced_config(cfg):
                    try:
                        check(f"triton {tile}", run_triton(prob), ref, dtype)
                        ms = time_ms(lambda p=prob: run_triton(p), device, args.cudagraph, False)
                    except Exception as err:  # e.g. out of shared memory for this tile
                        print(f"sweep {comp.name} {dtype} {tile}: {type(err).__name__}: {err}")
                        continue
                rows.append(
                    {"composition": comp.name, "dtype": str(dtype).removeprefix("torch."),
                     "head_dim": comp.head_dim, "tile": list(tile), "config": asdict(cfg),
                     "ms": ms, "tflops": attention_flops(comp) / ms / 1e9}
                )  # fmt: skip
                print(f"sweep {comp.name:32s} {rows[-1]['dtype']:8s} {tile}: {ms:.4f} ms")
            del prob, ref
    return rows


def pick_best(rows: list[dict]) -> dict[int, va._Config]:
    """Per head dim: the tile with the lowest geometric-mean time over every swept problem."""
    best = {}
    for d in sorted({r["head_dim"] for r in rows}):
        problems = {(r["composition"], r["dtype"]) for r in rows if r["head_dim"] == d}
        scores = {}
        for tile in {tuple(r["tile"]) for r in rows if r["head_dim"] == d}:
            ms = [r["ms"] for r in rows if r["head_dim"] == d and tuple(r["tile"]) == tile]
            if len(ms) == len(problems):  # ran (and passed the check) everywhere
                scores[tile] = statistics.geometric_mean(ms)
        if scores:
            tile = min(scores, key=scores.get)
            best[max(16, triton.next_power_of_2(d))] = va._Config(*tile)
            ranked = sorted(scores.items(), key=lambda kv: kv[1])
            print(f"D={d}: geomean ms by tile: " + ", ".join(f"{t}: {v:.4f}" for t, v in ranked))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shapes; also runs on CPU")
    parser.add_argument("--out", type=Path, default=None, help="JSON output path")
    parser.add_argument("--cudagraph", action="store_true", help="time CUDA-graph replays")
    parser.add_argument("--sweep", action="store_true", help="also time kernel tile configs")
    parser.add_argument(
        "--pick", action="store_true", help="with --sweep: time the table with each D's best tile"
    )
    parser.add_argument(
        "--precompile", type=int, default=0, metavar="N", help="compile in N processes first"
    )
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not va._interpreting():
        sys.exit("no CUDA device: run with TRITON_INTERPRET=1 and --quick for a CPU smoke run")
    if device.type != "cuda" and not args.quick:
        sys.exit("full shapes need a GPU; use --quick under TRITON_INTERPRET=1 on CPU")
    out_path = args.out
    if out_path is None:
        base = Path(os.environ["OUT"]) if os.environ.get("OUT") else REPO / "out"
        out_path = base / "varlen_attention.json"

    dtypes = [torch.float16, torch.bfloat16]
    comps = compositions(args.quick)
    t_start = time.perf_counter()
    dnames = [str(d).removeprefix("torch.") for d in dtypes]
    if args.sweep and args.precompile and device.type == "cuda":
        precompile(
            [(c, dn, astuple(cfg), "triton") for c in _sweep_problems(comps) for dn in dnames
             for cfg in SWEEP.get(c.head_dim, [])],
            args.precompile,
        )  # fmt: skip
    sweep_rows = sweep(comps, dtypes, device, args) if args.sweep else []
    picked = pick_best(sweep_rows) if args.pick else {}
    if args.precompile and device.type == "cuda":  # the worker processes do not see `picked`
        tiles = {d: astuple(c) for d, c in picked.items()}
        precompile(
            [(c, dn, tiles.get(max(16, triton.next_power_of_2(c.head_dim))), v)
             for c in comps for dn in dnames for v in ("triton", "triton_qidx")],
            args.precompile,
        )  # fmt: skip
    with _forced(picked):
        rows = table(comps, dtypes, device, args)

    result = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "commit": os.environ.get("GIT_COMMIT"),
        "flash_attn": None if flash_attn_varlen_func is None else "available",
        "timing": ("do_bench_cudagraph" if args.cudagraph else "do_bench")
        if device.type == "cuda"
        else "perf_counter (CPU interpreter smoke run; not a performance number)",
        "quick": args.quick,
        "seconds": time.perf_counter() - t_start,
        "picked": {str(d): asdict(c) for d, c in picked.items()},
        "rows": rows,
        "sweep": sweep_rows,
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=1))
    report(rows, result, out_path)


def table(comps: list[Composition], dtypes: list[torch.dtype], device: torch.device, args):
    """Check every variant against the reference, then time it, for every composition."""
    rows = []
    for comp in comps:
        for dtype in dtypes:
            seed = int.from_bytes(os.urandom(4), "little")
            torch.manual_seed(seed)
            prob = make_problem(comp, dtype, device)
            ref = va._reference(prob.q, prob.k, prob.v, prob.cu_q, prob.cu_k, prob.scale)
            row: dict = {
                "composition": comp.name, "model": comp.model, "heads": comp.heads,
                "head_dim": comp.head_dim, "seq": comp.seq, "mix": comp.mix,
                "fracs": list(comp.fracs), "n_q": comp.n_q, "n_k": comp.n_k,
                "dtype": str(dtype).removeprefix("torch."),
                "config": asdict(va._pick_config(max(16, triton.next_power_of_2(comp.head_dim)),
                                                 dtype)),
                "gflop": attention_flops(comp) / 1e9, "seed": seed,
            }  # fmt: skip
            row["sdpa_ops"] = sdpa_ops(prob)
            for name, fn in VARIANTS.items():
                check(name, fn(prob), ref, dtype)
                row[f"{name}_ms"] = time_ms(
                    lambda f=fn, p=prob: f(p), device, args.cudagraph, args.quick
                )
            del ref, prob
            best_torch = min(row["sdpa_loop_ms"], row["sdpa_padded_ms"])
            row["speedup_vs_best_sdpa"] = best_torch / row["triton_ms"]
            row["triton_tflops"] = row["gflop"] / row["triton_ms"]  # GFLOP / ms = TFLOP/s
            rows.append(row)
            print(
                f"{comp.name:32s} {row['dtype']:8s} triton {row['triton_ms']:.4f} ms, "
                f"best sdpa {best_torch:.4f} ms, x{row['speedup_vs_best_sdpa']:.2f}",
                flush=True,
            )
    return rows


def report(rows: list[dict], result: dict, out_path: Path) -> None:
    names = list(VARIANTS)
    print(f"\n{result['device']}, torch {torch.__version__}, triton {triton.__version__}, "
          f"{result['timing']}; ms (median)\n")  # fmt: skip
    print("| composition | dtype | " + " | ".join(names) + " | TFLOP/s | speedup |")
    print("|---|---|" + "---:|" * (len(names) + 2))
    for r in rows:
        cells = " | ".join(f"{r[f'{n}_ms']:.4f}" for n in names)
        print(
            f"| {r['composition']} | {r['dtype']} | {cells} | {r['triton_tflops']:.1f} "
            f"| {r['speedup_vs_best_sdpa']:.2f}x |"
        )
    ops = sorted({op for r in rows for op in r["sdpa_ops"]})
    print(f"\nspeedup = min(sdpa_loop, sdpa_padded) / triton; SDPA dispatched to {ops}")
    print(f"JSON: {out_path}")


if __name__ == "__main__":
    main()

"""Pricing a denoising step's blocks: the one code path that both the worker's per-step planner
(engine/step_pricing.py) and the router's estimate (estimate.py) call.

`step_costs(spec, pixels, works)` gives, for a batch of one working size and every hooked block
(execution order, spec.blocks), the latency of computing the batch's masked tokens (the "cached"
fit of the block's class at the batch's FLOPs), of computing every token ("full" fit), and of
loading the rows of the requests whose cache is copied host -> device for every step (the load
fit of the tier they are read from at their bytes, one copy per request: "dram", or "disk" for a
cache streamed from the disk tier where the profile fitted it, else "dram"). The planner
(planner.plan_step, the paper's Algorithm 1) turns them into the blocks that compute all
tokens. Without fitted compute (no profile) prices are nominal FLOPs (`NOMINAL_FLOPS_PER_MS`;
relative prices only).

FLOPs (paper Table 1, keys/values over all tokens): 2 FLOPs per multiply-add, matmuls and
attention only (what torch.utils.flop_counter counts), so predictions and counted FLOPs agree.
Pure Python: no torch, no diffusers.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from instgenie.scheduler import buckets
from instgenie.scheduler.fits import fit_ms
from instgenie.scheduler.planner import BlockCosts
from instgenie.scheduler.spec import BlockSpec, CostSpec, block_class

#: bytes per element of the cache dtypes (torch.<name>.itemsize), float8 variants excluded
ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}
#: FLOPs per millisecond of the nominal device that prices batches without a profile
#: (100 TFLOP/s); only ratios of such prices are used
NOMINAL_FLOPS_PER_MS = 1e11
#: CostSpecs whose block kinds are remembered (workers, restarted ones included)
_LAYOUTS_MAX = 64


#: BlockSpec kinds of sparse conv blocks (engine/masked/conv_blocks.py)
CONV_KINDS = ("resnet", "down", "up")
#: sparse convs: tokens of the active tiles per masked token (partly covered tiles at a mask's
#: edge; measured 1.2-1.6 on blob masks of ratio 0.05-0.35 with 8x8 tiles), and the tile side
TILE_WASTE = 1.4


def conv_tile(L: int) -> int:
    """Tile side of a conv block's grid of L tokens (engine/masked/tiles.py tile_size, for a
    square grid)."""
    return 8 if L >= 32 * 32 else 4


def conv_row_macs(d: BlockSpec, L: int, n: int) -> int:
    """Multiply-adds of a conv block's row computing n of its L output tokens (n = L: the
    stock forward on the whole map; else tiles covering the n tokens plus their halo, or the
    whole map where that is no dearer: the executor computes whole maps where a step's tiles
    would have as many convolution outputs, conv_blocks._maps_pay, a close rule)."""
    C, Ci = d.channels, d.in_channels

    def macs(inner: int, outer: int) -> int:
        if d.kind == "resnet":
            return 9 * outer * Ci * C + 9 * inner * C * C + (inner * Ci * C if Ci != C else 0)
        return 9 * inner * Ci * C  # samplers

    full = macs(L, L)  # every position once: zero padding, no halo
    if n >= L:
        return full
    t = conv_tile(L)
    inner = min(L, round(TILE_WASTE * n))  # tile tokens
    outer = round(inner * ((t + 2) / t) ** 2)  # resnet conv1: the tiles plus a 1-wide halo
    return min(full, macs(inner, outer))


#: block kinds whose keys and values a K/V cache may hold (engine/masked/kv_layout.py)
KV_KINDS = ("flux_dual", "flux_single")


def row_macs(d: BlockSpec, L: int, n: int, text_len: int) -> int:
    """Multiply-adds of one batch row computing n of its L image tokens (n = L: full); a K/V
    block (d.kv) reads its unmasked tokens' keys and values, projecting them for n."""
    C = d.channels
    if d.kind in CONV_KINDS:
        return conv_row_macs(d, L, n)
    if d.kind == "unet":
        macs = 2 * n * C * C + 2 * L * C * C + 2 * n * L * C + n * d.ff_macs
        if d.context_dim:
            macs += 2 * n * C * C + 2 * text_len * d.context_dim * C + 2 * n * text_len * C
        return macs
    tt = text_len
    kv_tokens = n if d.kv else L  # image tokens projected to keys and values
    if d.kind == "flux_dual":
        return (
            2 * 6 * C * C  # AdaLN modulation of both streams
            + 4 * tt * C * C + tt * d.ff_macs  # text projections and feed-forward
            + 2 * n * C * C + 2 * kv_tokens * C * C  # image q/out on n tokens, k/v
            + n * d.ff_macs
            + 2 * (tt + n) * (tt + L) * C  # joint attention
        )  # fmt: skip
    per_query = C * C + C * d.mlp + (C + d.mlp) * C
    return (3 * C * C + (tt + n) * per_query + 2 * (tt + kv_tokens) * C * C
            + 2 * (tt + n) * (tt + L) * C)  # fmt: skip


def batch_flops(d: BlockSpec, L: int, masked_per_row: list[int], text_len: int) -> int:
    """FLOPs of one block for a batch whose row r computes masked_per_row[r] tokens."""
    return 2 * sum(row_macs(d, L, n, text_len) for n in masked_per_row)


def cached_bytes(L: int, C: int, rows: int, cache_dtype: str, slabs: int = 1) -> int:
    """Bytes of `rows` cached block outputs as stored (whole rows: every token of each row);
    fp8 adds one float32 scale per token; `slabs` = 2: a K/V block's keys and values."""
    if cache_dtype.startswith("float8"):
        return slabs * rows * L * (C + 4)
    return slabs * rows * L * C * ITEMSIZE[cache_dtype]


@dataclass(frozen=True, slots=True)
class RequestWork:
    """One request of a step's batch, as pricing sees it."""

    rows: int  # batch rows: 2 with classifier-free guidance, else 1
    #: (token stride in pixels, masked tokens it computes on that grid), one per stride of the
    #: spec's blocks, sorted; None: the full path (no cache read: every token)
    tokens: tuple[tuple[int, int], ...] | None = None
    #: its cached rows are copied host -> device for every step (one copy per request, priced
    #: with the load fit of `load_tier`); False for a cache on the device or read through a step
    #: window
    loads: bool = False
    #: the host tier its copies are read from: "dram", or "disk" (priced with the profile's
    #: "disk" load fit where it has one, else the "dram" fit)
    load_tier: str = "dram"


@dataclass(frozen=True)
class _Layout:
    """A spec's blocks grouped into kinds: blocks of one class and stride cost the same, so each
    kind is priced once (SDXL: 70 blocks, 2 kinds; Flux: 57 blocks, 2 kinds)."""

    kinds: tuple[tuple[BlockSpec, int], ...]  # (the kind's block with block_id 0, stride)
    seq: tuple[int, ...]  # kind of each block, execution order
    strides: tuple[int, ...]  # token strides of the blocks, ascending


_layouts: dict[int, tuple[CostSpec, _Layout]] = {}


def layout(spec: CostSpec) -> _Layout:
    """The kinds of `spec`'s blocks, remembered per spec object."""
    hit = _layouts.get(id(spec))
    if hit is not None and hit[0] is spec:
        return hit[1]
    kinds: dict[tuple[BlockSpec, int], int] = {}
    seq = tuple(
        kinds.setdefault((dataclasses.replace(b, block_id=0), b.stride), len(kinds))
        for b in sorted(spec.blocks, key=lambda b: b.block_id)
    )
    lay = _Layout(tuple(kinds), seq, tuple(sorted({b.stride for b in spec.blocks})))
    if len(_layouts) >= _LAYOUTS_MAX:
        _layouts.clear()
    _layouts[id(spec)] = (spec, lay)
    return lay


def step_costs(spec: CostSpec, pixels: int, works: Sequence[RequestWork]) -> BlockCosts:
    """Per block (execution order) the costs of one step of `works`, a batch of one working size
    of `pixels` (width * height), priced with `spec`'s fits. A block of stride s has
    max(1, pixels // s²) tokens a row. With no request reading a cache, the masked compute is
    the full compute (there is nothing to read)."""
    lay = layout(spec)
    t = spec.text_len
    toks = [None if w.tokens is None else dict(w.tokens) for w in works]
    reads = any(tk is not None for tk in toks)
    rows = sum(w.rows for w in works)
    dram = spec.load.get("dram")
    fits = [spec.load.get(w.load_tier, dram) if w.loads else None for w in works]
    grids = {s: max(1, pixels // (s * s)) for s in lay.strides}  # stride -> tokens a row
    per_row = {  # stride -> masked tokens of each batch row
        s: [L if tk is None else tk[s] for w, tk in zip(works, toks, strict=True)
            for _ in range(w.rows)]
        for s, L in grids.items()
    }  # fmt: skip
    bucket = step_bucket(spec, works, grids, per_row) if reads else None
    if bucket is not None:
        per_row = padded(per_row, bucket, grids)
    per_kind = []
    for d, stride in lay.kinds:
        L = grids[stride]
        counts = Counter(per_row[stride])  # masked tokens per row -> rows
        load = 0.0
        for w, fit in zip(works, fits, strict=True):
            if w.loads:  # one copy per request, each priced by its tier's fit
                nbytes = cached_bytes(L, d.channels, w.rows, spec.cache_dtype, 1 + d.kv)
                load += fit_ms(fit, nbytes)
        # = batch_flops(d, L, rows' masked tokens, t): a sum of per-row terms
        full = _compute_ms(spec, d, "full", 2 * rows * row_macs(d, L, L, t))
        cached = full
        # a bucketed step's conv blocks compute whole maps inside its graph (the executor's
        # rule: engine/masked/executor.py _run_bucketed, conv_blocks._map_forward), whatever the
        # plan says for them; the other steps' compute their tiles
        if reads and not (bucket is not None and d.kind in CONV_KINDS):
            flops = 2 * sum(k * row_macs(d, L, n, t) for n, k in counts.items())
            cached = _compute_ms(spec, d, "cached", flops)
            if d.kind in CONV_KINDS:
                # a masked conv block can always compute whole maps (the same values: the
                # executor's rule, conv_blocks._maps_pay), so reading the cache never costs
                # more than computing all, which would give other values (own statistics)
                cached = min(cached, full)
        per_kind.append((cached, full, load))
    return BlockCosts.from_kinds(per_kind, lay.seq)


def step_bucket(
    spec: CostSpec,
    works: Sequence[RequestWork],
    grids: dict[int, int],
    per_row: dict[int, list[int]],
) -> buckets.Bucket | None:
    """The bucket whose graph a worker with bucket graphs runs this step in (engine/
    bucket_graphs.py), or None where the step runs eagerly: no buckets, more requests than
    buckets are captured for, rows streamed from the host each step, or more tokens than the top
    rung holds. `per_row`: stride -> masked tokens of each batch row."""
    if not spec.buckets or len(works) > buckets.MAX_REQUESTS or any(w.loads for w in works):
        return None
    rows = sum(w.rows for w in works)
    return buckets.pick(rows, {grids[s]: sum(n) for s, n in per_row.items()})


def padded(
    per_row: dict[int, list[int]], bucket: buckets.Bucket, grids: dict[int, int]
) -> dict[int, list[int]]:
    """The masked tokens of each row (`per_row`: stride -> list over batch rows) as a bucketed
    step computes them (engine/masked/context.py `pad_to`): raised to `bucket`'s capacity, the
    pads distributed as `buckets.pads` says (the executor's rule)."""
    return {s: [n + p for n, p in zip(ns, buckets.pads(ns, bucket.capacity(grids[s]), grids[s]),
                                      strict=True)]
            for s, ns in per_row.items()}  # fmt: skip


def _compute_ms(spec: CostSpec, d: BlockSpec, mode: str, flops: float) -> float:
    if not spec.compute:
        return flops / NOMINAL_FLOPS_PER_MS
    return fit_ms(spec.compute.get(f"{block_class(d)}/{mode}"), flops)

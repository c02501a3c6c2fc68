"""Per-block cost arithmetic: FLOPs of a masked or full block for a batch (paper Table 1 with
keys/values over all tokens), and bytes of cached rows to load. Pure functions of shapes; used
by the load planner (per step) and by the profiler (to fit latency against FLOPs).

Counting convention: 2 FLOPs per multiply-add, matmuls and attention only (what
torch.utils.flop_counter counts), so predictions and counted FLOPs agree.
Importing this module loads neither torch nor diffusers (only `block_dims` does): the API
server's router (instgenie.scheduler.estimate) prices batches with it.
"""

from __future__ import annotations

from dataclasses import dataclass

#: bytes per element of the cache dtypes (torch.<name>.itemsize), float8 variants excluded
ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class BlockDims:
    """Static shape of one hooked block (independent of resolution and batch)."""

    block_id: int
    kind: str  # "unet" | "flux_dual" | "flux_single"
    #: hidden width C
    channels: int
    #: multiply-adds of the feed-forward per token (UNet GEGLU: C*8C + 4C*C; Flux: 8C^2 / mlp)
    ff_macs: int
    #: cross-attention context width (UNet attn2), 0 otherwise
    context_dim: int = 0
    #: Flux single block: MLP hidden width
    mlp: int = 0


def block_dims(block, block_id: int, kind: str) -> BlockDims:  # noqa: ANN001 - a torch module
    from diffusers.models.attention import BasicTransformerBlock
    from diffusers.models.transformers.transformer_flux import FluxTransformerBlock

    if kind == "unet":
        assert isinstance(block, BasicTransformerBlock)
        C = block.norm1.normalized_shape[0]
        proj = block.ff.net[0].proj.out_features  # GEGLU: C -> 2 * inner
        inner = block.ff.net[2].in_features
        ctx = block.attn2.to_k.in_features if block.attn2 is not None else 0
        return BlockDims(block_id, kind, C, C * proj + inner * C, context_dim=ctx)
    C = block.attn.to_q.in_features
    if kind == "flux_dual":
        assert isinstance(block, FluxTransformerBlock)
        inner = block.ff.net[2].in_features
        return BlockDims(block_id, kind, C, 2 * C * inner)
    mlp = block.proj_mlp.out_features
    return BlockDims(block_id, kind, C, 0, mlp=mlp)


def row_macs(d: BlockDims, L: int, n: int, text_len: int) -> int:
    """Multiply-adds of one batch row computing n of its L image tokens (n = L: full)."""
    C = d.channels
    if d.kind == "unet":
        macs = 2 * n * C * C + 2 * L * C * C + 2 * n * L * C + n * d.ff_macs
        if d.context_dim:
            macs += 2 * n * C * C + 2 * text_len * d.context_dim * C + 2 * n * text_len * C
        return macs
    tt = text_len
    if d.kind == "flux_dual":
        return (
            2 * 6 * C * C  # AdaLN modulation of both streams
            + 4 * tt * C * C + tt * d.ff_macs  # text projections and feed-forward
            + 2 * n * C * C + 2 * L * C * C  # image q/out on n tokens, k/v on all
            + n * d.ff_macs
            + 2 * (tt + n) * (tt + L) * C  # joint attention
        )  # fmt: skip
    per_query = C * C + C * d.mlp + (C + d.mlp) * C
    return 3 * C * C + (tt + n) * per_query + 2 * (tt + L) * C * C + 2 * (tt + n) * (tt + L) * C


def batch_flops(d: BlockDims, L: int, masked_per_row: list[int], text_len: int) -> int:
    """FLOPs of one block for a batch whose row r computes masked_per_row[r] tokens."""
    return 2 * sum(row_macs(d, L, n, text_len) for n in masked_per_row)


def cached_bytes(L: int, C: int, rows: int, cache_dtype: str) -> int:
    """Bytes of `rows` cached block outputs as stored (whole rows: every token of each row);
    fp8 adds one float32 scale per token."""
    if cache_dtype.startswith("float8"):
        return rows * L * (C + 4)
    return rows * L * C * ITEMSIZE[cache_dtype]

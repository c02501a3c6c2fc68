"""Masked-token forward of diffusers' BasicTransformerBlock (norm_type "layer_norm": SD2, SDXL).

Per token everything is independent except self-attention (attn1). So for the packed masked
tokens T of all rows (MODELS.md recipe, generalised to a varlen batch):

    n  = norm1(X)                                  all tokens: keys/values need every row
    h  = X[T] + attn1(q = n[T], kv = n)            varlen: each row's queries vs its own L keys
    h += attn2(q = norm2(h), kv = text)            varlen over each row's text tokens
    h += ff(norm3(h))
    Y  = cached block output, with Y[T] = h        rows not reading the cache have T = all tokens

With every token selected this computes exactly the stock block (tests/engine/test_masked_exact.py).
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.models.attention import BasicTransformerBlock
from diffusers.models.attention_processor import Attention, AttnProcessor, AttnProcessor2_0

from instgenie.engine.attention import varlen_attention
from instgenie.engine.masked.context import StepContext, TokenSet
from instgenie.lora.apply import packed_rows


def check_supported(block: BasicTransformerBlock) -> str | None:
    """None if masked execution reproduces this block, else why not."""
    if block.norm_type != "layer_norm":
        return f"norm_type {block.norm_type!r}"
    if block.pos_embed is not None or block.only_cross_attention or block._chunk_size:
        return "positional embedding / cross-only attention / chunked FF"
    for attn in (block.attn1, block.attn2):
        if attn is None:
            continue
        if not isinstance(attn.processor, (AttnProcessor2_0, AttnProcessor)):
            return f"attention processor {type(attn.processor).__name__}"
        if attn.spatial_norm is not None or attn.group_norm is not None or attn.norm_cross:
            return "spatial/group/cross norm in attention"
        if attn.residual_connection or attn.rescale_output_factor != 1.0:
            return "residual connection / output rescale in attention"
    return None


def _attend(
    attn: Attention,
    q_in: torch.Tensor,
    kv_in: torch.Tensor,
    ts: TokenSet,
    cu_k: torch.Tensor,
    backend: str | None,
) -> torch.Tensor:
    """attn's projections + varlen attention. q_in (T, C) packed; kv_in (R, Lk, Ckv)."""
    R, Lk = kv_in.shape[:2]
    q = attn.to_q(q_in)
    # keys/values projected as (R, Lk, C): a packed 2-D input would be ambiguous to LoRA hooks
    k, v = attn.to_k(kv_in).reshape(R * Lk, -1), attn.to_v(kv_in).reshape(R * Lk, -1)
    head_dim = k.shape[-1] // attn.heads
    q = q.view(-1, attn.heads, head_dim)
    k = k.view(-1, attn.heads, head_dim)
    v = v.view(-1, attn.heads, head_dim)
    if attn.norm_q is not None:
        q = attn.norm_q(q)
    if attn.norm_k is not None:
        k = attn.norm_k(k)
    o = varlen_attention(q, k, v, ts.cu_q, cu_k, ts.max_q, Lk, head_dim**-0.5, backend=backend).to(
        q.dtype
    )
    o = attn.to_out[0](o.reshape(-1, attn.heads * head_dim))
    return attn.to_out[1](o)


def masked_forward(
    block: BasicTransformerBlock,
    ctx: StepContext,
    block_id: int,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    encoder_hidden_states: torch.Tensor | None = None,
    encoder_attention_mask: torch.Tensor | None = None,
    **_: Any,
) -> torch.Tensor:
    if attention_mask is not None or encoder_attention_mask is not None:
        raise NotImplementedError("masked execution does not support attention masks")
    X = hidden_states
    R, L, C = X.shape
    ts = ctx.tokens(L)
    with packed_rows(ts.cu_q, ts.total):
        return _masked(block, ctx, block_id, X, ts, encoder_hidden_states)


def _masked(block, ctx: StepContext, block_id: int, X, ts: TokenSet, encoder_hidden_states):
    R, L, C = X.shape
    flat = X.reshape(R * L, C)

    n = block.norm1(X)
    h = flat.index_select(0, ts.flat_idx)
    nq = n.reshape(R * L, C).index_select(0, ts.flat_idx)
    h = h + _attend(block.attn1, nq, n, ts, ts.cu_k, ctx.attention_backend)

    if block.attn2 is not None:
        text = encoder_hidden_states
        cu_text = ctx.row_offsets(text.shape[1])
        h = h + _attend(block.attn2, block.norm2(h), text, ts, cu_text, ctx.attention_backend)

    h = h + block.ff(block.norm3(h))

    return ctx.compose(block_id, X, ts, h)

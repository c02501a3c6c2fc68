"""Masked-token forwards of diffusers' Flux blocks (dual FluxTransformerBlock, single block).

Text tokens are always computed; of the image tokens only the masked ones are queries, while
keys/values cover every image token. Rotary embeddings: queries take the table rows of their own
positions (`JointSet.pos_in_row`), keys the full table. Everything else (AdaLN modulation,
projections, MLPs) is per token and runs on the packed query rows only, with each packed row's
modulation parameters gathered from its batch row. With every token selected this reproduces the
stock blocks (tests/engine/test_masked_exact.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.normalization import RMSNorm as DiffusersRMSNorm
from diffusers.models.transformers.transformer_flux import (
    FluxAttnProcessor,
    FluxSingleTransformerBlock,
    FluxTransformerBlock,
)

from instgenie.engine.attention import varlen_attention
from instgenie.engine.kernels import kernel_enabled, optional_kernel
from instgenie.engine.masked.context import JointSet, StepContext
from instgenie.lora.apply import packed_rows


def check_supported(block: FluxTransformerBlock | FluxSingleTransformerBlock) -> str | None:
    if type(block.attn.processor) is not FluxAttnProcessor:
        return f"attention processor {type(block.attn.processor).__name__}"
    if block.attn.fused_projections:
        return "fused QKV projections"
    return None


#: the fused RMSNorm + RoPE kernel (triton_kernels/rmsnorm_rope.py): "auto" = on CUDA where Triton
#: imports; "on" = also elsewhere (CPU tests under TRITON_INTERPRET=1); "off" = the torch ops
FUSED_ROPE = "auto"


def _fused_kernel():
    return optional_kernel("rmsnorm_rope", "rmsnorm_rope")


def _fused(attn: Any, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
    """The fused kernel if it reproduces this block's q/k norms and RoPE here, else None."""
    if not kernel_enabled(FUSED_ROPE, x.device):
        return None
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return None
    norms = [getattr(attn, n, None) for n in ("norm_q", "norm_k", "norm_added_q", "norm_added_k")]
    for norm in norms:
        if isinstance(norm, torch.nn.RMSNorm):
            ok = norm.weight is not None
        else:
            ok = isinstance(norm, DiffusersRMSNorm) and norm.weight is not None
            ok = ok and norm.bias is None
        if norm is not None and not ok:
            return None
    if not isinstance(rope, tuple) or rope[0].dtype != torch.float32:
        return None
    return _fused_kernel()


@dataclass
class _RopeRows:
    """Where each projected row goes and which RoPE table row it takes (one composition)."""

    #: dual blocks: packed image queries / text queries (positions in Q order and table rows)
    q_img_pos: torch.Tensor
    q_txt_pos: torch.Tensor
    #: keys of the joint (R * seq) sequence: image rows (R * L) and text rows (R * tt)
    k_img_dst: torch.Tensor
    k_img_pos: torch.Tensor
    k_txt_dst: torch.Tensor
    k_txt_pos: torch.Tensor
    #: single blocks: table row of every joint key (R * seq)
    k_all_pos: torch.Tensor


def _rope_rows(ctx: StepContext, js: JointSet, R: int, L: int, tt: int) -> _RopeRows:
    key = ("rope", L, tt)
    rows = ctx._joint.get(key)
    if rows is None:
        dev, seq = js.sel.device, tt + L
        r = torch.arange(R, device=dev)[:, None]
        img = torch.arange(tt, seq, device=dev)[None].expand(R, L)
        txt = torch.arange(tt, device=dev)[None].expand(R, tt)
        rows = ctx._joint[key] = _RopeRows(
            q_img_pos=js.pos_in_row[js.img_pos],
            q_txt_pos=js.pos_in_row[js.txt_pos],
            k_img_dst=(r * seq + img).reshape(-1),
            k_img_pos=img.reshape(-1),
            k_txt_dst=(r * seq + txt).reshape(-1),
            k_txt_pos=txt.reshape(-1),
            k_all_pos=torch.arange(seq, device=dev).repeat(R),
        )
    return rows


def _norm_rope(kernel, x: torch.Tensor, norm: torch.nn.Module, rope, pos, out, dst=None) -> None:
    """out[dst] = rope(norm(x)) at table rows pos; x (N, H, D); norm an RMSNorm (torch's or
    diffusers', whose rounding differs)."""
    cos, sin = (t.contiguous() for t in rope)
    eps = norm.eps if norm.eps is not None else torch.finfo(x.dtype).eps
    kernel(x, norm.weight, eps, cos, sin, pos, out, dst, isinstance(norm, DiffusersRMSNorm))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """diffusers' apply_rotary_emb (use_real, unbind -1) for x (N, H, D), cos/sin (N, D)."""
    real, imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    rotated = torch.stack([-imag, real], dim=-1).flatten(-2)
    return (x.float() * cos[:, None] + rotated.float() * sin[:, None]).to(x.dtype)


def _heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    return x.unflatten(-1, (-1, head_dim))


def _joint_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    js: JointSet,
    seq: int,
    backend: str | None,
) -> torch.Tensor:
    """q (Q, H, D) packed queries; k, v (R, seq, H, D) full joint sequences. Returns (Q, H*D)."""
    cos, sin = rope
    R = k.shape[0]
    q = _rope(q, cos[js.pos_in_row], sin[js.pos_in_row])
    k = apply_rotary_emb(k, rope, sequence_dim=1).reshape(R * seq, *k.shape[2:])
    v = v.reshape(R * seq, *v.shape[2:])
    return _attend_roped(q, k, v, js, seq, backend)


def _attend_roped(q, k, v, js: JointSet, seq: int, backend: str | None) -> torch.Tensor:
    """Varlen attention of rotated packed queries (Q, H, D) over rotated joint keys (R*seq)."""
    o = varlen_attention(q, k, v, js.cu_q, js.cu_k, js.max_q, seq, q.shape[-1] ** -0.5, backend)
    return o.to(q.dtype).flatten(1)


def _dual(
    block: FluxTransformerBlock,
    ctx: StepContext,
    block_id: int,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor],
    joint_attention_kwargs: dict[str, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    if joint_attention_kwargs:
        raise NotImplementedError("masked execution does not support joint_attention_kwargs")
    X, E = hidden_states, encoder_hidden_states
    R, L, C = X.shape
    tt = E.shape[1]
    ts, js = ctx.tokens(L), ctx.joint(L, tt)
    attn = block.attn
    hd = attn.head_dim

    n_img, gate_msa, shift_mlp, scale_mlp, gate_mlp = block.norm1(X, emb=temb)
    n_txt, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = block.norm1_context(E, emb=temb)

    n_img_q = n_img.reshape(R * L, C).index_select(0, ts.flat_idx)
    v_img = _heads(attn.to_v(n_img), hd)
    v_txt = _heads(attn.add_v_proj(n_txt), hd)
    v = torch.cat([v_txt, v_img], dim=1)
    kernel = _fused(attn, X, image_rotary_emb)
    if kernel is not None:  # norms + RoPE in one pass, written in place in the joint q and k
        seq, rr = tt + L, _rope_rows(ctx, js, R, L, tt)
        rope = image_rotary_emb
        q_img = _heads(attn.to_q(n_img_q), hd)
        H = q_img.shape[1]
        q = q_img.new_empty(js.sel.shape[0], H, hd)
        _norm_rope(kernel, q_img, attn.norm_q, rope, rr.q_img_pos, q, js.img_pos)
        q_txt = _heads(attn.add_q_proj(n_txt), hd).reshape(R * tt, H, hd)
        _norm_rope(kernel, q_txt, attn.norm_added_q, rope, rr.q_txt_pos, q, js.txt_pos)
        k = q.new_empty(R * seq, H, hd)
        k_img = _heads(attn.to_k(n_img), hd).reshape(R * L, H, hd)
        _norm_rope(kernel, k_img, attn.norm_k, rope, rr.k_img_pos, k, rr.k_img_dst)
        k_txt = _heads(attn.add_k_proj(n_txt), hd).reshape(R * tt, H, hd)
        _norm_rope(kernel, k_txt, attn.norm_added_k, rope, rr.k_txt_pos, k, rr.k_txt_dst)
        o = _attend_roped(q, k, v.reshape(R * seq, H, hd), js, seq, ctx.attention_backend)
    else:
        q_img = attn.norm_q(_heads(attn.to_q(n_img_q), hd))
        k_img = attn.norm_k(_heads(attn.to_k(n_img), hd))
        q_txt = attn.norm_added_q(_heads(attn.add_q_proj(n_txt), hd))
        k_txt = attn.norm_added_k(_heads(attn.add_k_proj(n_txt), hd))
        q = q_img.new_empty(js.sel.shape[0], *q_img.shape[1:])
        q[js.txt_pos] = q_txt.reshape(R * tt, *q_txt.shape[2:])
        q[js.img_pos] = q_img
        k = torch.cat([k_txt, k_img], dim=1)
        o = _joint_attention(q, k, v, image_rotary_emb, js, tt + L, ctx.attention_backend)

    h = X.reshape(R * L, C).index_select(0, ts.flat_idx)
    img = (gate_msa, shift_mlp, scale_mlp, gate_mlp)
    E, h = dual_after_attention(block, o, js, ts.row_of, h, E, img,
                                (c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp))  # fmt: skip
    return E, ctx.compose(block_id, X, ts, h)


def dual_after_attention(block, o, js: JointSet, row, h, E, img: tuple, txt: tuple):  # noqa: ANN001
    """A dual block after its joint attention `o` (Q, inner): the packed image tokens (inputs h,
    batch row of each `row`) through the output projection and feed-forward, and the text
    stream E (R, tt, C), every token; img / txt: (gate_msa, shift_mlp, scale_mlp, gate_mlp) of
    each stream, (R, C) each. Returns (E, h)."""
    attn = block.attn
    gate_msa, shift_mlp, scale_mlp, gate_mlp = img
    h = h + gate_msa[row] * attn.to_out[1](attn.to_out[0](o[js.img_pos]))
    nh = block.norm2(h) * (1 + scale_mlp[row]) + shift_mlp[row]
    h = h + gate_mlp[row] * block.ff(nh)
    c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = txt
    R, tt = E.shape[0], E.shape[1]
    ctx_attn = attn.to_add_out(o[js.txt_pos].reshape(R, tt, -1))
    E = E + c_gate_msa.unsqueeze(1) * ctx_attn
    ne = block.norm2_context(E) * (1 + c_scale_mlp[:, None]) + c_shift_mlp[:, None]
    E = E + c_gate_mlp.unsqueeze(1) * block.ff_context(ne)
    if E.dtype == torch.float16:
        E = E.clip(-65504, 65504)
    return E, h


def _single(
    block: FluxSingleTransformerBlock,
    ctx: StepContext,
    block_id: int,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor],
    joint_attention_kwargs: dict[str, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    if joint_attention_kwargs:
        raise NotImplementedError("masked execution does not support joint_attention_kwargs")
    X, E = hidden_states, encoder_hidden_states
    R, L, C = X.shape
    tt = E.shape[1]
    seq = tt + L
    ts, js = ctx.tokens(L), ctx.joint(L, tt)
    attn = block.attn
    hd = attn.head_dim

    S = torch.cat([E, X], dim=1)  # (R, seq, C)
    n, gate = block.norm(S, emb=temb)  # every token: keys/values need them
    n_flat = n.reshape(R * seq, C)
    n_q = n_flat.index_select(0, js.sel)
    mlp = block.act_mlp(block.proj_mlp(n_q))
    v = _heads(attn.to_v(n), hd)
    kernel = _fused(attn, X, image_rotary_emb)
    if kernel is not None:  # norms + RoPE in one pass each
        rr = _rope_rows(ctx, js, R, L, tt)
        q_lin = _heads(attn.to_q(n_q), hd)
        H = q_lin.shape[1]
        q = torch.empty_like(q_lin)
        _norm_rope(kernel, q_lin, attn.norm_q, image_rotary_emb, js.pos_in_row, q)
        k_lin = _heads(attn.to_k(n), hd).reshape(R * seq, H, hd)
        k = torch.empty_like(k_lin)
        _norm_rope(kernel, k_lin, attn.norm_k, image_rotary_emb, rr.k_all_pos, k)
        o = _attend_roped(q, k, v.reshape(R * seq, H, hd), js, seq, ctx.attention_backend)
    else:
        q = attn.norm_q(_heads(attn.to_q(n_q), hd))
        k = attn.norm_k(_heads(attn.to_k(n), hd))
        o = _joint_attention(q, k, v, image_rotary_emb, js, seq, ctx.attention_backend)

    h = gate[js.row_of] * block.proj_out(torch.cat([o, mlp], dim=1))
    h = S.reshape(R * seq, C).index_select(0, js.sel) + h
    if h.dtype == torch.float16:
        h = h.clip(-65504, 65504)

    E = h[js.txt_pos].reshape(R, tt, C)
    return E, ctx.compose(block_id, X, ts, h[js.img_pos])


def dual_rows(ctx: StepContext, hidden_states: torch.Tensor):  # noqa: ANN201
    """The dual block's packed 2-D rows (LoRA, lora.apply.packed_rows): its masked image
    tokens."""
    ts = ctx.tokens(hidden_states.shape[1])
    return packed_rows(ts.cu_q, ts.total)


def single_rows(ctx: StepContext, hidden_states: torch.Tensor, encoder_hidden_states):  # noqa: ANN001, ANN201
    """The single block's packed 2-D rows: its joint query rows (text and masked image)."""
    js = ctx.joint(hidden_states.shape[1], encoder_hidden_states.shape[1])
    return packed_rows(js.cu_q, int(js.sel.shape[0]))

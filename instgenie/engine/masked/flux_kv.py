"""Masked forwards of Flux blocks whose cache holds keys and values (ExecConfig.kv_cache on;
slots: kv_layout.py).

flux_blocks.py computes every image token's key and value from the block's cached input (AdaLN,
`to_k`, `to_v`, the key's RMSNorm and RoPE on all L tokens), because masked queries attend to
all of them. Here only the joint query rows (text tokens and the masked image tokens) are
normalised and projected; the unmasked image tokens' keys and values are the template's, copied
from the cache into the joint sequence. Per masked block at m = 0.2 (1024², 512 text tokens)
that removes 2 (L - n) C² of ~10 C² L multiply-adds: -24.7 % (scheduler/pricing.py row_macs
with kv).

The one approximation: the template's keys and values were computed under its own pooled prompt
embedding (`temb` modulates AdaLN), an edit's under its own. With the template's prompt the two
agree (replay stays exact); with another the cost was measured on the reference models
(docs/benchmarks/quality.md, "K/V cache").

Rows that compute every token (the full path, captures) compute every key and value here too;
a capturing row's image keys and values go to its writer (`record_kv`). Pads of a padded token
set (bucket graphs) write their keys and values to a trash row past the joint sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from instgenie.engine.masked import flux_blocks as fb
from instgenie.engine.masked.context import StepContext


def joint_kv(ctx: StepContext, block_id: int, values: bool, shape: tuple[int, int, int, int],
             dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """A (R * seq + 1, inner) joint key buffer (`values`: value buffer) for `shape` =
    (R, tt, L, inner): every row's tt text rows then its L image rows (seq = tt + L), then one
    trash row for pads. The cache-reading rows' image part holds the template's cached keys
    (values) at the request's step; everything else is uninitialised: the block writes its text
    rows and its computed image rows."""
    R, tt, L, inner = shape
    seq = tt + L
    buf = torch.empty((R * seq + 1, inner), dtype=dtype, device=ctx.device)
    if ctx.reads_cache:
        slot = ctx.kv.values[block_id] if values else block_id
        ctx.masked_blocks.append(slot)
        ctx._fill_cached(slot, buf[: R * seq].view(R, seq, inner)[:, tt:])
    return buf


@dataclass
class _KVRows:
    """Where each packed joint query row (JointSet order: text and masked image rows) writes its
    key and value in joint_kv's buffer: r * seq + position; a pad of a padded set, the trash row
    R * seq, where duplicates race harmlessly. (Q,) int64, and its image and text parts."""

    all: torch.Tensor
    img: torch.Tensor
    txt: torch.Tensor


def kv_rows(ctx: StepContext, L: int, tt: int) -> _KVRows:
    """The composition's _KVRows, built once (its blocks and steps reuse them)."""
    key = ("kv_rows", L, tt)
    rows = ctx._joint.get(key)
    if rows is None:
        ts, js = ctx.tokens(L), ctx.joint(L, tt)
        seq = tt + L
        dst = js.row_of * seq + js.pos_in_row
        if ts.scatter_idx is not None:
            idx = ts.scatter_idx  # r * L + pos, or R * L for a pad
            img = idx // L * seq + tt + idx % L
            dst[js.img_pos] = torch.where(idx == ctx.num_rows * L, ctx.num_rows * seq, img)
        rows = ctx._joint[key] = _KVRows(dst, dst[js.img_pos], dst[js.txt_pos])
    return rows


def record_kv(ctx: StepContext, block_id: int, k: torch.Tensor, v: torch.Tensor, tt: int) -> None:
    """Capture: each capturing request's image rows of joint_kv's buffers `k`, `v` to its writer
    (keys in the block's slot, values in its value slot)."""
    for slot, buf in ((block_id, k), (ctx.kv.values[block_id], v)):
        ctx.record(slot, buf[:-1].view(ctx.num_rows, -1, buf.shape[-1])[:, tt:])


def _modulation(norm: torch.nn.Module, temb: torch.Tensor, chunks: int) -> tuple:
    """diffusers' AdaLayerNormZero(Single) modulation vectors, each (R, C)."""
    return norm.linear(norm.silu(temb)).chunk(chunks, dim=1)


def _qkv(attn, n: torch.Tensor, img: bool) -> tuple:  # noqa: ANN001 - a diffusers Attention
    """Linear q, k, v (N, H, D) of normalised rows `n` (image or text projections)."""
    hd = attn.head_dim
    if img:
        return tuple(fb._heads(p(n), hd) for p in (attn.to_q, attn.to_k, attn.to_v))
    return tuple(fb._heads(p(n), hd) for p in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))


def _norm_rope_into(kernel, x, norm, rope, pos, out, dst=None) -> None:  # noqa: ANN001
    """out[dst] (dst None: out) = rope(norm(x)) at RoPE table rows pos, x (N, H, D): the fused
    kernel, or torch's ops."""
    if kernel is not None:
        fb._norm_rope(kernel, x, norm, rope, pos, out, dst)
        return
    cos, sin = rope
    y = fb._rope(norm(x), cos[pos], sin[pos])
    out.copy_(y) if dst is None else out.index_copy_(0, dst, y)


def _geometry(ctx: StepContext, X: torch.Tensor, E: torch.Tensor, kwargs: dict | None) -> tuple:
    """(R, L, C, tt, seq, TokenSet, JointSet) of a block's image rows X (R, L, C) and text rows
    E (R, tt, C)."""
    if kwargs:
        raise NotImplementedError("masked execution does not support joint_attention_kwargs")
    R, L, C = X.shape
    tt = E.shape[1]
    return R, L, C, tt, tt + L, ctx.tokens(L), ctx.joint(L, tt)


def _dual(block, ctx: StepContext, block_id: int, hidden_states, encoder_hidden_states,
          temb, image_rotary_emb, joint_attention_kwargs=None):  # fmt: skip
    X, E, rope = hidden_states, encoder_hidden_states, image_rotary_emb
    R, L, C, tt, seq, ts, js = _geometry(ctx, X, E, joint_attention_kwargs)
    attn = block.attn
    row = ts.row_of

    mod = _modulation(block.norm1, temb, 6)
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = mod
    h = X.reshape(R * L, C).index_select(0, ts.flat_idx)  # the masked tokens' inputs (packed)
    n_img = block.norm1.norm(h) * (1 + scale_msa[row]) + shift_msa[row]
    n_txt, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = block.norm1_context(E, emb=temb)
    q_img, k_img, v_img = _qkv(attn, n_img, img=True)
    q_txt, k_txt, v_txt = _qkv(attn, n_txt, img=False)
    H, hd = q_img.shape[1], q_img.shape[2]
    q_txt, k_txt, v_txt = (t.reshape(R * tt, H, hd) for t in (q_txt, k_txt, v_txt))

    dst, rr = kv_rows(ctx, L, tt), fb._rope_rows(ctx, js, R, L, tt)
    shape = (R, tt, L, H * hd)
    k = joint_kv(ctx, block_id, False, shape, X.dtype).view(-1, H, hd)
    v = joint_kv(ctx, block_id, True, shape, X.dtype).view(-1, H, hd)
    v.index_copy_(0, dst.img, v_img)
    v.index_copy_(0, dst.txt, v_txt)
    kernel = fb._fused(attn, X, rope)
    pos_img, pos_txt = rr.q_img_pos, rr.q_txt_pos  # RoPE table rows of the query rows
    q = q_img.new_empty(js.sel.shape[0], H, hd)
    _norm_rope_into(kernel, q_img, attn.norm_q, rope, pos_img, q, js.img_pos)
    _norm_rope_into(kernel, q_txt, attn.norm_added_q, rope, pos_txt, q, js.txt_pos)
    _norm_rope_into(kernel, k_img, attn.norm_k, rope, pos_img, k, dst.img)
    _norm_rope_into(kernel, k_txt, attn.norm_added_k, rope, pos_txt, k, dst.txt)
    if ctx.capturing:
        record_kv(ctx, block_id, k.flatten(1), v.flatten(1), tt)
    o = fb._attend_roped(q, k[: R * seq], v[: R * seq], js, seq, ctx.attention_backend)

    E, h = fb.dual_after_attention(block, o, js, row, h, E,
                                   (gate_msa, shift_mlp, scale_mlp, gate_mlp),
                                   (c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp))  # fmt: skip
    return E, ctx.compose(block_id, X, ts, h)


def _single(block, ctx: StepContext, block_id: int, hidden_states, encoder_hidden_states,
            temb, image_rotary_emb, joint_attention_kwargs=None):  # fmt: skip
    X, E, rope = hidden_states, encoder_hidden_states, image_rotary_emb
    R, L, C, tt, seq, ts, js = _geometry(ctx, X, E, joint_attention_kwargs)
    attn = block.attn

    # the joint query rows' inputs: every text token, the masked image tokens (JointSet order)
    s = X.new_empty(js.sel.shape[0], C)
    s[js.txt_pos] = E.reshape(R * tt, C)
    s[js.img_pos] = X.reshape(R * L, C).index_select(0, ts.flat_idx)
    shift, scale, gate = _modulation(block.norm, temb, 3)
    n = block.norm.norm(s) * (1 + scale[js.row_of]) + shift[js.row_of]
    mlp = block.act_mlp(block.proj_mlp(n))
    q_lin, k_lin, v_q = _qkv(attn, n, img=True)
    H, hd = q_lin.shape[1], q_lin.shape[2]

    dst = kv_rows(ctx, L, tt).all
    shape = (R, tt, L, H * hd)
    k = joint_kv(ctx, block_id, False, shape, X.dtype).view(-1, H, hd)
    v = joint_kv(ctx, block_id, True, shape, X.dtype).view(-1, H, hd)
    v.index_copy_(0, dst, v_q)
    kernel = fb._fused(attn, X, rope)
    q = torch.empty_like(q_lin)
    _norm_rope_into(kernel, q_lin, attn.norm_q, rope, js.pos_in_row, q)
    _norm_rope_into(kernel, k_lin, attn.norm_k, rope, js.pos_in_row, k, dst)
    if ctx.capturing:
        record_kv(ctx, block_id, k.flatten(1), v.flatten(1), tt)
    o = fb._attend_roped(q, k[: R * seq], v[: R * seq], js, seq, ctx.attention_backend)

    h = s + gate[js.row_of] * block.proj_out(torch.cat([o, mlp], dim=1))
    if h.dtype == torch.float16:
        h = h.clip(-65504, 65504)
    E = h[js.txt_pos].reshape(R, tt, C)
    return E, ctx.compose(block_id, X, ts, h[js.img_pos])


def dual_masked_forward(block, ctx: StepContext, block_id: int, hidden_states,
                        encoder_hidden_states, *args: Any, **kwargs: Any):  # fmt: skip
    """A dual block's masked forward: the K/V form for a K/V block, else flux_blocks'."""
    impl = _dual if ctx.is_kv(block_id) else fb._dual
    with fb.dual_rows(ctx, hidden_states):
        return impl(block, ctx, block_id, hidden_states, encoder_hidden_states, *args, **kwargs)


def single_masked_forward(block, ctx: StepContext, block_id: int, hidden_states,
                          encoder_hidden_states, *args: Any, **kwargs: Any):  # fmt: skip
    """A single block's masked forward: the K/V form for a K/V block, else flux_blocks'."""
    impl = _single if ctx.is_kv(block_id) else fb._single
    with fb.single_rows(ctx, hidden_states, encoder_hidden_states):
        return impl(block, ctx, block_id, hidden_states, encoder_hidden_states, *args, **kwargs)


def capture_forward(masked_forward):  # noqa: ANN001, ANN201
    """A K/V block's forward while a step captures and no row reads a cache: its K/V form over
    every token (it records their keys and values); None for other blocks (the stock forward,
    whose output is recorded)."""

    def forward(block, ctx: StepContext, block_id: int, *args: Any, **kwargs: Any):
        if not ctx.is_kv(block_id):
            return None
        return masked_forward(block, ctx, block_id, *args, **kwargs)

    return forward

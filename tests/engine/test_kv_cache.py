"""Flux templates whose cache holds keys and values (ExecConfig.kv_cache on; flux_kv.py), tiny
models on CPU.

Invariants: with the template's own prompt, seed and mask a K/V edit replays full computation
(float64); a mask of ratio 1.0 equals full computation whatever the cache holds; a request's
output does not depend on its batch-mates, and a capture batched behind others is exact; the
bucket graphs' form (padded sets, address tables, strided rows) equals the plain path. With
another prompt or mask the K/V path differs from the output-cache path: the template's `temb`
modulated the cached keys and values, and the first block's inputs (which no cache holds) were
the template's conditioning; its cost is measured in quality.md.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

from instgenie.config import ExecConfig
from instgenie.engine.masked import context, flux_blocks
from instgenie.engine.pipeline import EditPipeline
from instgenie.engine.request import EditRequest
from instgenie.engine.templates import TemplateSpec
from tests.conftest import make_image, make_mask, png_bytes
from tests.engine.test_masked_exact import MASKS, STEPS, _close, _full, _run

COMMON = dict(prompt="a red felt hat", seed=5, num_inference_steps=STEPS)


@functools.cache
def _pipe(kv: str, dtype: str = "fp64") -> EditPipeline:
    return EditPipeline.load("flux-fill:tiny", dtype=dtype, execution=ExecConfig(kv_cache=kv))


def _template(pipe: EditPipeline, mask: str | None = "rect", seed: int = 1, **spec) -> str:
    img = png_bytes(make_image(128, 128, seed=seed))
    m = None if mask is None else png_bytes(MASKS[mask])
    return pipe.build_template(TemplateSpec(image=img, mask=m, **{**COMMON, **spec}))


def _edit(pipe: EditPipeline, key: str, mask: str, uid: str = "e", **over) -> torch.Tensor:
    req = EditRequest(uid=uid, image=None, template_id=key, mask=png_bytes(MASKS[mask]),
                      paste_back=False, **{**COMMON, **over})  # fmt: skip
    state = pipe.preprocess(req)
    assert state.path == "masked" and state.notes.cache == "hit"
    return _run(pipe, state).latents


def test_cache_holds_keys_and_values_not_outputs() -> None:
    pipe = _pipe("on")
    ex = pipe.family.masked
    key = _template(pipe)
    shapes = pipe.store.meta(key).block_shapes
    n = ex.num_blocks
    # every block but the first (its inputs are the edit's own: it caches its output)
    assert ex.kv is not None and sorted(ex.kv.values) == list(range(1, n))
    assert sorted(shapes) == list(range(2 * n - 1)) and ex.num_cached_blocks == 2 * n - 1
    # slot b: the block's keys (inner width), slot values[b]: its values; image tokens only
    for b in range(1, n):
        inner = pipe.family.backbone.get_submodule(ex.blocks[b].name).attn.inner_dim
        assert shapes[b] == shapes[ex.kv.values[b]] == (256, inner)
    assert shapes[0] == (256, pipe.family.backbone.get_submodule(ex.blocks[0].name).attn.to_q
                         .in_features)  # fmt: skip
    # the cache key names the layout: an output cache is never read as keys
    assert key != _template(_pipe("off"))


@pytest.mark.parametrize("mask", ["rect", "ellipse", "one-pixel", "full"])
def test_replay_equals_full(mask: str) -> None:
    pipe = _pipe("on")
    key = _template(pipe, mask)
    masked = _edit(pipe, key, mask)
    ctx = pipe.family.masked.last_context
    assert sorted(ctx.masked_blocks) == list(range(pipe.family.masked.num_cached_blocks))
    img = png_bytes(make_image(128, 128, seed=1))
    full = _full(pipe, EditRequest(uid="f", image=img, mask=png_bytes(MASKS[mask]),
                                   paste_back=False, **COMMON))  # fmt: skip
    _close(masked, full.latents)


def test_another_prompt_differs_from_the_output_cache_path() -> None:
    kv, out = _pipe("on"), _pipe("off")
    a = _edit(kv, _template(kv, "rect"), "ellipse", prompt="a blue scarf")
    b = _edit(out, _template(out, "rect"), "ellipse", prompt="a blue scarf")
    diff = float((a - b).abs().max())
    assert 0 < diff < 0.5 * float(b.abs().max())


def test_ratio_one_equals_full_with_any_cache() -> None:
    pipe = _pipe("on")
    img = png_bytes(make_image(128, 128, seed=2))
    key = pipe.build_template(TemplateSpec(image=img, prompt="x", seed=99,
                                           num_inference_steps=STEPS))  # fmt: skip
    over = dict(prompt="a blue coat", seed=3)
    masked = _edit(pipe, key, "full", **over)
    full = _full(pipe, EditRequest(uid="f", image=img, mask=png_bytes(MASKS["full"]),
                                   paste_back=False, **{**COMMON, **over}))  # fmt: skip
    _close(masked, full.latents)


def test_batch_mates_do_not_change_an_edit() -> None:
    """Two K/V templates, other prompts and seeds, a full-path request, staggered joins: each
    equals its solo run; a capture batched behind them records an exact cache."""
    pipe = _pipe("on")
    keys = [_template(pipe, "rect", seed=4), _template(pipe, "ellipse", seed=5, prompt="shoes")]
    reqs = [
        EditRequest(uid="a", image=None, template_id=keys[0], mask=png_bytes(MASKS["two-regions"]),
                    paste_back=False, **{**COMMON, "prompt": "boots"}),
        EditRequest(uid="b", image=None, template_id=keys[1], mask=png_bytes(MASKS["rect"]),
                    paste_back=False, **{**COMMON, "seed": 8}),
        EditRequest(uid="c", image=png_bytes(make_image(128, 128, seed=6)),
                    mask=png_bytes(MASKS["rect"]), paste_back=False, **COMMON),
    ]  # fmt: skip
    solo = {r.uid: _run(pipe, pipe.preprocess(r)).latents for r in reqs}
    late = _template(pipe, "ellipse", seed=7)  # captured again below, batched behind the edits
    pipe.store.delete(late)
    states = {r.uid: pipe.preprocess(r) for r in reqs}
    states["cap"] = pipe.capture_state(late)
    step = 0
    while not all(s.is_done for s in states.values()):
        batch = [s for i, s in enumerate(states.values()) if step >= i and not s.is_done]
        pipe.denoise_step(batch)
        step += 1
    for uid, latents in solo.items():
        _close(states[uid].latents, latents)
    assert pipe.store.status(late) == "ready"
    masked = _edit(pipe, late, "ellipse")
    img = png_bytes(make_image(128, 128, seed=7))
    full = _full(pipe, EditRequest(uid="f", image=img, mask=png_bytes(MASKS["ellipse"]),
                                   paste_back=False, **COMMON))  # fmt: skip
    _close(masked, full.latents)


def test_fused_norm_rope_kernel_matches_torch_ops(monkeypatch) -> None:
    """The K/V forwards through the fused RMSNorm + RoPE kernel (interpreted on CPU) agree with
    torch's ops, float32."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the fused kernel on CPU tensors needs TRITON_INTERPRET=1")
    pipe = _pipe("on", "fp32")
    key = _template(pipe, "rect")
    out = {}
    for mode in ("off", "on"):
        monkeypatch.setattr(flux_blocks, "FUSED_ROPE", mode)
        out[mode] = _edit(pipe, key, "ellipse", prompt="a scarf")
    scale = float(out["off"].abs().max())
    assert float((out["on"] - out["off"]).abs().max()) <= 1e-5 * scale


@pytest.mark.parametrize("step_copy", ["auto", "on"])
def test_bucket_graph_form_equals_plain_path(step_copy: str, monkeypatch) -> None:
    """Every step through a bucket's static sets and address tables (pads to the trash row, the
    cached keys and values copied into strided joint rows), staggered compositions."""
    from tests.engine.test_bucket_graphs import _bucketed
    from tests.engine.test_bucket_graphs import _close as _near
    from tests.engine.test_graphs import _run_staggered

    if step_copy == "on" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the indirect copy kernel on CPU tensors needs TRITON_INTERPRET=1")
    monkeypatch.setattr(context, "STEP_COPY", step_copy)
    pipe = EditPipeline.load("flux-fill:tiny", execution=ExecConfig(kv_cache="on"))
    keys = [_template(pipe, "rect", seed=s, num_inference_steps=3) for s in (1, 2)]
    boxes = [(0.1, 0.1, 0.4, 0.5), (0.5, 0.2, 0.9, 0.7), (0.3, 0.3, 0.6, 0.6)]
    reqs = [EditRequest(uid=u, image=None if k else png_bytes(make_image(128, 128, seed=9)),
                        template_id=k, mask=png_bytes(make_mask(128, 128, box)), prompt=f"a {u}",
                        seed=3, num_inference_steps=3, paste_back=False)
            for u, k, box in zip("abc", [keys[0], keys[1], None], boxes, strict=True)]  # fmt: skip
    pipe.family.masked.graphs.mode = "off"
    plain = _run_staggered(pipe, reqs)
    graphs = _bucketed(pipe)
    padded = _run_staggered(pipe, reqs)
    assert graphs.counters["warmup"] >= 1 and graphs.counters["capture"] == 0
    for a, b in zip(plain, padded, strict=True):
        assert _near(b, a)


@pytest.mark.parametrize("loading", ["eager-pipelined", "auto", "pipelined", "window"])
def test_host_tier_caches_read_every_way_equal_the_plain_path(loading: str, tmp_path) -> None:
    """K/V templates in the host DRAM tier (slots 0..2n-1 of one segment): read in place, by the
    pipelined loader (which streams no K/V slot: they are copied by the blocks), through the
    graph form, or from a device step window: every way equals the plain path exactly."""
    import uuid

    from instgenie.cache.host_store import HostActivationStore
    from instgenie.cache.shm_segment import cleanup
    from instgenie.cache.tiered import TieredStore
    from tests.engine.test_graphs import _run_staggered, graph_form_reading

    ns = uuid.uuid4().hex[:10]
    tiered = TieredStore(tmp_path, ns, 256 << 20, 0, disk_enabled=False)
    try:
        loaded = EditPipeline.load("flux-fill:tiny", execution=ExecConfig(kv_cache="on"))
        pipe = EditPipeline(loaded.family, store=HostActivationStore(tiered, tmp_path))
        ex = pipe.family.masked
        keys = [_template(pipe, "rect", seed=s, num_inference_steps=3) for s in (1, 2)]
        assert pipe.store.tier(keys[0]) == "dram"
        reqs = [EditRequest(uid=u, image=None, template_id=k, prompt=f"a {u}", seed=3,
                            mask=png_bytes(make_mask(128, 128, box)), num_inference_steps=3,
                            paste_back=False)
                for u, k, box in (("a", keys[0], (0.1, 0.1, 0.4, 0.5)),
                                  ("b", keys[1], (0.5, 0.2, 0.9, 0.7)))]  # fmt: skip
        ex.graphs.mode = "off"
        plain = _run_staggered(pipe, reqs)
        if loading == "eager-pipelined":
            ex.loading = "pipelined"
        else:
            graph_form_reading(ex, loading)
        other = _run_staggered(pipe, reqs)
        for a, b in zip(plain, other, strict=True):
            assert torch.equal(a, b)
        assert len(ex._windows) == (2 if loading == "window" else 0)
    finally:
        tiered.close()
        cleanup(ns)


def test_flops_at_m_0_2_are_what_pricing_says() -> None:
    """torch's FLOP counter over one masked step at m = 0.2 (160², 10x10 token grid): the K/V
    path's transformer blocks cost exactly pricing's row_macs with kv (keys and values of the
    masked tokens only), the output-cache path's without; the expected fraction of a full step
    is stated."""
    from instgenie.engine.costspec import cost_spec
    from instgenie.scheduler.pricing import row_macs
    from tests.engine.test_masked_flops import M, _count_step
    from tests.engine.test_masked_flops import _edit as flops_edit

    size, measured, expected = 160, {}, {}
    for kv in ("off", "on"):
        pipe = EditPipeline.load("flux-fill:tiny", execution=ExecConfig(kv_cache=kv))
        img = png_bytes(make_image(size, size, seed=1))
        key = pipe.build_template(TemplateSpec(image=img, num_inference_steps=3))
        state = pipe.preprocess(flops_edit(key, size))
        assert state.path == "masked"
        ((L, idx),) = state.token_index.items()
        assert idx.numel() == round(M * L)
        full_blocks, _ = _count_step(pipe, pipe.preprocess(flops_edit(None, size)))
        masked_blocks, _ = _count_step(pipe, state)
        spec = cost_spec(pipe)
        assert spec.kv_cache is (kv == "on")
        tt = state.cond["prompt_embeds"].shape[1]
        assert [d.kv for d in spec.blocks] == [kv == "on" and d.block_id > 0 for d in spec.blocks]
        macs = sum(row_macs(d, L, idx.numel(), tt) for d in spec.blocks)
        full = sum(row_macs(d, L, L, tt) for d in spec.blocks)
        assert masked_blocks == 2 * macs and full_blocks == 2 * full
        measured[kv], expected[kv] = masked_blocks / full_blocks, macs / full
    # Flux-tiny: 0.2976 of a full step's block FLOPs with keys/values of every token, 0.2691
    # with the masked tokens' only in its blocks 1-3 (-9.6 %: its 256 image tokens are few
    # beside its text, and its first block of 4 computes them all; at 1024² a K/V block's cut
    # is -24.7 %, tests/scheduler/test_pricing.py)
    assert expected == pytest.approx({"off": 0.2976, "on": 0.2691}, abs=1e-4)
    assert measured == expected


def test_an_fp8_cache_holds_keys_and_values_too() -> None:
    """A float8 store quantises the key and value slots per token row like outputs; the edit
    stays within 1e-3 (relative) of the float32 cache's (tiny Flux, 4 steps)."""
    from instgenie.cache.store import InMemoryStore

    loaded = EditPipeline.load("flux-fill:tiny", execution=ExecConfig(kv_cache="on"))
    out = []
    for store in (None, InMemoryStore("cpu", dtype=torch.float8_e4m3fn)):
        pipe = loaded if store is None else EditPipeline(loaded.family, store=store)
        key = _template(pipe, "rect", prompt="a coat")
        out.append(_edit(pipe, key, "ellipse", prompt="a scarf", seed=3))
    scale = float(out[0].abs().max())
    assert 0 < float((out[1] - out[0]).abs().max()) <= 1e-3 * scale


def test_the_profiler_times_k_v_blocks_both_ways() -> None:
    """`instgenie profile` with K/V blocks: "cached" samples are masked steps priced with kv
    FLOPs; "full" samples are full-path steps (a K/V block cannot compute every token of a
    cache-reading row), every block of them run stock, priced as full."""
    from instgenie.engine.profiling import profile_compute

    pipe = _pipe("on", "fp32")
    ran = []
    ex = pipe.family.masked
    run = ex.run_backbone

    def spy(batch, plan, fn, *args, **kwargs):  # noqa: ANN001, ANN202
        out = run(batch, plan, fn, *args, **kwargs)
        ctx = ex.last_context
        ran.append((tuple(s.path for s in batch), sorted(ctx.masked_blocks), plan.compute_all))
        return out

    ex.run_backbone = spy
    try:
        compute = profile_compute(pipe, 2 * pipe.family.granule, [1], [0.25], warmup=0, iters=1,
                                  log=lambda m: None)  # fmt: skip
    finally:
        del ex.run_backbone
    timed = [(p, blocks) for p, blocks, every in ran if every]  # the "full" mode's steps
    assert timed and all(p == ("full",) and blocks == [] for p, blocks in timed)
    assert any(p == ("masked",) and blocks for p, blocks, every in ran if not every)
    samples = compute["samples"]
    assert set(samples) == set(compute["blocks"].values())
    for c in samples:
        (fc, _), (ff, _) = samples[c]["cached"][0], samples[c]["full"][0]
        assert fc < ff

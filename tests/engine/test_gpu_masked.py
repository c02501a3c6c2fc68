"""GPU checks of mask-aware execution (marked gpu; run on the device with --gpu).

On CUDA the varlen attention defaults to the Triton kernel. Replay of a template's own inputs
must still equal full computation (float32, no TF32), and the Triton and SDPA backends must agree.
"""

from __future__ import annotations

import functools

import pytest
import torch

from instgenie.config import ExecConfig
from instgenie.engine.pipeline import EditPipeline
from instgenie.engine.request import EditRequest
from instgenie.engine.templates import TemplateSpec
from tests.conftest import make_image, make_mask, planned_step, png_bytes

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@functools.cache
def cuda_pipeline(family: str, setting: str = "off") -> EditPipeline:
    """`setting`: "off" (transformer blocks masked), "auto" (sparse convs too: UNets), "kv" (a
    K/V cache: Flux)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    execution = ExecConfig(sparse_convs="auto" if setting == "auto" else "off",
                           kv_cache="on" if setting == "kv" else "off")  # fmt: skip
    return EditPipeline.load(f"{family}:tiny", device="cuda", dtype="fp32", execution=execution)


#: the families and settings of the masked-execution checks: sparse convs (SDXL) and the K/V
#: cache (Flux) too
SETUPS = [("sdxl-inpaint", "off"), ("sdxl-inpaint", "auto"), ("flux-fill", "off"),
          ("flux-fill", "kv")]  # fmt: skip


def _run(pipe, req):
    s = pipe.preprocess(req)
    while not s.is_done:
        pipe.denoise_step([s])
    return s


@pytest.mark.parametrize("family, setting", SETUPS)
def test_replay_on_cuda_with_triton(family: str, setting: str) -> None:
    pipe = cuda_pipeline(family, setting)
    assert pipe.family.masked.attention_backend in ("auto", "triton")
    img, mask = png_bytes(make_image(128, 128, seed=1)), png_bytes(make_mask(128, 128))
    common = dict(prompt="a hat", seed=3, num_inference_steps=4)
    key = pipe.build_template(TemplateSpec(image=img, mask=mask, **common))
    masked = _run(pipe, EditRequest(uid="m", image=None, template_id=key, mask=mask, **common))
    full = _run(pipe, EditRequest(uid="f", image=img, mask=mask, **common))
    assert masked.path == "masked"
    scale = float(full.latents.abs().max())
    # different attention kernels (Triton vs cuDNN/flash SDPA) round differently in fp32
    assert float((masked.latents - full.latents).abs().max()) <= 1e-4 * scale


@pytest.mark.parametrize("family, setting", SETUPS)
def test_triton_and_sdpa_backends_agree(family: str, setting: str, backend_calls) -> None:
    pipe = cuda_pipeline(family, setting)
    img, mask = png_bytes(make_image(128, 128, seed=2)), png_bytes(make_mask(128, 128))
    key = pipe.build_template(TemplateSpec(image=img, num_inference_steps=3))
    req = EditRequest(uid="e", image=None, template_id=key, mask=mask, prompt="boots", seed=5,
                      num_inference_steps=3)  # fmt: skip
    outs = {}
    try:
        for backend in ("triton", "sdpa"):
            pipe.family.masked.attention_backend = backend
            backend_calls.clear()
            state = _run(pipe, req)
            assert state.path == "masked"
            assert set(backend_calls) == {backend} and backend_calls[backend] > 0
            outs[backend] = state.latents
    finally:
        pipe.family.masked.attention_backend = None
    scale = float(outs["sdpa"].abs().max())
    assert float((outs["triton"] - outs["sdpa"]).abs().max()) <= 1e-4 * scale


@pytest.mark.parametrize("family, setting", SETUPS)
def test_cuda_graph_replay_equals_eager(family: str, setting: str) -> None:
    """Two masked requests on different templates, the second joining one step later: the
    shared composition is warmed up, captured and replayed; outputs equal the eager path."""
    from instgenie.engine.graphs import StepGraphs
    from tests.engine.test_graphs import _run_staggered

    pipe = cuda_pipeline(family, setting)
    ex = pipe.family.masked
    keys = [
        pipe.build_template(
            TemplateSpec(image=png_bytes(make_image(128, 128, seed=s)), num_inference_steps=6)
        )  # fmt: skip
        for s in (1, 2)
    ]
    reqs = [
        EditRequest(
            uid=f"r{i}",
            image=None,
            template_id=k,
            seed=i,
            prompt=f"a hat {i}",
            mask=png_bytes(make_mask(128, 128, (0.1 * i, 0.2, 0.6, 0.7))),
            num_inference_steps=6,
            paste_back=False,
        )  # fmt: skip
        for i, k in enumerate(keys)
    ]
    saved = ex.graphs
    try:
        ex.graphs = StepGraphs(ex.device, "off")
        eager = _run_staggered(pipe, reqs)
        ex.graphs = StepGraphs(ex.device, "all")
        graphed = _run_staggered(pipe, reqs)
        ex.graphs.clear()  # every graph gone: the next capture needs a fresh memory pool
        again = _run_staggered(pipe, reqs)
        counters, mode = dict(ex.graphs.counters), ex.graphs.mode
    finally:
        ex.graphs = saved
    assert mode == "all", "a capture failed"
    assert counters["capture"] >= 2 and counters["replay"] >= 6, counters
    for a, b, c in zip(eager, graphed, again, strict=True):
        assert float((a - b).abs().max()) <= 1e-5 * float(a.abs().max())
        assert torch.equal(b, c)


def test_capture_only_when_it_pays() -> None:
    """INSTGENIE_GRAPH_CAPTURE=auto: the first composition of a batch shape is captured (its
    costs are not known yet); once its costs say a capture does not pay within the horizon, a
    new composition of that shape runs eagerly (its first call counted as a warm-up); an
    unknown horizon captures."""
    from instgenie.engine.graphs import COST_MIN_SAMPLES, COST_SAMPLES, StepGraphs

    pipe = cuda_pipeline("sdxl-inpaint")
    ex = pipe.family.masked
    key = pipe.build_template(
        TemplateSpec(image=png_bytes(make_image(128, 128, seed=3)), num_inference_steps=6)
    )

    def run(known_horizon: bool) -> torch.Tensor:
        req = EditRequest(uid="r", image=None, template_id=key, seed=5, prompt="a hat",
                          mask=png_bytes(make_mask(128, 128, (0.2, 0.2, 0.6, 0.7))),
                          num_inference_steps=6, paste_back=False)  # fmt: skip
        s = pipe.preprocess(req)
        while not s.is_done:
            horizon = s.num_steps - s.step_index if known_horizon else None
            planned_step(pipe, [s], horizon=horizon)
        return s.latents

    saved = ex.graphs
    try:
        ex.graphs = StepGraphs(ex.device, "off")
        ref = run(True)
        g = ex.graphs = StepGraphs(ex.device, "all")
        first = run(True)
        after_first = dict(g.counters)
        torch.cuda.synchronize()
        g._read_timings()
        (shape,) = {s for _, s in g.costs._ms}
        measured = {k: list(g.costs._ms[(k, shape)]) for k in ("eager", "replay", "capture")}
        for k in ("eager", "replay"):  # repeat the measured costs up to a trusted count
            while len(g.costs._ms[(k, shape)]) < COST_MIN_SAMPLES:
                g.costs.add(k, shape, measured[k][-1])
        for _ in range(COST_SAMPLES):  # as if a capture of this shape took 1000 s
            g.costs.add("capture", shape, 1e6)
        second = run(True)
        after_second = dict(g.counters)
        third = run(False)
        after_third, mode = dict(g.counters), g.mode
    finally:
        ex.graphs = saved
    assert mode == "all", "a capture failed"
    assert after_first == {"capture": 1, "warmup": 1, "eager": 0, "replay": 4}
    assert [len(v) for v in measured.values()] == [1, 4, 1], measured  # one warm-up, 4 replays
    assert all(x > 0 for v in measured.values() for x in v), measured
    assert after_second == {"capture": 1, "warmup": 2, "eager": 5, "replay": 4}
    # unknown horizon: captured, and on its first call (the shape was captured before)
    assert after_third == {"capture": 2, "warmup": 2, "eager": 5, "replay": 9}
    for out in (first, second, third):
        assert float((out - ref).abs().max()) <= 1e-5 * float(ref.abs().max())


@pytest.mark.parametrize("family", ["sdxl-inpaint", "flux-fill"])
def test_first_call_capture_of_a_captured_shape(family: str) -> None:
    """Once a batch shape was captured, a new composition of it (another mask, other token
    counts) is captured on its first call, with no warm-up, and replays what eager computes.
    A two-request batch covers the varlen attention with several query lengths."""
    from instgenie.engine.graphs import StepGraphs

    pipe = cuda_pipeline(family)
    ex = pipe.family.masked
    key = pipe.build_template(
        TemplateSpec(image=png_bytes(make_image(128, 128, seed=4)), num_inference_steps=6)
    )

    def reqs(shift: float) -> list[EditRequest]:
        return [EditRequest(uid=f"r{i}", image=None, template_id=key, seed=i, prompt=f"a cap {i}",
                            mask=png_bytes(make_mask(128, 128, (shift * i, 0.1, 0.5 + shift, 0.8))),
                            num_inference_steps=6, paste_back=False)  # fmt: skip
                for i in range(2)]  # fmt: skip

    def run(batch: list[EditRequest]) -> list[torch.Tensor]:
        states = [pipe.preprocess(r) for r in batch]
        while not all(s.is_done for s in states):
            planned_step(pipe, states, horizon=min(s.num_steps - s.step_index for s in states))
        return [s.latents for s in states]

    saved = ex.graphs
    try:
        ex.graphs = StepGraphs(ex.device, "off")
        refs = [run(reqs(shift)) for shift in (0.1, 0.3)]
        g = ex.graphs = StepGraphs(ex.device, "all")
        first = run(reqs(0.1))  # warm-up, capture at call 2
        before = dict(g.counters)
        second = run(reqs(0.3))  # another composition of the same shape
        after, mode, first_ok = dict(g.counters), g.mode, g.capture_first
    finally:
        ex.graphs = saved
    assert mode == "all" and first_ok, "a capture failed"
    assert before == {"capture": 1, "warmup": 1, "eager": 0, "replay": 4}
    assert {k: after[k] - before[k] for k in after} == {
        "capture": 1,
        "warmup": 0,
        "eager": 0,
        "replay": 5,
    }
    for ref, out in zip(refs, (first, second), strict=True):
        for a, b in zip(ref, out, strict=True):
            assert float((a - b).abs().max()) <= 1e-5 * float(a.abs().max())


def test_failed_first_call_capture_falls_back_to_warm_ups() -> None:
    """A first-call capture that fails: the step's output is the eager one, graphs stay on, and
    from then on compositions warm up before their capture (on call 2)."""
    from instgenie.engine.graphs import StepGraphs

    pipe = cuda_pipeline("sdxl-inpaint")
    ex = pipe.family.masked
    key = pipe.build_template(
        TemplateSpec(image=png_bytes(make_image(128, 128, seed=6)), num_inference_steps=4)
    )

    def run(box) -> torch.Tensor:
        req = EditRequest(uid="r", image=None, template_id=key, seed=2, prompt="a scarf",
                          mask=png_bytes(make_mask(128, 128, box)), num_inference_steps=4,
                          paste_back=False)  # fmt: skip
        s = pipe.preprocess(req)
        while not s.is_done:
            planned_step(pipe, [s], horizon=s.num_steps - s.step_index)
        return s.latents

    boxes = [(0.1, 0.1, 0.5, 0.6), (0.3, 0.2, 0.9, 0.7), (0.0, 0.0, 0.4, 0.4)]
    saved = ex.graphs
    try:
        ex.graphs = StepGraphs(ex.device, "off")
        refs = [run(b) for b in boxes]
        g = ex.graphs = StepGraphs(ex.device, "all")
        outs = [run(boxes[0])]  # the shape is captured (on call 2)
        capture = g._capture
        failures = []

        def failing_once(ctx, fn, entry, shape):
            if not failures:
                failures.append(entry.calls)
                raise RuntimeError("injected capture failure")
            return capture(ctx, fn, entry, shape)

        g._capture = failing_once
        before = dict(g.counters)
        outs.append(run(boxes[1]))  # first-call capture fails: eager, then captured on call 2
        after = dict(g.counters)
        outs.append(run(boxes[2]))  # warms up first now
        last, mode, first_ok = dict(g.counters), g.mode, g.capture_first
    finally:
        ex.graphs = saved
    assert failures == [1] and mode == "all" and not first_ok
    assert {k: after[k] - before[k] for k in after} == {
        "capture": 1,
        "warmup": 1,
        "eager": 0,
        "replay": 2,
    }
    assert {k: last[k] - after[k] for k in last} == {
        "capture": 1,
        "warmup": 1,
        "eager": 0,
        "replay": 2,
    }
    for ref, out in zip(refs, outs, strict=True):
        assert float((out - ref).abs().max()) <= 1e-5 * float(ref.abs().max())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_norm_rope_compiled(dtype: torch.dtype) -> None:
    """The compiled fused RMSNorm + RoPE kernel at Flux's shapes against its torch reference."""
    from triton_kernels.rmsnorm_rope import rmsnorm_rope, rmsnorm_rope_reference

    g = torch.Generator(device="cuda").manual_seed(0)
    N, H, D, P = 4608, 24, 128, 4608
    x = (3 * torch.randn(N, H, D, device="cuda", generator=g)).to(dtype)
    w = (1 + 0.3 * torch.randn(D, device="cuda", generator=g)).to(dtype)
    angle = torch.rand(P, D // 2, device="cuda", generator=g) * 6.28
    cos, sin = angle.cos().repeat_interleave(2, 1), angle.sin().repeat_interleave(2, 1)
    pos = torch.randperm(P, device="cuda", generator=g)[:N]
    dst = torch.randperm(N + 100, device="cuda", generator=g)[:N]
    for diffusers in (False, True):
        out = torch.zeros(N + 100, H, D, device="cuda", dtype=dtype)
        ref = torch.zeros_like(out)
        rmsnorm_rope(x, w, 1e-6, cos, sin, pos, out, dst, diffusers)
        rmsnorm_rope_reference(x, w, 1e-6, cos, sin, pos, ref, dst, diffusers)
        unit = 2**-7 if dtype == torch.bfloat16 else 2**-10
        tol = 2 * unit * float(ref.abs().max())  # as in tests/kernels/test_rmsnorm_rope.py
        assert float((out.float() - ref.float()).abs().max()) <= tol


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_group_norm_compiled(dtype: torch.dtype, layout: str) -> None:
    """The compiled GroupNorm(+SiLU) kernel at SDXL UNet/VAE shapes against float64 values."""
    from triton_kernels.group_norm import group_norm, group_norm_reference

    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = [
        (2, 320, 128, 128),
        (16, 1280, 32, 32),
        (1, 128, 512, 512),
        (2, 2560, 8, 8),
        (2, 32, 1, 1),
    ]  # the last: one element per group (integer arguments equal to 1)
    for shape in shapes:
        x = (2 * torch.randn(shape, device="cuda", generator=g) + 3).to(dtype)
        if layout == "nhwc":
            x = x.to(memory_format=torch.channels_last)
        w = (1 + 0.3 * torch.randn(shape[1], device="cuda", generator=g)).to(dtype)
        b = (0.5 * torch.randn(shape[1], device="cuda", generator=g)).to(dtype)
        for silu in (False, True):
            y = group_norm(x, 32, w, b, 1e-5, silu)
            want = group_norm_reference(x.double(), 32, w.double(), b.double(), 1e-5, silu)
            torch_y = group_norm_reference(x, 32, w, b, 1e-5, silu)
            unit = {torch.float16: 2**-11, torch.bfloat16: 2**-8, torch.float32: 2e-6}[dtype]
            tol = 2 * unit * float(want.abs().max())
            err = float((y.double() - want).abs().max())
            assert err <= tol and err <= float((torch_y.double() - want).abs().max()) + tol
            assert y.stride() == x.stride()  # x's memory format


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_geglu_compiled(dtype: torch.dtype) -> None:
    """The compiled GEGLU gating kernel at SDXL feed-forward shapes against torch's chunk, gelu
    and mul. Per element: two output ulps (gelu's rounding and the product's may each flip),
    plus the float32 absolute error of 1 + erf(g / sqrt 2) (|g| * 2**-23 in gelu, times |h|),
    where torch's normcdf stays relative-accurate."""
    from triton_kernels.geglu import geglu, geglu_reference

    g = torch.Generator(device="cuda").manual_seed(0)
    for shape in [(16, 1024, 2 * 5120), (2, 4096, 2 * 2560), (3, 77, 2 * 640)]:
        p = (3 * torch.randn(shape, device="cuda", generator=g)).to(dtype)
        out, want = geglu(p), geglu_reference(p)
        assert out.shape == want.shape and out.dtype == dtype
        h, gate = p.double().chunk(2, dim=-1)
        unit = {torch.float16: 2**-10, torch.bfloat16: 2**-7, torch.float32: 2**-22}[dtype]
        bound = 2 * unit * want.double().abs() + 2**-22 * (h * gate).abs() + 2**-23
        assert bool(((out.double() - want.double()).abs() <= bound).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_conv_bias_compiled_is_bit_identical(dtype: torch.dtype) -> None:
    """cuDNN's unbiased convolution + the compiled bias kernel equals torch's biased Conv2d bit
    for bit at SDXL UNet/VAE shapes, NCHW and channels_last (torch adds the bias with one
    float32 add_ as well)."""
    from instgenie.engine import fused_conv

    g = torch.Generator(device="cuda").manual_seed(0)
    for n, cin, cout, hw, k in [(2, 320, 320, 128, 3), (16, 1280, 1280, 32, 3),
                                (2, 640, 1280, 64, 1), (1, 4, 320, 128, 3)]:  # fmt: skip
        conv = torch.nn.Conv2d(cin, cout, k, padding=k // 2).to("cuda", dtype)
        with torch.no_grad():
            conv.bias.normal_(0, 1, generator=g)
            x = torch.randn(n, cin, hw, hw, device="cuda", generator=g).to(dtype)
            swapped = fused_conv.BiasKernelConv2d(conv)
            for fmt in (torch.contiguous_format, torch.channels_last):  # both kernels
                conv.to(memory_format=fmt)
                xf = x.contiguous(memory_format=fmt)
                want = conv(xf)
                got = swapped(xf)
                assert got.is_contiguous(memory_format=fmt)
                assert torch.equal(got, want)
        assert swapped.kernel_calls == 2


def test_fused_kernels_in_sdxl_unet_fp16() -> None:
    """The swapped SDXL UNet (tiny, fp16, CUDA) runs the GroupNorm, GEGLU and conv-bias kernels
    in every swapped module and matches the stock ops (switches off) to fp16 rounding."""
    from instgenie.engine import fused_conv, fused_geglu, fused_norms

    pipe = EditPipeline.load("sdxl-inpaint:tiny", device="cuda", dtype="fp16")
    unet = pipe.family.unet
    kinds = (fused_norms.FusedGroupNorm, fused_geglu.FusedGEGLU, fused_conv.BiasKernelConv2d)
    swapped = [m for m in unet.modules() if isinstance(m, kinds)]
    assert {type(m) for m in swapped} == set(kinds)
    g = torch.Generator(device="cuda").manual_seed(1)
    cfg = unet.config
    s = cfg.sample_size
    kw = dict(
        sample=torch.randn(2, cfg.in_channels, s, s, device="cuda", generator=g).half(),
        timestep=torch.tensor([500.0, 20.0], device="cuda"),
        encoder_hidden_states=torch.randn(2, 7, cfg.cross_attention_dim, device="cuda",
                                          generator=g).half(),
        added_cond_kwargs={
            "text_embeds": torch.randn(2, cfg.projection_class_embeddings_input_dim - 48,
                                       device="cuda", generator=g).half(),
            "time_ids": (torch.rand(2, 6, device="cuda", generator=g) * 64).half(),
        },
    )  # fmt: skip
    saved = [m.mode for m in swapped]
    try:
        with torch.no_grad():
            for m in swapped:
                m.mode = "auto"
            got = unet(**kw).sample
            for m in swapped:
                m.mode = "off"
            want = unet(**kw).sample
    finally:
        for m, mode in zip(swapped, saved, strict=True):
            m.mode = mode
    assert all(m.kernel_calls == 1 for m in swapped)
    assert float((got - want).abs().max()) <= 1e-2 * float(want.abs().max())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_step_copy_compiled(dtype: torch.dtype) -> None:
    """The compiled step-copy kernel against index_select at SDXL/Flux cache-stack shapes,
    including the last-row slice (a CFG template serving a request without CFG)."""
    from triton_kernels.step_copy import copy_step, copy_step_reference

    for shape in [(4, 2, 1024, 1280), (3, 1, 4096, 3072), (3, 2, 4096, 640)]:
        stack = torch.randn(shape, device="cuda").to(dtype)
        for src in (stack, stack[:, shape[1] - 1 :]):
            for s in range(shape[0]):
                step = torch.tensor([s], device="cuda")
                out = copy_step(src, step, torch.empty(src.shape[1:], device="cuda", dtype=dtype))
                want = copy_step_reference(src, step, torch.empty_like(out))
                assert torch.equal(out, want)


_SECOND_GPU = """
import torch
from instgenie.config import ExecConfig
from instgenie.engine.pipeline import EditPipeline
from instgenie.engine.request import EditRequest
from instgenie.engine.templates import TemplateSpec
from tests.conftest import make_image, make_mask, png_bytes

pipe = EditPipeline.load("{family}:tiny", device="cuda:1", dtype="fp32")
assert torch.cuda.current_device() == 1, torch.cuda.current_device()
img, mask = png_bytes(make_image(128, 128, seed=1)), png_bytes(make_mask(128, 128))
key = pipe.build_template(TemplateSpec(image=img, num_inference_steps=2))
s = pipe.preprocess(EditRequest(uid="m", image=None, template_id=key, mask=mask, prompt="a hat",
                                seed=3, num_inference_steps=2))
while not s.is_done:
    pipe.denoise_step([s])
assert s.path == "masked" and s.latents.device == torch.device("cuda:1")
assert bool(torch.isfinite(s.latents).all())
print("ok")
"""


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("family", ["sdxl-inpaint", "flux-fill"])
def test_a_pipeline_on_the_second_gpu_runs_its_triton_kernels(family: str) -> None:
    """A fresh process (current device cuda:0) serving cuda:1, as a server's second worker
    does: before, every step that ran a Triton kernel failed ("Pointer argument cannot be
    accessed from Triton"), since Triton launches on the current device."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-c", _SECOND_GPU.format(family=family)], cwd=root,
                       capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]

"""ExecConfig: how the model executes (kernels, memory layout, CUDA graphs, sparse execution,
output encoding), settable by flag or INSTGENIE_* variable; re-exported by instgenie.config,
which reads the `#:` comments here as flag help."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field

#: ExecConfig.attention_backend values (engine/attention.py BACKENDS)
ATTENTION_BACKENDS = ("auto", "triton", "flash", "sdpa")
#: ExecConfig.cuda_graphs values (engine/graphs.py MODES)
GRAPH_MODES = ("all", "masked", "off")
#: ExecConfig.graph_capture values (engine/graphs.py CAPTURE_POLICIES)
CAPTURE_POLICIES = ("buckets", "auto", "always")
#: ExecConfig.fused_* values (engine/kernels.py kernel_enabled)
KERNEL_MODES = ("auto", "on", "off")
#: ExecConfig.sparse_convs values (engine/masked/conv_blocks.py)
SPARSE_CONVS = ("auto", "off")
#: ExecConfig.kv_cache values (engine/masked/flux_kv.py)
KV_CACHE = ("on", "off")
#: ExecConfig.png_compression values (engine/imageio.py PNG_SETTINGS)
PNG_COMPRESSION = ("fast", "default", "small")


def _switch(default: typing.Any, env: str, choices: tuple[str, ...] | None = None) -> typing.Any:
    """An ExecConfig field: its environment variable and, for a string, its allowed values."""
    return field(default=default, metadata={"env": env, "choices": choices})


@dataclass(frozen=True)
class ExecConfig:
    """How the model executes: attention kernel, memory layout, CUDA graphs, fused kernels, the
    output's PNG compression. Set
    once at start (a flag, else its INSTGENIE_* variable, else the default) and fixed for the
    process; every process of a worker gets it in its config. None of these changes what an edit
    computes beyond a kernel's documented rounding (decisions 0004, 0011, 0013-0015, 0020)."""

    #: varlen attention of masked steps: "auto" (the Triton kernel on CUDA where Triton works,
    #: else SDPA) | "triton" | "flash" (flash-attn) | "sdpa" (engine/attention.py); one that
    #: cannot run on the device fails the model load
    attention_backend: str = _switch("auto", "INSTGENIE_ATTENTION_BACKEND", ATTENTION_BACKENDS)
    #: UNets in NHWC (channels_last) on CUDA, kept NHWC through their transformer stacks
    #: (decision 0004); off: NCHW
    channels_last: bool = _switch(True, "INSTGENIE_UNET_CHANNELS_LAST")
    #: which denoising steps replay CUDA graphs: "all" | "masked" (only steps that read a
    #: template cache) | "off" (also no text-encoder graphs) (engine/graphs.py, decision 0011)
    cuda_graphs: str = _switch("all", "INSTGENIE_CUDA_GRAPHS", GRAPH_MODES)
    #: when step graphs are captured: "buckets" (at start only: masked steps pad to a bucket of
    #: rows and token capacity and replay its graph, full-path steps replay the warm-up's shape,
    #: everything else runs eagerly; serving never captures; decision 0051) | "auto" (while
    #: serving, each composition whose measured costs say the graph pays before the batch
    #: changes) | "always" (every eligible one on its second call) (decision 0020)
    graph_capture: str = _switch("buckets", "INSTGENIE_GRAPH_CAPTURE", CAPTURE_POLICIES)
    #: let cuDNN pick convolution algorithms by timing them (torch.backends.cudnn.benchmark) on
    #: CUDA; off: its heuristics
    cudnn_benchmark: bool = _switch(False, "INSTGENIE_CUDNN_BENCHMARK")
    #: GroupNorm + SiLU as one Triton kernel pair: "auto" (on CUDA) | "on" (also elsewhere, e.g.
    #: CPU under TRITON_INTERPRET=1) | "off" (torch's ops: stock diffusers) (decision 0013)
    fused_group_norm: str = _switch("auto", "INSTGENIE_FUSED_GROUPNORM", KERNEL_MODES)
    #: GEGLU gating (SDXL/SD2 feed-forwards) as one Triton kernel: "auto" (on CUDA) | "on" |
    #: "off" (torch's chunk, gelu and mul) (decision 0014)
    fused_geglu: str = _switch("auto", "INSTGENIE_FUSED_GEGLU", KERNEL_MODES)
    #: Conv2d biases added by a vectorised Triton kernel: "auto" (on CUDA) | "on" | "off"
    #: (torch's biased convolution) (decision 0015)
    fused_conv_bias: str = _switch("auto", "INSTGENIE_FUSED_CONV_BIAS", KERNEL_MODES)
    #: ResNets and up/down-samplers of UNet families compute only the tiles covering an edit's
    #: masked tokens plus their kernels' halo, reading the rest from the template's cache, which
    #: then also holds their outputs and GroupNorm statistics (1.6x the bytes): "auto" (each
    #: block where the load planner prices it cheaper than computing every token; a step that
    #: replays a bucket graph computes them on whole maps in it, with the template's
    #: statistics, and keeps the tiles' values, decision 0054) | "off" (only
    #: transformer blocks are masked; the default: the cache is 1.63x larger, decision 0043)
    sparse_convs: str = _switch("off", "INSTGENIE_SPARSE_CONVS", SPARSE_CONVS)
    #: Flux families: a template's cache holds every block's keys and values of its image tokens
    #: instead of the block's output, and a masked block projects only its masked tokens (the
    #: unmasked ones' keys and values are the template's, computed under its prompt's pooled
    #: embedding): "on" (-25 % of a masked block's FLOPs at m = 0.2; 2x the cache's bytes) |
    #: "off"; UNet families are unchanged (decision 0052)
    kv_cache: str = _switch("off", "INSTGENIE_KV_CACHE", KV_CACHE)
    #: PNG outputs' zlib effort: "fast" (level 1, run-length matching) | "default" (Pillow's
    #: level 6) | "small" (9); lossless, only the bytes and the encode time differ (decision 0040)
    png_compression: str = _switch("fast", "INSTGENIE_PNG_COMPRESSION", PNG_COMPRESSION)
    #: VAE-decode only the crop around a masked edit's mask (engine/cropped_decode.py) when it
    #: read a template cache and is pasted back, and its decoder statistics stay within the
    #: template's: "auto" (where the crop is at most 0.6 of the latent map) | "on" (any crop
    #: size, the whole map included) | "off" (always the whole image) (decision 0044)
    cropped_decode: str = _switch("auto", "INSTGENIE_CROPPED_DECODE", KERNEL_MODES)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value, choices = getattr(self, f.name), f.metadata["choices"]
            if choices is None:
                if not isinstance(value, bool):
                    raise ValueError(f"{f.name}: expected true or false, got {value!r}")
            elif value not in choices:
                raise ValueError(f"{f.name}: {value!r} is not one of {', '.join(choices)}")


#: ExecConfig's defaults (a library caller that passes none: no flag, no environment read)
EXEC_DEFAULTS = ExecConfig()
#: the words an environment variable may use for a boolean ExecConfig field
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def env_overrides(cls: type, environ: Mapping[str, str]) -> dict[str, typing.Any]:
    """{field: value} for each field of `cls` whose metadata `env` variable is set in `environ`:
    stripped and lower-cased, a boolean from 1/true/yes/on or 0/false/no/off. ValueError naming
    the variable for a value the field does not take."""
    out: dict[str, typing.Any] = {}
    for f in dataclasses.fields(cls):
        name = f.metadata.get("env")
        if name is None or name not in environ:
            continue
        text = environ[name].strip().lower()
        choices = f.metadata.get("choices")
        if f.type in (bool, "bool"):
            if text not in _TRUE + _FALSE:
                raise ValueError(f"{name}={environ[name]!r}: expected 1 or 0 (true/false)")
            out[f.name] = text in _TRUE
        elif choices is not None and text not in choices:
            raise ValueError(f"{name}={environ[name]!r}: expected one of {', '.join(choices)}")
        else:
            out[f.name] = text
    return out

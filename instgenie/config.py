"""One frozen configuration tree. Each component receives only its own sub-config.

CLI flags are generated from these dataclass fields (see `add_dataclass_args`), so a field added
here is a flag everywhere it is exposed, with its `#:` comment as the help text (`field_help`
reads the comments from the source: they stay the one place a setting is documented).

A field whose metadata names an `env` variable (ExecConfig's) can also be set by that variable:
a flag given wins, else the variable, else the default. The environment is read when a command
builds its config from its flags (`dataclass_from_args`, once at start); nothing here or in
the engine reads it at import or later, and worker processes get the values in their config.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import decimal
import functools
import inspect
import re
import textwrap
import typing
from dataclasses import dataclass, field

from instgenie.exec_config import (  # noqa: F401 - re-exported: the config tree's home
    ATTENTION_BACKENDS,
    CAPTURE_POLICIES,
    EXEC_DEFAULTS,
    GRAPH_MODES,
    KERNEL_MODES,
    PNG_COMPRESSION,
    ExecConfig,
    env_overrides,
)


@dataclass(frozen=True)
class ModelConfig:
    #: "FAMILY:SIZE" with SIZE in {tiny, full, ref}, or "FAMILY:/path/to/diffusers/dir"
    model: str = "sdxl-inpaint:tiny"
    #: torch device string, e.g. "cpu", "cuda", "cuda:1"
    device: str = "cpu"
    #: weights/activation dtype; "auto" = float32 on CPU, the family's GPU dtype on CUDA
    dtype: str = "auto"
    #: VAE dtype; "auto" = the family's choice (SDXL with float16 weights: float32, as its VAE
    #: config asks; otherwise the model's dtype), or a dtype name such as "bf16" (decision 0021)
    vae_dtype: str = "auto"
    #: capacity of each model process's prompt-encoder output cache, bytes; 0 turns it off
    prompt_cache_bytes: int = 256 << 20
    #: replay the text encoders' forward from CUDA graphs on CUDA (prompt-cache misses; decision
    #: 0022); --cuda-graphs off also turns it off
    text_encoder_graphs: bool = True
    #: pixels (at the working size) around an edit's mask that its masked path computes under
    #: the edit's prompt too, instead of reading the template's cache; paste-back still keeps
    #: only the mask. Closer to the full path, more tokens per step (decision 0050); 0: the
    #: mask's own tokens
    compute_margin: int = 0
    #: how the model executes (kernels, layout, graphs); its fields are flags of their own
    execution: ExecConfig = field(default_factory=ExecConfig)

    def __post_init__(self) -> None:
        # checked here, not with the model (check_model_config): the API server's process
        # builds this config without torch, and a bad value must not reach the workers
        margin = self.compute_margin
        if isinstance(margin, bool) or not isinstance(margin, int) or margin < 0:
            raise ValueError(f"compute_margin: must be a pixel count >= 0, got {margin!r}")


@dataclass(frozen=True)
class LimitsConfig:
    """Input limits checked before any decoding or model work (RELIABILITY.md items 1-3)."""

    #: largest image/mask a model works on, in pixels (width * height), checked from the header;
    #: 0 = the model family's native area x 4 (engine/sizing.py: SDXL and Flux 1024^2 -> 4194304,
    #: SD2 512^2 -> 1048576, every `tiny` model 128^2 -> 65536). Larger images are refused (413)
    #: or, with oversize="resize", worked on at the native area
    max_image_pixels: int = 0
    #: images over max_image_pixels: "refuse" (413 image_too_large) or "resize" (diffusion at
    #: the family's native area, keeping the aspect ratio; the result is resized back to the
    #: input's size and the unmasked input pixels pasted back at full resolution)
    oversize: str = "refuse"
    #: with oversize="resize": largest accepted image/mask, pixels, checked from the header
    #: (decoding, resizing and paste-back still run at this size)
    max_input_pixels: int = 8192 * 8192
    #: image container formats accepted, as Pillow format names
    allowed_formats: tuple[str, ...] = ("PNG", "JPEG", "WEBP")
    #: largest accepted num_inference_steps
    max_steps: int = 200
    #: largest accepted prompt, in characters
    max_prompt_chars: int = 4000
    #: largest accepted guidance scale
    max_guidance_scale: float = 100.0

    def __post_init__(self) -> None:
        if self.oversize not in OVERSIZE_POLICIES:
            raise ValueError(f"oversize: {self.oversize!r} is not one of {OVERSIZE_POLICIES}")
        for name in ("max_image_pixels", "max_input_pixels"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")

    @property
    def decode_pixels(self) -> int:
        """The most pixels an image may have to be decoded at all (its header is checked
        against this): max_image_pixels, or under oversize="resize" max_input_pixels. An
        unresolved max_image_pixels (0: no model named yet; engine/sizing.resolve_limits) is
        UNRESOLVED_PIXELS here."""
        cap = self.max_image_pixels or UNRESOLVED_PIXELS
        if self.oversize == "resize":
            return max(cap, self.max_input_pixels)
        return cap


#: the decoding cap of limits not yet resolved against a model (LimitsConfig.decode_pixels), pixels
UNRESOLVED_PIXELS = 4096 * 4096
#: LimitsConfig.oversize values
OVERSIZE_POLICIES = ("refuse", "resize")


#: the largest LoRA rank the segmented kernel serves (triton_kernels/segmented_lora._MAX_RANK)
LORA_RANK_LIMIT = 256


@dataclass(frozen=True)
class LoraConfig:
    """Per-request LoRA adapters (instgenie/lora): where registered files live, limits, caches."""

    #: directory of registered LoRA files (<sha256>.safetensors, written by the API, read by
    #: every worker of the host); "" = "loras" beside the server's state (under the cache root)
    lora_dir: str = ""
    #: largest rank a LoRA layer may have; larger files are refused (lora_rank_too_large)
    lora_max_rank: int = 128
    #: most LoRAs one edit may name
    lora_max_per_request: int = 4
    #: device memory the loop keeps loaded adapters in (LRU, adapters in use are kept), bytes
    lora_gpu_bytes: int = 2 << 30
    #: host memory each model process keeps parsed adapters in (LRU), bytes
    lora_host_bytes: int = 8 << 30
    #: bounded asynchronous loading (Katz / SwiftDiffusion): an edit whose adapter is still
    #: loading runs at most this many steps without it, then waits; 0 = wait from the start.
    #: 1: on the reference model (20 steps) K = 1 kept all of a style LoRA's effect, K = 3 77 %
    #: (docs/benchmarks/lora.md)
    lora_async_steps: int = 1

    def __post_init__(self) -> None:
        for name in ("lora_max_rank", "lora_max_per_request"):
            if not getattr(self, name) >= 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.lora_max_rank > LORA_RANK_LIMIT:
            raise ValueError(f"lora_max_rank: at most {LORA_RANK_LIMIT} (the segmented LoRA "
                             f"kernel's), got {self.lora_max_rank}")  # fmt: skip
        for name in ("lora_gpu_bytes", "lora_host_bytes", "lora_async_steps"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class WorkerConfig:
    """One worker = one GPU: supervisor, denoise loop, pre/post-processing processes."""

    #: batching policy: "continuous" | "static" | "naive-continuous" (scheduler/batching.py)
    policy: str = "continuous"
    #: most requests in one denoising batch
    max_batch: int = 8
    #: most requests held by the worker (queued, preparing, denoising, post-processing);
    #: beyond it submissions fail with code "overloaded" (retryable)
    max_queue: int = 256
    #: pre-processing processes (image decode, prompt and VAE encode)
    num_pre: int = 1
    #: post-processing processes (VAE decode, paste-back, image encode)
    num_post: int = 1
    #: where the prompt encoders and the VAE run: "loop" (in the denoise loop process, between
    #: steps: one CUDA context, so no time-slicing against another process; the pre/post
    #: processes then only decode/validate/resize and paste back/encode images, with no model)
    #: or "process" (in the pre/post processes, on `stage_device`). Measured in
    #: docs/decisions/0009-worker-stage-placement.md. naive-continuous runs everything in the loop.
    model_stages: str = "loop"
    #: torch device of the pre/post processes' encoders and VAE (model_stages="process"); "" =
    #: the model's device
    stage_device: str = ""
    #: run a private template through capture, masked edits and VAE decode before reporting
    #: ready, so the first requests do not pay the cold start (worker/warmup.py): "auto" (on
    #: CUDA), "on", "off"; not with model_stages="process" (the loop cannot encode)
    warmup: str = "auto"
    #: a child that has not loaded its model parts after this long, seconds, is restarted
    start_timeout_s: float = 900.0
    #: seconds between heartbeats of each child process
    heartbeat_interval_s: float = 0.5
    #: a child silent (no heartbeat) this long, seconds, is killed and restarted
    heartbeat_timeout_s: float = 10.0
    #: a child whose loop makes no progress this long while holding requests, seconds, is
    #: killed and restarted (covers the first step's warm-up on a GPU)
    stall_timeout_s: float = 120.0
    #: one model stage call of the loop outside a step (prompt + VAE encode of an arriving
    #: request, VAE decode of retiring ones) counts as progress for this long, seconds; past it
    #: the loop is stuck (huge images on a CPU can take minutes; on a GPU it is well under 1 s)
    stage_timeout_s: float = 900.0
    #: a child that exited is restarted after at least this long, seconds
    restart_backoff_s: float = 1.0
    #: a template whose capture run was lost this many times (its process died) fails
    max_template_attempts: int = 2
    #: step-log entries kept by the supervisor (GetStepLog)
    step_log_size: int = 10_000
    #: directory of the host DRAM + disk activation cache (templates found again after a
    #: restart; its DRAM tier is shared memory, shared by the host's workers); "auto" =
    #: $INSTGENIE_CACHE_ROOT if set, else $XDG_CACHE_HOME/instgenie/activations, else
    #: ~/.cache/instgenie/activations (cache/budgets.py); "" (or an empty INSTGENIE_CACHE_ROOT) =
    #: templates cached in the loop's device memory (lost, and re-captured, when it restarts)
    cache_root: str = "auto"
    #: host DRAM tier capacity, bytes (with a cache root); -1 = auto: 50% of MemAvailable,
    #: capped by the free space of /dev/shm less a reserve (cache/budgets.py); a template larger
    #: than this (or arriving while DRAM is full of entries in use) is captured straight to disk
    #: and streamed from it
    cache_dram_bytes: int = -1
    #: disk tier capacity, bytes (with a cache root); 0 disables the disk tier; -1 = auto: 50% of
    #: the free space of the cache root's filesystem (cache/budgets.py)
    cache_disk_bytes: int = -1
    #: device tier above the host cache, bytes (with a cache root): an LRU hot set of templates
    #: copied into the loop's device memory from their second use on (cache/device_tier.py);
    #: -1 = auto: 80% of the device's free memory once the model is loaded, less 4 GiB + 10% of
    #: its total (graph pools, activations), and 0 on a CPU device; 0 = off
    cache_gpu_bytes: int = -1
    #: how a capture's block outputs reach its host DRAM segment (cache/host_store.py): "auto" =
    #: "staged" on CUDA machines (async DMA into pinned staging slots, host threads back and
    #: fill the segment, pinned at commit: no page registration stalls the loop, decision
    #: 0046), else "direct"; "pinned" registers the fresh segment first (decision 0036: a stall
    #: of ≈ 0.34-0.8 s per GiB at the capture's first step); "direct": synchronous copies
    cache_capture_copies: str = "auto"
    #: fitted latency profile (JSON, `instgenie profile`) for the per-step load planner; ""
    #: = no planner (every cached block is loaded)
    profile: str = ""
    #: per-request LoRA adapters
    lora: LoraConfig = field(default_factory=LoraConfig)

    def __post_init__(self) -> None:
        if self.model_stages not in ("loop", "process"):
            raise ValueError(f"model_stages: {self.model_stages!r} is not one of loop, process")
        if self.warmup not in ("auto", "on", "off"):
            raise ValueError(f"warmup: {self.warmup!r} is not one of auto, on, off")
        for name in _AT_LEAST_ONE:
            value = getattr(self, name)
            if not value >= 1:
                raise ValueError(f"{name}: must be >= 1, got {value}")
        for name in _POSITIVE:
            value = getattr(self, name)
            if not value > 0:  # also refuses NaN
                raise ValueError(f"{name}: must be > 0, got {value}")
        for name in _NON_NEGATIVE:
            value = getattr(self, name)
            if not value >= 0:
                raise ValueError(f"{name}: must be >= 0, got {value}")
        if self.cache_capture_copies not in CAPTURE_COPIES:
            raise ValueError(f"cache_capture_copies: {self.cache_capture_copies!r} is not one of "
                             f"{', '.join(CAPTURE_COPIES)}")  # fmt: skip
        if not self.cache_gpu_bytes >= -1:
            raise ValueError(f"cache_gpu_bytes: must be >= -1 (auto), got {self.cache_gpu_bytes}")
        for name in ("cache_dram_bytes", "cache_disk_bytes"):
            value, least = getattr(self, name), 1 if name == "cache_dram_bytes" else 0
            if not (value >= least or value == AUTO_BYTES):
                raise ValueError(f"{name}: must be >= {least} or {AUTO_BYTES} (auto), got {value}")
        if not self.heartbeat_timeout_s > self.heartbeat_interval_s:
            raise ValueError(
                f"heartbeat_timeout_s: must be > heartbeat_interval_s "
                f"({self.heartbeat_interval_s}), got {self.heartbeat_timeout_s}"
            )


#: WorkerConfig.cache_capture_copies values
CAPTURE_COPIES = ("auto", "staged", "pinned", "direct")
#: WorkerConfig fields that are counts or capacities: a value below 1 cannot work
_AT_LEAST_ONE = (
    "max_batch",
    "max_queue",
    "num_pre",
    "num_post",
    "max_template_attempts",
    "step_log_size",
)
#: WorkerConfig durations for which 0 makes no sense (a child would be restarted at once)
_POSITIVE = (
    "start_timeout_s",
    "heartbeat_interval_s",
    "heartbeat_timeout_s",
    "stall_timeout_s",
    "stage_timeout_s",
)
#: WorkerConfig fields where 0 is meaningful (restart at once)
_NON_NEGATIVE = ("restart_backoff_s",)
#: WorkerConfig.cache_root: derive the cache root from the machine (cache/budgets.py)
AUTO_ROOT = "auto"
#: WorkerConfig.cache_dram_bytes / cache_disk_bytes: derive the budget from the machine
AUTO_BYTES = -1


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)


def to_dict(cfg: typing.Any) -> dict:
    """A config dataclass as plain JSON-able data (tuples become lists)."""
    return dataclasses.asdict(cfg)


def from_dict(cls: type, data: dict) -> typing.Any:
    """The inverse of `to_dict` for config class `cls`; TypeError on unknown or bad fields."""
    if not isinstance(data, dict):
        raise TypeError(f"{cls.__name__}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - names
    if unknown:
        raise TypeError(f"{cls.__name__}: unknown fields {sorted(unknown)}")
    kwargs = {}
    for name, value in data.items():
        typ = hints[name]
        if dataclasses.is_dataclass(typ):
            value = from_dict(typ, value)
        elif typing.get_origin(typ) is tuple:
            value = tuple(value)
        kwargs[name] = value
    return cls(**kwargs)


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's help ends with its default; an empty string default reads `""`."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = super()._get_help_string(action) or ""
        return text.replace("%(default)s", '""') if action.default == "" else text


@functools.cache
def field_help(cls: type) -> dict[str, str]:
    """{field name: its `#:` comment lines above it, joined} of a config dataclass, read from
    its source; {} when the source is not available."""
    try:
        lines, _ = inspect.getsourcelines(cls)
    except (OSError, TypeError):
        return {}
    tree = ast.parse(textwrap.dedent("".join(lines)))
    out: dict[str, str] = {}
    for node in tree.body[0].body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        comment: list[str] = []
        i = node.lineno - 2  # the line above the field, 0-based
        while i >= 0 and lines[i].strip().startswith("#:"):
            comment.insert(0, lines[i].strip().removeprefix("#:").strip())
            i -= 1
        out[node.target.id] = " ".join(comment)
    return out


#: byte units a `--*-bytes` flag accepts (decimal and binary), lower case
_BYTE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
               "gb": 10**9, "t": 10**12, "tb": 10**12, "kib": 1 << 10, "mib": 1 << 20,
               "gib": 1 << 30, "tib": 1 << 40}  # fmt: skip
_BYTE_COUNT = re.compile(r"\s*(-?[0-9]+(?:\.[0-9]*)?(?:[eE]\+?[0-9]+)?)\s*([A-Za-z]*)\s*")


def byte_count(text: str) -> int:
    """A `--*-bytes` flag's value: an integer ("8589934592", "-1"), scientific notation
    ("40e9"), or a number with a unit ("8GiB", "40 GB", "1.5TB"); a fraction of a byte is
    refused."""
    m = _BYTE_COUNT.fullmatch(text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _BYTE_UNITS:
        raise argparse.ArgumentTypeError(
            f"not a byte count: {text!r} (e.g. 8589934592, 40e9, 8GiB, 512MB)"
        )
    value = decimal.Decimal(m.group(1)) * _BYTE_UNITS[unit]
    if value != value.to_integral_value():
        raise argparse.ArgumentTypeError(f"not a whole number of bytes: {text!r}")
    return int(value)


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type, *, skip: tuple = ()) -> None:
    """Add one `--kebab-name` flag per field of dataclass `cls` (defaults from the class, help
    from the field's comment: `field_help`). Integer fields named `*_bytes` take `byte_count`
    values ("40e9", "8GiB"); a field with `choices` metadata takes only those; a nested config
    dataclass (ModelConfig.execution) adds the flags of its own fields. A field with an `env`
    variable has no argparse default (a flag not given leaves it unset: `dataclass_from_args`
    then takes the variable, else the default, which its help names)."""
    hints = typing.get_type_hints(cls)
    helps = field_help(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        typ = hints[f.name]
        if dataclasses.is_dataclass(typ):
            add_dataclass_args(parser, typ, skip=skip)
            continue
        text = helps.get(f.name, "").replace("%", "%%") or None  # argparse %-formats help
        extra: dict[str, typing.Any] = {}
        if f.metadata.get("choices"):
            extra["choices"] = f.metadata["choices"]
        if f.metadata.get("env"):
            shown = ("on" if default else "off") if typ is bool else default
            text = f"{text or ''} (default: {shown}; ${f.metadata['env']} overrides the default)"
            default = argparse.SUPPRESS
        if typ is bool:
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=default, help=text
            )
        elif typing.get_origin(typ) is tuple:
            parser.add_argument(flag, nargs="+", default=default, help=text)
        elif typ is int and f.name.endswith("_bytes"):
            parser.add_argument(flag, type=byte_count, default=default, help=text)
        else:
            parser.add_argument(flag, type=typ, default=default, help=text, **extra)


def dataclass_from_args(cls: type, args: argparse.Namespace, **overrides: typing.Any):
    """Build `cls` from the parsed flags that `add_dataclass_args` added. A field with an `env`
    variable and no flag given takes the variable's value if it is set (read here, from the
    process environment: instgenie.env.exec_environ); nested configs are built the same way.
    ValueError (naming the field or the variable) for a value the config refuses."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    fields = dataclasses.fields(cls)
    unset = {f.metadata["env"] for f in fields if f.metadata.get("env") and f.name not in args}
    if unset:  # a flag given replaces its variable: that one is not even parsed
        from instgenie import env  # the one reader of os.environ

        environ = {k: v for k, v in env.exec_environ().items() if k in unset}
        kwargs.update(env_overrides(cls, environ))
    for f in fields:
        if dataclasses.is_dataclass(hints[f.name]) and f.name not in overrides:
            kwargs[f.name] = dataclass_from_args(hints[f.name], args)
        elif hasattr(args, f.name):
            value = getattr(args, f.name)
            kwargs[f.name] = tuple(value) if isinstance(value, list) else value
    kwargs.update(overrides)
    return cls(**kwargs)

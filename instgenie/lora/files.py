"""Reading a LoRA file: safetensors bytes -> one low-rank pair per adapted linear layer.

Formats: diffusers/PEFT (`unet.<module>.lora_A.weight`, `lora_B`), the older diffusers forms
(`<module>.lora.down.weight`, attention-processor `to_q_lora.down`), and kohya/A1111
(`lora_unet_*`, `lora_te1_*`, `lora_te2_*`, Flux's `lora_unet_double_blocks_*`). The non-diffusers
formats are converted by diffusers' own `lora_state_dict` of the family's pipeline class (the
conversion diffusers' `load_lora_weights` runs); the remaining renames use diffusers' key tables.

Scale of a layer: alpha / rank, alpha from the file's per-layer `.alpha` keys, else the PEFT
metadata's `lora_alpha`, else alpha = rank (scale 1), as diffusers does.
Invariant: `read_lora` either returns every pair of the file or raises a typed LoraError; it
never returns part of a file.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from diffusers.utils.state_dict_utils import (
    DIFFUSERS_OLD_TO_PEFT,
    DIFFUSERS_TO_PEFT,
    UNET_TO_DIFFUSERS,
)
from safetensors import SafetensorError, safe_open
from safetensors.torch import load as load_safetensors

from instgenie.errors import LoraFileError, LoraUnknownKeys

#: components a LoRA may adapt; the backbone is "unet" (SD2, SDXL) or "transformer" (Flux)
COMPONENTS = ("unet", "transformer", "text_encoder", "text_encoder_2")
BACKBONES = ("unet", "transformer")
_TEXT_RENAMES = {**DIFFUSERS_OLD_TO_PEFT, **DIFFUSERS_TO_PEFT}


@dataclass(frozen=True)
class LoraLayer:
    #: one of COMPONENTS, and the nn.Linear's path inside it (diffusers / transformers names)
    component: str
    module: str
    #: (rank, in_features) and (out_features, rank), on the CPU, in the file's dtype
    down: torch.Tensor
    up: torch.Tensor
    #: alpha / rank: delta(x) = scale * up @ down @ x
    scale: float

    @property
    def rank(self) -> int:
        return int(self.down.shape[0])

    @property
    def key(self) -> tuple[str, str]:
        return (self.component, self.module)


@dataclass(frozen=True)
class LoraWeights:
    layers: tuple[LoraLayer, ...]
    #: the one buffer every pair is a view of (the store's host tier), else None
    flat: torch.Tensor | None = None

    @property
    def max_rank(self) -> int:
        return max(layer.rank for layer in self.layers)

    @property
    def components(self) -> frozenset[str]:
        return frozenset(layer.component for layer in self.layers)

    def nbytes(self, itemsize: int = 2) -> int:
        """Bytes the pairs take in a dtype of `itemsize` bytes (the model's on the device)."""
        return itemsize * sum(layer.down.numel() + layer.up.numel() for layer in self.layers)

    def part(self, components: frozenset[str] | set[str]) -> LoraWeights:
        return LoraWeights(tuple(x for x in self.layers if x.component in components))


def read_lora(data: bytes, pipeline_cls: type, unet_config: Mapping | None = None) -> LoraWeights:
    """Parse and convert a LoRA file for a family whose diffusers pipeline is `pipeline_cls`."""
    try:
        raw = load_safetensors(data)
    except (SafetensorError, ValueError, RuntimeError, OSError) as exc:
        raise LoraFileError("file", f"not a readable safetensors file ({exc})") from None
    if not raw:
        raise LoraFileError("file", "the file holds no tensors")
    return convert(raw, _metadata(data), pipeline_cls, unet_config)


def part_of_key(key: str) -> str:
    """ "text" or "backbone": which model part a raw key of a LoRA file adapts (any format)."""
    return "text" if key.startswith(("text_encoder", "lora_te")) else "backbone"


def read_part(path, part: str, pipeline_cls: type, unet_config: Mapping | None = None):
    """Only the `part` ("text" | "backbone") of a LoRA file, read lazily from disk (a prompt
    encode needs the small text part now; the backbone part loads beside the batch). None if
    the file adapts nothing of that part."""
    try:
        with safe_open(str(path), framework="pt") as f:
            keys = [k for k in f.keys() if part_of_key(k) == part]
            raw = {k: f.get_tensor(k) for k in keys}
            metadata = f.metadata() or {}
    except (SafetensorError, ValueError, RuntimeError) as exc:
        raise LoraFileError("file", f"not a readable safetensors file ({exc})") from None
    if not raw:
        return None
    return convert(raw, metadata, pipeline_cls, unet_config)


def convert(raw: dict, metadata: dict, pipeline_cls: type,
            unet_config: Mapping | None = None) -> LoraWeights:  # fmt: skip
    """A LoRA state dict (any format) as pairs per linear layer."""
    dora = sorted(k for k in raw if "dora_scale" in k or "lora_magnitude_vector" in k)
    if dora:
        raise LoraUnknownKeys("file", f"DoRA weights are not supported ({dora[0]})")
    kwargs = {"unet_config": unet_config} if unet_config is not None else {}
    log_level = logging.getLogger("diffusers").level
    logging.getLogger("diffusers").setLevel(logging.ERROR)  # its format warnings: we raise instead
    try:
        out = pipeline_cls.lora_state_dict(dict(raw), **kwargs)
    except Exception as exc:  # diffusers' converters raise many kinds on foreign layouts
        raise LoraUnknownKeys("file", f"not a LoRA layout this model accepts ({exc})") from None
    finally:
        logging.getLogger("diffusers").setLevel(log_level)
    state, alphas = (out[0], out[1] or {}) if isinstance(out, tuple) else (out, {})
    return _pairs(state, alphas, metadata)


def _metadata(data: bytes) -> dict:
    """The safetensors header's __metadata__ (PEFT writes lora_adapter_metadata there)."""
    try:
        size = int.from_bytes(data[:8], "little")
        return json.loads(data[8 : 8 + size]).get("__metadata__") or {}
    except (ValueError, UnicodeDecodeError):
        return {}


def _rename(component: str, rest: str) -> str:
    """A converted key (without its component) in PEFT form: `<module>.lora_A.weight`."""
    rest = rest.replace(".processor.", ".")
    table = UNET_TO_DIFFUSERS if component in BACKBONES else _TEXT_RENAMES
    for old, new in table.items():
        if old in rest:
            rest = rest.replace(old, new)
    rest = rest.replace(".lora_down.", ".lora_A.").replace(".lora_up.", ".lora_B.")
    return rest


def _split(key: str) -> tuple[str, str, str]:
    """(component, module, "A" | "B") of a LoRA weight key; LoraUnknownKeys otherwise."""
    component, _, rest = key.partition(".")
    if component not in COMPONENTS:
        raise LoraUnknownKeys("file", f"key {key!r} adapts no component this server knows")
    rest = _rename(component, rest)
    for half in ("A", "B"):
        marker = f".lora_{half}."
        if marker in rest:
            module, _, tail = rest.partition(marker)
            if tail == "weight":
                return component, module, half
    raise LoraUnknownKeys("file", f"key {key!r} is not a LoRA down/up weight")


def _global_alpha(metadata: dict) -> float | None:
    try:
        meta = json.loads(metadata.get("lora_adapter_metadata", "{}"))
        alpha = meta.get("lora_alpha")
        return None if alpha is None else float(alpha)
    except (ValueError, TypeError, AttributeError):
        return None


def _pairs(state: dict, alphas: Mapping, metadata: dict) -> LoraWeights:
    halves: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        component, module, half = _split(key)
        halves.setdefault((component, module), {})[half] = tensor
    alpha_of: dict[tuple[str, str], float] = {}
    for key, value in alphas.items():
        # diffusers names an alpha after the down weight it scales: "<down key>.alpha"
        down_key = key[: -len(".alpha")] if key.endswith(".alpha") else key
        try:
            component, module, _ = _split(down_key)
        except LoraUnknownKeys:
            continue
        alpha_of[(component, module)] = float(value)
    default_alpha = _global_alpha(metadata)
    layers = []
    for (component, module), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            missing = "up (lora_B)" if "B" not in pair else "down (lora_A)"
            raise LoraFileError("file", f"{component}.{module}: the {missing} weight is missing")
        down, up = pair["A"], pair["B"]
        if down.ndim == 4 and down.shape[2:] == (1, 1) and up.ndim == 4 and up.shape[2:] == (1, 1):
            down, up = down.flatten(1), up.flatten(1)  # 1x1 convolutions stored for a linear
        if down.ndim != 2 or up.ndim != 2:
            raise LoraUnknownKeys(
                "file", f"{component}.{module}: only linear layers are adapted "
                f"(down {tuple(down.shape)}, up {tuple(up.shape)})",
            )  # fmt: skip
        if up.shape[1] != down.shape[0]:
            raise LoraFileError(
                "file", f"{component}.{module}: ranks differ (down {tuple(down.shape)}, "
                f"up {tuple(up.shape)})",
            )  # fmt: skip
        if not (_finite(down) and _finite(up)):
            raise LoraFileError("file", f"{component}.{module}: non-finite weights")
        rank = down.shape[0]
        alpha = alpha_of.get((component, module), default_alpha)
        scale = 1.0 if alpha is None else alpha / rank
        layers.append(LoraLayer(component, module, down.contiguous(), up.contiguous(), scale))
    if not layers:
        raise LoraFileError("file", "the file holds no LoRA weight pairs")
    return LoraWeights(tuple(layers))


def _finite(t: torch.Tensor) -> bool:
    """No inf or NaN in `t`. A sum is finite only if every term is (inf and NaN propagate), so a
    finite sum (float32 accumulation at least) proves it in one reduction; only a sum that
    overflows is checked element by element (7x less CPU: docs/benchmarks/lora.md)."""
    half = t.is_floating_point() and t.element_size() < 4
    if torch.isfinite(t.sum(dtype=torch.float32) if half else t.sum()):
        return True
    return bool(torch.isfinite(t).all())

"""The model-family Protocol, model specs ("FAMILY:SIZE" / "FAMILY:/dir") and the registry.

A family adapter is a thin layer over a diffusers pipeline object: it reuses the pipeline's own
prompt encoding, image processors, VAE encode and latent preparation (so pre-processing matches
diffusers exactly), and replaces only the denoising loop with `denoise_step(batch, plan)`, whose
batch may mix requests at different steps (plan: the step's StepPlan, scheduler/step.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from PIL import Image

from instgenie.config import EXEC_DEFAULTS, ExecConfig, ModelConfig
from instgenie.errors import ModelLoadError, ValidationError

if TYPE_CHECKING:
    from instgenie.engine.request import EditRequest, RequestState
    from instgenie.scheduler.step import StepPlan

#: tiny / full: random weights built in code; ref: the reference models this project trained
#: (instgenie/reference), shipped as diffusers directories under instgenie/assets/ref
SIZES = ("tiny", "full", "ref")
#: where `FAMILY:ref` loads from
REF_ROOT = Path(__file__).resolve().parent.parent / "assets" / "ref"


@dataclass(frozen=True)
class ModelSpec:
    family: str
    #: "tiny", "full", "ref", or a local diffusers directory
    size: str

    @property
    def is_local_dir(self) -> bool:
        return self.size not in SIZES

    @property
    def directory(self) -> Path | None:
        """The diffusers directory the weights load from (None: built in code)."""
        if self.size == "ref":
            return REF_ROOT / self.family
        return Path(self.size) if self.is_local_dir else None

    @classmethod
    def parse(cls, text: str) -> ModelSpec:
        family, sep, size = text.partition(":")
        if not sep or not family or not size:
            raise ModelLoadError(
                f"model spec {text!r} must be FAMILY:SIZE (SIZE in {SIZES}) or FAMILY:/path/to/dir"
            )
        if family not in family_names():
            raise ModelLoadError(f"unknown model family {family!r}; known: {family_names()}")
        if size not in SIZES and not Path(size).is_dir():
            raise ModelLoadError(
                f"model size {size!r} is neither one of {SIZES} nor an existing local directory"
            )
        if size == "ref" and not (REF_ROOT / family / "model_index.json").is_file():
            have = sorted(p.parent.name for p in REF_ROOT.glob("*/model_index.json"))
            raise ModelLoadError(f"there is no reference model of {family!r}; there are: {have}")
        return cls(family, size)

    def __str__(self) -> str:
        return f"{self.family}:{self.size}"


@runtime_checkable
class ModelFamily(Protocol):
    """What every family adapter provides."""

    name: str
    spec: ModelSpec
    device: torch.device
    dtype: torch.dtype
    #: how it executes (kernels, layout, graphs), fixed at load
    execution: ExecConfig
    default_steps: int
    default_guidance: float
    #: image sides must be multiples of this many pixels
    granule: int
    #: the native resolution (square side, pixels)
    default_size: int
    #: pixels per token side at the first transformer grid; a block of level k has tokens
    #: token_stride * 2**k pixels on a side (engine.masked.hooks.BlockInfo.level)
    token_stride: int
    #: prompt tokens per conditioning row
    text_len: int
    #: pixels around an edit's mask that its masked path also computes (ModelConfig)
    compute_margin: int
    #: the diffusers pipeline object whose modules and helpers the adapter uses
    pipe: Any
    #: the denoising backbone (UNet or transformer) and its masked-execution binding
    backbone: torch.nn.Module
    masked: Any
    #: prompt-encoder outputs by prompt (engine/prompt_cache.py)
    prompts: Any
    #: text towers replayed from CUDA graphs, by pipeline attribute (engine/encoder_graphs.py)
    text_graphs: dict[str, Any]
    #: its VAE decode with the cropped path (engine/cropped_decode.py), or None without a VAE
    cropped: Any

    def encode_texts(self, prompt: str, negative_prompt: str | None, do_cfg: bool) -> tuple:
        """The text towers' outputs for one prompt (the prompt cache's entry), not cached."""
        ...

    def warm_up_text_graphs(self) -> float:
        """Capture the text towers' graphs before the first request; ms (0.0: none)."""
        ...

    def resolve_steps_guidance(
        self, steps: int | None, guidance: float | None
    ) -> tuple[int, float]:
        """The request's values, or the family's defaults."""
        ...

    def uses_cfg(self, guidance: float) -> bool:
        """Whether a request with this guidance scale runs classifier-free guidance rows."""
        ...

    def token_masks(self, mask: torch.Tensor) -> dict[int, torch.Tensor]:
        """{L: bool (L,)} tokens to compute at every transformer resolution, from a (1, 1, H, W)
        binary pixel mask."""
        ...

    def edit_mask(self, masks: dict[int, torch.Tensor], state: RequestState) -> torch.Tensor:
        """bool, broadcastable to the state's latents: True where latents are edited."""
        ...

    def prepare(
        self, request: EditRequest, image: Image.Image, mask: Image.Image, height: int, width: int
    ) -> RequestState:
        """Encode prompt, VAE-encode template and masked image, draw seeded noise, build tables."""
        ...

    def denoise_step(self, batch: list[RequestState], plan: StepPlan) -> None:
        """Advance every request of `batch` by one step (each at its own step index), in place,
        as `plan` (the batcher's decision for this step: its members are exactly `batch`) says."""
        ...

    def decode(self, batch: list[RequestState]) -> list[Image.Image]:
        """VAE-decode finished requests to images at working resolution."""
        ...


def family_names() -> list[str]:
    return sorted(_registry())


def _registry() -> dict[str, type]:
    from instgenie.engine.adapters.flux_fill import FluxFill
    from instgenie.engine.adapters.sd2_inpaint import SD2Inpaint
    from instgenie.engine.adapters.sdxl_inpaint import SDXLInpaint

    return {cls.name: cls for cls in (SD2Inpaint, SDXLInpaint, FluxFill)}


def resolve_dtype(family_cls: type, device: str, dtype: str) -> torch.dtype:
    from instgenie.engine.build import parse_dtype

    if dtype != "auto":
        return parse_dtype(dtype)
    return family_cls.gpu_dtype if torch.device(device).type == "cuda" else torch.float32


def check_model_config(model: ModelConfig) -> None:
    """ValidationError naming the field when the model spec, device or dtype cannot work on this
    machine: checked before any weights are loaded or any work is done."""
    try:
        ModelSpec.parse(model.model)
    except ModelLoadError as exc:
        raise ValidationError("model", exc.message) from None
    try:
        device = torch.device(model.device)
    except RuntimeError as exc:
        raise ValidationError("device", str(exc)) from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValidationError("device", f"{model.device!r}: this machine has no CUDA device")
        if device.index is not None and device.index >= count:
            raise ValidationError("device", f"{model.device!r}: there are {count} CUDA devices")
    elif device.type != "cpu":
        raise ValidationError("device", f"{model.device!r}: only cpu and cuda[:N] are supported")
    for name in ("dtype", "vae_dtype"):
        value = getattr(model, name)
        if value != "auto":
            from instgenie.engine.build import parse_dtype

            try:
                parse_dtype(value)
            except ValueError as exc:
                raise ValidationError(name, str(exc)) from None
    if not model.prompt_cache_bytes >= 0:
        raise ValidationError(
            "prompt_cache_bytes", f"must be >= 0 bytes, got {model.prompt_cache_bytes}"
        )


def family_options(model: ModelConfig) -> dict[str, Any]:
    """load_family's keyword arguments that come from the model config besides device/dtype."""
    return {
        "vae_dtype": model.vae_dtype,
        "prompt_cache_bytes": model.prompt_cache_bytes,
        "text_encoder_graphs": model.text_encoder_graphs,
        "execution": model.execution,
        "compute_margin": model.compute_margin,
    }


def load_family(
    spec: str | ModelSpec,
    device: str = "cpu",
    dtype: str = "auto",
    parts: str = "all",
    *,
    vae_dtype: str = "auto",
    prompt_cache_bytes: int = ModelConfig.prompt_cache_bytes,
    text_encoder_graphs: bool = ModelConfig.text_encoder_graphs,
    execution: ExecConfig = EXEC_DEFAULTS,
    compute_margin: int = ModelConfig.compute_margin,
) -> ModelFamily:
    """Build or load a model family adapter. Never touches the network. `parts`: "all",
    "backbone" (denoise loop), "stages" (pre/post-processing) or "none" (image codec work
    only); see AdapterBase.load. `vae_dtype`: "auto" (the family's choice) or a dtype name;
    `prompt_cache_bytes`: the prompt cache's capacity (0: off); `text_encoder_graphs`: replay the
    text encoders from CUDA graphs on CUDA (engine/encoder_graphs.py); `execution`: kernels,
    layout and graphs (config.ExecConfig); `compute_margin`: pixels around an edit's mask that
    its masked path also computes (config.ModelConfig.compute_margin)."""
    spec = spec if isinstance(spec, ModelSpec) else ModelSpec.parse(spec)
    cls = _registry()[spec.family]
    if device.startswith("cuda") and torch.device(device).index is not None:
        # Triton launches on the *current* CUDA device and refuses pointers of another one
        # ("cannot be accessed from Triton"): a process serves one device, make it current
        # (a worker on cuda:1 otherwise failed every step that ran a Triton kernel)
        torch.cuda.set_device(torch.device(device))
    if device.startswith("cuda") and execution.cudnn_benchmark:
        # shapes repeat every step: let cuDNN time its convolution algorithms once per shape
        torch.backends.cudnn.benchmark = True
    from instgenie.engine.build import parse_dtype

    return cls.load(
        spec,
        device=device,
        dtype=resolve_dtype(cls, device, dtype),
        parts=parts,
        vae_dtype=None if vae_dtype == "auto" else parse_dtype(vae_dtype),
        prompt_cache_bytes=prompt_cache_bytes,
        text_encoder_graphs=text_encoder_graphs,
        execution=execution,
        compute_margin=compute_margin,
    )

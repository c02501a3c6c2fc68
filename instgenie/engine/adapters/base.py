"""What all family adapters share: loading (tiny / full / ref / local directory), per-request
scheduler copies, and the proxy that lets diffusers' own pipeline methods run with a private
scheduler.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import torch
from diffusers import DiffusionPipeline
from PIL import Image

from instgenie.config import EXEC_DEFAULTS, ExecConfig, ModelConfig
from instgenie.engine.build import build_seeded
from instgenie.engine.cropped_decode import CroppedDecoder
from instgenie.engine.encoder_graphs import graph_text_encoders
from instgenie.engine.family import ModelSpec
from instgenie.engine.fused_conv import fuse_conv_bias
from instgenie.engine.fused_geglu import fuse_geglu
from instgenie.engine.fused_norms import fuse_group_norms
from instgenie.engine.masked.executor import MaskedExecutor
from instgenie.engine.prompt_cache import PromptCache
from instgenie.engine.weights import own_cpu_weights
from instgenie.errors import ModelLoadError, ValidationError

log = logging.getLogger(__name__)

#: seed of every random-weight model; identical in every process (see build.build_seeded)
WEIGHTS_SEED = 0
#: default capacity of each adapter's prompt-encoder cache, bytes
PROMPT_CACHE_BYTES: int = ModelConfig.prompt_cache_bytes
#: default: replay the text towers from CUDA graphs on CUDA (engine/encoder_graphs.py)
TEXT_ENCODER_GRAPHS: bool = ModelConfig.text_encoder_graphs

#: which model parts a process does not need (built on the meta device: configs, no weights)
META_PARTS: dict[str, frozenset[str]] = {
    "all": frozenset(),
    "backbone": frozenset({"text", "vae"}),
    "stages": frozenset({"backbone"}),
    "none": frozenset({"text", "vae", "backbone"}),  # image codec only: configs, no weights
}


class PipelineView:
    """Stands in for `self` when calling a diffusers pipeline method.

    Attribute reads fall through to the shared pipeline, except `scheduler` (a private per-request
    copy, so no shared mutable scheduler state is touched) and any per-call overrides.
    """

    def __init__(self, pipe: DiffusionPipeline, scheduler: Any, **overrides: Any) -> None:
        self.__dict__["_pipe"] = pipe
        self.__dict__["scheduler"] = scheduler
        self.__dict__.update(overrides)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_pipe"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        # diffusers methods may cache values on self; keep them on the view, never on the pipe
        self.__dict__[name] = value


class AdapterBase:
    name: ClassVar[str]
    pipeline_cls: ClassVar[type[DiffusionPipeline]]
    scheduler_cls: ClassVar[type]
    gpu_dtype: ClassVar[torch.dtype]
    default_steps: ClassVar[int] = 50
    default_guidance: ClassVar[float]
    #: keyword arguments for pipeline_cls(...) and from_pretrained(...)
    pipeline_kwargs: ClassVar[dict[str, Any]] = {}
    #: attribute of the pipeline holding the denoising backbone ("unet" / "transformer")
    backbone_name: ClassVar[str]

    def __init__(
        self,
        spec: ModelSpec,
        pipe: DiffusionPipeline,
        device: torch.device,
        dtype: torch.dtype,
        *,
        vae_dtype: torch.dtype | None = None,
        prompt_cache_bytes: int = PROMPT_CACHE_BYTES,
        text_encoder_graphs: bool = TEXT_ENCODER_GRAPHS,
        execution: ExecConfig = EXEC_DEFAULTS,
        compute_margin: int = 0,
    ) -> None:
        self.spec = spec
        self.pipe = pipe
        self.device = device
        self.dtype = dtype
        #: kernels, layout and graphs (config.ExecConfig), fixed for the adapter's life
        self.execution = execution
        #: pixels around an edit's mask that its masked path computes too (ModelConfig)
        self.compute_margin = compute_margin
        pipe.set_progress_bar_config(disable=True)
        self.backbone = getattr(pipe, self.backbone_name)
        self.vae = getattr(pipe, "vae", None)
        if self.vae is not None:
            # every VAE call casts its input to this dtype and its output back (encode_vae_image,
            # decode); None: the family's choice (auto_vae_dtype)
            target = vae_dtype or self.auto_vae_dtype()
            if self.vae.dtype != target:
                self.vae.to(target)
        #: prompt-encoder outputs by prompt (engine/prompt_cache.py); 0 bytes: off
        self.prompts = PromptCache(prompt_cache_bytes)
        #: text towers replayed from CUDA graphs, by pipeline attribute (engine/encoder_graphs.py)
        self.text_graphs = (
            graph_text_encoders(pipe, device)
            if text_encoder_graphs and execution.cuda_graphs != "off"
            else {}
        )
        # GroupNorm (+ SiLU) of UNet and VAE ResNets through one Triton kernel pair on CUDA
        for part in (self.backbone, self.vae):
            if part is not None:
                fuse_group_norms(part, execution.fused_group_norm)
                # Conv2d biases by a vectorised kernel on CUDA
                fuse_conv_bias(part, execution.fused_conv_bias)
        # GEGLU's chunk + gelu + mul of SDXL/SD2 feed-forwards as one Triton pass on CUDA
        fuse_geglu(self.backbone, execution.fused_geglu)
        #: hooks every transformer block; inert unless a step needs masked execution or capture
        self.masked = MaskedExecutor(self.backbone, device, execution)
        #: decode with the cropped path for pasted-back masked edits (engine/cropped_decode.py);
        #: its LRU of templates' decoder statistics lives in the process that decodes
        self.cropped = (
            None
            if self.vae is None
            else CroppedDecoder(
                self.vae, execution.cropped_decode, self.to_pil, pipe.vae_scale_factor
            )
        )

    def encode_texts(self, prompt: str, negative_prompt: str | None, do_cfg: bool) -> tuple:
        """The text towers' outputs for one prompt (the prompt cache's entry), not cached."""
        raise NotImplementedError

    def warm_up_text_graphs(self) -> float:
        """Capture the text towers' CUDA graphs now, with an empty prompt, so that the first
        request does not pay for the capture (150-250 ms; decision 0022); workers call it before
        they report ready. Returns the ms it took (0.0 without graphs). Leaves the prompt cache
        as it was."""
        if not self.text_graphs:
            return 0.0
        t0 = time.perf_counter()
        with torch.inference_mode():
            self.encode_texts("", None, self.uses_cfg(self.default_guidance))
        torch.cuda.synchronize(self.device)
        return 1e3 * (time.perf_counter() - t0)

    def auto_vae_dtype(self) -> torch.dtype:
        """The VAE's dtype when ModelConfig.vae_dtype is "auto": the model's dtype."""
        return self.dtype

    def to_pil(self, images: torch.Tensor) -> list[Image.Image]:
        """`pipe.image_processor.postprocess(images, "pil")` with the scaling and rounding to
        uint8 done on the tensors' device: the same bytes (denormalize in the tensors' dtype, then
        float32 * 255 rounded half to even, as numpy does), a quarter of the bytes copied to the
        host and no float32 numpy passes in the loop's process (11-17 ms per 1024² image)."""
        proc = self.pipe.image_processor
        if not proc.config.do_normalize or images.shape[1] != 3:
            return proc.postprocess(images, output_type="pil")
        u8 = (proc.denormalize(images).float() * 255).round().to(torch.uint8)
        return [Image.fromarray(a) for a in u8.permute(0, 2, 3, 1).cpu().numpy()]

    # ---- loading -------------------------------------------------------------------------
    @classmethod
    def load(
        cls,
        spec: ModelSpec,
        *,
        device: str,
        dtype: torch.dtype,
        parts: str = "all",
        vae_dtype: torch.dtype | None = None,
        prompt_cache_bytes: int = PROMPT_CACHE_BYTES,
        text_encoder_graphs: bool = TEXT_ENCODER_GRAPHS,
        execution: ExecConfig = EXEC_DEFAULTS,
        compute_margin: int = 0,
    ) -> AdapterBase:
        """parts: "all"; "backbone" (the denoise loop: text encoders and VAE are built on the
        meta device, configs only, no memory); "stages" (pre/post-processing: the backbone on
        meta). Local directories always load every part. `vae_dtype`: None = the family's choice
        (auto_vae_dtype); `prompt_cache_bytes`: the prompt cache's capacity (0: off);
        `text_encoder_graphs`: replay the text towers from CUDA graphs on CUDA; `execution`:
        kernels, layout and graphs (config.ExecConfig); `compute_margin`: pixels around an
        edit's mask its masked path computes too (config.ModelConfig.compute_margin)."""
        dev = torch.device(device)
        if spec.directory is not None:
            pipe = cls._from_dir(spec.directory, dev, dtype)
        else:
            meta = META_PARTS[parts]
            comps = cls.build_components(spec.size, build=cls.builder(str(dev), dtype, meta))
            pipe = cls.pipeline_cls(**comps, **cls.pipeline_kwargs)
        cls._check_pipeline(pipe)
        return cls(
            spec,
            pipe,
            dev,
            dtype,
            vae_dtype=vae_dtype,
            prompt_cache_bytes=prompt_cache_bytes,
            text_encoder_graphs=text_encoder_graphs,
            execution=execution,
            compute_margin=compute_margin,
        )

    @staticmethod
    def builder(device: str, dtype: torch.dtype, meta_parts: frozenset[str]) -> Callable:
        """build(factory, seed_offset, part) -> module, seeded, on `device` or on "meta"."""

        def build(factory: Callable[[], Any], offset: int, part: str) -> Any:
            dev = "meta" if part in meta_parts else device
            return build_seeded(factory, seed=WEIGHTS_SEED + offset, device=dev, dtype=dtype)

        return build

    @classmethod
    def build_components(cls, size: str, *, build: Callable) -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    def _from_dir(cls, path: Path, device: torch.device, dtype: torch.dtype) -> DiffusionPipeline:
        index = path / "model_index.json"
        if not index.is_file():
            raise ModelLoadError(
                f"{path} is not a diffusers pipeline directory (no model_index.json)"
            )
        try:
            class_name = json.loads(index.read_text()).get("_class_name")
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"{index} is unreadable: {exc}") from exc
        if class_name != cls.pipeline_cls.__name__:
            raise ModelLoadError(
                f"could not load {cls.name} from {path}: it holds a {class_name}, "
                f"this family needs a {cls.pipeline_cls.__name__}"
            )
        try:
            pipe = cls.pipeline_cls.from_pretrained(
                str(path), torch_dtype=dtype, local_files_only=True, **cls.pipeline_kwargs
            )
        except Exception as exc:  # diffusers raises many types; report them as one load error
            raise ModelLoadError(f"could not load {cls.name} from {path}: {exc}") from exc
        if not isinstance(pipe.scheduler, cls.scheduler_cls):
            # batched stepping needs a single-step Euler-family scheduler (noise_schedule.py)
            log.info(
                "replacing %s by %s", type(pipe.scheduler).__name__, cls.scheduler_cls.__name__
            )
            pipe.scheduler = cls.scheduler_cls.from_config(pipe.scheduler.config)
        pipe = pipe.to(device)
        for comp in pipe.components.values():
            if isinstance(comp, torch.nn.Module):  # CPU weights out of the files' maps
                own_cpu_weights(comp)
        return pipe

    @classmethod
    def _check_pipeline(cls, pipe: DiffusionPipeline) -> None:
        """Family-specific structural checks (input channels, scheduler)."""

    # ---- per-request helpers ---------------------------------------------------------------
    def new_scheduler(self) -> Any:
        """A private scheduler with the pipeline's config: per-request tables, no shared state."""
        sched = self.pipe.scheduler
        return type(sched).from_config(sched.config)

    def view(self, scheduler: Any, **overrides: Any) -> PipelineView:
        return PipelineView(self.pipe, scheduler, **overrides)

    @staticmethod
    def generator(seed: int) -> torch.Generator:
        """Seed semantics: a CPU generator, consumed in diffusers' order (noise, VAE sampling)."""
        return torch.Generator(device="cpu").manual_seed(int(seed))

    def resolve_steps_guidance(
        self, steps: int | None, guidance: float | None
    ) -> tuple[int, float]:
        return (
            self.default_steps if steps is None else int(steps),
            self.default_guidance if guidance is None else float(guidance),
        )

    @staticmethod
    def check_num_steps(num_steps: int, strength: float) -> None:
        if num_steps < 1:
            raise ValidationError(
                "strength",
                f"strength {strength} leaves {num_steps} denoising steps; increase strength or "
                "num_inference_steps so that at least one step runs",
            )

    @staticmethod
    def step_vectors(batch: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(timestep, sigma, sigma_next) for each request at its own step index; float32, CPU."""
        idx = [s.step_index for s in batch]
        t = torch.stack([s.timesteps[i] for s, i in zip(batch, idx, strict=True)])
        sig = torch.stack([s.sigmas[i] for s, i in zip(batch, idx, strict=True)])
        nxt = torch.stack([s.sigmas[i + 1] for s, i in zip(batch, idx, strict=True)])
        return t, sig, nxt

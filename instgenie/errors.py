"""Typed errors. Every user-facing failure is one of these, with a precise message.

Invariant: a `ValidationError` is raised before any model work starts for the request, so a
rejected request has consumed no GPU time and left no state behind.
"""

from __future__ import annotations

#: exit status of a command or worker process whose model could not be loaded
EXIT_MODEL_LOAD = 3


class InstGenIEError(Exception):
    """Base class of every error this package raises on purpose."""

    #: machine-readable code, stable across releases (used by the REST layer)
    code: str = "internal_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ValidationError(InstGenIEError):
    """The request is malformed: bad image/mask bytes, sizes, ranges. Maps to HTTP 422.

    `field` names the offending input (e.g. "mask", "num_inference_steps").
    """

    code = "invalid_request"

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.reason = message


class TooManyPixelsError(ValidationError):
    """An image (or a requested output size) has more pixels than the deployment accepts
    (LimitsConfig.max_image_pixels, or max_input_pixels under oversize="resize"). Maps to 413."""

    code = "image_too_large"


class ModelLoadError(InstGenIEError):
    """A model could not be built or loaded (unknown family, bad directory, missing files)."""

    code = "model_load_error"


class BatchError(InstGenIEError):
    """Requests that cannot share one denoising batch (e.g. different latent resolutions)."""

    code = "batch_error"


class LoraError(ValidationError):
    """A LoRA file or reference that cannot be used; nothing is loaded or registered. Maps to
    422 (lora_not_found: 404). `field` is "file" for the file itself, "loras" for a request's
    list."""

    code = "lora_invalid"


class LoraFileError(LoraError):
    """Not a readable safetensors LoRA (corrupt bytes, no LoRA pairs, a pair missing a half)."""

    code = "lora_invalid_file"


class LoraBaseMismatch(LoraError):
    """The LoRA names layers this model has with other shapes: made for another base model."""

    code = "lora_wrong_base"


class LoraUnknownKeys(LoraError):
    """The LoRA names layers the model does not have (or layer kinds this server does not adapt:
    convolutions, DoRA magnitudes)."""

    code = "lora_unknown_keys"


class LoraRankTooLarge(LoraError):
    """A layer's rank exceeds LoraConfig.max_rank."""

    code = "lora_rank_too_large"


class LoraNotFound(LoraError):
    """An edit names a LoRA id that is not registered. Maps to 404."""

    code = "lora_not_found"

"""One frozen configuration tree. Each component receives only its own sub-config.

CLI flags are generated from these dataclass fields (see `add_dataclass_args`), so a field added
here is a flag everywhere it is exposed, with its docstring comment as the help text.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelConfig:
    #: "FAMILY:SIZE" with SIZE in {tiny, full}, or "FAMILY:/path/to/diffusers/dir"
    model: str = "sdxl-inpaint:tiny"
    #: torch device string, e.g. "cpu", "cuda", "cuda:1"
    device: str = "cpu"
    #: weights/activation dtype; "auto" = float32 on CPU, the family's GPU dtype on CUDA
    dtype: str = "auto"


@dataclass(frozen=True)
class LimitsConfig:
    """Input limits checked before any decoding or model work (RELIABILITY.md items 1-3)."""

    #: largest accepted image/mask, in pixels (width * height), checked from the header
    max_image_pixels: int = 4096 * 4096
    #: image container formats accepted, as Pillow format names
    allowed_formats: tuple[str, ...] = ("PNG", "JPEG", "WEBP")
    #: largest accepted num_inference_steps
    max_steps: int = 200
    #: largest accepted prompt, in characters
    max_prompt_chars: int = 4000
    #: largest accepted guidance scale
    max_guidance_scale: float = 100.0


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type, *, skip: tuple = ()) -> None:
    """Add one `--kebab-name` flag per field of dataclass `cls` (defaults from the class)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        typ = hints[f.name]
        if typ is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        elif typing.get_origin(typ) is tuple:
            parser.add_argument(flag, nargs="+", default=default)
        else:
            parser.add_argument(flag, type=typ, default=default)


def dataclass_from_args(cls: type, args: argparse.Namespace, **overrides: typing.Any):
    """Build `cls` from the parsed flags that `add_dataclass_args` added."""
    kwargs = {}
    for f in dataclasses.fields(cls):
        if hasattr(args, f.name):
            value = getattr(args, f.name)
            kwargs[f.name] = tuple(value) if isinstance(value, list) else value
    kwargs.update(overrides)
    return cls(**kwargs)

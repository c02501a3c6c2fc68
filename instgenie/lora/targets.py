"""Which layers of a model a LoRA may adapt: every nn.Linear of the backbone and text encoders,
with its (in_features, out_features). Built on the meta device (configs only, no memory), so the
API process checks an uploaded file against the served model without loading it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import torch

from instgenie.errors import LoraBaseMismatch, LoraRankTooLarge, LoraUnknownKeys
from instgenie.lora.files import COMPONENTS, LoraWeights

#: {component: {module path: (in_features, out_features)}}
Table = dict[str, dict[str, tuple[int, int]]]


def linear_table(modules: dict[str, torch.nn.Module]) -> Table:
    return {
        name: {
            path: (m.in_features, m.out_features)
            for path, m in module.named_modules()
            if isinstance(m, torch.nn.Linear)
        }
        for name, module in modules.items()
        if name in COMPONENTS and isinstance(module, torch.nn.Module)
    }


def _from_dir(path: Path) -> dict[str, torch.nn.Module]:
    import diffusers
    import transformers

    out = {}
    for name in COMPONENTS:
        cfg_file = path / name / "config.json"
        if not cfg_file.is_file():
            continue
        cfg = json.loads(cfg_file.read_text())
        with torch.device("meta"):
            if "_class_name" in cfg:
                cls = getattr(diffusers, cfg["_class_name"])
                out[name] = cls.from_config(cls.load_config(str(path / name)))
            else:
                config = transformers.AutoConfig.from_pretrained(str(path / name))
                cls = getattr(transformers, cfg["architectures"][0])
                out[name] = cls(config)
    return out


@functools.cache
def model_table(spec_text: str) -> Table:
    """The linear layers of the model `spec_text` ("sdxl-inpaint:tiny", ...) names."""
    from instgenie.engine.family import ModelSpec, _registry

    spec = ModelSpec.parse(spec_text)
    if spec.directory is not None:
        return linear_table(_from_dir(spec.directory))
    cls = _registry()[spec.family]
    comps = cls.build_components(spec.size, build=cls.builder("meta", torch.float32, frozenset()))
    return linear_table(comps)


def _local_name(component: str, module: str, names: dict) -> str:
    """`module` as the served model names it: transformers 5's CLIP text models dropped the
    `text_model.` level that LoRA files (and diffusers' converters) still write."""
    if module not in names and module.startswith("text_model."):
        return module[len("text_model.") :]
    return module


def conform(weights: LoraWeights, table: Table, max_rank: int) -> LoraWeights:
    """`weights` with module paths as the model names them, after checking that every pair
    names a linear layer of the model with matching shapes and rank <= max_rank."""
    weights = LoraWeights(
        tuple(
            dataclasses.replace(
                x, module=_local_name(x.component, x.module, table.get(x.component, {}))
            )
            for x in weights.layers
        )
    )
    _check(weights, table, max_rank)
    return weights


def _check(weights: LoraWeights, table: Table, max_rank: int) -> None:
    unknown, wrong = [], []
    for layer in weights.layers:
        shape = table.get(layer.component, {}).get(layer.module)
        if shape is None:
            unknown.append(f"{layer.component}.{layer.module}")
        elif (layer.down.shape[1], layer.up.shape[0]) != shape:
            wrong.append(
                f"{layer.component}.{layer.module}: LoRA {layer.down.shape[1]}->"
                f"{layer.up.shape[0]}, model {shape[0]}->{shape[1]}"
            )
    if wrong:
        more = f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""
        raise LoraBaseMismatch(
            "file", f"made for another base model: {wrong[0]}{more}"
        )  # fmt: skip
    if unknown:
        more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
        raise LoraUnknownKeys("file", f"the model has no linear layer {unknown[0]}{more}")
    if weights.max_rank > max_rank:
        raise LoraRankTooLarge("file", f"rank {weights.max_rank} exceeds the limit {max_rank}")

"""Installing masked execution on a backbone: one diffusers ModelHook per transformer block.

Block ids are positions in execution order (UNet: down blocks, mid block, up blocks — note that
`model.modules()` order differs, because diffusers registers `up_blocks` before `mid_block`; Flux:
dual blocks then single blocks). The order is the same in every process, so cache entries written
by one process are read correctly by another, and the pipelined loader can rely on block i + 1
being the consumer of block i's output. Hooked blocks behave exactly like
stock ones unless a `StepContext` is active (see context.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from diffusers.hooks import HookRegistry, ModelHook
from diffusers.models.attention import BasicTransformerBlock
from diffusers.models.transformers.transformer_flux import (
    FluxSingleTransformerBlock,
    FluxTransformerBlock,
)

from instgenie.engine.masked import flux_blocks, unet_block
from instgenie.engine.masked.context import current_context

HOOK_NAME = "instgenie_masked"


@dataclass(frozen=True)
class BlockInfo:
    block_id: int
    kind: str  # "unet", "flux_dual", "flux_single"
    name: str  # module path, for logs
    #: 2x downsamplings between the family's first token grid and this block's:
    #: its tokens are family.token_stride * 2**level pixels on a side (Flux: always 0)
    level: int = 0


class MaskedBlockHook(ModelHook):
    def __init__(self, block_id: int, masked_forward: Callable, image_output: Callable) -> None:
        super().__init__()
        self.block_id = block_id
        self.masked_forward = masked_forward
        self.image_output = image_output

    def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        ctx = current_context()
        if ctx is not None and ctx.timer is not None:
            ctx.timer.start(self.block_id)
        if ctx is not None and ctx.is_masked(self.block_id):
            out = self.masked_forward(module, ctx, self.block_id, *args, **kwargs)
        else:
            out = self.fn_ref.original_forward(*args, **kwargs)
        if ctx is not None:
            if ctx.capturing:
                ctx.record(self.block_id, self.image_output(out))
            ctx.block_done(self.block_id)
            if ctx.timer is not None:
                ctx.timer.stop(self.block_id)
        return out


def _blocks(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, str, int]]:
    """(module path, block, kind, level) in forward order."""
    if hasattr(model, "down_blocks"):  # UNet2DConditionModel: forward order of its stages
        deepest = len(model.down_blocks) - 1
        found = []
        for prefix, stage in (("down_blocks", model.down_blocks), ("mid_block", model.mid_block),
                              ("up_blocks", model.up_blocks)):  # fmt: skip
            if stage is None:
                continue
            for name, module in stage.named_modules():
                if isinstance(module, BasicTransformerBlock):
                    # down_blocks[i] attends before its downsampler (level i); the mid block at
                    # the deepest level; up_blocks[j] before its upsampler (deepest - j)
                    pos = int(name.split(".", 1)[0]) if prefix != "mid_block" else 0
                    level = {"down_blocks": pos, "mid_block": deepest}.get(prefix, deepest - pos)
                    path = f"{prefix}.{name}" if name else prefix
                    found.append((path, module, "unet", level))
        return found
    dual = [(n, m, "flux_dual", 0) for n, m in model.named_modules()
            if isinstance(m, FluxTransformerBlock)]  # fmt: skip
    single = [(n, m, "flux_single", 0) for n, m in model.named_modules()
              if isinstance(m, FluxSingleTransformerBlock)]  # fmt: skip
    return dual + single


_FORWARDS: dict[str, tuple[Callable, Callable, Callable]] = {
    # kind: (check_supported, masked_forward, image part of the block's output)
    "unet": (unet_block.check_supported, unet_block.masked_forward, lambda out: out),
    "flux_dual": (flux_blocks.check_supported, flux_blocks.dual_masked_forward, lambda o: o[1]),
    "flux_single": (
        flux_blocks.check_supported,
        flux_blocks.single_masked_forward,
        lambda o: o[1],
    ),
}


def install(model: torch.nn.Module) -> list[BlockInfo]:
    """Hook every transformer block of `model` (idempotent). Returns the blocks in id order."""
    infos = []
    for block_id, (name, module, kind, level) in enumerate(_blocks(model)):
        check, masked_forward, image_output = _FORWARDS[kind]
        reason = check(module)
        if reason is not None:
            raise NotImplementedError(f"masked execution cannot reproduce block {name}: {reason}")
        registry = HookRegistry.check_if_exists_or_initialize(module)
        if registry.get_hook(HOOK_NAME) is None:
            registry.register_hook(
                MaskedBlockHook(block_id, masked_forward, image_output), HOOK_NAME
            )
        infos.append(BlockInfo(block_id, kind, name, level))
    if not infos:
        raise NotImplementedError(f"{type(model).__name__} has no supported transformer blocks")
    return infos

"""Installing masked execution on a backbone: one diffusers ModelHook per transformer block and,
with sparse convolutions (UNets), per ResNet and up/down-sampler.

Block ids are positions in execution order (UNet: down blocks, mid block, up blocks — note that
`model.modules()` order differs, because diffusers registers `up_blocks` before `mid_block`; Flux:
dual blocks then single blocks). The order is the same in every process, so cache entries written
by one process are read correctly by another, and the pipelined loader can rely on block i + 1
being the consumer of block i's output (conv blocks' outputs are read later too, by skip
connections: they never live in its staging ring, context.map_buffer). Hooked blocks behave
exactly like stock ones unless a `StepContext` is active (see context.py).
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

from instgenie.engine.masked import conv_blocks, flux_blocks, flux_kv, unet_block
from instgenie.engine.masked import sparse_convs as sparse_convs_mod
from instgenie.engine.masked.context import current_context

HOOK_NAME = "instgenie_masked"


@dataclass(frozen=True)
class BlockInfo:
    block_id: int
    kind: str  # "unet", "flux_dual", "flux_single"; sparse convs: "resnet", "down", "up"
    name: str  # module path, for logs
    #: 2x downsamplings between the family's first token grid and this block's OUTPUT grid:
    #: its tokens are family.token_stride * 2**level pixels on a side (Flux: always 0)
    level: int = 0


class MaskedBlockHook(ModelHook):
    def __init__(
        self,
        block_id: int,
        masked_forward: Callable,
        image_output: Callable,
        capture_forward: Callable | None = None,
    ) -> None:
        super().__init__()
        self.block_id = block_id
        self.masked_forward = masked_forward
        self.image_output = image_output
        #: a block computing every token while a row captures (ResNets: also records the
        #: GroupNorm statistics); None, or returning None: the stock forward
        self.capture_forward = capture_forward

    def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        ctx = current_context()
        if ctx is not None and ctx.timer is not None:
            ctx.timer.start(self.block_id)
        out = None
        if ctx is not None and ctx.is_masked(self.block_id):
            out = self.masked_forward(module, ctx, self.block_id, *args, **kwargs)
        elif ctx is not None and ctx.capturing and self.capture_forward is not None:
            out = self.capture_forward(module, ctx, self.block_id, *args, **kwargs)
        if out is None:
            out = self.fn_ref.original_forward(*args, **kwargs)
        if ctx is not None:
            if ctx.capturing and not ctx.is_kv(self.block_id):  # K/V blocks record their own
                ctx.record(self.block_id, self.image_output(out))
            ctx.block_done(self.block_id)
            if ctx.timer is not None:
                ctx.timer.stop(self.block_id)
        return out


def _unet_stage_order(prefix: str, stage: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(path, module) of a UNet stage's ResNets, transformer blocks and samplers in forward order:
    down/up blocks run resnets[i] then attentions[i], then their sampler; the mid block runs
    resnets[0], then attentions[i] and resnets[i + 1]."""
    resnets = list(getattr(stage, "resnets", None) or [])
    attns = list(getattr(stage, "attentions", None) or [])
    order: list[tuple[str, torch.nn.Module]] = []

    def add_attention(i: int) -> None:
        if i < len(attns):
            order.extend((f"{prefix}.attentions.{i}.{n}", m) for n, m in attns[i].named_modules()
                         if isinstance(m, BasicTransformerBlock))  # fmt: skip

    if prefix == "mid_block":
        order.append((f"{prefix}.resnets.0", resnets[0]))
        for i in range(len(attns)):
            add_attention(i)
            if i + 1 < len(resnets):
                order.append((f"{prefix}.resnets.{i + 1}", resnets[i + 1]))
        return order
    for i, resnet in enumerate(resnets):
        order.append((f"{prefix}.resnets.{i}", resnet))
        add_attention(i)
    for name in ("downsamplers", "upsamplers"):
        for j, sampler in enumerate(getattr(stage, name, None) or []):
            order.append((f"{prefix}.{name}.{j}", sampler))
    return order


def _blocks(
    model: torch.nn.Module, sparse_convs: bool
) -> list[tuple[str, torch.nn.Module, str, int]]:
    """(module path, block, kind, level) in forward order; `level` is the block's OUTPUT grid."""
    if hasattr(model, "down_blocks"):  # UNet2DConditionModel: forward order of its stages
        deepest = len(model.down_blocks) - 1
        found = []
        stages = [(f"down_blocks.{i}", s, i) for i, s in enumerate(model.down_blocks)]
        if model.mid_block is not None:
            stages.append(("mid_block", model.mid_block, deepest))
        stages += [(f"up_blocks.{j}", s, deepest - j) for j, s in enumerate(model.up_blocks)]
        for prefix, stage, level in stages:
            # down_blocks[i] computes at level i, its downsampler outputs level i + 1; the mid
            # block at the deepest level; up_blocks[j] at deepest - j, its upsampler outputs
            # deepest - j - 1
            for path, module in _unet_stage_order(prefix, stage):
                if isinstance(module, BasicTransformerBlock):
                    found.append((path, module, "unet", level))
                elif sparse_convs and sparse_convs_mod.check_supported(module) is None:
                    kind = sparse_convs_mod.kind_of(module)
                    out = level + (kind == "down") - (kind == "up")
                    found.append((path, module, kind, out))
        return found
    dual = [(n, m, "flux_dual", 0) for n, m in model.named_modules()
            if isinstance(m, FluxTransformerBlock)]  # fmt: skip
    single = [(n, m, "flux_single", 0) for n, m in model.named_modules()
              if isinstance(m, FluxSingleTransformerBlock)]  # fmt: skip
    return dual + single


_FORWARDS: dict[str, tuple[Callable, Callable, Callable, Callable | None]] = {
    # kind: (check_supported, masked_forward, image part of the block's output, capture forward)
    "unet": (unet_block.check_supported, unet_block.masked_forward, lambda out: out, None),
    "flux_dual": (
        flux_blocks.check_supported,
        flux_kv.dual_masked_forward,
        lambda o: o[1],
        flux_kv.capture_forward(flux_kv.dual_masked_forward),
    ),  # fmt: skip
    "flux_single": (
        flux_blocks.check_supported,
        flux_kv.single_masked_forward,
        lambda o: o[1],
        flux_kv.capture_forward(flux_kv.single_masked_forward),
    ),  # fmt: skip
    **{
        kind: (
            sparse_convs_mod.check_supported,
            conv_blocks.masked_forward(kind),
            conv_blocks.image_output,
            conv_blocks.capture_forward(kind),
        )
        for kind in ("resnet", "down", "up")
    },  # fmt: skip
}


def install(model: torch.nn.Module, sparse_convs: bool = False) -> list[BlockInfo]:
    """Hook every transformer block of `model` and, with `sparse_convs`, every supported ResNet
    and sampler of a UNet. Returns the blocks in id order. Installing again with the other
    `sparse_convs` is an error (block ids would change under existing caches)."""
    infos = []
    for block_id, (name, module, kind, level) in enumerate(_blocks(model, sparse_convs)):
        check, masked_forward, image_output, capture_forward = _FORWARDS[kind]
        reason = check(module)
        if reason is not None:
            raise NotImplementedError(f"masked execution cannot reproduce block {name}: {reason}")
        registry = HookRegistry.check_if_exists_or_initialize(module)
        hook = registry.get_hook(HOOK_NAME)
        if hook is None:
            hook = MaskedBlockHook(block_id, masked_forward, image_output, capture_forward)
            registry.register_hook(hook, HOOK_NAME)
        elif hook.block_id != block_id:
            raise RuntimeError(f"block {name} is hooked as block {hook.block_id}, not {block_id}")
        infos.append(BlockInfo(block_id, kind, name, level))
    if not infos:
        raise NotImplementedError(f"{type(model).__name__} has no supported transformer blocks")
    return infos

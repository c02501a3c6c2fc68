"""CUDA-graph replay of the text encoders: a prompt-cache miss without thousands of launches.

A prompt encode runs one prompt (batch 1) through each text tower: SDXL's CLIP-L and
OpenCLIP-bigG (12 + 32 layers at 77 tokens), SD2's OpenCLIP-H, Flux's CLIP-L and T5-XXL (24
layers at `text_len` tokens). At batch 1 the CLIP towers are host-bound: on an H100 SDXL's encode
took 18-31 ms eagerly and 6-8 ms replayed, SD2's 19 and 4 ms; Flux's, T5-bound, 35-37 and 30-32 ms
(docs/benchmarks/stages-h100.md). It runs in the denoise loop's process, between steps (decision
0009). Tokenizers pad to a fixed length, so each tower sees the same input shapes on every call:
its forward is captured once per shape and replayed.

`graph_text_encoders` replaces each tower's `forward` with a `GraphedForward`, which sends
eligible calls through a `StepGraphs` (engine/graphs.py) with capture "always". The first call of
a shape runs the forward eagerly (it loads kernels and cuBLAS plans; its result is dropped),
captures it and returns the replay; later calls copy the new token ids into the static inputs and
replay. Workers make that first call before they report ready
(`AdapterBase.warm_up_text_graphs`). Outputs are cloned out of the graph's pool before they are
returned (the prompt cache keeps them; the next replay overwrites the pool).

Invariants: every result of an eligible call comes from the tower's graph, so a prompt encodes to
the same bits on its first and later requests (and after a prompt-cache eviction). A replay runs
the captured kernels, which cuBLAS may pick differently from the eager forward's under capture:
float32 replays equal the eager forward bit for bit; float16 ones can differ in the last bit
(tests/engine/test_encoder_graphs.py, marked gpu; docs/benchmarks/stages-h100.md). Ineligible calls
run the tower's own forward: no CUDA, autograd on, a dispatch mode active (FLOP counting), a
capture already running on this stream, inputs on another device, a non-tensor argument that
cannot be hashed. A failed capture turns the tower's graphs off for the process (logged once).
Not thread-safe: one thread calls a tower (the loop's, or a stage process's).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from instgenie.engine.graphs import StepGraphs
from instgenie.lora import apply as lora_apply

#: pipeline attributes that hold text towers
TEXT_ENCODERS = ("text_encoder", "text_encoder_2")
_KEY = ("forward",)
#: input shapes kept per tower (tokenizers pad to one length: one is used in practice), count
MAX_SHAPES = 2


class GraphedForward:
    """Stands in for one module's `forward` (an instance attribute shadows the class's)."""

    def __init__(self, module: torch.nn.Module, device: torch.device) -> None:
        self.module = module
        self.eager: Callable[..., Any] = module.forward
        self.graphs = StepGraphs(device, "all", max_graphs=MAX_SHAPES, capture="always")
        module.forward = self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        graphs = self.graphs
        if not self.eligible(args, kwargs):
            graphs.eager()
            return self.eager(*args, **kwargs)
        warmups = graphs.counters["warmup"]
        out = graphs.run(_KEY, None, self.eager, args, kwargs)
        first = graphs.counters["warmup"] > warmups and graphs.device.type == "cuda"
        if first and graphs.mode != "off":
            # a shape's first call ran eagerly (loading kernels and plans); capture now and
            # return the replay, so that every result of this tower comes from its graph
            out = graphs.run(_KEY, None, self.eager, args, kwargs)
        return out

    def eligible(self, args: tuple, kwargs: dict[str, Any]) -> bool:
        if lora_apply.current() is not None:  # a request's text LoRAs: hooks run eagerly
            return False
        graphs = self.graphs
        if torch.is_grad_enabled() or not graphs.eligible(None, None, []):
            return False
        if graphs.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return False
        tensors = 0
        for leaf in pytree.tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.Tensor):
                tensors += 1
                if leaf.device != graphs.device:
                    return False
            else:
                try:
                    hash(leaf)  # non-tensor leaves are part of the graph's key
                except TypeError:
                    return False
        return tensors > 0

    def remove(self) -> None:
        """Give the module back its own forward (drops the graphs)."""
        self.graphs.clear()
        del self.module.forward

    @property
    def counters(self) -> dict[str, int]:
        """Calls by kind: "capture", "warmup", "eager", "replay" (graphs.CALL_KINDS)."""
        return self.graphs.counters


def graph_text_encoders(pipe: Any, device: torch.device) -> dict[str, GraphedForward]:
    """Wrap each text tower of `pipe` that holds weights on CUDA `device`; by attribute name.
    Towers on the meta device (a process that does not encode) and CPU towers are left alone."""
    out: dict[str, GraphedForward] = {}
    if device.type != "cuda":
        return out
    if device.index is None:  # "cuda": the current device, where the towers' weights are
        device = torch.device("cuda", torch.cuda.current_device())
    for name in TEXT_ENCODERS:
        module = getattr(pipe, name, None)
        if not isinstance(module, torch.nn.Module):
            continue
        param = next(module.parameters(), None)
        if param is None or param.device != device:
            continue
        out[name] = GraphedForward(module, device)
    return out

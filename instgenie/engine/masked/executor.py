"""Binds masked execution to a family's backbone: builds each step's context from the batch's
request states and keeps cache-reading requests on their template's latent trajectory.

Latents: a masked request computes only its masked tokens, and the unmasked rows of every block
come from the template's run, which followed the template's own latents. After each step the
request's latents outside its edit region are set to the template's latents after that step, so
the unmasked inputs of the next step match the cached activations. With the template's own
inputs (same seed, prompt, mask) this is the identity, so exact replay is preserved.
"""

from __future__ import annotations

import torch

from instgenie.cache.store import ActivationStore
from instgenie.engine.masked import hooks
from instgenie.engine.masked.context import RequestRows, StepContext
from instgenie.engine.request import RequestState


class MaskedExecutor:
    def __init__(self, backbone: torch.nn.Module, device: torch.device) -> None:
        self.blocks = hooks.install(backbone)
        self.device = device
        self.store: ActivationStore | None = None
        #: block ids that compute all tokens (no cache read); the load planner sets this per step
        self.compute_all: frozenset[int] = frozenset()
        #: None = INSTGENIE_ATTENTION_BACKEND / auto
        self.attention_backend: str | None = None
        #: the context of the last step (tests and the step log read it)
        self.last_context: StepContext | None = None

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def context(self, batch: list[RequestState]) -> StepContext | None:
        if not any(s.cache_key is not None or s.writer is not None for s in batch):
            self.last_context = None
            return None
        rows, start = [], 0
        for s in batch:
            rows.append(
                RequestRows(
                    start=start,
                    num_rows=s.num_rows,
                    step=s.step_index,
                    cache_key=s.cache_key,
                    token_index=s.token_index if s.cache_key is not None else None,
                    writer=s.writer,
                )
            )
            start += s.num_rows
        ctx = StepContext(rows, self.store, self.device, self.compute_all, self.attention_backend)
        self.last_context = ctx
        return ctx

    def after_step(self, batch: list[RequestState]) -> None:
        """Called once the batch's latents and step indices have advanced."""
        for s in batch:
            step = s.step_index - 1
            if s.writer is not None:
                s.writer.put_latents(step, s.latents)
            if s.cache_key is not None:
                template = self.store.latents(s.cache_key, step).to(s.latents.dtype)
                s.latents = torch.where(s.edit_mask, s.latents, template)

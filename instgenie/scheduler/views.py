"""What the router reads: a summary of the request to place (`RouteRequest`) and a typed view of
each worker's state (`WorkerView`: its running batch, queue, requests held with their progress,
templates resident by tier, and how to price it). Snapshots built by the dispatcher at routing
time (server/pool.py); the policies (routing.py) are pure functions of them. A view names the
host its worker runs on, for placement across hosts; no policy reads it yet.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from instgenie.scheduler.spec import CostSpec


@dataclass(frozen=True)
class RouteRequest:
    """What a policy may know about a request before it runs."""

    template_id: str | None  # registered template it edits (cache affinity), or None
    num_steps: int | None  # denoise steps asked for; None: the model's default
    pixels: int  # width * height of the image, pixels
    mask_ratio: float | None = None  # fraction of pixels to edit; None: not measured
    guidance: float | None = None  # guidance scale asked for; None: the model's default
    #: (token stride in pixels, fraction of that token grid the mask covers), one per transformer
    #: resolution of the model (estimate.token_ratios); empty: not measured
    token_ratios: tuple[tuple[int, float], ...] = ()
    steps_done: int = 0  # denoising steps it has done (a held request's progress), count
    strength: float | None = None  # img2img strength asked for (< 1 runs fewer steps)


@dataclass(frozen=True)
class WorkerView:
    """One worker as the dispatcher sees it at routing time."""

    index: int  # position in the pool, 0-based
    device: str  # torch device, e.g. "cuda:1"
    in_flight: int  # requests sent to it and not answered yet, count
    slots: int  # most requests it may hold at once (ServerConfig.worker_slots), count
    batch_size: int = 0  # requests in its last denoise step (stats, may lag), count
    queue_depth: int = 0  # requests it holds that are not in the denoise loop (stats), count
    templates_ready: frozenset[str] = field(default_factory=frozenset)  # cache resident there
    #: template id -> the fastest tier holding its cache there ("gpu", "dram", ...)
    template_tiers: Mapping[str, str] = field(default_factory=dict)
    #: the requests it holds (reserved or sent, not answered), oldest first, with their progress
    requests: tuple[RouteRequest, ...] = ()
    max_batch: int = 0  # most requests in one denoise step (WorkerConfig.max_batch); 0: unknown
    cost: CostSpec | None = None  # how to price its batches (its loop's CostSpec); None: unknown
    host: str = ""  # the host (node) it runs on; "": this one (a single-host pool)

    @property
    def has_room(self) -> bool:
        return self.in_flight < self.slots

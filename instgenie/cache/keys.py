"""Template cache keys. A key is a hash; no user-supplied string ever becomes a path or a name.

Key = sha256 over the canonical JSON of: the template's pixels at working resolution (hashed), the
model id, the resolution, the scheduler config + steps + strength, CFG on/off, the capture prompt,
negative prompt and seed, the capture mask (hashed; empty = "keep everything"), and the cache
dtype (and, when set, the LoRAs and the block layout). Two captures with equal keys produce
identical activations.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

import numpy as np
from PIL import Image


def pixel_digest(img: Image.Image | None) -> str:
    """sha256 of an image's mode, size and raw pixels ("" for None)."""
    if img is None:
        return ""
    h = hashlib.sha256(f"{img.mode}:{img.size}".encode())
    h.update(np.asarray(img).tobytes())
    return h.hexdigest()


@dataclass(frozen=True)
class TemplateKey:
    image: str
    model: str
    height: int
    width: int
    scheduler: str
    num_steps: int
    strength: float
    cfg: bool
    prompt: str
    negative_prompt: str
    seed: int
    capture_mask: str
    cache_dtype: str
    #: the LoRAs the capture ran with, [[id, scale], ...] as JSON; "" = none (then the field is
    #: left out of the digest: keys of templates without LoRAs are what they always were)
    loras: str = ""
    #: what the cache holds beyond the transformer blocks' outputs: "convs" (ResNets, samplers
    #: and their GroupNorm statistics: ExecConfig.sparse_convs), "kv" (Flux blocks' keys and
    #: values instead of their outputs: ExecConfig.kv_cache), or "" (left out of the digest)
    layout: str = ""

    @property
    def digest(self) -> str:
        """64 hex characters; the only identifier the cache tiers ever see."""
        fields = asdict(self)
        for optional in ("loras", "layout"):
            if not fields[optional]:
                del fields[optional]
        blob = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()

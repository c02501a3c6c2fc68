"""InstGenIE: serving mask-based generative image editing with mask-aware activation caching."""

from __future__ import annotations

__version__ = "0.1.0"

"""VAE-decode only the crop of a masked edit that paste-back keeps (ExecConfig.cropped_decode).

An edit of a cached template (its latents outside the edit mask reset to the template's after
every step, masked/executor.py) that is pasted back keeps only its masked pixels. Its decode
runs the decoder's latent-resolution prefix on the whole map (crop_forward.py: the global
mid-block attention, and every GroupNorm there with its own statistics), then the rest — where
nearly all the pixels and multiply-adds are — only on the crop: the mask's bounding box at
latent resolution, grown by the resize allowance of `finish` and a margin of a quarter of the
rest's receptive radius (at least one latent), clipped to the map. The rest normalises with the
template's statistics (decode_states.py), which is accurate only while the edit leaves the
decoder's statistics where the template's were: a guard compares the prefix's exact statistics
with the template's (crop_forward.deviation) and decodes the rest whole above MAX_DEVIATION.
Measured on the reference models (decision 0044): at deviation <= 0.03 the crop's pixels are
>= 48.7 dB PSNR from the whole decode's inside the mask; a realistic edit (a garment recoloured)
moves the statistics by 0.07-1.2 and is decoded whole.

The output is the whole working-resolution image, so that `finish` (resize, paste-back, encode)
is unchanged: the crop's decoded pixels over the request's working image (`state.image`), whose
pixels outside the crop paste-back replaces with the original's anyway.

Eligible: a decoder crop_forward supports, mode not "off", a request that read a template cache
(`cache_key`) and carries the template's final latents (`template_latents`, captured by
EditPipeline.release), with paste_back on; under "auto" its crop must also be at most
MAX_CROP_FRACTION of the latent map ("on": any size, the whole map included).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable

import torch
from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKL
from PIL import Image

from instgenie.engine import crop_forward as cf
from instgenie.engine.decode_states import DECODE_STATE_BYTES, DecodeStateCache
from instgenie.engine.kernels import check_mode
from instgenie.engine.request import RequestState

#: "auto" crops only where the crop is at most this fraction of the latent map: the crop path
#: costs the whole prefix plus the crop's share of the rest (CPU, sdxl-inpaint:ref at 256²:
#: 223 ms whole, 133 ms at 0.5, 195 ms at 0.75; decision 0044)
MAX_CROP_FRACTION = 0.6
#: the margin around the mask's box, as a fraction of the suffix's receptive radius (latents),
#: at least one latent: 1 on the 4x reference VAEs (>= 57.9 dB on template replays, 41.9 dB
#: with none), 2 on the 8x SD/SDXL/Flux VAEs (radius 6.25)
MARGIN_FRACTION = 0.25
#: the guard: decode the rest whole when the prefix's statistics move further than this from
#: the template's (crop_forward.deviation: mean shift in standard deviations, relative change
#: of the standard deviation)
MAX_DEVIATION = 0.03
#: Lanczos's support, pixels of the resized image: `finish` resizes the decode to the input's
#: size, so pixels this far (x the downscale) outside the mask still read decoded pixels
_LANCZOS_SUPPORT = 3

#: what decode decided for a request: cropped; rest decoded whole by the guard; whole-image
#: decode (not eligible, or the crop too large)
CROP, GUARDED, WHOLE = "crop", "guarded", "whole"


def margin_latents(vae: AutoencoderKL) -> int:
    return max(1, math.ceil(MARGIN_FRACTION * cf.suffix_radius(vae)))


def crop_box(state: RequestState, latent_hw: tuple[int, int], scale: int, margin: int) -> cf.Box:
    """The latent crop covering `state`'s mask (working resolution; empty: the whole map) plus
    the resize allowance and `margin` latents, clipped to the (h, w) map; `scale`: pixels per
    latent."""
    h, w = latent_hw
    bbox = state.mask.getbbox()  # (left, upper, right, lower) of the nonzero pixels
    if bbox is None:
        return cf.Box(0, h, 0, w, h, w)
    left, upper, right, lower = bbox
    original = state.original_image or state.image
    if original.size != state.image.size:  # finish resizes: Lanczos reads a neighbourhood
        down = max(state.image.width / original.width, state.image.height / original.height)
        pad = math.ceil(_LANCZOS_SUPPORT * max(1.0, down)) + 1
        left, upper, right, lower = left - pad, upper - pad, right + pad, lower + pad
    y0, x0 = upper // scale - margin, left // scale - margin
    y1, x1 = -(-lower // scale) + margin, -(-right // scale) + margin
    return cf.Box(max(0, y0), min(h, y1), max(0, x0), min(w, x1), h, w)


class CroppedDecoder:
    """A family's decode with the cropped path; one per adapter (its LRU lives with it)."""

    def __init__(
        self,
        vae: AutoencoderKL,
        mode: str,
        to_pil: Callable[[torch.Tensor], list[Image.Image]],
        scale: int,
        capacity_bytes: int = DECODE_STATE_BYTES,
    ) -> None:
        self.vae, self.mode, self.to_pil, self.scale = vae, check_mode(mode), to_pil, scale
        try:
            cf.check_decoder(vae)
            self.supported = True
        except cf.UnsupportedDecoder:
            self.supported = False
        self.margin = margin_latents(vae) if self.supported else 0
        #: the templates' decoder statistics, by template cache key
        self.states = DecodeStateCache(capacity_bytes)
        #: decisions so far, and the last call's {uid: CROP | GUARDED | WHOLE}
        self.counts: Counter[str] = Counter()
        self.last: dict[str, str] = {}

    @property
    def is_on(self) -> bool:
        """Whether any request may decode cropped (the pipeline captures template latents)."""
        return self.supported and self.mode != "off"

    def plan(self, state: RequestState, latent_hw: tuple[int, int]) -> cf.Box | None:
        """The crop `state` decodes, or None for the whole-image decode."""
        if not self.is_on or state.cache_key is None or state.template_latents is None:
            return None
        h, w = latent_hw
        if not state.request.paste_back or state.image.size != (w * self.scale, h * self.scale):
            return None
        box = crop_box(state, latent_hw, self.scale, self.margin)
        if self.mode == "auto" and box.area > MAX_CROP_FRACTION * h * w:
            return None
        return box

    def decode(
        self, batch: list[RequestState], to_input: Callable[[torch.Tensor], torch.Tensor]
    ) -> list[Image.Image]:
        """Working-resolution images of `batch`; `to_input` maps latents in the states' layout
        ((rows, ...), model dtype) to the decoder's input ((rows, C, h, w), VAE dtype)."""
        latents = to_input(torch.cat([s.latents for s in batch]))
        hw = tuple(latents.shape[-2:])
        plans = [self.plan(s, hw) for s in batch]
        self.last = {}
        whole = [i for i, p in enumerate(plans) if p is None]
        images: list[Image.Image | None] = [None] * len(batch)
        if whole:
            rows = latents if len(whole) == len(batch) else latents[whole]
            for i, img in zip(whole, self._whole(rows), strict=True):
                images[i], self.last[batch[i].uid] = img, WHOLE
        for i, box in enumerate(plans):
            if box is not None:
                s = batch[i]
                images[i], self.last[s.uid] = self._cropped(s, latents[i : i + 1], box, to_input)
        self.counts.update(self.last.values())
        return images  # type: ignore[return-value]

    def _whole(self, latents: torch.Tensor) -> list[Image.Image]:
        return self.to_pil(self.vae.decode(latents, return_dict=False)[0])

    def _cropped(
        self, s: RequestState, z: torch.Tensor, box: cf.Box, to_input: Callable
    ) -> tuple[Image.Image, str]:
        vae, key = self.vae, s.cache_key
        assert key is not None and s.template_latents is not None  # plan checked
        template = to_input(s.template_latents)
        x, prefix = cf.decode_prefix(vae, z)
        st = self.states.get(key, template)
        if st is None:
            st = cf.record_prefix(vae, template)
            self.states.put(key, st)
        if cf.deviation(st, prefix) > MAX_DEVIATION:
            return self.to_pil(cf.decode_suffix_whole(vae, x))[0], GUARDED
        if not st.is_complete:
            st = cf.record_decode(vae, template)[1]
            self.states.put(key, st)
        pixels = self.to_pil(cf.decode_suffix_crop(vae, x, box, st))[0]
        out = s.image.convert("RGB")  # a copy, at working resolution (plan checked its size)
        out.paste(pixels, (box.x0 * self.scale, box.y0 * self.scale))
        return out, CROP

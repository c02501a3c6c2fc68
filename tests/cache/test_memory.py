"""InMemoryStore's writer: a capture is ready only when complete, and its size is what it holds."""

from __future__ import annotations

import pytest
import torch

from instgenie.cache.quant import FP8
from instgenie.cache.store import InMemoryStore, TemplateMeta

Y = torch.randn(2, 4, 8)  # (rows, L, C)
LAT = torch.randn(1, 4, 2, 2)


def _writer(store: InMemoryStore, key: str = "k", steps: int = 2):
    return store.writer(key, TemplateMeta(num_steps=steps, num_rows=2))


def test_steps_outside_the_schedule_are_refused() -> None:
    store = InMemoryStore()
    w = _writer(store)
    for bad in (-1, 2):
        with pytest.raises(ValueError, match=rf"step {bad} outside \[0, 2\)"):
            w.put_block(bad, 0, Y)
        with pytest.raises(ValueError, match=rf"step {bad} outside \[0, 2\)"):
            w.put_latents(bad, LAT)
    assert store.status("k") == "building"


def test_a_capture_missing_any_step_or_block_is_not_ready() -> None:
    store = InMemoryStore()
    w = _writer(store)
    w.put_block(0, 0, Y)
    w.put_block(1, 1, Y)  # as many outputs as 2 steps x 1 block, but (1, 0), (0, 1) missing
    w.put_latents(0, LAT)
    w.put_latents(1, LAT)
    with pytest.raises(RuntimeError, match=r"2/4 block outputs \(first missing \(step, block\): "
                       r"\[\(0, 1\), \(1, 0\)\]\), 2/2 latents"):  # fmt: skip
        w.commit()
    assert store.status("k") == "absent"
    w = _writer(store)
    for s in range(2):
        w.put_block(s, 0, Y)
    w.put_latents(1, LAT)
    with pytest.raises(RuntimeError, match="1/2 latents"):
        w.commit()
    assert store.status("k") == "absent"


@pytest.mark.parametrize("dtype", [None, torch.float16, FP8])
def test_size_counts_what_is_held_once(dtype: torch.dtype | None) -> None:
    store = InMemoryStore(dtype=dtype)
    w = _writer(store)
    for s in range(2):
        w.put_block(s, 0, Y)
        w.put_latents(s, LAT)
    w.put_block(1, 0, 2 * Y)  # a retried step replaces its output
    w.commit()
    handle = store.open("k")
    y0, y1 = (handle.block(s, 0) for s in range(2))
    if dtype == FP8:
        y0, y1 = y0.dequantize(torch.float32), y1.dequantize(torch.float32)
    torch.testing.assert_close(y1.float(), 2 * y0.float(), rtol=0.07, atol=0)
    per_block = {None: 4, torch.float16: 2, FP8: 1}[dtype] * Y.numel()
    if dtype == FP8:
        per_block += 4 * Y.shape[0] * Y.shape[1]  # one float32 scale per row and token
    per_latents = {None: 4, torch.float16: 2, FP8: 4}[dtype] * LAT.numel()  # fp8: kept as is
    assert store.meta("k").nbytes == 2 * per_block + 2 * per_latents

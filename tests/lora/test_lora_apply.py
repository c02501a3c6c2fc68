"""LoraBatch.apply on every input layout (batch rows, per-row sequences, packed masked tokens),
through the torch ops and the segmented kernel (TRITON_INTERPRET=1 on CPU), against a per-token
float64 formula."""

from __future__ import annotations

import pytest
import torch

from instgenie.lora import apply
from instgenie.lora.apply import DeviceAdapter, Group, LoraBatch, packed_rows

KEY = ("unet", "blocks.0.attn.to_q")
CIN, COUT = 24, 20


def _adapter(name: str, rank: int, seed: int, has_key: bool = True) -> DeviceAdapter:
    g = torch.Generator().manual_seed(seed)
    down = torch.randn(rank, CIN, generator=g)
    up = torch.randn(rank, COUT, generator=g).T  # rank-major, as the store keeps it
    key = KEY if has_key else ("unet", "elsewhere")
    return DeviceAdapter(name, {key: (down, up, 0.5)})


A1, A2, A3 = _adapter("a1", 4, 1), _adapter("a2", 12, 2), _adapter("a3", 8, 3, has_key=False)
#: rows 0-1: a1; rows 2-3: nothing; rows 4-5: a2 and a1 (negative scale) and a3 (not this layer)
GROUPS = [Group(0, 2, ((A1, 1.0),)), Group(4, 6, ((A2, 0.5), (A1, -1.0), (A3, 2.0)))]
R = 6


def _expected(x2: torch.Tensor, y2: torch.Tensor, row_of: list[int]) -> torch.Tensor:
    out = y2.double().clone()
    for n, r in enumerate(row_of):
        for g in GROUPS:
            if g.row_lo <= r < g.row_hi:
                for a, s in g.adapters:
                    if KEY in a.pairs:
                        down, up, alpha = a.pairs[KEY]
                        out[n] += s * alpha * (up.double() @ (down.double() @ x2[n].double()))
    return out


@pytest.mark.parametrize("mode", ["off", "off-masked", "on"])
@pytest.mark.parametrize("layout", ["sequence", "strided", "rows", "packed", "packed_one_per_row"])
def test_apply_layouts(monkeypatch, mode: str, layout: str) -> None:
    """off: torch ops on each segment's rows; off-masked: the torch ops CUDA uses (no host read
    of the bounds, capturable: every row, weighted by its segment's mask); on: the kernel."""
    monkeypatch.setattr(apply, "SEGMENTED_KERNEL", mode.split("-")[0])
    if mode == "off-masked":
        monkeypatch.setattr(apply, "_add_sliced", apply._add_masked)
    batch = LoraBatch(GROUPS, R, torch.device("cpu"), torch.float32)
    g = torch.Generator().manual_seed(0)
    if layout == "sequence":
        x = torch.randn(R, 5, CIN, generator=g)
        row_of = [r for r in range(R) for _ in range(5)]
    elif layout == "strided":  # every other column: flattened rows stay a view, last stride 2
        x = torch.randn(R, 5, 2 * CIN, generator=g)[..., ::2]
        assert x.reshape(-1, CIN).stride(-1) == 2
        row_of = [r for r in range(R) for _ in range(5)]
    elif layout == "rows":
        x = torch.randn(R, CIN, generator=g)
        row_of = list(range(R))
    else:
        counts = [2, 3, 1, 4, 2, 2] if layout == "packed" else [1] * R
        x = torch.randn(sum(counts), CIN, generator=g)
        row_of = [r for r, c in enumerate(counts) for _ in range(c)]
    y = torch.randn(*x.shape[:-1], COUT, generator=g)
    want = _expected(x.reshape(-1, CIN), y.reshape(-1, COUT), row_of)
    if layout.startswith("packed"):
        cu = torch.tensor([0] + list(torch.tensor(counts).cumsum(0)), dtype=torch.int32)
        with packed_rows(cu, x.shape[0]):
            out = batch.apply(KEY, x, y.clone())
    else:
        out = batch.apply(KEY, x, y.clone())
    torch.testing.assert_close(out.reshape(-1, COUT).double(), want, rtol=1e-4, atol=1e-4)
    untouched = [n for n, r in enumerate(row_of) if r in (2, 3)]
    assert torch.equal(out.reshape(-1, COUT)[untouched], y.reshape(-1, COUT)[untouched])


def test_layer_without_adapters_and_unknown_layouts() -> None:
    batch = LoraBatch(GROUPS, R, torch.device("cpu"), torch.float32)
    y = torch.randn(9, COUT)
    assert batch.apply(("unet", "not.adapted"), torch.randn(9, CIN), y) is y
    with pytest.raises(RuntimeError, match="packed input"):
        batch.apply(KEY, torch.randn(9, CIN), y)  # 9 tokens, no declared layout
    with pytest.raises(RuntimeError, match="rows in a batch"):
        batch.apply(KEY, torch.randn(4, 3, CIN), torch.randn(4, 3, COUT))


def test_uniform_batch_applies_to_every_row() -> None:
    """A text encoder's call: one request, any shape."""
    batch = LoraBatch.uniform_for(((A1, 1.0),), torch.device("cpu"), torch.float32)
    x, y = torch.randn(2, 7, CIN), torch.randn(2, 7, COUT)
    out = batch.apply(KEY, x, y.clone())
    down, up, alpha = A1.pairs[KEY]
    torch.testing.assert_close(out, y + alpha * (x @ down.T) @ up.T)
    assert apply.text_key() is None
    with apply.use_lora(batch):
        assert apply.text_key() == (("a1", 1.0),)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["on", "off"])
def test_apply_captures_in_a_cuda_graph(monkeypatch, mode: str) -> None:
    """Both CUDA paths (kernel; torch ops) read no bounds on the host, so a step with LoRAs can
    be captured (a host read would fail the capture and turn graphs off for the process): the
    replay, on new inputs, equals the eager result."""
    monkeypatch.setattr(apply, "SEGMENTED_KERNEL", mode)
    dev = torch.device("cuda")

    def on(a: DeviceAdapter) -> DeviceAdapter:
        pairs = {k: (d.to(dev), u.T.contiguous().T.to(dev), s) for k, (d, u, s) in a.pairs.items()}
        return DeviceAdapter(a.lora_id, pairs)

    a1, a2 = on(A1), on(A2)
    groups = [Group(0, 2, ((a1, 1.0),)), Group(4, 6, ((a2, 0.5), (a1, -1.0)))]
    batch = LoraBatch(groups, R, dev, torch.float32)
    counts = [2, 3, 1, 4, 2, 2]
    cu = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    x = torch.randn(sum(counts), CIN, device=dev)
    y = torch.randn(sum(counts), COUT, device=dev)
    out = torch.empty_like(y)

    def step() -> None:
        out.copy_(y)
        with packed_rows(cu, x.shape[0]):
            batch.apply(KEY, x, out)

    step()  # warm-up (kernel compile) outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    x.copy_(torch.randn_like(x))
    graph.replay()
    replayed = out.clone()
    step()
    torch.testing.assert_close(replayed, out)
    assert not torch.equal(replayed, y)


def test_the_kernel_serves_every_rank_the_config_allows(monkeypatch) -> None:
    """The hooks launch the kernel unchecked: what it would refuse is refused earlier."""
    from instgenie.config import LORA_RANK_LIMIT, LoraConfig
    from triton_kernels import segmented_lora

    assert segmented_lora._MAX_RANK == LORA_RANK_LIMIT
    LoraConfig(lora_max_rank=LORA_RANK_LIMIT)
    with pytest.raises(ValueError, match="lora_max_rank"):
        LoraConfig(lora_max_rank=LORA_RANK_LIMIT + 1)
    monkeypatch.setattr(apply, "SEGMENTED_KERNEL", "on")
    batch = LoraBatch(GROUPS, R, torch.device("cpu"), torch.float32)
    with pytest.raises(TypeError, match="float64"):
        batch.apply(KEY, torch.randn(R, CIN, dtype=torch.float64), torch.randn(R, COUT))

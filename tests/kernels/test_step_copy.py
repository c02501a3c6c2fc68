"""Device-indexed step copy (triton_kernels/step_copy.py) against torch.index_select (CPU:
TRITON_INTERPRET=1)."""

from __future__ import annotations

import pytest
import torch

from triton_kernels.step_copy import (
    _BLOCK,
    copy_rows_indirect,
    copy_rows_indirect_reference,
    copy_step,
    copy_step_reference,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "steps, shape, tail_rows",
    [
        (5, (2, 33, 7), None),  # whole stack, numel not a multiple of the block
        (3, (2, 64, 64), 1),  # the last row of each step only (a template with CFG, no-CFG edit)
        (1, (1, 2 * _BLOCK), None),  # whole blocks only
        (4, (2, 0, 8), None),  # empty slice
    ],
)
def test_matches_index_select(steps, shape, tail_rows, dtype) -> None:
    g = torch.Generator().manual_seed(steps)
    stack = torch.randn(steps, *shape, generator=g).to(dtype)
    src = stack if tail_rows is None else stack[:, shape[0] - tail_rows :]
    for s in range(steps):
        step = torch.tensor([s])
        out = torch.full(src.shape[1:], float("nan"), dtype=dtype)
        want = copy_step_reference(src, step, torch.empty_like(out))
        copy_step(src, step, out)
        assert torch.equal(out, want) and torch.equal(out, src[s])


def test_reads_the_step_at_call_time() -> None:
    """The step lives in a tensor: writing it between calls changes what is read (the graph
    form writes it before every replay)."""
    stack = torch.arange(3 * 10, dtype=torch.float32).reshape(3, 10)
    step, out = torch.tensor([0]), torch.empty(10)
    copy_step(stack, step, out)
    assert torch.equal(out, stack[0])
    step.fill_(2)
    copy_step(stack, step, out)
    assert torch.equal(out, stack[2])


@pytest.mark.parametrize(
    "src, step, out, err",
    [
        (torch.zeros(3, 4), torch.tensor([0]), torch.zeros(5), ValueError),  # shapes
        (torch.zeros(3, 4), torch.tensor([0]), torch.zeros(4, dtype=torch.float16), TypeError),
        (torch.zeros(3, 4), torch.tensor([0], dtype=torch.int32), torch.zeros(4), ValueError),
        (torch.zeros(3, 4), torch.tensor([0, 1]), torch.zeros(4), ValueError),
        (torch.zeros(3, 4, 2).transpose(1, 2), torch.tensor([0]), torch.zeros(2, 4), ValueError),
    ],
)
def test_rejects_bad_input(src, step, out, err) -> None:
    with pytest.raises(err):
        copy_step(src, step, out)


def test_callers_find_their_kernels() -> None:
    """The engine's optional imports resolve (a wrong name would silently fall back to torch)."""
    from instgenie.engine import fused_norms
    from instgenie.engine.masked import context, flux_blocks
    from triton_kernels import group_norm, rmsnorm_rope, step_copy

    assert context._step_copy_kernel() is step_copy.copy_step
    assert fused_norms._kernel() is group_norm.group_norm
    assert flux_blocks._fused_kernel() is rmsnorm_rope.rmsnorm_rope


def _tables(sources: list[torch.Tensor | None]) -> tuple[torch.Tensor, torch.Tensor]:
    base = torch.tensor([0 if s is None else s.data_ptr() for s in sources], dtype=torch.int64)
    stride = torch.tensor([0 if s is None else s.stride(0) for s in sources], dtype=torch.int64)
    return base, stride


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(33, 7), (2 * _BLOCK + 5,), (64, 64)])
def test_indirect_rows_read_their_own_sources_and_steps(shape, dtype) -> None:
    """Each row reads its own stack (different step counts and strides: a window of 2 slots, a
    template of 5 steps, a CFG template's cond row) at its own step; a row without a source
    (base 0) is left untouched."""
    g = torch.Generator().manual_seed(len(shape))
    a = torch.randn(5, *shape, generator=g).to(dtype)
    cfg = torch.randn(2, 2, *shape, generator=g).to(dtype)  # (slots, rows, ...)
    sources = [a, None, cfg[:, 1], a]
    base, stride = _tables(sources)
    steps = torch.tensor([3, 0, 1, 0])
    out = torch.full((4, *shape), 7.0, dtype=dtype)
    copy_rows_indirect(base, stride, steps, out)
    want = copy_rows_indirect_reference(sources, steps, torch.full_like(out, 7.0))
    assert torch.equal(out, want)
    assert (
        torch.equal(out[0], a[3]) and torch.equal(out[2], cfg[1, 1]) and torch.equal(out[3], a[0])
    )
    assert bool((out[1] == 7.0).all())
    steps[3] = 4  # the steps live in a tensor: written between calls, read at call time
    copy_rows_indirect(base, stride, steps, out)
    assert torch.equal(out[3], a[4])


def test_indirect_rows_into_strided_rows() -> None:
    """out's rows may be strided (the image part of a joint key sequence: each row's text rows
    come first): each row lands in its own slice, the rows between untouched."""
    g = torch.Generator().manual_seed(3)
    a = torch.randn(4, 6, 8, generator=g)
    b = torch.randn(2, 6, 8, generator=g)
    sources = [a, None, b]
    base, stride = _tables(sources)
    steps = torch.tensor([2, 0, 1])
    joint = torch.full((3, 9, 8), 7.0)  # (rows, text 3 + image 6, inner)
    out = joint[:, 3:]
    copy_rows_indirect(base, stride, steps, out)
    assert torch.equal(out, copy_rows_indirect_reference(sources, steps, torch.full_like(out, 7)))
    assert torch.equal(out[0], a[2]) and torch.equal(out[2], b[1])
    assert bool((joint[:, :3] == 7.0).all()) and bool((joint[1] == 7.0).all())


@pytest.mark.parametrize(
    "tables, out",
    [
        ((torch.zeros(2, dtype=torch.int64),) * 3, torch.zeros(3, 4)),  # rows disagree
        ((torch.zeros(3, dtype=torch.int32),) * 3, torch.zeros(3, 4)),  # not int64
        ((torch.zeros(3, dtype=torch.int64),) * 3, torch.zeros(4, 3).t()),  # out not contiguous
    ],
)
def test_indirect_rejects_bad_input(tables, out) -> None:
    with pytest.raises(ValueError):
        copy_rows_indirect(*tables, out)

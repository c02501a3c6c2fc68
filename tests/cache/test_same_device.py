"""cache.store.same_device / on_device: an index-less CUDA device names the current card, so a
worker on "cuda" reads a stack on "cuda:0" in place (bucket graphs ran every step eagerly when
`!=` compared them) and a handle on "cuda:0" is not a host cache of a worker on "cuda"."""

from __future__ import annotations

import pytest
import torch

from instgenie.cache.store import on_device, same_device


def test_an_index_less_cuda_device_is_the_current_card(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert same_device("cuda", "cuda:1") and same_device(torch.device("cuda:1"), "cuda")
    assert not same_device("cuda", "cuda:0") and not same_device("cuda:0", "cuda")
    assert same_device("cuda", "cuda") and same_device("cuda:0", "cuda:0")
    assert not same_device("cuda:0", "cuda:1") and not same_device("cuda", "cpu")
    assert same_device("cpu", torch.device("cpu")) and not same_device("cpu", "cuda:1")


def test_a_tensor_is_on_its_device() -> None:
    assert on_device(torch.zeros(1), torch.device("cpu"))
    assert not on_device(torch.zeros(1), torch.device("cuda"))

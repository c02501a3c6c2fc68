"""Batch compositions and random problems of the varlen attention benchmark
(bench/bench_varlen_attention.py): which requests share a batch, how many of each request's
tokens are masked queries, and the packed / padded inputs every variant reads. Lengths in tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

MIXES = {
    "mixed4": [0.05, 0.2, 0.5, 1.0],
    "ten8": [0.1] * 8,
    "mixed8": [0.05, 0.05, 0.9, 0.3, 0.15, 0.6, 0.2, 1.0],
    "twenty4": [0.2] * 4,
    "full2": [1.0] * 2,
}


@dataclass(frozen=True)
class Composition:
    """A batch: every request has ``seq`` key tokens, of which ``maskable`` can be queries."""

    model: str
    heads: int
    head_dim: int
    seq: int
    maskable: int
    mix: str
    fracs: tuple[float, ...]

    @property
    def name(self) -> str:
        return f"{self.model} H{self.heads} D{self.head_dim} L{self.seq} {self.mix}"

    @property
    def n_q(self) -> list[int]:
        return [round(f * self.maskable) for f in self.fracs]

    @property
    def n_k(self) -> list[int]:
        return [self.seq] * len(self.fracs)


def compositions(quick: bool) -> list[Composition]:
    if quick:
        shapes = [("sdxl-tiny", 2, 16, 48, 48), ("flux-tiny", 2, 32, 40, 32)]
        mixes = {k: MIXES[k] for k in ("mixed4", "twenty4")}
    else:
        shapes = [
            ("sdxl", 10, 64, 4096, 4096),
            ("sdxl", 20, 64, 1024, 1024),
            ("flux", 24, 128, 4608, 4096),
        ]
        mixes = MIXES
    return [
        Composition(model, h, d, seq, maskable, mix, tuple(fracs))
        for model, h, d, seq, maskable in shapes
        for mix, fracs in mixes.items()
    ]


@dataclass
class Problem:
    """Fresh random inputs of one composition plus the metadata each variant needs."""

    comp: Composition
    src: torch.Tensor  # (B * L, H, D): every token's query; q = src[q_index]
    q_index: torch.Tensor  # (total_q,) int32, rows of src, request-major
    q: torch.Tensor  # (total_q, H, D) packed masked queries
    k: torch.Tensor  # (B * L, H, D)
    v: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    spans: list[tuple[int, int, int, int]]  # (q start, q end, k start, k end) of requests, n_q > 0
    pad_batch: torch.Tensor  # (total_q,) int64: request of each packed query row
    pad_pos: torch.Tensor  # (total_q,) int64: position of the row inside its request's queries
    scale: float


def make_problem(comp: Composition, dtype: torch.dtype, device: torch.device) -> Problem:
    n_q, n_k, seq = comp.n_q, comp.n_k, comp.seq
    shape = (len(n_k) * seq, comp.heads, comp.head_dim)
    src, k, v = (torch.randn(shape, device=device, dtype=dtype) for _ in range(3))
    # Masked tokens: a random sorted subset of each request's maskable (leading) tokens.
    index = [
        i * seq + torch.randperm(comp.maskable, device=device)[:nq].sort().values
        for i, nq in enumerate(n_q)
    ]
    q_index = torch.cat(index).to(torch.int32)
    q = src[q_index.long()]
    cu_q = torch.tensor([0, *torch.tensor(n_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(n_k).cumsum(0).tolist()], dtype=torch.int32)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    spans = [(cq[i], cq[i + 1], ck[i], ck[i + 1]) for i in range(len(n_q)) if n_q[i] > 0]
    pad_batch = torch.repeat_interleave(torch.arange(len(n_q)), torch.tensor(n_q))
    pad_pos = torch.cat([torch.arange(nq) for nq in n_q])
    return Problem(
        comp, src, q_index, q, k, v, cu_q.to(device), cu_k.to(device), spans,
        pad_batch.to(device), pad_pos.to(device), comp.head_dim**-0.5,
    )  # fmt: skip

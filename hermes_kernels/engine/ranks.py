"""Dense ranks of retained positions, per row of the last dim: what both policies' re-index plans rank positions with
(HERMES's compaction, H2SVC's step 4; docs/hermes.md §2.7). One answer, three ways to it:
  dense_rank          — sort, "value changed" marks, prefix sum: any device, no host read;
  dense_rank_counting — a presence table over each row's span (CPU tensors: linear in n + span), in C
      (`dense_rank_native`, compact_cpu.c) when the library builds, else in torch ops; the sort when positions lie
      too far apart for counting to pay.
"""
from __future__ import annotations

import torch

from . import bindings, native

__all__ = ["BIG", "dense_rank", "dense_rank_counting", "dense_rank_native", "counting_span_limit"]

# Sentinels for masked lanes of int64 position arithmetic: far outside any position, with room to add 1.
BIG = 2 ** 62


def dense_rank(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """0-based dense rank of each value among the valid values of its row (last dim); int64, same shape.

    values int64 [..., n]; valid bool broadcastable to it. Invalid lanes sort last and get ranks past every valid
    one, so they never change a valid lane's rank. Sort + "value changed" marks + prefix sum, scattered back.
    """
    padded = values.masked_fill(~valid, BIG)
    ordered, order = padded.sort(dim=-1)
    changed = torch.zeros_like(ordered)
    changed[..., 1:] = (ordered[..., 1:] != ordered[..., :-1]).to(ordered.dtype)
    return torch.empty_like(ordered).scatter_(-1, order, changed.cumsum(-1))


def counting_span_limit(n: int) -> int:
    """The widest span of a row's values (max - min) that the counting ranks of n lanes take on: past it (positions
    far apart) a sort is cheaper. Shared by `dense_rank_counting` and H2SVC's C re-index plan."""
    return max(4 * n, 1 << 16)


def dense_rank_counting(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """`dense_rank` of CPU tensors by counting instead of sorting; ranks of invalid lanes are unspecified.

    Each row marks its valid values in a presence table over the row's span (max - min + 1), prefix-sums it and
    reads every value's rank back: linear in n + span; in C (compact_cpu.c) when the library is available, else in
    torch ops, which read the spans on the host (free on CPU tensors). If the widest span is over max(4n, 2^16)
    (positions far apart), the sort of `dense_rank` is cheaper and used.
    """
    n = values.shape[-1]
    if values.numel() == 0:  # no rows or no lanes: nothing to rank (and no row shape to reshape to)
        return torch.zeros_like(values)
    widest = counting_span_limit(n)
    if native.library("compact_cpu") is not None:
        return dense_rank_native(values, valid, widest)
    rows = values.reshape(-1, n)
    ok = valid.expand_as(values).reshape(-1, n)
    low = rows.masked_fill(~ok, BIG).amin(dim=-1, keepdim=True)
    high = rows.masked_fill(~ok, -BIG).amax(dim=-1, keepdim=True)
    span = int((high - low).amax()) + 1
    if span > widest:
        return dense_rank(values, valid)
    # invalid lanes (and rows without a valid value) land in the extra column `span`, past every valid one
    column = torch.where(ok, rows - low, span).clamp_(0, span)
    present = torch.zeros(rows.shape[0], span + 1, dtype=torch.int32)
    present.scatter_(1, column, 1)
    rank = present.cumsum_(1).sub_(1)
    return rank.gather(1, column).to(torch.int64).view(values.shape)


def dense_rank_native(values: torch.Tensor, valid: torch.Tensor, widest: int) -> torch.Tensor:
    """`dense_rank_counting` in one call of compact_cpu.c's `hermes_dense_rank` (a presence table per row, one
    pass per lane instead of the torch ops' ten passes over the positions); rows whose span is wider than `widest`
    make it refuse, and the sort ranks instead. Invalid lanes rank past every valid one (unspecified for callers,
    as in the torch ops). The library must be available."""
    n = values.shape[-1]
    rows = values.reshape(-1, n).contiguous()
    every = valid.numel() == 1 and bool(valid.reshape(()))  # host read of a CPU tensor: free
    ok = None if every else valid.expand_as(values).reshape(-1, n).to(torch.uint8).contiguous()
    rank = torch.empty_like(rows)
    if not bindings.dense_rank(rows, ok, widest, rank):
        return dense_rank(values, valid)
    return rank.view(values.shape)

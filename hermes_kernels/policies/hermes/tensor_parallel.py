"""HERMES under tensor parallelism (docs/multi-gpu.md#what-crosses): each rank of a `torch.distributed` group holds
an equal share of every layer's query and KV heads, so the pooled guidance attention it computes
(`pooled_attention`) is the mean over its own heads. One all-reduce (sum) of that float32 [L, B, V] tensor, divided
by the group's size, gives every rank the mean over all heads; scoring, the selection and the re-index decision are
deterministic on identical input, so every rank then keeps the same tokens and compacts its own heads. Nothing else
of a HERMES step crosses ranks.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def group_mean(attn: torch.Tensor, group) -> torch.Tensor:
    """The mean over the group's ranks of each rank's attn [L, B, V] float32 (float64 kept): a new contiguous tensor
    on attn's device, from one all-reduce (sum) divided by the group's size; attn itself when group is None.

    Every rank calls it with the same shape (the callers check shapes first) and whatever its values: a non-finite
    value on one rank reaches every rank, so the finiteness check after it (`check_attn_finite`) raises alike
    everywhere and no rank is left waiting in a collective the others skipped.
    """
    if group is None:
        return attn
    total = attn.clone(memory_format=torch.contiguous_format)  # never the caller's buffer: it may be a view
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return total.div_(group.size())

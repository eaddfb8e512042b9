"""The live-tensor census the leak tests and bench.soak read on CPU (docs/testing.md#scaffolding)."""
from __future__ import annotations

import gc
import warnings

import torch


def live_tensors() -> tuple[int, int]:
    """(count, bytes of distinct storages) of every tensor alive in the process, after a full collection:
    the CPU allocator keeps no statistics, so this census is how a per-step leak shows."""
    gc.collect()
    with warnings.catch_warnings():  # isinstance() pokes deprecated torch.distributed aliases
        warnings.simplefilter("ignore", FutureWarning)
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return len(tensors), sum(storages.values())

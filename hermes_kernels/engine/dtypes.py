"""The dtypes the ops accept and the dtype they compute in.

A cache (keys, values, queries) may be fp16, bf16, fp32 or fp64; scores, attention and features are fp32 or fp64.
Every op computes in fp32, or in fp64 when its inputs are fp64 (`work_dtype`), whatever the storage dtype.
"""
from __future__ import annotations

import torch
import triton.language as tl

CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
SCORE_DTYPES = (torch.float32, torch.float64)
TRITON_WORK = {torch.float32: tl.float32, torch.float64: tl.float64}  # a kernel's WORK constexpr per work dtype


def work_dtype(x: torch.Tensor) -> torch.dtype:
    """float64 for a float64 tensor, else float32: the arithmetic dtype of every op."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32

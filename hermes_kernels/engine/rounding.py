"""Correctly rounded arithmetic for the Triton kernels, where a decision depends on it (docs/gpu.md#rounding).

On NVIDIA GPUs a float32 `/` in a Triton kernel compiles to an approximate divide (`div.full.f32`, within 2 ulp),
while the interpreter and the torch twins divide exactly; a keep set or an STCE eviction decided by a score a few
ulp off would then differ between the GPU and every CPU test. float64 `/` is exact already.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def div_rn(x, y):
    """x / y rounded to nearest (IEEE), in x's float dtype (float32 or float64); y a tensor or scalar of any
    numeric type (converted to x's dtype first)."""
    y = (tl.zeros_like(x) + y).to(x.dtype)
    if x.dtype == tl.float64:
        return x / y
    else:
        return tl.div_rn(x, y)

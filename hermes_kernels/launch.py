"""The one place Triton kernels are launched from, so a step's launch count can be observed.

`launch(kernel, grid, *args, **meta)` runs `kernel[grid](*args, **meta)` and counts it; tests read
`launch_count()` before and after a step to check that it does not grow with layers or streams.
"""
from __future__ import annotations

_count = 0


def launch(kernel, grid, *args, **meta):
    """Launch a @triton.jit kernel on `grid` (a tuple) and count the launch."""
    global _count
    _count += 1
    return kernel[grid](*args, **meta)


def launch_count() -> int:
    """Triton launches issued through `launch` since the process started."""
    return _count

"""The one place Triton kernels are launched from, so a step's launches can be observed.

`launch(kernel, grid, *args, **meta)` runs `kernel[grid](*args, **meta)` and counts it; tests read
`launch_count()` before and after a step to check that it does not grow with layers or streams.

Inside `recording()` a launch is not run but recorded (kernel, grid, arguments, meta-parameters): the GPU compile
guard (`hermes_kernels.gpu_specs`, `python -m bench.kernels`) drives the launchers that way, with meta tensors at
the real model shapes, so the signatures and constexprs it compiles are exactly the ones the launchers produce.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator

_count = 0
_recorded: list[Launch] | None = None


@dataclasses.dataclass(frozen=True)
class Launch:
    """One recorded launch: `kernel[grid](*args, **meta)` as the launcher issued it."""

    kernel: Any
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    meta: dict[str, Any]


def launch(kernel, grid, *args, **meta):
    """Launch a @triton.jit kernel on `grid` (a tuple) and count the launch; inside `recording()`, record it."""
    global _count
    if _recorded is not None:
        _recorded.append(Launch(kernel, tuple(grid), args, meta))
        return None
    _count += 1
    return kernel[grid](*args, **meta)


@contextlib.contextmanager
def recording() -> Iterator[list[Launch]]:
    """Record instead of run every launch made inside the block (not counted by `launch_count`); yields the list.

    Only for launchers whose host side needs no tensor data (they are driven with meta tensors): a launcher that
    reads a device value would fail on a meta tensor, which is the point.
    """
    global _recorded
    if _recorded is not None:
        raise RuntimeError("recording: already recording launches")
    _recorded = []
    try:
        yield _recorded
    finally:
        _recorded = None


def launch_count() -> int:
    """Triton launches issued through `launch` since the process started."""
    return _count

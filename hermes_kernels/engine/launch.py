"""The one place Triton kernels are launched from, so every launch is counted and made alike (docs/gpu.md#launches).

`launch(kernel, grid, *args, **meta)` runs `kernel[grid](*args, **meta)` on the device (and its current stream) of
its tensor arguments, refusing arguments on two devices, with FMA contraction set explicitly (`FP_FUSION`, off:
docs/gpu.md#rounding); `launch_count()` counts launches for the tests (docs/api.md#backends). Inside `recording()`
launches are recorded, not run: the GPU compile guard drives the launchers that way (docs/benchmarks.md#kernels).
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator

import torch

# FMA contraction of every launch (Triton's `enable_fp_fusion`): off, so a kernel's products and sums round as the
# torch twin's do; docs/gpu.md lists what differs from the reference all the same.
FP_FUSION = False

_count = 0
_recorded: list[Launch] | None = None


@dataclasses.dataclass(frozen=True)
class Launch:
    """One recorded launch: `kernel[grid](*args, **meta)` as the launcher issued it; `device` is the CUDA device
    it would have been made current for (None: no CUDA tensor among the arguments)."""

    kernel: Any
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    meta: dict[str, Any]
    device: torch.device | None = None


def _argument_names(kernel, count: int) -> list[str]:
    names = list(getattr(kernel, "arg_names", ()))
    return names[:count] + [f"argument {i}" for i in range(len(names), count)]


def launch_device(kernel, args: tuple, meta: dict) -> torch.device | None:
    """The CUDA device the tensor arguments (anything with a `device` and a `data_ptr`, as Triton takes pointers)
    live on, or None when none is on CUDA. ValueError naming two arguments on different devices: a launch reads
    and writes one device's memory on that device's stream."""
    name_of = dict(zip(range(len(args)), _argument_names(kernel, len(args))))
    found: tuple[str, torch.device] | None = None
    for key, value in (*enumerate(args), *meta.items()):
        if not (hasattr(value, "data_ptr") and hasattr(value, "device")):
            continue
        name, device = name_of.get(key, key), torch.device(value.device)
        if found is None:
            found = (name, device)
        elif device != found[1]:
            kernel_name = getattr(getattr(kernel, "fn", kernel), "__name__", repr(kernel))
            raise ValueError(f"{name}: on {device} but {found[0]} is on {found[1]}; {kernel_name} launches on "
                             f"one device, so pass all its tensors on one")
    return found[1] if found is not None and found[1].type == "cuda" else None


def launch(kernel, grid, *args, **meta):
    """Launch a @triton.jit kernel on `grid` (a tuple) on its tensors' device and stream, with FMA contraction
    set by `FP_FUSION`, and count the launch; inside `recording()`, record it instead. Arguments on two devices
    raise ValueError before anything runs."""
    global _count
    device = launch_device(kernel, args, meta)
    meta = {**meta, "enable_fp_fusion": FP_FUSION}
    if _recorded is not None:
        _recorded.append(Launch(kernel, tuple(grid), args, meta, device))
        return None
    _count += 1
    with torch.cuda.device(device) if device is not None else contextlib.nullcontext():
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

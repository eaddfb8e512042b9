"""Timing of one `Case`, and the copy bandwidth that sets the memory floor (docs/hermes.md §4).

Before every timed run: the untimed reset (in-place stages), then a write over a buffer larger than the last-level
cache, so no run finds its inputs cache-resident from the previous one (a streaming step follows a model forward
that has evicted them). CPU: host clock around `run()`. CUDA: the device is synchronised, then CUDA events
bracket `run()`, so the time includes the host's launch overhead of an isolated step (what a streaming session
pays once per chunk) but not the reset.
"""
from __future__ import annotations

import dataclasses
import gc
import time

import torch

from .stages import Case


@dataclasses.dataclass(frozen=True)
class Timing:
    """Per-run latency in milliseconds: median, 20th and 80th percentiles and fastest of `repeats` runs."""

    median: float
    p20: float
    p80: float
    best: float
    repeats: int


def summarise(samples_ms: list[float]) -> Timing:
    """Median / p20 / p80 (linear interpolation between order statistics) of a non-empty sample list."""
    if not samples_ms:
        raise ValueError("samples_ms: need at least one timing")
    q = torch.tensor(samples_ms, dtype=torch.float64).quantile(torch.tensor([0.5, 0.2, 0.8], dtype=torch.float64))
    return Timing(median=q[0].item(), p20=q[1].item(), p80=q[2].item(), best=min(samples_ms),
                  repeats=len(samples_ms))


FLUSH_BYTES = 128 << 20    # over twice an H100/H200 L2 (50 MB) or a server CPU's L3 slice (32 MB here)
_flush_buffers: dict[torch.device, torch.Tensor] = {}


def _cold_start(device: torch.device) -> None:
    """Evict the last-level cache (one layer's guidance keys, a few MB, would stay resident across repeats)
    and, on CUDA, wait for the device."""
    if device not in _flush_buffers:
        _flush_buffers[device] = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device)
    _flush_buffers[device].fill_(1)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_case(case: Case, device: torch.device, warmup: int, repeats: int) -> Timing:
    """Run `warmup` untimed rounds (compilation, first-touch page faults, allocator growth), then `repeats`
    timed ones, each after an untimed `reset` when the case works in place."""
    for _ in range(warmup):
        if case.reset is not None:
            case.reset()
        case.run()
    samples = []
    gc_was_enabled = gc.isenabled()
    gc.disable()    # a collection inside a timed run would be charged to the stage
    try:
        for _ in range(repeats):
            if case.reset is not None:
                case.reset()
            _cold_start(device)
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                case.run()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                case.run()
                samples.append((time.perf_counter() - t0) * 1e3)
    finally:
        if gc_was_enabled:
            gc.enable()
    return summarise(samples)


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Achievable memory bandwidth in bytes/s: the fastest of `repeats` copies of a `nbytes` tensor, counting
    bytes read plus written (a ceiling, so the best run, not the median).

    CPU: a host copy; CUDA: a device-to-device copy. Random contents (never zeros) and a warm-up that touches
    the destination, so page faults and lazy allocation stay out of the number.
    """
    src = torch.rand(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    case = Case(run=lambda: dst.copy_(src), bytes_moved=2 * nbytes)
    timing = time_case(case, device, warmup=2, repeats=repeats)
    return case.bytes_moved / (timing.best * 1e-3)

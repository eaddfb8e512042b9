"""Peak extra memory of one run of a `Case`: what the stage allocates on top of its inputs.

CUDA: the caching allocator's peak statistics. CPU: the PyTorch profiler's allocation trace (every tensor
allocation and free of the CPU allocator with the running total), which counts tensors exactly; process RSS
or tracemalloc would see allocator caching and Python objects instead of tensors.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

from .stages import Case


@contextlib.contextmanager
def _quiet_native_stderr():
    """Send file descriptor 2 to /dev/null: the profiler's native library prints start/stop lines there."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def _cpu_peak_bytes(fn) -> int:
    """Highest running total of CPU tensor allocations during fn(), relative to its start."""
    with _quiet_native_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    finally:
        os.remove(path)
    memory = sorted((e for e in events if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0),
                    key=lambda e: (e["ts"], e["args"].get("Ev Idx", 0)))
    if not memory:
        return 0
    start = memory[0]["args"]["Total Allocated"] - memory[0]["args"]["Bytes"]
    return max(0, max(e["args"]["Total Allocated"] for e in memory) - start)


def peak_extra_bytes(case: Case, device: torch.device) -> int:
    """Peak bytes allocated by one `case.run()` beyond what was allocated before it (after its reset)."""
    if case.reset is not None:
        case.reset()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        case.run()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    return _cpu_peak_bytes(case.run)

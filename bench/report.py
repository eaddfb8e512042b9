"""Result rows: the printed table (speed-up over reference, GB/s, ratio to the memory floor) and CSV history.

One row per (stage, backend, spec). Rows whose backend is missing keep status "n/a: why" and an error keeps
"error: what"; neither is written to CSV. CSV files are appended to, with a header when new, so history
across commits can be plotted.
"""
from __future__ import annotations

import csv
import dataclasses
import datetime
import os
import platform
import re
import subprocess
from pathlib import Path

import torch

CSV_FIELDS = ("timestamp", "stage", "backend", "shape", "budget", "chunk", "dtype", "batch", "reindex",
              "num_tokens", "bytes_moved", "median_ms", "p20_ms", "p80_ms", "repeats", "gbps", "floor_ratio",
              "speedup_vs_reference", "peak_extra_mib", "bandwidth_gbps", "load_before", "load_after", "device",
              "commit")
STATUS_WIDTH = 100


@dataclasses.dataclass
class Row:
    """One measured point. Times in ms; bytes_moved: least bytes the stage must move (docs/hermes.md §4);
    gbps = bytes_moved / median; floor_ratio = median / (bytes_moved / bandwidth), for stages with a floor.
    budget 0: an H2SVC row (per-class frame memories, no token budget; printed as "-")."""

    stage: str
    backend: str
    shape: str
    budget: int
    chunk: int
    dtype: str
    batch: int
    reindex: str
    num_tokens: int
    bytes_moved: int = 0
    has_floor: bool = False
    status: str = "ok"
    median_ms: float | None = None
    p20_ms: float | None = None
    p80_ms: float | None = None
    repeats: int = 0
    gbps: float | None = None
    floor_ratio: float | None = None
    speedup_vs_reference: float | None = None
    peak_extra_mib: float | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def point(self) -> tuple:
        """What a row is compared on across backends."""
        return self.stage, self.shape, self.budget, self.chunk, self.dtype, self.batch, self.reindex


def fill_speedups(rows: list[Row]) -> None:
    """speedup_vs_reference = reference median / this median at the same point (None without a reference)."""
    reference = {r.point(): r.median_ms for r in rows if r.backend == "reference" and r.ok}
    for r in rows:
        ref = reference.get(r.point())
        r.speedup_vs_reference = ref / r.median_ms if (r.ok and ref) else None


def fill_floor_ratios(rows: list[Row], bandwidth: float) -> None:
    """floor_ratio = median / (bytes_moved / bandwidth) for the rows whose stage has a memory floor."""
    for r in rows:
        r.floor_ratio = r.median_ms * 1e-3 / (r.bytes_moved / bandwidth) if (r.ok and r.has_floor) else None


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def format_table(rows: list[Row]) -> str:
    """Fixed-width table, one line per row, a blank line between benchmark points' groups.

    An n/a or error row prints its status in place of the numbers, so it does not widen those columns.
    """
    header = ("stage", "backend", "shape", "budget", "chunk", "dtype", "median ms", "p20 ms", "p80 ms",
              "vs ref", "GB/s", "x floor", "peak MiB")
    keys = [(r.stage, r.backend, r.shape, str(r.budget) if r.budget else "-", f"{r.chunk}f", r.dtype) for r in rows]
    numbers = [(_fmt(r.median_ms, ".3f"), _fmt(r.p20_ms, ".3f"), _fmt(r.p80_ms, ".3f"),
                _fmt(r.speedup_vs_reference, ".1f", "x"), _fmt(r.gbps, ".1f"), _fmt(r.floor_ratio, ".1f"),
                _fmt(r.peak_extra_mib, ".1f")) if r.ok else None for r in rows]
    widths = [len(h) for h in header]
    for key, nums in zip(keys, numbers):
        for i, cell in enumerate(key + (nums or ())):
            widths[i] = max(widths[i], len(cell))

    def render(key, nums, status="") -> str:
        left = "  ".join(c.ljust(w) for c, w in zip(key, widths))
        if nums is None:    # long exception texts are cut; the full text is in the Row
            return f"{left}  {status if len(status) <= STATUS_WIDTH else status[:STATUS_WIDTH - 3] + '...'}"
        return left + "  " + "  ".join(c.rjust(w) for c, w in zip(nums, widths[len(key):]))

    out = [render(header[:6], header[6:]), "-" * (sum(widths) + 2 * (len(widths) - 1))]
    for i, (r, key, nums) in enumerate(zip(rows, keys, numbers)):
        if i and key[2:] != keys[i - 1][2:]:
            out.append("")
        out.append(render(key, nums, r.status))
    return "\n".join(out)


def commit_hash() -> str:
    """`git rev-parse --short HEAD` of the tree bench/ lives in, or "unknown"."""
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent,
                              capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return done.stdout.strip() if done.returncode == 0 and done.stdout.strip() else "unknown"


def device_name(device: torch.device) -> str:
    """Human-readable device: the GPU's name, or the CPU model with the threads torch uses."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return f"{model} ({torch.get_num_threads()} threads)"


def device_kind(device: torch.device) -> str:
    """File-name slug of the device: "cpu" or the GPU name, e.g. "nvidia-h200"."""
    if device.type != "cuda":
        return "cpu"
    return re.sub(r"[^a-z0-9.]+", "-", torch.cuda.get_device_name(device).lower()).strip("-")


def append_csv(rows: list[Row], path: Path, device: str, commit: str, bandwidth_gbps: float,
               host_load: tuple[float | None, float | None] = (None, None)) -> int:
    """Append the measured rows to `path` (header when the file is new); returns how many were written.

    host_load: the CPU load average before and after the measurements (CPU runs), so that contended runs can
    be told apart later.
    """
    measured = [r for r in rows if r.ok]
    if not measured:
        return 0
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists() or os.path.getsize(path) == 0
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        if new:
            writer.writeheader()
        for r in measured:
            record = {k: v for k, v in dataclasses.asdict(r).items() if k in CSV_FIELDS}
            record.update(timestamp=stamp, bandwidth_gbps=f"{bandwidth_gbps:.1f}", device=device, commit=commit,
                          **{name: "" if value is None else f"{value:.2f}"
                             for name, value in zip(("load_before", "load_after"), host_load)})
            writer.writerow({k: ("" if v is None else (f"{v:.6g}" if isinstance(v, float) else v))
                             for k, v in record.items()})
    return len(measured)

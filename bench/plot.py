"""PNG of the whole-step latency: vs budget (at the largest chunk) and vs chunk size (at the largest budget),
one line per backend, one row of panels per shape and dtype, log-scale latency with p20-p80 bars.

matplotlib is imported here only, lazily, so the benchmark runs without it (a note is printed instead).
"""
from __future__ import annotations

from pathlib import Path

from .report import Row

PLOT_STAGE = "step"


def plot_rows(rows: list[Row], path: Path, title: str) -> Path | None:
    """Write the plot to `path`; returns None (with a printed note) when matplotlib or data are missing."""
    points = [r for r in rows if r.ok and r.stage == PLOT_STAGE]
    if not points:
        print(f"plot: no '{PLOT_STAGE}' timings to plot")
        return None
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot: matplotlib is not installed; skipping the PNG")
        return None
    panels = sorted({(r.shape, r.dtype) for r in points})
    fig, axes = plt.subplots(len(panels), 2, figsize=(11, 3.6 * len(panels)), squeeze=False)
    for (shape, dtype), (ax_budget, ax_chunk) in zip(panels, axes):
        mine = [r for r in points if (r.shape, r.dtype) == (shape, dtype)]
        top_chunk = max(r.chunk for r in mine)
        top_budget = max(r.budget for r in mine)
        for ax, x_of, fixed, xlabel in (
                (ax_budget, lambda r: r.budget, lambda r: r.chunk == top_chunk, f"budget (chunk {top_chunk} frames)"),
                (ax_chunk, lambda r: r.chunk, lambda r: r.budget == top_budget, f"chunk frames (budget {top_budget})")):
            for backend in sorted({r.backend for r in mine}):
                line = sorted((r for r in mine if r.backend == backend and fixed(r)), key=x_of)
                if not line:
                    continue
                xs = [x_of(r) for r in line]
                ys = [r.median_ms for r in line]
                err = [[r.median_ms - r.p20_ms for r in line], [r.p80_ms - r.median_ms for r in line]]
                ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=backend)
            ax.set_yscale("log")
            ax.set_xlabel(xlabel)
            ax.set_ylabel("step latency (ms)")
            ax.set_title(f"{shape} {dtype}")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

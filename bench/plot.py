"""PNG of a run at a glance: per shape (and dtype), every stage of both policies that ran, one bar per backend, as
a multiple of its copy floor (left: how far from moving the least bytes at the measured bandwidth) and of the
reference path (right: the plain PyTorch reference, or the released-style code for the released_* stages; below
1 is faster). The title says the machine, its load and the commit.

matplotlib is imported here only, lazily, so the benchmark runs without it (a note is printed instead).
"""
from __future__ import annotations

from pathlib import Path

from .report import Row

# bar colours by backend, so one backend reads alike in every panel
COLOURS = {"reference": "#9e9e9e", "released": "#6d4c41", "eager": "#fdd835", "torch": "#1e88e5",
           "torch-ops": "#90caf9", "triton": "#e53935"}
# the paths the right panel divides by: the plain reference, and the released-style code of the released_* stages
BASELINES = ("reference", "released")


def _label(row: Row) -> str:
    """The x label of a row's stage: HERMES stages with their budget and chunk, H2SVC's with the chunk."""
    if row.budget:
        return f"{row.stage}\nb={row.budget} c={row.chunk}"
    return f"{row.stage}\nc={row.chunk}"


def _bars(ax, groups: dict[str, dict[str, float]], ylabel: str) -> None:
    """Grouped bars on a log axis with a line at 1: groups {x label: {backend: value}}."""
    order = list(COLOURS)
    backends = sorted({b for values in groups.values() for b in values},
                      key=lambda b: (order.index(b) if b in order else len(order), b))
    width = 0.8 / max(len(backends), 1)
    for j, backend in enumerate(backends):
        xs = [i + (j - (len(backends) - 1) / 2) * width for i, values in enumerate(groups.values())
              if backend in values]
        ys = [values[backend] for values in groups.values() if backend in values]
        ax.bar(xs, ys, width, label=backend, color=COLOURS.get(backend))
        for x, y in zip(xs, ys):
            ax.annotate(f"{y:.3g}", (x, y), ha="center", va="bottom", fontsize=7)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_yscale("log")
    ax.set_xticks(range(len(groups)), list(groups), fontsize=8)
    ax.set_ylabel(ylabel)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=8)


def panels(rows: list[Row]) -> dict[tuple[str, str], tuple[dict, dict]]:
    """What the plot draws, per (shape, dtype): ({stage label: {backend: median / copy floor}}, {stage label:
    {backend: median / the reference path's median at the same point}}), over the rows that ran."""
    points = [r for r in rows if r.ok and r.median_ms]
    baseline = {r.point(): r.median_ms for r in points if r.backend in BASELINES}
    out = {}
    for r in points:
        floor, reference = out.setdefault((r.shape, r.dtype), ({}, {}))
        if r.floor_ratio:
            floor.setdefault(_label(r), {})[r.backend] = r.floor_ratio
        if r.point() in baseline and r.backend not in BASELINES:
            reference.setdefault(_label(r), {})[r.backend] = r.median_ms / baseline[r.point()]
    return dict(sorted(out.items()))


def plot_rows(rows: list[Row], path: Path, title: str) -> Path | None:
    """Write the plot to `path`; returns None (with a printed note) when matplotlib or data are missing."""
    drawn = panels(rows)
    if not drawn:
        print("plot: no timings to plot")
        return None
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot: matplotlib is not installed; skipping the PNG")
        return None
    widest = max(len(floor.keys() | reference.keys()) for floor, reference in drawn.values())
    fig, axes = plt.subplots(len(drawn), 2, figsize=(max(11, 3.2 * widest), 4.2 * len(drawn)), squeeze=False)
    for ((shape, dtype), (floor, reference)), (ax_floor, ax_reference) in zip(drawn.items(), axes):
        for ax, groups, ylabel, what in (
                (ax_floor, floor, "median / copy floor", "time as a multiple of its copy floor"),
                (ax_reference, reference, "median / reference median", "time as a multiple of the reference path")):
            if groups:
                _bars(ax, groups, ylabel)
            else:
                ax.text(0.5, 0.5, "no stage of this run has one", ha="center", va="center", transform=ax.transAxes)
                ax.set_xticks([])
                ax.set_yticks([])
            ax.set_title(f"{shape} {dtype}: {what}", fontsize=10)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path

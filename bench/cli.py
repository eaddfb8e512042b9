"""`python -m bench`, the main job: per-chunk latency of both policies' steps at real model shapes on synthetic caches.

The first run times the whole step of HERMES and H2SVC at the LLaVA-OV-7B and Qwen2.5-VL-7B shapes with every backend
that runs on the device, the ratio to the memory floor and the plot; `--full` times every stage on the grid,
`--quick` is CI's smoke run. Rows go to bench/results/<device>.csv, the plot to <device>.png; then the memory of a
512 s stream and one end-to-end step of a tiny model. How to read it: docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from hermes_kernels.engine import native

from . import e2e
from .memory import peak_extra_bytes
from .plot import plot_rows
from .report import (Row, append_csv, commit_hash, device_kind, device_name, fill_floor_ratios, fill_speedups,
                     format_table)
from .inputs import Spec, make_inputs
from .shapes import BUDGETS, CHUNK_FRAMES, PREFIX_LEN, SHAPES, SMOKE_SHAPES, TOKENS_PER_FRAME, get_shape
from .stages import (BACKENDS, RELEASED, RELEASED_FAMILIES, RELEASED_STAGES, STAGES, Unavailable, cache_bytes,
                     stage_backends, stage_policy)
from .timing import copy_bandwidth, time_case

# a run's CSV and plot; git ignores the folder, so a run leaves the checkout clean (the dated records under
# bench/results/ are written by hand, with their command)
OUT_DIR = Path(__file__).parent / "out"
DTYPES = {"float16": torch.float16, "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float32": torch.float32, "fp32": torch.float32}

# Defaults per run. The first run (no flag) is the headline: the whole step of both policies at the two 7B shapes
# (1D RoPE and M-RoPE), one budget and chunk, every backend that runs on the device, with the floor ratio and the
# plot. --full is the grid. CPU: the two 7B shapes and Qwen3.5's (partial rotary), both budgets, two chunk sizes,
# fp32, every stage but the released-style guidance pass (slow Python at the 7B shapes on a CPU:
# docs/integrations.md#what-it-buys). CUDA: every shape, fp16, more chunk sizes and repeats.
# The released-style rows (stages released_*) are slow Python: `released_repeats` timed runs, no warm-up besides
# the memory run.
HEADLINE_STAGES = ["step", "h2svc_step"]
DEFAULTS = {
    "cpu": dict(shapes=["llava-ov-7b", "qwen2.5-vl-7b"], budgets=[max(BUDGETS)], chunks=[CHUNK_FRAMES],
                dtypes=["float32"], repeats=5, reference_repeats=3, warmup=1, released_repeats=1,
                stages=HEADLINE_STAGES),
    "cuda": dict(shapes=["llava-ov-7b", "qwen2.5-vl-7b"], budgets=[max(BUDGETS)], chunks=[CHUNK_FRAMES],
                 dtypes=["float16"], repeats=20, reference_repeats=3, warmup=3, released_repeats=1,
                 stages=HEADLINE_STAGES),
    "cpu-full": dict(shapes=["llava-ov-7b", "qwen2.5-vl-7b", "qwen3.5"], budgets=list(BUDGETS),
                     chunks=[8, CHUNK_FRAMES], dtypes=["float32"], repeats=10, reference_repeats=5, warmup=2,
                     released_repeats=1, stages=[s for s in STAGES if s != "released_guidance"]),
    "cuda-full": dict(shapes=list(SHAPES), budgets=list(BUDGETS), chunks=[4, 8, CHUNK_FRAMES],
                      dtypes=["float16"], repeats=50, reference_repeats=5, warmup=5, released_repeats=5,
                      stages=list(STAGES)),
    "quick": dict(shapes=list(SMOKE_SHAPES), budgets=[64], chunks=[1], dtypes=None, repeats=3,
                  reference_repeats=3, warmup=1, released_repeats=1, stages=list(STAGES)),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    runs = p.add_mutually_exclusive_group()
    runs.add_argument("--quick", action="store_true",
                      help="smoke run: tiny shapes, few repeats, results into a temporary folder")
    runs.add_argument("--full", action="store_true",
                      help="the whole grid: every stage, both budgets, more chunk sizes (CPU: 10 minutes and more)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu or cuda[:i] (default: cuda when available)")
    p.add_argument("--shapes", nargs="+", help=f"model shapes, from {sorted(SHAPES) + sorted(SMOKE_SHAPES)} "
                   "(default: llava-ov-7b qwen2.5-vl-7b; --full on CUDA: all)")
    p.add_argument("--budgets", nargs="+", type=int,
                   help="visual tokens kept per layer (default 6000; --full: 4000 6000)")
    p.add_argument("--chunks", nargs="+", type=int, help="frames per chunk (default 16; --full: per device)")
    p.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), help="cache dtype (default fp32 CPU, fp16 CUDA)")
    p.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS),
                   help="default: all (triton only on CUDA; torch-ops, the torch backend without its C code, only "
                        "on CPU for compact, step, h2svc_stce and h2svc_step)")
    p.add_argument("--stages", nargs="+", choices=list(STAGES),
                   help="default: step h2svc_step, the whole step of each policy (--full: all; on CPU all but "
                        "released_guidance)")
    p.add_argument("--repeats", type=int,
                   help="timed runs per point (default 5 CPU, 20 CUDA; --full: 10 CPU, 50 CUDA)")
    p.add_argument("--reference-repeats", type=int, help="timed runs of the reference backend (default 3; --full: 5)")
    p.add_argument("--released-repeats", type=int,
                   help="timed runs of the released-style rows of the released_* stages (default 1; --full CUDA: 5)")
    p.add_argument("--warmup", type=int, help="untimed runs first (default 1 CPU, 3 CUDA; --full: 2 CPU, 5 CUDA)")
    p.add_argument("--batch", type=int, default=1, help="streams in lockstep, B (default 1)")
    p.add_argument("--reindex", choices=("eager", "lazy"), default="eager",
                   help="eager re-indexes every step (the worst case: every kept key is rotated); lazy "
                        "re-indexes only near max_positions, which synthetic positions never reach (default eager)")
    p.add_argument("--prefix-len", type=int, default=PREFIX_LEN, help=f"system-prompt tokens P (default {PREFIX_LEN})")
    p.add_argument("--tokens-per-frame", type=int, default=TOKENS_PER_FRAME,
                   help=f"visual tokens per frame (default {TOKENS_PER_FRAME})")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic inputs (default 0)")
    p.add_argument("--out", type=Path, metavar="DIR",
                   help="where this run's CSV rows and plot go (default bench/out/, which git ignores; --quick: a "
                        "temp dir)")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--no-e2e", action="store_true", help="skip the end-to-end streaming step")
    args = p.parse_args(argv)
    kind = "cuda" if args.device.startswith("cuda") else "cpu"
    defaults = DEFAULTS["quick" if args.quick else f"{kind}-full" if args.full else kind]
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.dtypes is None:     # --quick keeps the device's dtype
        args.dtypes = ["float16"] if args.device.startswith("cuda") else ["float32"]
    if min(args.repeats, args.reference_repeats, args.released_repeats) < 1 or args.warmup < 0:
        p.error("--repeats/--reference-repeats/--released-repeats must be >= 1 and --warmup >= 0")
    return args


def measure(specs: list[Spec], stages: list[str], backends: tuple[str, ...], args: argparse.Namespace,
            device: torch.device) -> list[Row]:
    """Time (and size) every stage x backend at every spec; returns one Row each, n/a and errors included."""
    from tqdm.auto import tqdm

    jobs = [(spec, stage, backend) for spec in specs for stage in stages if stage_policy(stage) == spec.policy
            and (stage not in RELEASED_STAGES or released_point(spec, specs))
            for backend in stage_backends(stage, backends)]
    rows = []
    # a bar on a terminal; in a log (CI, gpu_check) one plain line per benchmark point instead
    interactive = sys.stderr.isatty()
    bar = tqdm(total=len(jobs), desc="bench", unit="case", file=sys.stderr, dynamic_ncols=True,
               disable=not interactive)
    inputs, current = None, None
    for done, (spec, stage, backend) in enumerate(jobs):
        bar.set_postfix_str(f"{spec.label()} {stage} {backend}")
        if spec is not current:
            if not interactive:
                print(f"bench [{done}/{len(jobs)} cases] {spec.label()}", file=sys.stderr, flush=True)
            inputs, current = None, spec
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            try:
                inputs = make_inputs(spec)
            except Exception as exc:   # e.g. out of memory: this point's rows say so, the others still run
                inputs = exc
        row = Row(stage=stage, backend=backend, shape=spec.shape.name, budget=spec.budget, chunk=spec.chunk_frames,
                  dtype=spec.dtype_name, batch=spec.batch, reindex=spec.reindex, num_tokens=spec.num_tokens)
        try:
            if isinstance(inputs, Exception):
                raise RuntimeError(f"building the inputs failed: {type(inputs).__name__}: {inputs}")
            case = STAGES[stage](inputs, backend)
            warmup = args.warmup
            if not args.no_memory:      # the memory run doubles as the first warm-up run
                row.peak_extra_mib = peak_extra_bytes(case, device) / 2 ** 20
                warmup = max(warmup - 1, 0)
            repeats = args.reference_repeats if backend == "reference" else args.repeats
            if backend == RELEASED:     # slow Python: the memory run (if any) is its only warm-up
                warmup, repeats = 0, args.released_repeats
            timing = time_case(case, device, warmup, repeats)
            row.median_ms, row.p20_ms, row.p80_ms, row.repeats = timing.median, timing.p20, timing.p80, timing.repeats
            row.bytes_moved, row.has_floor = case.bytes_moved, case.has_floor
            row.gbps = case.bytes_moved / (timing.median * 1e-3) / 1e9
        except (Unavailable, NotImplementedError, ImportError) as exc:
            row.status = f"n/a: {type(exc).__name__}: {exc}"
        except Exception as exc:   # a broken backend must not hide the other rows; reported and exit code 1
            row.status = f"error: {type(exc).__name__}: {exc}"
            traceback.print_exc(file=sys.stderr)
        rows.append(row)
        bar.update()
    bar.close()
    fill_speedups(rows)
    fill_released_ratios(rows)
    return rows


def released_point(spec: Spec, specs: list[Spec]) -> bool:
    """The released stages run once per shape and dtype of a family the released code has (LLaVA-OV, Qwen2.5-VL): at
    the largest budget and chunk of the run."""
    if spec.shape.preset_name not in RELEASED_FAMILIES:
        return False
    same = [s for s in specs if s.policy == "hermes" and s.shape == spec.shape and s.dtype == spec.dtype]
    return spec.budget == max(s.budget for s in same) and spec.chunk_frames == max(s.chunk_frames for s in same)


def fill_released_ratios(rows: list[Row]) -> None:
    """The released stages' "vs ref": the released-style median over this one, at the same point."""
    released = {r.point(): r.median_ms for r in rows if r.stage in RELEASED_STAGES and r.backend == RELEASED and r.ok}
    for r in rows:
        if r.stage in RELEASED_STAGES:
            base = released.get(r.point())
            r.speedup_vs_reference = base / r.median_ms if (r.ok and base) else None


def headline(rows: list[Row]) -> list[str]:
    """One line per point: whole-step speed-up of every backend over reference (HERMES and H2SVC steps)."""
    lines = []
    base = {r.point(): r.median_ms for r in rows if r.stage in RELEASED_STAGES and r.backend == RELEASED and r.ok}
    for r in rows:
        if r.stage in RELEASED_STAGES and r.backend != RELEASED and r.speedup_vs_reference is not None:
            lines.append(f"{r.stage} accelerate(backend={r.backend!r}) vs the released-style code: "
                         f"{r.speedup_vs_reference:.1f}x, {base[r.point()]:.1f} -> {r.median_ms:.1f} ms per chunk "
                         f"({r.shape} b={r.budget} chunk={r.chunk}f {r.dtype}, N={r.num_tokens})")
        if r.stage in ("step", "h2svc_step") and r.backend != "reference" and r.speedup_vs_reference is not None:
            memory = "h2svc" if r.stage == "h2svc_step" else f"b={r.budget}"
            lines.append(f"{r.stage} speed-up {r.backend} vs reference: {r.speedup_vs_reference:.1f}x "
                         f"({r.shape} {memory} chunk={r.chunk}f {r.dtype}, N={r.num_tokens})")
    return lines


def cache_bytes_lines(shapes: list[str], dtype: torch.dtype, prefix_len: int, tokens_per_frame: int) -> list[str]:
    """One line per shape: K/V bytes of H2SVC (default ratios and head map) vs a dense 64-frame cache vs HERMES at
    budget 6000, retained memory and with room for one 16-frame chunk (`stages.cache_bytes`)."""
    lines = []
    for name in shapes:
        sizes = cache_bytes(get_shape(name), dtype, prefix_len, tokens_per_frame)
        cells = [f"{policy} {kept / 2 ** 20:.0f} MiB ({room / 2 ** 20:.0f})" for policy, (kept, room) in sizes.items()]
        lines.append(f"cache K+V bytes {name} {str(dtype).removeprefix('torch.')} per stream: " + " vs ".join(cells)
                     + f" (in parentheses: with room for a 16-frame chunk of {tokens_per_frame}-token frames)")
    return lines


def main(argv: list[str] | None = None) -> int:
    t_start = time.perf_counter()
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("--device cuda: CUDA is not available here", file=sys.stderr)
        return 2
    backends = tuple(args.backends)
    if device.type != "cuda" and "triton" in backends:
        backends = tuple(b for b in backends if b != "triton")
        print("note: triton skipped on CPU (the interpreter is for correctness tests only, its timings mean "
              "nothing); its rows come from a CUDA machine (bench/gpu_check.sh)")
    if device.type != "cpu" and "torch-ops" in backends:
        backends = tuple(b for b in backends if b != "torch-ops")  # the C row kernel is CPU-only: same as torch
    if device.type == "cpu":
        reason = native.unavailable_reason("compact_cpu")
        print("torch backend, compaction rows on CPU: "
              + ("C walk (hermes_kernels/engine/compact_cpu.c)" if reason is None else f"torch ops ({reason})")
              + "; torch-ops rows: always torch ops")
        reason = native.unavailable_reason("stce_cpu")
        print("torch backend, STCE arrival loop on CPU: " + ("C (hermes_kernels/engine/stce_cpu.c)" if reason is None
              else f"torch ops ({reason})") + "; torch-ops rows: always torch ops")
    results_dir = args.out or (Path(tempfile.mkdtemp(prefix="bench-quick-")) if args.quick else OUT_DIR)
    # HERMES points per budget; H2SVC points (frame memories, no budget: 0) once per shape, dtype and chunk
    policies = {stage_policy(stage) for stage in args.stages}
    specs = [Spec(shape=get_shape(shape), budget=budget, chunk_frames=chunk, dtype=DTYPES[dtype], device=device,
                  batch=args.batch, prefix_len=args.prefix_len, tokens_per_frame=args.tokens_per_frame,
                  reindex=args.reindex, seed=args.seed, policy=policy)
             for shape in args.shapes for dtype in args.dtypes for policy in ("hermes", "h2svc") if policy in policies
             for budget in (args.budgets if policy == "hermes" else [0]) for chunk in args.chunks]
    for spec in specs:      # bad budgets etc. fail here, before minutes of measuring
        spec.cfg

    name, commit = device_name(device), commit_hash()
    print(f"device: {name}; torch {torch.__version__}; commit {commit}")
    load = os.getloadavg()[0] if device.type == "cpu" and hasattr(os, "getloadavg") else None
    if load is not None:
        print(f"host load average before the run: {load:.1f} on {os.cpu_count()} cores"
              + ("  WARNING: other processes hold the CPU, timings will be inflated and noisy" if load > 0.5 else ""))
    copy_bytes = (64 << 20) if args.quick else (1 << 30)
    bandwidths = [copy_bandwidth(device, copy_bytes)]
    rows = measure(specs, args.stages, backends, args, device)
    bandwidths.append(copy_bandwidth(device, copy_bytes))
    bandwidth = max(bandwidths)     # a ceiling: the better of the copies before and after the measurements
    print(f"copy bandwidth (read + write, best of 5 {copy_bytes >> 20} MiB "
          f"{'device-to-device' if device.type == 'cuda' else 'host'} copies): before "
          f"{bandwidths[0] / 1e9:.1f} GB/s, after {bandwidths[1] / 1e9:.1f} GB/s; the memory floor uses "
          f"{bandwidth / 1e9:.1f} GB/s")
    fill_floor_ratios(rows, bandwidth)
    load_after = None
    if load is not None:    # the 1-minute average lags: a competitor that started mid-run shows up here
        load_after = os.getloadavg()[0]
        busy = torch.get_num_threads() + 0.5     # this run's own threads count towards it
        print(f"host load average after the measurements: {load_after:.1f} (this run's threads: "
              f"{torch.get_num_threads()})" + ("  WARNING: timings contended" if load_after > busy else ""))
    print()
    print(format_table(rows))
    print()
    print("median/p20/p80: per-run latency over the repeats; vs ref: reference median / this median (released_* "
          "rows: the released-style median / this median)\n"
          "GB/s: least bytes the stage must move / median; x floor (compact, step): median / (least bytes / copy "
          "bandwidth)\npeak MiB: extra memory of one run; pooled_attention rows: one layer's guidance pass "
          "(q40 mixed prompt, q20 global)")
    for line in headline(rows):
        print(line)
    if "h2svc" in policies:
        # in the models' own dtype, whatever the benchmarked cache dtype: sizes, not timings
        for line in cache_bytes_lines(args.shapes, torch.float16, args.prefix_len, args.tokens_per_frame):
            print(line)

    csv_path = results_dir / f"{device_kind(device)}.csv"
    written = append_csv(rows, csv_path, name, commit, bandwidth / 1e9, (load, load_after))
    print(f"appended {written} rows to {csv_path}")
    if not args.no_plot:
        loads = "" if load is None else f", load {load:.1f} before / {load_after:.1f} after on {os.cpu_count()} cores"
        png = plot_rows(rows, results_dir / f"{device_kind(device)}.png", f"{name}{loads}, commit {commit}")
        if png is not None:
            print(f"plot: {png}")

    errors = [f"{r.stage} {r.backend} {r.shape}: {r.status}" for r in rows if r.status.startswith("error")]
    print()
    try:  # the caches of the model glue: the `model` extra (the kernel stages above need only `bench`)
        from . import stream_memory
    except ImportError as exc:
        print(f"stream memory: n/a ({exc})")
    else:
        print(stream_memory.report())
    if not args.no_e2e:
        print()
        try:
            print(e2e.report(e2e.run(device, quick=args.quick)))
        except (Unavailable, NotImplementedError, ImportError) as exc:
            print(f"end-to-end: n/a ({type(exc).__name__}: {exc})")
        except Exception as exc:   # like a stage error: reported, exit code 1
            errors.append(f"end-to-end: error: {type(exc).__name__}: {exc}")
            traceback.print_exc(file=sys.stderr)
            print(errors[-1])

    print(f"\nbench finished in {time.perf_counter() - t_start:.0f} s; {len(errors)} error(s)")
    return 1 if errors else 0

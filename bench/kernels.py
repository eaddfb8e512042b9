"""`python -m bench.kernels`: every Triton kernel built for sm_80 and sm_90 without a GPU, and what it costs there.

The launches that the specs of `hermes_kernels.engine.gpu_specs` record on meta tensors are specialised as Triton's own
binder does, compiled to PTX and through ptxas, and reported per kernel x target x spec: registers, spills, shared
memory, occupancy (bench/ptx.py), grid and waves, global load/store widths, approximate arithmetic. `--check` (run by
tests/hermes_kernels/test_gpu_specs.py) fails on a kernel that does not build, spills or overflows shared memory,
or that no spec launches, so a GPU-only failure shows on a CPU machine. docs/benchmarks.md#kernels.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import functools
import hashlib
import importlib
import io
import json
import math
import multiprocessing
import os
import sys
import time
from pathlib import Path

import torch
from triton import knobs
from triton._C.libtriton import get_cache_invalidating_env_vars
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile as triton_compile, make_backend
from triton.runtime.cache import get_cache_key
from triton.runtime.jit import create_function_from_signature

from hermes_kernels.engine import gpu_specs
from hermes_kernels.policies.h2svc.gpu_case import H2SVCCase
from hermes_kernels.policies.hermes.gpu_case import HermesCase
from hermes_kernels.engine.launch import recording

from .shapes import BUDGETS, CHUNK_FRAMES, SHAPES, TOKENS_PER_FRAME, ModelShape
from .inputs import GUIDANCE_GLOBAL, GUIDANCE_MIXED
from .ptx import SM_MODELS, approximate_instructions, global_access_mix, occupancy, parse_ptxas_log

# Bumped when what a worker extracts from a compile changes, so cached results are recomputed.
_ANALYSIS_VERSION = 3
_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
_ROOM = 512  # the stream's default room past prefix + budget + chunk (hermes/stream.py)
# A fresh CUDA allocation is at least 256-byte aligned; a recorded view's address is this plus its offset.
_BASE_ADDRESS = 1 << 32


# ----------------------------------------------------------------------------------------------------------------
# cases and recording
# ----------------------------------------------------------------------------------------------------------------

def _with_head_dim(shape: ModelShape, head_dim: int) -> ModelShape:
    """The shape with another head dim (M-RoPE sections scaled with it, interleaved or not): the D = 64 / 256
    variants."""
    return dataclasses.replace(shape, name=f"{shape.name}[D={head_dim}]",
                               geometry=shape.geometry.with_head_dim(head_dim))


def _case(shape: ModelShape, dtype: str, budget: int, reindex: str, batch: int = 1) -> HermesCase:
    cfg = shape.config(budget, reindex="eager" if reindex == "given" else reindex)
    chunk = CHUNK_FRAMES * TOKENS_PER_FRAME
    label = f"{shape.name} {dtype} b{budget} {reindex}" + (f" B={batch}" if batch > 1 else "")
    return HermesCase(label=label, geometry=shape.geometry, dtype=_DTYPES[dtype], cfg=cfg, chunk_tokens=chunk,
                      capacity=cfg.prefix_len + budget + chunk + _ROOM,
                      guidance_tokens=(GUIDANCE_MIXED, GUIDANCE_GLOBAL), reindex=reindex, batch=batch)


def _h2svc_case(shape: ModelShape, dtype: str, chunk_frames: int, reindexing: bool,
                batch: int = 1) -> H2SVCCase:
    label = (f"{shape.name} h2svc {dtype} F{chunk_frames} {'reindex' if reindexing else 'no-reindex'}"
             + (f" B={batch}" if batch > 1 else ""))
    return H2SVCCase(label=label, geometry=shape.geometry, dtype=_DTYPES[dtype],
                     cfg=shape.h2svc_config(), chunk_frames=chunk_frames, reindexing=reindexing, batch=batch)


def spec_cases(models: list[str] | None = None, dtypes: list[str] | None = None, streams: list[int] | None = None,
               policies: list[str] | None = None) -> list:
    """The cases every spec is driven at (each spec at the cases of its type).

    HERMES (`HermesCase`; 16-frame chunks, the stream's default room, one stream unless said): the headline shapes
    (LLaVA-OV-7B 1D, Qwen2.5-VL-7B M-RoPE in contiguous sections, Qwen3-VL-8B M-RoPE in interleaved ones) x
    fp16/bf16/fp32 x budgets 6000/4000 x re-index lazy/eager/given; head dims 64 and 256 (LLaVA-OV-0.5B, and the 7B
    shapes at D = 64 / 256) x each dtype at budget 6000, lazy; Qwen3.5 (D 256, partial rotary R = 64, interleaved
    [11, 11, 10]) and Gemma 4 (D 512, 1D over 256 pairs: its proportional inv_freq is runtime data, so the
    compiles are those of any 1D head of 512) x each dtype at budget 6000, lazy and eager; the headline shapes with
    two streams (fp16, 6000, lazy: B = 1 is specialised as a constant, so B > 1 compiles apart).
    H2SVC (`H2SVCCase`; the default head map and windows, full memories): the headline shapes x each dtype x 16-
    and 8-frame chunks x re-index on/off; the D = 64 / 256 shapes, Qwen3.5 and Gemma 4 x each dtype x 16 frames x
    re-index on/off; the headline shapes with two streams (fp16, 16 frames, re-index on/off).
    `models` / `dtypes` / `streams` / `policies` keep only those model names (as labelled) / dtypes / stream
    counts / policies ("hermes", "h2svc")."""
    headline = [SHAPES["llava-ov-7b"], SHAPES["qwen2.5-vl-7b"], SHAPES["qwen3-vl-8b"]]
    dims = [SHAPES["llava-ov-0.5b"], _with_head_dim(headline[1], 64), _with_head_dim(headline[0], 256),
            _with_head_dim(headline[1], 256)]
    widths = [SHAPES["qwen3.5"], SHAPES["gemma4"]]  # partial rotary at D 256; D 512
    budgets = sorted(BUDGETS, reverse=True)  # docs/hermes.md §4's 6K first: it names the rows of the table
    hermes, h2svc = [], []
    for dtype in dtypes or list(_DTYPES):
        hermes += [_case(s, dtype, b, r) for s in headline for b in budgets for r in ("lazy", "eager", "given")]
        hermes += [_case(s, dtype, budgets[0], "lazy") for s in dims]
        hermes += [_case(s, dtype, budgets[0], r) for s in widths for r in ("lazy", "eager")]
        h2svc += [_h2svc_case(s, dtype, f, r) for s in headline for f in (CHUNK_FRAMES, CHUNK_FRAMES // 2)
                  for r in (True, False)]
        h2svc += [_h2svc_case(s, dtype, CHUNK_FRAMES, r) for s in dims + widths for r in (True, False)]
        if dtype == "fp16":
            hermes += [_case(s, dtype, budgets[0], "lazy", batch=2) for s in headline]
            h2svc += [_h2svc_case(s, dtype, CHUNK_FRAMES, r, batch=2) for s in headline for r in (True, False)]
    cases = [c for policy, group in (("hermes", hermes), ("h2svc", h2svc)) if policies is None or policy in policies
             for c in group]
    return [c for c in cases if (models is None or c.label.split()[0] in models)
            and (streams is None or c.batch in streams)]


@dataclasses.dataclass(frozen=True)
class Recorded:
    """One launch a spec's driver made at one case."""

    spec: str
    case: str
    kernel: str
    grid: tuple[int, ...]
    launch: object  # hermes_kernels.engine.launch.Launch


def record(cases) -> tuple[list[Recorded], list[str]]:
    """Every registered spec driven at every case; returns the launches and the coverage problems (kernels of
    the package no spec launches, specs that never launch a kernel they name, launches of unnamed kernels, drivers
    that raise: on meta tensors, a launcher that reads device data on the host does)."""
    recorded, problems = [], []
    specs = gpu_specs.registered_specs()
    for spec in specs:
        named = {gpu_specs.kernel_name(k) for k in spec.kernels}
        seen = set()
        driven = [c for c in cases if isinstance(c, spec.case_type)]
        for case in driven:
            with recording() as launches:
                try:
                    spec.drive(case)
                except Exception as exc:  # e.g. a launcher that reads device data: a finding, not a crash
                    problems.append(f"{spec.name} at {case.label}: the driver raised {type(exc).__name__}: {exc}")
                    continue
            for item in launches:
                name = gpu_specs.kernel_name(item.kernel)
                if name not in named:
                    problems.append(f"{spec.name} launches {name}, which it does not name")
                seen.add(name)
                recorded.append(Recorded(spec.name, case.label, name, item.grid, item))
        if driven:  # a spec without cases (filtered out by --policies / --models) has nothing to launch
            problems += [f"{spec.name} names {name} but never launches it" for name in sorted(named - seen)]
    specified = {gpu_specs.kernel_name(k) for spec in specs for k in spec.kernels}
    problems += [f"{name} has no compile spec (register one with hermes_kernels.engine.gpu_specs.gpu_spec)"
                 for name in sorted(set(gpu_specs.jit_kernels()) - specified)]
    return recorded, problems


class _Address:
    """What Triton's specialiser reads of a tensor argument: its dtype and address."""

    def __init__(self, tensor: torch.Tensor):
        self.dtype = tensor.dtype
        self._address = _BASE_ADDRESS + tensor.storage_offset() * tensor.element_size()

    def data_ptr(self) -> int:
        return self._address


@dataclasses.dataclass(frozen=True)
class Job:
    """One compile: a kernel specialised for a target, and its cache key."""

    kernel: str
    arch: int
    signature: dict
    constexprs: dict
    attrs: dict
    options: dict
    key: str


@functools.lru_cache(maxsize=None)
def _binder(kernel, arch: int):
    """(backend, binder) for a kernel on sm_`arch`: Triton's own argument specialiser, as `JITFunction.run` uses."""
    backend = make_backend(GPUTarget("cuda", arch, 32))
    return backend, create_function_from_signature(kernel.signature, kernel.params, backend)


def specialise(item: Recorded, arch: int) -> Job:
    """The compile `JITFunction.run` would make for this launch on an sm_`arch` device."""
    kernel, launch = item.launch.kernel, item.launch
    backend, binder = _binder(kernel, arch)
    args = [_Address(a) if isinstance(a, torch.Tensor) else a for a in launch.args]
    bound, specialization, options = binder(*args, **launch.meta)
    options, signature, constexprs, attrs = kernel._pack_args(backend, dict(launch.meta), bound, specialization,
                                                              options)
    src = ASTSource(kernel, signature, constexprs, attrs)
    key = get_cache_key(src, backend, options, get_cache_invalidating_env_vars())
    digest = hashlib.sha256(f"{_ANALYSIS_VERSION}-{key}".encode()).hexdigest()
    return Job(item.kernel, arch, signature, constexprs, attrs, dict(options.__dict__), digest)


# ----------------------------------------------------------------------------------------------------------------
# compiling (worker processes)
# ----------------------------------------------------------------------------------------------------------------

def _cache_dir() -> Path:
    return Path(knobs.cache.dir) / "hermes-gpu-guard"


def _cached(job: Job) -> dict | None:
    path = _cache_dir() / f"{job.key}.json"
    return json.loads(path.read_text()) if path.exists() else None


def compile_job(job: Job) -> dict:
    """Compile one job (or read its cached result): registers, spills, shared memory, PTX access mix, seconds;
    a compile error comes back as {"error": message}."""
    cached = _cached(job)
    if cached is not None:
        return cached
    module, name = job.kernel.rsplit(".", 1)
    kernel = getattr(importlib.import_module(module), name)
    knobs.nvidia.dump_ptxas_log = True        # the log of the ptxas run that makes the cubin
    knobs.compilation.always_compile = True   # a Triton cache hit would skip ptxas and its log
    log = io.StringIO()
    start = time.perf_counter()
    try:
        with contextlib.redirect_stdout(log):
            compiled = triton_compile(ASTSource(kernel, job.signature, job.constexprs, job.attrs),
                                      target=GPUTarget("cuda", job.arch, 32), options=job.options)
    except Exception as exc:  # every compile failure is a finding to report, not a crash of the guard
        return {"error": f"{type(exc).__name__}: {exc}"[:4000]}
    result = parse_ptxas_log(log.getvalue())
    result.update(shared=compiled.metadata.shared, num_warps=compiled.metadata.num_warps,
                  mix=global_access_mix(compiled.asm["ptx"]), approx=approximate_instructions(compiled.asm["ptx"]),
                  seconds=round(time.perf_counter() - start, 2))
    text = json.dumps(result)
    path = _cache_dir() / f"{job.key}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return json.loads(text)  # as a cached result reads back (access widths as strings)


def _compile_all(jobs: list[Job], workers: int) -> dict[str, dict]:
    """Results by job key; the jobs run in `workers` spawned processes (Triton's compiler holds global state)."""
    unique = {job.key: job for job in jobs}
    results = {key: _cached(job) for key, job in unique.items()}
    missing = [job for key, job in unique.items() if results[key] is None]
    if workers <= 1 or len(missing) <= 1:
        results.update((job.key, compile_job(job)) for job in missing)
        return results
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(min(workers, len(missing)), mp_context=context) as pool:
        futures = {job.key: pool.submit(compile_job, job) for job in missing}
        results.update((key, future.result()) for key, future in futures.items())
    return results


# ----------------------------------------------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------------------------------------------

def _spec_text(job: Job) -> str:
    """The parts of a specialisation that tell specs of one kernel apart: constexprs by name, pointer dtypes."""
    names = list(job.signature)
    consts = [f"{names[k[0]]}={v}" for k, v in job.constexprs.items()
              if names[k[0]].isupper() and len(k) == 1]
    pointers = sorted({t[1:] for t in job.signature.values() if isinstance(t, str) and t.startswith("*")})
    return " ".join(consts + ["/".join(pointers)])


def _width_text(counts: dict) -> str:
    counts = {int(k): v for k, v in counts.items()}
    return " ".join(f"{w}B:{counts[w]}" for w in sorted(counts, reverse=True)) or "-"


def build_rows(recorded: list[Recorded], archs: list[int], workers: int) -> list[dict]:
    """One row per kernel x target x distinct compile, with the cases that produce it."""
    bounds = {gpu_specs.kernel_name(k): s.max_spill_bytes for s in gpu_specs.registered_specs() for k in s.kernels}
    jobs = [(item, specialise(item, arch)) for arch in archs for item in recorded]
    results = _compile_all([job for _, job in jobs], workers)
    rows: dict[str, dict] = {}
    for item, job in jobs:
        row = rows.get(job.key)
        if row is None:
            sm = SM_MODELS[job.arch]
            row = rows[job.key] = dict(kernel=item.kernel.rsplit(".", 1)[1], module=item.kernel.rsplit(".", 1)[0],
                                       target=f"sm_{job.arch}", gpu=sm.name, spec=_spec_text(job), cases=[],
                                       grid=list(item.grid), max_spill_bytes=bounds[item.kernel],
                                       smem_limit=sm.smem_per_block, **results[job.key])
            if "error" not in row:
                blocks, limiter = occupancy(row["registers"], row["shared"], row["num_warps"], sm)
                row.update(blocks_per_sm=blocks, limiter=limiter,
                           occupancy=blocks * row["num_warps"] * 32 / sm.threads)
        elif item.case == row["cases"][0] and math.prod(item.grid) > math.prod(row["grid"]):
            row["grid"] = list(item.grid)  # the largest launch of the first case (e.g. an H2SVC step's episodic move)
        if item.case not in row["cases"]:  # e.g. the moves of two class blocks of one H2SVC step share a compile
            row["cases"].append(item.case)
    for row in rows.values():
        if "error" not in row:
            sm = SM_MODELS[int(row["target"][3:])]
            row["waves"] = math.prod(row["grid"]) / (max(row["blocks_per_sm"], 1) * sm.sms)
    return list(rows.values())


def violations(rows: list[dict]) -> list[str]:
    """The checks: compile errors, spills above the spec's bound, shared memory above the per-block limit."""
    found = []
    for row in rows:
        where = f"{row['kernel']} {row['target']} [{row['spec']}] (e.g. {row['cases'][0]})"
        if "error" in row:
            found.append(f"{where}: does not compile: {row['error']}")
            continue
        if row["spill_stores"] > row["max_spill_bytes"]:
            found.append(f"{where}: {row['spill_stores']} bytes of spill stores, bound {row['max_spill_bytes']}")
        if row["shared"] > row["smem_limit"]:
            found.append(f"{where}: {row['shared']} bytes of shared memory, {row['gpu']} allows "
                         f"{row['smem_limit']} per block")
    return found


def format_table(rows: list[dict]) -> str:
    header = ["kernel", "target", "spec", "cases", "warps", "regs", "spill st/ld", "smem", "blk/SM", "occ",
              "grid@case", "waves", "ld.global", "cp.async", "st.global", "approx"]
    lines = [header]
    # stable: within a kernel and target, rows stay in the order of their first case
    for row in sorted(rows, key=lambda r: (r["module"], r["kernel"], r["target"])):
        first = row["cases"][0] + (f" +{len(row['cases']) - 1}" if len(row["cases"]) > 1 else "")
        if "error" in row:
            lines.append([row["kernel"], row["target"], row["spec"], first, "COMPILE ERROR"] + [""] * 11)
            continue
        lines.append([row["kernel"], row["target"], row["spec"], first, str(row["num_warps"]),
                      str(row["registers"]), f"{row['spill_stores']}/{row['spill_loads']}", str(row["shared"]),
                      f"{row['blocks_per_sm']} ({row['limiter']})", f"{row['occupancy']:.0%}",
                      "x".join(map(str, row["grid"])), f"{row['waves']:.2f}", _width_text(row["mix"]["ld"]),
                      _width_text(row["mix"]["cp"]), _width_text(row["mix"]["st"]),
                      str(sum(row["approx"].values()))])
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join(" | ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines)


def approximate_summary(rows: list[dict]) -> list[str]:
    """One line per kernel whose PTX holds approximate arithmetic on some target: the opcodes and the largest
    static count of each over its compiles."""
    found: dict[str, dict[str, int]] = {}
    for row in rows:
        for opcode, count in row.get("approx", {}).items():
            ops = found.setdefault(f"{row['module']}.{row['kernel']}", {})
            ops[opcode] = max(ops.get(opcode, 0), count)
    return [f"{kernel}: " + ", ".join(f"{op} x{n}" for op, n in sorted(ops.items())) for kernel, ops in sorted(
        found.items())]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.kernels", description=__doc__.split("\n\n")[0])
    p.add_argument("--targets", nargs="+", type=int, default=[80, 90], choices=sorted(SM_MODELS),
                   help="compute capabilities to compile for (default 80 90)")
    p.add_argument("--models", nargs="+", help="only the cases of these model labels, e.g. llava-ov-7b "
                   "qwen2.5-vl-7b 'llava-ov-7b[D=256]' (default: all)")
    p.add_argument("--dtypes", nargs="+", choices=sorted(_DTYPES), help="only these cache dtypes (default: all)")
    p.add_argument("--streams", nargs="+", type=int, choices=[1, 2], help="only cases with these stream counts")
    p.add_argument("--policies", nargs="+", choices=["hermes", "h2svc"], help="only the cases of these policies "
                   "(default: both)")
    p.add_argument("--kernels", nargs="+", help="only these kernels, by function name (default: all)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compile processes (default: CPUs)")
    p.add_argument("--json", type=Path, help="also write the rows and problems to this JSON file")
    p.add_argument("--check", action="store_true", help="exit 1 on any problem (compile error, spills over the "
                   "bound, shared memory over the limit, a kernel without spec)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("bench.kernels: TRITON_INTERPRET is set; the compile guard needs the compiler (unset it)",
              file=sys.stderr)
        return 2
    start = time.perf_counter()
    recorded, coverage = record(spec_cases(args.models, args.dtypes, args.streams, args.policies))
    if args.kernels:
        recorded = [r for r in recorded if r.kernel.rsplit(".", 1)[1] in args.kernels]
    rows = build_rows(recorded, args.targets, args.jobs)
    found = violations(rows)
    problems = coverage + found
    seconds = time.perf_counter() - start
    print(format_table(rows))
    print(f"\n{len(rows)} compiles ({len(recorded)} recorded launches) in {seconds:.1f} s; occupancy per SM: "
          + "; ".join(f"sm_{a} = {m.name}: {m.regs // 1024}K regs, {m.threads} threads, {m.smem // 1024} KB smem "
                      f"({m.smem_per_block // 1024} KB/block), {m.blocks} blocks, {m.sms} SMs"
                      for a, m in SM_MODELS.items() if a in args.targets))
    approximate = approximate_summary(rows)
    print("\napproximate arithmetic in the PTX (static counts; docs/gpu.md#rounding): "
          + ("none" if not approximate else ""))
    for line in approximate:
        print(f"  {line}")
    for problem in problems:
        print(f"PROBLEM: {problem}")
    if args.json:
        report = {"kernels": sorted(gpu_specs.jit_kernels()), "targets": [f"sm_{a}" for a in args.targets],
                  "rows": rows, "coverage": coverage, "violations": found, "approximate": approximate,
                  "seconds": seconds}
        args.json.write_text(json.dumps(report, indent=1))
    return 1 if args.check and problems else 0


if __name__ == "__main__":
    sys.exit(main())

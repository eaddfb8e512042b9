"""The GPU compile guard: every Triton kernel builds for sm_80 and sm_90 without a GPU (bench/kernels.py over the specs
of hermes_kernels/engine/gpu_specs.py), within its spill bound and the target's shared-memory limit, its row moves
vectorised, and no kernel of the package goes without a spec.

The guard runs once per session as `python -m bench.kernels --json` in a subprocess without TRITON_INTERPRET: this
process runs the interpreter when there is no GPU, and then @triton.jit makes interpreter objects, which cannot be
compiled. Compiled results are cached under Triton's cache dir, keyed by Triton's own compile key, so a run after an
unchanged kernel costs seconds (about 10 on 2 shared cores); a cold run about a minute and a half. The pieces it is
made of (occupancy, ptxas log and PTX parsing, launch recording, the coverage rules) are tested here directly.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

from bench import kernels as guard_module
from bench import ptx
from hermes_kernels.policies.h2svc.config import EPISODIC, INSTANT, SHORT
from hermes_kernels.engine import gpu_specs
from hermes_kernels.policies.h2svc.gpu_case import H2SVCCase
from hermes_kernels.policies.hermes.gpu_case import HermesCase
from hermes_kernels.policies.h2svc import gpu_specs as h2svc_specs
from hermes_kernels.policies.h2svc import step as step_kernels
from hermes_kernels.engine.launch import launch, launch_count, recording
from hermes_kernels.rope import RotaryLayout
from tests.utils import REPO

ROOT = Path(REPO)
TARGETS = {"sm_80", "sm_90"}
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
HEADLINE = ("llava-ov-7b", "qwen2.5-vl-7b", "qwen3-vl-8b")
# rotary layouts the guard compiles at, and their head dims: 1D and contiguous M-RoPE at D = 64 / 128 / 256,
# interleaved M-RoPE at Qwen3-VL-8B's D = 128 and Qwen3.5's D = 256 (partial rotary: R = 64), 1D at Gemma 4's D = 512
ROPE_DIMS = {(kind, dim) for kind in ("1d", "sections") for dim in (64, 128, 256)} | {("interleaved", 128),
                                                                                     ("interleaved", 256), ("1d", 512)}
PARTIAL = ("qwen3.5", 256, 64)  # (model, D, R) of the partial-rotary cases
WIDEST = ("gemma4", 512)  # (model, D) of the widest head: Gemma 4's full-attention layers, 1D over all 256 pairs
GUARD_TIMEOUT_S = 1200  # a cold run on a loaded 2-core machine; the whole CI must stay under 20 minutes


@pytest.fixture(scope="module")
def guard(tmp_path_factory) -> dict:
    """The guard's JSON report over every spec, case and target."""
    report = tmp_path_factory.mktemp("guard") / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    proc = subprocess.run([sys.executable, "-m", "bench.kernels", "--json", str(report)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=GUARD_TIMEOUT_S)
    assert proc.returncode == 0, f"python -m bench.kernels failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(report.read_text())


def _where(row: dict) -> str:
    return f"{row['kernel']} {row['target']} [{row['spec']}] at {row['cases'][0]}"


def test_every_kernel_has_a_spec_that_launches_it(guard):
    assert guard["kernels"], "the guard found no @triton.jit kernel in hermes_kernels"
    assert not guard["coverage"], "\n".join(guard["coverage"])


def test_every_kernel_compiles_for_sm80_and_sm90(guard):
    errors = [f"{_where(row)}: {row['error']}" for row in guard["rows"] if "error" in row]
    assert not errors, "\n".join(errors)
    built = {(f"{row['module']}.{row['kernel']}", row["target"]) for row in guard["rows"]}
    missing = [(kernel, target) for kernel in guard["kernels"] for target in TARGETS if (kernel, target) not in built]
    assert not missing, f"kernels never compiled: {missing}"


def test_spills_and_shared_memory_within_bounds(guard):
    """Spill stores at most the spec's bound (0 for every kernel today), shared memory at most the per-block
    limit of the target (A100: 163 KB, H100/H200: 227 KB)."""
    assert not guard["violations"], "\n".join(guard["violations"])
    for row in guard["rows"]:
        assert row["spill_stores"] <= row["max_spill_bytes"], _where(row)
        assert row["shared"] <= row["smem_limit"], _where(row)


def test_row_moves_are_16_byte_vectors(guard):
    """K/V row moves are 16-byte accesses at every case and target, e.g. ld.global.v4.b32 of 8 fp16 values: the
    compaction's and the H2SVC step's (k and v halves: at least 4 loads and 4 stores per tile). Every store of the
    H2SVC move kernel is a K/V row store, so all of them are 16-byte."""
    for kernel in ("_move_kernel", "_frame_move_kernel"):
        moves = [row for row in guard["rows"] if row["kernel"] == kernel]
        assert {row["target"] for row in moves} == TARGETS, kernel
        for row in moves:
            assert row["mix"]["ld"].get("16", 0) >= 4 and row["mix"]["st"].get("16", 0) >= 4, \
                f"{_where(row)}: row moves not vectorised: {row['mix']}"
            if kernel == "_frame_move_kernel":
                assert set(row["mix"]["st"]) == {"16"}, f"{_where(row)}: a narrow K/V store: {row['mix']}"


def test_partial_rotary_shares_the_compiles_of_full_rotary(guard):
    """The rotary width is a runtime value of the row movers: every compile a Qwen3.5 (partial rotary, D 256) case
    makes of `_move_kernel` or `_frame_move_kernel` is one a full-rotary case of the same head dim makes too."""
    full_256 = {c.label for c in guard_module.spec_cases()
                if c.geometry.head_dim == PARTIAL[1] and c.rotary.rotary_dim == PARTIAL[1]}
    for kernel in ("_move_kernel", "_frame_move_kernel"):
        rows = [row for row in guard["rows"]
                if row["kernel"] == kernel and any(case.startswith(PARTIAL[0] + " ") for case in row["cases"])]
        assert {row["target"] for row in rows} == TARGETS, kernel
        for row in rows:
            assert full_256 & set(row["cases"]), f"{_where(row)}: no full-rotary case at D = 256 makes this compile"


def test_every_kernel_compiles_at_the_widest_head(guard):
    """Gemma 4's D = 512 cases reach every kernel on both targets (within the spill and shared-memory bounds the
    test above checks): its compiles are made, not assumed from narrower heads'."""
    for kernel in guard["kernels"]:
        name = kernel.rsplit(".", 1)[1]
        targets = {row["target"] for row in guard["rows"] if row["kernel"] == name
                   and any(case.startswith(WIDEST[0] + " ") for case in row["cases"])}
        assert targets == TARGETS, f"{name}: no {WIDEST[0]} (D = {WIDEST[1]}) compile on {TARGETS - targets}"


# the approximate instructions a kernel's PTX may hold, by opcode family (docs/gpu.md#rounding): ex2.approx in the
# softmax of the pooled attention and in the scores' recency; every division and root is correctly rounded (the
# scores and frame features decide keep sets and STCE evictions: they divide with hermes_kernels.engine.rounding.div_rn)
APPROXIMATE_ALLOWED = {"_row_lse_kernel": {"ex2"}, "_pooled_kernel": {"ex2"}, "_hermes_scores_kernel": {"ex2"}}


def test_only_the_documented_approximate_arithmetic_reaches_the_ptx(guard):
    for row in guard["rows"]:
        if "error" in row:
            continue
        families = {opcode.split(".")[0] for opcode in row["approx"]}
        assert families <= APPROXIMATE_ALLOWED.get(row["kernel"], set()), \
            f"{_where(row)}: approximate {row['approx']} (docs/gpu.md#rounding lists what is expected)"
    assert any(row["approx"] for row in guard["rows"] if row["kernel"] == "_hermes_scores_kernel"), \
        "the guard no longer sees the scores' ex2.approx: is it reading the PTX?"


def test_cases_cover_dtypes_rope_head_dims_and_the_7b_budgets():
    cases = [c for c in guard_module.spec_cases() if isinstance(c, HermesCase)]
    seen = {(c.dtype, c.rotary.kind, c.geometry.head_dim) for c in cases}
    assert seen == {(dtype, kind, dim) for dtype in DTYPES for kind, dim in ROPE_DIMS}
    assert {c.rotary.kind for c in cases if c.label.startswith("qwen3-vl-8b ")} == {"interleaved"}
    partial = [c for c in cases if c.rotary.rotary_dim < c.geometry.head_dim]
    assert {(c.label.split()[0], c.geometry.head_dim, c.rotary.rotary_dim) for c in partial} == {PARTIAL}
    assert {(c.dtype, c.reindex) for c in partial} == {(d, r) for d in DTYPES for r in ("lazy", "eager")}
    assert all(c.rotary == RotaryLayout.interleaved((11, 11, 10)) and c.inv_freq().shape == (32,) for c in partial)
    widest = [c for c in cases if c.label.startswith(WIDEST[0] + " ")]
    assert {(c.dtype, c.reindex) for c in widest} == {(d, r) for d in DTYPES for r in ("lazy", "eager")}
    assert all(c.geometry.head_dim == WIDEST[1] and c.rotary == RotaryLayout.one_d(WIDEST[1] // 2)
               and c.inv_freq().shape == (WIDEST[1] // 2,) for c in widest)
    for model in HEADLINE:
        at = {(c.cfg.budget, c.reindex) for c in cases if c.label.startswith(model + " ")}
        assert at >= {(b, r) for b in (4000, 6000) for r in ("eager", "lazy", "given")}, model
    assert any(c.batch > 1 for c in cases)


def test_h2svc_cases_cover_dtypes_rope_head_dims_chunks_reindex_and_streams():
    cases = [c for c in guard_module.spec_cases() if isinstance(c, H2SVCCase)]
    seen = {(c.dtype, c.rotary.kind, c.geometry.head_dim, c.reindexing) for c in cases}
    assert seen == {(dtype, kind, dim, reindex) for dtype in DTYPES for kind, dim in ROPE_DIMS
                    for reindex in (False, True)}
    for model in HEADLINE:
        at = {(c.chunk_frames, c.reindexing, c.dtype) for c in cases if c.label.startswith(model + " ")}
        assert at >= {(f, r, d) for f in (16, 8) for r in (False, True)
                      for d in DTYPES}, model
    assert {c.batch for c in cases} == {1, 2}
    partial = [c for c in cases if c.rotary.rotary_dim < c.geometry.head_dim]
    assert {(c.label.split()[0], c.geometry.head_dim, c.rotary.rotary_dim) for c in partial} == {PARTIAL}
    assert {(c.dtype, c.reindexing) for c in partial} == {(d, r) for d in DTYPES for r in (False, True)}
    assert all(c.inv_freq().shape == (32,) for c in partial)  # [R/2]
    widest = [c for c in cases if c.label.startswith(WIDEST[0] + " ")]
    assert {(c.dtype, c.reindexing) for c in widest} == {(d, r) for d in DTYPES for r in (False, True)}
    assert all(c.geometry.head_dim == WIDEST[1] and c.inv_freq().shape == (WIDEST[1] // 2,) for c in widest)
    # the default (depth-order) head map: every class has rows, so every block kind is driven
    assert all(not c.cfg.profiled and c.classes == (INSTANT, SHORT, EPISODIC) for c in cases)
    assert guard_module.spec_cases(policies=["hermes"]) == [c for c in guard_module.spec_cases()
                                                            if isinstance(c, HermesCase)]


@pytest.mark.parametrize("reindex", [True, False])
def test_h2svc_step_spec_launches_what_a_step_of_every_class_block_launches(reindex):
    """The step's spec drives `h2svc_step_triton` on each class block of LLaVA-OV-7B (full memories, 16 frames):
    features and STCE for the episodic block only, and one move per block with one work item per home slot when
    re-indexing (every retained key rotates) or one per overflow slot (the F arrivals) otherwise."""
    spec = next(s for s in gpu_specs.registered_specs() if s.name == f"{h2svc_specs.__name__}.step")
    case = next(c for c in guard_module.spec_cases(["llava-ov-7b"], ["fp16"], [1], ["h2svc"])
                if c.chunk_frames == 16 and c.reindexing is reindex)
    with recording() as launches:
        spec.drive(case)
    cfg, F, T = case.cfg, case.chunk_frames, case.cfg.tokens_per_frame
    expected = []
    for cls in (INSTANT, SHORT, EPISODIC):
        rows, window = cfg.num_rows(cls), cfg.window(cls)
        if cls == EPISODIC:
            expected += [(step_kernels._features._frame_features_kernel, rows * F),
                         (step_kernels._stce._stce_kernel, rows)]
        expected.append((step_kernels._frame_move_kernel, rows * (window if reindex else F)))
    assert [(item.kernel, item.grid[0]) for item in launches] == expected
    for item in launches:
        if item.kernel is step_kernels._frame_move_kernel:
            assert item.meta["ROTATE"] is reindex
            assert (item.grid[1] - 1) * item.meta["BLOCK_T"] < T <= item.grid[1] * item.meta["BLOCK_T"]


# ---- the pieces ----------------------------------------------------------------------------------------------------

# imports every module of hermes_kernels but the guard's (cases and specs), then prints the guard modules loaded
IMPORT_ALL_BUT_THE_GUARD = textwrap.dedent("""
    import importlib, pkgutil, sys
    import hermes_kernels as hk
    guard = ("gpu_case", "gpu_specs")
    for info in pkgutil.walk_packages(hk.__path__, prefix="hermes_kernels."):
        if info.name.rpartition(".")[2] not in guard:
            importlib.import_module(info.name)
    print(sorted(m for m in sys.modules if m.startswith("hermes_kernels.") and m.rpartition(".")[2] in guard))
""")


def test_the_guard_modules_load_only_with_the_guard():
    """No op, kernel or config module imports a policy's compile-guard cases or specs (nor the registry): they load
    when the guard asks `registered_specs()`, which finds every policy's `gpu_specs` module by name."""
    proc = subprocess.run([sys.executable, "-c", IMPORT_ALL_BUT_THE_GUARD], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"
    names = {spec.name.rpartition(".")[0] for spec in gpu_specs.registered_specs()}
    assert names == {"hermes_kernels.policies.hermes.gpu_specs", "hermes_kernels.policies.h2svc.gpu_specs"}


def test_occupancy_follows_the_calculator_rules():
    h100 = ptx.SM_MODELS[90]
    # 128 regs x 32 threads = 4096 per warp: 16 warps fit the 64K register file, so one 16-warp block
    assert ptx.occupancy(128, 0, 16, h100) == (1, "regs")
    # 32 regs, no smem, 4 warps: 16 blocks by registers and 16 by threads (2048 / 128); a tie names registers
    assert ptx.occupancy(32, 0, 4, h100) == (16, "regs")
    # registers round up to 256 per warp: 33 regs -> 1280 per warp -> 51 warps -> 12 blocks of 4 warps
    assert ptx.occupancy(33, 0, 4, h100) == (12, "regs")
    # 100 KB smem + 1 KB reserved per block: 2 blocks in 228 KB, 1 in the A100's 164 KB
    assert ptx.occupancy(32, 100 * 1024, 4, h100) == (2, "smem")
    assert ptx.occupancy(32, 100 * 1024, 4, ptx.SM_MODELS[80]) == (1, "smem")
    # tiny kernels stop at 32 blocks per SM
    assert ptx.occupancy(16, 0, 1, h100) == (32, "blocks")


def test_ptxas_log_parsing():
    log = ("ptxas info    : Compiling entry function '_k' for 'sm_90a'\n"
           "ptxas info    : Function properties for _k\n"
           "    16 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads\n"
           "ptxas info    : Used 128 registers, used 1 barriers, 16 bytes cumulative stack size\n")
    assert ptx.parse_ptxas_log(log) == {"registers": 128, "stack": 16, "spill_stores": 8,
                                                 "spill_loads": 12}
    with pytest.raises(ValueError, match="log"):
        ptx.parse_ptxas_log("ptxas fatal : Unsupported .version")


def test_ptx_access_mix():
    text = """
	@%p3 ld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd13 + 0 ];
	ld.global.L1::evict_last.v2.b64 { %rd1, %rd2 }, [ %rd3 + 0 ];
	ld.global.nc.b32 %r5, [ %rd4 + 0 ];
	@!%p2 st.global.b16 [ %rd5 + 0 ], { %rs1 };
	st.global.v4.b32 [ %rd6 + 0 ], { %r1, %r2, %r3, %r4 };
	cp.async.cg.shared.global [ %r90 + 0 ], [ %rd26 + 0 ], 0x10, %r91;
	ld.shared.v4.b32 { %r6, %r7, %r8, %r9 }, [ %r10 + 0 ];
"""
    assert ptx.global_access_mix(text) == {"ld": {16: 2, 4: 1}, "cp": {16: 1}, "st": {2: 1, 16: 1}}


def test_approximate_instructions_are_counted_by_opcode():
    text = """
	ex2.approx.f32 %f1, %f2;
	@%p1 ex2.approx.ftz.f32 %f3, %f4;
	div.full.f32 %f5, %f6, %f7;
	div.rn.f32 %f8, %f6, %f7;
	sqrt.rn.f32 %f9, %f8;
	sin.approx.ftz.f32 %f10, %f9;
	rcp.approx.ftz.f64 %fd1, %fd2;
	mul.f32 %f11, %f10, %f9;
"""
    assert ptx.approximate_instructions(text) == {"ex2.approx.f32": 1, "ex2.approx.ftz.f32": 1, "div.full.f32": 1,
                                                  "sin.approx.ftz.f32": 1, "rcp.approx.ftz.f64": 1}
    assert ptx.approximate_instructions("div.rn.f32 %f1, %f2, %f3;\nsqrt.rn.f32 %f4, %f1;\n") == {}


def test_recording_captures_launches_without_running_them():
    kernel = types.SimpleNamespace()  # not a kernel: running it would raise
    before = launch_count()
    q = torch.empty(2, 3, device="meta")
    with recording() as launches:
        assert launch(kernel, (4, 2), q, 7, BLOCK=64, num_warps=4) is None
        with pytest.raises(RuntimeError, match="already recording"):
            with recording():
                pass
    assert launch_count() == before
    assert len(launches) == 1
    got = launches[0]
    assert got.kernel is kernel and got.grid == (4, 2) and got.args == (q, 7)
    assert got.meta == {"BLOCK": 64, "num_warps": 4, "enable_fp_fusion": False}


def _fake_kernel(name: str):
    fn = types.FunctionType((lambda: None).__code__, {}, name)
    fn.__module__ = "hermes_kernels.fake"
    return types.SimpleNamespace(fn=fn)


def test_coverage_rules(monkeypatch):
    """A kernel without a spec, a spec that never launches a kernel it names, a spec launching a kernel it does
    not name, and a driver that raises (a launcher reading device data, here a meta tensor) are all reported; a
    spec with no case of its type (here an H2SVC spec at a HERMES-style case) is not driven and not reported."""
    covered, unspecced, named_only, stray, host = (_fake_kernel(n) for n in ("covered", "unspecced", "named",
                                                                             "stray", "host"))

    def drive(case):
        launch(covered, (1,))
        launch(stray, (1,))

    def reads_the_device(case):
        launch(host, (int(torch.zeros(1, device="meta").sum()),))

    def other_policy(case):
        raise AssertionError("a spec is driven only at the cases of its type")

    case_type = types.SimpleNamespace
    specs = [gpu_specs.GpuSpec("fake.spec", (covered, named_only), drive, 0, case_type),
             gpu_specs.GpuSpec("fake.host", (host,), reads_the_device, 0, case_type),
             gpu_specs.GpuSpec("fake.h2svc", (named_only,), other_policy, 0, H2SVCCase)]
    monkeypatch.setattr(gpu_specs, "registered_specs", lambda: specs)
    monkeypatch.setattr(gpu_specs, "jit_kernels", lambda: {gpu_specs.kernel_name(k): k
                                                           for k in (covered, unspecced, named_only, host)})
    recorded, problems = guard_module.record([types.SimpleNamespace(label="case")])
    assert [r.kernel for r in recorded] == ["hermes_kernels.fake.covered", "hermes_kernels.fake.stray"]
    assert problems[:2] == ["fake.spec launches hermes_kernels.fake.stray, which it does not name",
                            "fake.spec names hermes_kernels.fake.named but never launches it"]
    assert problems[2].startswith("fake.host at case: the driver raised")
    assert problems[3:] == ["fake.host names hermes_kernels.fake.host but never launches it",
                            "hermes_kernels.fake.unspecced has no compile spec (register one with "
                            "hermes_kernels.engine.gpu_specs.gpu_spec)"]


def test_gpu_spec_rejects_bad_arguments():
    with pytest.raises(ValueError, match="kernels"):
        gpu_specs.gpu_spec()
    with pytest.raises(ValueError, match="max_spill_bytes"):
        gpu_specs.gpu_spec(_fake_kernel("k"), max_spill_bytes=-1)
    with pytest.raises(ValueError, match="case"):
        gpu_specs.gpu_spec(_fake_kernel("k"), case=dict)

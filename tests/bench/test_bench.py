"""Smoke benchmarks of every stage x backend (pytest-benchmark) and checks of the harness itself.

    pytest tests/bench/test_bench.py --benchmark-enable --benchmark-autosave   # time and save a run
    pytest tests/bench/test_bench.py --benchmark-enable --benchmark-compare    # compare with the last one

Sizes are tiny (seconds in total): these cases keep the harness and every backend's entry points runnable,
they are not the numbers to quote (those come from `python -m bench`). Triton is timed only on CUDA: on CPU
its cases skip with that reason, and the interpreter's correctness is covered by tests/.
"""
from __future__ import annotations

import csv
import functools
from pathlib import Path

import pytest
import torch
from transformers import Gemma4TextConfig
from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRotaryEmbedding

from hermes_kernels.policies.hermes import reference
from hermes_kernels.rope import RotaryLayout

from bench import cli, inputs, report, stages
from bench.shapes import SHAPES, SMOKE_SHAPES
from bench.inputs import Spec, make_inputs
from bench.stages import (RELEASED, RELEASED_FAMILIES, RELEASED_STAGES, STAGES, Unavailable, cache_bytes, floor_bytes,
                          stage_backends, stage_policy)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SMOKE_TOKENS_PER_FRAME = 32


@functools.lru_cache(maxsize=None)
def smoke_inputs(shape_name: str, policy: str = "hermes"):
    """One tiny cache (HERMES) or set of class blocks (H2SVC) per smoke shape (fp16 on CUDA, fp32 on CPU), shared
    by the benchmark cases."""
    spec = Spec(shape=SMOKE_SHAPES[shape_name], budget=48 if policy == "hermes" else 0, chunk_frames=2,
                dtype=torch.float16 if DEVICE.type == "cuda" else torch.float32, device=DEVICE,
                tokens_per_frame=SMOKE_TOKENS_PER_FRAME, policy=policy)
    return make_inputs(spec)


BENCH_CASES = [(stage, backend) for stage in STAGES for backend in stage_backends(stage, stages.BACKENDS)]


@pytest.mark.parametrize("shape_name", sorted(SMOKE_SHAPES))
@pytest.mark.parametrize("stage,backend", BENCH_CASES, ids=[f"{s}-{b}" for s, b in BENCH_CASES])
def test_stage_benchmark(benchmark, stage, backend, shape_name):
    if backend == "triton" and DEVICE.type != "cuda":
        pytest.skip("triton is timed on CUDA only; on CPU the interpreter is for correctness (tests/)")
    if stage in RELEASED_STAGES and SMOKE_SHAPES[shape_name].preset_name not in RELEASED_FAMILIES:
        pytest.skip("the released code has LLaVA-OV and Qwen2.5-VL classes only")
    inputs = smoke_inputs(shape_name, stage_policy(stage))
    case = STAGES[stage](inputs, backend)   # an Unavailable backend fails here: torch/reference must exist
    benchmark.group = f"{stage}-{shape_name}"
    benchmark.pedantic(case.run, setup=case.reset, rounds=5, iterations=1, warmup_rounds=1)


def test_eager_pooled_attention_matches_reference():
    """The eager baseline must compute the same function as the oracle, or the memory comparison is moot."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 6, 5, 16, generator=gen, dtype=torch.float64)
    k = torch.randn(2, 2, 37, 16, generator=gen, dtype=torch.float64)
    got = stages.eager_pooled_attention(q, k)
    want = reference.pooled_attention(q, k).to(torch.float32)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("shape_name", ["llava-ov-7b", "qwen2.5-vl-7b"])
def test_synthetic_positions_look_like_a_streamed_cache(shape_name):
    spec = Spec(shape=SHAPES[shape_name], budget=300, chunk_frames=2, dtype=torch.float32,
                device=torch.device("cpu"))
    pos = inputs.visual_positions(spec, torch.Generator().manual_seed(3))
    L, P, N = spec.shape.geometry.num_layers, spec.prefix_len, spec.num_tokens
    mrope = spec.shape.geometry.mrope
    axes = pos if mrope else pos.unsqueeze(2)
    assert axes.shape == (L, 1, 3 if mrope else 1, N)
    assert torch.equal(axes[..., :P], torch.arange(P).expand(L, 1, axes.shape[2], P))
    t = axes[:, :, 0, P:]
    step = t.diff(dim=-1)
    if not mrope:
        assert (step >= 1).all() and (step > 1).any(), "visual positions must increase, with gaps"
    else:
        assert (step >= 0).all() and (step > 1).any(), "frame times must not decrease, with gaps"
        hw = axes[:, :, 1:, P:]
        assert hw.min() == P and hw.max() == P + 13, "h/w come from a 14x14 merged grid offset by P"
    assert not torch.equal(axes[0], axes[1]), "each layer keeps its own positions"


def test_the_gemma4_shape_is_transformers_default_config():
    """The registry's Gemma 4 numbers are transformers' default Gemma4TextConfig, read off the config object: the
    layers `layer_types` marks full_attention (the ones the policies compress), their heads, KV heads (the global
    count when attention_k_eq_v is on, else num_key_value_heads: both as the full layers' own config gives them)
    and head dim (global_head_dim), their RoPE theta and the positions; the rotary values of the shape's inputs are
    the rotary module's `full_attention_inv_freq`, bit for bit, over a plain 1D layout of all D/2 pairs."""
    config = Gemma4TextConfig()
    full = [i for i, kind in enumerate(config.layer_types) if kind == "full_attention"]
    layer = config.per_layer_config[full[0]]
    assert all(config.per_layer_config[i].head_dim == layer.head_dim for i in full)
    kv_heads = layer.num_key_value_heads
    if not config.attention_k_eq_v:  # the full layers keep the model's own KV head count
        assert kv_heads == config.per_layer_config[config.layer_types.index("sliding_attention")].num_key_value_heads
    shape = SHAPES["gemma4"]
    g = shape.geometry
    assert (g.num_layers, g.num_heads, g.num_kv_heads, g.head_dim) == (len(full), layer.num_attention_heads,
                                                                       kv_heads, layer.head_dim) == (5, 8, 4, 512)
    rope = config.rope_parameters["full_attention"]
    assert (rope["rope_type"], rope["partial_rotary_factor"], g.rope_theta) == ("proportional", shape.proportional,
                                                                                rope["rope_theta"])
    assert g.max_positions == config.max_position_embeddings and g.rotary == RotaryLayout.one_d(g.head_dim // 2)
    inv_freq = Gemma4TextRotaryEmbedding(config).full_attention_inv_freq
    assert torch.equal(shape.inv_freq(), inv_freq) and int((inv_freq == 0).sum()) == 192
    spec = Spec(shape=SMOKE_SHAPES["smoke-proportional"], budget=16, chunk_frames=1, dtype=torch.float32,
                device=torch.device("cpu"), tokens_per_frame=8)
    assert int((make_inputs(spec).inv_freq == 0).sum()) == 12  # the inputs carry the shape's proportional values


def test_distinct_values_have_no_ties_and_no_zeros():
    x = inputs.distinct_values(torch.Generator().manual_seed(0), (3, 2, 1000), torch.device("cpu"))
    assert (x > 0).all()
    assert (x.sort(dim=-1).values.diff(dim=-1) > 0).all()


def test_floor_bytes_match_design_section_4():
    """docs/hermes.md §4 at LLaVA-OV-7B fp16, 6K, 16 frames: read ~0.52 GB of K/V, write ~0.34 GB."""
    spec = Spec(shape=SHAPES["llava-ov-7b"], budget=6000, chunk_frames=16, dtype=torch.float16,
                device=torch.device("cpu"))
    kv_read = 2 * 28 * 4 * 9150 * 128 * 2
    kv_write = 2 * 28 * 4 * 6000 * 128 * 2
    assert spec.num_tokens == 9150
    assert abs(kv_read - 0.52e9) < 0.01e9 and abs(kv_write - 0.34e9) < 0.01e9
    small = 28 * (9150 + 6000) * 8 + 28 * 6000 * 8      # positions in and out, keep
    assert floor_bytes(spec)["compact"] == kv_read + kv_write + small
    assert floor_bytes(spec)["step"] == kv_read + kv_write + small + 2 * 28 * 9136 * 4


def test_h2svc_cache_bytes_at_llava_ov_7b():
    """docs/h2svc.md §5: with the default ratios the three memories hold 0.1·4 + 0.4·16 + 0.5·64 = 38.8 of 64 frames'
    worth of heads (11 / 45 / 56 of 112 heads at LLaVA-OV-7B); fp16 K and V of D = 128 take 512 bytes a token."""
    sizes = cache_bytes(SHAPES["llava-ov-7b"], torch.float16, prefix_len=14, tokens_per_frame=196, chunk_frames=16,
                        budget=6000, dense_frames=64)
    per_token = 2 * 128 * 2
    h2svc = 11 * (14 + 4 * 196) + 45 * (14 + 16 * 196) + 56 * (14 + 64 * 196)
    assert sizes["h2svc"] == (h2svc * per_token, (h2svc + 112 * 16 * 196) * per_token)
    assert sizes["dense 64-frame"][0] == 112 * (14 + 64 * 196) * per_token
    assert sizes["hermes b=6000"][0] == 112 * (14 + 6000) * per_token
    assert 0.60 < sizes["h2svc"][0] / sizes["dense 64-frame"][0] < 0.61


def test_h2svc_points_run_only_h2svc_stages_and_count_their_movers():
    """An H2SVC point measures the H2SVC stages only; its FIFO blocks move min(F, W) frames a row, the episodic
    block the arrivals STCE kept (between 1 and min(F, N_e) a row: the newest arrival always stays)."""
    spec = Spec(shape=SMOKE_SHAPES["smoke-1d"], budget=0, chunk_frames=3, dtype=torch.float32,
                device=torch.device("cpu"), tokens_per_frame=8, policy="h2svc")
    inputs = make_inputs(spec)
    cfg = spec.h2svc_cfg
    assert inputs.movers[0] == cfg.num_rows(0) * min(3, cfg.window(0))
    assert inputs.movers[1] == cfg.num_rows(1) * min(3, cfg.window(1))
    assert cfg.num_rows(2) <= inputs.movers[2] <= cfg.num_rows(2) * 3
    args = cli.parse_args(["--quick", "--no-memory"])
    rows = cli.measure([spec], ["scores", "h2svc_stce", "h2svc_step"], ("torch",), args, torch.device("cpu"))
    assert [r.stage for r in rows] == ["h2svc_stce", "h2svc_step"] and all(r.ok and r.budget == 0 for r in rows)
    assert rows[1].has_floor and rows[1].bytes_moved > 0


def test_unavailable_and_failing_backends_become_rows_not_crashes(monkeypatch):
    def missing(inputs, backend):
        raise NotImplementedError("lands later")

    def broken(inputs, backend):
        raise RuntimeError("boom")

    monkeypatch.setitem(STAGES, "missing", missing)
    monkeypatch.setitem(STAGES, "broken", broken)
    spec = Spec(shape=SMOKE_SHAPES["smoke-1d"], budget=16, chunk_frames=1, dtype=torch.float32,
                device=torch.device("cpu"), tokens_per_frame=8)
    args = cli.parse_args(["--quick", "--no-memory"])
    rows = cli.measure([spec], ["missing", "broken", "scores"], ("reference",), args, torch.device("cpu"))
    status = {r.stage: r.status for r in rows}
    assert status["missing"].startswith("n/a") and "lands later" in status["missing"]
    assert status["broken"].startswith("error") and "boom" in status["broken"]
    assert status["scores"] == "ok"
    table = report.format_table(rows)
    assert "lands later" in table and "boom" in table


def test_speedup_and_floor_ratio():
    def row(backend, stage, median):
        return report.Row(stage=stage, backend=backend, shape="s", budget=4, chunk=1, dtype="float32", batch=1,
                          reindex="eager", num_tokens=10, bytes_moved=10 ** 7, has_floor=stage == "step",
                          median_ms=median)

    rows = [row("reference", "step", 6.0), row("torch", "step", 2.0), row("torch", "scores", 1.0)]
    report.fill_speedups(rows)
    report.fill_floor_ratios(rows, bandwidth=1e10)     # 1e7 bytes at 1e10 B/s: a 1 ms floor
    assert [r.speedup_vs_reference for r in rows] == [1.0, 3.0, None]
    assert rows[0].floor_ratio == pytest.approx(6.0) and rows[1].floor_ratio == pytest.approx(2.0)
    assert rows[2].floor_ratio is None


def test_csv_appends_with_one_header(tmp_path):
    row = report.Row(stage="step", backend="torch", shape="s", budget=4, chunk=1, dtype="float32", batch=1,
                     reindex="eager", num_tokens=10, median_ms=1.5, p20_ms=1.0, p80_ms=2.0, repeats=3)
    skipped = report.Row(stage="step", backend="triton", shape="s", budget=4, chunk=1, dtype="float32", batch=1,
                         reindex="eager", num_tokens=10, status="n/a: no CUDA")
    path = tmp_path / "cpu.csv"
    assert report.append_csv([row, skipped], path, "dev", "abc123", 40.0) == 1
    assert report.append_csv([row], path, "dev", "abc123", 40.0) == 1
    with open(path) as f:
        records = list(csv.DictReader(f))
    assert len(records) == 2
    assert records[0]["median_ms"] == "1.5" and records[0]["commit"] == "abc123" and records[0]["device"] == "dev"


def test_quick_main_job_runs(tmp_path, capsys):
    """`python -m bench --quick` end to end (the CI smoke run of the main job), into a temp folder."""
    code = cli.main(["--quick", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert (tmp_path / f"{report.device_kind(DEVICE)}.csv").stat().st_size > 0
    assert "step" in out and "copy bandwidth" in out
    assert "h2svc_step" in out and "cache K+V bytes" in out
    assert "512 s stream" in out and "qwen2.5-vl-7b" in out
    assert "H2SVC (policy='h2svc'" in out and "H2SVC cache MiB per class" in out
    assert "released_step accelerate(backend='torch') vs the released-style code" in out
    assert "released_guidance accelerate(backend='torch') vs the released-style code" in out


def _cache_of(model):
    return [(k.clone(), v.clone()) for k, v in model.kv_cache], [p.clone() for p in model._position_ids_cache]


@pytest.mark.parametrize("shape_name", ["smoke-1d", "smoke-mrope"])
def test_released_step_rows_do_the_same_work(shape_name):
    """The released-style row and the accelerated row of released_step keep the same tokens at the same positions
    from the same guidance attention, so their ratio compares one step done two ways."""
    from bench.released import released_inputs

    inputs = smoke_inputs(shape_name)
    results = {}
    for backend in (RELEASED, "torch"):
        case = STAGES["released_step"](inputs, backend)
        case.reset()
        case.run()
        results[backend] = _cache_of(case.model)
    (rk, rp), (fk, fp) = results[RELEASED], results["torch"]
    assert [k.shape for k, _ in rk] == [k.shape for k, _ in fk]
    assert all(torch.equal(a, b) for a, b in zip(rp, fp))
    for (a, _), (b, _) in zip(rk, fk):
        torch.testing.assert_close(b.float(), a.float(), atol=1e-3 if a.dtype == torch.float16 else 1e-4, rtol=1e-3)
    assert released_inputs(inputs).pooled is not None


def test_released_stages_refuse_a_family_the_released_code_lacks():
    with pytest.raises(Unavailable, match="no qwen3_vl class"):
        STAGES["released_step"](smoke_inputs("smoke-mrope-interleaved"), "torch")


def test_released_stages_run_once_per_shape_with_their_ratio():
    """At the largest budget and chunk of each released family's shape only; "vs ref" is the released-style median
    over the accelerated one; the headline prints both medians."""
    specs = [Spec(shape=SMOKE_SHAPES[name], budget=budget, chunk_frames=chunk, dtype=torch.float32,
                  device=torch.device("cpu"), tokens_per_frame=8)
             for name in ("smoke-1d", "smoke-mrope-interleaved") for budget in (16, 24) for chunk in (1, 2)]
    args = cli.parse_args(["--quick", "--no-memory"])
    rows = cli.measure(specs, ["released_step"], ("torch",), args, torch.device("cpu"))
    assert [(r.shape, r.budget, r.chunk, r.backend) for r in rows] == [("smoke-1d", 24, 2, RELEASED),
                                                                       ("smoke-1d", 24, 2, "torch")]
    released, fast = rows
    assert released.ok and fast.ok and released.repeats == args.released_repeats == 1
    assert fast.speedup_vs_reference == pytest.approx(released.median_ms / fast.median_ms)
    line = [x for x in cli.headline(rows) if x.startswith("released_step")]
    assert len(line) == 1 and "accelerate(backend='torch') vs the released-style code" in line[0]


def test_the_cpu_grid_leaves_the_released_guidance_out():
    assert "released_guidance" not in cli.parse_args(["--full", "--device", "cpu"]).stages
    assert "released_guidance" in cli.parse_args(["--quick"]).stages
    assert {"released_step", "released_guidance"} <= set(cli.parse_args(["--full", "--device", "cuda"]).stages)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_first_run_is_the_headline_and_full_is_the_grid(device):
    """No flag: the whole step of both policies at the two 7B shapes, one budget and chunk (a newcomer's first
    command, about two minutes on 2 cores); --full: every stage over both budgets and more chunks; --quick and
    --full together are refused."""
    first = cli.parse_args(["--device", device])
    assert first.stages == ["step", "h2svc_step"] and first.budgets == [6000] and first.chunks == [16]
    assert first.shapes == ["llava-ov-7b", "qwen2.5-vl-7b"]
    full = cli.parse_args(["--full", "--device", device])
    assert {"scores", "select", "compact", "h2svc_stce", "released_step"} <= set(full.stages)
    assert full.budgets == [4000, 6000] and len(full.chunks) >= 2
    with pytest.raises(SystemExit):
        cli.parse_args(["--full", "--quick"])


def test_a_run_writes_to_a_folder_git_ignores(tmp_path, monkeypatch):
    """Without --out a run writes its CSV and plot under bench/out/, which git ignores (the committed records under
    bench/results/ stay as they are); --out DIR moves them."""
    import subprocess

    from tests.utils import REPO
    assert cli.OUT_DIR == Path(REPO) / "bench" / "out"
    ignored = subprocess.run(["git", "check-ignore", "-q", str(cli.OUT_DIR / "cpu.csv")], cwd=REPO)
    assert ignored.returncode == 0, "bench/out/ is not ignored by git"
    monkeypatch.setattr(cli, "OUT_DIR", tmp_path / "default")
    small = ["--shapes", "smoke-1d", "--budgets", "64", "--chunks", "1", "--stages", "step", "--repeats", "1",
             "--reference-repeats", "1", "--warmup", "0", "--no-e2e", "--no-memory"]
    assert cli.main(small) == 0
    assert sorted(p.name for p in (tmp_path / "default").iterdir()) == ["cpu.csv", "cpu.png"]
    assert cli.main([*small, "--no-plot", "--out", str(tmp_path / "given")]) == 0
    assert [p.name for p in (tmp_path / "given").iterdir()] == ["cpu.csv"]


def test_the_plot_divides_each_stage_by_its_floor_and_its_reference():
    """Per shape and dtype: every stage of either policy with a floor, each backend's median / copy floor; every
    non-reference backend's median / the reference median at the same point (the released-style one for the
    released stages), failed rows left out."""
    from bench.plot import panels

    def row(stage, backend, median, budget=64, floor=None, status="ok"):
        return report.Row(stage=stage, backend=backend, shape="s", budget=budget, chunk=2, dtype="float32",
                          batch=1, reindex="eager", num_tokens=10, status=status, median_ms=median,
                          floor_ratio=floor)
    rows = [row("step", "reference", 8.0, floor=40.0), row("step", "torch", 2.0, floor=10.0),
            row("h2svc_step", "reference", 6.0, budget=0, floor=30.0), row("h2svc_step", "torch", 3.0, budget=0,
                                                                            floor=15.0),
            row("released_step", "released", 10.0), row("released_step", "torch", 1.0),
            row("select", "torch", 5.0), row("step", "torch-ops", 4.0, status="error: boom")]
    floor, reference = panels(rows)[("s", "float32")]
    assert floor == {"step\nb=64 c=2": {"reference": 40.0, "torch": 10.0},
                     "h2svc_step\nc=2": {"reference": 30.0, "torch": 15.0}}
    assert reference == {"step\nb=64 c=2": {"torch": 0.25}, "h2svc_step\nc=2": {"torch": 0.5},
                         "released_step\nb=64 c=2": {"torch": 0.1}}

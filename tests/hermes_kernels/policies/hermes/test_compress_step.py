"""The whole step: hermes_kernels.compress_step on both backends against
hermes_kernels.policies.hermes.reference.compress_step, Gemma 4's full-attention layers (D 512, proportional RoPE)
among the cases."""
import pytest
import torch

import hermes_kernels as hk
from hermes_kernels import HermesConfig
from hermes_kernels.policies.hermes import reference as ref
from hermes_kernels.engine.launch import launch_count
from hermes_kernels.engine.dispatch import resolve_backend
from tests.utils import DEVICE, TORCH_OPS
from tests.utils import INTERLEAVED, PARTIAL, TOL, assert_close_verbose, assert_tails_equal, distinct_attention
from tests.utils import inv_freq_for, inv_freq_of, poison_tail_, rope_id, rotary_width, synthetic_positions
from hermes_kernels.rope import RotaryLayout
from scaffolding.rotary import proportional_inv_freq

BACKENDS = ["torch", TORCH_OPS, "triton"]

# (L, B, Hkv, D, P, V, budget, dtype, rotary, reindex, cascade, summary, preset)
CASES = [
    (4, 1, 2, 64, 0, 37, 16, torch.float32, None, "eager", True, True, "qwen2_5_vl"),
    (5, 3, 1, 128, 14, 41, 20, torch.float16, None, "lazy", True, True, "llava_ov"),
    (4, 3, 3, 64, 14, 20, 20, torch.bfloat16, None, "eager", False, True, "paper"),
    (6, 1, 2, 16, 3, 29, 11, torch.float32, [2, 3, 3], "eager", True, True, "qwen2_5_vl"),
    (4, 2, 2, 128, 14, 45, 23, torch.float16, [16, 24, 24], "lazy", True, True, "qwen2_5_vl"),
    (4, 2, 1, 16, 0, 9, 12, torch.float32, [2, 3, 3], "eager", True, True, "qwen2_5_vl"),
    (5, 2, 2, 64, 14, 33, 13, torch.bfloat16, None, "eager", True, False, "llava_ov"),
    (4, 1, 3, 64, 3, 30, 30, torch.float32, None, "lazy", False, True, "paper"),
    (5, 2, 2, 16, 3, 29, 11, torch.bfloat16, INTERLEAVED[16], "eager", True, True, "qwen3_vl"),
    (4, 1, 2, 128, 14, 45, 23, torch.float16, INTERLEAVED[128], "lazy", True, True, "qwen3_vl"),
    (4, 2, 1, 8, 0, 21, 9, torch.float32, INTERLEAVED[8], "eager", False, True, "qwen3_vl"),
    # partial rotary (Qwen3.5): channels [R, D) of a key never turn; kept rows' tails poisoned (−0.0, a NaN)
    (4, 2, 2, 32, 3, 29, 11, torch.float32, PARTIAL["il"][1], "eager", True, True, "qwen3_vl"),
    (5, 1, 2, 16, 14, 33, 13, torch.bfloat16, PARTIAL["1d"][1], "lazy", True, True, "llava_ov"),
    (4, 2, 1, 32, 0, 27, 27, torch.float16, PARTIAL["il"][1], "eager", False, True, "qwen3_vl"),
]
# Gemma 4's full-attention layers (`run_case(..., proportional=True)`): D 512 (and 256), 1D RoPE over all D/2 pairs
# with a proportional inv_freq (the first D/8 pairs turn, the others have frequency 0); its preset
PROPORTIONAL_CASES = [
    (3, 2, 2, 512, 3, 17, 7, torch.bfloat16, None, "lazy", True, True, "gemma4"),
    (2, 1, 4, 512, 14, 13, 6, torch.float32, None, "eager", True, True, "gemma4"),
    (3, 1, 1, 256, 0, 15, 15, torch.float16, None, "eager", False, True, "gemma4"),
]


def case_id(c) -> str:
    return (f"L{c[0]}B{c[1]}Hkv{c[2]}D{c[3]}P{c[4]}V{c[5]}b{c[6]}-{str(c[7])[6:]}-{rope_id(c[8], c[3])}-{c[9]}"
            f"-c{int(c[10])}s{int(c[11])}")


def run_case(case, backend, seed, start=0, max_positions=None, proportional=False):
    """One step of `backend` against the reference's on a fresh cache; returns the backend's result. Partial
    rotary: inv_freq [R/2], the tails [R, D) of the rows the step keeps poisoned (−0.0, a NaN with a payload) and
    compared byte for byte (summary slots: within tolerance). `proportional`: Gemma 4's inv_freq [D/2] (1D)."""
    L, B, Hkv, D, P, V, budget, dtype, section, reindex, cascade, summary, preset = case
    R = rotary_width(D, section)
    mrope = section is not None and RotaryLayout.of(section, R // 2).num_axes == 3
    N = P + V
    extra = {} if max_positions is None else dict(max_positions=max_positions, margin=64)
    cfg = getattr(HermesConfig, preset)(L, budget, P, reindex=reindex, cascade=cascade, summary=summary, **extra)
    g = torch.Generator().manual_seed(seed)
    # the cache is a view of a larger buffer whose tail is poisoned: nothing may touch it
    keys_buf = torch.full((L, B, Hkv, N + 5, D), float("nan"), dtype=dtype)
    values_buf = torch.full_like(keys_buf, float("nan"))
    keys_buf[..., :N, :] = torch.randn(L, B, Hkv, N, D, generator=g).to(dtype)
    values_buf[..., :N, :] = torch.randn(L, B, Hkv, N, D, generator=g).to(dtype)
    positions = synthetic_positions(L, B, N, P, g, mrope=mrope, start=start)
    attn = distinct_attention(L, B, V, g)
    keys_buf, values_buf, positions, attn = (t.to(DEVICE) for t in (keys_buf, values_buf, positions, attn))
    keys, values = keys_buf[..., :N, :], values_buf[..., :N, :]
    inv_freq = proportional_inv_freq(D, device=DEVICE) if proportional else inv_freq_of(D, section, device=DEVICE)
    keep = ref.select_keep(ref.hermes_scores(attn, cfg), cfg)  # the rows whose tails are carried
    carried = torch.zeros(L, B, N, dtype=torch.bool, device=DEVICE)
    carried[..., :P] = True
    carried.scatter_(2, P + keep.clamp(min=0), keep >= 0)
    poison_tail_(keys, R, carried.unsqueeze(2))
    rk, rv, rp = keys.clone(), values.clone(), positions.clone()
    expected = ref.compress_step(rk, rv, rp, attn.clone(), cfg, inv_freq, section)
    ptrs = (keys.data_ptr(), values.data_ptr(), positions.data_ptr())
    got = hk.compress_step(keys, values, positions, attn, cfg, inv_freq, section, backend=backend)
    assert (keys.data_ptr(), values.data_ptr(), positions.data_ptr()) == ptrs, "not in place"
    assert torch.isnan(keys_buf[..., N:, :]).all() and torch.isnan(values_buf[..., N:, :]).all(), "wrote past N"
    assert got.length == expected.length
    assert bool(got.reindexed) == bool(expected.reindexed)
    assert torch.equal(got.keep.cpu(), expected.keep.cpu()), "keep indices differ"
    assert_close_verbose(got.scores, expected.scores, 1e-5, 1e-5, "scores")
    n = got.length
    assert torch.equal(positions[..., :n].cpu(), rp[..., :n].cpu()), "positions differ"
    atol, rtol = TOL[dtype]
    assert_close_verbose(keys[..., :n, :R], rk[..., :n, :R], atol * 4, rtol * 4, "keys")
    kept = P + (got.keep >= 0).sum(dim=-1, keepdim=True)  # [L, B, 1]: slots before it are carried rows
    assert_tails_equal(keys[..., :n, :], rk[..., :n, :], R, (torch.arange(n, device=kept.device) < kept).unsqueeze(2))
    assert_close_verbose(values[..., :n, :], rv[..., :n, :], atol, rtol, "values")
    return got


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_matches_reference(case, backend):
    run_case(case, backend, seed=hash(case[:7]) % 1000)


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("case", PROPORTIONAL_CASES, ids=case_id)
def test_proportional_rope_matches_reference(case, backend):
    """Gemma 4's full-attention layers: the whole step with its proportional inv_freq, lazy re-indexing crossing the
    limit (decided on the device) or eager."""
    lazy = dict(start=4 * (case[4] + case[5]), max_positions=4 * (case[4] + case[5])) if case[9] == "lazy" else {}
    assert bool(run_case(case, backend, seed=PROPORTIONAL_CASES.index(case), proportional=True, **lazy).reindexed)


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("section", [None, [2, 3, 3], INTERLEAVED[16]], ids=rope_id)
def test_lazy_threshold_crossed(backend, section):
    case = (4, 2, 1, 16, 3, 25, 10, torch.float32, section, "lazy", True, True, "qwen2_5_vl")
    assert not bool(run_case(case, backend, seed=5, start=100, max_positions=1000).reindexed)
    assert bool(run_case(case, backend, seed=5, start=1000, max_positions=1000).reindexed)


def launches_for(L, B):
    case = (L, B, 1, 16, 2, 12, 6, torch.float32, None, "eager", True, True, "llava_ov")
    before = launch_count()
    run_case(case, "triton", seed=L + B)
    return launch_count() - before


def test_triton_launch_count_independent_of_layers_and_streams():
    counts = {(L, B): launches_for(L, B) for L, B in [(2, 1), (28, 1), (28, 3)]}
    assert len(set(counts.values())) == 1, f"launches per step vary: {counts}"
    assert 0 < counts[(2, 1)] <= 8, f"expected a handful of launches, got {counts[(2, 1)]}"


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_bad_input_leaves_cache_unchanged(backend):
    cfg = HermesConfig.llava_ov(4, 5, 2)
    g = torch.Generator().manual_seed(9)
    keys = torch.randn(4, 1, 2, 12, 16, generator=g).to(DEVICE)
    values, positions = keys.clone(), synthetic_positions(4, 1, 12, 2, g).to(DEVICE)
    attn = distinct_attention(4, 1, 10, g, device=DEVICE)
    attn[1, 0, 3] = float("nan")
    snapshot = [t.clone() for t in (keys, values, positions)]
    with pytest.raises(ValueError, match=r"layer\(s\) \[1\]"):
        hk.compress_step(keys, values, positions, attn, cfg, inv_freq_for(16, device=DEVICE), backend=backend)
    with pytest.raises(ValueError, match="backend"):
        hk.compress_step(keys, values, positions, attn.nan_to_num(), cfg, inv_freq_for(16, device=DEVICE),
                         backend="cuda")
    for before, after in zip(snapshot, (keys, values, positions)):
        assert torch.equal(before, after)


def test_auto_backend_follows_the_device():
    assert resolve_backend("auto", torch.device("cpu")) == "torch"
    assert resolve_backend("auto", torch.device("cuda", 0)) == "triton"
    assert resolve_backend("torch", torch.device("cuda", 0)) == "torch"

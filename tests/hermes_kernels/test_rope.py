"""hermes_kernels.rope: delta rotations agree with transformers' own RoPE and compose; compaction ranks per axis."""
import pytest
import torch
from transformers.models.qwen2 import modeling_qwen2
from transformers.models.qwen2_5_vl import configuration_qwen2_5_vl, modeling_qwen2_5_vl

from hermes_kernels.rope import apply_rotary_delta, compact_positions, mrope_axis_of_freq
from tests.utils import assert_close_verbose, inv_freq_for

TOL_ROT = {torch.float32: (1e-4, 1e-4), torch.float64: (1e-9, 1e-9)}


def hf_rotate(x, positions, inv_freq):
    """transformers' Qwen2 RoPE of x [H, T, D] at integer positions [T] (the convention the models use)."""
    freqs = positions.to(torch.float64)[:, None] * inv_freq.to(torch.float64)
    emb = torch.cat([freqs, freqs], dim=-1)
    q, _ = modeling_qwen2.apply_rotary_pos_emb(x.double(), x.double(), emb.cos(), emb.sin(), 0)
    return q


def hf_rotate_mrope(x, positions, mrope_section, theta):
    """transformers' Qwen2.5-VL M-RoPE of x [H, T, D] at positions [3, T]."""
    head_dim = x.shape[-1]
    config = configuration_qwen2_5_vl.Qwen2_5_VLTextConfig(
        hidden_size=head_dim * 2, num_attention_heads=2, num_key_value_heads=1, head_dim=head_dim,
        rope_parameters={"rope_type": "default", "rope_theta": theta, "mrope_section": list(mrope_section)})
    rotary = modeling_qwen2_5_vl.Qwen2_5_VLRotaryEmbedding(config)
    cos, sin = rotary(x.float(), positions[:, None, :])
    q, _ = modeling_qwen2_5_vl.apply_rotary_pos_emb(x.float(), x.float(), cos[0], sin[0], 0)
    return q


def test_matches_transformers_1d():
    g = torch.Generator().manual_seed(0)
    D = 64
    inv_freq = inv_freq_for(D, 1e6)
    x = torch.randn(3, 11, D, generator=g, dtype=torch.float64)
    positions = torch.randint(0, 30000, (11,), generator=g)
    assert_close_verbose(apply_rotary_delta(x, positions, inv_freq), hf_rotate(x, positions, inv_freq),
                         1e-9, 1e-9, "rotary vs transformers")


@pytest.mark.parametrize("section", [[2, 3, 3], [16, 24, 24]])
def test_matches_transformers_mrope(section):
    g = torch.Generator().manual_seed(1)
    D = 2 * sum(section)
    x = torch.randn(2, 9, D, generator=g)
    positions = torch.randint(0, 500, (3, 9), generator=g)
    ours = apply_rotary_delta(x, positions, inv_freq_for(D, 1e6), section)
    assert_close_verbose(ours, hf_rotate_mrope(x, positions, section, 1e6), 2e-4, 2e-4, "M-RoPE vs transformers")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("section", [None, [2, 3, 3], [16, 24, 24]])
def test_rotation_composes(dtype, section):
    """Rotating to p and then by d equals rotating to p + d."""
    g = torch.Generator().manual_seed(2)
    D = 2 * sum(section) if section else 64
    inv_freq = inv_freq_for(D, 1e4)
    x = torch.randn(4, 13, D, generator=g, dtype=dtype)
    shape = (3, 13) if section else (13,)
    p = torch.randint(0, 20000, shape, generator=g)
    d = torch.randint(-5000, 5000, shape, generator=g)
    two_steps = apply_rotary_delta(apply_rotary_delta(x, p, inv_freq, section), d, inv_freq, section)
    one_step = apply_rotary_delta(x, p + d, inv_freq, section)
    atol, rtol = TOL_ROT[dtype]
    assert_close_verbose(two_steps, one_step, atol * 30, rtol * 30, "R(d)R(p)x vs R(p+d)x")
    back = apply_rotary_delta(one_step, -(p + d), inv_freq, section)
    assert_close_verbose(back, x, atol * 30, rtol * 30, "rotation inverse")


def test_zero_delta_is_identity_and_dtype_kept():
    x = torch.randn(2, 5, 16, dtype=torch.float16)
    out = apply_rotary_delta(x, torch.zeros(5, dtype=torch.int64), inv_freq_for(16))
    assert out.dtype == torch.float16
    assert torch.equal(out, x)


def test_axis_map():
    assert mrope_axis_of_freq([2, 3, 3]).tolist() == [0, 0, 1, 1, 1, 2, 2, 2]
    with pytest.raises(ValueError, match="mrope_section"):
        mrope_axis_of_freq([2, 3])


def test_compact_positions_1d_and_per_axis():
    assert compact_positions(torch.tensor([20, 23, 40, 41]), 5).tolist() == [5, 6, 7, 8]
    kept = torch.tensor([[30, 30, 32, 32, 35],    # t: frames repeat
                         [30, 31, 30, 33, 31],    # h: not monotone in cache order
                         [40, 41, 40, 41, 44]])
    assert compact_positions(kept, 3).tolist() == [[3, 3, 4, 4, 5], [3, 4, 3, 5, 4], [3, 4, 3, 4, 5]]

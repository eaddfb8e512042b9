"""hermes_kernels.engine.geometry.ModelGeometry: the one record of a model's attention geometry. Its default inverse
frequencies are transformers' own, its head-dim variants keep the rotary layout's kind, and bad fields are refused
naming the field."""
import pytest
import torch
from transformers.models.qwen2 import configuration_qwen2, modeling_qwen2
from transformers.models.qwen3_5 import configuration_qwen3_5, modeling_qwen3_5

from hermes_kernels.engine.geometry import ModelGeometry
from hermes_kernels.rope import RotaryLayout
from tests.utils import assert_close_verbose

GOOD = dict(num_layers=4, num_heads=8, num_kv_heads=2, head_dim=32, max_positions=4096, rope_theta=1e6)


@pytest.mark.parametrize("theta,head_dim", [(1e4, 32), (1e6, 128), (5e6, 64)])
def test_inv_freq_is_the_default_rope_of_transformers(theta, head_dim):
    """The fp64 theta ** (-2i / D) rounded once to fp32: at least as close to it as transformers' own fp32 one."""
    config = configuration_qwen2.Qwen2Config(hidden_size=4 * head_dim, num_attention_heads=4, num_key_value_heads=2,
                                             rope_parameters=dict(rope_type="default", rope_theta=theta))
    theirs = modeling_qwen2.Qwen2RotaryEmbedding(config).inv_freq.to(torch.float64)
    got = ModelGeometry(**{**GOOD, "num_heads": 4, "head_dim": head_dim, "rope_theta": theta}).inv_freq()
    exact = theta ** -(torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    assert got.dtype == torch.float32 and torch.equal(got, exact.to(torch.float32))
    assert (got.double() - exact).abs().max() <= (theirs - exact).abs().max()


@pytest.mark.parametrize("rotary", [None, RotaryLayout.sections((4, 6, 6)), RotaryLayout.interleaved((6, 5, 5))])
def test_with_head_dim_scales_the_pairs_and_keeps_the_layout_kind(rotary):
    geometry = ModelGeometry(**GOOD, rotary=rotary)
    assert geometry.rotary == RotaryLayout.of(rotary, 16) and geometry.mrope == (rotary is not None)
    wide = geometry.with_head_dim(64)
    assert wide.head_dim == 64 and wide.rotary.pairs == 32 and wide.rotary.kind == geometry.rotary.kind
    assert wide.rotary.counts == tuple(2 * count for count in geometry.rotary.counts)
    assert dataclasses_equal_but(wide, geometry, "head_dim", "rotary")


def test_partial_rotary_inv_freq_and_head_dim_variants():
    """Partial rotary (Qwen3.5: R = D/4 of D 256, interleaved [11, 11, 10]): inv_freq is the rotary width's,
    theta ** (-2i / R) over R/2 pairs, as transformers' Qwen3.5 rotary module computes it; a head-dim variant keeps
    its pair counts scaled with the head (1D and M-RoPE)."""
    config = configuration_qwen3_5.Qwen3_5TextConfig(
        hidden_size=512, num_attention_heads=2, num_key_value_heads=1, head_dim=256,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25})
    theirs = modeling_qwen3_5.Qwen3_5TextRotaryEmbedding(config).inv_freq
    geometry = ModelGeometry(**{**GOOD, "head_dim": 256, "rope_theta": 1e4},
                             rotary=RotaryLayout.interleaved((11, 11, 10)))
    got = geometry.inv_freq()
    exact = 1e4 ** -(torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    assert got.shape == theirs.shape == (32,) and torch.equal(got, exact.to(torch.float32))
    assert_close_verbose(got, theirs, 1e-7, 1e-6, "partial inv_freq vs Qwen3.5's")
    narrow = geometry.with_head_dim(64)
    assert narrow.rotary.counts == (2, 2, 2) and narrow.rotary.kind == "interleaved"  # each count scaled, rounded down
    one_d = ModelGeometry(**GOOD, rotary=RotaryLayout.one_d(4))
    assert one_d.with_head_dim(64).rotary == RotaryLayout.one_d(8) and one_d.inv_freq().shape == (4,)
    assert ModelGeometry(**GOOD).with_head_dim(64).rotary == RotaryLayout.one_d(32)


def dataclasses_equal_but(a, b, *fields) -> bool:
    names = ("num_layers", "num_heads", "num_kv_heads", "head_dim", "max_positions", "rope_theta", "rotary")
    return all(getattr(a, name) == getattr(b, name) for name in names if name not in fields)


@pytest.mark.parametrize("field,value,match", [
    ("num_layers", 0, "num_layers"), ("num_heads", 7, "num_heads"), ("num_kv_heads", True, "num_kv_heads"),
    ("head_dim", 31, "head_dim"), ("max_positions", 2.0, "max_positions"), ("rope_theta", 0.5, "rope_theta"),
    ("rope_theta", "1e6", "rope_theta"), ("rotary", (4, 4, 4), "rotary"), ("rotary", "t", "rotary"),
    ("rotary", RotaryLayout.one_d(17), "rotary")])
def test_bad_fields_are_refused_naming_the_field(field, value, match):
    with pytest.raises((ValueError, TypeError), match=match):
        ModelGeometry(**{**GOOD, field: value})


def test_rope_theta_must_exceed_one():
    """theta = 1 turns every pair by the same angle (all inverse frequencies 1): refused; any base above 1 is kept."""
    with pytest.raises(ValueError, match="^rope_theta: expected a RoPE base > 1, got 1$"):
        ModelGeometry(**{**GOOD, "rope_theta": 1})
    assert ModelGeometry(**{**GOOD, "rope_theta": 1.5}).rope_theta == 1.5


def test_inv_freq_is_made_on_the_device_asked_for():
    """The meta device stands in for CUDA on a machine without one."""
    got = ModelGeometry(**GOOD).inv_freq("meta")
    assert got.device.type == "meta" and got.dtype == torch.float32 and got.shape == (16,)


@pytest.mark.parametrize("pairs", [12, 15])
def test_a_partial_1d_width_near_the_whole_head_scales_with_it(pairs):
    """Partial 1D rotary of 12 or 15 of 16 pairs is still partial at twice the head dim."""
    geometry = ModelGeometry(**GOOD, rotary=RotaryLayout.one_d(pairs))
    assert geometry.with_head_dim(64).rotary == RotaryLayout.one_d(2 * pairs)

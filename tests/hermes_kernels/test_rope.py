"""hermes_kernels.rope: the rotary layouts (which axis turns each frequency pair) and delta rotations agree with
transformers' own rotary modules (Qwen2.5-VL's contiguous sections, Qwen3-VL's interleaved ones, Qwen3.5's partial
rotary, Gemma 4's proportional RoPE as plain 1D) and compose; a partial rotation leaves the head's other channels bit
for bit, and so does a zero frequency; compaction ranks per axis."""
import pytest
import torch
from transformers.models.gemma4 import configuration_gemma4, modeling_gemma4
from transformers.models.qwen2 import modeling_qwen2
from transformers.models.qwen2_5_vl import configuration_qwen2_5_vl, modeling_qwen2_5_vl
from transformers.models.qwen3_5 import configuration_qwen3_5, modeling_qwen3_5
from transformers.models.qwen3_vl import configuration_qwen3_vl, modeling_qwen3_vl

from hermes_kernels.engine.checks import check_rotary
from hermes_kernels.rope import RotaryLayout, apply_rotary_delta, compact_positions, rotary_angles, rotary_cos_sin
from scaffolding.rotary import proportional_inv_freq
from tests.utils import assert_close_verbose, frozen_channels, inv_freq_for

# M-RoPE family -> (its text config, its rotary module, the layout we read its mrope_section as)
HF_MROPE = {
    "qwen2_5_vl": (configuration_qwen2_5_vl.Qwen2_5_VLTextConfig, modeling_qwen2_5_vl.Qwen2_5_VLRotaryEmbedding,
                   RotaryLayout.sections),
    "qwen3_vl": (configuration_qwen3_vl.Qwen3VLTextConfig, modeling_qwen3_vl.Qwen3VLTextRotaryEmbedding,
                 RotaryLayout.interleaved),
}
# (family, mrope_section): the published sections at D = 128 and small ones of the test grids
MROPE_CASES = [("qwen2_5_vl", [2, 3, 3]), ("qwen2_5_vl", [16, 24, 24]), ("qwen3_vl", [2, 1, 1]),
               ("qwen3_vl", [4, 2, 2]), ("qwen3_vl", [24, 20, 20])]

TOL_ROT = {torch.float32: (1e-4, 1e-4), torch.float64: (1e-9, 1e-9)}


def hf_rotate(x, positions, inv_freq):
    """transformers' Qwen2 RoPE of x [H, T, D] at integer positions [T] (the convention the models use)."""
    freqs = positions.to(torch.float64)[:, None] * inv_freq.to(torch.float64)
    emb = torch.cat([freqs, freqs], dim=-1)
    q, _ = modeling_qwen2.apply_rotary_pos_emb(x.double(), x.double(), emb.cos(), emb.sin(), 0)
    return q


def hf_rotary(family: str, mrope_section, theta: float) -> torch.nn.Module:
    """The rotary module of `family`'s text model with this mrope_section (head dim 2·sum(section))."""
    config_type, module_type, _ = HF_MROPE[family]
    head_dim = 2 * sum(mrope_section)
    config = config_type(hidden_size=head_dim * 2, num_attention_heads=2, num_key_value_heads=1, head_dim=head_dim,
                         rope_parameters={"rope_type": "default", "rope_theta": theta,
                                          "mrope_section": list(mrope_section), "mrope_interleaved": True})
    return module_type(config)


def hf_rotate_mrope(x, positions, mrope_section, theta, family="qwen2_5_vl"):
    """transformers' M-RoPE of `family` (default Qwen2.5-VL) of x [H, T, D] at positions [3, T]."""
    cos, sin = hf_rotary(family, mrope_section, theta)(x.float(), positions[:, None, :])
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


@pytest.mark.parametrize("family, section", MROPE_CASES)
def test_layout_matches_transformers_cos_sin(family, section):
    """cos/sin of every frequency pair at 3-axis positions: the family's layout against the family's own rotary
    module (both halves of D), from the module's own inv_freq; independent random positions per axis."""
    g = torch.Generator().manual_seed(7)
    rotary = hf_rotary(family, section, 5e6)
    layout = HF_MROPE[family][2](section)
    positions = torch.randint(0, 40000, (3, 17), generator=g)
    want_cos, want_sin = rotary(torch.zeros(1), positions[:, None, :])
    cos, sin = rotary_cos_sin(positions, rotary.inv_freq, layout)
    half = layout.pairs
    for name, ours, theirs in (("cos", cos, want_cos[0]), ("sin", sin, want_sin[0])):
        assert_close_verbose(ours, theirs[:, :half], 1e-6, 1e-6, f"{family} {name}, pairs")
        assert_close_verbose(ours, theirs[:, half:], 1e-6, 1e-6, f"{family} {name}, second half")


@pytest.mark.parametrize("family, section", MROPE_CASES)
def test_matches_transformers_mrope(family, section):
    g = torch.Generator().manual_seed(1)
    D = 2 * sum(section)
    x = torch.randn(2, 9, D, generator=g)
    positions = torch.randint(0, 500, (3, 9), generator=g)
    layout = HF_MROPE[family][2](section)
    ours = apply_rotary_delta(x, positions, inv_freq_for(D, 1e6), layout)
    assert_close_verbose(ours, hf_rotate_mrope(x, positions, section, 1e6, family), 2e-4, 2e-4,
                         f"{family} M-RoPE vs transformers")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("section", [None, [2, 3, 3], [16, 24, 24], RotaryLayout.interleaved([24, 20, 20])],
                         ids=["1d", "sections-2-3-3", "sections-16-24-24", "interleaved-24-20-20"])
def test_rotation_composes(dtype, section):
    """Rotating to p and then by d equals rotating to p + d."""
    g = torch.Generator().manual_seed(2)
    D = 2 * (section.pairs if isinstance(section, RotaryLayout) else sum(section)) if section else 64
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


def test_layout_maps():
    assert RotaryLayout.one_d(3) == RotaryLayout((0, 0, 0), 1)
    assert RotaryLayout.sections([2, 3, 3]).axis == (0, 0, 1, 1, 1, 2, 2, 2)
    assert RotaryLayout.interleaved([2, 1, 1]).axis == (0, 1, 2, 0)
    assert RotaryLayout.interleaved([4, 2, 2]).axis == (0, 1, 2, 0, 1, 2, 0, 0)
    qwen3 = RotaryLayout.interleaved((24, 20, 20))  # Qwen3-VL-8B: t, h, w cycle over pairs 0-59, t holds 60-63
    assert qwen3.axis == (0, 1, 2) * 20 + (0,) * 4
    assert (qwen3.pairs, qwen3.num_axes) == (64, 3)
    assert RotaryLayout.sections([4, 2, 2]) != RotaryLayout.interleaved([4, 2, 2])
    assert RotaryLayout((0, 2, 1), 3).kind == "custom" and RotaryLayout((0, 2, 1), 3).counts == (1, 1, 1)
    assert [RotaryLayout.sections([2, 1, 1]).describe(), RotaryLayout.interleaved([2, 1, 1]).describe(),
            RotaryLayout.one_d(4).describe()] == ["M-RoPE sections [2, 1, 1]", "M-RoPE interleaved [2, 1, 1]",
                                                  "1d (4 pairs)"]


def test_layout_of_normalises_every_description():
    """None -> 1D, three counts (list, tuple or tensor) -> contiguous sections, a layout -> itself."""
    assert RotaryLayout.of(None, 4) == RotaryLayout.one_d(4)
    for section in ([2, 3, 3], (2, 3, 3), torch.tensor([2, 3, 3])):
        assert RotaryLayout.of(section, 8) == RotaryLayout.sections([2, 3, 3])
    layout = RotaryLayout.interleaved([4, 2, 2])
    assert RotaryLayout.of(layout, 8) is layout
    assert len({RotaryLayout.of([2, 3, 3], 8), RotaryLayout.sections((2, 3, 3))}) == 1  # hashable, equal


def test_axis_tensor_is_built_once_per_device():
    layout = RotaryLayout.interleaved([4, 2, 2])
    axis = layout.axis_tensor()
    assert axis.dtype == torch.int32 and axis.tolist() == list(layout.axis)
    assert layout.axis_tensor("cpu") is axis
    assert RotaryLayout.interleaved([4, 2, 2]).axis_tensor() is axis  # equal layouts share it
    assert layout.axis_tensor("meta").device.type == "meta"


@pytest.mark.parametrize("bad, error, match", [
    (lambda: RotaryLayout.sections([2, 3]), ValueError, "mrope_section: expected three"),
    (lambda: RotaryLayout.sections([2, -1, 3]), ValueError, "mrope_section: expected three non-negative"),
    (lambda: RotaryLayout.sections([0, 0, 0]), ValueError, "mrope_section"),
    (lambda: RotaryLayout.sections("abc"), TypeError, "mrope_section: expected three pair counts"),
    (lambda: RotaryLayout.interleaved([1, 3, 3]), ValueError, r"mrope_section: interleaved \[1, 3, 3\]"),
    (lambda: RotaryLayout.one_d(0), ValueError, "pairs: a 1D layout"),
    (lambda: RotaryLayout((0, 3), 3), ValueError, r"RotaryLayout\.axis: expected one axis in \[0, 3\)"),
    (lambda: RotaryLayout((0, 1), 2), ValueError, r"RotaryLayout\.num_axes: a layout has 1 axis"),
    (lambda: RotaryLayout((), 1), ValueError, r"RotaryLayout\.axis"),
    (lambda: RotaryLayout.of([2, 3, 3], 9), ValueError, "rotary: .* covers 8 frequency pairs, expected D/2=9"),
    (lambda: RotaryLayout.of(RotaryLayout.interleaved([4, 2, 2]), 4), ValueError,
     r"rotary: M-RoPE interleaved \[4, 2, 2\] covers 8 frequency pairs, more than the head's D/2=4"),
    (lambda: RotaryLayout.of([2, 1, 1], 8), ValueError, "explicit RotaryLayout"),
    (lambda: RotaryLayout.of("233", 8), TypeError, "rotary: expected None, three pair counts"),
    (lambda: RotaryLayout.of([2, 3], 5), ValueError, "rotary: expected three non-negative pair counts"),
    (lambda: RotaryLayout.of(3, 8), TypeError, "rotary"),
], ids=["two-counts", "negative", "empty", "letters", "interleaved-overflow", "1d-empty", "axis-range",
        "two-axes", "no-pairs", "of-pairs", "of-layout-pairs", "of-sections-partial", "of-str", "of-two-counts",
        "of-int"])
def test_layout_errors_name_the_argument(bad, error, match):
    with pytest.raises(error, match=match):
        bad()


def test_one_d_layout_is_none():
    """A 1D layout and None take the same [..., T] deltas and give the same angles; a 3-axis layout wants 3 rows."""
    g = torch.Generator().manual_seed(3)
    inv_freq = inv_freq_for(16)
    delta = torch.randint(-900, 900, (2, 5, 7), generator=g)
    assert torch.equal(rotary_angles(delta, inv_freq, RotaryLayout.one_d(8)), rotary_angles(delta, inv_freq))
    with pytest.raises(ValueError, match=r"delta: expected \[\.\.\., 3, T\]"):
        rotary_angles(delta, inv_freq, RotaryLayout.sections([2, 3, 3]))


def test_compact_positions_1d_and_per_axis():
    assert compact_positions(torch.tensor([20, 23, 40, 41]), 5).tolist() == [5, 6, 7, 8]
    kept = torch.tensor([[30, 30, 32, 32, 35],    # t: frames repeat
                         [30, 31, 30, 33, 31],    # h: not monotone in cache order
                         [40, 41, 40, 41, 44]])
    assert compact_positions(kept, 3).tolist() == [[3, 3, 4, 4, 5], [3, 4, 3, 5, 4], [3, 4, 3, 4, 5]]


# ---- partial rotary (Qwen3.5: the first R = D·partial_rotary_factor channels turn) ---------------------------------
def qwen3_5_rotary(head_dim: int, factor: float, mrope_section, theta: float = 1e4) -> torch.nn.Module:
    """Qwen3.5's text rotary module at this head dim, partial_rotary_factor and (interleaved) mrope_section."""
    config = configuration_qwen3_5.Qwen3_5TextConfig(
        hidden_size=2 * head_dim, num_attention_heads=2, num_key_value_heads=1, head_dim=head_dim,
        rope_parameters={"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": factor,
                         "mrope_section": list(mrope_section)})
    return modeling_qwen3_5.Qwen3_5TextRotaryEmbedding(config)


# (head dim D, partial_rotary_factor, mrope_section): the published D 256, R 64, [11, 11, 10] and the tiny model's
PARTIAL_CASES = [(256, 0.25, (11, 11, 10)), (32, 0.25, (2, 1, 1)), (24, 0.5, (2, 2, 2))]


@pytest.mark.parametrize("head_dim, factor, section", PARTIAL_CASES, ids=lambda v: str(v))
@pytest.mark.parametrize("axes", ["mrope", "1d"])
def test_partial_rotation_matches_transformers_qwen3_5(head_dim, factor, section, axes):
    """Qwen3.5's RoPE of x at true positions = ours from 0 with the module's own inv_freq [R/2] and the interleaved
    layout of its mrope_section (1D: the same module with one position on every axis, our one_d layout of R/2
    pairs); the unrotated channels [R, D) come back bit for bit."""
    g = torch.Generator().manual_seed(11)
    rotary = qwen3_5_rotary(head_dim, factor, section)
    R = int(head_dim * factor)
    assert rotary.inv_freq.numel() == R // 2
    x = torch.randn(2, 13, head_dim, generator=g, dtype=torch.float64)
    if axes == "mrope":
        positions = torch.randint(0, 500, (3, 13), generator=g)
        layout = RotaryLayout.interleaved(rotary.mrope_section)
    else:
        positions = torch.randint(0, 500, (13,), generator=g)
        layout = RotaryLayout.one_d(R // 2)
    assert layout.rotary_dim == R
    cos, sin = rotary(x, positions.expand(3, 13)[:, None, :])
    want, _ = modeling_qwen3_5.apply_rotary_pos_emb(x, x, cos[0], sin[0], 0)
    ours = apply_rotary_delta(x, positions, rotary.inv_freq, layout)
    # the module's angles are fp32, ours fp64 (as in test_matches_transformers_mrope)
    assert_close_verbose(ours, want, 2e-4, 2e-4, f"Qwen3.5 partial rotary ({axes})")
    assert torch.equal(ours[..., R:], x[..., R:])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_partial_rotation_copies_the_tail_bit_for_bit(dtype):
    """Channels [R, D) of a partial rotation are the input's bytes: −0.0, NaN, ±inf and subnormals included (a
    rotation by zero would turn −0.0 into +0.0); channels [0, R) equal the full rotation of a head of R."""
    g = torch.Generator().manual_seed(12)
    D, R = 20, 8
    layout = RotaryLayout.interleaved((2, 1, 1))
    inv_freq = inv_freq_for(R, 1e4)
    x = torch.randn(3, 7, D, generator=g).to(dtype)
    specials = torch.tensor([-0.0, float("nan"), float("inf"), -float("inf"), torch.finfo(dtype).tiny / 4, 0.0])
    x[..., R:R + len(specials)] = specials.to(dtype)
    delta = torch.randint(-3000, 3000, (3, 1, 3, 7), generator=g)
    out = apply_rotary_delta(x, delta, inv_freq, layout)
    assert out.dtype == dtype and out.shape == (3, 3, 7, D)
    tail = x[..., R:].expand(3, 3, 7, D - R)
    assert torch.equal(out[..., R:].contiguous().view(torch.uint8), tail.contiguous().view(torch.uint8))
    assert torch.equal(out[..., :R], apply_rotary_delta(x[..., :R], delta, inv_freq, layout))
    assert not torch.isnan(out[..., :R]).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_partial_rotation_composes(dtype):
    """Rotating to p and then by d equals rotating to p + d, tails untouched, for a partial interleaved layout."""
    g = torch.Generator().manual_seed(13)
    layout = RotaryLayout.interleaved((11, 11, 10))
    inv_freq = inv_freq_for(64, 1e4)
    x = torch.randn(2, 9, 256, generator=g, dtype=dtype)
    p = torch.randint(0, 20000, (3, 9), generator=g)
    d = torch.randint(-5000, 5000, (3, 9), generator=g)
    two_steps = apply_rotary_delta(apply_rotary_delta(x, p, inv_freq, layout), d, inv_freq, layout)
    atol, rtol = TOL_ROT[dtype]
    assert_close_verbose(two_steps, apply_rotary_delta(x, p + d, inv_freq, layout), atol * 30, rtol * 30,
                         "R(d)R(p)x vs R(p+d)x, partial")
    assert torch.equal(two_steps[..., 64:], x[..., 64:])


def gemma4_rotary(head_dim: int) -> torch.nn.Module:
    """Gemma 4's rotary module from transformers' default Gemma4TextConfig, its full-attention layers at
    global_head_dim = `head_dim` (proportional RoPE, partial_rotary_factor 0.25, theta 1e6)."""
    return modeling_gemma4.Gemma4TextRotaryEmbedding(configuration_gemma4.Gemma4TextConfig(global_head_dim=head_dim))


@pytest.mark.parametrize("head_dim", [512, 256])
def test_proportional_inv_freq_is_gemma4s(head_dim):
    """The tests' proportional inv_freq [D/2] is the one Gemma 4's rotary module builds for its full-attention
    layers, bit for bit: int(0.25·D/2) non-zero frequencies, then exact zeros."""
    inv_freq = gemma4_rotary(head_dim).full_attention_inv_freq
    ours = proportional_inv_freq(head_dim)
    assert ours.shape == (head_dim // 2,) and ours.dtype == torch.float32
    assert torch.equal(ours, inv_freq)
    turning = head_dim // 8
    assert (ours[:turning] > 0).all() and torch.equal(ours[turning:], torch.zeros(head_dim // 2 - turning))


@pytest.mark.parametrize("head_dim", [512, 256])
def test_proportional_rotation_matches_transformers_gemma4(head_dim):
    """Gemma 4's RoPE of x at true positions (its module's cos/sin, its apply_rotary_pos_emb: rotate-half over all D
    channels) = ours from 0 as plain 1D RoPE with the module's own inv_freq (rotary=None, no layout of its own); the
    channels of the zero-frequency pairs come back bit for bit from both."""
    g = torch.Generator().manual_seed(14)
    rotary = gemma4_rotary(head_dim)
    x = torch.randn(1, 13, 2, head_dim, generator=g, dtype=torch.float64)  # [B, T, H, D], Gemma 4's own layout
    positions = torch.randint(0, 500, (13,), generator=g)
    cos, sin = rotary(x, positions[None], "full_attention")
    want = modeling_gemma4.apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim=2)
    ours = apply_rotary_delta(x.transpose(1, 2), positions, rotary.full_attention_inv_freq).transpose(1, 2)
    # the module's angles are fp32, ours fp64 (as in test_matches_transformers_mrope)
    assert_close_verbose(ours, want, 2e-4, 2e-4, "Gemma 4 proportional RoPE")
    frozen = frozen_channels(rotary.full_attention_inv_freq)
    assert int(frozen.sum()) == 2 * (head_dim // 2 - head_dim // 8)
    assert torch.equal(ours[..., frozen], x[..., frozen]) and torch.equal(want[..., frozen], x[..., frozen])


def test_layout_rotary_dim_and_partial_descriptions():
    """`pairs` is R/2, `rotary_dim` R; an explicit layout of fewer pairs than the head's is partial rotary, None
    and bare section counts always cover the head."""
    layout = RotaryLayout.interleaved((11, 11, 10))
    assert (layout.pairs, layout.rotary_dim) == (32, 64)
    assert RotaryLayout.of(layout, 128) is layout
    assert RotaryLayout.of(None, 128).rotary_dim == 256
    assert RotaryLayout.of([40, 44, 44], 128).rotary_dim == 256
    one_d = RotaryLayout.one_d(16)
    assert RotaryLayout.of(one_d, 64) is one_d and one_d.rotary_dim == 32


def test_check_rotary_wants_inv_freq_of_the_rotary_pairs():
    """check_rotary: inv_freq [R/2] = the layout's pairs, 2·pairs <= D; full rotary unless the layout is explicit."""
    layout = RotaryLayout.interleaved((2, 1, 1))
    assert check_rotary(inv_freq_for(8), layout, 32) is layout
    assert check_rotary(inv_freq_for(32), None, 32) == RotaryLayout.one_d(16)
    for inv_freq, rotary, D, error, match in (
            (inv_freq_for(32), layout, 32, ValueError, r"^inv_freq: expected \[R/2=4\]"),
            (inv_freq_for(8), None, 32, ValueError, r"^inv_freq: expected \[R/2=16\]"),
            (inv_freq_for(8), [2, 1, 1], 32, ValueError, "^rotary"),
            (inv_freq_for(8), layout, 6, ValueError, "^rotary: .* more than the head's D/2=3"),
            (inv_freq_for(8).to(torch.int64), layout, 32, TypeError, "^inv_freq")):
        with pytest.raises(error, match=match):
            check_rotary(inv_freq, rotary, D)


def test_rotations_refuse_widths_that_do_not_agree():
    """An explicit layout must cover inv_freq's R/2 pairs, and a head must hold the R rotary channels: errors name
    the argument."""
    delta = torch.zeros(3, 5, dtype=torch.int64)
    with pytest.raises(ValueError, match="^rotary: M-RoPE interleaved .* covers 4 frequency pairs, inv_freq has 8"):
        rotary_angles(delta, inv_freq_for(16), RotaryLayout.interleaved((2, 1, 1)))
    with pytest.raises(ValueError, match=r"^x: a head of D=8 channels cannot hold the R=16 rotary channels"):
        apply_rotary_delta(torch.zeros(5, 8), delta[0], inv_freq_for(16))

"""The oracle itself, checked against independent formulas and the properties docs/hermes.md §2 promises."""
import math

import pytest
import torch

from hermes_kernels import HermesConfig
from hermes_kernels.policies.hermes import reference as ref
from hermes_kernels.rope import apply_rotary_delta
from scaffolding.rotary import proportional_inv_freq
from tests.utils import INTERLEAVED, assert_close_verbose, distinct_attention, inv_freq_for, synthetic_positions

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def make_cache(L, B, Hkv, N, D, P, dtype=torch.float32, mrope=False, seed=0, start=0):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(L, B, Hkv, N, D, generator=g).to(dtype)
    values = torch.randn(L, B, Hkv, N, D, generator=g).to(dtype)
    positions = synthetic_positions(L, B, N, P, g, mrope=mrope, start=start)
    attn = distinct_attention(L, B, N - P, g)
    return keys, values, positions, attn


def config(L=4, budget=6, P=3, **kw):
    # L = 4 with default ratios: s = int(0.4) = 0, e = int(2.8) = 2 -> layers 0, 1 mid; 2, 3 deep
    return HermesConfig.qwen2_5_vl(L, budget, P, **kw)


def explicit_pooled(q, k, scale):
    """softmax(q k^T) with the full [B, H, Q, N] matrix, GQA by repeating KV heads, mean over H and Q."""
    B, H, Q, D = q.shape
    N = k.shape[2]
    k_full = k.double().repeat_interleave(H // k.shape[1], dim=1)
    logits = torch.einsum("bhqd,bhnd->bhqn", q.double(), k_full) * scale
    mask = torch.ones(Q, N, dtype=torch.bool).tril(diagonal=N - Q)
    return torch.softmax(logits.masked_fill(~mask, -math.inf), dim=-1).mean(dim=(1, 2))


@pytest.mark.parametrize("H, Hkv, Q, N", [(4, 4, 1, 9), (8, 2, 5, 17), (7, 1, 6, 6), (28, 4, 12, 40)])
def test_pooled_attention_equals_explicit_softmax(H, Hkv, Q, N):
    g = torch.Generator().manual_seed(H * N)
    q = torch.randn(2, H, Q, 16, generator=g)
    k = torch.randn(2, Hkv, N, 16, generator=g)
    out = ref.pooled_attention(q, k)
    assert out.dtype == torch.float32 and out.shape == (2, N)
    assert_close_verbose(out.double(), explicit_pooled(q, k, 0.25), 1e-6, 1e-5, "pooled attention")
    assert_close_verbose(out.sum(-1).double(), torch.ones(2, dtype=torch.float64), 1e-5, 0, "pooled total")
    stacked = ref.pooled_attention(torch.stack([q, q.flip(0)]), torch.stack([k, k.flip(0)]), scale=0.1)
    assert_close_verbose(stacked[1].double(), explicit_pooled(q.flip(0), k.flip(0), 0.1), 1e-6, 1e-5, "stacked")


def test_pooled_attention_float64_stays_float64():
    q, k = torch.randn(1, 2, 3, 8, dtype=torch.float64), torch.randn(1, 2, 10, 8, dtype=torch.float64)
    out = ref.pooled_attention(q, k)
    assert out.dtype == torch.float64
    assert_close_verbose(out, explicit_pooled(q, k, 8 ** -0.5), 1e-12, 1e-12, "fp64 pooled attention")


def min_max(x, eps=1e-6):
    return (x - x.min()) / (x.max() - x.min() + eps)


def test_scores_deepest_layer_is_normalised_attention_unsmoothed():
    cfg = config()
    attn = distinct_attention(4, 2, 11, torch.Generator().manual_seed(3))
    scores = ref.hermes_scores(attn, cfg)
    for b in range(2):
        assert_close_verbose(scores[3, b], min_max(attn[3, b]), 1e-6, 1e-6, "deepest layer")


def test_scores_mid_layer_formula():
    cfg = config(L=10)  # s = 1, e = 7: layer 3 is mid with p = 2/6
    attn = distinct_attention(10, 1, 15, torch.Generator().manual_seed(4))
    scores = ref.hermes_scores(attn, cfg)
    p = 2 / 6
    omega, k = 0.75 - 0.6 * p, 20 - 12 * p

    def raw(layer):
        return (1 - cfg.omega[layer].item()) * min_max(attn[layer, 0]) + cfg.omega[layer].item() * \
            min_max(torch.exp(-cfg.forget[layer].item() * (14 - torch.arange(15.0)) / 14))
    assert cfg.omega[3].item() == pytest.approx(omega) and cfg.forget[3].item() == pytest.approx(k, abs=1e-5)
    expected_s4 = scores[4, 0]  # cascade: layer 3 blends the already smoothed layer 4
    assert_close_verbose(scores[3, 0], 0.7 * raw(3) + 0.3 * expected_s4, 1e-6, 1e-6, "mid-layer S~")


def test_shallow_layers_ignore_attention():
    cfg = HermesConfig.llava_ov(10, 6, 2)  # layer 0 shallow (ω = 1)
    g = torch.Generator().manual_seed(5)
    attn = distinct_attention(10, 1, 12, g)
    other = attn.clone()
    other[0] = distinct_attention(1, 1, 12, g)[0]
    assert not torch.equal(attn[0], other[0])
    assert torch.equal(ref.hermes_scores(attn, cfg)[0], ref.hermes_scores(other, cfg)[0])


@pytest.mark.parametrize("cascade", [True, False])
def test_cascade_reads_smoothed_or_raw_deeper_layer(cascade):
    cfg = config(L=5, cascade=cascade)
    g = torch.Generator().manual_seed(6)
    attn = distinct_attention(5, 1, 12, g)
    changed = attn.clone()
    changed[3] = distinct_attention(1, 1, 12, g)[0]  # alters S[3], hence S~[2] and (with cascade) S~[1]
    before, after = ref.hermes_scores(attn, cfg), ref.hermes_scores(changed, cfg)
    assert not torch.allclose(before[2], after[2])
    assert torch.allclose(before[1], after[1]) == (not cascade)


def test_select_keep_top_in_cache_order_with_deep_budget():
    cfg = config(budget=4)
    scores = torch.tensor([[[0.1, 0.9, 0.3, 0.8, 0.7, 0.2]]]).expand(4, 1, 6).contiguous()
    keep = ref.select_keep(scores, cfg)
    assert keep[0, 0].tolist() == [1, 2, 3, 4]  # mid layers keep 4, in cache order
    assert keep[3, 0].tolist() == [1, 3, 4, -1]  # deep layers keep budget-1, padded
    ties = torch.tensor([[[0.5, 0.7, 0.5, 0.5, 0.7, 0.1]]]).expand(4, 1, 6).contiguous()
    assert ref.select_keep(ties, cfg)[3, 0].tolist() == [0, 1, 4, -1]  # tie at 0.5 goes to the lowest index


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("P", [0, 3])
@pytest.mark.parametrize("D", [16, 512], ids=["D16", "D512-proportional"])
def test_summary_is_mean_of_pruned_rotated_to_target(dtype, P, D):
    """D 512: Gemma 4's full-attention layers, proportional RoPE (1D over every pair, most at frequency 0)."""
    L, B, Hkv, N, budget = 4, 2, 2, P + 11, 6
    cfg = config(budget=budget, P=P, reindex="eager")
    keys, values, positions, attn = make_cache(L, B, Hkv, N, D, P, dtype, seed=7)
    k0, v0, p0 = keys.clone(), values.clone(), positions.clone()
    inv_freq = proportional_inv_freq(D) if D == 512 else inv_freq_for(D)
    result = ref.compress_step(keys, values, positions, attn, cfg, inv_freq)
    assert result.length == P + budget and bool(result.reindexed)
    work = torch.float64 if dtype == torch.float64 else torch.float32
    for b in range(B):
        # deepest layer is unsmoothed attention-only: it keeps the top budget-1 attention scores
        kept = attn[3, b].argsort(descending=True)[:budget - 1].sort().values
        assert result.keep[3, b, :budget - 1].tolist() == kept.tolist()
        pruned = torch.tensor([j for j in range(N - P) if j not in kept.tolist()])
        target = P + budget - 1
        assert positions[3, b, :P + budget].tolist() == list(range(P + budget))
        rotated = apply_rotary_delta(k0[3, b][:, P + pruned].to(work), target - p0[3, b, P + pruned], inv_freq)
        tol = dict(atol=None, rtol=None) if dtype != torch.float32 else dict(atol=1e-5, rtol=1e-5)
        assert_close_verbose(keys[3, b, :, P + budget - 1], rotated.mean(1).to(dtype), **tol, name="summary key")
        assert_close_verbose(values[3, b, :, P + budget - 1], v0[3, b][:, P + pruned].to(work).mean(1).to(dtype),
                             **tol, name="summary value")
        assert torch.equal(keys[3, b, :, :P], k0[3, b, :, :P]) and torch.equal(positions[3, b, :P], p0[3, b, :P])


def test_single_pruned_token_summary_is_that_token_moved():
    P, budget, D = 2, 6, 16
    cfg = config(budget=budget, P=P)  # lazy, far below the threshold: positions are kept
    keys, values, positions, attn = make_cache(4, 1, 3, P + budget, D, P, seed=8)
    k0, v0, p0 = keys.clone(), values.clone(), positions.clone()
    inv_freq = inv_freq_for(D)
    result = ref.compress_step(keys, values, positions, attn, cfg, inv_freq)
    assert not bool(result.reindexed) and result.length == P + budget
    for layer in (2, 3):
        kept = result.keep[layer, 0, :budget - 1]
        (dropped,) = [j for j in range(budget) if j not in kept.tolist()]
        target = p0[layer, 0, P + kept[-1]] + 1
        moved = apply_rotary_delta(k0[layer, 0, :, P + dropped:P + dropped + 1], target - p0[layer, 0, P + dropped],
                                   inv_freq)
        assert_close_verbose(keys[layer, 0, :, P + budget - 1], moved[:, 0], 1e-6, 1e-6, "one-token summary key")
        assert torch.equal(values[layer, 0, :, P + budget - 1], v0[layer, 0, :, P + dropped])
        assert positions[layer, 0, P + budget - 1] == target
        assert torch.equal(keys[layer, 0, :, P:P + budget - 1], k0[layer, 0][:, P + kept])  # delta 0: untouched
    for layer in (0, 1):
        assert result.keep[layer, 0].tolist() == list(range(budget))
        assert torch.equal(keys[layer, 0, :, :P + budget], k0[layer, 0, :, :P + budget])


@pytest.mark.parametrize("V", [1, 4, 5])
def test_nothing_pruned_below_budget(V):
    P, budget = 3, 6
    cfg = config(budget=budget, P=P)
    keys, values, positions, attn = make_cache(4, 2, 2, P + V, 16, P, seed=9)
    k0, v0, p0 = keys.clone(), values.clone(), positions.clone()
    result = ref.compress_step(keys, values, positions, attn, cfg, inv_freq_for(16))
    assert result.length == P + V
    assert result.keep.shape == (4, 2, V) and torch.equal(result.keep, torch.arange(V).expand(4, 2, V))
    assert torch.equal(keys, k0) and torch.equal(values, v0) and torch.equal(positions, p0)


def test_eager_positions_are_contiguous_in_every_layer():
    P, budget = 4, 5
    cfg = config(L=6, budget=budget, P=P, reindex="eager")
    keys, values, positions, attn = make_cache(6, 3, 1, P + 13, 8, P, seed=10, start=500)
    result = ref.compress_step(keys, values, positions, attn, cfg, inv_freq_for(8))
    assert result.length == P + budget
    for layer in range(6):  # deep layers: n = budget-1 kept + the summary at P + n; others: n = budget kept
        assert positions[layer, :, :P + budget].tolist() == [list(range(P + budget))] * 3


def test_lazy_keeps_positions_until_threshold_then_compacts():
    P, budget, N, D = 2, 5, 14, 8
    max_positions, margin = 4096, 1024
    below = config(budget=budget, P=P, max_positions=max_positions, margin=margin)
    keys, values, positions, attn = make_cache(4, 1, 1, N, D, P, seed=11, start=3000 - P)
    assert positions.max() <= max_positions - margin
    p0 = positions.clone()
    result = ref.compress_step(keys, values, positions, attn, below, inv_freq_for(D))
    assert not bool(result.reindexed)
    for layer in range(4):
        n = int((result.keep[layer, 0] >= 0).sum())
        assert positions[layer, 0, P:P + n].tolist() == p0[layer, 0, P + result.keep[layer, 0, :n]].tolist()
    keys, values, positions, attn = make_cache(4, 1, 1, N, D, P, seed=11, start=3100 - P)
    assert positions.max() > max_positions - margin
    result = ref.compress_step(keys, values, positions, attn, below, inv_freq_for(D))
    assert bool(result.reindexed)
    assert positions[:, 0, :P + budget].tolist() == [list(range(P + budget))] * 4


def test_mrope_compaction_ranks_each_axis():
    P, budget, D, section = 3, 6, 16, [2, 3, 3]
    cfg = config(budget=budget, P=P, reindex="eager")
    keys, values, positions, attn = make_cache(4, 2, 1, P + 15, D, P, mrope=True, seed=12, start=100)
    p0 = positions.clone()
    result = ref.compress_step(keys, values, positions, attn, cfg, inv_freq_for(D), section)
    for layer in range(4):
        for b in range(2):
            kept = result.keep[layer, b][result.keep[layer, b] >= 0]
            n = kept.numel()
            for axis in range(3):
                old = p0[layer, b, axis, P + kept].tolist()
                distinct = sorted(set(old))
                assert positions[layer, b, axis, P:P + n].tolist() == [P + distinct.index(v) for v in old]
            assert torch.equal(positions[layer, b, :, :P], p0[layer, b, :, :P])
            if n < budget:  # deep layer: summary at max retained coordinate + 1 on all three axes
                top = positions[layer, b, :, :P + n].max().item()
                assert positions[layer, b, :, P + n].tolist() == [top + 1] * 3


@pytest.mark.parametrize("section, axis", [
    ([2, 3, 3], [0, 0, 1, 1, 1, 2, 2, 2]),  # contiguous: pairs 0-1 follow t, 2-4 h, 5-7 w
    (INTERLEAVED[16], [0, 1, 2, 0, 1, 2, 0, 0]),  # interleaved (4, 2, 2): t, h, w, t, h, w, then t
], ids=["sections", "interleaved"])
def test_mrope_kept_keys_rotate_per_axis_section(section, axis):
    P, budget, D = 2, 5, 16
    cfg = config(budget=budget, P=P, reindex="eager", summary=False)
    keys, values, positions, attn = make_cache(4, 1, 2, P + 9, D, P, mrope=True, seed=13, start=40)
    k0, p0 = keys.clone(), positions.clone()
    inv_freq = inv_freq_for(D)
    result = ref.compress_step(keys, values, positions, attn, cfg, inv_freq, section)
    kept = result.keep[1, 0]
    # independent per-pair rotation, each pair by the delta of the axis written out above
    delta = positions[1, 0, :, P:P + budget] - p0[1, 0, :, P + kept]
    axis = torch.tensor(axis)
    angle = delta.T[:, axis].double() * inv_freq.double()
    x = k0[1, 0][:, P + kept].double()
    x1, x2 = x[..., :8], x[..., 8:]
    expected = torch.cat([x1 * angle.cos() - x2 * angle.sin(), x2 * angle.cos() + x1 * angle.sin()], -1)
    assert_close_verbose(keys[1, 0, :, P:P + budget].double(), expected, 1e-5, 1e-5, "M-RoPE kept keys")


@pytest.mark.parametrize("dtype", DTYPES)
def test_in_place_dtype_and_equal_lengths(dtype):
    P, budget = 3, 5
    cfg = config(budget=budget, P=P, reindex="eager")
    keys, values, positions, attn = make_cache(4, 2, 2, P + 12, 16, P, dtype, seed=14)
    ptrs = (keys.data_ptr(), values.data_ptr(), positions.data_ptr())
    result = ref.compress_step(keys, values, positions, attn, cfg, inv_freq_for(16))
    assert (keys.data_ptr(), values.data_ptr(), positions.data_ptr()) == ptrs and keys.dtype == dtype
    assert result.scores.dtype == torch.float32 and result.scores.shape == (4, 2, 12)
    valid = (result.keep >= 0).sum(-1) + torch.tensor([0, 0, 1, 1])[:, None]  # + summary in deep layers
    assert torch.all(valid == budget) and result.length == P + budget


def bad_calls():
    """(description, mutate(args) -> args, error type, message fragment)."""
    def with_(**changes):
        return lambda a: a | changes
    return [
        ("keys rank", lambda a: a | dict(keys=a["keys"][0]), ValueError, "keys"),
        ("values shape", lambda a: a | dict(values=a["values"][:, :, :, :-1]), ValueError, "values"),
        ("values dtype", lambda a: a | dict(values=a["values"].half()), TypeError, "values"),
        ("keys dtype", lambda a: a | dict(keys=a["keys"].int(), values=a["values"].int()), TypeError, "keys"),
        ("positions dtype", lambda a: a | dict(positions=a["positions"].int()), TypeError, "positions"),
        ("positions shape", lambda a: a | dict(positions=a["positions"][..., :-1]), ValueError, "positions"),
        ("positions device", lambda a: a | dict(positions=a["positions"].to("meta")), ValueError, "positions"),
        ("attn length", lambda a: a | dict(attn=a["attn"][..., :-1]), ValueError, "attn"),
        ("attn streams", lambda a: a | dict(attn=a["attn"][:, :1]), ValueError, "attn"),
        ("attn dtype", lambda a: a | dict(attn=a["attn"].half()), TypeError, "attn"),
        ("attn layers", lambda a: a | dict(attn=a["attn"][:-1]), ValueError, "attn"),
        ("inv_freq length", lambda a: a | dict(inv_freq=a["inv_freq"][:-1]), ValueError, "inv_freq"),
        ("1D positions with mrope", with_(rotary=[1, 3, 4]), ValueError, "positions"),
        ("mrope sum", lambda a: a | dict(positions=torch.zeros(4, 2, 3, 12, dtype=torch.int64),
                                         rotary=[1, 1, 1]), ValueError, "rotary"),
        ("1D positions with interleaved", with_(rotary=INTERLEAVED[16]), ValueError, "positions"),
        ("interleaved pairs", lambda a: a | dict(positions=torch.zeros(4, 2, 3, 12, dtype=torch.int64),
                                                 rotary=INTERLEAVED[128]), ValueError, "rotary"),
        ("rotary type", with_(rotary=4), TypeError, "rotary"),
        ("cfg type", with_(cfg={"budget": 4}), TypeError, "cfg"),
        ("layers vs cfg", lambda a: a | dict(cfg=config(L=5, budget=5, P=3)), ValueError, "keys"),
        ("no visual tokens", lambda a: a | dict(cfg=config(budget=5, P=12)), ValueError, "keys"),
    ]


@pytest.mark.parametrize("desc, mutate, error, fragment", bad_calls(), ids=[c[0] for c in bad_calls()])
def test_bad_inputs_raise_before_writing(desc, mutate, error, fragment):
    keys, values, positions, attn = make_cache(4, 2, 2, 12, 16, 3, seed=15)
    args = dict(keys=keys, values=values, positions=positions, attn=attn, cfg=config(budget=5, P=3),
                inv_freq=inv_freq_for(16), rotary=None)
    args = mutate(args)
    snapshot = [t.clone() for t in (keys, values, positions, attn)]
    with pytest.raises(error, match=fragment):
        ref.compress_step(**args)
    for before, after in zip(snapshot, (keys, values, positions, attn)):
        assert torch.equal(before, after)


def test_non_finite_attention_names_the_layer():
    keys, values, positions, attn = make_cache(4, 2, 2, 12, 16, 3, seed=16)
    attn[2, 1, 4] = float("nan")
    attn[3, 0, 0] = float("inf")
    snapshot = keys.clone()
    with pytest.raises(ValueError, match=r"attn: non-finite values in layer\(s\) \[2, 3\]"):
        ref.compress_step(keys, values, positions, attn, config(budget=5, P=3), inv_freq_for(16))
    assert torch.equal(snapshot, keys)


def split_compact(keys, values, positions, keep, cfg, inv_freq, section, splits, flag):
    """ref.compact stack by stack over the layer ranges `splits`, all with the same re-index flag."""
    lengths = set()
    for layers in splits:
        part = slice(layers.start, layers.stop)
        length, used = ref.compact(keys[part], values[part], positions[part], keep[part], cfg, inv_freq, section,
                                   layers=layers, reindexed=flag)
        assert used is flag
        lengths.add(length)
    assert len(lengths) == 1
    return lengths.pop()


@pytest.mark.parametrize("mrope", [False, True], ids=["1d", "mrope"])
@pytest.mark.parametrize("reindex, last_layer_shift", [("lazy", 0), ("lazy", 2000), ("eager", 0)])
@pytest.mark.parametrize("splits", [[range(0, 1), range(1, 3), range(3, 5)], [range(0, 4), range(4, 5)]],
                         ids=["1-2-2", "4-1"])
def test_layer_subsets_with_a_shared_flag_equal_the_whole_cache(splits, reindex, last_layer_shift, mrope):
    """Compacting consecutive layer ranges separately (roles and budgets of their own layers, one flag decided
    for the whole cache) gives exactly the whole-cache compaction. A shift of the last layer's positions past the
    lazy threshold makes the whole cache re-index although the other ranges alone would not."""
    P, D, section = 3, 16, [2, 3, 3] if mrope else None
    cfg = config(L=5, budget=6, P=P, reindex=reindex, max_positions=1000, margin=64)  # mid 0-2, deep 3-4
    keys, values, positions, attn = make_cache(5, 2, 2, P + 14, D, P, mrope=mrope, seed=17)
    positions[-1, ..., P:] += last_layer_shift
    keep = ref.select_keep(ref.hermes_scores(attn, cfg), cfg)
    inv_freq = inv_freq_for(D)
    whole = [t.clone() for t in (keys, values, positions)]
    length, flag = ref.compact(*whole, keep, cfg, inv_freq, section)
    assert bool(flag) == (reindex == "eager" or last_layer_shift > 0)
    if last_layer_shift:
        assert not ref.decide_reindex(positions[:-1], cfg), "the other layers alone must stay below the threshold"
    assert split_compact(keys, values, positions, keep, cfg, inv_freq, section, splits, flag) == length
    for name, got, expected in zip(("keys", "values", "positions"), (keys, values, positions), whole):
        assert torch.equal(got, expected), f"{name} of the split compaction differ from the whole cache's"


@pytest.mark.parametrize("mrope", [False, True], ids=["1d", "mrope"])
@pytest.mark.parametrize("reindex, flag", [("lazy", True), ("eager", False)])
def test_explicit_flag_wins_over_the_config(reindex, flag, mrope):
    """A caller's flag decides re-indexing whatever cfg.reindex says: lazy below the threshold with True
    compacts as eager does; eager with False keeps positions as lazy below the threshold does."""
    P, D, section = 3, 16, [2, 3, 3] if mrope else None
    cfg = config(budget=6, P=P, reindex=reindex)
    keys, values, positions, attn = make_cache(4, 2, 2, P + 14, D, P, mrope=mrope, seed=18, start=40)
    keep = ref.select_keep(ref.hermes_scores(attn, cfg), cfg)
    inv_freq = inv_freq_for(D)
    deciding = cfg.replace(reindex="eager" if flag else "lazy")  # positions stay far below max_positions
    expected = [t.clone() for t in (keys, values, positions)]
    _, expected_flag = ref.compact(*expected, keep, deciding, inv_freq, section)
    assert bool(expected_flag) == flag
    given = torch.tensor(flag)
    ref.compact(keys, values, positions, keep, cfg, inv_freq, section, reindexed=given)
    for name, got, want in zip(("keys", "values", "positions"), (keys, values, positions), expected):
        assert torch.equal(got, want), f"{name} do not follow the explicit flag"


def bad_compact_calls():
    """(description, keyword changes, error type, message fragment) for ref.compact's layers/compacted_flag."""
    return [
        ("layers list", dict(layers=[0, 1, 2, 3]), TypeError, "layers"),
        ("layers step", dict(layers=range(0, 4, 2)), ValueError, "layers"),
        ("layers empty", dict(layers=range(2, 2)), ValueError, "layers"),
        ("layers negative", dict(layers=range(-1, 3)), ValueError, "layers"),
        ("layers past L", dict(layers=range(1, 5)), ValueError, "layers"),
        ("layers vs keys", dict(layers=range(0, 3)), ValueError, "keys"),
        ("flag bool", dict(reindexed=True), TypeError, "reindexed"),
        ("flag dtype", dict(reindexed=torch.tensor(1)), TypeError, "reindexed"),
        ("flag shape", dict(reindexed=torch.tensor([True])), ValueError, "reindexed"),
        ("flag device", dict(reindexed=torch.tensor(True, device="meta")), ValueError, "reindexed"),
    ]


@pytest.mark.parametrize("desc, changes, error, fragment", bad_compact_calls(),
                         ids=[c[0] for c in bad_compact_calls()])
def test_bad_layers_or_flag_raise_before_writing(desc, changes, error, fragment):
    keys, values, positions, attn = make_cache(4, 2, 2, 12, 16, 3, seed=19)
    cfg = config(budget=5, P=3)
    keep = ref.select_keep(ref.hermes_scores(attn, cfg), cfg)
    snapshot = [t.clone() for t in (keys, values, positions)]
    with pytest.raises(error, match=fragment):
        ref.compact(keys, values, positions, keep, cfg, inv_freq_for(16), **changes)
    for before, after in zip(snapshot, (keys, values, positions)):
        assert torch.equal(before, after)


@pytest.mark.parametrize("q_shape, k_shape", [((1, 0, 2, 8), (1, 1, 5, 8)), ((0, 2, 2, 8), (0, 1, 5, 8)),
                                              ((1, 2, 2, 0), (1, 1, 5, 0)), ((1, 2, 2, 8), (1, 0, 5, 8))])
def test_pooled_attention_rejects_empty_dimensions(q_shape, k_shape):
    with pytest.raises(ValueError, match="q, k: every dimension"):
        ref.pooled_attention(torch.randn(q_shape), torch.randn(k_shape))

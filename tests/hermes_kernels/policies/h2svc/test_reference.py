"""hermes_kernels.policies.h2svc.reference against hand-computed answers and independent brute force (docs/h2svc.md
§2–4).

Routing (§2): TAD values on synthetic attention maps, GQA averaging, min-max normalisation, class counts and
ties. STCE (§3): curvature by hand, straight line with a sharp turn, zero velocity, endpoints, ties, chunk =
single arrivals, O(1) update = recompute from scratch. FIFO, the slot plan and the right-aligned re-index (§4)
with keys checked against transformers' own RoPE (Gemma 4's proportional RoPE at D 512 included). Bad inputs raise
before anything is written.
"""
import dataclasses
import math
import zlib

import pytest
import torch
from transformers.models.gemma4 import modeling_gemma4

from hermes_kernels.policies.h2svc.config import EPISODIC, INSTANT, SHORT, H2SVCConfig, default_head_map
from hermes_kernels import StreamClock
from hermes_kernels.policies.h2svc import reference as ref
from hermes_kernels.rope import RotaryLayout
from tests.hermes_kernels.test_rope import gemma4_rotary, hf_rotate, hf_rotate_mrope
from tests.utils import INTERLEAVED, assert_close_verbose, frozen_channels, inv_freq_for, same_bytes

CACHE_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


# ---------------------------------------------------------------------------------------------------------------
# §2 routing
# ---------------------------------------------------------------------------------------------------------------

def layout(P: int, n: int, T_f: int, Q: int) -> tuple[torch.Tensor, torch.Tensor]:
    """frame_of_token [S] for prefix, n frames of T_f tokens, Q text tokens; and the text token indices."""
    frame_of_token = torch.tensor([-1] * P + [f for f in range(n) for _ in range(T_f)] + [-1] * Q)
    return frame_of_token, torch.arange(P + n * T_f, P + n * T_f + Q)


def attention_row(frame_of_token: torch.Tensor, masses: dict, g: torch.Generator) -> torch.Tensor:
    """One probability row [S] float64: mass m of {frame j: m} spread at random over frame j's tokens; what is
    left spread at random over the non-frame tokens (prefix / text), so only per-frame sums are fixed."""
    row = torch.zeros(frame_of_token.numel(), dtype=torch.float64)
    rest = 1.0 - sum(masses.values())
    for j, m in list(masses.items()) + [(-1, rest)]:
        idx = (frame_of_token == j).nonzero().flatten()
        share = torch.rand(idx.numel(), generator=g, dtype=torch.float64) + 0.1
        row[idx] = m * share / share.sum()
    return row


def attention_map(L, H, frame_of_token, pattern, g) -> torch.Tensor:
    """probs [L, H, S, S]: row q of (layer, head) follows pattern(layer, head, q) -> {frame: mass} (or None for a
    random row: rows that no TAD reads)."""
    S = frame_of_token.numel()
    probs = torch.empty(L, H, S, S, dtype=torch.float64)
    for layer in range(L):
        for head in range(H):
            for q in range(S):
                masses = pattern(layer, head, q)
                probs[layer, head, q] = (torch.softmax(torch.randn(S, generator=g, dtype=torch.float64), 0)
                                         if masses is None else attention_row(frame_of_token, masses, g))
    return probs


@pytest.mark.parametrize("P, n, T_f", [(0, 1, 1), (2, 3, 1), (1, 4, 3), (3, 5, 2)])
def test_tad_v2v_by_hand(P, n, T_f):
    g = torch.Generator().manual_seed(P * 100 + n * 10 + T_f)
    fot, _ = layout(P, n, T_f, 2)
    tokens_of = [(fot == f).nonzero().flatten().tolist() for f in range(n)]

    def own(layer, head, q):
        return {int(fot[q]): 1.0} if fot[q] >= 0 else None

    def first(layer, head, q):
        return {0: 1.0} if fot[q] >= 0 else None

    def half_previous(layer, head, q):  # 0.5 own frame, 0.5 the previous one (frame 0: all on itself)
        i = int(fot[q])
        return None if i < 0 else ({0: 1.0} if i == 0 else {i: 0.5, i - 1: 0.5})

    def first_token_looks_back(layer, head, q):  # frame i: its first token all on frame 0, the others on i
        i = int(fot[q])
        return None if i < 0 else ({0: 1.0} if q == tokens_of[i][0] else {i: 1.0})

    def with_prefix(layer, head, q):  # 0.3 on prefix/text tokens counts at distance 0 (not a frame)
        return {0: 0.7} if fot[q] >= 0 else None

    expected = {own: 0.0, first: (n - 1) / 2, half_previous: (n - 1) / (2 * n),
                first_token_looks_back: (n - 1) / (2 * T_f), with_prefix: 0.7 * (n - 1) / 2}
    for pattern, value in expected.items():
        probs = attention_map(1, 1, fot, pattern, g)
        got = ref.tad_v2v(probs, fot, 1)
        assert got.dtype == torch.float64 and got.shape == (1, 1)
        assert got.item() == pytest.approx(value, abs=1e-12), pattern.__name__


@pytest.mark.parametrize("n", [1, 2, 5])
def test_tad_t2v_by_hand(n):
    g = torch.Generator().manual_seed(n)
    fot, text = layout(2, n, 2, 4)
    text_set = set(text.tolist())
    cases = {
        "all on frame 0": (lambda q: {0: 1.0}, n - 1),
        "all on newest": (lambda q: {n - 1: 1.0}, 0.0),
        "half text on 0, half on newest": (lambda q: {0: 1.0} if q % 2 else {n - 1: 1.0}, (n - 1) / 2),
        "0.4 on frame 0, 0.6 on question": (lambda q: {0: 0.4}, 0.4 * (n - 1)),
    }
    for name, (masses, value) in cases.items():
        probs = attention_map(1, 1, fot, lambda layer, head, q: masses(q) if q in text_set else None, g)
        assert ref.tad_t2v(probs, fot, text, 1).item() == pytest.approx(value, abs=1e-12), name
    # only the given text queries count: the last two text tokens put all mass on frame 0
    probs = attention_map(1, 1, fot, lambda layer, head, q: ({0: 1.0} if q >= text[2] else {n - 1: 1.0})
                          if q in text_set else None, g)
    assert ref.tad_t2v(probs, fot, text[:2], 1).item() == pytest.approx(0.0, abs=1e-12)
    assert ref.tad_t2v(probs, fot, text[2:], 1).item() == pytest.approx(n - 1, abs=1e-12)


def test_tad_gqa_groups_average_their_query_heads():
    """H = 4 query heads on Hkv = 2: heads 0, 1 are KV head 0, heads 2, 3 KV head 1; layer 1 swaps the roles."""
    g = torch.Generator().manual_seed(11)
    n = 4
    fot, text = layout(1, n, 2, 2)
    looks_back = {(0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (1, 2)}  # (layer, query head) attending to frame 0

    def pattern(layer, head, q):
        if fot[q] < 0 and q not in text.tolist():
            return None
        if (layer, head) in looks_back:
            return {0: 1.0}
        return {int(fot[q]): 1.0} if fot[q] >= 0 else {n - 1: 1.0}

    probs = attention_map(2, 4, fot, pattern, g)
    v2v, t2v = ref.tad_v2v(probs, fot, 2), ref.tad_t2v(probs, fot, text, 2)
    half = (n - 1) / 2  # V2V of a head looking at frame 0
    expected_v2v = torch.tensor([[half / 2, half], [half, half / 2]], dtype=torch.float64)
    expected_t2v = torch.tensor([[(n - 1) / 2, n - 1], [n - 1, (n - 1) / 2]], dtype=torch.float64)
    assert_close_verbose(v2v, expected_v2v, 1e-12, 0, "TAD_V2V")
    assert_close_verbose(t2v, expected_t2v, 1e-12, 0, "TAD_T2V")
    # one KV head per query head: no averaging
    assert ref.tad_v2v(probs, fot, 4)[0].tolist() == pytest.approx([0, half, half, half], abs=1e-12)


def test_head_scores_min_max():
    v2v = torch.tensor([[0.0, 2.0], [4.0, 1.0]], dtype=torch.float64)
    t2v = torch.full((2, 2), 3.0, dtype=torch.float64)  # max = min: normalises to 0
    assert ref.head_scores(v2v, t2v).tolist() == [[0.0, 0.25], [0.5, 0.125]]
    t2v = torch.tensor([[10.0, 30.0], [20.0, 10.0]], dtype=torch.float64)
    assert_close_verbose(ref.head_scores(v2v, t2v), torch.tensor([[0.0, 0.75], [0.75, 0.125]], dtype=torch.float64),
                         1e-15, 0, "S")
    assert ref.head_scores(v2v.float(), t2v.float()).dtype == torch.float64


@pytest.mark.parametrize("L, Hkv, counts", [
    (1, 1, (0, 1, 0)), (1, 5, (1, 2, 2)), (7, 1, (1, 3, 3)), (3, 5, (2, 6, 7)), (5, 5, (3, 10, 12)),
    (28, 4, (11, 45, 56)),
])
def test_classify_counts_and_order(L, Hkv, counts):
    g = torch.Generator().manual_seed(L * 7 + Hkv)
    scores = torch.rand(L, Hkv, generator=g, dtype=torch.float64)
    classes = ref.classify_heads(scores)
    assert classes.dtype == torch.int64 and classes.shape == (L, Hkv)
    assert tuple(int((classes == c).sum()) for c in (INSTANT, SHORT, EPISODIC)) == counts
    by_class = [scores[classes == c] for c in (INSTANT, SHORT, EPISODIC)]
    for lower, upper in zip(by_class, by_class[1:]):
        if lower.numel() and upper.numel():
            assert lower.max() < upper.min()


def test_classify_ties_by_layer_then_head():
    assert ref.classify_heads(torch.zeros(3, 3)).tolist() == [[0, 1, 1], [1, 1, 2], [2, 2, 2]]
    assert torch.equal(ref.classify_heads(torch.zeros(6, 4)), default_head_map(6, 4))
    # two tied groups: 0.5 (4 heads) below 0.9 (5 heads); n_i = 1, n_s = 4, episodic 4
    scores = torch.tensor([[0.9, 0.5, 0.9], [0.5, 0.9, 0.9], [0.5, 0.9, 0.5]])
    assert ref.classify_heads(scores).tolist() == [[1, 0, 2], [1, 2, 2], [1, 2, 1]]
    # ratios other than the defaults: n_i = floor(2.25 + 0.5) = 2, n_s = floor(6.75 + 0.5) - 2 = 5
    ranks = torch.arange(9, dtype=torch.float32).flip(0).view(3, 3)
    assert ref.classify_heads(ranks, 0.25, 0.5).tolist() == [[2, 2, 1], [1, 1, 1], [1, 0, 0]]


# ---------------------------------------------------------------------------------------------------------------
# §3 frame features and STCE
# ---------------------------------------------------------------------------------------------------------------

def test_frame_features_mean_per_frame():
    T_f, F, D = 3, 4, 5
    values = torch.arange(F * T_f, dtype=torch.float32)[:, None].expand(F * T_f, D) + torch.arange(D) * 100
    feats = ref.frame_features(values.expand(2, 3, F * T_f, D), T_f)
    assert feats.dtype == torch.float32 and feats.shape == (2, 3, F, D)
    expected = (torch.arange(F, dtype=torch.float32) * T_f + 1)[:, None] + torch.arange(D) * 100
    assert torch.equal(feats[1, 2], expected)
    assert ref.frame_features(values.double()[None, None], T_f).dtype == torch.float64


def test_frame_features_accumulate_in_float32():
    # bf16: 1 + 2^-8 rounds back to 1, so a bf16 accumulation would give 1/3; float32 gives (1 + 2^-7)/3
    values = torch.tensor([1.0, 2.0 ** -8, 2.0 ** -8], dtype=torch.bfloat16)[:, None].reshape(1, 1, 3, 1)
    assert ref.frame_features(values, 3).item() == pytest.approx((1 + 2.0 ** -7) / 3, abs=1e-9)


def curvature_brute(prev, j, nxt, t_prev, t_next) -> float:
    """I(j) of docs/h2svc.md §3 in float64, written independently of the reference."""
    v_in, v_out = (j - prev).double(), (nxt - j).double()
    a, b = v_in.norm().item(), v_out.norm().item()
    cos = 0.0 if a * b == 0 else (v_in @ v_out).item() / (a * b)
    return (1 - cos) * min(a, b) * math.log(t_next - t_prev)


def test_curvature_by_hand():
    e1, e2 = torch.eye(2)
    z = torch.zeros(2)
    cases = [  # (V_p, V_j, V_n, t_p, t_n, I)
        (z, e1, e1 + e2, 0, 2, math.log(2)),                      # right angle: cos 0, min 1
        (z, e1, z, 3, 5, 2 * math.log(2)),                        # reversal: cos -1
        (z, 2 * e1, 2 * e1 + 3 * e2, 0, 9, 2 * math.log(9)),      # min(2, 3) and the span 9
        (z, e1, e1 + 4 * torch.tensor([0.5, 3 ** 0.5 / 2]), 10, 13, 0.5 * math.log(3)),  # 60°: 1 - 0.5
        (z, e1, 2 * e1, 0, 2, 0.0),                               # straight: cos 1
    ]
    for p, j, n, tp, tn, value in cases:
        scores = ref.stce_scores(torch.stack([p, j, n]), torch.tensor([tp, (tp + tn) // 2, tn]))
        assert scores[0] == math.inf and scores[2] == math.inf
        assert scores[1].item() == pytest.approx(value, abs=1e-6)


def test_zero_velocity_scores_zero():
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(2, 16, generator=g)
    for feats in ([a, a, b], [a, b, b], [a, a, a]):
        scores = ref.stce_scores(torch.stack(feats), torch.tensor([0, 4, 7]))
        assert scores[1].item() == 0.0  # exactly 0, never NaN


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n, D", [(1, 4), (2, 8), (7, 16), (13, 64)])
def test_stce_scores_match_brute_force(n, D, dtype):
    g = torch.Generator().manual_seed(n * D)
    feats = torch.randn(n, D, generator=g, dtype=dtype)
    times = torch.randint(1, 5, (n,), generator=g).cumsum(0)
    scores = ref.stce_scores(feats, times)
    assert scores.dtype == dtype and scores.shape == (n,)
    assert scores[0] == math.inf and scores[-1] == math.inf
    for j in range(1, n - 1):
        expected = curvature_brute(feats[j - 1], feats[j], feats[j + 1], int(times[j - 1]), int(times[j + 1]))
        assert scores[j].item() == pytest.approx(expected, rel=1e-5 if dtype == torch.float32 else 1e-12)


def stce_brute(held: dict, arrivals: list, first_frame: int, capacity: int) -> tuple[list, list]:
    """STCE recomputing every score from scratch after every arrival (no linked list, no incremental update).
    held: {frame: feature}; arrivals: features in order. Returns (retained frames, evicted frame per arrival)."""
    frames = dict(held)
    evicted = []
    for i, feature in enumerate(arrivals):
        frames[first_frame + i] = feature
        if len(frames) <= capacity:
            evicted.append(-1)
            continue
        times = sorted(frames)
        interior = [(curvature_brute(frames[times[k - 1]], frames[times[k]], frames[times[k + 1]],
                                     times[k - 1], times[k + 1]), times[k]) for k in range(1, len(times) - 1)]
        _, victim = min(interior)  # lowest score, then the older frame
        del frames[victim]
        evicted.append(victim)
    return sorted(frames), evicted


def random_memory(H, B, W, D, held, first_frame, g, dtype=torch.float32):
    """features [H, B, W, D] and frames [H, B, W]: `held` distinct frames < first_frame per row in random slots
    (others −1 with NaN features, which STCE must never read)."""
    features = torch.full((H, B, W, D), float("nan"), dtype=dtype)
    frames = torch.full((H, B, W), -1, dtype=torch.int64)
    for h in range(H):
        for b in range(B):
            slots = torch.randperm(W, generator=g)[:held]
            frames[h, b, slots] = torch.randperm(first_frame, generator=g)[:held].sort().values
            features[h, b, slots] = torch.randn(held, D, generator=g, dtype=dtype)
    return features, frames


@pytest.mark.parametrize("capacity, held, F, D", [
    (4, 0, 9, 8), (4, 2, 1, 16), (6, 6, 5, 16), (8, 3, 16, 32), (16, 16, 16, 64), (2, 2, 4, 4), (5, 5, 1, 128),
])
def test_stce_incremental_equals_recompute_from_scratch(capacity, held, F, D):
    """O(1) neighbour update == recomputing all scores after every eviction (independent brute force, fp64)."""
    g = torch.Generator().manual_seed(capacity * 1000 + held * 100 + F)
    H, B, first = 2, 3, 40
    checked = 0
    for _ in range(20):  # fresh draws until tie-free: float32 and float64 then agree on every eviction
        features, frames = random_memory(H, B, capacity, D, held, first, g)
        arriving = torch.randn(H, B, F, D, generator=g)
        trace = ref.stce_trace(features, frames, arriving, first, capacity)
        if not bool((trace.margin > 1e-4).all()):
            continue
        for h in range(H):
            for b in range(B):
                memory = {int(t): features[h, b, s] for s, t in enumerate(frames[h, b].tolist()) if t >= 0}
                kept, evicted = stce_brute(memory, list(arriving[h, b]), first, capacity)
                assert trace.keep[h, b].tolist() == kept + [-1] * (capacity - len(kept))
                assert trace.evicted[h, b].tolist() == evicted
        checked += 1
        if checked == 2:
            break
    assert checked == 2, "no tie-free draw"
    assert torch.equal(ref.stce_select(features, frames, arriving, first, capacity), trace.keep)


@pytest.mark.parametrize("capacity, held, F", [(4, 0, 7), (6, 3, 8), (8, 8, 16), (3, 3, 5)])
def test_stce_chunk_equals_single_arrivals(capacity, held, F):
    g = torch.Generator().manual_seed(capacity + 10 * held + 100 * F)
    H, B, D, first = 2, 2, 16, 30
    features, frames = random_memory(H, B, capacity, D, held, first, g)
    arriving = torch.randn(H, B, F, D, generator=g)
    chunk = ref.stce_select(features, frames, arriving, first, capacity)
    feature_of = {}  # (h, b, frame) -> feature
    for h in range(H):
        for b in range(B):
            for s, t in enumerate(frames[h, b].tolist()):
                if t >= 0:
                    feature_of[h, b, t] = features[h, b, s]
            for i in range(F):
                feature_of[h, b, first + i] = arriving[h, b, i]
    state_frames, state_features = frames, features
    for i in range(F):
        kept = ref.stce_select(state_features, state_frames, arriving[:, :, i:i + 1], first + i, capacity)
        state_frames = kept
        state_features = torch.full((H, B, capacity, D), float("nan"))
        for h in range(H):
            for b in range(B):
                for s, t in enumerate(kept[h, b].tolist()):
                    if t >= 0:
                        state_features[h, b, s] = feature_of[h, b, t]
    assert torch.equal(chunk, state_frames)


def test_stce_slot_order_does_not_matter():
    g = torch.Generator().manual_seed(21)
    features, frames = random_memory(1, 2, 8, 16, 6, 20, g)
    arriving = torch.randn(1, 2, 5, 16, generator=g)
    perm = torch.randperm(8, generator=g)
    assert torch.equal(ref.stce_select(features, frames, arriving, 20, 8),
                       ref.stce_select(features[:, :, perm], frames[:, :, perm], arriving, 20, 8))


@pytest.mark.parametrize("turn", [5, 9, 14])
def test_straight_line_with_sharp_turn_keeps_the_turn(turn):
    """Frames move along a line at constant speed, turn sharply at frame `turn`, go on along another line: the
    corner is the only curved point, so STCE keeps it while FIFO of the same size would have dropped it."""
    g = torch.Generator().manual_seed(turn)
    D, n, capacity = 32, 24, 5
    u, r = torch.nn.functional.normalize(torch.randn(2, D, generator=g), dim=-1)
    v = torch.nn.functional.normalize(r - (r @ u) * u, dim=0)  # orthogonal to u
    w = -0.8 * u + 0.6 * v  # a unit direction 143° away from u
    start = torch.randn(D, generator=g)
    path = [start + t * u if t <= turn else start + turn * u + (t - turn) * w for t in range(n)]
    arriving = torch.stack(path)[None, None]
    empty = torch.full((1, 1, capacity, D), float("nan"))
    trace = ref.stce_trace(empty, torch.full((1, 1, capacity), -1), arriving, 0, capacity)
    kept = trace.keep[0, 0].tolist()
    assert turn in kept and kept[0] == 0 and kept[-1] == n - 1
    assert turn not in ref.fifo_keep(torch.full((1, 1, 1), -1), 0, n, capacity)[0, 0].tolist()


def test_tie_evicts_the_older_frame():
    # zigzag V_j = (j, j mod 2): every interior frame turns by 90° at speed √2 -> equal scores √2·log 2
    zigzag = torch.tensor([[float(j), float(j % 2)] for j in range(5)])
    held = zigzag[:4][None, None]
    trace = ref.stce_trace(held, torch.arange(4)[None, None], zigzag[4:][None, None], 4, 4)
    assert trace.evicted[0, 0].tolist() == [1] and trace.gap[0, 0, 0].item() == 0.0
    assert trace.keep[0, 0].tolist() == [0, 2, 3, 4]
    # a straight line (all scores exactly 0) also evicts the oldest interior frame
    line = torch.tensor([[float(j), 2.0 * j] for j in range(5)])
    assert ref.stce_select(line[:4][None, None], torch.arange(4)[None, None], line[4:][None, None], 4,
                           4)[0, 0].tolist() == [0, 2, 3, 4]
    # control: bend frame 1 off the line; frames 1 and 2 now turn, frame 3 alone is straight and goes
    line[1, 1] += 1.0
    assert ref.stce_select(line[:4][None, None], torch.arange(4)[None, None], line[4:][None, None], 4,
                           4)[0, 0].tolist() == [0, 1, 2, 4]


@pytest.mark.parametrize("capacity", [2, 3, 6])
def test_endpoints_never_evicted(capacity):
    g = torch.Generator().manual_seed(capacity)
    features, frames = random_memory(2, 2, capacity, 8, capacity, 10, g)
    F = 12
    arriving = torch.randn(2, 2, F, 8, generator=g)
    trace = ref.stce_trace(features, frames, arriving, 10, capacity)
    for h in range(2):
        for b in range(2):
            oldest = int(frames[h, b][frames[h, b] >= 0].min())
            assert trace.keep[h, b, 0] == oldest and trace.keep[h, b, -1] == 10 + F - 1
            assert oldest not in trace.evicted[h, b].tolist()
            # an arrival is never evicted at its own arrival: it is the newest then
            assert all(int(e) != 10 + i for i, e in enumerate(trace.evicted[h, b].tolist()))


def test_fifo_keep_by_hand():
    frames = torch.tensor([[[3, 1, -1, 2], [-1, -1, -1, -1]]])
    kept = ref.fifo_keep(frames, 5, 2, 4)
    assert kept.tolist() == [[[2, 3, 5, 6], [5, 6, -1, -1]]]
    assert ref.fifo_keep(frames, 5, 7, 3).tolist() == [[[9, 10, 11], [9, 10, 11]]]
    assert ref.fifo_keep(frames, 9, 1, 6).tolist() == [[[1, 2, 3, 9, -1, -1], [9, -1, -1, -1, -1, -1]]]


# ---------------------------------------------------------------------------------------------------------------
# one step: slot plan and re-indexing
# ---------------------------------------------------------------------------------------------------------------

def small_cfg(P=1, T_f=2, W=(3, 4, 5), reindex="lazy"):
    return H2SVCConfig(num_layers=2, num_kv_heads=2, prefix_len=P, tokens_per_frame=T_f, instant_frames=W[0],
                       short_frames=W[1], episodic_frames=W[2], reindex=reindex)


def test_slot_plan_by_hand_fifo():
    """short window W = 3, T_f = 2, P = 1: held frames [10, 11, 12], arrivals 13, 14 in overflow slots 3, 4.
    Kept: 12, 13, 14. Freed home slots 0, 1 take 13, 14 (arrival order); slot 2 (frame 12) stays."""
    cfg = small_cfg(W=(2, 3, 5))
    C, D = 1 + 5 * 2 + 1, 4
    keys = torch.arange(C * D, dtype=torch.float32).view(1, 1, C, D)
    values = -keys.clone()
    positions = torch.arange(C).view(1, 1, C) * 10
    slot_frames = torch.tensor([[[10, 11, 12]]])
    k0, v0, p0 = keys.clone(), values.clone(), positions.clone()
    result = ref.h2svc_step(keys, values, positions, slot_frames, cfg, SHORT, inv_freq_for(D),
                            clock=StreamClock(held=3, num_frames=2, first_frame=13,
                                              reindexed=torch.tensor(False), next_position=0))
    assert result.held == 3 and not bool(result.reindexed) and result.keep is slot_frames
    assert slot_frames.tolist() == [[[13, 14, 12]]]
    tokens = lambda s: slice(1 + 2 * s, 3 + 2 * s)  # noqa: E731
    expected_source = {0: 3, 1: 4, 2: 2}
    for target, source in expected_source.items():
        assert torch.equal(keys[0, 0, tokens(target)], k0[0, 0, tokens(source)])
        assert torch.equal(values[0, 0, tokens(target)], v0[0, 0, tokens(source)])
        assert torch.equal(positions[0, 0, tokens(target)], p0[0, 0, tokens(source)])
    for untouched in (slice(0, 1), tokens(3), tokens(4), slice(11, 12)):  # prefix, mover sources, spare slot
        assert torch.equal(keys[0, 0, untouched], k0[0, 0, untouched])
        assert torch.equal(positions[0, 0, untouched], p0[0, 0, untouched])


def test_slot_plan_held_in_any_slot_order():
    cfg = small_cfg(W=(2, 3, 5))
    C, D = 1 + 5 * 2, 4
    keys = torch.randn(1, 1, C, D)
    positions = torch.arange(C).view(1, 1, C)
    slot_frames = torch.tensor([[[12, 10, 11]]])
    ref.h2svc_step(keys, keys.clone(), positions, slot_frames, cfg, SHORT, inv_freq_for(D),
                   clock=StreamClock(held=3, num_frames=2, first_frame=13,
                                     reindexed=torch.tensor(False), next_position=0))
    assert slot_frames.tolist() == [[[12, 13, 14]]]
    assert positions[0, 0, 3:7].tolist() == [7, 8, 9, 10]  # frames 13, 14 came from frame slots 3, 4


@pytest.mark.parametrize("cls", [INSTANT, SHORT, EPISODIC])
def test_nothing_moves_when_the_chunk_fits(cls):
    cfg = small_cfg(W=(4, 4, 4))
    g = torch.Generator().manual_seed(cls)
    H_c, B, D, held, F = 2, 2, 8, 1, 3
    C = 1 + 4 * 2
    keys, values = torch.randn(2, H_c, B, C, D, generator=g)
    positions = torch.arange(C).expand(H_c, B, C).clone()
    slot_frames = torch.tensor([5, -1, -1, -1]).expand(H_c, B, 4).clone()
    features = torch.randn(H_c, B, 4, D, generator=g) if cls == EPISODIC else None
    k0, v0, p0 = keys.clone(), values.clone(), positions.clone()
    result = ref.h2svc_step(keys, values, positions, slot_frames, cfg, cls, inv_freq_for(D),
                            clock=StreamClock(held=held, num_frames=F, first_frame=6,
                                              reindexed=torch.tensor(False), next_position=C),
                            features=features)
    assert result.held == 4 and slot_frames[0, 0].tolist() == [5, 6, 7, 8]
    assert torch.equal(keys, k0) and torch.equal(values, v0) and torch.equal(positions, p0)
    if cls == EPISODIC:  # arrivals in home slots get their features
        assert_close_verbose(features[:, :, 1:], ref.frame_features(v0[:, :, 3:9], 2), name="features")


def make_block(cfg, cls, H_c, B, D, held, F, first, dtype, g, mrope=False, start=0):
    """A class block after a chunk's prefill: unrotated `raw` keys, keys = transformers' RoPE of raw at the
    positions, held frames (random distinct indices < first, random home slots) and F arrivals at frame slots
    held.. in order; positions per frame strictly increasing with the frame index (M-RoPE as Qwen2.5-VL: t per
    frame, h/w a 1×T_f grid at the same offset in every frame). Returns a dict of tensors plus the frame of every
    frame slot."""
    P, T_f, W = cfg.prefix_len, cfg.tokens_per_frame, cfg.window(cls)
    C = P + (held + F) * T_f + 3
    frame_in_slot = torch.full((H_c, B, held + F), -1, dtype=torch.int64)
    positions = torch.zeros(H_c, B, 3, C, dtype=torch.int64) if mrope else torch.zeros(H_c, B, C, dtype=torch.int64)
    for r in range(H_c):
        for b in range(B):
            frame_in_slot[r, b, :held] = torch.randperm(first, generator=g)[:held]
            frame_in_slot[r, b, held:] = torch.arange(first, first + F)
            # base position of frame f: prefix + 2 f + a per-row random offset (gaps between frames)
            offset = int(torch.randint(0, 5, (1,), generator=g))
            base = {int(f): start + P + offset + (T_f + 2) * int(f) for f in frame_in_slot[r, b]}
            for s, f in enumerate(frame_in_slot[r, b].tolist()):
                token = slice(P + s * T_f, P + (s + 1) * T_f)
                if mrope:
                    positions[r, b, 0, token] = base[f]
                    positions[r, b, 1, token] = start + P + offset
                    positions[r, b, 2, token] = start + P + offset + torch.arange(T_f)
                else:
                    positions[r, b, token] = base[f] + torch.arange(T_f)
    if mrope:
        positions[:, :, :, :P] = torch.arange(P)
    else:
        positions[:, :, :P] = torch.arange(P)
    work = torch.float64 if dtype == torch.float64 else torch.float32
    raw = torch.randn(H_c, B, C, D, generator=g, dtype=work)
    values = torch.randn(H_c, B, C, D, generator=g).to(dtype)
    slot_frames = torch.full((H_c, B, W), -1, dtype=torch.int64)
    slot_frames[:, :, :held] = frame_in_slot[:, :, :held]
    features = None
    if cls == EPISODIC:
        features = torch.full((H_c, B, W, D), float("nan"), dtype=work)
        features[:, :, :held] = torch.randn(H_c, B, held, D, generator=g, dtype=work)
    return dict(raw=raw, values=values, positions=positions, slot_frames=slot_frames, features=features,
                frame_in_slot=frame_in_slot)


def rotate_like_the_model(raw, positions, inv_freq, section, theta):
    """keys [H_c, B, C, D] = transformers' RoPE of raw at positions: Qwen2's 1D (section None), Qwen2.5-VL's M-RoPE
    (contiguous pair counts) or Qwen3-VL's (an interleaved RotaryLayout), each through the family's own module."""
    interleaved = isinstance(section, RotaryLayout) and section.kind == "interleaved"
    family, counts = ("qwen3_vl", section.counts) if interleaved else ("qwen2_5_vl", section)
    out = torch.empty_like(raw)
    for r in range(raw.shape[0]):
        for b in range(raw.shape[1]):
            if section is None:
                out[r, b] = hf_rotate(raw[r, b][None], positions[r, b], inv_freq)[0].to(raw.dtype)
            else:
                out[r, b] = hf_rotate_mrope(raw[r, b][None], positions[r, b], counts, theta, family)[0].to(raw.dtype)
    return out


# a case's rotary layout at D = 16: 1D, Qwen2.5-VL's contiguous sections, Qwen3-VL's interleaved ones
ROPES = {"1d": None, "sections": [2, 3, 3], "interleaved": INTERLEAVED[16]}
STEP_CASES = [  # cls, W (instant, short, episodic), held, F, rope
    (INSTANT, (3, 6, 6), 3, 2, "1d"), (SHORT, (3, 6, 6), 4, 5, "sections"), (EPISODIC, (3, 6, 6), 6, 4, "1d"),
    (EPISODIC, (3, 6, 5), 2, 6, "sections"), (EPISODIC, (3, 6, 4), 0, 7, "1d"), (SHORT, (3, 5, 6), 0, 2, "1d"),
    (INSTANT, (2, 5, 6), 2, 1, "sections"), (SHORT, (3, 6, 6), 4, 5, "interleaved"),
    (EPISODIC, (3, 6, 5), 2, 6, "interleaved"), (INSTANT, (2, 5, 6), 2, 1, "interleaved"),
]


@pytest.mark.parametrize("dtype", CACHE_DTYPES)
@pytest.mark.parametrize("cls, W, held, F, rope", STEP_CASES)
@pytest.mark.parametrize("reindex", [False, True])
def test_step_plan_and_reindex(cls, W, held, F, rope, reindex, dtype):
    """Properties of one step on random blocks: kept set = FIFO / STCE of the chunk; kept home frames stay; freed
    slots take the overflow frames ascending in arrival order; every token's K, V and position travels with it;
    re-indexing: prefix untouched, per-axis dense ranks in the old order, newest coordinate at R − 1 in every row,
    keys = transformers' RoPE at the new positions."""
    g = torch.Generator().manual_seed(zlib.crc32(repr((cls, W, held, F, rope, reindex, dtype)).encode()))
    P, T_f, D = 2, 3, 16
    section = ROPES[rope]
    mrope = section is not None
    cfg = small_cfg(P=P, T_f=T_f, W=W, reindex="eager")
    H_c, B, first = 3, 2, 20
    block = make_block(cfg, cls, H_c, B, D, held, F, first, dtype, g, mrope)
    inv_freq = inv_freq_for(D, 1e6)
    keys = rotate_like_the_model(block["raw"], block["positions"], inv_freq, section, 1e6).to(dtype)
    values, positions, slot_frames, features = (block[k] for k in ("values", "positions", "slot_frames",
                                                                   "features"))
    k0, v0, p0, f0, s0 = keys.clone(), values.clone(), positions.clone(), \
        None if features is None else features.clone(), slot_frames.clone()
    Wc = cfg.window(cls)
    held_after = min(Wc, held + F)
    R = P + held_after * T_f + 7
    if cls == EPISODIC:
        arriving = ref.frame_features(v0[:, :, P + held * T_f:P + (held + F) * T_f], T_f)
        expected_kept = ref.stce_select(f0, s0, arriving, first, Wc)
    else:
        expected_kept = ref.fifo_keep(s0, first, F, Wc)
    result = ref.h2svc_step(keys, values, positions, slot_frames, cfg, cls, inv_freq, section,
                            clock=StreamClock(held=held, num_frames=F, first_frame=first,
                                              reindexed=torch.tensor(reindex), next_position=R), features=features)
    assert result.held == held_after and bool(result.reindexed) == reindex
    assert torch.equal(result.keep, slot_frames)
    for r in range(H_c):
        for b in range(B):
            before = block["frame_in_slot"][r, b].tolist()
            after = slot_frames[r, b].tolist()
            assert after[held_after:] == [-1] * (Wc - held_after)
            assert sorted(after[:held_after]) == [t for t in expected_kept[r, b].tolist() if t >= 0]
            # kept frames already in a home slot stay; freed slots take the overflow frames in arrival order
            moved = [s for s in range(held_after) if after[s] != before[s]]
            assert all(before.index(after[s]) >= Wc for s in moved)
            assert [after[s] for s in moved] == sorted(after[s] for s in moved)
            assert len(moved) == sum(1 for s in range(Wc, held + F) if before[s] in after)
            source = {s: before.index(after[s]) for s in range(held_after)}
            pos = positions[r, b]
            for s, src in source.items():
                dst_t, src_t = slice(P + s * T_f, P + (s + 1) * T_f), slice(P + src * T_f, P + (src + 1) * T_f)
                assert torch.equal(values[r, b, dst_t], v0[r, b, src_t])
                if not reindex:
                    assert torch.equal(keys[r, b, dst_t], k0[r, b, src_t])
                    assert torch.equal(pos[..., dst_t], p0[r, b][..., src_t])
                if cls == EPISODIC:
                    frame = after[s]
                    expected = f0[r, b, src] if frame < first else arriving[r, b, frame - first]
                    assert torch.equal(features[r, b, s], expected)
            assert torch.equal(pos[..., :P], p0[r, b][..., :P]) and torch.equal(keys[r, b, :P], k0[r, b, :P])
            if not reindex:
                continue
            retained = pos[..., P:P + held_after * T_f]
            old = torch.cat([p0[r, b][..., P + source[s] * T_f:P + (source[s] + 1) * T_f]
                             for s in range(held_after)], dim=-1)
            per_axis_new = retained.reshape(-1, retained.shape[-1])
            per_axis_old = old.reshape(-1, old.shape[-1])
            assert int(per_axis_new.max()) == R - 1  # right alignment: the newest coordinate ends at R - 1
            assert int(per_axis_new.min()) >= P  # the prefix comes first
            for new_a, old_a in zip(per_axis_new, per_axis_old):
                distinct = new_a.unique()
                assert distinct.tolist() == list(range(int(distinct[0]), int(distinct[0]) + distinct.numel()))
                assert torch.equal(torch.sign(new_a[:, None] - new_a[None]), torch.sign(old_a[:, None] - old_a[None]))
            if not mrope:
                assert retained.max() == pos[P + [s for s in range(held_after) if after[s] == max(after)][0] * T_f
                                             + T_f - 1]  # the newest frame's last token
            raw_moved = torch.cat([block["raw"][r, b, P + source[s] * T_f:P + (source[s] + 1) * T_f]
                                   for s in range(held_after)])
            expected_keys = rotate_like_the_model(raw_moved[None, None], retained[None, None], inv_freq, section,
                                                  1e6)[0, 0]
            if dtype == torch.float64:
                atol = rtol = 1e-9 if section is None else 2e-4  # transformers' M-RoPE tables are float32
            elif dtype == torch.float32:
                atol = rtol = 2e-4
            else:
                atol = rtol = {torch.bfloat16: 3e-2, torch.float16: 4e-3}[dtype]  # two roundings to the dtype
            assert_close_verbose(keys[r, b, P:P + held_after * T_f], expected_keys.to(dtype), atol, rtol,
                                 f"row {r} stream {b} keys vs transformers RoPE")


def test_reindex_1d_by_hand():
    """instant W = 2, P = 2, T_f = 2: frames at [10, 11], [14, 15], arrival at [20, 21] moves to slot 0; kept
    tokens in slot order [20, 21, 14, 15] rank [2, 3, 0, 1]; R = 8 -> [6, 7, 4, 5]."""
    cfg = small_cfg(P=2, T_f=2, W=(2, 4, 4))
    D = 8
    positions = torch.tensor([[[0, 1, 10, 11, 14, 15, 20, 21]]])
    raw = torch.randn(1, 1, 8, D, dtype=torch.float64)
    keys = rotate_like_the_model(raw, positions, inv_freq_for(D), None, 1e6)
    slot_frames = torch.tensor([[[0, 1]]])
    ref.h2svc_step(keys, raw.clone(), positions, slot_frames, cfg, INSTANT, inv_freq_for(D),
                   clock=StreamClock(held=2, num_frames=1, first_frame=2,
                                     reindexed=torch.tensor(True), next_position=8))
    assert slot_frames.tolist() == [[[2, 1]]]
    assert positions.tolist() == [[[0, 1, 6, 7, 4, 5, 20, 21]]]
    expected = rotate_like_the_model(raw[:, :, [0, 1, 6, 7, 4, 5]], positions[..., :6], inv_freq_for(D), None, 1e6)
    assert_close_verbose(keys[:, :, :6], expected, 1e-9, 1e-9, "keys")


@pytest.mark.parametrize("section", [[2, 3, 3], INTERLEAVED[16]], ids=["sections", "interleaved"])
def test_reindex_mrope_by_hand(section):
    """short W = 3, P = 1, T_f = 2 (a 1×2 grid, Qwen2.5-VL style: h, w repeat in every frame): t = 5, 9, 12,
    h = 5, w = 5, 6. Distinct counts t 3, h 1, w 2 -> E = 3 (not the 6 tokens); R = 20: new = 17 + rank per axis,
    so t ends at 19 = R - 1, h is 17 everywhere, w takes 17, 18. Keys against the family's own RoPE (Qwen2.5-VL's
    contiguous sections, Qwen3-VL's interleaved ones)."""
    cfg = small_cfg(P=1, T_f=2, W=(2, 3, 4))
    D = 16
    positions = torch.tensor([[[[0, 5, 5, 9, 9, 12, 12],
                                [0, 5, 5, 5, 5, 5, 5],
                                [0, 5, 6, 5, 6, 5, 6]]]])
    raw = torch.randn(1, 1, 7, D)
    keys = rotate_like_the_model(raw, positions, inv_freq_for(D), section, 1e6)
    slot_frames = torch.tensor([[[0, 1, -1]]])
    ref.h2svc_step(keys, raw.clone(), positions, slot_frames, cfg, "short", inv_freq_for(D), section,
                   clock=StreamClock(held=2, num_frames=1, first_frame=2,
                                     reindexed=torch.tensor(True), next_position=20))
    assert slot_frames.tolist() == [[[0, 1, 2]]]
    assert positions.tolist() == [[[[0, 17, 17, 18, 18, 19, 19],
                                    [0, 17, 17, 17, 17, 17, 17],
                                    [0, 17, 18, 17, 18, 17, 18]]]]
    assert_close_verbose(keys, rotate_like_the_model(raw, positions, inv_freq_for(D), section, 1e6), 2e-4, 2e-4,
                         "keys")


def gemma4_rope(raw: torch.Tensor, positions: torch.Tensor, rotary: torch.nn.Module) -> torch.Tensor:
    """Gemma 4's own RoPE of raw [H_c, B, C, D] at positions int64 [H_c, B, C]: its full-attention rotary module's
    cos / sin and its apply_rotary_pos_emb (rotate-half over all D channels), in raw's dtype."""
    out = torch.empty_like(raw)
    for r in range(raw.shape[0]):
        for b in range(raw.shape[1]):
            x = raw[r, b][None, :, None]  # [1, C, 1, D]: Gemma 4's [B, T, H, D]
            cos, sin = rotary(x, positions[r, b][None], "full_attention")
            out[r, b] = modeling_gemma4.apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim=2)[0, :, 0]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cls", [SHORT, EPISODIC])
def test_reindexed_keys_are_gemma4s_rope_at_the_new_positions(cls, dtype):
    """Gemma 4's full-attention layers (D 512, proportional RoPE, taken as plain 1D with the rotary module's own
    inv_freq): keys made by Gemma 4's RoPE at their positions, stepped with re-indexing, are Gemma 4's RoPE of the
    raw keys at the new positions, and in the zero-frequency channels the raw keys themselves, bit for bit."""
    g = torch.Generator().manual_seed(zlib.crc32(repr((cls, dtype)).encode()))
    P, T_f, D, H_c, B, first, held, F = 2, 3, 512, 2, 1, 20, 5, 3
    cfg = small_cfg(P=P, T_f=T_f, W=(3, 6, 6), reindex="eager")
    rotary = gemma4_rotary(D)
    block = make_block(cfg, cls, H_c, B, D, held, F, first, dtype, g)
    keys = gemma4_rope(block["raw"], block["positions"], rotary).to(dtype)
    positions, slot_frames = block["positions"], block["slot_frames"]
    held_after = min(cfg.window(cls), held + F)
    R = P + held_after * T_f + 7
    result = ref.h2svc_step(keys, block["values"], positions, slot_frames, cfg, cls, rotary.full_attention_inv_freq,
                            clock=StreamClock(held=held, num_frames=F, first_frame=first,
                                              reindexed=torch.tensor(True), next_position=R),
                            features=block["features"])
    assert result.held == held_after
    frozen = frozen_channels(rotary.full_attention_inv_freq)
    for r in range(H_c):
        for b in range(B):
            before = block["frame_in_slot"][r, b].tolist()
            source = [before.index(frame) for frame in slot_frames[r, b, :held_after].tolist()]
            raw = torch.cat([block["raw"][r, b, P + s * T_f:P + (s + 1) * T_f] for s in source])
            retained = positions[r, b, P:P + held_after * T_f]
            want = gemma4_rope(raw[None, None], retained[None, None], rotary)[0, 0].to(dtype)
            got = keys[r, b, P:P + held_after * T_f]
            atol, rtol = (2e-4, 2e-4) if dtype == torch.float32 else (3e-2, 3e-2)  # bf16: two roundings to it
            assert_close_verbose(got, want, atol, rtol, f"row {r} stream {b} keys vs Gemma 4's RoPE")
            assert torch.equal(got[:, frozen], raw[:, frozen].to(dtype)), "a zero-frequency channel changed"


def test_every_row_ends_at_the_shared_next_position():
    """Rows with different held frame counts of positions still end at R − 1 together (right alignment)."""
    g = torch.Generator().manual_seed(5)
    cfg = small_cfg(P=2, T_f=3, W=(3, 5, 5))
    block = make_block(cfg, SHORT, 4, 3, 8, 5, 3, 40, torch.float32, g, start=1000)
    keys = block["raw"].clone()
    R = 2 + 5 * 3 + 11
    ref.h2svc_step(keys, block["values"], block["positions"], block["slot_frames"], cfg, SHORT, inv_freq_for(8),
                   clock=StreamClock(held=5, num_frames=3, first_frame=40, reindexed=torch.tensor(True),
                                     next_position=R))
    visual = block["positions"][:, :, 2:2 + 15]
    assert torch.equal(visual.amax(-1), torch.full((4, 3), R - 1))
    assert torch.equal(visual.amin(-1), torch.full((4, 3), R - 15))


# ---------------------------------------------------------------------------------------------------------------
# bad inputs
# ---------------------------------------------------------------------------------------------------------------

def step_inputs(cls=EPISODIC, mrope=False, dtype=torch.float32):
    g = torch.Generator().manual_seed(99)
    cfg = small_cfg(P=1, T_f=2, W=(2, 3, 4))
    block = make_block(cfg, cls, 2, 2, 8, 3, 2, 10, dtype, g, mrope)
    args = dict(keys=block["raw"].to(dtype), values=block["values"], positions=block["positions"],
                slot_frames=block["slot_frames"], cfg=cfg, cls=cls, inv_freq=inv_freq_for(8),
                rotary=[1, 1, 2] if mrope else None, features=block["features"],
                clock=dict(held=3, num_frames=2, first_frame=10, reindexed=torch.tensor(True),
                           next_position=1 + 4 * 2))
    return args


CLOCK_FIELDS = {field.name for field in dataclasses.fields(StreamClock)}


def _swap(args, **changes):
    """args with `changes`; a StreamClock field changes the clock's fields (built at the call: `_step`)."""
    clock = args["clock"] | {k: v for k, v in changes.items() if k in CLOCK_FIELDS}
    return args | {k: v for k, v in changes.items() if k not in CLOCK_FIELDS} | {"clock": clock}


def _step(args):
    """ref.h2svc_step with the clock built from its fields here, so the clock's own checks count as the step's."""
    return ref.h2svc_step(**args | {"clock": StreamClock(**args["clock"])})


BAD_STEP = [  # (name, change(args) -> args, exception, the argument the message must start with)
    ("keys not a tensor", lambda a: _swap(a, keys=a["keys"].tolist()), TypeError, "keys"),
    ("keys int", lambda a: _swap(a, keys=a["keys"].long()), TypeError, "keys"),
    ("keys 3D", lambda a: _swap(a, keys=a["keys"][0]), ValueError, "keys"),
    ("values shape", lambda a: _swap(a, values=a["values"][:, :, :-1]), ValueError, "values"),
    ("values dtype", lambda a: _swap(a, values=a["values"].half()), TypeError, "values"),
    ("odd head dim", lambda a: _swap(a, keys=a["keys"][..., :7], values=a["values"][..., :7],
                                     features=a["features"][..., :7]), ValueError, "keys"),
    ("positions int32", lambda a: _swap(a, positions=a["positions"].int()), TypeError, "positions"),
    ("positions shape", lambda a: _swap(a, positions=a["positions"][:, :, :-1]), ValueError, "positions"),
    ("M-RoPE without 3 axes", lambda a: _swap(a, rotary=[1, 1, 2]), ValueError, "positions"),
    ("slot_frames width", lambda a: _swap(a, slot_frames=a["slot_frames"][..., :3]), ValueError, "slot_frames"),
    ("slot_frames dtype", lambda a: _swap(a, slot_frames=a["slot_frames"].int()), TypeError, "slot_frames"),
    ("cfg type", lambda a: _swap(a, cfg="episodic"), TypeError, "cfg"),
    ("cls unknown", lambda a: _swap(a, cls="long"), ValueError, "cls"),
    ("inv_freq size", lambda a: _swap(a, inv_freq=inv_freq_for(16)), ValueError, "inv_freq"),
    ("rotary sum", lambda a: _swap(a, rotary=[1, 1, 1], positions=torch.zeros(
        2, 2, 3, a["keys"].shape[2], dtype=torch.int64)), ValueError, "rotary"),
    ("interleaved pairs", lambda a: _swap(a, rotary=INTERLEAVED[16], positions=torch.zeros(
        2, 2, 3, a["keys"].shape[2], dtype=torch.int64)), ValueError, "rotary"),
    ("interleaved without 3 axes", lambda a: _swap(a, rotary=INTERLEAVED[8]), ValueError, "positions"),
    ("held above W", lambda a: _swap(a, held=5), ValueError, r"clock\.held"),
    ("held negative", lambda a: _swap(a, held=-1), ValueError, r"clock\.held"),
    ("held not int", lambda a: _swap(a, held=3.0), TypeError, r"clock\.held"),
    ("num_frames 0", lambda a: _swap(a, num_frames=0), ValueError, r"clock\.num_frames"),
    ("cache too short", lambda a: _swap(a, num_frames=4), ValueError, "keys"),
    ("first_frame not newer", lambda a: _swap(a, first_frame=int(a["slot_frames"].max())), ValueError,
     r"clock\.first_frame"),
    ("reindexed a bool", lambda a: _swap(a, reindexed=True), TypeError, r"clock\.reindexed"),
    ("reindexed not 0-dim", lambda a: _swap(a, reindexed=torch.tensor([True])), TypeError, r"clock\.reindexed"),
    ("reindexed on meta", lambda a: _swap(a, reindexed=torch.tensor(True, device="meta")), TypeError,
     r"clock\.reindexed"),
    ("next_position too small", lambda a: _swap(a, next_position=8), ValueError, r"clock\.next_position"),
    ("clock not a StreamClock", lambda a: a | {"clock": None}, TypeError, "clock"),
    ("features missing", lambda a: _swap(a, features=None), TypeError, "features"),
    ("features fp16", lambda a: _swap(a, features=a["features"].half()), TypeError, "features"),
    ("features shape", lambda a: _swap(a, features=a["features"][:, :, :3]), ValueError, "features"),
    ("features non-finite", lambda a: _swap(a, features=a["features"].index_fill(2, torch.tensor([0]),
                                                                                float("inf"))), ValueError, "features"),
    ("values non-finite", lambda a: _swap(a, values=a["values"].index_fill(2, torch.tensor([8]), float("nan"))),
     ValueError, "values"),
    ("slot_frames repeated", lambda a: _swap(a, slot_frames=a["slot_frames"].index_fill(2, torch.tensor([1]), 0)
                                             .index_fill(2, torch.tensor([0]), 0)), ValueError, "slot_frames"),
    ("slot_frames hole", lambda a: _swap(a, slot_frames=a["slot_frames"].index_fill(2, torch.tensor([1]), -1)),
     ValueError, "slot_frames"),
    ("slot_frames past held", lambda a: _swap(a, held=2), ValueError, "slot_frames"),
]


@pytest.mark.parametrize("name, change, error, argument", BAD_STEP, ids=[case[0] for case in BAD_STEP])
def test_step_refuses_bad_input_before_writing(name, change, error, argument):
    args = change(step_inputs())
    snapshot = {k: v.clone() for k, v in args.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(error, match=rf"^{argument}\b"):
        if args["clock"] is None:  # not a StreamClock at all
            ref.h2svc_step(**args)
        else:
            _step(args)
    for k, v in snapshot.items():
        assert same_bytes(args[k], v), f"{k} was written"


def test_fifo_step_refuses_features():
    args = step_inputs(cls=SHORT)
    args["features"] = torch.zeros(2, 2, 3, 8)
    with pytest.raises(ValueError, match="^features"):
        _step(args)


def _replace(args, **changes):
    return args | changes


BAD_STCE = [
    ("features int", lambda a: _replace(a, features=a["features"].long()), TypeError, "features"),
    ("features fp16", lambda a: _replace(a, features=a["features"].half()), TypeError, "features"),
    ("frames shape", lambda a: _replace(a, slot_frames=a["slot_frames"][:, :, :2]), ValueError, "slot_frames"),
    ("frames dtype", lambda a: _replace(a, slot_frames=a["slot_frames"].int()), TypeError, "slot_frames"),
    ("arriving D", lambda a: _replace(a, arriving=a["arriving"][..., :3]), ValueError, "arriving"),
    ("arriving dtype", lambda a: _replace(a, arriving=a["arriving"].double()), TypeError, "arriving"),
    ("arriving empty", lambda a: _replace(a, arriving=a["arriving"][:, :, :0]), ValueError, "arriving"),
    ("capacity 1", lambda a: _replace(a, capacity=1), ValueError, "capacity"),
    ("more held than capacity", lambda a: _replace(a, capacity=2), ValueError, "slot_frames"),
    ("first_frame old", lambda a: _replace(a, first_frame=0), ValueError, "first_frame"),
    ("first_frame bool", lambda a: _replace(a, first_frame=True), TypeError, "first_frame"),
    ("duplicate frame", lambda a: _replace(a, slot_frames=a["slot_frames"].index_fill(2, torch.tensor([0, 1]), 4)),
     ValueError, "slot_frames"),
    ("frame -2", lambda a: _replace(a, slot_frames=a["slot_frames"].index_fill(2, torch.tensor([3]), -2)),
     ValueError, "slot_frames"),
    ("held feature NaN", lambda a: _replace(a, features=torch.full_like(a["features"], float("nan"))), ValueError,
     "features"),
    ("arriving inf", lambda a: _replace(a, arriving=a["arriving"].index_fill(3, torch.tensor([0]), float("inf"))),
     ValueError, "arriving"),
]


@pytest.mark.parametrize("name, change, error, argument", BAD_STCE, ids=[case[0] for case in BAD_STCE])
def test_stce_refuses_bad_input(name, change, error, argument):
    g = torch.Generator().manual_seed(7)
    features, slot_frames = random_memory(2, 1, 4, 4, 3, 8, g)
    args = change(dict(features=features, slot_frames=slot_frames, arriving=torch.randn(2, 1, 2, 4, generator=g),
                       first_frame=8, capacity=4))
    with pytest.raises(error, match=rf"^{argument}\b"):
        ref.stce_select(**args)


def test_other_functions_refuse_bad_input():
    fot, text = layout(1, 3, 2, 2)
    probs = torch.softmax(torch.randn(2, 4, 9, 9), -1)
    cases = [
        (lambda: ref.frame_features(torch.zeros(1, 1, 5, 4), 2), ValueError, "values"),
        (lambda: ref.frame_features(torch.zeros(1, 5, 4), 1), ValueError, "values"),
        (lambda: ref.frame_features(torch.zeros(1, 1, 4, 4, dtype=torch.int64), 2), TypeError, "values"),
        (lambda: ref.frame_features(torch.zeros(1, 1, 4, 4), 0), ValueError, "tokens_per_frame"),
        (lambda: ref.stce_scores(torch.zeros(3, 4), torch.tensor([0, 2, 2])), ValueError, "times"),
        (lambda: ref.stce_scores(torch.zeros(3, 4), torch.tensor([0, 2])), ValueError, "times"),
        (lambda: ref.fifo_keep(torch.tensor([[[1, 1]]]), 3, 1, 2), ValueError, "slot_frames"),
        (lambda: ref.fifo_keep(torch.tensor([[[1, 2]]]), 3, 1, 0), ValueError, "window"),
        (lambda: ref.fifo_keep(torch.tensor([[[1, 2]]]), 3, 0, 2), ValueError, "num_frames"),
        (lambda: ref.tad_v2v(probs, fot, 3), ValueError, "num_kv_heads"),
        (lambda: ref.tad_v2v(probs[..., :8], fot, 2), ValueError, "probs"),
        (lambda: ref.tad_v2v(probs.half(), fot, 2), TypeError, "probs"),
        (lambda: ref.tad_v2v(probs, fot[:8], 2), ValueError, "frame_of_token"),
        (lambda: ref.tad_v2v(probs, torch.where(fot == 1, -1, fot), 2), ValueError, "frame_of_token"),
        (lambda: ref.tad_v2v(probs.index_fill(2, torch.tensor([0]), float("nan")), fot, 2), ValueError, "probs"),
        (lambda: ref.tad_t2v(probs, fot, torch.tensor([6, 8]), 2), ValueError, "text_queries"),
        (lambda: ref.tad_t2v(probs, fot, torch.tensor([7, 7]), 2), ValueError, "text_queries"),
        (lambda: ref.head_scores(torch.zeros(2, 2), torch.zeros(2, 3)), ValueError, "t2v"),
        (lambda: ref.head_scores(torch.full((2, 2), float("nan")), torch.zeros(2, 2)), ValueError, "v2v"),
        (lambda: ref.classify_heads(torch.zeros(4)), ValueError, "scores"),
        (lambda: ref.classify_heads(torch.zeros(2, 2), 0.7, 0.5), ValueError, "short_ratio"),
        (lambda: ref.classify_heads(torch.zeros(2, 2), -0.1), ValueError, "instant_ratio"),
    ]
    for call, error, argument in cases:
        with pytest.raises(error, match=rf"^{argument}\b"):
            call()

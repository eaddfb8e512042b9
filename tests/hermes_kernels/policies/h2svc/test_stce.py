"""H2SVC stage (b), STCE over a chunk: hk.stce_select on every backend against hermes_kernels.policies.h2svc.reference.

Features are the frame features (reference `frame_features`) of fresh random values stored in the cache dtype
(fp32 / bf16 / fp16), held in random slot order with NaN in empty slots. Keep sets must equal the reference's
exactly on tie-free draws: a draw is used only if every eviction of the reference trace beats the runner-up by a
relative margin of MARGIN (`stce_trace`), otherwise the seed moves on. That is the honest form of "no ties": the
kernels score through a Gram matrix in float32, the reference from the vectors themselves, so the order of two
scores a rounding error apart is not defined by the contract.
The Triton output is poisoned before the kernel writes it.
"""
from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

import hermes_kernels as hk
from hermes_kernels.policies.h2svc import reference as ref
import hermes_kernels.engine.native as native
from tests.utils import DEVICE, TORCH_OPS
from tests.utils import poison_, require_c_library, same_bytes

stce_module = importlib.import_module("hermes_kernels.policies.h2svc.stce")

BACKENDS = ["torch", TORCH_OPS, "triton"]  # torch-ops: the torch loop where the CPU would run the C one
MARGIN = 1e-3  # relative gap between the lowest and second-lowest evictable score at every eviction
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


@pytest.fixture(autouse=True)
def poisoned_output(monkeypatch):
    monkeypatch.setattr(stce_module, "_output", lambda shape, dtype, device: poison_(
        torch.empty(shape, dtype=dtype, device=device)))


@dataclasses.dataclass(frozen=True)
class Case:
    chunk: int  # F arrivals
    memory: str  # "empty" | "partial" (each row a different count below capacity) | "full"
    D: int
    dtype: torch.dtype  # cache dtype the values are stored in
    H: int = 2
    B: int = 2
    capacity: int = 6
    tokens_per_frame: int = 3

    @property
    def id(self) -> str:
        return f"F{self.chunk}-{self.memory}-D{self.D}-{str(self.dtype)[6:]}"


# every chunk size with every memory state; D and dtype rotate so each meets each chunk size once
# (16 arrivals on one row of the interpreter are 16 sequential rounds: those cases run 1 x 2 rows, not 2 x 2)
CASES = [Case(F, memory, D, dtype, H=1 if F == 16 else 2)
         for F, row in ((1, ((16, F32), (64, BF16), (128, F16))),
                        (4, ((64, F16), (128, F32), (16, BF16))),
                        (16, ((128, BF16), (16, F16), (64, F32))))
         for memory, (D, dtype) in zip(("empty", "partial", "full"), row)]
# Gemma 4's widths (its full-attention layers' D 512, and 256): the features' Gram matrix over wide rows
CASES += [Case(4, "full", 512, BF16), Case(4, "partial", 512, F32, B=1), Case(1, "full", 256, F16)]


def draw(case: Case, seed: int):
    """(features [H, B, W, D] float32 with NaN in empty slots, frames [H, B, W] in random slot order,
    arriving [H, B, F, D] float32, first_frame), features = frame means of values in the cache dtype."""
    g = torch.Generator().manual_seed(seed)
    H, B, W, D, T, F = case.H, case.B, case.capacity, case.D, case.tokens_per_frame, case.chunk
    held = {"empty": torch.zeros(H, B, dtype=torch.int64),
            "partial": torch.randint(1, W, (H, B), generator=g),
            "full": torch.full((H, B), W)}[case.memory]
    first_frame = 3 * W
    frames = torch.full((H, B, W), -1, dtype=torch.int64)
    for h in range(H):
        for b in range(B):
            n = int(held[h, b])
            times = torch.randperm(first_frame, generator=g)[:n]  # held frames: any older indices, with gaps
            frames[h, b, torch.randperm(W, generator=g)[:n]] = times
    values = torch.randn(H, B, (W + F) * T, D, generator=g).to(case.dtype)
    features = ref.frame_features(values[:, :, :W * T], T).masked_fill_((frames < 0).unsqueeze(-1), float("nan"))
    arriving = ref.frame_features(values[:, :, W * T:], T)
    return features, frames, arriving, first_frame


def tie_free(case: Case, seed: int, attempts: int = 50):
    """The first draw from `seed` on whose reference trace has no near-tie; returns (inputs, trace)."""
    for attempt in range(attempts):
        inputs = draw(case, seed * 1000 + attempt)
        trace = ref.stce_trace(*inputs, case.capacity)
        if bool((trace.margin > MARGIN).all()):
            return inputs, trace
    raise AssertionError(f"no tie-free draw in {attempts} attempts for {case.id}")


def on_device(*tensors):
    return [t.to(DEVICE) for t in tensors]


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_keep_sets_equal_the_reference(case, backend):
    (features, frames, arriving, first_frame), trace = tie_free(case, CASES.index(case))
    if case.memory == "full":
        assert bool((trace.evicted >= 0).all()), "a full memory must evict on every arrival"
    snapshot = [t.clone() for t in (features, frames, arriving)]
    kept = hk.stce_select(*on_device(features, frames, arriving), first_frame, case.capacity, backend=backend)
    assert kept.dtype == torch.int64 and kept.shape == (case.H, case.B, case.capacity)
    assert torch.equal(kept.cpu(), trace.keep), f"kept\n{kept.cpu()}\nreference\n{trace.keep}"
    for before, after in zip(snapshot, (features, frames, arriving)):
        assert same_bytes(before, after), "an input changed"
    # endpoints: the oldest retained frame and the newest arrival always stay
    oldest = torch.where(frames >= 0, frames, first_frame).amin(dim=-1)
    assert (kept.cpu() == oldest.unsqueeze(-1)).any(dim=-1).all()
    assert (kept.cpu() == first_frame + case.chunk - 1).any(dim=-1).all()


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("transform", ["scaled", "shifted"])
@pytest.mark.parametrize("case", [c for c in CASES if c.memory != "empty" and c.chunk < 16], ids=lambda c: c.id)
def test_keep_sets_ignore_the_feature_scale_and_a_common_shift(case, backend, transform):
    """Curvature is a property of the trajectory's shape: features scaled by 2^-6 (every distance, hence every score,
    scales exactly; distances then sit far below 1) or shifted by 1024 in every dimension (the Gram matrix of raw
    fp32 features that large would be rounding noise; the trajectory is centred first) keep the same frames."""
    (features, frames, arriving, first_frame), trace = tie_free(case, 40 + CASES.index(case))
    if transform == "scaled":
        features, arriving = features / 64, arriving / 64
    else:
        features, arriving = features + 1024, arriving + 1024
    kept = hk.stce_select(*on_device(features, frames, arriving), first_frame, case.capacity, backend=backend)
    assert torch.equal(kept.cpu(), trace.keep), f"{transform}: kept\n{kept.cpu()}\nreference\n{trace.keep}"


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_a_chunk_equals_its_frames_one_by_one(backend):
    """F arrivals in one call == F calls of one arrival, each starting from the previous call's memory."""
    case = Case(5, "partial", 16, BF16, H=2, B=1, capacity=4)
    (features, frames, arriving, first_frame), trace = tie_free(case, seed=7)
    features, frames, arriving = on_device(features, frames, arriving)
    together = hk.stce_select(features, frames, arriving, first_frame, case.capacity, backend=backend)
    feature_of = {}  # (row, stream, frame) -> feature
    for h in range(case.H):
        for b in range(case.B):
            for slot, frame in enumerate(frames[h, b].tolist()):
                if frame >= 0:
                    feature_of[h, b, frame] = features[h, b, slot]
            for i in range(case.chunk):
                feature_of[h, b, first_frame + i] = arriving[h, b, i]
    held_frames, held_features = frames, features
    for i in range(case.chunk):
        kept = hk.stce_select(held_features, held_frames, arriving[:, :, i:i + 1], first_frame + i, case.capacity,
                              backend=backend)
        held_frames = kept
        held_features = torch.stack([torch.stack([
            torch.stack([feature_of[h, b, f] if f >= 0 else torch.full_like(features[0, 0, 0], float("nan"))
                         for f in kept[h, b].tolist()]) for b in range(case.B)]) for h in range(case.H)])
    assert torch.equal(held_frames, together)
    assert torch.equal(together.cpu(), trace.keep)


def line_features(times: torch.Tensor, D: int, g: torch.Generator) -> torch.Tensor:
    """Points V_t = t·u on a straight line through feature space, float32 [n, D]."""
    u = torch.randn(D, generator=g)
    return times.to(F32).unsqueeze(-1) * u


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_straight_line_keeps_the_sharp_turn(backend):
    """Frames on a straight line score (about) 0; one frame pushed off the line is a sharp turn: STCE evicts
    line frames and keeps the turn and the endpoints however many arrive."""
    g = torch.Generator().manual_seed(3)
    W, F, D, turn = 5, 9, 32, 2
    times = torch.arange(W + F)
    line = line_features(times, D, g)
    line[turn] += 40 * torch.randn(D, generator=g)
    frames = torch.tensor([3, 0, 4, 1, 2]).view(1, 1, W)  # slot order need not be temporal
    features = line[frames.flatten()].view(1, 1, W, D)
    kept = hk.stce_select(*on_device(features, frames, line[W:].view(1, 1, F, D)), W, W, backend=backend).cpu()
    assert {0, turn, W + F - 1} <= set(kept.flatten().tolist()), kept
    assert turn in ref.stce_select(features, frames, line[W:].view(1, 1, F, D), W, W).flatten().tolist()


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_zero_velocity_frames_score_zero_and_the_older_goes_first(backend):
    """Frame 2 repeats frame 1 and frame 6 repeats frame 5: frames 1 and 5 stop (v_out = 0), frames 2 and 6 do not
    move in (v_in = 0), so all four score exactly 0, the lowest possible score. Ties go to the older frame: the
    first arrival evicts frame 1 (frame 2 then moves in from frame 0 and scores > 0), the second frame 5."""
    g = torch.Generator().manual_seed(5)
    W, D = 8, 16
    base = torch.randn(W + 2, D, generator=g)
    base[2] = base[1]
    base[6] = base[5]
    scores = ref.stce_scores(base[:W], torch.arange(W))
    assert scores[[1, 2, 5, 6]].tolist() == [0, 0, 0, 0] and bool((scores[[3, 4]] > 0).all())
    frames = torch.arange(W).view(1, 1, W)
    features = base[:W].view(1, 1, W, D)
    one = hk.stce_select(*on_device(features, frames, base[W:W + 1].view(1, 1, 1, D)), W, W, backend=backend)
    assert one.flatten().tolist() == [0, 2, 3, 4, 5, 6, 7, 8]
    two = hk.stce_select(*on_device(features, frames, base[W:].view(1, 1, 2, D)), W, W, backend=backend)
    assert two.flatten().tolist() == [0, 2, 3, 4, 6, 7, 8, 9]
    assert torch.equal(two.cpu(), ref.stce_select(features, frames, base[W:].view(1, 1, 2, D), W, W))


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_a_straight_step_and_a_repeated_frame_tie_at_zero_and_the_older_goes_first(backend):
    """Frame 1 lies midway on a straight line (cos = 1: score exactly 0) and frame 4 repeats frame 3 (a zero-length
    step: both score 0 by the norms > 0 guard, not 0/0 = NaN). Small integer points over 8 lanes keep every
    distance, centre and cosine exact in float32, so the tie is exact and the older frame, 1, is evicted. A NaN in
    place of the guarded 0 would win the argmin and evict frame 3 instead."""
    points = [(0, 0), (1, 0), (2, 0), (2, 3), (2, 3), (5, 7), (9, 7), (9, 12)]
    base = torch.zeros(len(points), 4)
    base[:, :2] = torch.tensor(points, dtype=torch.float32)
    W = len(points) - 1
    scores = ref.stce_scores(base[:W], torch.arange(W))
    assert scores[[1, 3, 4]].tolist() == [0, 0, 0] and bool((scores[[2, 5]] > 0).all())
    features, frames = base[:W].view(1, 1, W, 4), torch.arange(W).view(1, 1, W)
    arriving = base[W:].view(1, 1, 1, 4)
    kept = hk.stce_select(*on_device(features, frames, arriving), W, W, backend=backend).cpu()
    assert kept.flatten().tolist() == [0, 2, 3, 4, 5, 6, 7]
    assert torch.equal(kept, ref.stce_select(features, frames, arriving, W, W))


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_identical_features_evict_oldest_interior_first(backend):
    """Every velocity 0: every interior score ties at 0, so each eviction takes the oldest interior frame; the
    oldest frame (an endpoint) stays, and the memory ends as the oldest plus the newest capacity - 1 frames."""
    W, F = 4, 6
    features = torch.full((1, 2, W, 8), 0.3)
    frames = torch.tensor([[[2, 0, 3, 1]], [[10, 11, 12, 13]]]).view(1, 2, W)
    arriving = torch.full((1, 2, F, 8), 0.3)
    kept = hk.stce_select(*on_device(features, frames, arriving), 14, W, backend=backend).cpu()
    assert kept[0, 0].tolist() == [0, 17, 18, 19]
    assert kept[0, 1].tolist() == [10, 17, 18, 19]
    assert torch.equal(kept, ref.stce_select(features, frames, arriving, 14, W))


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_below_capacity_nothing_is_evicted(backend):
    case = Case(3, "partial", 16, F32, capacity=8)
    (features, frames, arriving, first_frame), trace = tie_free(case, seed=11)
    kept = hk.stce_select(*on_device(features, frames, arriving), first_frame, 16, backend=backend).cpu()
    held = [sorted(f for f in row if f >= 0) for row in frames.flatten(0, 1).tolist()]
    for row, before in zip(kept.flatten(0, 1).tolist(), held):
        expected = before + [first_frame, first_frame + 1, first_frame + 2]
        assert row == expected + [-1] * (16 - len(expected))


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_bad_input_raises_before_writing(backend):
    case = Case(2, "full", 16, F32)
    features, frames, arriving, first_frame = draw(case, 0)
    features, frames, arriving = on_device(features, frames, arriving)
    snapshot = [t.clone() for t in (features, frames, arriving)]
    twice = frames.clone()
    twice[0, 0, 1] = twice[0, 0, 0]
    nan_arriving = arriving.clone()
    nan_arriving[1, 0, 1, 3] = float("nan")
    bad_calls = [
        (ValueError, "features", (features[0], frames, arriving, first_frame, 6)),
        (TypeError, "features", (features.half(), frames, arriving, first_frame, 6)),
        (TypeError, "slot_frames", (features, frames.to(torch.int32), arriving, first_frame, 6)),
        (ValueError, "slot_frames", (features, frames[..., :-1], arriving, first_frame, 6)),
        (TypeError, "arriving", (features, frames, arriving.double(), first_frame, 6)),
        (ValueError, "arriving", (features, frames, arriving[..., :-1], first_frame, 6)),
        (ValueError, "capacity", (features, frames, arriving, first_frame, 1)),
        (TypeError, "first_frame", (features, frames, arriving, float(first_frame), 6)),
        (ValueError, "first_frame", (features, frames, arriving, -1, 6)),
    ]
    if DEVICE == "cpu":  # contents checks run on CPU tensors only (a GPU read would be a host sync)
        bad_calls += [(ValueError, "slot_frames", (features, twice, arriving, first_frame, 6)),
                      (ValueError, "slot_frames", (features, frames, arriving, first_frame, 5)),  # 6 held > 5
                      (ValueError, "first_frame", (features, frames, arriving, int(frames.max()), 6)),
                      (ValueError, "arriving", (features, frames, nan_arriving, first_frame, 6))]
    for error, name, args in bad_calls:
        with pytest.raises(error, match=f"^{name}"):
            hk.stce_select(*args, backend=backend)
    with pytest.raises(ValueError, match="^backend"):
        hk.stce_select(features, frames, arriving, first_frame, 6, backend="gpu")
    for before, after in zip(snapshot, (features, frames, arriving)):
        assert same_bytes(before, after)


@pytest.mark.skipif(DEVICE != "cpu", reason="the C loop (stce_cpu.c) runs on CPU tensors only")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_c_loop_decides_like_the_torch_loop(dtype, monkeypatch):
    """stce_cpu.c against the torch twin's loop, bit for bit, on draws the reference tests cannot use: exact ties
    (repeated features: the older frame must go first), zero arrivals, empty / partial / full rows of different
    held counts, W and F from 2 to 12, float32 and float64 features. Also: the C path really ran, and past its
    log-table bound the torch loop takes over."""
    require_c_library("stce_cpu")
    ran = []
    c_loop = stce_module._select_rows_native
    monkeypatch.setattr(stce_module, "_select_rows_native", lambda *a: ran.append(1) or c_loop(*a))
    g = torch.Generator().manual_seed(91)
    for trial in range(60):
        H, B, W, F = 2, 2, 2 + trial % 11, 1 + trial % 12
        first_frame = 3 * W + trial
        frames = torch.full((H, B, W), -1, dtype=torch.int64)
        for h in range(H):
            for b in range(B):
                n = (trial + h + b) % (W + 1)
                frames[h, b, torch.randperm(W, generator=g)[:n]] = torch.randperm(first_frame, generator=g)[:n]
        features = torch.randn(H, B, W, 8, generator=g, dtype=dtype)
        arriving = torch.randn(H, B, F, 8, generator=g, dtype=dtype)
        if trial % 3 == 0:
            features[..., 1:, :] = features[..., :1, :]  # exact ties among the held frames
        if trial % 4 == 0:
            arriving[..., :, :] = arriving[..., :1, :]  # arrivals standing still
        in_c = stce_module.stce_select_torch(features, frames, arriving, first_frame, W)
        monkeypatch.setenv(native.ENV_SWITCH, "0")
        in_torch = stce_module.stce_select_torch(features, frames, arriving, first_frame, W)
        monkeypatch.delenv(native.ENV_SWITCH)
        assert torch.equal(in_c, in_torch), f"trial {trial}: C {in_c.tolist()} vs torch {in_torch.tolist()}"
    assert len(ran) == 60
    monkeypatch.setattr(stce_module, "_MAX_LOG_TABLE", first_frame + F - 1)
    stce_module.stce_select_torch(features, frames, arriving, first_frame, W)
    assert len(ran) == 60, "past the log-table bound the torch loop should run"


@pytest.mark.skipif(DEVICE != "cpu", reason="the C loop (stce_cpu.c) runs on CPU tensors only")
def test_c_loop_refuses_a_log_table_shorter_than_the_frames():
    """The C loop reads log(t_n - t_p) from the caller's table: it is told the table's length and refuses one that
    does not reach the newest frame index (instead of reading past its end); one entry more runs."""
    require_c_library("stce_cpu")
    g = torch.Generator().manual_seed(92)
    H, B, W, F, first_frame = 2, 1, 4, 3, 6
    frames = torch.arange(W).repeat(H, B, 1)
    features, arriving = torch.randn(H, B, W, 8, generator=g), torch.randn(H, B, F, 8, generator=g)
    times, d2 = stce_module._trajectory(features, frames, arriving, first_frame)
    newest = first_frame + F - 1
    with pytest.raises(RuntimeError, match="log.*table of 8 entries"):
        stce_module._select_rows_native(times, d2, W, newest, W)
    kept = stce_module._select_rows_native(times, d2, W, newest + 1, W)
    assert torch.equal(kept.view(H, B, W), stce_module.stce_select_torch(features, frames, arriving, first_frame, W))



def _every_backend(features, frames, arriving, first_frame, capacity, monkeypatch) -> dict[str, torch.Tensor]:
    """Keep sets of the Triton kernel, the torch ops and (CPU) the C loop, called past the op's checks: on CUDA
    non-finite features reach them unchecked (the check would be a host sync)."""
    args = (*on_device(features, frames, arriving), first_frame, capacity)
    got = {"triton": stce_module.stce_select_triton(*args), "torch": stce_module.stce_select_torch(*args)}
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    got[TORCH_OPS] = stce_module.stce_select_torch(*args)
    monkeypatch.delenv(native.ENV_SWITCH)
    return {name: kept.cpu() for name, kept in got.items()}


@pytest.mark.parametrize("bad", ["nan-held", "inf-arriving", "nan-arriving"])
def test_non_finite_features_evict_the_same_frames_in_triton_torch_and_c(bad, monkeypatch):
    """A non-finite feature makes the row's centre, and so every distance, non-finite: every score is NaN, which
    every backend reads as 0, so the interior frames go oldest first (the first and newest frames stay)."""
    H, B, W, F, D = 2, 2, 5, 4, 8
    g = torch.Generator().manual_seed(17)
    frames = torch.stack([torch.randperm(W, generator=g) for _ in range(H * B)]).view(H, B, W) * 2  # full, shuffled
    features = torch.randn(H, B, W, D, generator=g)
    arriving = torch.randn(H, B, F, D, generator=g)
    target = features if bad == "nan-held" else arriving
    target[:, :, 1, 3] = float("inf") if bad == "inf-arriving" else float("nan")
    got = _every_backend(features, frames, arriving, 2 * W, W, monkeypatch)
    oldest_and_newest = torch.tensor([0] + list(range(2 * W + F - (W - 1), 2 * W + F))).expand(H, B, W)
    for name, kept in got.items():
        assert torch.equal(kept, oldest_and_newest), f"{name}: {kept.tolist()}"


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's numpy on NaN
def test_non_finite_distances_decide_alike_in_triton_torch_and_c(monkeypatch):
    """NaN, +inf and float-range-overflowing entries scattered over otherwise finite distances (every way a score
    can become NaN: a NaN input, inf - inf, 0 · inf, a NaN cosine or norm): Triton, the torch ops and the C loop
    keep the same frames."""
    trajectory = stce_module._trajectory
    g = torch.Generator().manual_seed(23)
    trial = 0

    def poisoned(*args):  # the same poison for every backend of one trial
        times, d2 = trajectory(*args)
        p = torch.Generator().manual_seed(trial)
        pick = torch.rand(d2.shape, generator=p) < 0.15
        value = torch.tensor([float("nan"), float("inf"), 3e38])[torch.randint(0, 3, d2.shape, generator=p)]
        upper = torch.where(pick.cpu(), value, d2.cpu()).triu(1)
        return times, (upper + upper.transpose(-1, -2)).to(d2.device)  # symmetric, zero diagonal

    monkeypatch.setattr(stce_module, "_trajectory", poisoned)
    for trial in range(6):
        H, B, W, F = 2, 2, 4 + trial, 3 + trial % 3
        frames = torch.stack([torch.randperm(W, generator=g) for _ in range(H * B)]).view(H, B, W)
        features, arriving = torch.randn(H, B, W, 8, generator=g), torch.randn(H, B, F, 8, generator=g)
        got = _every_backend(features, frames, arriving, W, W, monkeypatch)
        assert got["triton"].equal(got[TORCH_OPS]) and got["torch"].equal(got[TORCH_OPS]), f"trial {trial}: {got}"

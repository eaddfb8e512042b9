"""H2SVC stage (c), the step of one class block: hk.h2svc_step on every backend against
hermes_kernels.policies.h2svc.reference.

Each case builds a fresh block as a stream leaves it: `held` frames (distinct frame indices with gaps) in random
home-slot order, the chunk's F arrivals written at frame slots held .. held+F-1 with the stream's next positions,
keys that are the model's RoPE of random raw keys at their positions, values random, episodic features the frame
means of the held values. The reference and the backend each step a copy; everything must agree: held', slot_frames,
positions (exactly), values (bit-exact copies), keys (bit-exact without re-indexing, within the dtype tolerance of
the compaction tests with it), features. Before that, a first reference run tells which held frames the step
evicts; their slots' K/V are poisoned with NaN in both copies, so a destination the kernel forgets to write shows.
EPISODIC draws are tie-free (the reference trace's margins). Caches are contiguous or views of NaN-tailed buffers.
Gemma 4's full-attention layers (D 512, proportional RoPE: 1D over every pair, most of them at frequency 0) are in
the grid, and a re-index leaves their zero-frequency channels bit for bit on every backend.
"""
from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

import hermes_kernels as hk
from hermes_kernels import StreamClock
from hermes_kernels.engine import native
from hermes_kernels.policies.h2svc import step as step_kernels
from hermes_kernels.engine.ranks import dense_rank
from hermes_kernels.policies.h2svc.config import EPISODIC, INSTANT, SHORT, H2SVCConfig
from hermes_kernels.policies.h2svc import reference as ref
from hermes_kernels.rope import RotaryLayout, apply_rotary_delta
from hermes_kernels.engine.launch import launch_count
from tests.utils import DEVICE, TORCH_OPS
from scaffolding.rotary import proportional_inv_freq
from tests.utils import INTERLEAVED, PARTIAL, QWEN3_5_ROTARY, TOL, assert_close_verbose, frozen_channels, inv_freq_for
from tests.utils import inv_freq_of
from tests.utils import poison_tail_, require_c_library, rotary_width, same_bytes

BACKENDS = ["torch", TORCH_OPS, "triton"]
F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
MARGIN = 1e-3
SPARE = 3  # buffer slots past C in "view" layouts, NaN / poison, checked untouched
POSITION_POISON = -(2 ** 40)
# (D, rotary): 1D, contiguous sections (Qwen2.5-VL) and interleaved ones (Qwen3-VL, "il"); D = 8 and 12:
# rows of 16 and 48 bytes, not whole 32-byte vectors (the C walk must not stream-store them); partial rotary
# (Qwen3.5, "-r": channels [R, D) never turn, their bytes poisoned with −0.0 and a NaN): the tiny model's D 32, R 8
# interleaved, a 1D D 16, R 8 and the published D 256, R 64
ROPES = {"1d": (16, None), "mrope": (16, (2, 3, 3)), "mrope128": (128, (16, 24, 24)), "1d-d8": (8, None),
         "mrope-d12": (12, (2, 2, 2)), "il": (16, INTERLEAVED[16]), "il128": (128, INTERLEAVED[128]),
         "il-d12": (12, INTERLEAVED[12]), "il-d8": (8, INTERLEAVED[8]), "1d128": (128, None),
         "il-r8": PARTIAL["il"], "1d-r8": PARTIAL["1d"], "il256-r64": (256, QWEN3_5_ROTARY),
         "1d512-p": (512, None), "1d256-p": (256, None), "1d32-p": (32, None)}
# the ROPES whose keys carry proportional RoPE (Gemma 4's full-attention layers: D 512; its inv_freq turns the first
# D/8 pairs, the other pairs have frequency 0) instead of default RoPE
PROPORTIONAL = {"1d512-p", "1d256-p", "1d32-p"}


def rope_inv_freq(rope: str, device="cpu") -> torch.Tensor:
    """The inv_freq [R/2] of a ROPES entry: default RoPE's, or proportional RoPE's [D/2]."""
    D, section = ROPES[rope]
    return proportional_inv_freq(D, device=device) if rope in PROPORTIONAL else inv_freq_of(D, section, device=device)
# 2 layers x 3 KV heads: 1 instant, 2 short, 3 episodic rows (default depth map); windows 2 / 3 / 4 frames
CONFIG = dict(num_layers=2, num_kv_heads=3, prefix_len=3, tokens_per_frame=4, instant_frames=2, short_frames=3,
              episodic_frames=4)


@dataclasses.dataclass(frozen=True)
class Case:
    cls: int
    held: int
    chunk: int
    rope: str
    reindex: bool
    dtype: torch.dtype
    layout: str  # "view" (of a larger NaN-tailed buffer) | "contiguous"
    B: int = 2

    @property
    def id(self) -> str:
        name = ("instant", "short", "episodic")[self.cls]
        return (f"{name}-held{self.held}-F{self.chunk}-{self.rope}-{'eager' if self.reindex else 'lazy'}-"
                f"{str(self.dtype)[6:]}-{self.layout}")


CASES = [
    # episodic (W = 4): full + F < W, F > W, partial overflow, fits, empty + single arrival, D = 128 M-RoPE
    Case(EPISODIC, 4, 2, "1d", False, F32, "view"),
    Case(EPISODIC, 4, 6, "mrope", True, BF16, "contiguous"),
    Case(EPISODIC, 2, 3, "1d", True, F16, "view"),
    Case(EPISODIC, 1, 2, "mrope", False, F32, "contiguous"),
    Case(EPISODIC, 3, 5, "mrope128", True, F32, "view"),
    Case(EPISODIC, 0, 1, "1d", True, F64, "contiguous"),
    # short (W = 3)
    Case(SHORT, 3, 2, "1d", True, BF16, "view"),
    Case(SHORT, 0, 3, "mrope", True, F32, "contiguous"),
    Case(SHORT, 2, 5, "1d", False, F16, "contiguous"),
    Case(SHORT, 3, 1, "mrope128", False, BF16, "view"),
    # instant (W = 2)
    Case(INSTANT, 2, 5, "mrope", True, F16, "view"),
    Case(INSTANT, 1, 1, "1d", False, F32, "contiguous"),
    Case(INSTANT, 2, 1, "mrope128", True, F32, "view"),
    # odd row sizes with movers beside kept slots: bf16 D = 8, fp32 D = 12
    Case(EPISODIC, 4, 3, "1d-d8", False, BF16, "contiguous"),
    Case(SHORT, 3, 2, "mrope-d12", False, F32, "contiguous"),
    Case(SHORT, 2, 2, "1d-d8", True, BF16, "view"),
    Case(EPISODIC, 3, 2, "mrope-d12", True, F32, "contiguous"),
    # interleaved M-RoPE (Qwen3-VL): every class, re-indexing on and off, odd row sizes
    Case(EPISODIC, 4, 6, "il", True, BF16, "contiguous"),
    Case(EPISODIC, 3, 5, "il128", True, F16, "view"),
    Case(EPISODIC, 0, 1, "il", True, F64, "contiguous"),
    Case(SHORT, 0, 3, "il", True, F32, "view"),
    Case(SHORT, 3, 1, "il128", False, BF16, "view"),
    Case(SHORT, 2, 2, "il-d8", True, BF16, "contiguous"),
    Case(INSTANT, 2, 5, "il-d12", True, F32, "contiguous"),
    Case(INSTANT, 2, 1, "il128", True, F32, "view"),
    # partial rotary (Qwen3.5): every class, re-indexing on and off, every cache dtype
    Case(EPISODIC, 4, 6, "il-r8", True, BF16, "contiguous"),
    Case(EPISODIC, 3, 2, "il-r8", False, F32, "view"),
    Case(EPISODIC, 0, 1, "1d-r8", True, F64, "view"),
    Case(SHORT, 3, 2, "il-r8", True, F16, "view"),
    Case(SHORT, 2, 5, "1d-r8", True, F32, "contiguous"),
    Case(INSTANT, 2, 5, "il-r8", True, F32, "contiguous"),
    Case(INSTANT, 1, 1, "1d-r8", False, BF16, "view"),
    # Gemma 4's full-attention layers (D 512) and D 256, proportional RoPE: every class, re-indexing on and off
    Case(EPISODIC, 4, 3, "1d512-p", True, BF16, "view"),
    Case(SHORT, 3, 2, "1d512-p", False, F32, "contiguous"),
    Case(INSTANT, 2, 5, "1d512-p", True, F16, "contiguous", B=1),
    Case(SHORT, 2, 2, "1d256-p", True, F64, "view", B=1),
]


@dataclasses.dataclass
class Block:
    """One class block before the step, plus what the checks need."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    slot_frames: torch.Tensor
    features: torch.Tensor | None
    raw: torch.Tensor  # keys before RoPE, [H_c, B, C, D], float32 (float64 for a float64 cache)
    buffers: tuple | None  # the larger tensors keys/values/positions view, or None
    first_frame: int
    next_position: int

    def tensors(self):
        return [t for t in (self.keys, self.values, self.positions, self.slot_frames, self.features) if t is not None]

    def copy(self) -> "Block":
        """A deep copy with the same layout (views of copied buffers)."""
        if self.buffers is None:
            keys, values, positions = (t.clone() for t in (self.keys, self.values, self.positions))
            buffers = None
        else:
            buffers = tuple(t.clone() for t in self.buffers)
            C = self.keys.shape[2]
            keys, values, positions = buffers[0][:, :, :C], buffers[1][:, :, :C], buffers[2][..., :C]
        return dataclasses.replace(self, keys=keys, values=values, positions=positions, buffers=buffers,
                                   slot_frames=self.slot_frames.clone(),
                                   features=None if self.features is None else self.features.clone())


def config() -> H2SVCConfig:
    return H2SVCConfig(**CONFIG)


def frame_positions(frames: torch.Tensor, base: torch.Tensor, T: int, mrope: bool) -> torch.Tensor:
    """Positions [..., A, n·T] of the tokens of frames [..., n] (A = 1 or 3), frame f starting at base[..., f].

    1D: a frame's T tokens take consecutive positions. M-RoPE (Qwen2.5-VL style): t advances with the frame,
    h and w walk a 2-wide grid of the frame's tokens, all offset by the frame's base.
    """
    k = torch.arange(T)
    start = base.unsqueeze(-1)
    if not mrope:
        return (start + k).flatten(-2).unsqueeze(-2)
    axes = [start + 0 * k, start + k // 2 - frames.unsqueeze(-1) % 3, start + k % 2]
    return torch.stack([a.flatten(-2) for a in axes], dim=-2)


def make_block(cfg: H2SVCConfig, case: Case, seed: int) -> Block:
    g = torch.Generator().manual_seed(seed)
    W, P, T = cfg.window(case.cls), cfg.prefix_len, cfg.tokens_per_frame
    D, section = ROPES[case.rope]
    mrope = section is not None and RotaryLayout.of(section, rotary_width(D, section) // 2).num_axes == 3
    H, B, held, F = cfg.num_rows(case.cls), case.B, case.held, case.chunk
    C = P + (held + F) * T + 2  # two spare slots inside the block, as a cache has room for the question
    first_frame = 2 * W + 3
    # held frames: distinct older indices with gaps, in random home-slot order
    slot_frames = torch.full((H, B, W), -1, dtype=torch.int64)
    for h in range(H):
        for b in range(B):
            slot_frames[h, b, :held] = torch.randperm(first_frame, generator=g)[:held]
    # positions: frame f starts at P + f·T plus a per-row offset (rows differ after earlier re-indexing); the
    # arrivals continue from the stream's next position, shared by every row
    offset = torch.randint(0, 5, (H, B, 1), generator=g)
    A = 3 if mrope else 1
    positions = torch.empty(H, B, A, C, dtype=torch.int64)
    positions[..., :P] = torch.arange(P)
    positions[..., P + (held + F) * T:] = POSITION_POISON  # slots past the chunk: never read
    held_frames = slot_frames[..., :held]
    positions[..., P:P + held * T] = frame_positions(held_frames, P + held_frames * T + offset, T, mrope)
    incoming = P + first_frame * T + 5
    arrivals = first_frame + torch.arange(F).expand(H, B, F)
    positions[..., P + held * T:P + (held + F) * T] = frame_positions(arrivals, incoming + (arrivals - first_frame) * T,
                                                                      T, mrope)
    next_position = incoming + F * T
    if case.reindex:  # any shared next position >= P + held'·T works; this one re-numbers most tokens
        next_position = P + min(W, held + F) * T + int(torch.randint(0, 6, (), generator=g))
    inv_freq = rope_inv_freq(case.rope)
    raw = torch.randn(H, B, C, D, generator=g).to(F64 if case.dtype == F64 else F32)
    pos = positions if mrope else positions[:, :, 0]
    keys = poison_tail_(apply_rotary_delta(raw, pos.clamp(min=0), inv_freq, section).to(case.dtype),
                        rotary_width(D, section))
    values = torch.randn(H, B, C, D, generator=g).to(case.dtype)
    features = None
    if case.cls == EPISODIC:
        features = torch.full((H, B, W, D), float("nan"), dtype=F64 if case.dtype == F64 else F32)
        if held:
            features[:, :, :held] = ref.frame_features(values[:, :, P:P + held * T], T)
    pos = pos.contiguous()
    buffers = None
    if case.layout == "view":
        buffers = (torch.full((H, B, C + SPARE, D), float("nan"), dtype=case.dtype),
                   torch.full((H, B, C + SPARE, D), float("nan"), dtype=case.dtype),
                   torch.full((*pos.shape[:-1], C + SPARE), POSITION_POISON, dtype=torch.int64))
        buffers[0][:, :, :C], buffers[1][:, :, :C], buffers[2][..., :C] = keys, values, pos
        buffers = tuple(t.to(DEVICE) for t in buffers)
        keys, values, pos = buffers[0][:, :, :C], buffers[1][:, :, :C], buffers[2][..., :C]
    return Block(keys.to(DEVICE), values.to(DEVICE), pos.to(DEVICE), slot_frames.to(DEVICE),
                 None if features is None else features.to(DEVICE), raw, buffers, first_frame, next_position)


def step_args(cfg: H2SVCConfig, case: Case, block: Block) -> tuple[tuple, dict]:
    D, section = ROPES[case.rope]
    args = (block.keys, block.values, block.positions, block.slot_frames, cfg, case.cls,
            rope_inv_freq(case.rope, device=DEVICE), section)
    clock = StreamClock(held=case.held, num_frames=case.chunk, first_frame=block.first_frame,
                        reindexed=torch.tensor(case.reindex), next_position=block.next_position)
    return args, dict(clock=clock, features=block.features)


def tie_free_block(cfg: H2SVCConfig, case: Case, seed: int, attempts: int = 50) -> Block:
    """A block whose STCE (episodic) has no near-tie in the reference trace; FIFO blocks as drawn."""
    for attempt in range(attempts):
        block = make_block(cfg, case, seed * 1000 + attempt)
        if case.cls != EPISODIC:
            return block
        P, T, W = cfg.prefix_len, cfg.tokens_per_frame, cfg.window(case.cls)
        arriving = ref.frame_features(block.values[:, :, P + case.held * T:P + (case.held + case.chunk) * T].cpu(), T)
        trace = ref.stce_trace(block.features.cpu(), block.slot_frames.cpu(), arriving, block.first_frame, W)
        if bool((trace.margin > MARGIN).all()):
            return block
    raise AssertionError(f"no tie-free draw in {attempts} attempts for {case.id}")


def poison_evicted(cfg: H2SVCConfig, case: Case, block: Block) -> None:
    """NaN into the K/V of the held frames the step evicts (found by a reference run on a copy): those slots are
    overwritten by movers, and nothing else reads them."""
    probe = block.copy()
    args, kwargs = step_args(cfg, case, probe)
    ref.h2svc_step(*args, **kwargs)
    P, T = cfg.prefix_len, cfg.tokens_per_frame
    kept = probe.slot_frames.cpu()
    for h, b, s in (block.slot_frames[..., :case.held].cpu().unsqueeze(-1) != kept.unsqueeze(-2)).all(-1) \
            .nonzero().tolist():
        block.keys[h, b, P + s * T:P + (s + 1) * T] = float("nan")
        block.values[h, b, P + s * T:P + (s + 1) * T] = float("nan")


def source_tokens(cfg: H2SVCConfig, case: Case, block: Block, after: Block, held_after: int) -> torch.Tensor:
    """int64 [H_c, B, held'·T]: the slot each retained token was in before the step (found by frame index)."""
    P, T = cfg.prefix_len, cfg.tokens_per_frame
    source_slot = torch.empty(after.slot_frames.shape[:2] + (held_after,), dtype=torch.int64)
    frame_in_slot = torch.cat([block.slot_frames[..., :case.held].cpu(),
                               (block.first_frame + torch.arange(case.chunk)).expand(*source_slot.shape[:2], -1)], -1)
    for h, b, s in itertools.product(*map(range, source_slot.shape)):
        source_slot[h, b, s] = int((frame_in_slot[h, b] == after.slot_frames[h, b, s].cpu()).nonzero())
    return (P + source_slot.unsqueeze(-1) * T + torch.arange(T)).flatten(-2)


def expected_rope_keys(cfg: H2SVCConfig, case: Case, block: Block, after: Block, held_after: int) -> torch.Tensor:
    """The model's own RoPE of each retained token's raw key at its new position: [H_c, B, held'·T, D] (its rotary
    channels: a partial-rotary key's tail is the poisoned cache bytes, not the raw key's)."""
    P, T = cfg.prefix_len, cfg.tokens_per_frame
    D, section = ROPES[case.rope]
    tokens = source_tokens(cfg, case, block, after, held_after)
    raw = block.raw.gather(2, tokens.unsqueeze(-1).expand(-1, -1, -1, D))
    new = after.positions[..., P:P + held_after * T].cpu()
    return apply_rotary_delta(raw, new, rope_inv_freq(case.rope), section).to(case.dtype)


def run_case(cfg: H2SVCConfig, case: Case, backend: str, seed: int) -> None:
    block = tie_free_block(cfg, case, seed)
    poison_evicted(cfg, case, block)
    expected, got = block.copy(), block.copy()
    args, kwargs = step_args(cfg, case, expected)
    want = ref.h2svc_step(*args, **kwargs)
    args, kwargs = step_args(cfg, case, got)
    storage = [t.data_ptr() for t in got.tensors()]
    result = hk.h2svc_step(*args, **kwargs, backend=backend)
    assert [t.data_ptr() for t in got.tensors()] == storage, "not in place"

    W, P, T = cfg.window(case.cls), cfg.prefix_len, cfg.tokens_per_frame
    held_after = min(W, case.held + case.chunk)
    assert result.held == want.held == held_after and bool(result.reindexed) is case.reindex
    assert result.keep is got.slot_frames
    assert torch.equal(got.slot_frames.cpu(), expected.slot_frames.cpu())
    assert torch.equal(got.positions.cpu(), expected.positions.cpu()), "positions differ"
    assert same_bytes(got.values, expected.values), "values are not bit-exact copies"
    home = slice(P, P + held_after * T)
    R = rotary_width(*ROPES[case.rope])
    if case.reindex:
        atol, rtol = TOL[case.dtype]
        assert_close_verbose(got.keys[:, :, home, :R].cpu(), expected.keys[:, :, home, :R].cpu(), atol, rtol, "keys")
        assert same_bytes(got.keys[:, :, home, R:], expected.keys[:, :, home, R:]), "key tails differ"
        assert same_bytes(got.keys[:, :, :P], expected.keys[:, :, :P]), "prefix keys changed"
        assert same_bytes(got.keys[:, :, home.stop:], expected.keys[:, :, home.stop:])
    else:
        assert same_bytes(got.keys, expected.keys), "keys changed although nothing was re-indexed"
    assert not got.keys[:, :, home, :R].isnan().any() and not got.values[:, :, home].isnan().any(), \
        "a home slot still holds a poisoned (evicted) row"  # (a partial-rotary tail holds NaN of its own)
    if case.cls == EPISODIC:
        assert_close_verbose(got.features[:, :, :held_after].cpu(), expected.features[:, :, :held_after].cpu(),
                             name="features")
        assert same_bytes(got.features[:, :, held_after:], expected.features[:, :, held_after:])
    if got.buffers is not None:
        C = got.keys.shape[2]
        assert got.buffers[0][:, :, C:].isnan().all() and got.buffers[1][:, :, C:].isnan().all(), "wrote past C"
        assert (got.buffers[2][..., C:] == POSITION_POISON).all(), "wrote positions past C"

    if case.reindex:
        # §4: every row's newest retained coordinate sits at next_position - 1; the prefix comes first
        pos = got.positions.cpu()
        pos = pos if pos.dim() == 4 else pos.unsqueeze(2)
        retained = pos[..., home]
        assert (retained.amax(dim=(-1, -2)) == kwargs["clock"].next_position - 1).all()
        assert (retained.amin(dim=-1) >= P).all() and torch.equal(pos[..., :P], torch.arange(P).expand_as(pos[..., :P]))
        # keys are the model's own RoPE at the new positions
        atol, rtol = TOL[case.dtype]
        assert_close_verbose(got.keys[:, :, home, :R].cpu(),
                             expected_rope_keys(cfg, case, block, got, held_after)[..., :R], atol, rtol,
                             "keys vs RoPE at the new positions")
    if R < got.keys.shape[-1]:
        # partial rotary, without the reference: each retained key's tail is its source slot's bytes
        tokens = source_tokens(cfg, case, block, got, held_after)
        bits = {8: torch.int64, 4: torch.int32, 2: torch.int16}[block.keys.element_size()]  # bf16 gathers rewrite NaN
        moved = block.keys.cpu().view(bits).gather(2, tokens.unsqueeze(-1).expand(-1, -1, -1, block.keys.shape[-1]))
        assert same_bytes(got.keys[:, :, home, R:].cpu().view(bits), moved[..., R:]), \
            "a retained key's tail is not the bytes of its source's tail"


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_matches_reference(case, backend):
    run_case(config(), case, backend, seed=CASES.index(case))


@pytest.mark.parametrize("backend", ["reference", *BACKENDS], indirect=True)
@pytest.mark.parametrize("case", [Case(EPISODIC, 4, 3, "1d512-p", True, F32, "contiguous", B=1),
                                  Case(SHORT, 3, 2, "1d512-p", True, BF16, "view", B=1),
                                  Case(INSTANT, 2, 1, "1d256-p", True, F16, "contiguous", B=1)], ids=lambda c: c.id)
def test_zero_frequencies_leave_their_channels_bit_for_bit(case, backend):
    """Proportional RoPE (Gemma 4's full-attention layers): a re-indexing step turns every retained key by its
    delta, on every backend and in the reference; the channels of its zero-frequency pairs are the bytes of its
    source slot, and every key whose position changed turned in some other channel."""
    cfg = config()
    block = tie_free_block(cfg, case, seed=7)
    before = block.copy()
    args, kwargs = step_args(cfg, case, block)
    step = ref.h2svc_step if backend == "reference" else lambda *a, **k: hk.h2svc_step(*a, **k, backend=backend)
    held = step(*args, **kwargs).held
    P, T, D = cfg.prefix_len, cfg.tokens_per_frame, block.keys.shape[-1]
    tokens = source_tokens(cfg, case, before, block, held)  # [H_c, B, held·T]: each retained token's old slot
    moved = before.keys.cpu().gather(2, tokens.unsqueeze(-1).expand(-1, -1, -1, D))
    landed = block.keys[:, :, P:P + held * T].cpu()
    frozen = frozen_channels(rope_inv_freq(case.rope))
    assert int(frozen.sum()) == 2 * (D // 2 - D // 8)
    assert same_bytes(landed[..., frozen], moved[..., frozen]), "a zero-frequency channel changed"
    turned = block.positions[..., P:P + held * T].cpu() != before.positions.cpu().gather(-1, tokens)
    assert turned.any() and (landed[turned][:, ~frozen] != moved[turned][:, ~frozen]).any(dim=-1).all()


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("cls, chunks", [(INSTANT, (1, 3, 1, 2)), (SHORT, (2, 2, 5, 1))])
def test_fifo_windows_over_a_stream(cls, chunks, backend):
    """Chunk after chunk, a FIFO block holds exactly the newest min(W, frames seen) frames."""
    cfg = config()
    W, P, T = cfg.window(cls), cfg.prefix_len, cfg.tokens_per_frame
    H, B = cfg.num_rows(cls), 1
    C = P + (W + max(chunks)) * T
    g = torch.Generator().manual_seed(cls)
    keys, values = torch.randn(2, H, B, C, 16, generator=g).to(DEVICE)
    positions = torch.arange(C).expand(H, B, C).contiguous().to(DEVICE)
    slot_frames = torch.full((H, B, W), -1, dtype=torch.int64, device=DEVICE)
    held, seen = 0, 0
    for chunk in chunks:
        values[:, :, P + held * T:P + (held + chunk) * T] = seen + torch.arange(chunk, device=DEVICE) \
            .repeat_interleave(T).view(1, 1, -1, 1).float()  # a frame's values carry its index
        clock = StreamClock(held=held, num_frames=chunk, first_frame=seen, reindexed=torch.tensor(False),
                            next_position=P + (held + chunk) * T)
        result = hk.h2svc_step(keys, values, positions, slot_frames, cfg, cls, inv_freq_for(16, device=DEVICE),
                               clock=clock, backend=backend)
        seen += chunk
        held = result.held
        newest = list(range(max(0, seen - W), seen))
        assert held == len(newest)
        for row in slot_frames.cpu().flatten(0, 1).tolist():
            assert sorted(row[:held]) == newest and row[held:] == [-1] * (W - held)
        frame_of_value = values[:, :, P:P + held * T, 0].cpu().view(H, B, held, T)
        assert torch.equal(frame_of_value, slot_frames[..., :held].cpu().unsqueeze(-1).float().expand(-1, -1, -1, T))


# 5 tokens per frame in tiles of 2 (a rotation, or an fp32 copy) or 4 (a 16-bit copy): a partial last tile
TILED_CASES = [
    Case(EPISODIC, 4, 2, "1d", True, F32, "view"),
    Case(SHORT, 3, 2, "mrope", False, BF16, "contiguous"),
    Case(INSTANT, 2, 5, "mrope", True, F16, "view"),
    Case(EPISODIC, 3, 2, "il", True, BF16, "contiguous"),
]


@pytest.mark.parametrize("case", TILED_CASES, ids=lambda c: c.id)
def test_triton_moves_frames_in_token_tiles(case, monkeypatch):
    """A frame's T_f tokens span several token tiles of the move kernel (grid axis 1) at the 7B shapes (196 tokens
    in tiles of 16 or 32); here tiles of 64 bytes per K/V half (D = 16: 2 tokens held in float32, 4 in a 16-bit
    copy) cover T_f = 5."""
    monkeypatch.setattr(step_kernels, "_TILE_BYTES", 64)
    run_case(H2SVCConfig(**{**CONFIG, "tokens_per_frame": 5}), case, "triton", seed=100 + TILED_CASES.index(case))


def launches_for(cls: int, num_layers: int, B: int) -> int:
    cfg = H2SVCConfig(**{**CONFIG, "num_layers": num_layers})
    case = Case(cls, cfg.window(cls), 2, "1d", False, F32, "contiguous", B=B)
    block = make_block(cfg, case, seed=num_layers)
    args, kwargs = step_args(cfg, case, block)
    before = launch_count()
    hk.h2svc_step(*args, **kwargs, backend="triton")
    return launch_count() - before


@pytest.mark.parametrize("cls, launches", [(EPISODIC, 3), (SHORT, 1)])
def test_triton_launch_count_independent_of_rows_and_streams(cls, launches):
    counts = {(L, B): launches_for(cls, L, B) for L, B in [(2, 1), (4, 1), (2, 2)]}
    assert set(counts.values()) == {launches}, f"launches per step: {counts}"


@pytest.mark.skipif(DEVICE != "cuda", reason="host synchronisation is a CUDA matter: CPU tensors never wait")
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_no_host_sync_on_cuda(backend):
    """A step on CUDA tensors never waits for the device (the caller's host ints decide everything); checked by
    torch's sync debug mode, after a warm-up step that compiles the kernels."""
    cfg = config()
    for case in (Case(EPISODIC, 4, 3, "mrope", True, F16, "view"), Case(SHORT, 3, 2, "1d", False, BF16, "contiguous")):
        for attempt in range(2):
            args, kwargs = step_args(cfg, case, make_block(cfg, case, seed=attempt))
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error" if attempt else "default")
            try:
                hk.h2svc_step(*args, **kwargs, backend=backend)
            finally:
                torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_bad_input_raises_before_writing(backend):
    cfg = config()
    case = Case(EPISODIC, 4, 2, "mrope", True, F32, "contiguous")
    block = make_block(cfg, case, seed=99)
    args, kwargs = step_args(cfg, case, block)
    keys, values, positions, slot_frames, _, cls, inv_freq, section = args
    snapshot = [t.clone() for t in block.tensors()]
    twice = slot_frames.clone()
    twice[0, 0, 1] = twice[0, 0, 0]
    nan_values = values.clone()
    nan_values[1, 0, cfg.prefix_len + 4 * cfg.tokens_per_frame, 2] = float("nan")  # an arriving frame's token

    def call(error, name, *changes, **kw):
        """A call with positional `changes` and keyword changes: `features=` replaces the features, any other
        keyword a field of the clock (the clock is built inside the raises block: its own checks count too)."""
        changed = list(args)
        for index, value in changes:
            changed[index] = value
        return error, name, changed, kw

    bad = [
        call(ValueError, "keys", (0, keys[0])),
        call(TypeError, "values", (1, values.half())),
        call(ValueError, "positions", (2, positions[:, :, 0])),
        call(TypeError, "positions", (2, positions.float())),
        call(ValueError, "slot_frames", (3, slot_frames[..., :-1])),
        call(TypeError, "cfg", (4, cfg.__dict__)),
        call(ValueError, "cls", (5, 3)),
        call(ValueError, "inv_freq", (6, inv_freq[:-1])),
        call(ValueError, "rotary", (7, [2, 3, 4])),
        call(ValueError, "rotary", (7, INTERLEAVED[128])),
        call(ValueError, "positions", (7, RotaryLayout.one_d(8))),
        call(ValueError, r"clock\.held", held=5),
        call(ValueError, r"clock\.num_frames", num_frames=0),
        call(ValueError, "keys", num_frames=3),  # the block has room for held + 2 frames only
        call(TypeError, r"clock\.reindexed", reindexed=True),
        call(TypeError, r"clock\.reindexed", reindexed=torch.tensor(1)),
        call(ValueError, r"clock\.next_position", next_position=cfg.prefix_len + 4 * cfg.tokens_per_frame - 1),
        call(TypeError, "features", features=None),
        call(ValueError, "features", features=block.features[..., :-1]),
        call(TypeError, r"clock\.first_frame", first_frame=None),
    ]
    if DEVICE == "cpu":  # contents checks run on CPU tensors only (a GPU read would be a host sync)
        bad += [call(ValueError, "slot_frames", (3, twice)),
                call(ValueError, r"clock\.first_frame", first_frame=int(slot_frames.max())),
                call(ValueError, "values", (1, nan_values))]
    for error, name, call_args, changes in bad:
        with pytest.raises(error, match=f"^{name}"):
            features = changes.pop("features", kwargs["features"])
            clock = dataclasses.replace(kwargs["clock"], **changes)
            hk.h2svc_step(*call_args, clock=clock, features=features, backend=backend)
    with pytest.raises(TypeError, match="^clock"):
        hk.h2svc_step(*args, clock=dataclasses.asdict(kwargs["clock"]), features=block.features, backend=backend)
    fifo = Case(SHORT, 3, 1, "1d", False, F32, "contiguous")
    fifo_block = make_block(cfg, fifo, seed=98)
    fifo_args, fifo_kwargs = step_args(cfg, fifo, fifo_block)
    with pytest.raises(ValueError, match="^features"):
        hk.h2svc_step(*fifo_args, **{**fifo_kwargs, "features": block.features}, backend=backend)
    with pytest.raises(ValueError, match="^backend"):
        hk.h2svc_step(*args, **kwargs, backend="cuda")
    for before, after in zip(snapshot, block.tensors()):
        assert same_bytes(before, after)


@pytest.mark.skipif(DEVICE != "cpu", reason="the C re-index plans CPU tensors only")
@pytest.mark.parametrize("axes", [1, 3])
def test_c_reindex_plans_like_the_torch_ops(axes, monkeypatch):
    """Step 4's plan in C (compact_cpu.c `hermes_frame_reindex`: the old positions gathered through the slot plan,
    per-axis counting ranks, right alignment) against the sort ranks of the torch ops on GPUs, exactly: strided
    positions, repeated and negative coordinates, sources in home and overflow slots, two streams, E set by
    different axes in different rows. Positions are only read. A row whose span is too wide to count returns None
    (the torch ops then plan); with HERMES_KERNELS_NATIVE=0 it returns None without calling C."""
    require_c_library("compact_cpu")
    g = torch.Generator().manual_seed(99)
    H, B, P, T, W, held, spare = 3, 2, 2, 3, 4, 4, 2
    C = P + (W + 3) * T
    for trial in range(12):
        spread = 1 if trial < 10 else 1 << 20  # the last two: spans past the counting bound
        buffer = torch.randint(-30, 30, (H, B, axes, C + spare), generator=g) * spread
        pos = buffer[..., :C]  # a view: rows strided past C
        if trial % 3 == 0 and axes == 3:
            pos[0, :, 1] = pos[0, :, 0] * 2  # a row where the height axis has the most distinct values
        source = torch.stack([torch.randperm(W + 3, generator=g)[:held] for _ in range(H * B)]).view(H, B, held)
        next_position = 500 + trial
        before = buffer.clone()
        got = step_kernels._reindex_native(pos, source, P, T, next_position)
        assert torch.equal(buffer, before), "the C plan wrote positions"
        if spread > 1:
            assert got is None
            continue
        old = pos.gather(-1, step_kernels._tokens(source, P, T).unsqueeze(2).expand(H, B, axes, held * T))
        rank = dense_rank(old, torch.ones(1, dtype=torch.bool))  # the sort rank: no C involved
        extent = rank.amax(dim=-1).amax(dim=-1).view(H, B, 1, 1) + 1
        want = rank + next_position - extent
        assert got is not None
        assert torch.equal(got[0], want) and torch.equal(got[1], want - old)
        assert int(got[0].amax()) == next_position - 1
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    assert step_kernels._reindex_native(pos, source, P, T, 500) is None

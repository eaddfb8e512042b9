"""Stage 4, in-place compaction: hermes_kernels.compact on both backends against
hermes_kernels.policies.hermes.reference.compact.

Every test builds a fresh cache (seeded), runs the reference on a clone, and checks the fast path: same length and
re-index flag, positions equal in the first `length` slots, kept values bit-equal, kept keys bit-equal when nothing
is re-indexed (a zero delta is an exact identity) and within the dtype's tolerance otherwise, summary tokens within
tolerance, slots from `length` on untouched, the same storage, and nothing written past N of a larger buffer.
Scratch memory of both backends is poisoned (NaN / int minimum / True) so a read of an unwritten word shows up.
Gemma 4's full-attention layers (D 512, proportional RoPE: 1D over every pair, most of them at frequency 0) are in
the grid, and a re-index leaves their zero-frequency channels bit for bit on every backend.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import hermes_kernels as hk
from hermes_kernels.engine import bindings, native, ranks, rows_native, rows_torch, workspace
from hermes_kernels.policies.hermes import compaction as compact_module
from hermes_kernels.policies.hermes import compaction_triton
from hermes_kernels import HermesConfig
from hermes_kernels.policies.hermes import reference as ref
from hermes_kernels.rope import RotaryLayout, rotary_cos_sin
from hermes_kernels.engine.launch import launch_count
from tests.utils import DEVICE, TORCH_OPS
from scaffolding.rotary import proportional_inv_freq
from tests.utils import (INTERLEAVED, PARTIAL, QWEN3_5_ROTARY, TOL, assert_close_verbose, assert_tails_equal,
                         distinct_attention, frozen_channels, inv_freq_for, inv_freq_of, poison_tail_,
                         require_c_library, rope_id, rotary_width, same_bytes, synthetic_positions)


BACKENDS = ["torch", TORCH_OPS, "triton"]
SPARE = 5  # buffer slots past N in "view" layouts, poisoned and checked untouched
POSITION_POISON = -(2 ** 40)
PROPORTIONAL = "proportional"  # Case.inv_freq: Gemma 4's proportional RoPE (scaffolding.rotary)


@dataclass(frozen=True)
class Case:
    preset: str
    L: int
    B: int
    Hkv: int
    D: int
    P: int
    V: int
    budget: int
    dtype: torch.dtype
    section: tuple[int, int, int] | RotaryLayout | None  # 1D, contiguous pair counts, or a layout (interleaved)
    mode: str  # "eager", "lazy-below" (positions far from the limit), "lazy-above" (past max_positions - margin)
    summary: bool
    layout: str  # "view": buffer[..., :N, :] of a larger poisoned buffer; "contiguous"
    inv_freq: str = "default"  # "default": default RoPE over R; PROPORTIONAL: 1D over D/2 pairs, most at frequency 0

    @property
    def id(self) -> str:
        rope = rope_id(self.section, self.D) + ("-prop" if self.inv_freq == PROPORTIONAL else "")
        return (f"{self.preset}-L{self.L}B{self.B}Hkv{self.Hkv}D{self.D}P{self.P}V{self.V}b{self.budget}-"
                f"{str(self.dtype)[6:]}-{rope}-{self.mode}-s{int(self.summary)}-{self.layout}")

    @property
    def mrope(self) -> bool:
        """Positions carry three axes (t, h, w)."""
        return self.section is not None and RotaryLayout.of(self.section, self.R // 2).num_axes == 3

    @property
    def R(self) -> int:
        """Rotary channels of a head: D, or fewer for a partial-rotary layout."""
        return rotary_width(self.D, self.section)


F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
CASES = [
    # V above budget, 1D, both layouts, all presets, all three re-index modes
    Case("llava_ov", 4, 1, 1, 64, 14, 37, 16, F32, None, "eager", True, "view"),
    Case("llava_ov", 5, 3, 3, 128, 0, 29, 12, F16, None, "lazy-below", True, "contiguous"),
    Case("llava_ov", 3, 1, 3, 128, 14, 45, 44, F32, None, "lazy-above", True, "contiguous"),
    Case("paper", 4, 2, 1, 64, 0, 27, 9, BF16, None, "lazy-above", False, "view"),
    Case("paper", 4, 1, 3, 64, 14, 31, 7, F64, None, "eager", True, "view"),
    Case("paper", 3, 2, 2, 256, 14, 33, 12, F32, None, "eager", True, "view"),
    # V at budget: deep layers prune exactly one token into the summary
    Case("llava_ov", 4, 3, 1, 64, 14, 23, 23, BF16, None, "lazy-above", True, "view"),
    Case("paper", 4, 1, 3, 64, 0, 26, 26, F16, None, "eager", False, "view"),
    # V below budget: nothing pruned, no summary
    Case("llava_ov", 4, 1, 1, 64, 14, 1, 5, F32, None, "eager", True, "contiguous"),
    Case("qwen2_5_vl", 4, 1, 1, 128, 0, 21, 30, BF16, (16, 24, 24), "lazy-above", True, "contiguous"),
    Case("qwen2_5_vl", 4, 3, 1, 16, 0, 19, 40, F32, (2, 3, 3), "eager", False, "view"),
    # odd row sizes (16 and 48 bytes: not whole 32-byte vectors) with kept rows beside moved ones
    Case("llava_ov", 4, 2, 2, 8, 3, 29, 11, BF16, None, "eager", True, "contiguous"),
    Case("qwen2_5_vl", 4, 1, 2, 12, 3, 27, 10, F32, (2, 2, 2), "lazy-below", True, "contiguous"),
    # M-RoPE above budget
    Case("qwen2_5_vl", 4, 2, 3, 16, 14, 33, 10, F32, (2, 3, 3), "eager", True, "view"),
    Case("qwen2_5_vl", 5, 3, 1, 128, 14, 41, 19, F16, (16, 24, 24), "lazy-below", False, "view"),
    Case("paper", 4, 2, 1, 16, 14, 30, 7, BF16, (2, 3, 3), "lazy-above", True, "contiguous"),
    Case("qwen2_5_vl", 4, 1, 3, 128, 0, 35, 13, F32, (16, 24, 24), "lazy-above", True, "view"),
    # interleaved M-RoPE (Qwen3-VL): the 8B layout and small ones, odd row sizes (48 and 16 bytes) included
    Case("qwen3_vl", 4, 2, 3, 16, 14, 33, 10, F32, INTERLEAVED[16], "eager", True, "view"),
    Case("qwen3_vl", 5, 3, 1, 128, 14, 41, 19, F16, INTERLEAVED[128], "lazy-above", True, "view"),
    Case("qwen3_vl", 4, 1, 3, 128, 0, 35, 13, BF16, INTERLEAVED[128], "eager", True, "contiguous"),
    Case("qwen3_vl", 4, 1, 2, 12, 3, 27, 10, F32, INTERLEAVED[12], "lazy-above", True, "contiguous"),
    Case("qwen3_vl", 4, 2, 2, 8, 3, 29, 11, BF16, INTERLEAVED[8], "eager", True, "view"),
    Case("qwen3_vl", 4, 1, 3, 16, 0, 26, 26, F64, INTERLEAVED[16], "lazy-above", True, "view"),
    # partial rotary (Qwen3.5): keys turn in channels [0, R) only, [R, D) move as bytes (poisoned: −0.0, NaN)
    Case("qwen3_vl", 4, 2, 3, 32, 3, 29, 11, F32, PARTIAL["il"][1], "eager", True, "view"),
    Case("qwen3_vl", 4, 1, 2, 32, 14, 33, 10, BF16, PARTIAL["il"][1], "lazy-above", True, "contiguous"),
    Case("qwen3_vl", 5, 3, 1, 32, 0, 27, 9, F16, PARTIAL["il"][1], "lazy-below", True, "view"),
    Case("qwen3_vl", 4, 1, 3, 32, 3, 26, 26, F64, PARTIAL["il"][1], "eager", True, "contiguous"),
    Case("llava_ov", 4, 2, 2, 16, 3, 31, 12, BF16, PARTIAL["1d"][1], "eager", True, "view"),
    Case("llava_ov", 4, 1, 1, 16, 0, 21, 30, F32, PARTIAL["1d"][1], "lazy-above", False, "contiguous"),
    # Gemma 4's full-attention layers: D 512 (and 256), 1D RoPE over all D/2 pairs, proportional inv_freq (the first
    # D/8 pairs turn, the others have frequency 0)
    Case("llava_ov", 3, 1, 2, 512, 3, 13, 6, BF16, None, "eager", True, "view", PROPORTIONAL),
    Case("llava_ov", 2, 2, 1, 512, 0, 11, 5, F32, None, "lazy-above", True, "contiguous", PROPORTIONAL),
    Case("paper", 3, 1, 1, 512, 14, 10, 4, F16, None, "lazy-below", True, "view", PROPORTIONAL),
    Case("llava_ov", 2, 1, 1, 512, 2, 9, 9, F64, None, "eager", True, "contiguous", PROPORTIONAL),
    Case("llava_ov", 3, 2, 1, 256, 3, 15, 6, F16, None, "eager", True, "contiguous", PROPORTIONAL),
]


@pytest.fixture(autouse=True)
def poisoned_scratch(monkeypatch):
    """Route both backends' work memory through a poisoning allocator."""
    def scratch(shape, dtype, device):
        out = torch.empty(shape, dtype=dtype, device=device)
        if dtype.is_floating_point:
            return out.fill_(float("nan"))
        return out.fill_(True if dtype == torch.bool else torch.iinfo(dtype).min)
    monkeypatch.setattr(workspace, "scratch", scratch)


def make_config(case: Case) -> tuple[HermesConfig, int]:
    """The case's config and the first visual position (past max_positions - margin for "lazy-above")."""
    reindex = "eager" if case.mode == "eager" else "lazy"
    limits = dict(max_positions=1000, margin=64) if case.mode == "lazy-above" else {}
    cfg = getattr(HermesConfig, case.preset)(case.L, case.budget, case.P, reindex=reindex, summary=case.summary,
                                             **limits)
    return cfg, (1000 if case.mode == "lazy-above" else 0)


def make_cache(case: Case, g: torch.Generator, positions: torch.Tensor | None = None):
    """keys, values [L, B, Hkv, N, D], positions, and the buffers they view (None when contiguous)."""
    L, B, Hkv, D, P, V = case.L, case.B, case.Hkv, case.D, case.P, case.V
    N = P + V
    _, start = make_config(case)
    data = [torch.randn(L, B, Hkv, N, D, generator=g).to(case.dtype) for _ in range(2)]
    if positions is None:
        positions = synthetic_positions(L, B, N, P, g, mrope=case.mrope, start=start)
    if case.layout == "contiguous":
        return data[0].to(DEVICE), data[1].to(DEVICE), positions.to(DEVICE), None
    buffers = [torch.full((L, B, Hkv, N + SPARE, D), float("nan"), dtype=case.dtype) for _ in range(2)]
    for buf, x in zip(buffers, data):
        buf[..., :N, :] = x
    pos_buf = torch.full((*positions.shape[:-1], N + SPARE), POSITION_POISON, dtype=torch.int64)
    pos_buf[..., :N] = positions
    buffers = [t.to(DEVICE) for t in (*buffers, pos_buf)]
    return buffers[0][..., :N, :], buffers[1][..., :N, :], buffers[2][..., :N], buffers


def setup_case(case: Case, seed: int, positions: torch.Tensor | None = None, cfg: HermesConfig | None = None):
    """(cfg, keys, values, positions, buffers, attn, keep, inv_freq, rotary) of one fresh seeded cache;
    keep is the reference's selection from attn, inv_freq [R/2]. With partial rotary the tails of the rows that
    stay or move are poisoned (`poison_tail_`: −0.0 and a NaN with a payload); pruned rows keep finite tails, which
    a summary averages."""
    g = torch.Generator().manual_seed(seed)
    cfg = make_config(case)[0] if cfg is None else cfg
    keys, values, positions, buffers = make_cache(case, g, positions)
    attn = distinct_attention(case.L, case.B, case.V, g, device=DEVICE)
    keep = ref.select_keep(ref.hermes_scores(attn, cfg), cfg)
    inv_freq = (proportional_inv_freq(case.D, device=DEVICE) if case.inv_freq == PROPORTIONAL
                else inv_freq_of(case.D, case.section, device=DEVICE))
    if case.R < case.D:
        poison_tail_(keys, case.R, carried_rows(case, keep))
    return cfg, keys, values, positions, buffers, attn, keep, inv_freq, case.section


def carried_rows(case: Case, keep: torch.Tensor) -> torch.Tensor:
    """bool [L, B, 1, N]: the slots whose keys the step keeps (the prefix and the kept visual tokens)."""
    rows = torch.zeros(case.L, case.B, case.P + case.V, dtype=torch.bool, device=keep.device)
    rows[..., :case.P] = True
    rows.scatter_(2, case.P + keep.clamp(min=0), keep >= 0)
    return rows.unsqueeze(2)


def assert_compacted_like(case: Case, got, expected, length: int, keep: torch.Tensor, compacted: bool,
                          buffers) -> None:
    """got (keys, values, positions) after the fast path == expected after the reference, `length` slots valid:
    positions equal, keys (their rotary channels [0, R)) and values within the dtype's tolerance, kept values (and
    keys when nothing was re-indexed) bit-exact, a partial-rotary key's tail [R, D) byte-equal in kept slots and
    within tolerance in a summary slot, slots from `length` on untouched, nothing written past N of a larger
    buffer."""
    keys, values, positions = got
    rk, rv, rp = expected
    n, R = length, case.R
    assert torch.equal(positions[..., :n].cpu(), rp[..., :n].cpu()), "positions differ"
    atol, rtol = TOL[case.dtype]
    assert_close_verbose(keys[..., :n, :R], rk[..., :n, :R], atol, rtol, "keys")
    assert_close_verbose(values[..., :n, :], rv[..., :n, :], atol, rtol, "values")
    # kept rows (all but a summary slot) are copies, and keys are exact too when positions are not re-indexed
    kept = (keep >= 0).sum(dim=-1).cpu()
    slot = torch.arange(n)
    assert_tails_equal(keys[..., :n, :], rk[..., :n, :], R, (slot < case.P + kept[..., None]).unsqueeze(2))
    for layer in range(case.L):
        for b in range(case.B):
            end = case.P + int(kept[layer, b])
            assert torch.equal(values[layer, b, :, :end].cpu(), rv[layer, b, :, :end].cpu()), \
                f"kept values of layer {layer} stream {b} are not bit-exact copies"
            if not compacted:
                assert same_bytes(keys[layer, b, :, :end], rk[layer, b, :, :end]), \
                    f"keys of layer {layer} stream {b} changed although nothing was re-indexed"
    # slots from `length` on are left as they were, and nothing past N of the buffer is touched
    assert same_bytes(keys[..., n:, :], rk[..., n:, :])
    assert same_bytes(values[..., n:, :], rv[..., n:, :])
    assert torch.equal(positions[..., n:].cpu(), rp[..., n:].cpu())
    if buffers is not None:
        N = case.P + case.V
        assert torch.isnan(buffers[0][..., N:, :]).all() and torch.isnan(buffers[1][..., N:, :]).all(), \
            "wrote past N"
        assert (buffers[2][..., N:] == POSITION_POISON).all(), "wrote positions past N"


def gather_bytes(x: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
    """x.gather(dim, index) of the raw bits (torch's bf16 gather on CPU rewrites NaN payloads)."""
    bits = {8: torch.int64, 4: torch.int32, 2: torch.int16}[x.element_size()]
    return x.view(bits).gather(dim, index).view(x.dtype)


def assert_tails_carried(case: Case, before: torch.Tensor, keys: torch.Tensor, keep: torch.Tensor) -> None:
    """Partial rotary, without the reference: kept token i's tail [R, D) in slot P + i is the bytes of its source
    slot's tail before the step, and the prefix's tails are untouched."""
    if case.R == case.D:
        return
    P, n = case.P, keep.shape[-1]
    valid = (keep >= 0).cpu()
    source = (P + keep.clamp(min=0)).cpu().view(case.L, case.B, 1, n, 1).expand(-1, -1, case.Hkv, -1, case.D)
    moved = gather_bytes(before.cpu(), 3, source)[..., case.R:]
    landed = keys[..., P:P + n, case.R:].cpu()
    rows = valid.view(case.L, case.B, 1, n).expand(-1, -1, case.Hkv, -1)
    assert same_bytes(landed[rows], moved[rows]), "a kept key's tail is not the bytes of its source's tail"
    assert same_bytes(keys[..., :P, case.R:], before[..., :P, case.R:]), "a prefix key's tail changed"


def compacts_like_the_reference(case: Case, cfg, keys, values, positions, buffers, keep, inv_freq, section,
                                compact) -> tuple[int, bool, tuple]:
    """Run the reference on clones and `compact()` (the fast path, in place on keys/values/positions; returns
    (length, flag)); assert everything matches. Returns (length, flag, the reference's keys, values, positions)."""
    rk, rv, rp = keys.clone(), values.clone(), positions.clone()
    before = keys.clone()
    ref_length, ref_flag = ref.compact(rk, rv, rp, keep, cfg, inv_freq, section)

    storage = [t.data_ptr() for t in (keys, values, positions)]
    length, flag = compact()
    assert_tails_carried(case, before, keys, keep)

    assert [t.data_ptr() for t in (keys, values, positions)] == storage, "not in place"
    assert isinstance(length, int) and length == ref_length
    assert isinstance(flag, torch.Tensor) and flag.dtype == torch.bool and flag.dim() == 0
    assert flag.device == keys.device and bool(flag) == bool(ref_flag)
    assert_compacted_like(case, (keys, values, positions), (rk, rv, rp), length, keep, bool(ref_flag), buffers)
    return length, bool(flag), (rk, rv, rp)


def run_case(case: Case, backend: str, seed: int, positions: torch.Tensor | None = None,
             cfg: HermesConfig | None = None) -> bool:
    """Compact one cache with `backend` and with the reference; assert everything matches. Returns the flag."""
    cfg, keys, values, positions, buffers, _, keep, inv_freq, section = setup_case(case, seed, positions, cfg)
    return compacts_like_the_reference(
        case, cfg, keys, values, positions, buffers, keep, inv_freq, section,
        lambda: hk.compact(keys, values, positions, keep, cfg, inv_freq, section, backend=backend))[1]


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_matches_reference(case, backend):
    compacted = run_case(case, backend, seed=CASES.index(case))
    assert compacted == (case.mode != "lazy-below")


@pytest.mark.parametrize("backend", ["reference", *BACKENDS], indirect=True)
@pytest.mark.parametrize("D, dtype", [(512, BF16), (512, F32), (256, F16)], ids=str)
def test_zero_frequencies_leave_their_channels_bit_for_bit(D, dtype, backend):
    """Proportional RoPE (Gemma 4's full-attention layers): an eager re-index turns every kept key by its delta, on
    every backend and in the reference; the channels of its zero-frequency pairs, [D/8, D/2) and [5D/8, D), are the
    bytes of its source slot, and every key whose position changed turned in some other channel."""
    case = Case("llava_ov", 3, 2, 2, D, 3, 17, 7, dtype, None, "eager", True, "view", PROPORTIONAL)
    cfg, keys, values, positions, _, _, keep, inv_freq, _ = setup_case(case, seed=90)
    before, old = keys.clone(), positions.clone()
    if backend == "reference":
        ref.compact(keys, values, positions, keep, cfg, inv_freq)
    else:
        hk.compact(keys, values, positions, keep, cfg, inv_freq, backend=backend)
    P, n = case.P, keep.shape[-1]
    source = (P + keep.clamp(min=0)).cpu()  # [L, B, n]: the slot each kept token came from
    rows = (keep >= 0).cpu().unsqueeze(2).expand(-1, -1, case.Hkv, -1)  # [L, B, Hkv, n]
    moved = gather_bytes(before.cpu(), 3, source.view(case.L, case.B, 1, n, 1).expand(-1, -1, case.Hkv, -1, D))
    landed = keys[..., P:P + n, :].cpu()
    frozen = frozen_channels(inv_freq)
    assert int(frozen.sum()) == 2 * (D // 2 - D // 8)
    assert same_bytes(landed[rows][:, frozen], moved[rows][:, frozen]), "a zero-frequency channel changed"
    turned = rows & (positions[..., P:P + n].cpu() != old.cpu().gather(2, source)).unsqueeze(2)
    assert turned.any() and (landed[turned][:, ~frozen] != moved[turned][:, ~frozen]).any(dim=-1).all()


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("spread", [1, 2 ** 36], ids=["narrow", "wide"])
@pytest.mark.parametrize("section", [None, (2, 3, 3)])
def test_dense_rank_of_arbitrary_positions(section, spread, backend):
    """Positions in no order, with repeats on every axis: ranks still equal the reference's (torch.unique).
    `wide`: the values span 2**40, so the Triton rank kernel's radix sort takes ten digit passes, not one."""
    case = Case("qwen2_5_vl", 4, 2, 2, 16 if section else 64, 3, 29, 11, F32, section, "eager", True, "view")
    g = torch.Generator().manual_seed(11)
    shape = (case.L, case.B, 3, case.P + case.V) if section else (case.L, case.B, case.P + case.V)
    positions = torch.randint(0, 12, shape, generator=g) * spread + torch.randint(0, 3, shape, generator=g)
    run_case(case, backend, seed=12, positions=positions)


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("section", [None, (2, 3, 3)])
def test_lazy_threshold_is_strict(section, backend):
    """Lazy re-indexing starts once the largest position exceeds max_positions - margin, not when it equals it."""
    case = Case("qwen2_5_vl", 4, 2, 1, 16, 3, 25, 10, F32, section, "lazy-below", True, "view")
    g = torch.Generator().manual_seed(21)
    positions = synthetic_positions(case.L, case.B, case.P + case.V, case.P, g, mrope=section is not None,
                                    start=500)
    top, margin = int(positions.max()), 64
    for max_positions, expected in ((top + margin, False), (top + margin - 1, True)):
        cfg = HermesConfig.qwen2_5_vl(case.L, case.budget, case.P, max_positions=max_positions, margin=margin)
        assert run_case(case, backend, seed=22, positions=positions, cfg=cfg) == expected


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_many_tiles_move_left_to_right(backend, monkeypatch):
    """Tiles far smaller than the cache: in-place safety across tile and chunk boundaries."""
    monkeypatch.setattr(rows_torch, "TILE_ELEMENTS", 3 * 256)  # torch: 3 tokens per tile (L·B·Hkv·D = 256)
    monkeypatch.setattr(compaction_triton, "_MOVE_TOKENS", 8)
    monkeypatch.setattr(compaction_triton, "_CHUNK", 16)
    for seed, case in enumerate([
            Case("qwen2_5_vl", 4, 2, 2, 16, 14, 67, 29, BF16, (2, 3, 3), "eager", True, "view"),
            Case("llava_ov", 4, 1, 1, 64, 3, 70, 50, F32, None, "lazy-below", True, "view")]):
        run_case(case, backend, seed=40 + seed)


def launches_for(L: int, B: int) -> int:
    case = Case("llava_ov", L, B, 1, 16, 2, 12, 6, F32, None, "eager", True, "contiguous")
    before = launch_count()
    run_case(case, "triton", seed=L + B)
    return launch_count() - before


def test_triton_launch_count_independent_of_layers_and_streams():
    counts = {(L, B): launches_for(L, B) for L, B in [(2, 1), (28, 1), (2, 3)]}
    assert len(set(counts.values())) == 1, f"launches per step vary: {counts}"
    assert counts[(2, 1)] == 3, f"expected the rank, plan and move launches, got {counts[(2, 1)]}"


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_bad_input_raises_before_writing(backend):
    case = Case("qwen2_5_vl", 4, 1, 2, 16, 2, 10, 5, F32, (2, 3, 3), "eager", True, "contiguous")
    cfg = make_config(case)[0]
    g = torch.Generator().manual_seed(31)
    keys, values, positions, _ = make_cache(case, g)
    keep = ref.select_keep(ref.hermes_scores(distinct_attention(4, 1, 10, g), cfg), cfg).to(DEVICE)
    inv_freq = inv_freq_for(16, device=DEVICE)
    snapshot = [t.clone() for t in (keys, values, positions)]
    bad_calls = [
        (ValueError, "keep", (keys, values, positions, keep[..., :-1], cfg, inv_freq, [2, 3, 3])),
        (TypeError, "keep", (keys, values, positions, keep.to(torch.int32), cfg, inv_freq, [2, 3, 3])),
        (TypeError, "positions", (keys, values, positions.float(), keep, cfg, inv_freq, [2, 3, 3])),
        (ValueError, "positions", (keys, values, positions, keep, cfg, inv_freq, None)),
        (ValueError, "rotary", (keys, values, positions, keep, cfg, inv_freq, [2, 3, 4])),
        (ValueError, "rotary", (keys, values, positions, keep, cfg, inv_freq, INTERLEAVED[128])),
        (ValueError, "positions", (keys, values, positions, keep, cfg, inv_freq, RotaryLayout.one_d(8))),
        (ValueError, "positions", (keys, values, positions[:, :, 0], keep, cfg, inv_freq, INTERLEAVED[16])),
        (TypeError, "rotary", (keys, values, positions, keep, cfg, inv_freq, "t, h, w")),
        (ValueError, "inv_freq", (keys, values, positions, keep, cfg, inv_freq[:-1], [2, 3, 3])),
        (ValueError, "inv_freq", (keys, values, positions, keep, cfg, inv_freq, RotaryLayout.interleaved((2, 1, 1)))),
        (TypeError, "values", (keys, values.half(), positions, keep, cfg, inv_freq, [2, 3, 3])),
    ]
    for error, name, args in bad_calls:
        with pytest.raises(error, match=name):
            hk.compact(*args, backend=backend)
    for before, after in zip(snapshot, (keys, values, positions)):
        assert torch.equal(before, after)


# ---- layer ranges of a split cache, the caller's re-index flag, and the multi-stack step ----------------------
# (case, layer ranges, shifted): "shifted" moves the last layer's visual positions 1000 up, past the lazy threshold
# of the "lazy-above" config (max_positions 1000, margin 64) while every other layer stays far below it, so only
# one decision for the whole cache re-indexes the other ranges too.
SPLIT_CASES = [
    (Case("llava_ov", 5, 2, 1, 64, 3, 29, 12, F16, None, "lazy-above", True, "view"), ((0, 2), (2, 4), (4, 5)), True),
    (Case("qwen2_5_vl", 4, 1, 2, 16, 2, 25, 9, BF16, (2, 3, 3), "lazy-above", True, "view"), ((0, 3), (3, 4)), True),
    (Case("paper", 4, 2, 1, 64, 14, 21, 8, F32, None, "eager", True, "contiguous"), ((0, 1), (1, 4)), False),
    (Case("qwen2_5_vl", 4, 2, 1, 16, 0, 19, 7, F32, (2, 3, 3), "lazy-below", False, "view"), ((0, 2), (2, 4)), False),
    (Case("qwen3_vl", 4, 1, 2, 16, 2, 25, 9, BF16, INTERLEAVED[16], "lazy-above", True, "view"), ((0, 3), (3, 4)),
     True),
    (Case("qwen3_vl", 4, 2, 2, 32, 2, 25, 9, F16, PARTIAL["il"][1], "lazy-above", True, "view"), ((0, 1), (1, 4)),
     True),
]


def split_id(split) -> str:
    case, ranges, shifted = split
    return f"{case.id}-{'_'.join(f'{a}:{b}' for a, b in ranges)}{'-shifted' if shifted else ''}"


def split_positions(case: Case, seed: int, shifted: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    positions = synthetic_positions(case.L, case.B, case.P + case.V, case.P, g, mrope=case.mrope)
    if shifted:
        positions[-1, ..., case.P:] += 1000
    return positions


def assert_shared_flag_matters(positions: torch.Tensor, cfg: HermesConfig, shifted: bool) -> None:
    """With a shifted last layer the whole cache re-indexes while the other layers alone would not: a stack
    deciding on its own positions would get a different result."""
    if shifted:
        assert bool(ref.decide_reindex(positions, cfg)) and not bool(ref.decide_reindex(positions[:-1], cfg))


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("split", SPLIT_CASES, ids=split_id)
def test_layer_ranges_with_a_shared_flag_equal_the_whole_cache(split, backend):
    """hk.compact over consecutive layer ranges, each with its own layers' roles and budgets and the flag decided
    for the whole cache, gives the reference's whole-cache compaction; still three launches per range (Triton),
    and the caller's flag comes back unchanged."""
    case, ranges, shifted = split
    seed = SPLIT_CASES.index(split)
    cfg, keys, values, positions, buffers, _, keep, inv_freq, section = setup_case(
        case, 50 + seed, split_positions(case, 60 + seed, shifted))
    assert_shared_flag_matters(positions, cfg, shifted)
    rk, rv, rp = keys.clone(), values.clone(), positions.clone()
    ref_length, ref_flag = ref.compact(rk, rv, rp, keep, cfg, inv_freq, section)
    flag = ref.decide_reindex(positions, cfg)
    for start, stop in ranges:
        before = launch_count()
        length, used = hk.compact(keys[start:stop], values[start:stop], positions[start:stop], keep[start:stop], cfg,
                                  inv_freq, section, backend=backend, layers=range(start, stop), reindexed=flag)
        assert length == ref_length and used is flag
        assert launch_count() - before == (3 if backend == "triton" else 0)
    assert bool(flag) == bool(ref_flag)
    assert_compacted_like(case, (keys, values, positions), (rk, rv, rp), ref_length, keep, bool(ref_flag), buffers)


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("section", [None, (2, 3, 3)])
@pytest.mark.parametrize("mode, flag", [("lazy-below", True), ("eager", False)])
def test_explicit_flag_wins_over_the_config(mode, flag, section, backend):
    """The caller's flag decides, whatever cfg.reindex says: lazy below the threshold with True compacts as an
    eager config does; eager with False keeps the positions as a lazy config below the threshold does."""
    case = Case("qwen2_5_vl", 4, 2, 2, 16, 3, 25, 9, F32, section, mode, True, "view")
    cfg, keys, values, positions, buffers, _, keep, inv_freq, section = setup_case(case, 70 + int(flag))
    deciding = cfg.replace(reindex="eager" if flag else "lazy")  # positions start at 0: far below the limit
    rk, rv, rp = keys.clone(), values.clone(), positions.clone()
    ref_length, ref_flag = ref.compact(rk, rv, rp, keep, deciding, inv_freq, section)
    assert bool(ref_flag) == flag
    given = torch.tensor(flag, device=DEVICE)
    length, used = hk.compact(keys, values, positions, keep, cfg, inv_freq, section, backend=backend,
                              reindexed=given)
    assert length == ref_length and used is given and bool(given) == flag
    assert_compacted_like(case, (keys, values, positions), (rk, rv, rp), length, keep, flag, buffers)


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_bad_layers_or_flag_raise_before_writing(backend):
    case = Case("llava_ov", 4, 1, 2, 16, 2, 10, 5, F32, None, "eager", True, "contiguous")
    cfg, keys, values, positions, _, _, keep, inv_freq, _ = setup_case(case, 80)
    snapshot = [t.clone() for t in (keys, values, positions)]
    bad = [
        (TypeError, "layers", dict(layers=[0, 1, 2, 3])),
        (ValueError, "layers", dict(layers=range(0, 4, 2))),
        (ValueError, "layers", dict(layers=range(2, 2))),
        (ValueError, "layers", dict(layers=range(1, 5))),
        (ValueError, "keys", dict(layers=range(1, 4))),
        (TypeError, "reindexed", dict(reindexed=False)),
        (TypeError, "reindexed", dict(reindexed=torch.tensor(0, device=DEVICE))),
        (ValueError, "reindexed", dict(reindexed=torch.ones(1, dtype=torch.bool, device=DEVICE))),
        (ValueError, "reindexed", dict(reindexed=torch.tensor(True, device="meta"))),
    ]
    for error, name, changes in bad:
        with pytest.raises(error, match=name):
            hk.compact(keys, values, positions, keep, cfg, inv_freq, backend=backend, **changes)
    for before, after in zip(snapshot, (keys, values, positions)):
        assert torch.equal(before, after)


def stacks_of(ranges, keys, values, positions, inv_freq) -> list:
    """compress_stacks' input: one (layers, keys, values, positions, inv_freq) per range, views of one cache."""
    return [(range(a, b), keys[a:b], values[a:b], positions[a:b], inv_freq) for a, b in ranges]


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("split", SPLIT_CASES, ids=split_id)
def test_compress_stacks_equals_the_whole_step(split, backend):
    """hk.compress_stacks over the stacks of a split cache == the reference step on the whole cache: same keep,
    scores, length and flag (one decision from all stacks), same keys/values/positions in every stack."""
    case, ranges, shifted = split
    seed = SPLIT_CASES.index(split)
    cfg, keys, values, positions, buffers, attn, _, inv_freq, section = setup_case(
        case, 90 + seed, split_positions(case, 100 + seed, shifted))
    assert_shared_flag_matters(positions, cfg, shifted)
    rk, rv, rp = keys.clone(), values.clone(), positions.clone()
    expected = ref.compress_step(rk, rv, rp, attn, cfg, inv_freq, section)
    got = hk.compress_stacks(stacks_of(ranges, keys, values, positions, inv_freq), attn, cfg, section,
                             backend=backend)
    assert got.length == expected.length and bool(got.reindexed) == bool(expected.reindexed)
    assert got.reindexed.dim() == 0 and got.reindexed.device == attn.device
    assert torch.equal(got.keep.cpu(), expected.keep.cpu()), "keep indices differ"
    assert_close_verbose(got.scores, expected.scores, 1e-5, 1e-5, "scores")
    assert_compacted_like(case, (keys, values, positions), (rk, rv, rp), got.length, expected.keep,
                          bool(expected.reindexed), buffers)


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_compress_stacks_rejects_bad_input_without_writing(backend):
    """Every stack and attn are checked first: a bad second stack leaves the valid first one untouched too."""
    case = Case("llava_ov", 4, 2, 1, 16, 2, 10, 5, F32, None, "eager", True, "contiguous")
    cfg, keys, values, positions, _, attn, _, inv_freq, _ = setup_case(case, 110)
    snapshot = [t.clone() for t in (keys, values, positions)]
    good = stacks_of(((0, 2), (2, 4)), keys, values, positions, inv_freq)
    nan_attn = attn.clone()
    nan_attn[3, 1, 0] = float("nan")
    shorter = (range(2, 4), keys[2:, :, :, :-1], values[2:, :, :, :-1], positions[2:, :, :-1], inv_freq)
    bad = [  # (error, message, stacks, attn, backend)
        (TypeError, "stacks", [], attn, backend),
        (TypeError, r"stacks\[1\]", [good[0], good[1][:4]], attn, backend),
        (TypeError, r"stacks\[1\]: layers", [good[0], ([2, 3],) + good[1][1:]], attn, backend),
        (ValueError, r"stacks\[1\]", stacks_of(((0, 2), (3, 4)), keys, values, positions, inv_freq), attn, backend),
        (ValueError, r"stacks\[1\]", stacks_of(((0, 2), (1, 4)), keys, values, positions, inv_freq), attn, backend),
        (ValueError, r"stacks\[0\]", good[::-1], attn, backend),
        (ValueError, "stacks: the layer ranges end", good[:1], attn, backend),
        (ValueError, r"stacks\[1\]", [good[0], shorter], attn, backend),
        (TypeError, r"stacks\[1\]: positions", [good[0], good[1][:3] + (positions[2:].float(), inv_freq)], attn,
         backend),
        (ValueError, r"stacks\[1\]: inv_freq", [good[0], good[1][:4] + (inv_freq[:-1],)], attn, backend),
        (ValueError, "attn: non-finite", good, nan_attn, backend),
        (ValueError, "attn", good, attn[:, :1], backend),
        (ValueError, "backend", good, attn, "cuda"),
    ]
    for error, match, stacks, attn_arg, backend_arg in bad:
        with pytest.raises(error, match=match):
            hk.compress_stacks(stacks, attn_arg, cfg, backend=backend_arg)
    for before, after in zip(snapshot, (keys, values, positions)):
        assert torch.equal(before, after)


# ---------------------------------------------------------------------------------------------------------------
# The two CPU movers of the torch backend: the C walk (compact_cpu.c) and the torch ops
# ---------------------------------------------------------------------------------------------------------------

NATIVE_CASES = [
    Case("llava_ov", 4, 3, 2, 128, 14, 45, 19, F32, None, "eager", True, "view"),
    Case("qwen2_5_vl", 4, 2, 3, 16, 3, 33, 10, F32, (2, 3, 3), "lazy-above", True, "contiguous"),
    Case("paper", 3, 1, 1, 64, 0, 27, 9, F32, None, "lazy-below", False, "view"),
    Case("llava_ov", 4, 2, 2, 128, 14, 41, 17, BF16, None, "eager", True, "view"),
    Case("qwen2_5_vl", 4, 1, 3, 128, 3, 37, 12, BF16, (16, 24, 24), "eager", True, "contiguous"),
    Case("qwen3_vl", 4, 2, 3, 16, 3, 33, 10, F32, INTERLEAVED[16], "lazy-above", True, "contiguous"),
    Case("qwen3_vl", 4, 1, 3, 128, 3, 37, 12, BF16, INTERLEAVED[128], "eager", True, "view"),
    # partial rotary: the tiny Qwen3.5's D 32, R 8 and the published D 256, R 64 (a specialised walk in C)
    Case("qwen3_vl", 4, 2, 2, 32, 3, 33, 10, F32, PARTIAL["il"][1], "eager", True, "view"),
    Case("qwen3_vl", 3, 2, 2, 256, 3, 37, 12, BF16, QWEN3_5_ROTARY, "eager", True, "contiguous"),
    Case("qwen3_vl", 3, 1, 2, 256, 14, 29, 11, F32, QWEN3_5_ROTARY, "lazy-above", True, "view"),
    Case("llava_ov", 4, 2, 1, 16, 0, 27, 9, BF16, PARTIAL["1d"][1], "lazy-below", True, "contiguous"),
    # Gemma 4's full-attention layers: D 512, 1D over 256 pairs, 192 of them at frequency 0
    Case("llava_ov", 3, 2, 2, 512, 3, 21, 8, BF16, None, "eager", True, "view", PROPORTIONAL),
    Case("llava_ov", 2, 1, 2, 512, 14, 17, 9, F32, None, "lazy-above", True, "contiguous", PROPORTIONAL),
]


def refuse(*args, **kwargs):
    raise AssertionError("this mover must not run here")


@pytest.fixture
def fresh_build():
    """Forget the built library before and after the test, so a patched compiler takes effect and the next
    test builds the real one again."""
    native._build.cache_clear()
    yield
    native._build.cache_clear()


@pytest.mark.skipif(DEVICE != "cpu", reason="the C row kernel moves CPU tensors only")
@pytest.mark.parametrize("case", NATIVE_CASES, ids=lambda c: c.id)
def test_cpu_caches_take_the_c_walk_and_torch_ops_when_switched_off(case, monkeypatch):
    """backend="torch" on an fp32/bf16 CPU cache runs the C walk (the torch-ops mover would raise) and matches the
    reference; with HERMES_KERNELS_NATIVE=0 the torch-ops mover runs instead (the C one would raise)."""
    require_c_library("compact_cpu")
    with monkeypatch.context() as patch:
        patch.setattr(rows_torch, "move_rows_torch", refuse)
        run_case(case, "torch", seed=60 + NATIVE_CASES.index(case))
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    monkeypatch.setattr(rows_native, "move_rows_native", refuse)
    run_case(case, "torch", seed=60 + NATIVE_CASES.index(case))


@pytest.mark.skipif(DEVICE != "cpu", reason="the C row kernel moves CPU tensors only")
@pytest.mark.parametrize("dtype", [F16, F64], ids=str)
def test_asking_for_the_c_walk_where_it_cannot_run_raises_before_writing(dtype, monkeypatch):
    case = Case("llava_ov", 4, 1, 2, 64, 3, 20, 9, dtype, None, "eager", True, "contiguous")
    cfg, keys, values, positions, _, _, keep, inv_freq, section = setup_case(case, seed=70)
    snapshot = [t.clone() for t in (keys, values, positions)]
    takes = ", ".join(map(str, bindings.C_DTYPES))  # the message lists the dtypes the C kernel does take
    with pytest.raises(RuntimeError, match=f"native: the C row kernel cannot run: the cache is {dtype}, "
                                           f"the C kernel takes {takes}$"):
        compact_module.compact_torch(keys, values, positions, keep, cfg, inv_freq, section, native=True)
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    with pytest.raises(RuntimeError, match=f"native: .*{native.ENV_SWITCH}=0"):
        compact_module.compact_torch(keys.float(), values.float(), positions, keep, cfg, inv_freq, section,
                                     native=True)
    for before, after in zip(snapshot, (keys, values, positions)):
        assert torch.equal(before, after)


def strided_rows(x: torch.Tensor) -> torch.Tensor:
    """x's values in a view whose last dim has stride 2 (every other element of a buffer twice as wide)."""
    buffer = torch.full((*x.shape[:-1], 2 * x.shape[-1]), float("nan"), dtype=x.dtype, device=x.device)
    buffer[..., ::2] = x
    return buffer[..., ::2]


@pytest.mark.skipif(DEVICE != "cpu", reason="the C row kernel moves CPU tensors only")
def test_native_false_takes_the_torch_ops_where_the_c_walk_could_run(monkeypatch):
    """`native=False` is a choice, not a hint: on a cache the C walk takes (CPU fp32, contiguous rows, library
    built) the torch-ops mover runs, with the sorting dense rank, and matches the reference."""
    require_c_library("compact_cpu")
    monkeypatch.setattr(rows_native, "move_rows_native", refuse)
    monkeypatch.setattr(ranks, "dense_rank_counting", refuse)
    case = NATIVE_CASES[1]
    cfg, keys, values, positions, _, _, keep, inv_freq, section = setup_case(case, seed=74)
    compacts_like_the_reference(case, cfg, keys, values, positions, None, keep, inv_freq, section, lambda: (
        compact_module.compact_torch(keys, values, positions, keep, cfg, inv_freq, section, native=False)))


@pytest.mark.skipif(DEVICE != "cpu", reason="the C row kernel moves CPU tensors only")
@pytest.mark.parametrize("strided", ["keys", "values"])
def test_rows_not_contiguous_in_either_tensor_take_the_torch_ops(strided, monkeypatch):
    """The C walk reads rows of D adjacent elements: keys or values alone with a strided last dim must send the
    step to the torch-ops mover (which then matches the reference), and `native=True` must name the reason."""
    require_c_library("compact_cpu")
    case = Case("llava_ov", 4, 2, 2, 16, 3, 27, 10, F32, None, "eager", True, "contiguous")
    cfg, keys, values, positions, _, _, keep, inv_freq, section = setup_case(case, seed=72)
    if strided == "keys":
        keys = strided_rows(keys)
    else:
        values = strided_rows(values)
    with pytest.raises(RuntimeError, match=r"^native: the C row kernel cannot run: a key or value row is not "
                                           r"contiguous \(stride of the last dim != 1\)$"):
        compact_module.compact_torch(keys, values, positions, keep, cfg, inv_freq, section, native=True)
    monkeypatch.setattr(rows_native, "move_rows_native", refuse)
    compacts_like_the_reference(case, cfg, keys, values, positions, None, keep, inv_freq, section, lambda: (
        compact_module.compact_torch(keys, values, positions, keep, cfg, inv_freq, section)))


@pytest.mark.skipif(DEVICE != "cpu", reason="the C row kernel moves CPU tensors only")
def test_heads_wider_than_the_c_walk_take_the_torch_ops(monkeypatch):
    """The C walk holds a row of at most `C_MAX_HEAD_DIM` channels: a head of that width runs in C, a wider one
    (proportional RoPE at D = 1032) goes to the torch-ops mover instead of failing in the C call, and `native=True`
    names the reason; both match the reference."""
    require_c_library("compact_cpu")
    widest = bindings.C_MAX_HEAD_DIM
    case = Case("llava_ov", 2, 1, 1, widest, 3, 9, 4, F32, None, "eager", True, "contiguous", PROPORTIONAL)
    with monkeypatch.context() as patch:
        patch.setattr(rows_torch, "move_rows_torch", refuse)
        run_case(case, "torch", seed=75)
    case = Case("llava_ov", 2, 1, 1, widest + 8, 3, 9, 4, BF16, None, "eager", True, "contiguous", PROPORTIONAL)
    cfg, keys, values, positions, _, _, keep, inv_freq, section = setup_case(case, seed=75)
    with pytest.raises(RuntimeError, match=rf"^native: the C row kernel cannot run: a head of D={widest + 8} is "
                                           rf"wider than the C kernel's rows \(D <= {widest}\)$"):
        compact_module.compact_torch(keys, values, positions, keep, cfg, inv_freq, section, native=True)
    monkeypatch.setattr(rows_native, "move_rows_native", refuse)
    compacts_like_the_reference(case, cfg, keys, values, positions, None, keep, inv_freq, section, lambda: (
        hk.compact(keys, values, positions, keep, cfg, inv_freq, section, backend="torch")))


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_fp16_summary_of_large_values_does_not_overflow(backend):
    """A deep layer folds 40 pruned fp16 rows of about 3000 into its summary: their sum (~1.2e5) is past fp16's
    largest value (65504), their mean is not. The sums must be taken in fp32, as the reference's are."""
    case = Case("llava_ov", 4, 1, 2, 16, 3, 50, 10, F16, None, "eager", True, "contiguous")
    cfg, keys, values, positions, _, _, keep, inv_freq, section = setup_case(case, seed=73)
    for x in (keys, values):
        x.abs_().add_(3000)
    length, _, (rk, rv, _) = compacts_like_the_reference(
        case, cfg, keys, values, positions, None, keep, inv_freq, section,
        lambda: hk.compact(keys, values, positions, keep, cfg, inv_freq, section, backend=backend))
    assert bool(torch.isfinite(rk[..., :length, :]).all() & torch.isfinite(rv[..., :length, :]).all()), \
        "the reference overflowed: the case does not test what it says"
    assert bool(torch.isfinite(keys[..., :length, :]).all()) and bool(torch.isfinite(values[..., :length, :]).all())


@pytest.mark.skipif(DEVICE != "cpu", reason="the C row kernel moves CPU tensors only")
def test_without_a_compiler_the_torch_ops_mover_runs(monkeypatch, fresh_build):
    monkeypatch.setattr(native, "_compiler", lambda: None)
    assert native.library("compact_cpu") is None
    assert native.unavailable_reason("compact_cpu").startswith("no C compiler")
    monkeypatch.setattr(rows_native, "move_rows_native", refuse)
    run_case(NATIVE_CASES[0], "torch", seed=71)


@pytest.mark.parametrize("spread", ["narrow", "wide"])
def test_angle_table_rows_equal_the_per_token_angles(spread):
    """The C walk's cos/sin table: a range of deltas (narrow spread) or only the distinct ones (wide spread, so
    the range would be longer than the deltas); either way row index[i] is bit-equal to rotary_cos_sin(delta[i]),
    the zero row is delta 0's, and -1 when the table has no row for 0."""
    g = torch.Generator().manual_seed(72)
    scale = 1 if spread == "narrow" else 100_003
    delta = torch.randint(-40, 25, (3, 2, 1, 17), generator=g) * scale
    delta[0, 0, 0, 5] = 0
    inv_freq = inv_freq_for(64)
    cos, sin, index, zero = rows_native.angle_table(delta, inv_freq)
    assert index.dtype == torch.int32 and index.shape == delta.shape
    assert cos.shape[0] <= (65 if spread == "narrow" else delta.numel())
    want_cos, want_sin = rotary_cos_sin(delta, inv_freq)
    assert torch.equal(cos[index.long()], want_cos) and torch.equal(sin[index.long()], want_sin)
    assert zero >= 0 and torch.equal(cos[zero], torch.ones(32)) and torch.equal(sin[zero], torch.zeros(32))
    _, _, _, none = rows_native.angle_table(delta.abs() + 1, inv_freq)  # no row for 0
    assert none == -1


@pytest.mark.parametrize("in_c", [True, False], ids=["C", "torch-ops"])
@pytest.mark.parametrize("mask", ["lanes", "all"])
@pytest.mark.parametrize("spread", [1, 100_003])
def test_counting_dense_rank_equals_the_sorting_one(spread, mask, in_c, monkeypatch):
    """CPU planning (HERMES's compaction, H2SVC's re-index) ranks positions by counting (linear in the span; in C
    when the library builds, else torch ops), falling back to the sort when the span is wide: every path gives the
    sort's ranks on every valid lane, with repeats, negative values, rows in no order and a row without any valid
    lane; invalid lanes rank past every valid one of their row."""
    if in_c:
        require_c_library("compact_cpu")
    else:
        monkeypatch.setenv(native.ENV_SWITCH, "0")
    g = torch.Generator().manual_seed(73)
    values = torch.randint(-20, 20, (3, 2, 3, 23), generator=g) * spread + 5
    valid = torch.rand(3, 2, 1, 23, generator=g) < 0.7 if mask == "lanes" else torch.ones(1, dtype=torch.bool)
    if mask == "lanes":
        valid[1, 0] = False
    sort_rank, calls, in_c_calls = ranks.dense_rank, [], []
    native_rank = ranks.dense_rank_native
    monkeypatch.setattr(ranks, "dense_rank", lambda *a: calls.append(1) or sort_rank(*a))
    monkeypatch.setattr(ranks, "dense_rank_native", lambda *a: in_c_calls.append(1) or native_rank(*a))
    got = ranks.dense_rank_counting(values, valid)
    want = sort_rank(values, valid)
    ok = valid.expand_as(values)
    assert torch.equal(got[ok], want[ok])
    assert len(calls) == (spread > 1), "the wide span should fall back to the sort, the narrow one count"
    assert len(in_c_calls) == in_c, "the C rank should run exactly when the library is available"
    if spread == 1 and mask == "lanes":
        past = got.masked_fill(ok, -1).amax(dim=-1) >= want.masked_fill(~ok, -1).amax(dim=-1) + 1
        assert past[(~ok).any(dim=-1).expand(3, 2, 3)].all(), "an invalid lane ranks among the valid ones"


@pytest.mark.skipif(DEVICE != "cpu", reason="the C row kernel moves CPU tensors only")
@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
@pytest.mark.parametrize("section", [None, (2, 3, 3), INTERLEAVED[16], PARTIAL["il"][1]], ids=rope_id)
def test_c_walk_rotates_and_rounds_like_torch(dtype, section, monkeypatch):
    """Bit-exact check of the C walk's arithmetic: with arbitrary cos/sin tables (no transcendental functions
    involved), every kept key equals torch's fp32 x1·c − x2·s, x2·c + x1·s rounded to the cache dtype — each
    product and sum rounded once, to nearest even — with each frequency pair from its own axis's row (the
    layout's axis map: contiguous or interleaved M-RoPE sections), and a partial-rotary key's tail [R, D) its own
    bytes."""
    require_c_library("compact_cpu")
    D = 64 if section is None else PARTIAL["il"][0] if section is PARTIAL["il"][1] else 16
    case = Case("paper", 3, 2, 2, D, 4, 29, 13, dtype, section, "eager", False, "view")
    cfg, keys, values, positions, _, _, keep, inv_freq, section = setup_case(case, seed=74)
    g = torch.Generator().manual_seed(75)
    seen = {}

    def random_table(delta, inv_freq):
        cos, sin, index, zero = real_table(delta, inv_freq)
        cos, sin = torch.rand(cos.shape, generator=g) * 2 - 1, torch.rand(sin.shape, generator=g) * 2 - 1
        cos[zero], sin[zero] = 1.0, 0.0  # slots that do not move keep their key: the identity
        seen.update(cos=cos, sin=sin, index=index)
        return cos, sin, index, zero

    real_table = rows_native.angle_table
    monkeypatch.setattr(rows_native, "angle_table", random_table)
    before = keys.clone()
    compact_module.compact_torch(keys, values, positions, keep, cfg, inv_freq, section, native=True)

    L, B, Hkv, n, half = case.L, case.B, case.Hkv, keep.shape[-1], case.R // 2
    A = 1 if section is None else 3
    index = seen["index"].view(L, B, A, n).long()
    axis = RotaryLayout.of(section, half).axis_tensor().long()
    pick = axis.view(1, 1, 1, 1, half).expand(L, B, 1, n, half)
    cos = seen["cos"][index].gather(2, pick)  # [L, B, 1, n, half]
    sin = seen["sin"][index].gather(2, pick)
    src = (keep + case.P).view(L, B, 1, n, 1).expand(L, B, Hkv, n, D)
    moved = gather_bytes(before, 3, src)
    x = moved.float()
    x1, x2 = x[..., :half], x[..., half:2 * half]
    want = torch.cat([(x1 * cos - x2 * sin).to(dtype), (x2 * cos + x1 * sin).to(dtype), moved[..., 2 * half:]],
                     dim=-1)
    got = keys[..., case.P:case.P + n, :]
    assert torch.equal(got.view(torch.int16 if dtype != F32 else torch.int32),
                       want.view(torch.int16 if dtype != F32 else torch.int32)), \
        f"{(got.float() != want.float()).sum().item()} of {got.numel()} keys differ"


@pytest.mark.skipif(DEVICE != "cpu", reason="the C row kernel moves CPU tensors only")
def test_a_failing_build_or_load_falls_back_with_its_reason(monkeypatch, tmp_path, fresh_build):
    """A compiler that rejects the source, or a library that cannot be loaded, leaves the torch ops in charge
    with the reason on record, and no exception reaches the caller."""
    broken = tmp_path / "cc"
    broken.write_text("#!/bin/sh\necho 'cc: no such luck' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("CC", str(broken))
    assert native.library("compact_cpu") is None
    assert "no such luck" in native.unavailable_reason("compact_cpu")
    monkeypatch.setattr(rows_native, "move_rows_native", refuse)
    run_case(NATIVE_CASES[0], "torch", seed=76)

    native._build.cache_clear()
    monkeypatch.delenv("CC")

    def unloadable(path):
        raise OSError(f"{path}: failed to map segment from shared object")
    monkeypatch.setattr(native.ctypes, "CDLL", unloadable)
    assert native.library("compact_cpu") is None
    assert "failed to map segment" in native.unavailable_reason("compact_cpu")

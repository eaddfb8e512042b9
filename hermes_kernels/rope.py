"""Rotary positions: delta rotations (1D and M-RoPE) and the left-compaction of positions (docs/hermes.md §2.7–2.8).

Convention: rotate-half, as transformers' `apply_rotary_pos_emb`, over the first R channels of a head of D >= R
(R = D for most models; partial rotary, e.g. Qwen3.5's R = D/4): frequency pair i < R/2 couples channels i and
i + R/2, a rotation by angle θ_i maps (x_i, x_{i+R/2}) to (x_i cos θ_i − x_{i+R/2} sin θ_i, x_{i+R/2} cos θ_i +
x_i sin θ_i), and channels [R, D) are never rotated (copied bit for bit).
Angles come from the integer delta times `inv_freq` in fp32 (fp64 for fp64 tensors), never from products of
low-precision cos/sin tables, so rotating by p then by d is rotating by p + d up to fp32 rounding.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import torch


@dataclasses.dataclass(frozen=True)
class RotaryLayout:
    """Which position axis turns each rotary frequency pair: axis[i] in [0, num_axes) for pair i of the R/2 pairs.

    The one description every rotation by a position delta reads (docs/hermes.md §2.8): 1D RoPE has one axis
    (positions [..., N]); M-RoPE has three, t, h and w (positions [..., 3, N]), laid out per model family:
      sections    — Qwen2.5-VL: contiguous blocks, `mrope_section` = (16, 24, 24) gives pairs 0-15 to t,
                    16-39 to h, 40-63 to w;
      interleaved — Qwen3-VL: pair i turns with h when i % 3 == 1 and i < 3·section[1], with w when i % 3 == 2
                    and i < 3·section[2], with t otherwise ((24, 20, 20): t, h, w cycle over pairs 0-59, t holds
                    60-63).
    Both halves of the rotary channels share the map (rotate-half). `pairs` = R/2 may be fewer than the head's D/2
    (partial rotary: channels [R, D) never turn); only an explicit layout says so (`of`). Frozen and hashable, so a
    layout can key caches.
    """
    axis: tuple[int, ...]
    num_axes: int

    def __post_init__(self):
        axis = tuple(self.axis)
        if self.num_axes not in (1, 3):
            raise ValueError(f"RotaryLayout.num_axes: a layout has 1 axis (1D RoPE) or 3 (M-RoPE: t, h, w), "
                             f"got {self.num_axes!r}")
        if not axis or any(isinstance(a, bool) or not isinstance(a, int) or not 0 <= a < self.num_axes
                           for a in axis):
            raise ValueError(f"RotaryLayout.axis: expected one axis in [0, {self.num_axes}) per frequency pair, "
                             f"got {axis!r}")
        object.__setattr__(self, "axis", axis)

    @classmethod
    def one_d(cls, pairs: int) -> "RotaryLayout":
        """1D RoPE over `pairs` = R/2 frequency pairs: every pair turns with the one position."""
        if isinstance(pairs, bool) or not isinstance(pairs, int) or pairs < 1:
            raise ValueError(f"pairs: a 1D layout needs a positive pair count, got {pairs!r}")
        return cls((0,) * pairs, 1)

    @classmethod
    def sections(cls, mrope_section: Sequence[int]) -> "RotaryLayout":
        """M-RoPE with contiguous blocks of (t, h, w) pairs (Qwen2.5-VL's `mrope_section`)."""
        section = _three_counts(mrope_section)
        return cls(tuple(a for a, count in enumerate(section) for _ in range(count)), 3)

    @classmethod
    def interleaved(cls, mrope_section: Sequence[int]) -> "RotaryLayout":
        """M-RoPE with the axes interleaved pair by pair (Qwen3-VL's `mrope_section`, as its rotary module's
        `recomposition_frequencies`). Every section's pairs must exist: the counts of the map are the section's."""
        section = _three_counts(mrope_section)
        pairs = sum(section)
        axis = tuple(a if a and i < 3 * section[a] else 0 for i in range(pairs) for a in (i % 3,))
        counts = tuple(axis.count(a) for a in range(3))
        if counts != section:
            raise ValueError(f"mrope_section: interleaved {list(section)} over {pairs} pairs gives (t, h, w) "
                             f"{list(counts)} pairs; h and w may hold at most one pair in three")
        return cls(axis, 3)

    @classmethod
    def of(cls, rotary, head_pairs: int) -> "RotaryLayout":
        """The layout an op's `rotary` argument describes for a head of `head_pairs` = D/2 channel pairs: None is 1D
        RoPE and three pair counts are contiguous sections (Qwen2.5-VL's `mrope_section`), both over the whole head;
        a RotaryLayout is itself and may cover fewer pairs (partial rotary, R < D: only ever asked for
        explicitly). ValueError/TypeError naming `rotary` otherwise."""
        if rotary is None:
            return cls.one_d(head_pairs)
        if isinstance(rotary, RotaryLayout):
            if rotary.pairs > head_pairs:
                raise ValueError(f"rotary: {rotary.describe()} covers {rotary.pairs} frequency pairs, more than the "
                                 f"head's D/2={head_pairs}")
            return rotary
        if isinstance(rotary, (Sequence, torch.Tensor)) and not isinstance(rotary, (str, bytes)):
            try:
                layout = cls.sections(rotary)
            except (TypeError, ValueError) as error:
                raise type(error)(f"rotary: {str(error).removeprefix('mrope_section: ')}") from error
        else:
            raise TypeError(f"rotary: expected None, three pair counts (t, h, w) or a RotaryLayout, got "
                            f"{type(rotary).__name__}")
        if layout.pairs != head_pairs:
            raise ValueError(f"rotary: {layout.describe()} covers {layout.pairs} frequency pairs, expected "
                             f"D/2={head_pairs} (partial rotary only through an explicit RotaryLayout)")
        return layout

    @property
    def pairs(self) -> int:
        """Rotary frequency pairs R/2 the layout covers (= inv_freq.numel())."""
        return len(self.axis)

    @property
    def rotary_dim(self) -> int:
        """R = 2·pairs: the channels of a head that turn (the first R; a head of D > R keeps [R, D) as it is)."""
        return 2 * self.pairs

    @property
    def counts(self) -> tuple[int, ...]:
        """Pairs per axis: (R/2,) for 1D, (t, h, w) for M-RoPE."""
        return tuple(self.axis.count(a) for a in range(self.num_axes))

    @property
    def kind(self) -> str:
        """Which map this is: "1d", "sections" (contiguous), "interleaved", or "custom" (any other)."""
        if self.num_axes == 1:
            return "1d"
        for name, build in (("sections", RotaryLayout.sections), ("interleaved", RotaryLayout.interleaved)):
            try:
                if build(self.counts) == self:
                    return name
            except ValueError:  # counts no interleaved map can hold
                pass
        return "custom"

    def describe(self) -> str:
        """Short text for messages and labels: '1d (P pairs)' or 'M-RoPE <kind> [t, h, w pair counts]'."""
        return f"1d ({self.pairs} pairs)" if self.num_axes == 1 else f"M-RoPE {self.kind} {list(self.counts)}"

    def axis_tensor(self, device: torch.device | str | None = None) -> torch.Tensor:
        """int32 [R/2] axis of each pair on `device` (default CPU), built once per layout and device."""
        return _axis_tensor(self, str(torch.device("cpu" if device is None else device)))


def _three_counts(mrope_section) -> tuple[int, int, int]:
    try:
        section = tuple(int(s) for s in mrope_section)
    except (TypeError, ValueError):
        raise TypeError(f"mrope_section: expected three pair counts (t, h, w), got {mrope_section!r}") from None
    if len(section) != 3 or min(section) < 0 or sum(section) < 1:
        raise ValueError(f"mrope_section: expected three non-negative pair counts (t, h, w), got "
                         f"{list(section)}")
    return section


@functools.lru_cache(maxsize=64)
def _axis_tensor(layout: RotaryLayout, device: str) -> torch.Tensor:
    # memoised: rotations call this per token tile, and building it on a GPU is a host-to-device copy each time
    return torch.tensor(layout.axis, dtype=torch.int32).to(device)


def rotary_angles(delta: torch.Tensor, inv_freq: torch.Tensor,
                  rotary: Sequence[int] | RotaryLayout | None = None,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rotation angles [..., T, R/2] for integer position deltas.

    delta: int64 [..., T] (1D layout) or [..., 3, T] (M-RoPE: t, h, w deltas); inv_freq: [R/2] (R the rotary width,
    D for full rotary); rotary: anything `RotaryLayout.of` takes, of inv_freq's R/2 pairs. Each frequency pair takes
    the delta of its own axis (`RotaryLayout.axis`).
    """
    layout = RotaryLayout.of(rotary, inv_freq.numel())
    if layout.pairs != inv_freq.numel():
        raise ValueError(f"rotary: {layout.describe()} covers {layout.pairs} frequency pairs, inv_freq has "
                         f"{inv_freq.numel()}")
    freq = inv_freq.to(device=delta.device, dtype=dtype)
    if layout.num_axes == 1:
        return delta.to(dtype).unsqueeze(-1) * freq  # every pair turns with the one position: a broadcast
    if delta.dim() < 2 or delta.shape[-2] != 3:
        raise ValueError(f"delta: expected [..., 3, T] for {layout.describe()}, got {tuple(delta.shape)}")
    per_axis = delta.to(dtype).transpose(-1, -2)  # [..., 3, T] -> [..., T, 3]
    # pick each pair's axis -> [..., T, R/2]
    return per_axis.index_select(-1, layout.axis_tensor(delta.device)) * freq


def rotary_cos_sin(delta: torch.Tensor, inv_freq: torch.Tensor,
                   rotary: Sequence[int] | RotaryLayout | None = None,
                   dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [..., T, R/2] of `rotary_angles` (fp32 unless `dtype` says otherwise)."""
    angle = rotary_angles(delta, inv_freq, rotary, dtype)
    return angle.cos(), angle.sin()


def apply_rotary_delta(x: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor,
                       rotary: Sequence[int] | RotaryLayout | None = None) -> torch.Tensor:
    """Rotate x [..., T, D] by delta·inv_freq (§2.8); returns a new tensor in x's dtype.

    delta: int64 [..., T] or, for M-RoPE, [..., 3, T], broadcastable against x's leading dims; inv_freq: [R/2],
    R <= D; rotary: anything `RotaryLayout.of` takes, of R/2 pairs. Channels [0, R) turn (arithmetic in fp32, fp64
    when x is fp64); channels [R, D) are copied bit for bit (partial rotary: never "rotated by zero", which would
    turn −0.0 into +0.0).
    """
    half = inv_freq.numel()
    if x.shape[-1] < 2 * half:
        raise ValueError(f"x: a head of D={x.shape[-1]} channels cannot hold the R={2 * half} rotary channels of "
                         f"inv_freq [R/2={half}]")
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    cos, sin = rotary_cos_sin(delta, inv_freq, rotary, work)
    xf = x[..., :2 * half].to(work)
    x1, x2 = xf[..., :half], xf[..., half:]
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
    if 2 * half == x.shape[-1]:
        return out
    tail = x[..., 2 * half:]
    return torch.cat((out, tail.expand(*out.shape[:-1], tail.shape[-1])), dim=-1)


def rotate_into(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out <- x with channels [0, R) rotated by the angles of cos/sin (rotate-half, §2.8) and channels [R, D) copied,
    in out's dtype (the work dtype); returns out.

    x [..., D] in the cache dtype (promoted exactly to the work dtype by the ops), cos/sin broadcastable to
    [..., R/2] (R = 2·cos.shape[-1] <= D: partial rotary when less); out [..., D] must not overlap x. Four passes
    over the rotary half rows and one copy of the tail, no temporaries: the in-place row movers' rotation
    (`hermes_kernels.engine.rows_torch`). The tail is a copy, never a rotation by zero (−0.0 − (−0.0) is +0.0); it is
    bit for bit when out has x's dtype (a widening copy canonicalises NaN payloads: callers that write a tail back
    to the cache take it from x). `apply_rotary_delta` keeps its own two products and a difference: a fused
    multiply-add (which `addcmul_` may be on a GPU) rounds once where it rounds twice, and the model glue and the
    references rotate with it.
    """
    half = cos.shape[-1]
    x1, x2 = x[..., :half], x[..., half:2 * half]
    o1, o2 = out[..., :half], out[..., half:2 * half]
    torch.mul(x1, cos, out=o1)
    o1.addcmul_(x2, sin, value=-1)
    torch.mul(x2, cos, out=o2)
    o2.addcmul_(x1, sin)
    if 2 * half < x.shape[-1]:
        out[..., 2 * half:].copy_(x[..., 2 * half:])
    return out


def compact_positions(positions: torch.Tensor, prefix_len: int) -> torch.Tensor:
    """Left-compacted positions for retained visual tokens (appendix E, §2.7).

    positions: int64 [n] (1D) or [3, n] (M-RoPE), the old positions of the retained visual tokens of one layer
    and stream. Each axis separately: new = prefix_len + rank of the value among the distinct retained
    values of that axis (dense rank, so equal coordinates stay equal and order is preserved).
    """
    rows = positions.unsqueeze(0) if positions.dim() == 1 else positions
    ranks = torch.stack([torch.unique(axis_values, sorted=True, return_inverse=True)[1] for axis_values in rows])
    return prefix_len + (ranks[0] if positions.dim() == 1 else ranks)

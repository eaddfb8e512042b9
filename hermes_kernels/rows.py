"""Row movers and dense ranks of the torch backend, shared by both policies' in-place steps (HERMES compaction,
`policies/hermes/compaction.py`; H2SVC's class-block step, `policies/h2svc/step.py`).

A "row" is one token's key or value vector [D] of one (layer or class row, stream, KV head). Both steps move rows
to lower slots of the same buffer, rotating keys by a position delta on the way (docs/hermes.md §2.8), so they
share:
  dense_rank / dense_rank_counting — per-axis dense rank of retained positions (docs/hermes.md §2.7), by sorting
      (any device) or by counting (CPU; in C, compact_cpu.c, when the library builds);
  move_rows_native — the C row walk (compact_cpu.c): every row walked once, left to right, in place;
  move_rows_torch — the same row work in torch ops over all rows at once, looping over L2-sized token tiles.
"""
from __future__ import annotations

import ctypes
import math
from typing import Sequence

import torch

from . import native
from .dtypes import work_dtype
from .rope import RotaryLayout, rotary_cos_sin

# Sentinels for masked lanes of int64 position arithmetic: far outside any position, with room to add 1.
BIG = 2 ** 62
# Values per token tile of the torch path over all (layer, stream, head) rows: 2 MiB of fp32, about L2-sized
# (1/4 and 4x were measured slower at the LLaVA-OV-7B shape).
TILE_ELEMENTS = 1 << 19


def scratch(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Uninitialised work memory; every op writes it before reading it (tests poison it through this seam)."""
    return torch.empty(shape, dtype=dtype, device=device)


def dense_rank(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """0-based dense rank of each value among the valid values of its row (last dim); int64, same shape.

    values int64 [..., n]; valid bool broadcastable to it. Invalid lanes sort last and get ranks past every valid
    one, so they never change a valid lane's rank. Sort + "value changed" marks + prefix sum, scattered back.
    """
    padded = values.masked_fill(~valid, BIG)
    ordered, order = padded.sort(dim=-1)
    changed = torch.zeros_like(ordered)
    changed[..., 1:] = (ordered[..., 1:] != ordered[..., :-1]).to(ordered.dtype)
    return torch.empty_like(ordered).scatter_(-1, order, changed.cumsum(-1))


def counting_span_limit(n: int) -> int:
    """The widest span of a row's values (max - min) that the counting ranks of n lanes take on: past it (positions
    far apart) a sort is cheaper. Shared by `dense_rank_counting` and H2SVC's C re-index plan."""
    return max(4 * n, 1 << 16)


def dense_rank_counting(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """`dense_rank` of CPU tensors by counting instead of sorting; ranks of invalid lanes are unspecified.

    Each row marks its valid values in a presence table over the row's span (max - min + 1), prefix-sums it and
    reads every value's rank back: linear in n + span; in C (compact_cpu.c) when the library is available, else in
    torch ops, which read the spans on the host (free on CPU tensors). If the widest span is over max(4n, 2^16)
    (positions far apart), the sort of `dense_rank` is cheaper and used.
    """
    n = values.shape[-1]
    widest = counting_span_limit(n)
    lib = native.library("compact_cpu")
    if lib is not None:
        return dense_rank_native(lib, values, valid, widest)
    rows = values.reshape(-1, n)
    ok = valid.expand_as(values).reshape(-1, n)
    low = rows.masked_fill(~ok, BIG).amin(dim=-1, keepdim=True)
    high = rows.masked_fill(~ok, -BIG).amax(dim=-1, keepdim=True)
    span = int((high - low).amax()) + 1 if rows.numel() else 0
    if span > widest:
        return dense_rank(values, valid)
    # invalid lanes (and rows without a valid value) land in the extra column `span`, past every valid one
    column = torch.where(ok, rows - low, span).clamp_(0, span)
    present = torch.zeros(rows.shape[0], span + 1, dtype=torch.int32)
    present.scatter_(1, column, 1)
    rank = present.cumsum_(1).sub_(1)
    return rank.gather(1, column).to(torch.int64).view(values.shape)


def dense_rank_native(lib: ctypes.CDLL, values: torch.Tensor, valid: torch.Tensor, widest: int) -> torch.Tensor:
    """`dense_rank_counting` in one call of compact_cpu.c's `hermes_dense_rank` (a presence table per row, one
    pass per lane: the torch ops' ten passes over the positions cost the H2SVC step at the 7B shape about 15 ms);
    rows whose span is wider than `widest` make it return 3 and the sort ranks instead. Invalid lanes rank past
    every valid one (unspecified for callers, as in the torch ops)."""
    n = values.shape[-1]
    rows = values.reshape(-1, n).contiguous()
    every = valid.numel() == 1 and bool(valid.reshape(()))  # host read of a CPU tensor: free
    ok = None if every else valid.expand_as(values).reshape(-1, n).to(torch.uint8).contiguous()
    rank = torch.empty_like(rows)
    ptr = ctypes.c_void_p
    status = lib.hermes_dense_rank(ptr(rows.data_ptr()), None if ok is None else ptr(ok.data_ptr()),
                                   ctypes.c_int64(rows.shape[0]), ctypes.c_int64(n), ctypes.c_int64(widest),
                                   ptr(rank.data_ptr()), ctypes.c_int(torch.get_num_threads()))
    if status == 3:
        return dense_rank(values, valid)
    if status != 0:
        raise RuntimeError(f"compact_cpu.c: hermes_dense_rank returned {status} (2: a worker thread failed or a "
                           "presence table could not be allocated)")
    return rank.view(values.shape)


def rotate_into(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out <- x rotated by the angles of cos/sin (rotate-half, §2.8) in out's dtype (the work dtype); returns out.

    x [..., D] in the cache dtype (promoted exactly to the work dtype by the ops), cos/sin broadcastable to
    [..., D/2]; out must not overlap x. Four passes over half rows, no temporaries.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    o1, o2 = out[..., :half], out[..., half:]
    torch.mul(x1, cos, out=o1)
    o1.addcmul_(x2, sin, value=-1)
    torch.mul(x2, cos, out=o2)
    o2.addcmul_(x1, sin)
    return out


class TileRows:
    """Tile-by-tile row gathers x[l, b, h, slots[l, b, i], :] from x [L, B, Hkv, N, D] (any strides).

    x's storage is aliased as a 2D tensor whose rows start every g elements, g = gcd of x's four leading strides,
    so every (layer, stream, head, token) row of x (buffer views included) is one of its rows; alias rows may
    overlap in memory, which a read-only gather does not mind. The row numbers of all tiles are computed once,
    tile-major, so a tile costs one `index_select` into one reused buffer of `tile` tokens, small enough to stay
    in the CPU's caches (whole-cache temporaries would cost a page fault per 4 KiB on every call).
    """

    def __init__(self, x: torch.Tensor, slots: torch.Tensor, tile: int):
        L, B, Hkv, N, D = x.shape
        unit = math.gcd(*x.stride()[:4]) or 1
        extent = sum((size - 1) * stride for size, stride in zip(x.shape[:4], x.stride()[:4])) // unit + 1
        self.alias = x.as_strided((extent, D), (unit, x.stride(4)), x.storage_offset())
        lead = [stride // unit for stride in x.stride()[:4]]
        count = slots.shape[-1]
        tiles = -(-count // tile)
        # the last tile is padded with slot 0 of every (layer, stream, head): gathered, never written anywhere
        padded = torch.nn.functional.pad(slots * lead[3], (0, tiles * tile - count))
        index = (padded.view(L, B, 1, tiles, tile) + lead[0] * torch.arange(L, device=x.device).view(L, 1, 1, 1, 1)
                 + lead[1] * torch.arange(B, device=x.device).view(1, B, 1, 1, 1)
                 + lead[2] * torch.arange(Hkv, device=x.device).view(1, 1, Hkv, 1, 1))
        self.index = index.permute(3, 0, 1, 2, 4).reshape(tiles, -1)  # [tiles, L·B·Hkv·tile], tile-major
        self.buffer = scratch((L * B * Hkv * tile, D), x.dtype, x.device)
        self.shape = (L, B, Hkv, tile, D)

    def gather(self, t: int, count: int) -> torch.Tensor:
        """Rows of tile t as [L, B, Hkv, count, D], a view of the tile buffer (valid until the next call)."""
        torch.index_select(self.alias, 0, self.index[t], out=self.buffer)
        return self.buffer.view(self.shape)[:, :, :, :count]


def tile_tokens(x: torch.Tensor) -> int:
    """Tokens per tile so that one tile's rows over all (layer, stream, head) of x hold ~TILE_ELEMENTS values."""
    return max(1, TILE_ELEMENTS // (x.shape[0] * x.shape[1] * x.shape[2] * x.shape[4]))


def head_angles(delta: torch.Tensor, inv_freq: torch.Tensor, layout: RotaryLayout, work: torch.dtype):
    """cos, sin [L, B, 1, T, D/2] for position deltas [L, B, A, T] (A = layout.num_axes), broadcast over heads."""
    cos, sin = rotary_cos_sin(delta if layout.num_axes == 3 else delta[:, :, 0], inv_freq, layout, work)
    return cos.unsqueeze(2), sin.unsqueeze(2)


def move_rows_torch(keys, values, P, src, delta, first, pruned, to_target, inv_freq, layout: RotaryLayout):
    """Row work in torch ops: summary sums of the pruned rows, then the kept rows rotated/moved to slots P + i.

    src int64 [L, B, n] source slots (-1 past a row's kept count), delta int64 [L, B, A, n], pruned int64
    [L - first, B, m] and to_target [L - first, B, A, m] (None without summary); A = layout.num_axes, each
    frequency pair turned by the delta of its axis `layout.axis`. Returns the key and value sums
    [L - first, B, Hkv, D] in the work dtype, or None.

    Every op covers all layers, streams and heads at once; the only Python loops run over token tiles (their
    number follows from the shapes), which keeps the temporaries small. Tiles move left to right: tile [i0, i1)
    writes slots P+i0..P+i1-1 and reads sources P + keep[i] >= P + i0, and later tiles read only sources
    >= P + i1, so no row is overwritten before it is read. Padded lanes (-1) gather slot P, a valid row, and write
    slots the caller overwrites with the summary (the only padded column).
    """
    L, B, Hkv, N, D = keys.shape
    n = src.shape[-1]
    work = work_dtype(keys)
    src = src.clamp(min=P)
    sums = None
    if pruned is not None:
        Ld, m = pruned.shape[0], pruned.shape[-1]
        tile = tile_tokens(keys[first:])
        deep_keys, deep_values = TileRows(keys[first:], pruned, tile), TileRows(values[first:], pruned, tile)
        rotated = scratch((Ld, B, Hkv, tile, D), work, keys.device)
        k_sum = torch.zeros(Ld, B, Hkv, D, dtype=work, device=keys.device)
        v_sum = torch.zeros_like(k_sum)
        for t, j0 in enumerate(range(0, m, tile)):
            j1 = min(j0 + tile, m)
            cos, sin = head_angles(to_target[..., j0:j1], inv_freq, layout, work)
            turned = rotate_into(deep_keys.gather(t, j1 - j0), cos, sin, rotated[:, :, :, :j1 - j0])
            k_sum += turned.sum(dim=3)
            v_sum += deep_values.gather(t, j1 - j0).sum(dim=3, dtype=work)
        sums = k_sum, v_sum

    tile = tile_tokens(keys)
    key_rows, value_rows = TileRows(keys, src, tile), TileRows(values, src, tile)
    # fp32/fp64 caches take the rotation straight into their slots; others go through a work-dtype tile
    rotated = None if keys.dtype == work else scratch((L, B, Hkv, tile, D), work, keys.device)
    for t, i0 in enumerate(range(0, n, tile)):
        i1 = min(i0 + tile, n)
        cos, sin = head_angles(delta[..., i0:i1], inv_freq, layout, work)
        slots = keys[:, :, :, P + i0:P + i1]
        out = slots if rotated is None else rotated[:, :, :, :i1 - i0]
        rotate_into(key_rows.gather(t, i1 - i0), cos, sin, out)
        if rotated is not None:
            slots.copy_(out)
        values[:, :, :, P + i0:P + i1] = value_rows.gather(t, i1 - i0)
    return sums


C_DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # the dtype codes of compact_cpu.c


def native_blocker(keys: torch.Tensor, values: torch.Tensor) -> str | None:
    """Why the C row kernel cannot move these rows, or None when it can."""
    if keys.device.type != "cpu":
        return f"the cache is on {keys.device}, the C kernel runs on CPU tensors only"
    if keys.dtype not in C_DTYPES:
        return f"the cache is {keys.dtype}, the C kernel takes {', '.join(map(str, C_DTYPES))}"
    if keys.stride(-1) != 1 or values.stride(-1) != 1:
        return "a key or value row is not contiguous (stride of the last dim != 1)"
    return native.unavailable_reason("compact_cpu")


def use_native(native_choice: bool | None, keys: torch.Tensor, values: torch.Tensor) -> bool:
    blocker = native_blocker(keys, values)
    if native_choice and blocker is not None:
        raise RuntimeError(f"native: the C row kernel cannot run: {blocker}")
    return blocker is None if native_choice is None else native_choice


def angle_table(delta: torch.Tensor, inv_freq: torch.Tensor):
    """cos, sin float32 [R, D/2] (what the C kernel reads) of the distinct integer deltas, each row's table index
    (int32, delta's shape) and the row of delta 0 (-1 if none). CPU only: the table size is read from the data.

    Rows cover the range min..max when that is no longer than the deltas themselves (the usual case: a step's
    deltas span about V), else only the distinct values. Angles are `rotary_cos_sin`'s, so bit-equal per delta.
    """
    flat = delta.reshape(-1)
    low, high = (int(x) for x in torch.aminmax(flat)) if flat.numel() else (0, 0)
    if high - low < max(flat.numel(), 1):
        values = torch.arange(low, high + 1, dtype=torch.int64)
        index = flat - low
        zero = -low if low <= 0 <= high else -1
    else:
        values, index = torch.unique(flat, sorted=True, return_inverse=True)
        at = int(torch.searchsorted(values, 0))
        zero = at if at < values.numel() and int(values[at]) == 0 else -1
    cos, sin = rotary_cos_sin(values, inv_freq, None, torch.float32)
    return cos.contiguous(), sin.contiguous(), index.to(torch.int32).view(delta.shape), zero


def move_rows_native(keys, values, P, src, delta, first, pruned, to_target, inv_freq, layout: RotaryLayout,
                     stream=False):
    """Row work in one call of the C kernel (compact_cpu.c): each (layer, stream, head) row is walked once, left to
    right, in place; same arguments and result as `move_rows_torch` except the sums come back in float64. The
    kernel reads each pair's axis from `layout.axis_tensor()`.
    delta=None (no pruned tokens): nothing rotates, rows only move — every token reads the one table row of
    delta 0, so the walk skips the tokens that stay and copies the others exactly. stream: rows that change slot are
    written with streaming stores (`put_row` in the C file: for moves whose destinations the walk has not just
    read, H2SVC's)."""
    L, B, Hkv, N, D = keys.shape
    if delta is None:
        A, layout = 1, RotaryLayout.one_d(D // 2)
        cos, sin = torch.ones(1, D // 2), torch.zeros(1, D // 2)
        ktab, zero = torch.zeros(src.shape[:-1] + (1, src.shape[-1]), dtype=torch.int32), 0
    else:
        A = delta.shape[2]
        deltas = delta.reshape(-1) if pruned is None else torch.cat([delta.reshape(-1), to_target.reshape(-1)])
        cos, sin, rows, zero = angle_table(deltas, inv_freq)
        ktab = rows[:delta.numel()].contiguous()
    axis = layout.axis_tensor("cpu")
    if pruned is None:
        m, ptab, pruned, sums = 0, ktab, src, torch.zeros(2, 1, dtype=torch.float64)
    else:
        m = pruned.shape[-1]
        ptab = rows[delta.numel():].contiguous()
        pruned = pruned.contiguous()
        sums = torch.zeros(2, L - first, B, Hkv, D, dtype=torch.float64)
    shape = torch.tensor([L, B, Hkv, D], dtype=torch.int64)
    kstride = torch.tensor(keys.stride()[:4], dtype=torch.int64)
    vstride = torch.tensor(values.stride()[:4], dtype=torch.int64)
    src = src.contiguous()
    kernel = native.library("compact_cpu").hermes_compact_rows
    ptr = ctypes.c_void_p
    status = kernel(ptr(keys.data_ptr()), ptr(values.data_ptr()), ctypes.c_int(C_DTYPES[keys.dtype]),
                    ptr(shape.data_ptr()), ptr(kstride.data_ptr()), ptr(vstride.data_ptr()),
                    ctypes.c_int64(P), ctypes.c_int64(src.shape[-1]), ptr(src.data_ptr()), ptr(ktab.data_ptr()),
                    ctypes.c_int64(A), ptr(axis.data_ptr()), ptr(cos.data_ptr()), ptr(sin.data_ptr()),
                    ctypes.c_int32(zero), ctypes.c_int64(first), ctypes.c_int64(m), ptr(pruned.data_ptr()),
                    ptr(ptab.data_ptr()), ptr(sums[0].data_ptr()), ptr(sums[1].data_ptr()), ctypes.c_int(int(stream)),
                    ctypes.c_int(torch.get_num_threads()))
    if status != 0:
        raise RuntimeError(f"compact_cpu.c: hermes_compact_rows returned {status} (1: bad dtype {keys.dtype}, "
                           f"head_dim {D}, axis count {A} or axis map; 2: a worker thread failed)")
    return None if m == 0 else (sums[0], sums[1])



"""The torch-ops row mover of both policies' in-place steps (HERMES's compaction, `policies/hermes/compaction.py`;
H2SVC's class-block step, `policies/h2svc/step.py`): kept rows rotated by a position delta (docs/hermes.md §2.8)
and moved to lower slots of the same buffer, with the summary sums of the pruned rows, in torch ops over all
(layer, stream, head) rows at once. Rows are gathered tile by tile (`TileRows`) through one reused buffer of about
L2 size, so no whole-cache temporary is made. The C mover of CPU caches, one pass in place, is `rows_native`.
"""
from __future__ import annotations

import math

import torch

from . import workspace
from .dtypes import work_dtype
from ..rope import RotaryLayout, rotary_cos_sin, rotate_into

__all__ = ["move_rows_torch", "TileRows", "tile_tokens", "TILE_ELEMENTS"]

# Values per token tile of the torch path over all (layer, stream, head) rows: 2 MiB of fp32, about L2-sized, so a
# gathered tile is still in cache when it is written back (re-measure the torch-ops rows of `python -m bench` at the
# 7B shapes before changing it).
TILE_ELEMENTS = 1 << 19


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
        self.buffer = workspace.scratch((L * B * Hkv * tile, D), x.dtype, x.device)
        self.shape = (L, B, Hkv, tile, D)

    def gather(self, t: int, count: int) -> torch.Tensor:
        """Rows of tile t as [L, B, Hkv, count, D], a view of the tile buffer (valid until the next call)."""
        torch.index_select(self.alias, 0, self.index[t], out=self.buffer)
        return self.buffer.view(self.shape)[:, :, :, :count]


def tile_tokens(x: torch.Tensor) -> int:
    """Tokens per tile so that one tile's rows over all (layer, stream, head) of x hold ~TILE_ELEMENTS values."""
    return max(1, TILE_ELEMENTS // (x.shape[0] * x.shape[1] * x.shape[2] * x.shape[4]))


def _head_angles(delta: torch.Tensor, inv_freq: torch.Tensor, layout: RotaryLayout, work: torch.dtype):
    """cos, sin [L, B, 1, T, R/2] for position deltas [L, B, A, T] (A = layout.num_axes), broadcast over heads."""
    cos, sin = rotary_cos_sin(delta if layout.num_axes == 3 else delta[:, :, 0], inv_freq, layout, work)
    return cos.unsqueeze(2), sin.unsqueeze(2)


def move_rows_torch(keys, values, P, src, delta, first, pruned, to_target, inv_freq, layout: RotaryLayout):
    """Row work in torch ops: summary sums of the pruned rows, then the kept rows rotated/moved to slots P + i.

    keys / values [L, B, Hkv, N, D] (any dtype and strides), updated in place. src int64 [L, B, n] source slots (-1
    past a row's kept count), delta int64 [L, B, A, n], pruned int64 [L - first, B, m] and to_target
    [L - first, B, A, m] (None without summary); A = layout.num_axes, each of the R/2 frequency pairs (inv_freq
    [R/2], R <= D) turned by the delta of its axis `layout.axis`. Channels [R, D) of a key move unrotated, bit for
    bit (partial rotary; docs/hermes.md §2.8), and enter the key sums as they are. Returns the key and value sums
    [L - first, B, Hkv, D] in the work dtype, or None.

    Every op covers all layers, streams and heads at once; the only Python loops run over token tiles (their
    number follows from the shapes), which keeps the temporaries small. Tiles move left to right: tile [i0, i1)
    writes slots P+i0..P+i1-1 and reads sources P + keep[i] >= P + i0, and later tiles read only sources
    >= P + i1, so no row is overwritten before it is read. Padded lanes (-1) gather slot P, a valid row, and write
    slots the caller overwrites with the summary (the only padded column).
    """
    L, B, Hkv, N, D = keys.shape
    R = 2 * inv_freq.numel()
    n = src.shape[-1]
    work = work_dtype(keys)
    src = src.clamp(min=P)
    sums = None
    if pruned is not None:
        Ld, m = pruned.shape[0], pruned.shape[-1]
        tile = tile_tokens(keys[first:])
        deep_keys, deep_values = TileRows(keys[first:], pruned, tile), TileRows(values[first:], pruned, tile)
        rotated = workspace.scratch((Ld, B, Hkv, tile, D), work, keys.device)
        k_sum = torch.zeros(Ld, B, Hkv, D, dtype=work, device=keys.device)
        v_sum = torch.zeros_like(k_sum)
        for t, j0 in enumerate(range(0, m, tile)):
            j1 = min(j0 + tile, m)
            cos, sin = _head_angles(to_target[..., j0:j1], inv_freq, layout, work)
            turned = rotate_into(deep_keys.gather(t, j1 - j0), cos, sin, rotated[:, :, :, :j1 - j0])
            k_sum += turned.sum(dim=3)
            v_sum += deep_values.gather(t, j1 - j0).sum(dim=3, dtype=work)
        sums = k_sum, v_sum

    tile = tile_tokens(keys)
    key_rows, value_rows = TileRows(keys, src, tile), TileRows(values, src, tile)
    # fp32/fp64 caches take the rotation straight into their slots; others turn the rotary channels in a work-dtype
    # tile and take the tail from the gathered rows (a widening round trip would canonicalise NaN payloads)
    rotated = None if keys.dtype == work else workspace.scratch((L, B, Hkv, tile, R), work, keys.device)
    for t, i0 in enumerate(range(0, n, tile)):
        i1 = min(i0 + tile, n)
        cos, sin = _head_angles(delta[..., i0:i1], inv_freq, layout, work)
        slots = keys[:, :, :, P + i0:P + i1]
        rows = key_rows.gather(t, i1 - i0)
        if rotated is None:
            rotate_into(rows, cos, sin, slots)
        else:
            slots[..., :R] = rotate_into(rows[..., :R], cos, sin, rotated[:, :, :, :i1 - i0])
            slots[..., R:] = rows[..., R:]
        values[:, :, :, P + i0:P + i1] = value_rows.gather(t, i1 - i0)
    return sums

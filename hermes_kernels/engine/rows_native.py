"""The C row mover of CPU caches (compact_cpu.c's row walk, called through `bindings`): the work of
`rows_torch.move_rows_torch` for fp32 / bf16 caches with contiguous rows, each (layer, stream, head) row walked once,
left to right, in place (docs/api.md#cpu-code). `use_native` decides whether it runs (and says why not);
`angle_table` builds the cos / sin table the walk reads, bit-equal to `rotary_cos_sin` per delta.
"""
from __future__ import annotations

import torch

from . import bindings, native
from .bindings import C_DTYPES, C_MAX_HEAD_DIM
from ..rope import RotaryLayout, rotary_cos_sin

__all__ = ["move_rows_native", "use_native", "native_blocker", "angle_table"]


def native_blocker(keys: torch.Tensor, values: torch.Tensor) -> str | None:
    """Why the C row kernel cannot move these rows, or None when it can."""
    if keys.device.type != "cpu":
        return f"the cache is on {keys.device}, the C kernel runs on CPU tensors only"
    if keys.dtype not in C_DTYPES:
        return f"the cache is {keys.dtype}, the C kernel takes {', '.join(map(str, C_DTYPES))}"
    if keys.stride(-1) != 1 or values.stride(-1) != 1:
        return "a key or value row is not contiguous (stride of the last dim != 1)"
    if keys.shape[-1] > C_MAX_HEAD_DIM:
        return f"a head of D={keys.shape[-1]} is wider than the C kernel's rows (D <= {C_MAX_HEAD_DIM})"
    return native.unavailable_reason("compact_cpu")


def use_native(native_choice: bool | None, keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether the C mover moves these rows: `native_choice` None = whenever it can, False = never, True = always
    (RuntimeError naming the blocker when it cannot)."""
    blocker = native_blocker(keys, values)
    if native_choice and blocker is not None:
        raise RuntimeError(f"native: the C row kernel cannot run: {blocker}")
    return blocker is None if native_choice is None else native_choice


def angle_table(delta: torch.Tensor, inv_freq: torch.Tensor):
    """cos, sin float32 [rows, R/2] (what the C kernel reads; inv_freq [R/2]) of the distinct integer deltas, each
    row's table index (int32, delta's shape) and the row of delta 0 (-1 if none). CPU only: the table size is read
    from the data.

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
    kernel reads each pair's axis from `layout.axis_tensor()` and turns the R/2 = inv_freq.numel() pairs of channels
    [0, R); channels [R, D) move as bytes (partial rotary).
    delta=None (no pruned tokens): nothing rotates, rows only move — every token reads the one table row of
    delta 0 on one axis, so the walk skips the tokens that stay and copies the others exactly. stream: rows that
    change slot are written with streaming stores (`put_row` in the C file: for moves whose destinations the walk
    has not just read, H2SVC's)."""
    L, B, Hkv, N, D = keys.shape
    pairs = inv_freq.numel()
    if delta is None:
        A, layout = 1, RotaryLayout.one_d(pairs)
        cos, sin = torch.ones(1, pairs), torch.zeros(1, pairs)
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
    src = src.contiguous()
    bindings.compact_rows(keys, values, P, src, ktab, A, axis, cos, sin, zero, first, m, pruned, ptab, sums[0],
                          sums[1], stream)
    return None if m == 0 else (sums[0], sums[1])

"""The engine's generic input checks, used by both policies' op checks (`hermes_kernels.policies.*.checks`) and by
the model glue.

Every check runs before anything is written, so a failed call leaves its tensors untouched. Errors are ValueError
(bad shape, value or size) or TypeError (bad type or dtype), and every message starts with the argument's name.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .dtypes import CACHE_DTYPES
from .rope import RotaryLayout

REINDEX_MODES = ("lazy", "eager")  # when positions are re-indexed (docs/hermes.md §2.7, docs/h2svc.md §4)


def check_int(name: str, value, minimum: int) -> int:
    """An int (not a bool; else TypeError) >= minimum (else ValueError), returned."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")
    return value


def check_positive_int(name: str, value, allow_none: bool = False) -> int | None:
    """A positive int (None too when `allow_none`), returned; ValueError naming `name` otherwise (a setting of a
    cache, a stream or a command line, where a wrong type and a wrong value are the same mistake)."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    return value


def check_tensor(name: str, x, ndim: Sequence[int], dtypes: Sequence[torch.dtype], shape_doc: str) -> None:
    """x is a torch.Tensor (else TypeError) with x.dim() in `ndim` (else ValueError) and a dtype in `dtypes` (else
    TypeError); every message names the argument `name` and quotes `shape_doc`."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor {shape_doc}, got {type(x).__name__}")
    if x.dim() not in ndim:
        raise ValueError(f"{name}: expected shape {shape_doc}, got {tuple(x.shape)}")
    if x.dtype not in dtypes:
        raise TypeError(f"{name}: dtype {x.dtype} not supported for {shape_doc}; expected one of "
                        f"{[str(d) for d in dtypes]}")


def check_same_device(name: str, x: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    """ValueError naming `name` unless x lives on ref's device."""
    if x.device != ref.device:
        raise ValueError(f"{name}: on {x.device} but {ref_name} is on {ref.device}; pass both on one device")


def check_keys_values(keys, values, ndim: int, shape_doc: str) -> None:
    """A cache's key and value tensors: `ndim` dims, a cache dtype, and values of the keys' shape, dtype and device
    (the pair both policies' ops take; shape_doc names the dims in messages)."""
    check_tensor("keys", keys, (ndim,), CACHE_DTYPES, shape_doc)
    check_tensor("values", values, (ndim,), CACHE_DTYPES, shape_doc)
    if values.shape != keys.shape:
        raise ValueError(f"values: expected the shape of keys {tuple(keys.shape)}, got {tuple(values.shape)}")
    if values.dtype != keys.dtype:
        raise TypeError(f"values: dtype {values.dtype} differs from keys' {keys.dtype}")
    check_same_device("values", values, "keys", keys)


def check_positions(positions, leading: list[int], length: int, layout: RotaryLayout, keys: torch.Tensor) -> None:
    """Position ids int64 [*leading, N] (a 1D layout) or [*leading, 3, N] (M-RoPE: t, h, w) on keys' device."""
    mrope = layout.num_axes == 3
    expected = [*leading, 3, length] if mrope else [*leading, length]
    check_tensor("positions", positions, (len(expected),), (torch.int64,),
                 f"{expected} int64" + (" (M-RoPE: t, h, w)" if mrope else ""))
    if list(positions.shape) != expected:
        raise ValueError(f"positions: expected {expected} int64, got {tuple(positions.shape)}")
    check_same_device("positions", positions, "keys", keys)


def check_rotary(inv_freq, rotary: Sequence[int] | RotaryLayout | None, head_dim: int) -> RotaryLayout:
    """inv_freq [R/2] float, R <= D the rotary width; rotary None (1D RoPE) or three pair counts (t, h, w, contiguous
    sections), both over the whole head (R = D), or a RotaryLayout of R/2 pairs (partial rotary when R < D).
    Returns the layout every rotation of the op reads."""
    check_tensor("inv_freq", inv_freq, (1,), (torch.float32, torch.float64, torch.float16, torch.bfloat16), "[R/2]")
    layout = RotaryLayout.of(rotary, head_dim // 2)
    if inv_freq.numel() != layout.pairs:
        raise ValueError(f"inv_freq: expected [R/2={layout.pairs}] for {layout.describe()} (head dim D={head_dim}), "
                         f"got {tuple(inv_freq.shape)}")
    return layout

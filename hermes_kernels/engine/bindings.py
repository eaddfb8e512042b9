"""The one ctypes face of the C files (compact_cpu.c, stce_cpu.c): every call into them goes through a wrapper here.

Each C function's argument types are declared once (`_SIGNATURES`) and set on the loaded function the first time
it is used; a wrapper takes tensors (their data pointers are passed; the C contract, in the .c file above each
function, says which must be contiguous) and ints, adds the worker thread count, and turns a failure status into
a RuntimeError. Whether a library is there at all is `native.library(name)`'s answer: the callers ask first.
See docs/api.md#cpu-code.
"""
from __future__ import annotations

import ctypes
import functools

import torch

from . import native

__all__ = ["C_DTYPES", "C_MAX_HEAD_DIM", "compact_rows", "dense_rank", "frame_reindex", "stce_rows"]

C_DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # the cache dtype codes of compact_cpu.c
C_MAX_HEAD_DIM = 1024  # compact_cpu.c's 2·MAX_HALF: the widest row its walk's buffers on the stack hold

_PTR, _I64, _I32, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_int
# C function -> (library, argument types), in the order of the C signatures; every one returns an int status
_SIGNATURES = {
    "hermes_compact_rows": ("compact_cpu", (_PTR, _PTR, _INT, _PTR, _PTR, _PTR, _I64, _I64, _PTR, _PTR, _I64, _I64,
                                            _PTR, _PTR, _PTR, _I32, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _INT, _INT)),
    "hermes_dense_rank": ("compact_cpu", (_PTR, _PTR, _I64, _I64, _I64, _PTR, _INT)),
    "hermes_frame_reindex": ("compact_cpu", (_PTR, _PTR, _I64, _I64, _I64, _PTR, _I64, _I64, _I64, _I64, _I64, _PTR,
                                             _PTR, _INT)),
    "hermes_stce_rows": ("stce_cpu", (_PTR, _PTR, _INT, _PTR, _I64, _I64, _I64, _I64, _I64, _PTR)),
}


@functools.lru_cache(maxsize=None)
def _typed(library: ctypes.CDLL, name: str):
    function = getattr(library, name)
    function.argtypes = _SIGNATURES[name][1]
    function.restype = ctypes.c_int
    return function


def _function(name: str):
    """The typed C function `name` of the loaded library (RuntimeError naming why when there is none)."""
    library_name = _SIGNATURES[name][0]
    library = native.library(library_name)
    if library is None:
        raise RuntimeError(f"{library_name}.c: {name} cannot run: {native.unavailable_reason(library_name)}")
    return _typed(library, name)


def _ptr(x: torch.Tensor | None) -> int | None:
    return None if x is None else x.data_ptr()


def compact_rows(keys: torch.Tensor, values: torch.Tensor, P: int, src: torch.Tensor, ktab: torch.Tensor, A: int,
                 axis: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, zero_row: int, first: int, m: int,
                 pruned: torch.Tensor, ptab: torch.Tensor, k_sum: torch.Tensor, v_sum: torch.Tensor,
                 stream: bool) -> None:
    """`hermes_compact_rows`: the in-place row walk of keys / values [L, B, Hkv, N, D] (fp32 or bf16, any strides
    with contiguous rows). src int64 [L, B, n] and ktab int32 [L, B, A, n] (contiguous); axis int32 [R/2]; cos / sin
    float32 [rows, R/2], R/2 the rotary pairs (<= D/2: the walk turns channels [0, R) and carries [R, D) unrotated);
    pruned int64 [L - first, B, m] and ptab int32 (any contiguous int64 / int32 when m = 0); k_sum / v_sum float64
    [L - first, B, Hkv, D] receive the summary sums."""
    L, B, Hkv, _, D = keys.shape
    rh = cos.shape[-1]
    if axis.numel() != rh or sin.shape != cos.shape:
        raise ValueError(f"axis: expected [R/2={rh}] entries, one per column of the cos / sin table "
                         f"{tuple(cos.shape)}, got axis {tuple(axis.shape)} and sin {tuple(sin.shape)}")
    shape = torch.tensor([L, B, Hkv, D], dtype=torch.int64)
    kstride = torch.tensor(keys.stride()[:4], dtype=torch.int64)
    vstride = torch.tensor(values.stride()[:4], dtype=torch.int64)
    status = _function("hermes_compact_rows")(
        keys.data_ptr(), values.data_ptr(), C_DTYPES[keys.dtype], shape.data_ptr(), kstride.data_ptr(),
        vstride.data_ptr(), P, src.shape[-1], src.data_ptr(), ktab.data_ptr(), A, rh, axis.data_ptr(),
        cos.data_ptr(), sin.data_ptr(), zero_row, first, m, pruned.data_ptr(), ptab.data_ptr(), k_sum.data_ptr(),
        v_sum.data_ptr(), int(stream), torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"compact_cpu.c: hermes_compact_rows returned {status} (1: bad dtype {keys.dtype}, "
                           f"head_dim {D}, rotary pairs {rh}, axis count {A} or axis map; 2: a worker thread "
                           f"failed)")


def dense_rank(values: torch.Tensor, valid: torch.Tensor | None, max_span: int, rank: torch.Tensor) -> bool:
    """`hermes_dense_rank`: counting dense ranks of values int64 [rows, n] (contiguous) into rank (same shape);
    valid uint8 [rows, n] or None (every lane valid). False when a row's span is over max_span (rank incomplete:
    the caller sorts instead)."""
    status = _function("hermes_dense_rank")(values.data_ptr(), _ptr(valid), values.shape[0], values.shape[1],
                                            max_span, rank.data_ptr(), torch.get_num_threads())
    if status not in (0, 3):
        raise RuntimeError(f"compact_cpu.c: hermes_dense_rank returned {status} (2: a worker thread failed or a "
                           "presence table could not be allocated)")
    return status == 0


def frame_reindex(pos: torch.Tensor, source: torch.Tensor, P: int, T: int, next_position: int, max_span: int,
                  new: torch.Tensor, delta: torch.Tensor) -> bool:
    """`hermes_frame_reindex`: H2SVC's re-index plan from positions int64 [H, B, A, C] (any strides) and the slot
    plan's source int64 [H, B, held] (contiguous) into new / delta int64 [H, B, A, held·T]. False when a row's span
    is over max_span (nothing usable written: the caller plans in torch ops)."""
    H, B, A, _ = pos.shape
    stride = torch.tensor(pos.stride(), dtype=torch.int64)
    status = _function("hermes_frame_reindex")(pos.data_ptr(), stride.data_ptr(), H, B, A, source.data_ptr(),
                                               source.shape[-1], P, T, next_position, max_span, new.data_ptr(),
                                               delta.data_ptr(), torch.get_num_threads())
    if status not in (0, 3):
        raise RuntimeError(f"compact_cpu.c: hermes_frame_reindex returned {status} (2: a worker thread failed or a "
                           "presence table could not be allocated)")
    return status == 0


def stce_rows(times: torch.Tensor, d2: torch.Tensor, log_gap: torch.Tensor, W: int, capacity: int,
              kept: torch.Tensor) -> None:
    """`hermes_stce_rows`: STCE's arrival loop of every row. times int64 [R, M], d2 [R, M, M] float32 or float64,
    log_gap [G] of d2's dtype (log_gap[g] = log(g)), kept int64 [R, capacity]; all contiguous."""
    R, M = times.shape
    status = _function("hermes_stce_rows")(times.data_ptr(), d2.data_ptr(), int(d2.dtype == torch.float64),
                                           log_gap.data_ptr(), log_gap.numel(), R, M, W, capacity, kept.data_ptr())
    if status != 0:
        raise RuntimeError(f"stce_cpu.c: hermes_stce_rows returned {status} (1: {M} lanes, over its limit; 2: the "
                           f"log(gap) table of {log_gap.numel()} entries is shorter than the newest frame index + 1)")

"""H2SVC stage (a): the mean value vector of every arriving frame, the feature STCE compares frames by (values, not
keys: they carry no rotary phase, so frames at different positions compare directly). Sums run in float32 whatever
the cache dtype (float64 for a float64 cache, as the reference) and are divided once by T_f, in one Triton launch
(`frame_features_triton`) or one torch reduction (`frame_features_torch`). docs/h2svc.md §3,
docs/api.md#h2svc-ops.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...engine.dtypes import TRITON_WORK, work_dtype
from ...engine.launch import launch
from ...engine.rounding import div_rn

__all__ = ["frame_features_torch", "frame_features_triton"]



def frame_features_torch(values: torch.Tensor, tokens_per_frame: int) -> torch.Tensor:
    """Mean value vector per frame, V_f = (1 / T_f) · Σ_{k < T_f} v[f·T_f + k]: values [H, B, F·T_f, D]
    fp16/bf16/fp32/fp64 (any strides) -> [H, B, F, D] float32 (float64 for float64 values). One reduction over an
    [H, B, F, T_f, D] view, which splitting a dimension makes without a copy whatever the strides. Inputs already
    validated."""
    frames = values.unflatten(-2, (values.shape[-2] // tokens_per_frame, tokens_per_frame))
    return frames.sum(dim=-2, dtype=work_dtype(values)).div_(tokens_per_frame)


def _output(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The Triton kernel's output, uninitialised: the kernel writes every element (tests poison it here)."""
    return torch.empty(shape, dtype=dtype, device=device)


# Grid (H·B·F, cdiv(D, BLOCK_D)): a program reads its frame's T_f value rows in [BLOCK_T, BLOCK_D] tiles, contiguous
# along the channels, once each, and writes one [BLOCK_D] slice of the frame's mean. B and F (streams, frames of the
# chunk) are runtime values, not specialised: a ragged last chunk or another stream count needs no new compile.
# Compile spec (GPU guard): the H2SVC step's, `gpu_specs.step`, which launches it as a step does.
@triton.jit(do_not_specialize=["B", "F"])
def _frame_features_kernel(v_ptr, out_ptr, sv_h, sv_b, sv_n, sv_d, so_h, so_b, so_f, so_d,
                           B, F, T, D,
                           WORK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)  # (row, stream, frame), frame fastest
    frame = pid % F
    stream = pid // F % B
    row = pid // F // B
    channel = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    in_dim = channel < D
    base = v_ptr + row.to(tl.int64) * sv_h + stream.to(tl.int64) * sv_b + (frame * T).to(tl.int64) * sv_n
    total = tl.zeros([BLOCK_D], WORK)
    for start in range(0, T, BLOCK_T):
        token = start + tl.arange(0, BLOCK_T)
        mask = (token < T)[:, None] & in_dim[None, :]
        tile = tl.load(base + token.to(tl.int64)[:, None] * sv_n + channel[None, :] * sv_d, mask=mask, other=0)
        total += tl.sum(tile.to(WORK), axis=0)
    out = out_ptr + row.to(tl.int64) * so_h + stream.to(tl.int64) * so_b + frame.to(tl.int64) * so_f
    tl.store(out + channel * so_d, div_rn(total, T), mask=in_dim)  # correctly rounded: features decide STCE


def frame_features_triton(values: torch.Tensor, tokens_per_frame: int) -> torch.Tensor:
    """`frame_features_torch` in one Triton launch: values [H, B, F·T_f, D] (any strides) -> [H, B, F, D] float32
    (float64 for float64 values). Inputs already validated."""
    H, B, N, D = values.shape
    T = tokens_per_frame
    F = N // T
    work = work_dtype(values)
    out = _output((H, B, F, D), work, values.device)
    block_d = min(128, triton.next_power_of_2(D))
    block_t = min(32, triton.next_power_of_2(T))
    launch(_frame_features_kernel, (H * B * F, triton.cdiv(D, block_d)), values, out,
           *values.stride(), *out.stride(), B, F, T, D,
           WORK=TRITON_WORK[work], BLOCK_T=block_t, BLOCK_D=block_d)
    return out

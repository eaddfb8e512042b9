"""HERMES guidance pooling: every key's causal softmax probability, averaged over a guidance prompt's heads and query
tokens, without building the [H, Q, N] probabilities. Triton makes two launches for any L and B: each query row's
log-sum-exp, then a key-stationary sum in which one program writes each key (deterministic, no atomics); the torch
twin sums over chunks of GQA groups whose logits are bounded by `_TORCH_CHUNK_ELEMS`. docs/hermes.md §2.3,
docs/hermes.md §5 item 7, docs/decisions.md#hermes-scoring.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ...engine.checks import check_written
from ...engine.launch import launch

_LOG2E = 1.4426950408889634
# the torch twin holds at most this many logits (and as many softmax outputs, and upcast keys) per chunk: 16 MiB in
# fp32, so a chunk's logits and probabilities can stay in a server CPU's last-level cache
_TORCH_CHUNK_ELEMS = 1 << 22


def _as_stacked(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """View [B, H, Q, D] / [B, Hkv, N, D] inputs as one layer of the stacked form [1, B, ...]."""
    return (q, k) if q.dim() == 5 else (q.unsqueeze(0), k.unsqueeze(0))


def _output(out: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The float32 [L, B, N] result buffer: a fresh one, or the caller's `out` ([B, N] or [L, B, N], any strides)
    viewed in the stacked form."""
    shape = (*k.shape[:-3], k.shape[-2])
    if out is None:
        out = torch.empty(shape, dtype=torch.float32, device=q.device)
    elif out.shape != shape or out.dtype != torch.float32 or out.device != q.device:
        raise ValueError(f"out: expected float32 {list(shape)} on {q.device}, got {out.dtype} {tuple(out.shape)} "
                         f"on {out.device}")
    else:
        check_written([("out", out)], [("q", q), ("k", k)])  # written while q and k are read
    return out if out.dim() == 3 else out.unsqueeze(0)


# ----------------------------------------------------------------------------------------------------------------------
# Triton
# ----------------------------------------------------------------------------------------------------------------------

@triton.jit
def _logits(q_rows, row_ok, k_rows, key_ok, D, sq_d, sk_d,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """q·kᵀ float32 [BLOCK_M, BLOCK_N] of the query rows at `q_rows` and the keys at `k_rows` (row pointers), BLOCK_K
    dims at a time: registers and shared memory stay bounded whatever the head dim (a whole-row fp32 dot spilled)."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_K):
        dims = d0 + tl.arange(0, BLOCK_K)
        dim_ok = dims < D
        q = tl.load(q_rows + dims[None, :] * sq_d, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
        k = tl.load(k_rows + dims[None, :] * sk_d, mask=key_ok[:, None] & dim_ok[None, :], other=0.0)
        acc += tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision=PRECISION)
    return acc


# Pass 1, grid (L·B·Hkv, cdiv(G·Q, BLOCK_M)): a program owns BLOCK_M query rows of one GQA group (row r = g·Q + i is
# query i of head kv_head·G + g) and streams that group's keys once, BLOCK_N rows at a time, keeping a running max/sum.
@triton.jit
def _row_lse_kernel(q_ptr, k_ptr, lse_ptr,
                    B, Hkv, G, Q, N, D, qk_scale,
                    sq_l, sq_b, sq_h, sq_q, sq_d,
                    sk_l, sk_b, sk_h, sk_n, sk_d,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    PRECISION: tl.constexpr):
    group = tl.program_id(0).to(tl.int64)
    kv_head = group % Hkv
    layer = group // Hkv // B
    stream = group // Hkv % B
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < G * Q
    query = rows % Q
    head = kv_head * G + rows // Q
    q_rows = q_ptr + layer * sq_l + stream * sq_b + head[:, None] * sq_h + query[:, None] * sq_q
    last_visible = N - Q + query
    k_base = k_ptr + layer * sk_l + stream * sk_b + kv_head * sk_h
    # a finite start keeps padded rows NaN-free; every real row sees key 0, so its max becomes a real logit
    run_max = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    run_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        # logits in log2 units: exp2(s·log2e) == exp(s)
        logits = _logits(q_rows, row_ok, k_base + keys[:, None] * sk_n, keys < N, D, sq_d, sk_d,
                         BLOCK_M, BLOCK_N, BLOCK_K, PRECISION) * qk_scale
        logits = tl.where(keys[None, :] <= last_visible[:, None], logits, float("-inf"))
        new_max = tl.maximum(run_max, tl.max(logits, axis=1))
        run_sum = run_sum * tl.exp2(run_max - new_max) + tl.sum(tl.exp2(logits - new_max[:, None]), axis=1)
        run_max = new_max
    # lse is laid out [L, B, Hkv, G·Q] == [L, B, H, Q]
    tl.store(lse_ptr + group * G * Q + rows, run_max + tl.log2(run_sum), mask=row_ok)


# Pass 2, grid (L·B, cdiv(N, BLOCK_N)): key-stationary. A program owns one key tile of one (layer, stream), loads it
# once per KV head and sweeps all G·Q query rows of that head's group past it, summing exp(s - lse) per key (its keys
# and the small q and lse stay in cache); it alone writes its keys, in a fixed order: deterministic, no atomics.
@triton.jit
def _pooled_kernel(q_ptr, k_ptr, lse_ptr, out_ptr,
                   B, Hkv, G, Q, N, D, qk_scale, inv_count,
                   sq_l, sq_b, sq_h, sq_q, sq_d,
                   sk_l, sk_b, sk_h, sk_n, sk_d,
                   so_l, so_b, so_n,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   PRECISION: tl.constexpr):
    layer_stream = tl.program_id(0).to(tl.int64)
    layer = layer_stream // B
    stream = layer_stream % B
    keys = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    key_ok = keys < N
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for kv_head in range(0, Hkv):
        k_rows = k_ptr + layer * sk_l + stream * sk_b + kv_head * sk_h + keys[:, None] * sk_n
        lse_base = lse_ptr + (layer_stream * Hkv + kv_head) * G * Q
        for row_start in range(0, G * Q, BLOCK_M):
            rows = row_start + tl.arange(0, BLOCK_M)
            row_ok = rows < G * Q
            query = rows % Q
            head = kv_head * G + rows // Q
            q_rows = q_ptr + layer * sq_l + stream * sq_b + head[:, None] * sq_h + query[:, None] * sq_q
            lse = tl.load(lse_base + rows, mask=row_ok, other=0.0)
            logits = _logits(q_rows, row_ok, k_rows, key_ok, D, sq_d, sk_d,
                             BLOCK_M, BLOCK_N, BLOCK_K, PRECISION) * qk_scale
            visible = row_ok[:, None] & (keys[None, :] <= (N - Q + query)[:, None])
            # hidden entries go to exp2(-inf) = 0 before exponentiating, so they cannot overflow
            total += tl.sum(tl.exp2(tl.where(visible, logits - lse[:, None], float("-inf"))), axis=0)
    tl.store(out_ptr + layer * so_l + stream * so_b + keys * so_n, total * inv_count, mask=key_ok)


# Query rows and head dims per dot: 32 x 32 for tf32, 32 x 16 for the fp32 FMA path (its registers grow fastest
# with the dims); no spills on sm_80 / sm_90 at 80-146 registers per thread (bench/kernels.py).
_BLOCK_ROWS = 32
_BLOCK_DIMS = {"tf32": 32, "ieee": 16}


def pooled_attention_triton(q: torch.Tensor, k: torch.Tensor, scale: float | None,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    """Pooled causal attention per key (§2.3) in two Triton launches, whatever L and B are.

    q: [B, H, Q, D] or [L, B, H, Q, D]; k: [B, Hkv, N, D] or [L, B, Hkv, N, D]; fp16/bf16/fp32 (fp64 is read and
    computed in fp32); any strides. `scale` defaults to 1/sqrt(D). Returns float32 [B, N] ([L, B, N]), written into
    `out` when given. Inputs are validated by `hermes_kernels.pooled_attention`.
    """
    q5, k5 = _as_stacked(q, k)
    L, B, H, Q, D = q5.shape
    Hkv, N = k5.shape[2], k5.shape[3]
    G = H // Hkv
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    lse = torch.empty(L * B * H * Q, dtype=torch.float32, device=q.device)
    out5 = _output(out, q, k)
    # fp16/bf16 tiles are upcast before tl.dot: exact in tf32 (10-bit mantissa), and the Triton 3.9 interpreter
    # mis-computes bf16 dots. fp32/fp64 inputs need full-precision products to meet fp32 tolerances.
    precision = "tf32" if q.dtype in (torch.float16, torch.bfloat16) else "ieee"
    rows = G * Q
    block_m = min(_BLOCK_ROWS, max(16, triton.next_power_of_2(rows)))
    block_n = 64
    block_k = min(_BLOCK_DIMS[precision], max(16, triton.next_power_of_2(D)))
    meta = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision, num_warps=4)
    qk_scale = scale * _LOG2E
    launch(_row_lse_kernel, (L * B * Hkv, triton.cdiv(rows, block_m)), q5, k5, lse,
           B, Hkv, G, Q, N, D, qk_scale, *q5.stride(), *k5.stride(), **meta)
    launch(_pooled_kernel, (L * B, triton.cdiv(N, block_n)), q5, k5, lse, out5,
           B, Hkv, G, Q, N, D, qk_scale, 1.0 / (H * Q), *q5.stride(), *k5.stride(), *out5.stride(), **meta)
    return out5 if q.dim() == 5 else out5[0]


# ----------------------------------------------------------------------------------------------------------------------
# torch twin
# ----------------------------------------------------------------------------------------------------------------------

def pooled_attention_torch(q: torch.Tensor, k: torch.Tensor, scale: float | None,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """Pooled causal attention per key (§2.3): batched matmul + softmax over chunks of (layer, stream, KV head)
    groups, each group holding all heads that share the KV head; no host sync. Per key j,
    a_j = 1/(H·Q) · Σ_h Σ_i softmax_j(scale · q_{h,i} · k_{h//G, j}), the softmax over the keys query i sees
    (bottom-right causal: j <= N - Q + i; G = H / Hkv query heads per KV head), as the Triton passes compute it.

    q: [B, H, Q, D] or [L, B, H, Q, D]; k: [B, Hkv, N, D] or [L, B, Hkv, N, D]; fp16/bf16/fp32 (computed in fp32) or
    fp64 (computed in fp64). Returns float32 [B, N] ([L, B, N]), written into `out` when given. At most
    `_TORCH_CHUNK_ELEMS` logits exist at a time: whole GQA groups per chunk, or blocks of one group's query rows when a
    group alone is larger. Inputs are validated by `hermes_kernels.pooled_attention`.
    """
    q5, k5 = _as_stacked(q, k)
    out5 = _output(out, q, k)
    L, B, H, Q, D = q5.shape
    Hkv, N = k5.shape[2], k5.shape[3]
    rows = (H // Hkv) * Q
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    # rows of one group are (head-in-group, query) pairs: consecutive query heads share a KV head (GQA)
    groups_q = q5.reshape(L * B * Hkv, rows, D)
    groups_k = k5.reshape(L * B * Hkv, N, D)
    # only the queries' own Q keys are ever hidden: row r (query r % Q) sees own key c iff c <= r % Q
    hidden = torch.arange(Q, device=q.device)[None, :] > (torch.arange(rows, device=q.device) % Q)[:, None]
    per_group = torch.zeros(L * B * Hkv, N, dtype=work, device=q.device)
    # a chunk of groups also upcasts its keys (N·D per group), so both sizes count against the bound
    group_chunk = max(1, _TORCH_CHUNK_ELEMS // (max(rows, D) * N))
    row_chunk = min(rows, max(1, _TORCH_CHUNK_ELEMS // N))
    for g0 in range(0, L * B * Hkv, group_chunk):
        g1 = min(g0 + group_chunk, L * B * Hkv)
        keys_t = groups_k[g0:g1].to(work).transpose(1, 2)
        for r0 in range(0, rows, row_chunk):
            r1 = min(r0 + row_chunk, rows)
            logits = torch.bmm(groups_q[g0:g1, r0:r1].to(work) * scale, keys_t)
            logits[..., N - Q:].masked_fill_(hidden[r0:r1], float("-inf"))
            per_group[g0:g1] += torch.softmax(logits, dim=-1).sum(dim=1)
    out5.copy_(per_group.view(L, B, Hkv, N).sum(dim=2) / (H * Q))
    return out5 if q.dim() == 5 else out5[0]

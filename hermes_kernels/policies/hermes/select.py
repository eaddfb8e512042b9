"""HERMES stage 3: the visual tokens each (layer, stream) keeps, its n_l = min(b_l, V) best scores in ascending cache
order (ties to the lower index), -1 padded to n = min(b, V): the contract of
`hermes_kernels.policies.hermes.reference.select_keep`. Both backends find the n_l-th largest score as a threshold
instead of sorting (`topk` in `select_keep_torch`, a radix select over integer keys in `select_keep_triton`); a
prefix sum over the kept tokens gives each its slot, so the output is ascending as written, and the same sum is the
destination map compaction can read (`destination_map`). docs/hermes.md §2.5, docs/decisions.md#hermes-scoring.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...engine.checks import check_written
from ...engine.launch import launch
from .config import HermesConfig

# digits of the threshold decided per sweep of a row: 32/4 = 8 sweeps for fp32 keys, 16 for fp64
_RADIX_BITS = 4


def _outputs(scores: torch.Tensor, cfg: HermesConfig, out: torch.Tensor | None,
             dest_out: torch.Tensor | None) -> tuple[int, torch.Tensor | None, torch.Tensor | None]:
    """n = min(budget, V), and the caller's output buffers (contiguous, checked; None when not given)."""
    L, B, V = scores.shape
    n = min(cfg.budget, V)
    wanted = (("out", out, (L, B, n), torch.int64), ("dest_out", dest_out, (L, B, V), torch.int32))
    for name, buf, shape, dtype in wanted:
        if buf is not None and (not isinstance(buf, torch.Tensor) or tuple(buf.shape) != shape
                                or buf.dtype != dtype or buf.device != scores.device or not buf.is_contiguous()):
            got = f"{buf.dtype} {tuple(buf.shape)} (contiguous: {buf.is_contiguous()}) on {buf.device}" \
                if isinstance(buf, torch.Tensor) else type(buf).__name__
            raise ValueError(f"{name}: expected a contiguous {dtype} {list(shape)} on {scores.device}, got {got}")
    given = [(name, buf) for name, buf in (("out", out), ("dest_out", dest_out)) if buf is not None]
    check_written(given, [("scores", scores)])  # written while the scores are read
    return n, out, dest_out


def destination_map(keep: torch.Tensor, num_visual: int) -> torch.Tensor:
    """dest int32 [L, B, V]: the slot of every visual token among the kept ones (keep[l, b, dest[j]] = j), else -1.

    keep: int64 [L, B, n] as returned by `select_keep` (ascending, -1 padded); num_visual: V. No host sync.
    """
    L, B, n = keep.shape
    dest = torch.full((L, B, num_visual + 1), -1, dtype=torch.int32, device=keep.device)
    # padding (-1) is routed to the extra column V, dropped below
    target = torch.where(keep >= 0, keep, num_visual)
    slots = torch.arange(n, dtype=torch.int32, device=keep.device).expand(L, B, n)
    dest.scatter_(-1, target, slots)
    return dest[..., :num_visual].contiguous()


def select_keep_torch(scores: torch.Tensor, cfg: HermesConfig, out: torch.Tensor | None = None,
                      with_destination: bool = False, dest_out: torch.Tensor | None = None):
    """Kept visual indices int64 [L, B, n] (eq. 6), vectorised over layers and streams; no host sync.

    scores: float32/float64 [L, B, V], already validated, not NaN (±inf are fine; -0.0 ties with +0.0, as in the
    reference's sort). The threshold t is the n_l-th largest value, found with `topk` over whichever side of the
    row is smaller: the n largest values, or the V - min_l(n_l) + 1 smallest (whichever tied indices topk picked,
    the multiset of values is the same); a second tiny topk over that pool gives the value at each layer's rank.
    Kept: {j : s_j > t} and the first n_l - #{s_j > t} indices with s_j == t; keep[slot] = j, slot = the number
    of kept indices before j.
    out / dest_out: optional contiguous buffers to write into. Returns keep, or (keep, dest int32 [L, B, V]) when
    `with_destination` (dest[l, b, j] = slot of j among the kept, -1 if pruned).
    """
    n, out, dest_out = _outputs(scores, cfg, out, dest_out)
    L, B, V = scores.shape
    device = scores.device
    n_layer = cfg.on(device).layer_budget.clamp(max=V).view(L, 1, 1)  # n_l
    n_fewest = min(min(cfg.layer_budget_list), V)
    largest = 2 * n <= V
    pool = torch.topk(scores, n if largest else V - n_fewest + 1, dim=-1, largest=largest, sorted=False).values
    # the n_l-th largest value is the (n - n_l + 1)-th smallest of the n largest, or the (n_l - n_fewest + 1)-th
    # largest of the V - n_fewest + 1 smallest
    edge = torch.topk(pool, n - n_fewest + 1, dim=-1, largest=not largest, sorted=True).values
    rank = (n - n_layer) if largest else (n_layer - n_fewest)
    threshold = edge.gather(-1, rank.expand(L, B, 1))
    above = scores > threshold
    tied = scores == threshold
    ties_wanted = n_layer - above.sum(dim=-1, keepdim=True)
    kept = above | (tied & (tied.cumsum(dim=-1) <= ties_wanted))
    slot = kept.cumsum(dim=-1) - 1
    keep = torch.full((L, B, n + 1), -1, dtype=torch.int64, device=device)
    # pruned tokens are routed to the extra column n, dropped below
    keep.scatter_(-1, torch.where(kept, slot, n), torch.arange(V, device=device).expand(L, B, V))
    keep = keep[..., :n]
    keep = keep.contiguous() if out is None else out.copy_(keep)
    if not with_destination:
        return keep
    dest = torch.where(kept, slot, -1)
    dest = dest.to(torch.int32) if dest_out is None else dest_out.copy_(dest)
    return keep, dest


@triton.jit
def _ordered_key(x):
    """Unsigned integer key with the order of the float x (fp32 -> uint32, fp64 -> uint64); -0.0 maps to +0.0."""
    x = tl.where(x == 0, 0.0, x)
    if x.dtype == tl.float64:
        bits = x.to(tl.uint64, bitcast=True)
        sign = tl.full([], 1, tl.uint64) << 63
    else:
        bits = x.to(tl.uint32, bitcast=True)
        sign = tl.full([], 1, tl.uint32) << 31
    # negatives: flip every bit (larger magnitude -> smaller key); non-negatives: set the sign bit
    return tl.where((bits & sign) != 0, ~bits, bits | sign)


# grid (L*B,): one program per (layer, stream) row. It builds the n_l-th largest key RADIX_BITS at a time from the
# top (one sweep of the row per digit, counting keys against all 2^RADIX_BITS candidates at once), then sweeps once
# to count keys above it and once to emit the kept indices.
@triton.jit
def _select_keep_kernel(scores_ptr, keep_ptr, dest_ptr, layer_budget_ptr, B, V, n_out,
                        stride_sl, stride_sb, stride_sv,
                        KEY_BITS: tl.constexpr, RADIX_BITS: tl.constexpr, NUM_DIGITS: tl.constexpr,
                        WRITE_DEST: tl.constexpr, BLOCK_V: tl.constexpr):
    row_id = tl.program_id(0)
    layer = row_id // B
    b = row_id % B
    row = scores_ptr + layer * stride_sl + b * stride_sb
    n_keep = tl.minimum(tl.load(layer_budget_ptr + layer), V).to(tl.int32)
    lanes = tl.arange(0, BLOCK_V)

    # threshold: the largest key t with #{key >= t} >= n_l. Digit by digit from the top, keep the largest digit
    # whose candidate still has n_l keys at or above it (digit 0 always does: it is the previous prefix).
    key_type = tl.uint64 if KEY_BITS == 64 else tl.uint32
    digits = tl.arange(0, NUM_DIGITS).to(key_type)
    threshold = tl.zeros([], dtype=key_type)
    for d in tl.static_range(KEY_BITS // RADIX_BITS):
        shift = KEY_BITS - RADIX_BITS * (d + 1)
        candidates = threshold | (digits << shift)
        counts = tl.zeros([NUM_DIGITS], dtype=tl.int32)
        for start in range(0, V, BLOCK_V):
            offs = start + lanes
            key = _ordered_key(tl.load(row + offs * stride_sv, mask=offs < V, other=0.0))
            at_or_above = (key[:, None] >= candidates[None, :]) & (offs < V)[:, None]
            counts += tl.sum(at_or_above.to(tl.int32), axis=0)
        best = tl.max(tl.where(counts >= n_keep, digits, 0), axis=0)
        threshold = threshold | (best << shift)

    above_total = 0
    for start in range(0, V, BLOCK_V):
        offs = start + lanes
        key = _ordered_key(tl.load(row + offs * stride_sv, mask=offs < V, other=0.0))
        above_total += tl.sum(((key > threshold) & (offs < V)).to(tl.int32), axis=0)
    ties_wanted = n_keep - above_total

    # emit: ties at the threshold go to the lowest indices; a prefix sum of the keep mask gives each its slot
    out_row = keep_ptr + row_id.to(tl.int64) * n_out
    kept_before = 0
    ties_before = 0
    for start in range(0, V, BLOCK_V):
        offs = start + lanes
        in_row = offs < V
        key = _ordered_key(tl.load(row + offs * stride_sv, mask=in_row, other=0.0))
        tied = ((key == threshold) & in_row).to(tl.int32)
        tie_rank = ties_before + tl.cumsum(tied, axis=0) - tied
        kept = (((key > threshold) & in_row) | ((tied != 0) & (tie_rank < ties_wanted))).to(tl.int32)
        slot = kept_before + tl.cumsum(kept, axis=0) - kept
        tl.store(out_row + slot, offs.to(tl.int64), mask=kept != 0)
        if WRITE_DEST:
            tl.store(dest_ptr + row_id.to(tl.int64) * V + offs, tl.where(kept != 0, slot, -1), mask=in_row)
        kept_before += tl.sum(kept, axis=0)
        ties_before += tl.sum(tied, axis=0)
    # layers keeping fewer than n (deep layers with a summary slot) pad with -1
    for start in range(n_keep, n_out, BLOCK_V):
        offs = start + lanes
        tl.store(out_row + offs, tl.full([BLOCK_V], -1, tl.int64), mask=offs < n_out)


def select_keep_triton(scores: torch.Tensor, cfg: HermesConfig, out: torch.Tensor | None = None,
                       with_destination: bool = False, dest_out: torch.Tensor | None = None):
    """Kept visual indices int64 [L, B, n] (eq. 6) in ONE Triton launch, no sort (radix-style threshold select).

    scores: float32/float64 [L, B, V], any strides, already validated, not NaN. Same outputs as `select_keep_torch`;
    out / dest_out (contiguous) are written in full. The destination map costs one extra store per token.
    """
    n, out, dest_out = _outputs(scores, cfg, out, dest_out)
    L, B, V = scores.shape
    if out is None:
        out = torch.empty((L, B, n), dtype=torch.int64, device=scores.device)
    if with_destination and dest_out is None:
        dest_out = torch.empty((L, B, V), dtype=torch.int32, device=scores.device)
    # a [BLOCK_V, 2^RADIX_BITS] comparison tile per sweep: 512 x 16 keeps it at 32 values per thread (8 warps)
    block_v = min(triton.next_power_of_2(V), 512)
    launch(_select_keep_kernel, (L * B,), scores, out, dest_out if with_destination else out,
           cfg.on(scores.device).layer_budget, B, V, n, *scores.stride(),
           KEY_BITS=8 * scores.element_size(), RADIX_BITS=_RADIX_BITS, NUM_DIGITS=2 ** _RADIX_BITS,
           WRITE_DEST=with_destination, BLOCK_V=block_v, num_warps=8)
    return (out, dest_out) if with_destination else out

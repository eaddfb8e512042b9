"""HERMES stage 2: the smoothed importance scores S~ [L, B, V] of the visual tokens from their pooled guidance
attention: attention and recency, each min-max normalised per (layer, stream), blended per layer, then smoothed from
the deepest layer up. One Triton launch for all layers and streams (`hermes_scores_triton`), or torch ops vectorised
over layers and streams that write the smoothing as one [L, L] matmul (`hermes_scores_torch`). Neither reduces over
the recency row: it is monotone in j, so its min is its first entry and its max exp(-0) = 1. The math: docs/hermes.md
§2.3–2.4 (normalisation: docs/hermes.md §5 item 6; recency in the released code's form: docs/hermes.md §5 item 3).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ...engine.checks import check_written
from ...engine.launch import launch
from ...engine.rounding import div_rn
from .config import HermesConfig


@functools.lru_cache(maxsize=64)
def _smoothing_matrix(cfg: HermesConfig, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """C [L, L] with S~[l] = Σ_m C[l, m]·S[m] (eq. 5 unrolled; memoised per config, device and dtype).

    cascade: C[l, l] = 1-λ_l, C[l, m] = (1-λ_m)·Π_{i=l}^{m-1} λ_i for l < m < L-1, C[l, L-1] = Π_{i=l}^{L-2} λ_i;
    cascade=False: C[l, l] = 1-λ_l and C[l, l+1] = λ_l; the deepest row is the identity row in both cases.
    Built in float64 on the host once, so the products carry no float32 rounding.
    """
    lam = cfg.lam.to(torch.float64).tolist()
    L = cfg.num_layers
    C = torch.zeros(L, L, dtype=torch.float64)
    C[L - 1, L - 1] = 1.0
    for layer in range(L - 2, -1, -1):
        C[layer, layer] = 1.0 - lam[layer]
        if cfg.cascade:
            C[layer] += lam[layer] * C[layer + 1]
        else:
            C[layer, layer + 1] = lam[layer]
    return C.to(device=device, dtype=dtype)


@functools.lru_cache(maxsize=64)
def _layer_params(cfg: HermesConfig, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[4, L] in the compute dtype: rows ω_l, k_l, λ_l and eps (a tensor, so float64 runs see eps unrounded)."""
    eps = torch.full((cfg.num_layers,), cfg.eps, dtype=torch.float64)
    rows = [cfg.omega.to(torch.float64), cfg.forget.to(torch.float64), cfg.lam.to(torch.float64), eps]
    return torch.stack(rows).to(device=device, dtype=dtype).contiguous()


@functools.lru_cache(maxsize=16)
def _smoothed_recency(cfg: HermesConfig, num_visual: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """C·(ω ⊙ R) [L, V]: the recency half of S~, which depends only on the config and V (memoised; a stream
    compresses at the same V every chunk). R is computed element by element as the reference does (eq. 1)."""
    omega, forget, _, eps = _layer_params(cfg, device, dtype)
    V = num_visual
    distance = (V - 1) - torch.arange(V, dtype=dtype, device=device)
    recency = torch.exp(-forget[:, None] * distance / max(V - 1, 1))
    # the row is monotone in j: its min is the first entry, its max exp(-0) = 1
    r_min = recency[:, :1]
    R = (recency - r_min) / (1 - r_min + eps[0])
    return _smoothing_matrix(cfg, device, dtype) @ (omega[:, None] * R)


def _check_out(out: torch.Tensor | None, like: torch.Tensor) -> None:
    if out is None:
        return
    if not isinstance(out, torch.Tensor) or out.shape != like.shape or out.dtype != like.dtype \
            or out.device != like.device:
        raise ValueError(f"out: expected a {like.dtype} tensor of shape {tuple(like.shape)} on {like.device}, got "
                         f"{tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__}")
    check_written([("out", out)], [("attn", like)])  # every program writes its own elements, none of attn's


def hermes_scores_torch(attn: torch.Tensor, cfg: HermesConfig, out: torch.Tensor | None = None) -> torch.Tensor:
    """S~ [L, B, V] from attn [L, B, V] (§2.3–2.4), vectorised over layers and streams; no host sync.

    attn: float32 (or float64) pooled attention over visual tokens, already validated; arithmetic in its dtype.
    Eq. 4–5 are linear, so S~ = C·((1-ω) ⊙ A) + C·(ω ⊙ R): the second term is memoised per (config, V) and the
    first is one [L, L] x [L, B·V] matmul of the scaled attention (rounding differs from the reference's
    per-layer recursion by a few ulp). out: optional [L, B, V] of attn's dtype to write into.
    Returns S~ in attn's dtype (float32 for float32 input, as the reference does).
    """
    _check_out(out, attn)
    L, B, V = attn.shape
    dtype, device = attn.dtype, attn.device
    omega, _, _, eps = _layer_params(cfg, device, dtype)
    # two reductions: aminmax(dim=...) is slower on CPU
    a_min, a_max = attn.amin(dim=-1, keepdim=True), attn.amax(dim=-1, keepdim=True)
    # (1-ω)·A = (a - min a) · (1-ω)/(max a - min a + eps); subtracting first keeps near-constant rows exact
    weighted = (attn - a_min).mul_((1 - omega)[:, None, None] / (a_max - a_min + eps[0]))
    recency = _smoothed_recency(cfg, V, device, dtype)
    if B > 1:
        recency = recency[:, None, :].expand(L, B, V)
    smooth = torch.addmm(recency.reshape(L, B * V), _smoothing_matrix(cfg, device, dtype),
                         weighted.reshape(L, B * V)).view(L, B, V)
    if out is None:
        return smooth
    return out.copy_(smooth)


# grid (B, cdiv(V, BLOCK_V)): each program owns one token tile of one stream and walks the layers deepest first,
# keeping the deeper layer's (smoothed) score in registers; per layer it first sweeps the whole row for min/max.
@triton.jit
def _hermes_scores_kernel(attn_ptr, out_ptr, params_ptr, L, V,
                          stride_al, stride_ab, stride_av, stride_ol, stride_ob, stride_ov,
                          CASCADE: tl.constexpr, BLOCK_V: tl.constexpr):
    b = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    in_row = offs < V
    dtype = attn_ptr.dtype.element_ty
    eps = tl.load(params_ptr + 3 * L)
    # eq. 1 distance to the newest token as a fraction of the span; j = 0 gives the row's minimum.
    # (V - 1 is lifted to a tensor: V == 1 arrives as a compile-time constant.)
    oldest_int = tl.zeros([], dtype=tl.int32) + (V - 1)
    span = tl.maximum(oldest_int, 1).to(dtype)
    oldest = oldest_int.to(dtype)
    distance = (oldest_int - offs).to(dtype)
    deeper = tl.zeros([BLOCK_V], dtype=dtype)
    for step in range(L):
        layer = L - 1 - step
        row = attn_ptr + layer * stride_al + b * stride_ab
        lo = tl.full([BLOCK_V], float("inf"), dtype=dtype)
        hi = tl.full([BLOCK_V], float("-inf"), dtype=dtype)
        for start in range(0, V, BLOCK_V):
            sweep = start + tl.arange(0, BLOCK_V)
            x = tl.load(row + sweep * stride_av, mask=sweep < V, other=0.0)
            lo = tl.minimum(lo, tl.where(sweep < V, x, float("inf")))
            hi = tl.maximum(hi, tl.where(sweep < V, x, float("-inf")))
        a_min = tl.min(lo, axis=0)
        a_max = tl.max(hi, axis=0)
        a = tl.load(row + offs * stride_av, mask=in_row, other=0.0)
        # correctly rounded divisions (a GPU's float32 `/` is approximate): these scores decide the keep sets
        A = div_rn(a - a_min, a_max - a_min + eps)
        omega = tl.load(params_ptr + layer)
        k = tl.load(params_ptr + L + layer)
        recency = tl.exp(div_rn(-k * distance, span))
        r_min = tl.exp(div_rn(-k * oldest, span))
        R = div_rn(recency - r_min, 1 - r_min + eps)
        raw = (1 - omega) * A + omega * R
        # the deepest layer keeps its raw score: λ is taken as 0 there
        lam = tl.where(layer == L - 1, 0.0, tl.load(params_ptr + 2 * L + layer))
        smooth = (1 - lam) * raw + lam * deeper
        tl.store(out_ptr + layer * stride_ol + b * stride_ob + offs * stride_ov, smooth, mask=in_row)
        if CASCADE:
            deeper = smooth
        else:
            deeper = raw


def hermes_scores_triton(attn: torch.Tensor, cfg: HermesConfig, out: torch.Tensor | None = None) -> torch.Tensor:
    """S~ [L, B, V] from attn [L, B, V] (§2.3–2.4) in ONE Triton launch for all layers and streams.

    attn: float32 (or float64) [L, B, V], any strides, already validated; arithmetic in attn's dtype.
    out: optional [L, B, V] of attn's dtype (any strides) to write into; every element is written.
    """
    _check_out(out, attn)
    L, B, V = attn.shape
    if out is None:
        out = torch.empty_like(attn, memory_format=torch.contiguous_format)
    params = _layer_params(cfg, attn.device, attn.dtype)
    block_v = min(triton.next_power_of_2(V), 1024)
    grid = (B, triton.cdiv(V, block_v))
    launch(_hermes_scores_kernel, grid, attn, out, params, L, V, *attn.stride(), *out.stride(),
           CASCADE=cfg.cascade, BLOCK_V=block_v)
    return out

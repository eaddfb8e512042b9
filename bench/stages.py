"""Synthetic inputs and one setup function per stage, shared by the speed and memory runs.

A stage's setup takes the inputs of one benchmark point (`Spec` -> `Inputs`) and a backend name and returns a
`Case`: `run()` does the work being measured, `reset()` (in-place stages only) restores the cache outside the
timed region, and `bytes_moved` is the least traffic the stage needs (DESIGN.md §4), from which GB/s and the
ratio to the memory floor follow.

Backends: "reference" is `hermes.reference`; "torch" and "triton" are `hermes_kernels` with that `backend=`;
"torch-ops" (compact and step, CPU) is the torch backend with its C row kernel switched off
(HERMES_KERNELS_NATIVE=0), i.e. the compaction's rows moved by torch ops; "eager" (pooled attention only)
materialises the [B, H, Q, N] probabilities as `output_attentions=True` does.
A backend or stage that is not there yet raises `Unavailable`, which the harness reports as "n/a".
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import math
import os
from typing import Callable

import torch

from hermes import HermesConfig

from .shapes import GRID_WIDTH, MROPE_TIME_STEP, PREFIX_LEN, TOKENS_PER_FRAME, ModelShape

BACKENDS = ("reference", "torch", "torch-ops", "triton")
TORCH_OPS_STAGES = ("compact", "step")  # where torch-ops differs from torch
GUIDANCE_MIXED = 40     # query tokens of the mixed prompt (local + "; " + global), mid layers
GUIDANCE_GLOBAL = 20    # query tokens of the global prompt, deep layers


class Unavailable(Exception):
    """A backend or stage that does not exist (yet) in this tree or on this device."""


@dataclasses.dataclass(frozen=True)
class Spec:
    """One benchmark point: a model shape at a budget, chunk size and cache dtype on a device.

    The cache holds what one compression step sees: the prefix P, `budget` tokens kept by earlier steps and
    one freshly encoded chunk, so N = P + budget + chunk_frames * tokens_per_frame.
    """

    shape: ModelShape
    budget: int
    chunk_frames: int
    dtype: torch.dtype
    device: torch.device
    batch: int = 1
    prefix_len: int = PREFIX_LEN
    tokens_per_frame: int = TOKENS_PER_FRAME
    reindex: str = "eager"
    seed: int = 0

    @property
    def chunk_tokens(self) -> int:
        return self.chunk_frames * self.tokens_per_frame

    @property
    def num_tokens(self) -> int:
        """N, cache length at the start of the step."""
        return self.prefix_len + self.budget + self.chunk_tokens

    @property
    def num_visual(self) -> int:
        """V = N - P."""
        return self.budget + self.chunk_tokens

    @functools.cached_property
    def cfg(self) -> HermesConfig:
        return self.shape.config(self.budget, self.prefix_len, self.reindex)

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def label(self) -> str:
        return f"{self.shape.name} b={self.budget} chunk={self.chunk_frames}f {self.dtype_name}"


def distinct_values(gen: torch.Generator, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """float32 `shape` whose last axis is a random permutation of 1..n, scaled to (0, 1]: never zero, no ties."""
    n = shape[-1]
    perm = torch.rand(shape, generator=gen, device=device).argsort(dim=-1)
    return (perm.to(torch.float32) + 1.0) / n


def visual_positions(spec: Spec, gen: torch.Generator) -> torch.Tensor:
    """Position ids of the whole cache as after earlier steps: int64 [L, B, N] (1D) or [L, B, 3, N] (M-RoPE).

    Prefix 0..P-1 on every axis. The `budget` retained tokens of each (layer, stream) are a random ascending
    subset of a history twice as long (so positions have gaps), and the chunk follows the history. For M-RoPE
    a visual token of frame f at merged-grid cell (r, c) sits at (P + MROPE_TIME_STEP*f, P + r, P + c).
    """
    L, B, P, device = spec.shape.num_layers, spec.batch, spec.prefix_len, spec.device
    T = spec.tokens_per_frame
    history = math.ceil(2 * spec.budget / T) * T
    draw = torch.rand(L * B, history, generator=gen, device=device)
    retained = draw.argsort(dim=-1)[:, :spec.budget].sort(dim=-1).values
    chunk = history + torch.arange(spec.chunk_tokens, device=device).expand(L * B, -1)
    token = torch.cat([retained, chunk], dim=-1).view(L, B, spec.num_visual)
    prefix = torch.arange(P, device=device).expand(L, B, P)
    if spec.shape.mrope_section is None:
        return torch.cat([prefix, P + token], dim=-1).contiguous()
    frame, cell = token // T, token % T
    visual = torch.stack([frame * MROPE_TIME_STEP, cell // GRID_WIDTH, cell % GRID_WIDTH], dim=2) + P
    return torch.cat([prefix.unsqueeze(2).expand(L, B, 3, P), visual], dim=-1).contiguous()


class Inputs:
    """Random inputs of one `Spec` on its device, built once and shared by every stage and backend.

    keys/values [L, B, Hkv, N, D] `spec.dtype` (pristine) and work copies that in-place stages modify;
    positions (see `visual_positions`); attn, scores float32 [L, B, V] without ties; keep int64 [L, B, n]
    from the reference selection of `scores`; guidance queries [B, H, Q, D] and keys [B, Hkv, N + Q, D]
    (layer 0's cache followed by the queries' own keys).
    """

    def __init__(self, spec: Spec):
        self.spec = spec
        shape, device = spec.shape, spec.device
        gen = torch.Generator(device=device).manual_seed(spec.seed)
        L, B, Hkv, D = shape.num_layers, spec.batch, shape.num_kv_heads, shape.head_dim
        cache_shape = (L, B, Hkv, spec.num_tokens, D)
        self.keys = torch.randn(cache_shape, generator=gen, device=device, dtype=spec.dtype)
        self.values = torch.randn(cache_shape, generator=gen, device=device, dtype=spec.dtype)
        self.positions = visual_positions(spec, gen)
        self.attn = distinct_values(gen, (L, B, spec.num_visual), device)
        self.scores = distinct_values(gen, (L, B, spec.num_visual), device)
        self.inv_freq = shape.inv_freq(device)
        self.guidance = {}
        for q_len in (GUIDANCE_MIXED, GUIDANCE_GLOBAL):
            q = torch.randn(B, shape.num_heads, q_len, D, generator=gen, device=device, dtype=spec.dtype)
            own = torch.randn(B, Hkv, q_len, D, generator=gen, device=device, dtype=spec.dtype)
            self.guidance[q_len] = (q, torch.cat([self.keys[0], own], dim=2))
        self.work_keys = self.keys.clone()
        self.work_values = self.values.clone()
        self.work_positions = self.positions.clone()
        self._keep = None

    @property
    def keep(self) -> torch.Tensor:
        """Kept indices for the compaction stage, from the reference selection (the contract's format)."""
        if self._keep is None:
            self._keep = backend_op("reference", "select_keep")(self.scores, self.spec.cfg)
        return self._keep

    def reset(self) -> None:
        """Restore the work cache from the pristine copy (outside any timed region)."""
        self.work_keys.copy_(self.keys)
        self.work_values.copy_(self.values)
        self.work_positions.copy_(self.positions)


@dataclasses.dataclass
class Case:
    """What one (stage, backend, spec) point measures: `run` timed, `reset` before every run when in place."""

    run: Callable[[], object]
    bytes_moved: int
    reset: Callable[[], None] | None = None
    has_floor: bool = False


def eager_pooled_attention(q: torch.Tensor, k: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """The straightforward pooled attention (§2.3) that materialises probabilities [B, H, Q, N] float32.

    q [B, H, Q, D], k [B, Hkv, N, D] (last Q keys the queries' own, causal bottom-right); GQA by repeating KV
    heads, as an `output_attentions=True` eager forward does. Returns float32 [B, N].
    """
    B, H, Q, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    scale = D ** -0.5 if scale is None else scale
    k_full = k.repeat_interleave(H // Hkv, dim=1)
    logits = torch.matmul(q, k_full.transpose(-1, -2)).to(torch.float32) * scale
    hidden = torch.arange(N, device=q.device)[None, :] > (N - Q + torch.arange(Q, device=q.device))[:, None]
    probs = logits.masked_fill(hidden, float("-inf")).softmax(dim=-1)
    return probs.mean(dim=(1, 2))


def backend_op(backend: str, name: str) -> Callable:
    """The stage function `name` of `backend`; raises Unavailable when it does not exist (yet)."""
    if backend == "eager":
        if name != "pooled_attention":
            raise Unavailable(f"eager has no {name}")
        return eager_pooled_attention
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS + ('eager',)}, got {backend!r}")
    module_name = "hermes.reference" if backend == "reference" else "hermes_kernels"
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise Unavailable(f"{module_name} does not import: {exc}") from exc
    fn = getattr(module, name, None)
    if fn is None:
        raise Unavailable(f"{module_name}.{name} does not exist yet")
    if backend == "torch-ops":
        return _without_c_rows(functools.partial(fn, backend="torch"))
    return fn if backend == "reference" else functools.partial(fn, backend=backend)


def _without_c_rows(fn: Callable) -> Callable:
    """fn run with HERMES_KERNELS_NATIVE=0 (read by hermes_kernels on every call), the previous value restored."""
    from hermes_kernels.native import ENV_SWITCH

    def run(*args, **kwargs):
        before = os.environ.get(ENV_SWITCH)
        os.environ[ENV_SWITCH] = "0"
        try:
            return fn(*args, **kwargs)
        finally:
            if before is None:
                del os.environ[ENV_SWITCH]
            else:
                os.environ[ENV_SWITCH] = before
    return run


def _cache_bytes(spec: Spec, tokens: int) -> int:
    """Bytes of K and V plus positions for `tokens` slots of every layer and stream."""
    s = spec.shape
    axes = 3 if s.mrope_section is not None else 1
    kv = 2 * s.num_layers * spec.batch * s.num_kv_heads * tokens * s.head_dim * spec.dtype.itemsize
    return kv + s.num_layers * spec.batch * axes * tokens * 8


def floor_bytes(spec: Spec) -> dict[str, int]:
    """Least traffic of the compaction and of the whole step (DESIGN.md §4), in bytes.

    Read K, V and positions of all N tokens in all layers, write those of the min(b, V) visual slots that
    end up filled (kept tokens and the summary; the prefix stays where it is); plus keep (compaction) or
    attn in and scores out (step).
    """
    L, B, V = spec.shape.num_layers, spec.batch, spec.num_visual
    kept = min(spec.budget, V)
    keep_bytes = L * B * kept * 8
    compact = _cache_bytes(spec, spec.num_tokens) + _cache_bytes(spec, kept) + keep_bytes
    step = compact + 2 * L * B * V * 4
    return {"compact": compact, "step": step}


def setup_pooled_attention(inputs: Inputs, backend: str, q_len: int) -> Case:
    """One layer's guidance pooling (§2.3): q [B, H, Q, D] against the cache + own keys [B, Hkv, N + Q, D]."""
    op = backend_op(backend, "pooled_attention")
    q, k = inputs.guidance[q_len]
    moved = q.numel() * q.element_size() + k.numel() * k.element_size() + k.shape[0] * k.shape[2] * 4
    return Case(run=lambda: op(q, k), bytes_moved=moved)


def setup_scores(inputs: Inputs, backend: str) -> Case:
    """Scoring and cross-layer smoothing (§2.3-2.4): attn float32 [L, B, V] -> S~ float32 [L, B, V]."""
    op = backend_op(backend, "hermes_scores")
    cfg = inputs.spec.cfg
    return Case(run=lambda: op(inputs.attn, cfg), bytes_moved=2 * inputs.attn.numel() * 4)


def setup_select(inputs: Inputs, backend: str) -> Case:
    """Top-b_l selection in cache order (§2.5): scores float32 [L, B, V] -> keep int64 [L, B, n]."""
    op = backend_op(backend, "select_keep")
    cfg = inputs.spec.cfg
    spec = inputs.spec
    moved = inputs.scores.numel() * 4 + spec.shape.num_layers * spec.batch * min(spec.budget, spec.num_visual) * 8
    return Case(run=lambda: op(inputs.scores, cfg), bytes_moved=moved)


def setup_compact(inputs: Inputs, backend: str) -> Case:
    """In-place gather, re-index, rotary delta and summary (§2.5-2.8) of the work cache; reset before each run."""
    op = backend_op(backend, "compact")
    spec = inputs.spec
    keep = inputs.keep
    return Case(run=lambda: op(inputs.work_keys, inputs.work_values, inputs.work_positions, keep, spec.cfg,
                               inputs.inv_freq, spec.shape.mrope_section),
                bytes_moved=floor_bytes(spec)["compact"], reset=inputs.reset, has_floor=True)


def setup_step(inputs: Inputs, backend: str) -> Case:
    """The whole compression step (§2.3-2.8) in place on the work cache; reset before each run."""
    op = backend_op(backend, "compress_step")
    spec = inputs.spec
    return Case(run=lambda: op(inputs.work_keys, inputs.work_values, inputs.work_positions, inputs.attn, spec.cfg,
                               inputs.inv_freq, spec.shape.mrope_section),
                bytes_moved=floor_bytes(spec)["step"], reset=inputs.reset, has_floor=True)


STAGES: dict[str, Callable[[Inputs, str], Case]] = {
    f"pooled_attention_q{GUIDANCE_MIXED}": functools.partial(setup_pooled_attention, q_len=GUIDANCE_MIXED),
    f"pooled_attention_q{GUIDANCE_GLOBAL}": functools.partial(setup_pooled_attention, q_len=GUIDANCE_GLOBAL),
    "scores": setup_scores,
    "select": setup_select,
    "compact": setup_compact,
    "step": setup_step,
}


def stage_backends(stage: str, backends: tuple[str, ...]) -> tuple[str, ...]:
    """The backends a stage is measured with: the chosen ones (torch-ops only where it differs from torch), plus
    the eager baseline for pooled attention."""
    chosen = tuple(b for b in backends if b != "torch-ops" or stage in TORCH_OPS_STAGES)
    return chosen + ("eager",) if stage.startswith("pooled_attention") else chosen

"""One setup function per stage, shared by the speed and memory runs (`STAGES`: stage name -> setup).

A setup takes one benchmark point's inputs (`bench.inputs.make_inputs`: `Inputs` for the HERMES and released-style
stages, `H2SVCInputs` for the H2SVC ones) and a backend name, and returns a `Case`: `run()` is timed, `reset()`
restores an in-place stage's cache outside the timed region, and `bytes_moved`, the least traffic the stage needs,
gives GB/s and the floor ratio. A backend or stage that does not exist raises `Unavailable` (printed "n/a"). The
stages and backends: docs/benchmarks.md#reading-the-table.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import os
from typing import Callable

import torch

from hermes_kernels.policies.h2svc.config import EPISODIC, INSTANT, SHORT

from .inputs import GUIDANCE_GLOBAL, GUIDANCE_MIXED, H2SVCInputs, Inputs, Spec
from .shapes import PREFIX_LEN, TOKENS_PER_FRAME, ModelShape

BACKENDS = ("reference", "torch", "torch-ops", "triton")
TORCH_OPS_STAGES = ("compact", "step", "h2svc_stce", "h2svc_step")  # where torch-ops differs from torch
H2SVC_STAGES = ("h2svc_features", "h2svc_stce", "h2svc_step")
RELEASED_STAGES = ("released_step", "released_guidance")
RELEASED_FAMILIES = ("llava_ov", "qwen2_5_vl")  # the model classes the released code has (its Qwen: 2.5-VL)
RELEASED = "released"          # the released-style baseline of the released stages
ADAPTER_BACKENDS = ("torch", "triton")  # what `accelerate` is given in the released stages' other rows


class Unavailable(Exception):
    """A backend or stage that does not exist (yet) in this tree or on this device."""


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


def backend_op(backend: str, name: str, policy: str = "hermes") -> Callable:
    """The stage function `name` of `backend` (the reference of `policy`); raises Unavailable when it does not
    exist (yet)."""
    if backend == "eager":
        if name != "pooled_attention":
            raise Unavailable(f"eager has no {name}")
        return eager_pooled_attention
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS + ('eager',)}, got {backend!r}")
    reference = f"hermes_kernels.policies.{policy}.reference"
    module_name = reference if backend == "reference" else "hermes_kernels"
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
    from hermes_kernels.engine.native import ENV_SWITCH

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
    g = spec.shape.geometry
    axes = 3 if g.mrope else 1
    kv = 2 * g.num_layers * spec.batch * g.num_kv_heads * tokens * g.head_dim * spec.dtype.itemsize
    return kv + g.num_layers * spec.batch * axes * tokens * 8


def floor_bytes(spec: Spec) -> dict[str, int]:
    """Least traffic of the compaction and of the whole step (docs/hermes.md §4), in bytes.

    Read K, V and positions of all N tokens in all layers, write those of the min(b, V) visual slots that
    end up filled (kept tokens and the summary; the prefix stays where it is); plus keep (compaction) or
    attn in and scores out (step).
    """
    L, B, V = spec.shape.geometry.num_layers, spec.batch, spec.num_visual
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
    kept = spec.shape.geometry.num_layers * spec.batch * min(spec.budget, spec.num_visual)
    moved = inputs.scores.numel() * 4 + kept * 8
    return Case(run=lambda: op(inputs.scores, cfg), bytes_moved=moved)


def setup_compact(inputs: Inputs, backend: str) -> Case:
    """In-place gather, re-index, rotary delta and summary (§2.5-2.8) of the work cache; reset before each run."""
    op = backend_op(backend, "compact")
    spec = inputs.spec
    keep = inputs.keep
    return Case(run=lambda: op(inputs.work_keys, inputs.work_values, inputs.work_positions, keep, spec.cfg,
                               inputs.inv_freq, spec.shape.geometry.rotary),
                bytes_moved=floor_bytes(spec)["compact"], reset=inputs.reset, has_floor=True)


def setup_step(inputs: Inputs, backend: str) -> Case:
    """The whole compression step (§2.3-2.8) in place on the work cache; reset before each run."""
    op = backend_op(backend, "compress_step")
    spec = inputs.spec
    return Case(run=lambda: op(inputs.work_keys, inputs.work_values, inputs.work_positions, inputs.attn, spec.cfg,
                               inputs.inv_freq, spec.shape.geometry.rotary),
                bytes_moved=floor_bytes(spec)["step"], reset=inputs.reset, has_floor=True)


def h2svc_floor_bytes(inputs: H2SVCInputs) -> dict[str, int]:
    """Least traffic of the H2SVC stages (the policies/h2svc/step.py docstring), in bytes.

    features: read the episodic arrivals' values, write their float32 features. step, per class block: without
    re-indexing read and write the movers' K and V rows and positions; with it read and write every retained
    key and position, and the movers' values; plus slot_frames in and out, and for the episodic block the
    features stage and the STCE inputs (held and arriving features) and the movers' features.
    """
    spec = inputs.spec
    cfg, B, T, F = spec.h2svc_cfg, spec.batch, spec.tokens_per_frame, spec.chunk_frames
    D, item = spec.shape.geometry.head_dim, spec.dtype.itemsize
    axes = 3 if spec.shape.geometry.mrope else 1
    features = 0
    step = 0
    for cls, block in inputs.blocks.items():
        rows, W, moved = cfg.num_rows(cls) * B, block.window, inputs.movers[cls]
        retained = rows * W * T  # tokens in the home slots after the step (full memories)
        if bool(inputs.clock.reindexed):
            step += 2 * retained * D * item + 2 * moved * T * D * item + 2 * retained * axes * 8
        else:
            step += 4 * moved * T * D * item + 2 * moved * T * axes * 8
        step += 2 * rows * W * 8
        if cls == EPISODIC:
            features = rows * F * T * D * item + rows * F * D * 4
            step += features + rows * (W + F) * D * 4 + moved * D * 4
    return {"features": features, "step": step}


def setup_h2svc_features(inputs: H2SVCInputs, backend: str) -> Case:
    """Stage (a): frame features of the episodic block's F arriving frames, values [H_e, B, F·T_f, D] (a view)."""
    op = backend_op(backend, "frame_features", "h2svc")
    spec, block = inputs.spec, inputs.blocks[EPISODIC]
    P, T, W = spec.prefix_len, spec.tokens_per_frame, block.window
    arriving = block.values[:, :, P + W * T:P + (W + spec.chunk_frames) * T]
    return Case(run=lambda: op(arriving, T), bytes_moved=h2svc_floor_bytes(inputs)["features"], has_floor=True)


def setup_h2svc_stce(inputs: H2SVCInputs, backend: str) -> Case:
    """Stage (b): STCE over the chunk for every (layer, episodic head, stream) of a full N_e-frame memory."""
    op = backend_op(backend, "stce_select", "h2svc")
    block = inputs.blocks[EPISODIC]
    rows = block.slot_frames.shape[0] * block.slot_frames.shape[1]
    F, D = inputs.arriving.shape[2], inputs.arriving.shape[3]
    moved = rows * (block.window + F) * D * 4 + rows * block.window * 8 * 2
    return Case(run=lambda: op(block.features, block.slot_frames, inputs.arriving, inputs.first_frame,
                               block.window), bytes_moved=moved)


def setup_h2svc_step(inputs: H2SVCInputs, backend: str) -> Case:
    """The H2SVC step of a whole model for one chunk: `h2svc_step` on the instant, short and episodic blocks in
    place (features, STCE, slot plan, moves, re-index when eager); reset before each run."""
    op = backend_op(backend, "h2svc_step", "h2svc")
    spec = inputs.spec
    section = spec.shape.geometry.rotary

    def run():
        for cls, block in inputs.blocks.items():
            op(block.keys, block.values, block.positions, block.slot_frames, spec.h2svc_cfg, cls, inputs.inv_freq,
               section, clock=inputs.clock.at(block.window), features=block.features)

    return Case(run=run, bytes_moved=h2svc_floor_bytes(inputs)["step"], reset=inputs.reset, has_floor=True)


def setup_released_step(inputs: Inputs, backend: str) -> Case:
    """One chunk's compression after the guidance pass: the released classes' selection and shrink, per layer in
    Python ("released"), or the same instance after `accelerate` (bench/released.py); same work as `step`."""
    from .released import released_step_case
    return released_step_case(inputs, backend, floor_bytes(inputs.spec)["step"])


def setup_released_guidance(inputs: Inputs, backend: str) -> Case:
    """One chunk's guidance pass: the released manual path (three prompts, attention materialised per layer) or
    the accelerated instance's pooled pass (bench/released.py)."""
    from .released import released_guidance_case
    return released_guidance_case(inputs, backend)


def cache_bytes(shape: ModelShape, dtype: torch.dtype, prefix_len: int = PREFIX_LEN,
                tokens_per_frame: int = TOKENS_PER_FRAME, chunk_frames: int = 16, budget: int = 6000,
                dense_frames: int = 64) -> dict[str, tuple[int, int]]:
    """K and V bytes of one stream's cache at `shape` for three policies, as (retained memory, with room for one
    chunk of `chunk_frames` frames): H2SVC with the default ratios and head map (docs/h2svc.md §5: the token-heads
    Σ_c H_c·(P + W_c·T_f)), a dense cache of `dense_frames` frames in every head, and HERMES at `budget` tokens
    per layer."""
    cfg = shape.h2svc_config(prefix_len, tokens_per_frame)
    per_token = 2 * shape.geometry.head_dim * dtype.itemsize
    heads = shape.geometry.num_layers * shape.geometry.num_kv_heads
    chunk = chunk_frames * tokens_per_frame

    def both(token_heads: int, rows: int) -> tuple[int, int]:
        return token_heads * per_token, (token_heads + rows * chunk) * per_token

    h2svc = sum(cfg.num_rows(c) * (prefix_len + cfg.window(c) * tokens_per_frame) for c in (INSTANT, SHORT, EPISODIC))
    return {"h2svc": both(h2svc, heads),
            f"dense {dense_frames}-frame": both(heads * (prefix_len + dense_frames * tokens_per_frame), heads),
            f"hermes b={budget}": both(heads * (prefix_len + budget), heads)}


STAGES: dict[str, Callable[[Inputs | H2SVCInputs, str], Case]] = {
    f"pooled_attention_q{GUIDANCE_MIXED}": functools.partial(setup_pooled_attention, q_len=GUIDANCE_MIXED),
    f"pooled_attention_q{GUIDANCE_GLOBAL}": functools.partial(setup_pooled_attention, q_len=GUIDANCE_GLOBAL),
    "scores": setup_scores,
    "select": setup_select,
    "compact": setup_compact,
    "step": setup_step,
    "h2svc_features": setup_h2svc_features,
    "h2svc_stce": setup_h2svc_stce,
    "h2svc_step": setup_h2svc_step,
    "released_step": setup_released_step,
    "released_guidance": setup_released_guidance,
}


def stage_policy(stage: str) -> str:
    """The policy whose inputs a stage runs on: "h2svc" for the H2SVC stages, else "hermes"."""
    return "h2svc" if stage in H2SVC_STAGES else "hermes"


def stage_backends(stage: str, backends: tuple[str, ...]) -> tuple[str, ...]:
    """The backends a stage is measured with: the chosen ones (torch-ops only where it differs from torch), plus
    the eager baseline for pooled attention; for the released stages the released-style baseline and the chosen
    backends `accelerate` takes."""
    if stage in RELEASED_STAGES:
        return (RELEASED,) + tuple(b for b in backends if b in ADAPTER_BACKENDS)
    chosen = tuple(b for b in backends if b != "torch-ops" or stage in TORCH_OPS_STAGES)
    return chosen + ("eager",) if stage.startswith("pooled_attention") else chosen

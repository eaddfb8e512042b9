"""`accelerate(model)` and the `Accelerated` handle it returns: the released HERMES classes' compression step, run by
this library's ops. `accelerate` replaces three methods on one instance (never on its class), and `restore()` puts
them back: the guidance pass `pseudo_forward` (guidance.py), the selection `prune_kv_cache_by_attention` and the
shrink `_shrink_positions_and_rerotate_keys` (step.py). Everything the instance must have is checked before anything
is replaced (checks.py); the constants the released code hard-codes are stated in `ReleasedSchedule` (schedule.py).
The released code, what changes and what it buys: docs/integrations.md#released-code.
"""
from __future__ import annotations

from typing import Any, Sequence

import dataclasses

import torch

from ..engine.checks import check_group
from ..engine.dispatch import check_backend
from ..policies.hermes.config import HermesConfig
from .caches import IncompatibleInstance
from .checks import LMParts, instance_problems
from .guidance import GuidancePass
from .schedule import GUIDANCE_MODES, KINDS, LLAVA_OV, METHODS, PARTS, QWEN2_5_VL, SCHEDULES, ReleasedSchedule
from .step import CompressionStep

MARKER = "_hermes_kernels_accelerated"


def _ratio_boundary(boundary: int, num_layers: int, deep: bool) -> float:
    """A HermesConfig ratio that reproduces the integer layer boundary: int(r·L) == boundary (shallow) or
    int((1 - r)·L) == boundary (deep)."""
    for fraction in (boundary / num_layers, (boundary + 0.5) / num_layers):
        fraction = min(max(fraction, 0.0), 1.0)
        ratio = 1.0 - fraction if deep else fraction
        if int((1.0 - ratio if deep else ratio) * num_layers) == boundary:
            return ratio
    raise IncompatibleInstance(f"layer boundary {boundary} of {num_layers} layers has no ratio")  # pragma: no cover


class Accelerated(GuidancePass, CompressionStep):
    """The handle `accelerate` returns: the replaced methods live on the instance until `restore()` (also on
    leaving a `with` block). `stats` counts guidance passes run and skipped, selections and shrinks."""

    def __init__(self, model: Any, kind: str, backend: str, guidance: str, parts: tuple[str, ...],
                 schedule: ReleasedSchedule, lm: LMParts, contiguous: bool, group=None):
        self.model, self.kind, self.backend, self.guidance = model, kind, backend, guidance
        self.parts, self.schedule, self.contiguous, self.group = parts, schedule, contiguous, group
        self._lm = lm
        self._configs: dict = {}
        self._inv_freq: dict = {}
        self._saved: dict = {}
        self.stats = {"guidance_passes": 0, "guidance_skipped": 0, "selections": 0, "shrinks": 0}
        self.active = False

    # -- installing and restoring -------------------------------------------------------------------------------

    def _install(self) -> None:
        impl = {"guidance": self.pseudo_forward, "selection": self.prune_kv_cache_by_attention,
                "shrink": self._shrink_positions_and_rerotate_keys}
        store = vars(self.model)
        for part in self.parts:
            name = METHODS[part]
            self._saved[name] = store.get(name, _MISSING)
            setattr(self.model, name, impl[part])
        setattr(self.model, MARKER, self)
        self.active = True

    def restore(self) -> None:
        """Put the instance's original methods back (idempotent)."""
        if not self.active:
            return
        for name, previous in self._saved.items():
            if previous is _MISSING:
                if name in vars(self.model):
                    delattr(self.model, name)
            else:
                setattr(self.model, name, previous)
        if MARKER in vars(self.model):
            delattr(self.model, MARKER)
        self._saved.clear()
        self.active = False

    def __enter__(self) -> "Accelerated":
        return self

    def __exit__(self, *exc) -> None:
        self.restore()

    def __repr__(self) -> str:
        return (f"Accelerated({type(self.model).__name__}, kind={self.kind!r}, backend={self.backend!r}, "
                f"guidance={self.guidance!r}, parts={self.parts}, active={self.active})")

    # -- configuration ------------------------------------------------------------------------------------------

    def config(self, budget: int, prefix_len: int | None = None) -> HermesConfig:
        """The HermesConfig this instance's selection runs with at `budget` (deep layers keep budget - 1 plus the
        summary). Re-indexing is decided by the adapter with the released rule, so the config's own re-index
        fields play no part (eager, margin 0)."""
        m, s = self.model, self.schedule
        P = m.visual_start_idx if prefix_len is None else prefix_len
        key = (budget, P, m.num_layers, m.short_term_threshold, m.long_term_threshold)
        if key not in self._configs:
            L = m.num_layers
            self._configs[key] = HermesConfig(
                num_layers=L, budget=budget, prefix_len=P, max_positions=max(self._lm.max_positions, P + budget + 1),
                shallow_ratio=_ratio_boundary(m.short_term_threshold, L, deep=False),
                deep_ratio=_ratio_boundary(m.long_term_threshold, L, deep=True),
                omega0=s.omega0, gamma=s.gamma, k0=s.k0, k_end=s.k_end, lambda_shallow=s.lambda_shallow,
                lambda_mid=s.lambda_mid, lambda_deep=s.lambda_deep, cascade=True, summary=True, reindex="eager",
                margin=0, eps=s.eps)
            cfg = self._configs[key]
            if (cfg.shallow_end, cfg.deep_start) != (m.short_term_threshold, m.long_term_threshold):
                raise IncompatibleInstance(f"short_term_threshold={m.short_term_threshold}, long_term_threshold="
                                           f"{m.long_term_threshold}: no HermesConfig reproduces these boundaries")
        return self._configs[key]

    def _freq(self, device: torch.device) -> torch.Tensor:
        if device not in self._inv_freq:
            self._inv_freq[device] = self._lm.inv_freq.to(device)
        return self._inv_freq[device]


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


_MISSING = _Missing()


def accelerate(model: Any, *, backend: str = "auto", guidance: str = "released", kind: str = "auto",
               parts: Sequence[str] = PARTS, schedule: ReleasedSchedule | None = None,
               contiguous: bool = False, group=None) -> Accelerated:
    """Speed up one instance of the released HERMES classes (or of a fork keeping their attributes) in place.

    model: the instance (`LlavaOneVision_Hermes`, `QwenVL_Hermes` or alike) — only its attributes are read.
    backend: "auto" | "torch" | "triton", handed to every op.
    guidance: "released" (default: the released code's path for the instance's attention implementation —
        sdpa / flash_attention_2: queries and keys from the prompt's input embeddings in every layer, no causal
        mask among the prompt's tokens; eager: hidden states propagated, causal), "embeddings" or "propagated"
        (the paper's reading) to force one.
    kind: "auto" (Qwen2.5-VL when the instance has `_mrope_section`, else LLaVA-OV), "llava_ov" or "qwen2_5_vl":
        which schedule, position layout and re-index rule.
    parts: which of "guidance", "selection", "shrink" to replace (default all three).
    schedule: the selection constants (default `SCHEDULES[kind]`).
    contiguous: hand back contiguous per-layer tensors (one copy of the kept cache) instead of views of the first
        `length` slots of the compacted ones.
    group: None (one process), or the `torch.distributed` process group of an instance run under tensor
        parallelism: each rank's cache and projections hold its equal share of the heads (the config's counts over
        the group's size); each rank's pooled attention is averaged over the group by one all-reduce before the
        selection, so every rank keeps the same tokens (docs/multi-gpu.md#what-crosses).

    Every attribute is checked before anything is replaced: an incompatible instance raises IncompatibleInstance
    naming what is missing. Returns the `Accelerated` handle; `handle.restore()` puts the original methods back.
    """
    check_backend(backend)
    check_group(group)
    if guidance not in GUIDANCE_MODES:
        raise ValueError(f"guidance: expected one of {GUIDANCE_MODES}, got {guidance!r}")
    if kind == "auto":
        kind = QWEN2_5_VL if hasattr(model, "_mrope_section") else LLAVA_OV
    if kind not in KINDS:
        raise ValueError(f"kind: expected 'auto' or one of {KINDS}, got {kind!r}")
    parts = tuple(parts)
    if not parts or any(p not in PARTS for p in parts) or len(set(parts)) != len(parts):
        raise ValueError(f"parts: expected distinct names from {PARTS}, got {parts!r}")
    schedule = SCHEDULES[kind] if schedule is None else schedule
    if not isinstance(schedule, ReleasedSchedule):
        raise TypeError(f"schedule: expected a ReleasedSchedule, got {type(schedule).__name__}")
    if MARKER in vars(model):
        raise IncompatibleInstance(f"accelerate: this {type(model).__name__} instance is already accelerated; call "
                                   f"restore() on its handle first")
    problems, lm = instance_problems(model, kind, parts, schedule)
    if problems:
        raise IncompatibleInstance(f"accelerate: the {type(model).__name__} instance lacks what the released HERMES "
                                   f"classes have: " + "; ".join(problems))
    if group is not None:  # this rank's share of the heads: the config's counts are the whole model's
        if lm.heads % group.size() or lm.kv_heads % group.size():
            raise IncompatibleInstance(f"accelerate: {lm.heads} query and {lm.kv_heads} KV heads do not split evenly "
                                       f"over the group's {group.size()} ranks")
        lm = dataclasses.replace(lm, heads=lm.heads // group.size(), kv_heads=lm.kv_heads // group.size())
    handle = Accelerated(model, kind, backend, guidance, parts, schedule, lm, contiguous, group)
    handle.config(model.kv_size)  # a bad budget or prefix for HermesConfig fails here, before any replacement
    handle._install()
    return handle

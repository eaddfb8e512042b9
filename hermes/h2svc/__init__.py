"""H2SVC, the second policy (H2SVC.md): head-aware heterogeneous streaming cache.

Every (layer, KV head) is routed offline to one of three frame memories: INSTANT (FIFO, W_s frames), SHORT
(FIFO, W_w frames) or EPISODIC (semantic trajectory curvature eviction, N_e frames). This package holds the
policy's own parts: `config` (H2SVCConfig, presets, the default head map), `reference` (the per-head oracle)
and `validation` (input checks of its ops). The engine parts both policies use (rope, generic validation,
the kernel dispatch) stay in `hermes` and `hermes_kernels`.
"""
from .config import CLASS_NAMES, EPISODIC, INSTANT, SHORT, H2SVCConfig, class_counts, class_id, default_head_map

__all__ = ["H2SVCConfig", "INSTANT", "SHORT", "EPISODIC", "CLASS_NAMES", "default_head_map", "class_counts",
           "class_id"]

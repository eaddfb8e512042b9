"""H2SVC, the second policy (H2SVC.md): head-aware heterogeneous streaming cache.

Every (layer, KV head) is routed offline to one of three frame memories: INSTANT (FIFO, W_s frames), SHORT
(FIFO, W_w frames) or EPISODIC (semantic trajectory curvature eviction, N_e frames). This package holds the
policy's own parts: `config` (H2SVCConfig, presets, the default head map), `reference` (the per-head oracle),
`validation` (input checks of its ops), `profile` (the offline head profiler and `python -m hermes.h2svc.profile`;
imported on its own, it needs transformers), `head_map` (the map file: save, load, check against a model) and,
on a model, `cache` (`H2SVCCache`: one K/V block per class and device, the step), `attention` (one dense call per
class, frame-window masks) and `policy` (`H2SVCPolicy`, HermesStream's policy="h2svc"); import those from their
modules (they pull in transformers and the kernels). The engine parts both policies use (rope, generic validation,
the kernel dispatch, the cache plumbing, the attention entry, the stream front) stay in `hermes` and
`hermes_kernels`.
"""
from .config import CLASS_NAMES, EPISODIC, INSTANT, SHORT, H2SVCConfig, class_counts, class_id, default_head_map
from .head_map import HeadProfile, load_head_map, save_head_map

__all__ = ["H2SVCConfig", "INSTANT", "SHORT", "EPISODIC", "CLASS_NAMES", "default_head_map", "class_counts",
           "class_id", "HeadProfile", "save_head_map", "load_head_map"]

"""What the released HERMES classes fix (docs/integrations.md#what-the-released-code-fixes): the two model kinds, the
guidance paths, the three methods `accelerate` replaces, and the selection constants per kind (`ReleasedSchedule`).

Every value the released code hard-codes is either read from the instance (thresholds, `kv_size`,
`visual_start_idx`, `streaming`, `max_position_embeddings`, `_mrope_section`; checks.py) or stated here (the ω/k
schedule per model kind, the smoothing weights, the 1024 margin).
"""
from __future__ import annotations

import dataclasses

LLAVA_OV, QWEN2_5_VL = "llava_ov", "qwen2_5_vl"
KINDS = (LLAVA_OV, QWEN2_5_VL)
# "released": what the released code does for the instance's attention implementation (sdpa / flash_attention_2:
# "embeddings"; anything else, e.g. eager: "propagated"); the other two force one path
GUIDANCE_MODES = ("released", "embeddings", "propagated")
PARTS = ("guidance", "selection", "shrink")
METHODS = {"guidance": "pseudo_forward", "selection": "prune_kv_cache_by_attention",
           "shrink": "_shrink_positions_and_rerotate_keys"}


@dataclasses.dataclass(frozen=True)
class ReleasedSchedule:
    """The selection constants one released model class hard-codes (docs/integrations.md#what-the-released-code-fixes).

    Mid layer at progress p = (l - s) / (e - s): recency weight ω = omega0 - gamma·p and forgetting rate
    k = k0 - (k0 - k_end)·p; shallow layers ω = 1, k = k0; deep layers ω = 0, k = 0. Smoothing weight by the
    current layer's type; `eps` in the min-max denominator; lazy re-indexing once a position exceeds
    max_position_embeddings - `margin`; `default_max_positions` when the language model's config has no
    max_position_embeddings.
    """

    kind: str
    omega0: float
    gamma: float
    k0: float
    k_end: float
    default_max_positions: int
    lambda_shallow: float = 0.1
    lambda_mid: float = 0.3
    lambda_deep: float = 0.4
    eps: float = 1e-6
    margin: int = 1024


SCHEDULES = {
    LLAVA_OV: ReleasedSchedule(LLAVA_OV, omega0=1.0, gamma=0.9, k0=20.0, k_end=0.5, default_max_positions=32768),
    QWEN2_5_VL: ReleasedSchedule(QWEN2_5_VL, omega0=0.75, gamma=0.6, k0=20.0, k_end=8.0,
                                 default_max_positions=128000),
}

"""Compile specs of the HERMES kernels for the GPU compile guard (registry: `hermes_kernels.engine.gpu_specs`; the
guard: `python -m bench.kernels`, docs/benchmarks.md#kernels): each driver calls one launcher of this folder on the
meta tensors of a `HermesCase`, as a compression step calls it. Kept apart from the kernels, so importing an op
never imports the guard's cases.
"""
from __future__ import annotations

from ...engine.gpu_specs import gpu_spec
from .compaction_triton import _move_kernel, _plan_kernel, _rank_kernel, compact_triton
from .gpu_case import HermesCase
from .pooling import _pooled_kernel, _row_lse_kernel, pooled_attention_triton
from .scoring import _hermes_scores_kernel, hermes_scores_triton
from .select import _select_keep_kernel, select_keep_triton


@gpu_spec(_row_lse_kernel, _pooled_kernel, case=HermesCase, max_spill_bytes=0)
def pooling(case: HermesCase) -> None:
    """Each guidance prompt's pooling over one layer of the cache, as `hermes.attention` calls it."""
    for q_len in case.guidance_tokens:
        pooled_attention_triton(*case.guidance(q_len), None)


@gpu_spec(_hermes_scores_kernel, case=HermesCase, max_spill_bytes=0)
def scoring(case: HermesCase) -> None:
    """The step's scoring launch on the cache's pooled-attention view."""
    hermes_scores_triton(case.guidance_attn(), case.cfg)


@gpu_spec(_select_keep_kernel, case=HermesCase, max_spill_bytes=0)
def select(case: HermesCase) -> None:
    """The step's selection launch (keep only), and the variant that also writes the destination map."""
    select_keep_triton(case.scores(), case.cfg)
    select_keep_triton(case.scores(), case.cfg, with_destination=True)


@gpu_spec(_rank_kernel, _plan_kernel, _move_kernel, case=HermesCase, max_spill_bytes=0)
def compaction(case: HermesCase) -> None:
    """The step's compaction of the cache views, with the case's re-index trigger."""
    keys, values, positions = case.cache()
    compact_triton(keys, values, positions, case.keep(), case.cfg, case.inv_freq(), case.rotary, None,
                   case.reindexed())

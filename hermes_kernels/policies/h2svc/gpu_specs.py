"""Compile spec of the H2SVC kernels for the GPU compile guard (registry: `hermes_kernels.engine.gpu_specs`; the guard:
`python -m bench.kernels`, docs/benchmarks.md#kernels): one driver runs the Triton step on every class block of
an `H2SVCCase`, so it covers the feature, STCE and move kernels the step launches. Kept apart from the kernels, so
importing an op never imports the guard's cases.
"""
from __future__ import annotations

from ...engine.gpu_specs import gpu_spec
from .features import _frame_features_kernel
from .gpu_case import H2SVCCase
from .stce import _stce_kernel
from .step import _frame_move_kernel, h2svc_step_triton


@gpu_spec(_frame_move_kernel, _frame_features_kernel, _stce_kernel, max_spill_bytes=0, case=H2SVCCase)
def step(case: H2SVCCase) -> None:
    """The whole step of every class block, as a stream makes it: the plan's torch ops run on the meta tensors
    too (they read nothing on the host), so the guard compiles the launches `h2svc_step_triton` itself makes: the
    move of each block and, for the episodic block, the feature and STCE launches before it."""
    for cls in case.classes:
        block = case.block(cls)
        h2svc_step_triton(block.keys, block.values, block.positions, block.slot_frames, case.cfg, cls,
                          case.inv_freq(), case.rotary, case.clock(cls), block.features)

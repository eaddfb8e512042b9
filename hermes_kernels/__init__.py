"""hermes-kernels: training-free KV-cache policies for streaming video LLMs, as fused in-place ops on torch tensors.

Two policies share the engine: HERMES (docs/hermes.md: score, smooth, select and compact a stacked cache) and
H2SVC (docs/h2svc.md: per-class frame memories stepped after every chunk). Every op checks its inputs before anything
is written, then runs the backend `backend="auto"|"triton"|"torch"` resolves to (`hermes_kernels.engine.dispatch`):
fused Triton kernels, or vectorised PyTorch (with small C loops on CPU), both tested against the plain references
`hermes_kernels.policies.hermes.reference` and `hermes_kernels.policies.h2svc.reference`. The library imports torch
and triton only; this module re-exports the public names (docs/api.md lists every path).
"""
from .policies.h2svc.clock import StreamClock
from .policies.h2svc.config import EPISODIC, INSTANT, SHORT, H2SVCConfig
from .policies.h2svc.ops import frame_features, h2svc_step, stce_select
from .policies.hermes.config import HermesConfig
from .policies.hermes.ops import compact, compress_stacks, compress_step, hermes_scores, pooled_attention, select_keep
from .results import CompressResult, H2SVCChunkResult, H2SVCStepResult
from .rope import RotaryLayout
from .version import __version__

__all__ = ["pooled_attention", "hermes_scores", "select_keep", "compact", "compress_step", "compress_stacks",
           "frame_features", "stce_select", "h2svc_step", "HermesConfig", "H2SVCConfig", "StreamClock",
           "RotaryLayout", "INSTANT", "SHORT", "EPISODIC", "CompressResult", "H2SVCStepResult", "H2SVCChunkResult",
           "__version__"]

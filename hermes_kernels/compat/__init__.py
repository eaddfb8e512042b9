"""Integrations: this library behind code that was not written for it (docs/integrations.md).

`accelerate(model)` speeds up an instance of the released HERMES classes (github.com/haowei-freesky/HERMES,
`LlavaOneVision_Hermes`, `QwenVL_Hermes`) or of a fork keeping their attributes, in place, and returns a handle
whose `restore()` puts the original methods back. Its test oracle and the benchmark's released-style baseline, a
stand-in of those classes' compression step, live in the checkout (scaffolding/standin/) and are not installed.
Like the rest of the library, nothing here imports transformers or `hermes`.
"""
from .caches import IncompatibleInstance, read_layers, write_layers
from .handle import Accelerated, accelerate
from .schedule import GUIDANCE_MODES, KINDS, PARTS, SCHEDULES, ReleasedSchedule
from .step import KeepIndices

__all__ = ["accelerate", "Accelerated", "ReleasedSchedule", "SCHEDULES", "KeepIndices", "IncompatibleInstance",
           "KINDS", "GUIDANCE_MODES", "PARTS", "read_layers", "write_layers"]

"""Where a stream stands when an H2SVC step runs: the host values one class block's step reads (docs/h2svc.md §7).

The caller (e.g. `H2SVCCache.step`) keeps these on the host, so a step on CUDA tensors reads no device value.
"""
from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class StreamClock:
    """The stream clock of one `h2svc_step` call on one class block.

    held:          frames in the block's home slots before the chunk (int >= 0; at most the class window W).
    num_frames:    F, the chunk's frames (int >= 1), written at frame slots held .. held + F - 1.
    first_frame:   stream index of the chunk's first frame (int >= 0), newer than every held frame.
    reindexed:     this step's re-index decision (docs/h2svc.md §4), a 0-dim bool tensor on the CPU (a host value:
                   reading it, `bool(clock.reindexed)`, never synchronises a device).
    next_position: R (int >= 0): after a re-index every row's newest retained token sits at R - 1 (right alignment).

    Each field is checked here (TypeError / ValueError naming `clock.<field>`); how the clock fits a block (held
    <= W, room for the chunk, R past the retained tokens) is checked by the step with the block.
    """

    held: int
    num_frames: int
    first_frame: int
    reindexed: torch.Tensor
    next_position: int

    def __post_init__(self) -> None:
        for name, minimum in (("held", 0), ("num_frames", 1), ("first_frame", 0), ("next_position", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"clock.{name}: expected an int, got {type(value).__name__}")
            if value < minimum:
                raise ValueError(f"clock.{name}: expected an int >= {minimum}, got {value}")
        decision = self.reindexed
        if not isinstance(decision, torch.Tensor) or decision.dim() != 0 or decision.dtype != torch.bool or \
                decision.device.type != "cpu":
            got = (f"{decision.dtype} {tuple(decision.shape)} on {decision.device}"
                   if isinstance(decision, torch.Tensor) else type(decision).__name__)
            raise TypeError(f"clock.reindexed: expected a 0-dim bool tensor on the CPU (the step's re-index decision, "
                            f"a host value), got {got}")

    def at(self, held: int) -> "StreamClock":
        """The same clock for a block holding `held` frames (the other fields are shared by every block of a
        cache)."""
        return dataclasses.replace(self, held=held)

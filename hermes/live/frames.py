"""What a live source hands the live session: sampled frames with their video time and arrival (wall) time, and
the end of the source with its reason (docs/live.md#time)."""
from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np


@dataclasses.dataclass(frozen=True)
class LiveFrame:
    """One sampled frame.

    index:    sample number from 0, in the order the source delivers (a frame the session drops keeps its number).
    time:     seconds of video time from the source's own timestamps, 0 at the first frame; never runs backwards,
              also across a reconnect (offset so that it continues).
    pixels:   uint8 [H, W, 3] RGB at the size the model's processor keeps.
    arrived:  `time.monotonic()` when the frame was sampled, for a source that sets the pace (a camera, a network
              stream, a pipe, a file played in real time); None for a file read as fast as it decodes, which the
              session never falls behind (no lag, nothing dropped).
    """

    index: int
    time: float
    pixels: np.ndarray
    arrived: float | None


class SourceEnded(Exception):
    """Raised by `LiveSource.get` once the source has ended and every frame it sampled was taken. `reason` says
    why, in words a summary line can print ("end of stream", "disconnected", "stalled for 10 s", ...)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class LiveSource(Protocol):
    """A source of sampled frames (`hermes.live.open_source`). A reader thread decodes and samples while the
    session works, so frames that arrive during a chunk's prefill or an answer wait here (or are dropped by the
    session's rule, never by the source).

    fps:         the sampling rate (frames per second of video time).
    frame_size:  (height, width) of every frame's pixels.
    """

    fps: float
    frame_size: tuple[int, int]

    def get(self, timeout: float | None = None) -> LiveFrame | None:
        """The oldest frame not taken yet; waits up to `timeout` seconds (None: until one comes), then returns None.
        Raises `SourceEnded` once the source ended and nothing is left."""

    def stats(self) -> dict:
        """Counters so far: "decoded" frames, "sampled" frames, "corrupt_packets" skipped, "reconnects" made."""

    def close(self) -> None:
        """Stop the reader and release the source (idempotent)."""

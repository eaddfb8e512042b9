"""Video files into chunks for the lmms-eval adapter, through the project's one decoding path (`hermes.video`).

A `VideoFeed` hands out a video's sampled frames chunk by chunk up to a time and remembers where it stopped, so
a multi-round request streams up to each question's time and goes on from there; `merge_inputs` joins the
prepared chunks of streams advanced in lockstep. Errors of a file that cannot be read or decoded become
`UnreadableVideo` (the adapter skips that sample). docs/evaluation.md#what-it-does.
"""
from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

from hermes.video import VideoReader, sample_by_time


class UnreadableVideo(Exception):
    """A video file that is missing, cannot be opened or fails to decode; the message is one line from
    `hermes.video` ("video: ...")."""


class VideoFeed:
    """The frames of one stream's video sampled at `fps` by timestamp, in chunks of at most `chunk_frames`.

    `open(path)` switches to a file; frames sampled at or before the last time already handed out are skipped, so
    a longer clip of the same video (OVO-Bench's per-question prefix clips) continues where the last one ended.
    `chunks(end)` yields (frames uint8 [F, H, W, 3] RGB, times in seconds) up to `end` seconds (None: the file's
    end); the last chunk before `end` may be shorter. A context manager; `close()` closes the file.
    """

    def __init__(self, fps: float, chunk_frames: int):
        self.fps, self.chunk_frames = fps, chunk_frames
        self.path: str | None = None
        self.streamed_to: float | None = None  # time of the last frame handed out
        self._reader: VideoReader | None = None
        self._samples: Iterator | None = None
        self._pending: tuple[float, np.ndarray] | None = None  # a sample read past the last `end`

    def __enter__(self) -> "VideoFeed":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
        self._reader = self._samples = self._pending = None

    def open(self, path: str) -> None:
        """Continue the stream from the file `path` (the same file again: nothing changes)."""
        if path == self.path:
            return
        self.close()
        try:
            self._reader = VideoReader(path)
        except (OSError, ValueError) as err:
            raise UnreadableVideo(str(err)) from err
        self.path = path
        self._samples = self._reader.chunks(self.fps, 1)

    def _next_sample(self) -> tuple[float, np.ndarray] | None:
        if self._pending is not None:
            sample, self._pending = self._pending, None
            return sample
        while True:
            try:
                chunk = next(self._samples, None)
            except ValueError as err:
                raise UnreadableVideo(str(err)) from err
            if chunk is None:
                return None
            if self.streamed_to is None or chunk.times[0] > self.streamed_to:
                return chunk.times[0], chunk.frames[0]

    def chunks(self, end: float | None = None) -> Iterator[tuple[np.ndarray, list[float]]]:
        """Chunks of the open file's frames sampled up to `end` seconds (None: all that are left)."""
        frames, times = [], []
        while (sample := self._next_sample()) is not None:
            if end is not None and sample[0] > end:
                self._pending = sample
                break
            times.append(sample[0])
            frames.append(sample[1])
            self.streamed_to = sample[0]
            if len(frames) == self.chunk_frames:
                yield np.stack(frames), times
                frames, times = [], []
        if frames:
            yield np.stack(frames), times


def sampled_shape(path: str, fps: float) -> tuple[int, int, int]:
    """(sampled frames, height, width) of a video file, from one decoding pass without converting pixels: videos
    of equal shape give equal chunks and may share a lockstep batch. UnreadableVideo when it cannot be decoded
    or has no frame."""
    try:
        with VideoReader(path) as reader:
            count, size = 0, None
            for _, _, frame in sample_by_time(reader.decoded(), fps):
                count, size = count + 1, size or (frame.height, frame.width)
    except (OSError, ValueError) as err:
        raise UnreadableVideo(str(err)) from err
    if size is None:
        raise UnreadableVideo(f"video: {path} has no frame to sample")
    return count, *size


def merge_inputs(inputs: list[dict]) -> dict:
    """One `append_video` call's keyword arguments for streams in lockstep, from each stream's `prepare_frames`
    output: "video" pixel values concatenated along dim 0 (LLaVA-OV [1, F, C, S, S] -> [B, F, C, S, S]; Qwen
    rows [t*h*w, D] -> [B*t*h*w, D]); every other argument (grid, seconds per grid step, timestamps) must be the
    same for all streams and is passed once. ValueError when they differ."""
    if len(inputs) == 1:
        return inputs[0]
    merged = dict(inputs[0])
    merged["video"] = torch.cat([torch.as_tensor(x["video"]) for x in inputs])
    for name, value in inputs[0].items():
        if name != "video" and not all(_same(x[name], value) for x in inputs[1:]):
            raise ValueError(f"{name}: the streams of a lockstep batch need equal chunks, got {value!r} and others")
    return merged


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return torch.equal(torch.as_tensor(a), torch.as_tensor(b))
    return a == b

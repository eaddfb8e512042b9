"""Short synthetic video files for the decoding and CLI tests (imported by test_video.py and test_cli.py).

Frame i of a file has a background colour that encodes i (red = 16 * (i % 16) + 8, green = 32 * (i // 16) + 16)
and a white square that moves with i, so the frame a sampler picked can be read back from the decoded pixels
despite lossy MPEG-4 coding. Timestamps are exact milliseconds, so variable frame rates are easy to write.
"""
from __future__ import annotations

import fractions

import av
import numpy as np

HEIGHT, WIDTH = 48, 64


def frame_image(index: int, height: int = HEIGHT, width: int = WIDTH) -> np.ndarray:
    """uint8 [height, width, 3] RGB: background colour encoding `index`, a white 8 x 8 square at a
    position that moves with `index`."""
    image = np.empty((height, width, 3), dtype=np.uint8)
    image[...] = (16 * (index % 16) + 8, 32 * (index // 16) + 16, 96)
    top, left = (3 * index) % (height - 8), (5 * index) % (width - 24) + 16
    image[top:top + 8, left:left + 8] = 255
    return image


def frame_index(image: np.ndarray) -> int:
    """The index `frame_image` encoded, read from the median colour of the left 12 columns (never
    covered by the square)."""
    red, green = np.median(image[:, :12, :2].reshape(-1, 2), axis=0)
    return int(round((red - 8) / 16)) + 16 * int(round((green - 16) / 32))


def write_video(path, times: list[float], height: int = HEIGHT, width: int = WIDTH) -> str:
    """An MPEG-4 .mp4 whose frame i shows `frame_image(i)` at times[i] seconds (increasing, millisecond
    precision). Returns the path."""
    tb = fractions.Fraction(1, 1000)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=1000)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for index, t in enumerate(times):
            frame = av.VideoFrame.from_ndarray(frame_image(index, height, width), format="rgb24")
            frame.pts, frame.time_base = round(t * 1000), tb
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return str(path)


def decode_all(path) -> tuple[list[float], list[np.ndarray]]:
    """Every frame of a file straight from PyAV: (timestamps in seconds, uint8 [H, W, 3] RGB frames)."""
    with av.open(str(path)) as container:
        frames = list(container.decode(video=0))
        return [float(f.time) for f in frames], [f.to_ndarray(format="rgb24") for f in frames]

"""Short synthetic video files for the decoding and CLI tests (imported by test_video.py and test_cli.py), and
files with odd timestamps, sizes or no frames for the reader's fuzz cases.

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


def decode_all(path, size: tuple[int, int] | None = None) -> tuple[list[float], list[np.ndarray]]:
    """Every frame of a file straight from PyAV: (timestamps in seconds, uint8 [H, W, 3] RGB frames), or with
    `size` = (H, W) frames scaled to it by swscale's bicubic filter (as `hermes.video` scales them)."""
    scale = {} if size is None else dict(height=size[0], width=size[1], interpolation="BICUBIC")
    with av.open(str(path)) as container:
        frames = list(container.decode(video=0))
        return [float(f.time) for f in frames], [f.to_ndarray(format="rgb24", **scale) for f in frames]


def write_packets(path, pts: list[int], dts: list[int] | None = None, sizes: list[tuple[int, int]] | None = None,
                  unit: fractions.Fraction = fractions.Fraction(1, 1000)) -> str:
    """A file of intra-coded MJPEG frames (container from the suffix) whose frame i shows `frame_image(i)` at
    `sizes[i]` = (H, W) (default HEIGHT x WIDTH) and carries the timestamps pts[i] and dts[i] (default pts[i]),
    in `unit` seconds (default milliseconds), as given: equal or non-monotonic presentation times can be written
    this way (a muxer still refuses decreasing dts)."""
    tb = unit
    sizes = sizes or [(HEIGHT, WIDTH)] * len(pts)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mjpeg", rate=1000)
        stream.height, stream.width = sizes[0]
        stream.pix_fmt, stream.time_base = "yuvj420p", tb
        for index, (height, width) in enumerate(sizes):
            encoder = av.CodecContext.create("mjpeg", "w")  # one per frame: frames of any size
            encoder.height, encoder.width, encoder.pix_fmt, encoder.time_base = height, width, "yuvj420p", tb
            frame = av.VideoFrame.from_ndarray(frame_image(index, height, width), format="rgb24")
            for packet in [*encoder.encode(frame), *encoder.encode()]:
                packet.stream, packet.time_base = stream, tb
                packet.pts, packet.dts = pts[index], (dts or pts)[index]
                container.mux(packet)
    return str(path)


def write_gray(path, height: int, width: int, count: int = 2) -> str:
    """`count` uncompressed 8-bit grey frames of height x width at 4 fps (cheap to write at any size): a .mkv."""
    with av.open(str(path), "w") as container:
        stream = container.add_stream("rawvideo", rate=4)
        stream.height, stream.width, stream.pix_fmt = height, width, "gray"
        for index in range(count):
            frame = av.VideoFrame.from_ndarray(np.full((height, width), 40 * index, np.uint8), format="gray")
            frame.pts, frame.time_base = index, fractions.Fraction(1, 4)
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return str(path)


def write_without_frames(path) -> str:
    """A .mkv that declares a HEIGHT x WIDTH video track and holds no frame of it (only a little silent audio)."""
    with av.open(str(path), "w", format="matroska") as container:
        video = container.add_stream("mpeg4", rate=4)
        video.height, video.width, video.pix_fmt = HEIGHT, WIDTH, "yuv420p"
        audio = container.add_stream("pcm_s16le", rate=8000)
        for index in range(4):
            frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.int16), format="s16", layout="mono")
            frame.sample_rate, frame.pts = 8000, 1024 * index
            for packet in audio.encode(frame):
                container.mux(packet)
        for packet in audio.encode():
            container.mux(packet)
    return str(path)

"""hermes.video at its limits, in-process (the fuzz cases of test_video.py read files in a subprocess, which the
mutation audit cannot see, docs/testing.md#mutation-audit): each bound exactly at its value, the gap a file may
leave, argument names in the messages, frames without timestamps, audio beside the video, odd frame sizes."""
from fractions import Fraction

import av
import numpy as np
import pytest

from hermes import video
from hermes.video import VideoReader, as_fraction, parse_time, sample_by_time
from tests.hermes.video_files import HEIGHT, WIDTH, frame_image, frame_index, write_gray, write_packets, write_video


def _sources(path, fps=1.0, chunk_frames=8, keep=None):
    with VideoReader(path) as reader:
        return [source for chunk in reader.chunks(fps, chunk_frames, keep=keep) for source in chunk.sources]


def test_floats_become_the_nearest_fraction_with_denominator_at_most_a_million():
    assert as_fraction(29.97, "fps") == Fraction(2997, 100)
    assert as_fraction(1 / 1234567, "fps") == Fraction(1 / 1234567).limit_denominator(10 ** 6) != Fraction(1, 1234567)
    assert as_fraction(Fraction(1, 999_999), "fps") == Fraction(1, 999_999)


def test_a_frame_at_the_time_of_the_one_before_is_skipped_not_sampled():
    """Two frames at 1.0 s (broken muxing): the first is on screen there, the second never is."""
    got = [(float(t), i) for t, i, _ in sample_by_time(((t, None) for t in [0.0, 1.0, 1.0, 2.0]), 1)]
    assert got == [(0, 0), (1, 1), (2, 3)]


@pytest.mark.parametrize("call", ["sample", "chunks"])
def test_a_bad_fps_is_named(call, tmp_path):
    path = write_video(tmp_path / "one.mp4", [0.0, 0.5])
    with pytest.raises(ValueError, match=r"^fps: expected a positive finite number, got 0$"):
        if call == "sample":
            list(sample_by_time([(0.0, None)], 0))
        else:
            with VideoReader(path) as reader:
                reader.chunks(0, 4)


@pytest.mark.parametrize("chunk_frames", [True, 1.5, 0])
def test_chunk_frames_must_be_a_positive_int(chunk_frames, tmp_path):
    path = write_video(tmp_path / "one.mp4", [0.0, 0.5])
    with VideoReader(path) as reader, pytest.raises(ValueError, match=r"^chunk_frames: expected a positive int"):
        reader.chunks(1, chunk_frames)


def test_chunks_of_one_frame(tmp_path):
    path = write_video(tmp_path / "three.mp4", [0.0, 1.0, 2.0])
    with VideoReader(path) as reader:
        assert [c.sources for c in reader.chunks(1, 1)] == [[0], [1], [2]]


def test_a_chunk_of_exactly_max_chunk_bytes_is_allowed(tmp_path, monkeypatch):
    path = write_video(tmp_path / "three.mp4", [0.0, 1.0, 2.0])
    monkeypatch.setattr(video, "MAX_CHUNK_BYTES", 4 * 16 * 22 * 3)  # four frames scaled to 16 x 22
    with VideoReader(path) as reader:
        reader.chunks(1, 4, keep=(16, 16))
        with pytest.raises(ValueError, match="chunk_frames: 5 frames of 22 x 16 px"):
            reader.chunks(1, 5, keep=(16, 16))


@pytest.mark.parametrize("keep,size", [((1, 1), (1, 2)), ((60, 10), (48, 64)), ((47, 64), (48, 64))])
def test_output_size_at_its_bounds(keep, size, tmp_path):
    """keep (1, 1) is the smallest allowed (1 x 2 keeps the aspect ratio); a keep larger on one side never scales up
    (60 x 10 of 48 x 64 frames: scale 1.25); 47 x 64 covers itself only at scale 1."""
    path = write_video(tmp_path / "one.mp4", [0.0])
    with VideoReader(path) as reader:
        assert reader.output_size(keep) == size


@pytest.mark.parametrize("height,width", [(1, 64), (48, 1), (2, video.MAX_SIDE)])
def test_frames_one_pixel_thin_or_max_side_wide_are_read(height, width, tmp_path):
    path = write_gray(tmp_path / "thin.mkv", height, width)
    with VideoReader(path) as reader:
        assert reader.size == (height, width)
        assert [c.frames.shape for c in reader.chunks(4, 2)] == [(2, height, width, 3)]


def test_frames_over_max_side_are_refused_in_process(tmp_path):
    path = write_gray(tmp_path / "wide.mkv", 2, video.MAX_SIDE + 1)
    with pytest.raises(ValueError, match=rf"declares {video.MAX_SIDE + 1} x 2 px frames; the reader decodes at most"):
        VideoReader(path)


def test_a_frame_of_exactly_max_pixels_is_read(tmp_path, monkeypatch):
    path = write_gray(tmp_path / "big.mkv", 60, 80)
    monkeypatch.setattr(video, "MAX_PIXELS", 60 * 80)
    with VideoReader(path) as reader:
        assert reader.size == (60, 80)


def test_a_larger_frame_mid_stream_is_not_decoded_past_max_pixels(tmp_path, monkeypatch):
    """The decoder gets the pixel limit too: a frame over it after a small first frame (the one probed) is a
    decoding error, not a large allocation."""
    path = write_packets(tmp_path / "grow.mkv", [0, 250, 500], sizes=[(HEIGHT, WIDTH), (HEIGHT, WIDTH),
                                                                      (4 * HEIGHT, 4 * WIDTH)])
    monkeypatch.setattr(video, "MAX_PIXELS", 2 * HEIGHT * WIDTH)
    with VideoReader(path) as reader, pytest.raises(ValueError, match=r"decoding .* failed after 0\.25 s"):
        list(reader.chunks(4, 8))


def test_metadata_that_is_not_utf8_is_read(tmp_path):
    """The muxer's name made invalid UTF-8: read as the original file (PyAV would raise reading the tags strictly)."""
    original = write_packets(tmp_path / "plain.mkv", [0, 250, 500])
    data = open(original, "rb").read()
    assert b"Lavf" in data
    tagged = tmp_path / "tagged.mkv"
    tagged.write_bytes(data.replace(b"Lavf", b"\xff\xfe\xfd\xfc"))
    assert _sources(tagged, fps=4) == _sources(original, fps=4) == [0, 1, 2]


def test_audio_beside_the_video_is_not_decoded_as_frames(tmp_path):
    """A file with a sound track next to the video: only video frames are sampled."""
    path = tmp_path / "av.mkv"
    with av.open(str(path), "w", format="matroska") as container:
        picture = container.add_stream("mpeg4", rate=4)
        picture.height, picture.width, picture.pix_fmt = HEIGHT, WIDTH, "yuv420p"
        sound = container.add_stream("pcm_s16le", rate=8000)
        for index in range(4):
            frame = av.VideoFrame.from_ndarray(frame_image(index), format="rgb24")
            frame.pts, frame.time_base = index, Fraction(1, 4)
            for packet in picture.encode(frame):
                container.mux(packet)
            audio = av.AudioFrame.from_ndarray(np.zeros((1, 2000), np.int16), format="s16", layout="mono")
            audio.sample_rate, audio.pts = 8000, 2000 * index
            for packet in sound.encode(audio):
                container.mux(packet)
        for stream in (picture, sound):
            for packet in stream.encode():
                container.mux(packet)
    with VideoReader(path) as reader:
        chunks = list(reader.chunks(4, 8))
    assert [c.sources for c in chunks] == [[0, 1, 2, 3]]
    assert [frame_index(f) for f in chunks[0].frames] == [0, 1, 2, 3]


def _frames_with(monkeypatch, change):
    real = av.container.InputContainer.decode

    def decode(self, *args, **kwargs):
        for index, frame in enumerate(real(self, *args, **kwargs)):
            yield change(index, frame)

    monkeypatch.setattr(av.container.InputContainer, "decode", decode)


def test_a_frame_without_a_timestamp_is_refused(tmp_path, monkeypatch):
    path = write_video(tmp_path / "four.mp4", [0.0, 0.25, 0.5, 0.75])

    def drop_pts(index, frame):
        if index == 2:
            frame.pts = None
        return frame

    _frames_with(monkeypatch, drop_pts)
    with VideoReader(path) as reader, pytest.raises(ValueError, match=r"has a frame without a timestamp after 0\.25 s"):
        list(reader.chunks(4, 8))


def test_a_decoding_error_at_the_first_frame_says_zero_seconds(tmp_path, monkeypatch):
    path = write_video(tmp_path / "four.mp4", [0.0, 0.25, 0.5, 0.75])

    def fail(index, frame):
        raise av.error.InvalidDataError(1094995529, "Invalid data found when processing input")

    _frames_with(monkeypatch, fail)
    with VideoReader(path) as reader, pytest.raises(ValueError, match=r"failed after 0\.00 s"):
        list(reader.chunks(4, 8))


@pytest.mark.parametrize("pts_ms,fps,error", [
    ([0, 250, 1_000_000], 4, "jumps from 0.25 s to 1000.00 s, a gap of over 900 s"),   # 3600 samples at 4 fps
    ([0, 36_000], 100, None),                      # a gap of exactly 3600 samples at 100 fps: allowed
    ([0, 36_010], 100, "a gap of over 36 s"),
    ([0, 30_000, 100, 37_000], 100, None),         # the gap counts from the latest time (30 s), not a frame before
    ([2_000_000, 2_000_250, 2_000_500], 1, None),  # large times, small gaps
])
def test_the_gap_one_frame_may_fill(pts_ms, fps, error, tmp_path):
    """A frame may be repeated MAX_REPEATS (3600) times to fill a gap of 3600 / fps seconds after the latest time
    before it; a longer gap is refused as broken timestamps."""
    path = write_packets(tmp_path / "gap.mkv", pts_ms, dts=list(range(len(pts_ms))))
    if error is None:
        _sources(path, fps=fps, chunk_frames=4000, keep=(3, 4))
    else:
        with pytest.raises(ValueError, match=error):
            _sources(path, fps=fps, chunk_frames=4000, keep=(3, 4))


@pytest.mark.parametrize("text,ok", [("0:59.9", 59.9), ("0:60", None), ("1:00:60", None), ("1:59:59", 7199)])
def test_clock_times_at_sixty(text, ok):
    if ok is None:
        with pytest.raises(ValueError, match="time: expected"):
            parse_time(text)
    else:
        assert parse_time(text) == pytest.approx(ok)


def test_the_frames_sampled_from_a_file_that_starts_late(tmp_path):
    """Sampling counts from the first frame: a file whose first frame is at 2000 s samples frames 0, 4 at 1 fps."""
    path = write_packets(tmp_path / "late.mkv", [2_000_000 + 250 * i for i in range(6)])
    assert _sources(path) == [0, 4]

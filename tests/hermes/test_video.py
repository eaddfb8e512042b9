"""hermes.video: frames sampled by timestamp (constant and variable frame rate), chunking, bad files, times."""
import wave
from fractions import Fraction

import av
import pytest

from hermes.video import VideoReader, parse_time, sample_by_time
from tests.hermes.video_files import decode_all, frame_index, write_video

VFR_TIMES = [0.0, 0.1, 0.2, 1.5, 1.6, 3.0, 3.05]


def sampled(times, fps):
    return [(float(t), index) for t, index, _ in sample_by_time(((t, None) for t in times), fps)]


def on_screen(times, at):
    """Index of the last frame whose time (from the first frame) is <= at: the frame shown at `at`."""
    return max(i for i, t in enumerate(times) if t - times[0] <= at)


@pytest.mark.parametrize("exact", [True, False], ids=["fractions", "floats"])
def test_constant_rate_takes_every_kth_frame(exact):
    """A 4 fps stream sampled at 1 fps gives frames 0, 4, 8, ...; at 2 fps every second frame; at 4 fps all;
    at 8 fps each frame twice (the frame on screen)."""
    times = [Fraction(i, 4) if exact else i / 4 for i in range(22)]   # last frame at 5.25 s
    assert sampled(times, 1) == [(k, 4 * k) for k in range(6)]
    assert sampled(times, 2) == [(k / 2, 2 * k) for k in range(11)]
    assert sampled(times, 4) == [(k / 4, k) for k in range(22)]
    assert sampled(times, 8) == [(k / 8, k // 2) for k in range(43)]


def test_variable_rate_takes_the_frame_on_screen():
    """Gaps longer than 1/fps repeat the frame shown during them; sampling stops at the last frame."""
    assert sampled(VFR_TIMES, 1) == [(0, 0), (1, 2), (2, 4), (3, 5)]
    assert sampled(VFR_TIMES, 2) == [(k / 2, on_screen(VFR_TIMES, k / 2)) for k in range(7)]
    assert [i for _, i in sampled(VFR_TIMES, 2)] == [0, 2, 2, 3, 4, 4, 5]
    assert sampled(VFR_TIMES, Fraction(1, 3)) == [(0, 0), (3, 5)]


def test_sampling_counts_from_the_first_frame_and_skips_non_increasing_times():
    assert sampled([10.0, 10.5, 11.0, 12.0], 1) == [(0, 0), (1, 2), (2, 3)]
    assert sampled([0.0, 0.5, 0.5, 0.25, 1.0], 1) == [(0, 0), (1, 4)]
    assert sampled([0.0, 0.5, 0.4, 1.2], 1) == [(0, 0), (1, 1)]      # 0.4 after 0.5 is never on screen
    assert sampled([], 1) == []
    assert sampled([7.0], 1) == [(0, 0)]


@pytest.mark.parametrize("fps", [0, -1, float("nan"), float("inf"), "1", True])
def test_bad_fps_raises(fps):
    with pytest.raises(ValueError, match="fps"):
        list(sample_by_time([(0.0, None)], fps))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("videos")
    return {"cfr": write_video(folder / "cfr.mp4", [i / 4 for i in range(56)]),    # 4 fps, last frame 13.75 s
            "vfr": write_video(folder / "vfr.mp4", VFR_TIMES)}


def test_file_at_4fps_sampled_at_1fps_in_chunks(files):
    """Decoded pixels show it: chunk frames are source frames 0, 4, 8, ... (read back from their colours),
    times 0..13 s, chunks of 4 with the 2 left-over frames last."""
    with VideoReader(files["cfr"]) as reader:
        assert reader.duration == pytest.approx(14.0, abs=0.3)
        chunks = list(reader.chunks(1, 4))
    assert [len(c.times) for c in chunks] == [4, 4, 4, 2]
    assert [c.index for c in chunks] == [0, 1, 2, 3]
    assert [t for c in chunks for t in c.times] == list(range(14))
    assert [s for c in chunks for s in c.sources] == list(range(0, 56, 4))
    assert [frame_index(f) for c in chunks for f in c.frames] == list(range(0, 56, 4))
    assert all(c.frames.shape[1:] == (48, 64, 3) and c.frames.dtype.name == "uint8" for c in chunks)
    assert (chunks[1].start, chunks[1].end) == (4, 7)


def test_variable_frame_rate_file(files):
    """The file keeps its irregular timestamps; sampling at 1 and 2 fps picks the frames on screen."""
    times, _ = decode_all(files["vfr"])
    assert times == pytest.approx(VFR_TIMES)
    for fps in (1, 2):
        with VideoReader(files["vfr"]) as reader:
            (chunk,) = list(reader.chunks(fps, 100))
        expected = [on_screen(VFR_TIMES, k / fps) for k in range(int(3.05 * fps) + 1)]
        assert chunk.sources == expected
        assert [frame_index(f) for f in chunk.frames] == expected


def test_missing_corrupt_and_audio_only_files(tmp_path, files):
    with pytest.raises(FileNotFoundError, match="video: no such file"):
        VideoReader(tmp_path / "nope.mp4")
    junk = tmp_path / "junk.mp4"
    junk.write_bytes(bytes(range(256)) * 64)
    with pytest.raises(ValueError, match="video: cannot read"):
        VideoReader(junk)
    truncated = tmp_path / "truncated.mp4"
    data = open(files["cfr"], "rb").read()
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="video: cannot read"):
        VideoReader(truncated)
    sound = tmp_path / "sound.wav"
    with wave.open(str(sound), "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(8000), w.writeframes(bytes(1600))
    with pytest.raises(ValueError, match="has no video stream"):
        VideoReader(sound)


def test_decoding_error_mid_stream_names_the_time(files, monkeypatch):
    """An FFmpeg error raised while decoding (injected after 6 frames) becomes a ValueError with the time
    reached; the chunk completed before it was delivered."""
    real_decode = av.container.InputContainer.decode

    def failing_decode(self, *args, **kwargs):
        for index, frame in enumerate(real_decode(self, *args, **kwargs)):
            if index == 6:
                raise av.error.InvalidDataError(1094995529, "Invalid data found when processing input")
            yield frame

    monkeypatch.setattr(av.container.InputContainer, "decode", failing_decode)
    delivered = []
    with VideoReader(files["cfr"]) as reader, pytest.raises(ValueError, match=r"decoding .* failed after 1\.25 s"):
        for chunk in reader.chunks(4, 4):
            delivered.append(chunk.sources)
    assert delivered == [[0, 1, 2, 3]]


def test_chunk_frames_must_be_positive(files):
    with VideoReader(files["vfr"]) as reader, pytest.raises(ValueError, match="chunk_frames"):
        next(reader.chunks(1, 0))


@pytest.mark.parametrize("text,seconds", [("30", 30), ("30s", 30), ("12.5s", 12.5), ("1:30", 90), ("01:02:03", 3723),
                                          (" 0:05.5 ", 5.5), ("0", 0)])
def test_parse_time(text, seconds):
    assert parse_time(text) == seconds


@pytest.mark.parametrize("text", ["", "abc", "-1", "1:75", "1:60:00", "nan", "inf", "30ss", "1::2"])
def test_parse_time_rejects(text):
    with pytest.raises(ValueError, match="time"):
        parse_time(text)

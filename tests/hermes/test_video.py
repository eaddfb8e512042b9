"""hermes.video: frames sampled by timestamp (constant and variable frame rate), chunking, bad files, times; and
the reader as a trust boundary (docs/security.md#video): frames scaled as they are decoded, bounds on what a file
may ask, and fuzzed files, each read in a subprocess with bounded time and memory."""
import json
import os
import subprocess
import sys
import wave
from fractions import Fraction

import av
import numpy as np
import pytest

from hermes import video
from hermes.video import VideoReader, parse_time, sample_by_time
from tests.hermes.live.servers import TcpServer
from tests.hermes.video_files import (HEIGHT, WIDTH, decode_all, frame_index, write_gray, write_packets, write_video,
                                      write_without_frames)
from tests.utils import REPO

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


# ---- untrusted files (docs/security.md#video) ---------------------------------------------------------------------
@pytest.mark.parametrize("keep,size", [((16, 16), (16, 22)), ((12, 16), (12, 16)), ((24, 8), (24, 32)),
                                       ((48, 64), (48, 64)), ((100, 10), (48, 64)), (None, (48, 64))])
def test_output_size_is_the_smallest_of_the_aspect_ratio_that_covers_keep(files, keep, size):
    """48 x 64 frames: keep (16, 16) scales by 1/3 (16 x 21.33, rounded up to 22), (24, 8) by 1/2; a keep not
    smaller on both sides, or none, leaves the frames whole."""
    with VideoReader(files["cfr"]) as reader:
        assert reader.size == (HEIGHT, WIDTH)
        assert reader.output_size(keep) == size


@pytest.mark.parametrize("keep", [(0, 16), (16,), "16x16", (16.0, 16), (True, 16)])
def test_a_bad_keep_is_refused(files, keep):
    with VideoReader(files["cfr"]) as reader, pytest.raises(ValueError, match="keep: expected"):
        reader.chunks(1, 4, keep=keep)


def test_frames_are_scaled_as_they_are_decoded(files):
    """With keep, every chunk holds frames of output_size: swscale's bicubic scaling of the same frames (what
    PyAV gives), still the frames sampled (read back from their colours)."""
    with VideoReader(files["cfr"]) as reader:
        chunks = list(reader.chunks(1, 4, keep=(16, 16)))
    assert [c.frames.shape for c in chunks] == [(4, 16, 22, 3)] * 3 + [(2, 16, 22, 3)]
    _, scaled = decode_all(files["cfr"], (16, 22))
    np.testing.assert_array_equal(np.concatenate([c.frames for c in chunks]), np.stack(scaled[::4]))
    assert [frame_index(f) for c in chunks for f in c.frames] == list(range(0, 56, 4))


def test_a_chunk_may_hold_at_most_max_chunk_bytes(files):
    """The bound is on the frames as delivered (scaled), and checked when chunks() is called, before decoding."""
    with VideoReader(files["cfr"]) as reader:
        most = video.MAX_CHUNK_BYTES // (16 * 22 * 3)
        reader.chunks(1, most, keep=(16, 16))
        with pytest.raises(ValueError, match=rf"chunk_frames: {most + 1} frames of 22 x 16 px would hold 1\.0 GiB, "
                                             r"over the 1 GiB one chunk may hold; lower chunk_frames"):
            reader.chunks(1, most + 1, keep=(16, 16))
        with pytest.raises(ValueError, match=r"chunk_frames: 200000 frames of 64 x 48 px would hold 1\.7 GiB"):
            reader.chunks(1, 200_000)


def test_frames_whose_size_changes_mid_stream_come_out_at_one_size(tmp_path):
    """A stream whose frames change size (the decoder follows each frame) is delivered at the stream's size."""
    path = write_packets(tmp_path / "sizes.mkv", [0, 250, 500, 750],
                         sizes=[(HEIGHT, WIDTH), (2 * HEIGHT, 2 * WIDTH), (HEIGHT, WIDTH), (HEIGHT // 2, WIDTH // 2)])
    with VideoReader(path) as reader:
        (chunk,) = reader.chunks(4, 8)
    assert chunk.frames.shape == (4, HEIGHT, WIDTH, 3)
    assert [frame_index(f) for f in chunk.frames] == [0, 1, 2, 3]


def test_frames_over_max_pixels_are_not_even_probed(tmp_path, monkeypatch):
    """A frame within MAX_SIDE but over MAX_PIXELS (a smaller bound here: a real one would be a 35 MB frame): FFmpeg
    refuses to allocate it while probing the file, so its size stays unknown and the file is refused."""
    path = write_gray(tmp_path / "big.mkv", 60, 80)
    VideoReader(path).close()
    monkeypatch.setattr(video, "MAX_PIXELS", 80 * 60 - 1)
    with pytest.raises(ValueError, match=r"big\.mkv: the size of its frames is unknown: no frame could be probed, "
                                         r"or they are over 4799 px, which are not decoded"):
        VideoReader(path)


# read in a subprocess: hermes.video alone (no torch), address space capped; one JSON line of what came out
READ = """
import json, resource, sys, types
resource.setrlimit(resource.RLIMIT_AS, (int(sys.argv[5]), int(sys.argv[5])))
package = types.ModuleType("hermes")
package.__path__ = [sys.argv[1]]
sys.modules["hermes"] = package
from hermes.video import VideoReader
try:
    with VideoReader(sys.argv[2]) as reader:
        result = dict(chunks=[dict(sources=chunk.sources, shape=list(chunk.frames.shape))
                              for chunk in reader.chunks(float(sys.argv[3]), int(sys.argv[4]))])
except (ValueError, FileNotFoundError) as err:
    result = dict(error=str(err))
with open("/proc/self/status") as status:  # VmHWM: this program's peak (ru_maxrss counts the parent's before exec)
    result["peak_mib"] = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) / 1024
print(json.dumps(result))
"""
ADDRESS_SPACE = 1536 * 2 ** 20  # bytes: python, numpy and FFmpeg's threads fit; a 16384 x 16384 frame does not
PEAK_MIB = 300  # resident memory a case may reach (about 50 MiB read a small file)
SECONDS = 60  # per case: each takes well under a second


def read_bounded(path, fps: float = 1, chunk_frames: int = 4) -> dict:
    """Read `path` in a subprocess under ADDRESS_SPACE, SECONDS and PEAK_MIB: no crash, no hang, bounded memory;
    returns {"chunks": [{"sources", "shape"}, ...]} or {"error": message}."""
    # glibc's per-thread arenas and a BLAS thread per core would reserve address space on a many-core machine
    env = dict(os.environ, MALLOC_ARENA_MAX="2", OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", READ, os.path.join(REPO, "hermes"), str(path), str(fps),
                           str(chunk_frames), str(ADDRESS_SPACE)], capture_output=True, text=True, timeout=SECONDS,
                          env=env)
    assert done.returncode == 0, f"the reader crashed on {path}: {done.returncode}\n{done.stderr[-2000:]}"
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["peak_mib"] < PEAK_MIB, result
    assert "error" not in result or (result["error"].startswith("video:") and "\n" not in result["error"])
    return result


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """The fuzz cases' originals: MPEG-4 in Matroska (header first) and in MP4 (index last), 6 s at 4 fps."""
    folder = tmp_path_factory.mktemp("sources")
    times = [i / 4 for i in range(24)]
    return {"mkv": write_video(folder / "base.mkv", times), "mp4": write_video(folder / "base.mp4", times)}


def sampled_sources(result) -> list[int]:
    return [s for chunk in result["chunks"] for s in chunk["sources"]]


def frames_as_declared(result) -> bool:
    """Whole chunks (but the last) of frames of the stream's size."""
    return all(c["shape"][1:] == [HEIGHT, WIDTH, 3] for c in result["chunks"]) and \
        all(c["shape"][0] == 4 for c in result["chunks"][:-1])


@pytest.mark.parametrize("kind", ["mkv", "mp4"])
@pytest.mark.parametrize("kept", [0.0, 0.1, 0.5, 0.9])
def test_fuzz_a_truncated_file_gives_an_error_or_a_prefix(sources, tmp_path, kind, kept):
    """Cut at any point (nothing at all included): one "video:" error, or the samples of a prefix of the file."""
    data = open(sources[kind], "rb").read()
    path = tmp_path / f"cut.{kind}"
    path.write_bytes(data[:int(len(data) * kept)])
    result = read_bounded(path)
    if "error" not in result:
        with VideoReader(sources[kind]) as reader:
            full = [source for chunk in reader.chunks(1, 4) for source in chunk.sources]
        got = sampled_sources(result)
        assert got == full[:len(got)] and frames_as_declared(result)
    elif kept == 0.0:
        assert result["error"].startswith("video: cannot read")


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("head", [8, 2])
@pytest.mark.parametrize("kind", ["mkv", "mp4"])
def test_fuzz_garbage_after_a_valid_header_gives_an_error_or_frames(sources, tmp_path, kind, head, seed):
    """The first 1/head of the file kept (Matroska: its header and track, then frames), the rest random bytes:
    one "video:" error, or chunks of frames of the declared size (what the decoder made of the garbage)."""
    data = open(sources[kind], "rb").read()
    path = tmp_path / f"garbage.{kind}"
    path.write_bytes(data[:len(data) // head] + np.random.default_rng(seed).bytes(len(data) - len(data) // head))
    result = read_bounded(path)
    assert "error" in result or frames_as_declared(result)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("kind", ["mkv", "mp4"])
def test_fuzz_flipped_bytes_give_an_error_or_frames(sources, tmp_path, kind, seed):
    """One byte in 200 changed anywhere (headers, indexes, frame data; among such files: unknown codecs, lost
    streams, boxes that ask for more memory than FFmpeg allows, decoding errors): one "video:" error, or chunks of
    frames of the declared size."""
    rng = np.random.default_rng(seed)
    data = np.frombuffer(open(sources[kind], "rb").read(), np.uint8).copy()
    where = rng.integers(0, data.size, size=data.size // 200)
    data[where] ^= rng.integers(1, 256, size=where.size, dtype=np.uint8)
    path = tmp_path / f"flipped.{kind}"
    path.write_bytes(data.tobytes())
    result = read_bounded(path)
    assert "error" in result or frames_as_declared(result)


def test_fuzz_zero_length_and_non_monotonic_timestamps_are_skipped(tmp_path):
    """Frames that do not come after the latest one are skipped (docs/security.md#video): six frames at time 0 give
    one sample; times 0, 0.5, 1, 0.4, 1.5, 0.2 s sampled at 2 fps give frames 0, 1, 2, 4."""
    assert read_bounded(write_packets(tmp_path / "zero.mkv", [0] * 6))["chunks"] == \
        [{"sources": [0], "shape": [1, HEIGHT, WIDTH, 3]}]
    shuffled = write_packets(tmp_path / "back.mkv", [0, 500, 1000, 400, 1500, 200], dts=[0, 1, 2, 3, 4, 5])
    assert sampled_sources(read_bounded(shuffled, fps=2)) == [0, 1, 2, 4]


def test_fuzz_a_huge_frame_rate_and_a_huge_gap(tmp_path, sources):
    """Twelve frames a nanosecond apart (a 10^9 fps stream) all fall before the second sample: one sample. A
    jump of 10^6 s between frames, or an fps of 10^9 on an ordinary file, would repeat one frame millions of
    times: refused with one line."""
    dense = write_packets(tmp_path / "dense.mp4", list(range(12)), unit=Fraction(1, 10 ** 9))
    assert read_bounded(dense)["chunks"] == [{"sources": [0], "shape": [1, HEIGHT, WIDTH, 3]}]
    gap = write_packets(tmp_path / "gap.mkv", [0, 250, 10 ** 9])
    assert read_bounded(gap)["error"] == (f"video: {gap} jumps from 0.25 s to 1000000.00 s, a gap of over 3600 s "
                                          f"that would repeat one frame over 3600 times; its timestamps are broken, "
                                          f"or lower fps")
    assert "a gap of over 3.6e-06 s" in read_bounded(sources["mkv"], fps=10 ** 9)["error"]


def test_fuzz_absurd_sizes_and_no_frames(tmp_path):
    """A file that claims 16384 x 16384 frames (its header patched; no such frame can be probed), one of
    9000 x 2 frames, an empty file and a video track without frames: one line each, in bounded memory."""
    original = write_gray(tmp_path / "gray.mkv", 300, 300)
    data = open(original, "rb").read()
    for element in (b"\xb0\x82\x01\x2c", b"\xba\x82\x01\x2c"):  # Matroska PixelWidth, PixelHeight: 2 bytes, 300
        assert data.count(element) == 1
        data = data.replace(element, element[:2] + (16384).to_bytes(2, "big"))
    claimed = tmp_path / "claimed.mkv"
    claimed.write_bytes(data)
    assert read_bounded(claimed)["error"] == (f"video: {claimed}: the size of its frames is unknown: no frame could "
                                              f"be probed, or they are over 35389440 px, which are not decoded")
    wide = write_gray(tmp_path / "wide.mkv", 2, 9000)
    assert read_bounded(wide)["error"] == (f"video: {wide} declares 9000 x 2 px frames; the reader decodes at most "
                                           f"8192 px a side and 35389440 px a frame")
    (tmp_path / "empty.mp4").write_bytes(b"")
    assert read_bounded(tmp_path / "empty.mp4")["error"].startswith("video: cannot read")
    none = write_without_frames(tmp_path / "none.mkv")
    assert read_bounded(none)["error"] == f"video: {none} has no video frames (none of its video stream decodes)"


def test_fuzz_an_unknown_codec_and_metadata_that_is_not_utf8(sources, tmp_path):
    """The track's codec renamed to one FFmpeg does not know: one line. The muxer's name (in the header and the
    ENCODER tag) made invalid UTF-8: read as the original (PyAV would raise UnicodeDecodeError reading the tags
    strictly)."""
    data = open(sources["mkv"], "rb").read()
    assert data.count(b"V_MPEG4/ISO/ASP") == 1 and b"Lavf" in data  # Matroska CodecID; the muxer's name
    unknown = tmp_path / "unknown.mkv"
    unknown.write_bytes(data.replace(b"V_MPEG4/ISO/ASP", b"V_NOSUCH/CODEC!"))
    assert read_bounded(unknown)["error"] == f"video: {unknown}: its video stream is in a format PyAV cannot decode"
    tagged = tmp_path / "tagged.mkv"
    tagged.write_bytes(data.replace(b"Lavf", b"\xff\xfe\xfd\xfc"))
    assert read_bounded(tagged)["chunks"] == read_bounded(sources["mkv"])["chunks"]


# ---- a local file is a file, whatever its name (docs/security.md#video) --------------------------------------------
def _frames_of(path) -> list[int]:
    with VideoReader(path) as reader:
        return [frame_index(frame) for chunk in reader.chunks(4, 8) for frame in chunk.frames]


@pytest.mark.parametrize("form", ["relative", "absolute"])
def test_a_local_name_shaped_like_a_url_is_a_file(tmp_path, monkeypatch, form):
    """A folder `http:` holding `127.0.0.1:PORT/x.mp4`: relative, the name reads as http://127.0.0.1:PORT/x.mp4,
    and a loopback server listens on PORT. The local file's frames come out, and nobody connects to the server."""
    with TcpServer([([], "close")]) as server:
        name = f"http://127.0.0.1:{server.url.rsplit(':', 1)[1]}/x.mp4"
        (tmp_path / name).parent.mkdir(parents=True)
        write_video(tmp_path / name, [0.0, 0.25, 0.5, 0.75])
        monkeypatch.chdir(tmp_path)
        assert _frames_of(name if form == "relative" else os.path.join(tmp_path, name)) == [0, 1, 2, 3]
    assert server.accepted == 0


@pytest.mark.parametrize("form", ["relative", "absolute"])
def test_a_local_name_with_a_colon_opens(tmp_path, monkeypatch, form):
    """`take:2.mp4` is a file, not the unknown protocol `take`."""
    write_video(tmp_path / "take:2.mp4", [0.0, 0.25, 0.5])
    monkeypatch.chdir(tmp_path)
    assert _frames_of("take:2.mp4" if form == "relative" else tmp_path / "take:2.mp4") == [0, 1, 2]


def test_a_playlist_in_a_local_file_opens_no_url(tmp_path):
    """An HLS playlist naming a segment on a loopback server: FFmpeg's playlist reader may open local files only
    (a file read through a file object would otherwise let it open any protocol), so nobody connects."""
    with TcpServer([([], "close")]) as server:
        playlist = tmp_path / "list.m3u8"
        playlist.write_text(f"#EXTM3U\n#EXT-X-TARGETDURATION:1\n#EXTINF:1,\nhttp{server.url[3:]}/seg.ts\n"
                            "#EXT-X-ENDLIST\n")
        with pytest.raises(ValueError, match="^video: cannot read"):
            VideoReader(playlist)
    assert server.accepted == 0

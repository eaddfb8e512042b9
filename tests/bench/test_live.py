"""`python -m bench.live` and `python -m bench.soak --live` (docs/benchmarks.md#live, docs/benchmarks.md#soak-live):
the synthetic source against the LiveSource protocol, the simulated clock, the sustain model's arithmetic against
values worked out by hand from RECORDED, both commands at tiny sizes (seconds), and the soak failing on a leak and
on a broken drop rule injected on purpose. Nothing here asserts a timing."""
from __future__ import annotations

import math
import threading
import time

import numpy as np
import pytest
import torch

from hermes.live import LiveFrame, LiveSession, SourceEnded
from hermes.live.sources import QUEUED
from scaffolding.models import tiny_llava_ov
from scaffolding.pixels import llava_pixels

from bench import live, soak
from bench.widths import RealWidth

pytestmark = pytest.mark.usefixtures("single_thread")


# ---- the synthetic source -------------------------------------------------------------------------------------------
def test_the_synthetic_source_hands_out_paced_frames_on_a_simulated_clock():
    """2 fps for 3 s: six frames, each `due` 0.5 s after the last and stamped so; a get that would wait longer than
    its timeout moves the clock by the timeout and returns None, one that would not skips to the frame; then the
    source ends, and stays ended."""
    clock = live.SimClock(start=100.0)
    source = live.SyntheticSource(2.0, (12, 16), 3.0, clock=clock)
    assert (source.fps, source.frame_size, source.frames) == (2.0, (12, 16), 6)
    first = source.get(timeout=0)
    assert isinstance(first, LiveFrame) and (first.index, first.time) == (0, 0.0)
    assert first.arrived == source.due(0) and first.pixels.shape == (12, 16, 3) and first.pixels.dtype == np.uint8
    before = clock()
    assert source.get(timeout=0.1) is None and before + 0.1 <= clock() < source.due(1)
    frames = [source.get(timeout=None) for _ in range(5)]
    assert [(f.index, f.time) for f in frames] == [(i, i / 2) for i in range(1, 6)]
    assert [f.arrived for f in frames] == [source.due(i) for i in range(1, 6)] and clock() >= source.due(5)
    assert all(not np.array_equal(a.pixels, b.pixels) for a, b in zip([first] + frames, frames))
    for _ in range(2):
        with pytest.raises(SourceEnded, match="^end of stream$"):
            source.get(timeout=0)
    assert source.stats() == {"decoded": 6, "sampled": 6, "corrupt_packets": 0, "reconnects": 0, "overflow": 0}


def test_frames_past_the_queue_bound_are_dropped_oldest_first_and_counted():
    """A consumer that comes back after QUEUED + 10 samples were due finds the newest QUEUED of them, as a reader
    thread's bounded queue keeps them; the 11 oldest (the one due at once, then 10) are counted as overflow."""
    clock = live.SimClock()
    source = live.SyntheticSource(1.0, (8, 8), QUEUED + 100, clock=clock)
    clock.sleep(QUEUED + 10)
    frame = source.get(timeout=0)
    assert frame.index == 11 and frame.arrived == source.due(11)
    assert source.stats()["overflow"] == 11 and source.stats()["sampled"] == 12


def test_close_ends_the_source_and_cuts_a_real_time_wait_short():
    """In real time (no clock given) a get waiting for a frame due in an hour returns SourceEnded("closed") as soon as
    another thread closes the source; later gets say the same; close is idempotent."""
    source = live.SyntheticSource(1 / 3600, (8, 8), 7200.0)
    assert source.get(timeout=0).arrived <= source.due(1)
    assert source.get(timeout=0) is None
    closer = threading.Timer(0.05, source.close)
    closer.start()
    with pytest.raises(SourceEnded, match="^closed$"):
        source.get()
    closer.join()
    source.close()
    with pytest.raises(SourceEnded, match="^closed$"):
        source.get(timeout=0)


@pytest.mark.parametrize("bad", [0, -1.0, math.inf, True, "1"])
def test_the_synthetic_source_and_the_clock_refuse_bad_rates(bad):
    with pytest.raises(ValueError, match=r"^fps: expected a positive number"):
        live.SyntheticSource(bad, (8, 8), 1.0)
    with pytest.raises(ValueError, match=r"^seconds: expected a positive number"):
        live.SyntheticSource(1.0, (8, 8), bad)
    with pytest.raises(ValueError, match=r"^scale: expected a positive number"):
        live.SimClock(bad)


def test_the_simulated_clock_counts_work_and_skips_waits():
    """Readings never decrease; wait_until jumps to a later time and ignores a past one; sleep skips its seconds; a
    scale of 1000 turns the real time a loop takes into at least a thousand times as much."""
    clock = live.SimClock(start=5.0)
    readings = [clock() for _ in range(100)]
    assert readings == sorted(readings) and readings[0] >= 5.0
    clock.wait_until(50.0)
    assert clock() >= 50.0
    now = clock()
    clock.wait_until(now - 10)
    assert clock() >= now
    clock.sleep(7.0)
    assert clock() >= now + 7.0
    fast = live.SimClock(scale=1000.0)
    start, real = fast(), time.perf_counter()
    sum(range(100_000))
    elapsed = time.perf_counter() - real  # read before the clock: its interval holds this one
    assert fast() - start >= 1000 * elapsed * 0.999


# ---- the sustain model, by hand -------------------------------------------------------------------------------------
# LLaVA-OV-0.5B widths (Qwen2-0.5B: 24 layers, 896 wide, 14 query / 2 KV heads of 64, MLP 4864), from RECORDED:
#   weights 2 * 24 * (896*896 + 2*896*128 + 896*896 + 3*896*4864) = 715,653,120 FLOPs a token
#   keys    4 * 24 * 14 * 64 = 86,016 FLOPs a token per key; a token sees 6014 + 785 / 2 = 6406.5 keys
#   slope   (8155.17 - 5311.67) * 86016 / (715653120 + 86016 * 6406.5) = 0.193087291617 ms per cached token
#   fixed   8155.17 - 0.193087291617 * 6014 = 6993.943028 ms
#   H2SVC   rows 5 / 19 / 24 of 48 hold 4 / 16 / 64 frames: 14 + 196 * 1860 / 48 = 7609 tokens,
#           6993.943028 + 0.193087291617 * 7609 = 8463.144230 ms
#   behind  at 0.25 fps a chunk lasts 16 s: (16000 - 6993.943 - 0.19309 * 14) / (0.19309 * 784) = 59.475, so chunk 60,
#           which starts at 60 * 16 s = 16.0 min; at 0.5 fps 6.628: chunk 7 at 0.9333 min; at 1 fps from chunk 0
#   10 min  chunk 43 must keep up: 4000 / f >= 6996.646 + 43 * 151.38044 = 13506.005, f <= 0.296164 (< 0.3, where
#           the 45th chunk would fall within the 10 minutes)
# Qwen2.5-VL-3B widths (36 layers, 2048 wide, 16 / 2 heads of 128, MLP 11008):
#   slope   7590.01 * 294912 / (5549064192 + 294912 * 6211.5) = 0.303266806513; fixed 10498.350159 ms
#   H2SVC   rows 7 / 29 / 36 of 72: 15 + 196 * 2796 / 72 = 7626.333 tokens, 12811.163914 ms
#   behind  at 0.25 fps 46.24: chunk 47, 12.5333 min; at 0.5 fps from chunk 0
HAND = {
    "llava-ov-0.5b": dict(per_token=0.193087291617, fixed=6993.943028, hermes_fps=4 / 8.89895, h2svc_ms=8463.144230,
                          behind={0.1: 146.0, 0.25: 16.0, 0.5: 0.9333333, 1.0: 0.0}),
    "qwen2.5-vl-3b": dict(per_token=0.303266806513, fixed=10498.350159, hermes_fps=4 / 13.40558,
                          h2svc_ms=12811.163914, behind={0.1: 166.0, 0.25: 12.5333333, 0.5: 0.0}),
}


@pytest.mark.parametrize("width", sorted(HAND))
def test_the_cost_model_of_the_recorded_widths_matches_the_hand_computation(width):
    hand, model = HAND[width], live.cost_model(live.RECORDED[width])
    assert model.per_token_ms == pytest.approx(hand["per_token"], rel=1e-9)
    assert model.fixed_ms == pytest.approx(hand["fixed"], rel=1e-9)
    assert model.sustained_fps(model.hermes_ms) == pytest.approx(hand["hermes_fps"], rel=1e-9)
    assert model.h2svc_ms == pytest.approx(hand["h2svc_ms"], rel=1e-9)
    assert {fps: model.behind_minute(fps) for fps in hand["behind"]} == pytest.approx(hand["behind"], rel=1e-6)


def test_the_uncompressed_stream_s_sustained_rate_over_ten_minutes_matches_the_hand_computation():
    model = live.cost_model(live.RECORDED["llava-ov-0.5b"])
    rate = model.uncompressed_fps(10.0)
    assert rate == pytest.approx(0.296164, abs=2e-4)
    assert model.uncompressed_fps(1.0) > rate > model.uncompressed_fps(60.0)


def test_a_measured_short_point_gives_the_slope():
    """With prefill alone measured at two cache lengths (7000 ms at 798 tokens, 8155.17 at 6014) the slope is their
    difference quotient, 1155.17 / 5216 = 0.221466641104 ms a token, and fixed 6823.269620 ms; a measured H2SVC chunk
    is taken as it is."""
    cost = live.ChunkCost("llava-ov-0.5b", 4, 784, 6014, 8155.17, 5311.67, 8898.95, h2svc_ms=9000.0,
                          short=(798, 7000.0), origin="a test")
    model = live.cost_model(cost)
    assert model.per_token_ms == pytest.approx(0.221466641104, rel=1e-9)
    assert model.fixed_ms == pytest.approx(6823.269620, rel=1e-9)
    assert model.h2svc_ms == 9000.0 and model.h2svc == "measured"


def test_the_sustain_report_prints_a_row_per_width():
    models = [live.cost_model(cost) for cost in live.RECORDED.values()]
    lines = live.sustain_report(models, (0.25, 1.0), (1.0, 10.0))
    assert lines[0].split(" | ") == ["width         ", "HERMES fps", "H2SVC fps", "unc. 1 min", "unc. 10 min"]
    assert lines[1].split() == ["llava-ov-0.5b", "|", "0.449", "|", "0.473", "|", "0.506", "|", "0.296"]
    assert lines[-2].split() == ["llava-ov-0.5b", "|", "16.0", "|", "0.0"]


# ---- the commands at tiny sizes -------------------------------------------------------------------------------------
def test_bench_live_runs_both_policies_slowed_and_not_and_draws_the_lag(tmp_path, capsys):
    """Two seconds at 4 fps of the synthetic source in real time, each policy as it runs and slowed by 1.3 s a chunk
    (a chunk lasts 1 s: frames are dropped); the lines, the PNG and the sustain table from the record."""
    png = tmp_path / "lag.png"
    assert live.main(["--seconds", "2", "--fps", "4", "--slow", "1.3", "--source", "synthetic", "--png", str(png),
                      "--sustain-fps", "0.25", "--minutes", "10"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines()]
    assert ["llava-ov-0.5b", "|", "16.0"] in rows
    rows = [row for row in rows if row[:1] == ["llava_ov"]]
    assert [row[:4] for row in rows] == [["llava_ov", p, "4", slow] for slow in ("0", "1.3") for p in live.POLICIES]
    assert all(int(row[9]) >= 1 for row in rows) and all(int(row[10]) >= 1 for row in rows[2:])  # chunks, drops
    assert "bench/results/2026-12-01-cpu-stream-cost-real-widths.md" in out
    pytest.importorskip("matplotlib")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_run_from_a_generated_clip_played_in_real_time(tmp_path):
    """The file source path: a 2 s clip at 8 fps written by write_clip, sampled at 2 fps, every frame encoded."""
    pytest.importorskip("av")
    clip = live.write_clip(tmp_path / "clip.mp4", 2.0)
    run = live.live_run("qwen2_5_vl", "hermes", 2.0, 2.0, clip=clip)
    assert run.summary["frames"] == 4 and run.summary["ended"] == "end of stream" and not run.drops
    assert [end for end, _ in run.chunks] == [1.5] and all(lag is not None for _, lag in run.chunks)


def test_measure_times_a_width_s_chunks():
    """--measure's timing on a tiny stand-in width (budget 128): every field filled, the short point before the
    budget, the cache at prefix + budget once HERMES compresses, and a model built from it."""
    def frames(count, generator):
        return {"video": llava_pixels(1, count, generator).to(torch.bfloat16)}

    width = RealWidth("tiny", type(tiny_llava_ov()), lambda: tiny_llava_ov().config, frames, None)
    cost = live.measure(width, budget=128, steps=1)
    assert (cost.width, cost.frames, cost.chunk_tokens) == ("tiny", 4, 64)
    assert cost.short[0] < cost.cache and cost.cache - 128 == cost.short[0] - 64
    assert all(value > 0 for value in (cost.alone_ms, cost.vision_ms, cost.hermes_ms, cost.h2svc_ms, cost.short[1]))


def test_soak_live_slowed_drops_frames_keeps_lag_bounded_and_memory_flat(capsys):
    """Ten minutes at 1 fps, every chunk 6 simulated seconds slower than its 4 s: about a third of the frames dropped
    (how many exactly depends on the chunks' own few ms, which shift the phase of the drops), each chunk's lag within
    max_lag + its stages, the reports' live tensor bytes equal, every frame accounted for, the questions answered."""
    reports, summary = soak.soak_live("llava_ov", "hermes", minutes=10.0, every=25, question_every=20, slow=6.0,
                                      progress=False)
    assert [r.chunk for r in reports] == list(range(25, 25 * len(reports) + 1, 25)) and len(reports) >= 3
    assert len({r.tensor_bytes for r in reports}) == 1 and len(capsys.readouterr().out.splitlines()) == len(reports)
    assert summary["dropped"] > 100 and summary["frames"] + summary["dropped"] == 600
    assert summary["lag"]["max"] <= 4.0 + 6.0 + 1.0 and summary["answers"] == summary["chunks"] // 20
    assert summary["ended"] == "end of stream"


def test_soak_live_command(capsys):
    """`python -m bench.soak --live` over two minutes of video, both policies, as it runs and slowed: a line per report
    and an OK line per run."""
    assert soak.main(["--live", "--minutes", "2", "--family", "qwen2_5_vl", "--every", "10", "--no-progress"]) == 0
    lines = capsys.readouterr().out.splitlines()
    ok = [line for line in lines if " OK: " in line]
    assert [line.split(":")[0] for line in ok] == [f"qwen2_5_vl {p} slow {s} s" for p in live.POLICIES
                                                   for s in ("0", "6")]


# ---- the soak fails when it should ----------------------------------------------------------------------------------
def test_soak_live_fails_on_a_stream_that_keeps_every_chunk():
    """A stream wrapped to keep every chunk's pixel tensors (a leak on purpose): the second report's live tensor
    bytes differ from the first's."""
    kept = []

    def keep_every_chunk(stream):
        append = stream.append_video

        def keeping(**inputs):
            kept.append(inputs)
            return append(**inputs)

        stream.append_video = keeping
        return stream

    with pytest.raises(soak.SoakFailure, match=r"^llava_ov hermes chunk 20: live tensor bytes \d+ != \d+ at chunk "
                                                 r"10"):
        soak.soak_live("llava_ov", "hermes", minutes=5.0, every=10, progress=False, wrap=keep_every_chunk)
    assert len(kept) == 20


def test_soak_live_fails_on_a_session_that_never_drops(monkeypatch):
    """A session whose drop rule is switched off, 6 s slower than each 4 s chunk: its lag grows past max_lag + the
    chunk's stages within a few chunks."""
    monkeypatch.setattr(LiveSession, "_drop_late", lambda self: None)
    with pytest.raises(soak.SoakFailure, match=r"^llava_ov hermes chunk \d+: lag [0-9.]+ s past max_lag 4 s \+ its "
                                                 r"stages 6\.\d+ s$"):
        soak.soak_live("llava_ov", "hermes", minutes=5.0, every=10, slow=6.0, progress=False)


def test_soak_live_fails_when_memory_was_never_compared():
    """A minute of video is 15 chunks: with a report every 10 there is one, nothing to compare it with."""
    with pytest.raises(soak.SoakFailure, match=r"^qwen2_5_vl h2svc: 1 report\(s\) in 15 chunks, so memory was not "
                                                 r"compared"):
        soak.soak_live("qwen2_5_vl", "h2svc", minutes=1.0, every=10, progress=False)


@pytest.mark.parametrize("grew", ["tensors", "rss"])
def test_the_flat_memory_rule(grew):
    first = soak.LiveReport(10, 1.0, 400.0, 1000, 5, 0, 78, {}, 0, 1.0)
    later = soak.LiveReport(20, 2.0, 400.0 + (65.0 if grew == "rss" else 63.0), 1000 + (grew == "tensors"), 5, 0, 78,
                            {}, 0, 1.0)
    message = "live tensor bytes 1001 != 1000 at chunk 10" if grew == "tensors" else "RSS 465.0 MiB grew more than 64"
    with pytest.raises(soak.SoakFailure, match=f"^here: {message}"):
        soak.check_flat(first, later, 64.0, "here")
    soak.check_flat(first, soak.LiveReport(20, 2.0, 463.0, 1000, 6, 0, 78, {}, 0, 1.0), 64.0, "here")

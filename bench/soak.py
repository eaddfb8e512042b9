"""Soak: stream many chunks through HermesStream on the tiny models; memory must stay flat, positions bounded.

`soak(family, chunks, ...)` runs `batch` streams in lockstep, with ragged questions every `question_every` chunks,
and returns one `Report` per `every` chunks (RSS, live tensor bytes, length, positions, time per chunk); it raises
`SoakFailure` at the first leak, RSS growth past the tolerance, position past max_position_embeddings, wrong length
after a step or moved storage. Usage (`python -m bench.soak --chunks 10000`), the options and the failure rules:
docs/benchmarks.md#soak.

`soak_live(family, policy, ...)` (`--live`) plays an hour of a synthetic 1 fps source into a `LiveSession` on a
simulated clock (bench.live.SimClock: idle waits skipped, the work counted as it takes here) and raises
`SoakFailure` when memory grows or a chunk's lag passes max_lag plus its processing: docs/benchmarks.md#soak-live.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import time

import torch
from tqdm import tqdm

from hermes.live import ChunkDone, Ended, FramesDropped, LiveSession
from hermes.stream import HermesStream
from scaffolding.census import live_tensors
from scaffolding.pixels import llava_pixels, qwen_pixels
from scaffolding.tokenizer import tiny_tokenizer

from bench.live import (BUILDERS, CHUNK_FRAMES, FAMILIES, POLICIES, SimClock, SyntheticSource, slowed,
                        tiny_stream)

QUESTIONS = ("what is the person holding ?", "where is the red cup the man is holding ?")  # ragged
# real seconds the live session may spend between its drop check and its first stage timer (a few microseconds; the
# rest covers the process being descheduled there): a chunk's lag may pass max_lag + its stages by this x the scale
LAG_SLACK = 0.1


class SoakFailure(AssertionError):
    """Memory grew or positions left their bound; the message says which, at which chunk."""


@dataclasses.dataclass
class Report:
    chunk: int              # chunks streamed so far
    rss_mib: float | None   # resident set size of the process (None where /proc is missing)
    tensor_bytes: int       # bytes of distinct storages of every live tensor
    tensor_count: int
    length: int             # cache length after the chunk
    positions: tuple[int, int]
    ms_per_chunk: float     # mean since the previous report
    steps: int
    reindexes: int

    def line(self, family: str) -> str:
        rss = "n/a" if self.rss_mib is None else f"{self.rss_mib:8.1f}"
        return (f"{family:10s} chunk {self.chunk:6d} | RSS {rss} MiB | live tensors {self.tensor_count:5d} "
                f"{self.tensor_bytes / 2**20:8.3f} MiB | length {self.length:4d} | positions "
                f"{self.positions[0]}..{self.positions[1]:4d} | {self.ms_per_chunk:6.2f} ms/chunk | steps "
                f"{self.steps} reindexes {self.reindexes}")


def rss_mib() -> float | None:
    """Resident set size of this process in MiB, from /proc (None on systems without it)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return None


def _chunker(family: str, batch: int, generator: torch.Generator):
    if family == "llava_ov":
        return 2, {}, lambda: {"video": llava_pixels(batch, 2, generator)}
    if family == "qwen3_5":  # 8 x 8 frames, two temporal steps a chunk, one second apart
        seconds = iter(range(0, 10**9, 2))

        def chunk():
            video, grid = qwen_pixels(batch, 4, generator, 8, 8)
            start = next(seconds)
            return {"video": video, "grid_thw": grid, "timestamps": [start + 0.5, start + 1.5]}
        return 4, {"frame_size": (8, 8)}, chunk
    return 4, {"frame_size": (16, 16)}, lambda: dict(zip(("video", "grid_thw"), qwen_pixels(batch, 4, generator)))


def soak(family: str, chunks: int, every: int = 500, question_every: int = 100, batch: int = 2, budget: int = 64,
         max_positions: int = 512, rss_tolerance: float = 64.0, progress: bool = True, seed: int = 0,
         out=print) -> list[Report]:
    """Stream `chunks` chunks through a tiny `family` model; returns one Report per `every` chunks (and the last).
    Raises SoakFailure at the first violation (docs/benchmarks.md#soak)."""
    if family not in FAMILIES:
        raise ValueError(f"family: expected one of {FAMILIES}, got {family!r}")
    for name, value in (("chunks", chunks), ("every", every), ("question_every", question_every), ("batch", batch)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")
    generator = torch.Generator().manual_seed(seed)
    frames, extra, chunk = _chunker(family, batch, generator)
    model = BUILDERS[family](max_positions=max_positions)
    # lazy re-indexing once positions pass max_positions - margin: every few dozen chunks at these sizes
    tokenizer = tiny_tokenizer(digits=family == "qwen3_5")
    stream = HermesStream(model, tokenizer, budget=budget, batch_size=batch, chunk_frames=frames, room=160,
                          margin=max_positions // 4, **extra)
    kept = stream.cfg.prefix_len + budget
    storage = stream.cache.data_ptrs()
    questions = [QUESTIONS[0 if stream.cache.linear_states is not None else b % len(QUESTIONS)] for b in range(batch)]
    reports: list[Report] = []
    first: Report | None = None
    bar = tqdm(range(1, chunks + 1), desc=f"soak {family}", unit="chunk", disable=not progress, leave=False)
    started = time.perf_counter()
    for index in bar:
        result = stream.append_video(**chunk())
        if index % question_every == 0:
            stream.ask(questions, max_new_tokens=4)
        stats = stream.stats()
        if stats["positions"][1] >= max_positions:
            raise SoakFailure(f"{family} chunk {index}: position {stats['positions'][1]} reached "
                              f"max_position_embeddings={max_positions}")
        if result is not None and stats["length"] != kept:
            raise SoakFailure(f"{family} chunk {index}: length {stats['length']} after a step, expected {kept}")
        if stream.cache.data_ptrs() != storage:
            raise SoakFailure(f"{family} chunk {index}: the cache's buffers moved")
        if index % every and index != chunks:
            continue
        elapsed = time.perf_counter() - started
        count, nbytes = live_tensors()
        since = index - (reports[-1].chunk if reports else 0)
        report = Report(chunk=index, rss_mib=rss_mib(), tensor_bytes=nbytes, tensor_count=count,
                        length=stats["length"], positions=stats["positions"], ms_per_chunk=elapsed / since * 1e3,
                        steps=stats["steps"], reindexes=stats["reindexes"])
        reports.append(report)
        (bar.write if progress else out)(report.line(family))
        first = first or report
        check_flat(first, report, rss_tolerance, f"{family} chunk {index}")
        started = time.perf_counter()
    bar.close()
    if reports[-1].reindexes < 1:
        raise SoakFailure(f"{family}: no re-indexing ran in {chunks} chunks; positions were never exercised")
    return reports


@dataclasses.dataclass
class LiveReport:
    chunk: int              # chunks encoded so far
    minutes: float          # video minutes the source has played (the end of the last chunk)
    rss_mib: float | None
    tensor_bytes: int
    tensor_count: int
    buffered: int           # frames the session holds for its next chunk
    length: int             # cache length after the chunk
    lag: dict               # the session's summary of lag (s): p50, p99 over the last WINDOW chunks, max over all
    dropped: int
    ms_per_chunk: float     # real ms per chunk since the previous report (answers and idle polls included)

    def line(self, family: str, policy: str) -> str:
        rss = "n/a" if self.rss_mib is None else f"{self.rss_mib:8.1f}"
        return (f"{family:10s} {policy:6s} chunk {self.chunk:5d} video {self.minutes:5.1f} min | RSS {rss} MiB | "
                f"live tensors {self.tensor_count:5d} {self.tensor_bytes / 2**20:8.3f} MiB | buffered "
                f"{self.buffered} | length {self.length:4d} | lag p50 {self.lag['p50']:6.3f} p99 "
                f"{self.lag['p99']:6.3f} max {self.lag['max']:6.3f} s | dropped {self.dropped:5d} | "
                f"{self.ms_per_chunk:6.2f} ms/chunk")


def check_flat(first, report, rss_tolerance: float, where: str) -> None:
    """SoakFailure unless `report` holds the live tensor bytes of `first` and RSS within `rss_tolerance` MiB of it
    (LiveReport or Report)."""
    if report.tensor_bytes != first.tensor_bytes:
        raise SoakFailure(f"{where}: live tensor bytes {report.tensor_bytes} != {first.tensor_bytes} at chunk "
                          f"{first.chunk} ({report.tensor_count} vs {first.tensor_count} tensors)")
    if report.rss_mib is not None and report.rss_mib - first.rss_mib > rss_tolerance:
        raise SoakFailure(f"{where}: RSS {report.rss_mib:.1f} MiB grew more than {rss_tolerance} MiB over "
                          f"{first.rss_mib:.1f} MiB at chunk {first.chunk}")


def soak_live(family: str, policy: str = "hermes", minutes: float = 60.0, fps: float = 1.0, every: int = 100,
              question_every: int = 100, slow: float = 0.0, compute_scale: float = 1.0, budget: int = 64,
              max_positions: int = 512, rss_tolerance: float = 64.0, progress: bool = True, wrap=None,
              out=print) -> tuple[list[LiveReport], dict]:
    """Play `minutes` of a `SyntheticSource` at `fps` into a `LiveSession` over a tiny `family` stream (`policy`;
    HERMES at `budget`, lazy re-indexing below `max_positions`) on a `SimClock(compute_scale)`, every chunk `slow`
    simulated seconds slower, a question every `question_every` chunks. Returns a LiveReport every `every` chunks
    (none after the source's shorter last chunk) and the session's summary. `wrap(stream)`, if given, returns the
    stream the session is fed (a test's leak). Raises SoakFailure at the first chunk whose lag passes max_lag + its
    stages' time (+ LAG_SLACK x compute_scale), at a report whose live tensor bytes differ from the first's or whose
    RSS grew past `rss_tolerance` MiB, and at the end unless the source ended, every frame it sampled was encoded or
    dropped, and there were two reports to compare."""
    for name, value in (("every", every), ("question_every", question_every)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")
    clock = SimClock(compute_scale)
    stream = tiny_stream(family, policy, max_positions=max_positions, **({"budget": budget} if policy == "hermes"
                                                                         else {}))
    if slow:
        slowed(stream, slow, sleep=clock.sleep)
    if wrap is not None:
        stream = wrap(stream)
    source = SyntheticSource(fps, stream.frame_size, 60 * minutes, clock=clock)
    session = LiveSession(stream, source, chunk_frames=CHUNK_FRAMES, max_new_tokens=4, clock=clock)
    name, slack = f"{family} {policy}", LAG_SLACK * compute_scale
    reports: list[LiveReport] = []
    bar = tqdm(total=source.frames, desc=f"soak --live {name}", unit="frame", disable=not progress, leave=False)
    started, since = time.perf_counter(), 0
    for event in session.run():
        if isinstance(event, FramesDropped):
            bar.update(event.count)
        if isinstance(event, Ended) and event.reason != "end of stream":
            raise SoakFailure(f"{name}: the session ended with {event.reason!r}, not the source's end")
        if not isinstance(event, ChunkDone):
            continue
        bar.update(event.frames)
        stages = (event.decode_ms + (event.vision_ms or 0.0) + event.prefill_ms + (event.compression_ms or 0.0)) / 1e3
        if event.lag > session.max_lag + stages + slack:
            raise SoakFailure(f"{name} chunk {event.index}: lag {event.lag:.3f} s past max_lag {session.max_lag:g} s "
                              f"+ its stages {stages:.3f} s")
        chunks = event.index + 1
        if chunks % question_every == 0:
            session.ask(QUESTIONS[0])
        if chunks % every or event.frames < session.chunk_frames:
            continue  # the census at whole chunks only: the session holds the inputs of the chunk it just encoded
        count, nbytes = live_tensors()
        report = LiveReport(chunk=chunks, minutes=event.end / 60, rss_mib=rss_mib(), tensor_bytes=nbytes,
                            tensor_count=count, buffered=session.buffered, length=stream.stats()["length"],
                            lag=session.summary()["lag"], dropped=session.summary()["dropped"],
                            ms_per_chunk=(time.perf_counter() - started) / (chunks - since) * 1e3)
        reports.append(report)
        (bar.write if progress else out)(report.line(family, policy))
        check_flat(reports[0], report, rss_tolerance, f"{name} chunk {chunks}")
        started, since = time.perf_counter(), chunks
    bar.close()
    if len(reports) < 2:
        raise SoakFailure(f"{name}: {len(reports)} report(s) in {session.summary()['chunks']} chunks, so memory was "
                          f"not compared; play longer or report more often than every {every} chunks")
    summary = session.summary()
    overflow = source.stats()["overflow"]
    if summary["frames"] + summary["dropped"] + overflow != source.frames:
        raise SoakFailure(f"{name}: {summary['frames']} frames encoded + {summary['dropped']} dropped + {overflow} "
                          f"overflowed != the {source.frames} the source sampled")
    return reports, summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, default=10_000)
    parser.add_argument("--family", choices=FAMILIES + ("all",), default="all")
    parser.add_argument("--every", type=int, default=None,
                        help="report every this many chunks (default 500; --live 100)")
    parser.add_argument("--question-every", type=int, default=100)
    parser.add_argument("--batch", type=int, default=2, help="streams in lockstep")
    parser.add_argument("--budget", type=int, default=64)
    parser.add_argument("--max-positions", type=int, default=512)
    parser.add_argument("--rss-tolerance", type=float, default=64.0, help="MiB of RSS growth allowed")
    parser.add_argument("--no-progress", action="store_true")
    live = parser.add_argument_group("--live", "a LiveSession fed by a synthetic source on a simulated clock")
    live.add_argument("--live", action="store_true", help="soak a live session instead of the stream (--chunks and "
                                                           "--batch do not apply)")
    live.add_argument("--minutes", type=float, default=60.0, help="minutes of video (default 60)")
    live.add_argument("--fps", type=float, default=1.0, help="the source's sampling rate (default 1)")
    live.add_argument("--policy", nargs="+", choices=POLICIES, default=list(POLICIES))
    live.add_argument("--slow", nargs="+", type=float, default=[0.0, 6.0],
                      help="simulated seconds added to every chunk; one run per value (default 0 and 6: as the "
                           "model runs, and 1.5 chunks of 1 fps video slower)")
    live.add_argument("--compute-scale", type=float, default=1.0,
                      help="simulated seconds per real second of work (default 1)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # tiny models are latency-bound; see tests/hermes/streams.py
    families = FAMILIES if args.family == "all" else (args.family,)
    if args.live:
        return live_main(args, families)
    for family in families:
        try:
            reports = soak(family, args.chunks, args.every or 500, args.question_every, args.batch, args.budget,
                           args.max_positions, args.rss_tolerance, progress=not args.no_progress)
        except SoakFailure as failure:
            print(f"SOAK FAILED: {failure}", file=sys.stderr)
            return 1
        last, first = reports[-1], reports[0]
        rss = "n/a" if last.rss_mib is None else f"{last.rss_mib - first.rss_mib:+.1f} MiB"
        print(f"{family}: {args.chunks} chunks OK: RSS {rss} since chunk {first.chunk}, live tensor bytes "
              f"unchanged ({last.tensor_bytes / 2**20:.3f} MiB), positions {last.positions[0]}..{last.positions[1]} "
              f"< {args.max_positions}, {last.steps} steps, {last.reindexes} re-indexings")
    return 0


def live_main(args, families) -> int:
    """`--live`: soak_live for every family, policy and --slow; a line per run, exit 1 at the first failure."""
    for family in families:
        for policy in args.policy:
            for slow in args.slow:
                try:
                    reports, summary = soak_live(family, policy, args.minutes, args.fps, args.every or 100,
                                                 args.question_every, slow, args.compute_scale, args.budget,
                                                 args.max_positions, args.rss_tolerance,
                                                 progress=not args.no_progress,
                                                 out=functools.partial(print, flush=True))
                except SoakFailure as failure:
                    print(f"SOAK FAILED: {failure}", file=sys.stderr)
                    return 1
                first, last, lag = reports[0], reports[-1], summary["lag"]
                rss = "n/a" if last.rss_mib is None else f"{last.rss_mib - first.rss_mib:+.1f} MiB"
                print(f"{family} {policy} slow {slow:g} s: {args.minutes:g} min at {args.fps:g} fps OK: "
                      f"{summary['chunks']} chunks, {summary['dropped']} frames dropped, lag p50 {lag['p50']:.3f} "
                      f"p99 {lag['p99']:.3f} max {lag['max']:.3f} s, {summary['answers']} answers, RSS {rss} since "
                      f"chunk {first.chunk}, live tensor bytes unchanged ({last.tensor_bytes / 2**20:.3f} MiB), "
                      f"real-time factor {summary['realtime_factor']:.3f} (simulated wall)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Soak: stream many chunks through HermesStream on the tiny models; memory must stay flat, positions bounded.

`soak(family, chunks, ...)` runs `batch` streams in lockstep, with ragged questions every `question_every` chunks,
and returns one `Report` per `every` chunks (RSS, live tensor bytes, length, positions, time per chunk); it raises
`SoakFailure` at the first leak, RSS growth past the tolerance, position past max_position_embeddings, wrong length
after a step or moved storage. Usage (`python -m bench.soak --chunks 10000`), the options and the failure rules:
docs/benchmarks.md#soak.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import torch
from tqdm import tqdm

from hermes.stream import HermesStream
from scaffolding.census import live_tensors
from scaffolding.models import tiny_llava_ov, tiny_qwen2_5_vl, tiny_qwen3_5
from scaffolding.pixels import llava_pixels, qwen_pixels
from scaffolding.tokenizer import tiny_tokenizer

FAMILIES = ("llava_ov", "qwen2_5_vl", "qwen3_5")
BUILDERS = {"llava_ov": tiny_llava_ov, "qwen2_5_vl": tiny_qwen2_5_vl, "qwen3_5": tiny_qwen3_5}
QUESTIONS = ("what is the person holding ?", "where is the red cup the man is holding ?")  # ragged


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
        if report.tensor_bytes != first.tensor_bytes:
            raise SoakFailure(f"{family} chunk {index}: live tensor bytes {report.tensor_bytes} != "
                              f"{first.tensor_bytes} at chunk {first.chunk} ({report.tensor_count} vs "
                              f"{first.tensor_count} tensors)")
        if report.rss_mib is not None and report.rss_mib - first.rss_mib > rss_tolerance:
            raise SoakFailure(f"{family} chunk {index}: RSS {report.rss_mib:.1f} MiB grew more than "
                              f"{rss_tolerance} MiB over {first.rss_mib:.1f} MiB at chunk {first.chunk}")
        started = time.perf_counter()
    bar.close()
    if reports[-1].reindexes < 1:
        raise SoakFailure(f"{family}: no re-indexing ran in {chunks} chunks; positions were never exercised")
    return reports


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, default=10_000)
    parser.add_argument("--family", choices=FAMILIES + ("all",), default="all")
    parser.add_argument("--every", type=int, default=500, help="report every this many chunks")
    parser.add_argument("--question-every", type=int, default=100)
    parser.add_argument("--batch", type=int, default=2, help="streams in lockstep")
    parser.add_argument("--budget", type=int, default=64)
    parser.add_argument("--max-positions", type=int, default=512)
    parser.add_argument("--rss-tolerance", type=float, default=64.0, help="MiB of RSS growth allowed")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # tiny models are latency-bound; see tests/hermes/streams.py
    families = FAMILIES if args.family == "all" else (args.family,)
    for family in families:
        try:
            reports = soak(family, args.chunks, args.every, args.question_every, args.batch, args.budget,
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


if __name__ == "__main__":
    sys.exit(main())

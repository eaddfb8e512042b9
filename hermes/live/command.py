"""The live command, `hermes --live SOURCE` or `hermes --video FILE --realtime` (hermes.cli parses and checks it):
`run_live` opens the source, streams it through a `LiveSession` and returns its events as records, while
`TypedQuestions` asks the questions typed on standard input as it plays; `LivePrinter` puts the records on the
terminal. Options, output, order of the checks: docs/cli.md#live; the session's model of time: docs/live.md.
"""
from __future__ import annotations

import json
import os
import select
import sys
import threading
import warnings
from typing import IO, Callable, Sequence

import numpy as np

from hermes.cli import build_stream, check_live_run
from hermes.commands import LoadedModel, load_model
from hermes.live.session import LiveSession
from hermes.live.sources import open_source

AT_THE_END = sys.float_info.max  # video seconds no chunk reaches: the session asks such a question as the source ends
POLL = 0.1  # s between the question reader's looks at stop()
READ = 4096  # bytes the question reader takes at a time


def run_live(model: str | os.PathLike | LoadedModel, source: str | os.PathLike, *, live: bool = True,
             questions: Sequence[str] = (), ask_at: Sequence = (), watch: str | None = None, typed: IO | None = None,
             fps: float = 1.0, chunk_frames: int = 16, budget: int = 6000, policy: str = "hermes",
             head_map: str | os.PathLike | None = None, device=None, dtype="auto", max_new_tokens: int = 64,
             max_lag: float | None = None, open_timeout: float = 10.0, stall_timeout: float = 10.0,
             reconnect: int = 0, on_record: Callable[[dict], None] | None = None) -> list[dict]:
    """Stream a live source through `model` as it plays and answer questions meanwhile; returns the records (also
    passed to `on_record` as they come).

    source:        live=True: a URL, /dev/videoN or "-" (standard input), opened with `open_timeout` s, ended after
                   `stall_timeout` s without a frame, reopened up to `reconnect` times (a URL); live=False: a video
                   file played at its own speed (`open_source(..., realtime=True)`).
    questions:     asked when the source ends; ask_at: "TIME:question" or (video seconds, question), each asked after
                   the first chunk that reaches TIME; watch: re-asked after every chunk, yielded when its answer
                   changes; typed: a file (standard input) whose lines are asked while the source plays
                   (`TypedQuestions`).
    max_lag:       seconds a sampled frame may wait before it is encoded; later ones are dropped (None: one chunk's
                   duration, chunk_frames / fps).
    Other arguments as `hermes.cli.run`.

    Records: every event's `to_json()` as the session yields it ("chunk", "dropped", "answer", the last one
    "ended"; docs/live.md#events), then {"type": "summary", **LiveSession.summary(), "source": the source's
    counters} — also after an error or a KeyboardInterrupt (its "ended": "interrupted"), which then propagate. The
    checks come first (`hermes.cli.check_live_run`), then the source opens (a source that cannot open within
    open_timeout: ValueError "live: cannot open ..."), then the weights load and the stream is built for the size of
    its frames.
    """
    check = check_live_run(model, source, live=live, questions=questions, ask_at=ask_at, watch=watch, fps=fps,
                           chunk_frames=chunk_frames, budget=budget, policy=policy, head_map=head_map, device=device,
                           dtype=dtype, max_new_tokens=max_new_tokens, max_lag=max_lag, open_timeout=open_timeout,
                           stall_timeout=stall_timeout, reconnect=reconnect)
    # the source opens before the weights load, so one that cannot (a closed port, an unreachable host) is refused
    # before they do; frames that arrive meanwhile wait in its bounded queue, and the session drops the late ones
    family, processor = (model.family, model.processor) if isinstance(model, LoadedModel) else \
        (check.family, check.processor)
    # a file's kept size is known from its header; a live source's once it is open
    keep = check.keep if not live else (lambda height, width: family.kept_size(processor, height, width))
    frames = open_source(os.fspath(source), live=live, fps=fps, keep=keep, realtime=not live,
                         open_timeout=open_timeout, stall_timeout=stall_timeout, reconnect=reconnect)
    try:
        loaded = model if isinstance(model, LoadedModel) else load_model(model, check.device, check.dtype,
                                                                          processor=check.processor)
        stream = build_stream(loaded, policy=policy, budget=budget, chunk_frames=chunk_frames, head_map=head_map,
                              frame_size=processed_size(loaded, frames.frame_size, chunk_frames, fps))
        session = LiveSession(stream, frames, chunk_frames=chunk_frames, max_lag=max_lag,
                              ask_at=[*check.schedule, *((AT_THE_END, question.strip()) for question in questions)],
                              watch=watch, max_new_tokens=max_new_tokens)
    except BaseException:
        frames.close()
        raise
    records: list[dict] = []

    def emit(record: dict) -> None:
        records.append(record)
        if on_record is not None:
            on_record(record)

    reader = None if typed is None else TypedQuestions(typed, session)
    events = session.run()
    interrupted = False
    try:
        for event in events:
            emit(event.to_json())
    except KeyboardInterrupt:
        interrupted = True
        raise
    finally:
        events.close()  # an interrupt that struck outside the session leaves it suspended: end it now
        if reader is not None:
            reader.stop()
        summary = session.summary()
        emit({"type": "summary", **summary, "ended": "interrupted" if interrupted else summary["ended"],
              "source": frames.stats()})
    return records


def processed_size(loaded: LoadedModel, size: tuple[int, int], chunk_frames: int,
                   fps: float) -> tuple[int, int] | None:
    """The family's frame size (`frame_size`, which sizes a Qwen stream's chunks) of chunks of `size` (height, width)
    frames: read from the inputs `prepare_frames` makes of one chunk of blank frames."""
    blank = np.zeros((chunk_frames, *size, 3), np.uint8)
    return loaded.family.frame_size(loaded.model, loaded.family.prepare_frames(loaded.processor, blank, fps))


class TypedQuestions:
    """Questions typed on `file` (standard input: a terminal or a pipe), one a line, asked of a running `session`
    as they come (`LiveSession.ask`, from this reader's thread), until the end of the input or `stop()`; blank lines
    are skipped. The file's descriptor is read directly, in steps of POLL s, so that stop() ends the reader promptly
    and no thread is left holding `sys.stdin`. A question the stream refuses (e.g. no room for it) is a warning."""

    def __init__(self, file: IO, session: LiveSession):
        self.fd, self.session = file.fileno(), session
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._read, name="hermes-live-questions", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """Stop reading (a line not finished is dropped) and wait for the reader."""
        self.stopping.set()
        self.thread.join()

    def _read(self) -> None:
        pending = b""
        while not self.stopping.is_set():
            try:
                if not select.select([self.fd], [], [], POLL)[0]:
                    continue
                data = os.read(self.fd, READ)
            except OSError:  # the terminal went away (a closed pseudo-terminal reads as EIO)
                data = b""
            *lines, pending = (pending + data).split(b"\n")
            for line in lines + ([pending] if not data else []):
                self._ask(line.decode(errors="replace"))
            if not data:
                return

    def _ask(self, line: str) -> None:
        if line.strip():
            self.session.ask(line).add_done_callback(_warn_refused)


def _warn_refused(future) -> None:
    # a question the stream refused fails alone; one asked as the session ended is not worth a line
    if not future.cancelled() and isinstance(future.exception(), ValueError):
        warnings.warn(f"question not answered: {future.exception()}", stacklevel=1)


class LivePrinter:
    """run_live's records on the terminal (docs/cli.md#live).

    stdout: as_json, every record as a JSON line; otherwise the answers, "[m:ss.s] Q: ..." then "A: ..." with the
    latencies to the first and last token.
    stderr: per chunk, a line with its stages (`verbose`) or the progress line (`progress`: rewritten in place on a
    terminal, a line per chunk otherwise); "source ended: REASON" at a clean end; the summary, unless as_json.
    """

    def __init__(self, as_json: bool = False, verbose: bool = False, progress: bool = True, out: IO | None = None,
                 err: IO | None = None):
        self.as_json, self.verbose, self.progress = as_json, verbose, progress
        self.out, self.err = out or sys.stdout, err or sys.stderr
        self.in_place = progress and not verbose and self.err.isatty()
        self.showing = False  # a progress line is on the terminal, not ended by a newline

    def record(self, record: dict) -> None:
        kind = record["type"]
        if self.as_json:
            self._write(self.out, json.dumps(record))
        if kind == "chunk" and self.verbose:
            self._write(self.err, chunk_line(record))
        elif kind == "chunk" and self.progress:
            self._progress(progress_line(record))
        elif kind == "dropped" and self.verbose:
            self._write(self.err, dropped_line(record))
        elif kind == "answer" and not self.as_json:
            self._write(self.out, answer_text(record))
        elif kind == "ended" and not record["reason"].startswith("error: "):  # an error has its own line
            self._write(self.err, f"source ended: {record['reason']}")
        elif kind == "summary" and not self.as_json:
            self._write(self.err, summary_text(record))

    def _progress(self, line: str) -> None:
        if not self.in_place:
            self._write(self.err, line)
            return
        self.err.write(f"\r{line}\x1b[K")
        self.err.flush()
        self.showing = True

    def _write(self, file: IO, text: str) -> None:
        if self.showing:  # end the progress line first: the text goes below it
            self.err.write("\n")
            self.err.flush()
            self.showing = False
        print(text, file=file, flush=True)


def clock(seconds: float) -> str:
    """Video time as m:ss.s."""
    minutes, seconds = divmod(seconds, 60)
    return f"{int(minutes)}:{seconds:04.1f}"


def _number(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def chunk_line(record: dict) -> str:
    """--verbose's line for a chunk record: video times, lag (s), drops so far, each stage (ms), the cache."""
    return (f"chunk {record['index']}  {clock(record['start'])}-{clock(record['end'])}  lag "
            f"{_number(record['lag'], 2)} s  dropped {record['dropped']}  decode {_number(record['decode_ms'])}  "
            f"vision {_number(record['vision_ms'])}  prefill+guidance {_number(record['prefill_ms'])}  compression "
            f"{_number(record['compression_ms'])} ms  cache {record['cache_length']} tokens")


def dropped_line(record: dict) -> str:
    """--verbose's line for a dropped record: how many, their video times, how many in all."""
    count, times = record["count"], record["times"]
    return (f"dropped {count} late frame{'' if count == 1 else 's'}, {clock(times[0])} to {clock(times[-1])} "
            f"({record['total']} in all)")


def progress_line(record: dict) -> str:
    """The progress line after a chunk record: video time reached, lag (s), drops so far, the chunk's ms, the cache."""
    spent = sum(record[name] or 0.0 for name in ("decode_ms", "vision_ms", "prefill_ms", "compression_ms"))
    return (f"{clock(record['end'])} of video  chunk {record['index']}  lag {_number(record['lag'], 2)} s  "
            f"dropped {record['dropped']}  {spent:.0f} ms/chunk  cache {record['cache_length']} tokens")


def answer_text(record: dict) -> str:
    """An answer record as two lines: video time seen, the question (a watch question marked), the answer and its
    latencies from the question (s)."""
    asked = "Q (watch)" if record["watch"] else "Q"
    return (f"[{clock(record['seen'])}] {asked}: {record['question']}\n           A: {record['answer']}  "
            f"({record['first_token_s']:.2f} s to the first token, {record['last_token_s']:.2f} s to the last)")


def _spread(stats: dict, digits: int) -> str:
    return " / ".join(_number(stats[name], digits) for name in ("p50", "p99", "max"))


def summary_text(record: dict) -> str:
    """The summary record in lines: counts and the real-time factor (video s per wall s), the stages' ms, the lag
    and the answers' latencies (p50 / p99 / max), the source's counters, why it ended."""
    source = record["source"]
    stages = "; ".join(f"{label} {_spread(record[name], 0)}" for label, name in (
        ("decode", "decode_ms"), ("vision", "vision_ms"), ("prefill+guidance", "prefill_ms"),
        ("compression", "compression_ms")))
    return "\n".join([
        f"summary: {record['chunks']} chunks, {record['frames']} frames: {record['video_seconds']:.1f} s of video in "
        f"{record['wall_seconds']:.1f} s, real-time factor {_number(record['realtime_factor'], 2)}; "
        f"frames dropped: {record['dropped']}; answers: {record['answers']}; watch asks: {record['watch_asks']}",
        f"  ms per chunk (p50 / p99 / max): {stages}",
        f"  lag s (p50 / p99 / max): {_spread(record['lag'], 2)}",
        f"  answer s (p50 / p99 / max): to the first token {_spread(record['first_token_s'], 2)}; to the last "
        f"{_spread(record['last_token_s'], 2)}",
        f"  source: {source['decoded']} frames decoded, {source['sampled']} sampled, {source['corrupt_packets']} "
        f"corrupt packets skipped, {source['reconnects']} reconnects, {source['overflow']} lost to a full queue",
        f"  ended: {record['ended']}"])

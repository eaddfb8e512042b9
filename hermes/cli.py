"""`python -m hermes`: stream a video file through LLaVA-OneVision or Qwen2.5-VL with a HERMES (or H2SVC) cache and
answer questions about it; `run(...)` does the same from Python and returns the records `--json` prints.

    python -m hermes --model PATH --video FILE --question "What is the person holding?"
    python -m hermes --model PATH --video FILE --ask-at 30s:"What just happened?" --json
    python -m hermes --model PATH --video FILE --policy h2svc --head-map map.json --question "..."

The path of one run: the checkpoint's config names the model family (`hermes.models`), the model loads with
`AutoModelForImageTextToText` and its processor with `load_processor` (the real video processor, or the
torchvision-free twin); PyAV decodes the file and frames are sampled at `fps` by timestamp (`hermes.video`);
every `chunk_frames` samples go through the processor (`family.prepare_frames`) into
`HermesStream.append_video`; a question given with a time is asked after the first chunk that reaches that
time, the others after the last chunk, in order.

Chunking: the cache is sized for `chunk_frames` frames, so a video with fewer sampled frames than one chunk is
refused (ValueError: lower chunk_frames or raise fps); a longer video's last chunk holds the frames left over
and may be shorter.

Errors a user can fix raise ValueError, OSError (FileNotFoundError) or ImportError with a one-line message
naming what is wrong; `main` prints it as one line on stderr and exits with status 1 (2 for a bad command
line), without a traceback unless --traceback is given.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import re
import sys
import textwrap
import time
from typing import Callable, Iterable, Sequence

import torch

from hermes.video import VideoReader, as_fraction, parse_time
from hermes_kernels.checks import check_positive_int

POLICIES = ("hermes", "h2svc")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_ASK_AT = re.compile(r"^\s*(\d+(?::\d+){0,2}(?:\.\d+)?s?)\s*:(.*)$", re.DOTALL)


@dataclasses.dataclass
class LoadedModel:
    """A checkpoint ready to stream: the model (eval mode, on `device`), its processor and its family."""

    model: torch.nn.Module
    processor: object
    family: object
    path: str
    device: torch.device


def resolve_device(device: str | torch.device | None) -> torch.device:
    """torch.device from a name; None picks cuda when available, else cpu. ValueError for a device that is
    not there."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"device: expected e.g. cpu, cuda or cuda:1, got {device!r}") from err
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: cuda was asked for but torch sees no CUDA device (torch.cuda.is_available() "
                         "is False); use --device cpu")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device: expected cpu or cuda, got {device}")
    return device


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """"auto" is bfloat16 on CUDA and float32 on CPU; otherwise a name from DTYPES or a torch.dtype."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"dtype: expected auto or one of {sorted(DTYPES)}, got {dtype!r}")


def load_model(path: str | os.PathLike, device: str | torch.device | None = None,
               dtype: str | torch.dtype = "auto") -> LoadedModel:
    """Load a local checkpoint folder: its family from config.json's model_type (checked before any weights
    load), the model with `AutoModelForImageTextToText`, the processor with `load_processor`."""
    from transformers import AutoModelForImageTextToText, PretrainedConfig

    from hermes.models import family_of_type
    from hermes.models.processing import load_processor

    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model: no such folder: {path} (expected a local checkpoint folder)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"model: {path} has no config.json; expected a checkpoint saved with save_pretrained")
    config, _ = PretrainedConfig.get_config_dict(path)
    family = family_of_type(config.get("model_type"))
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype).to(device).eval()
    return LoadedModel(model=model, processor=load_processor(path, family), family=family, path=path, device=device)


def policy_kwargs(policy: str, budget: int, head_map: str | os.PathLike | None = None) -> dict:
    """HermesStream keyword arguments that select the KV-cache `policy` and its settings: the one place the CLI
    maps a policy to the stream. "hermes": its budget; "h2svc": policy="h2svc" and the head map file (None: the
    unprofiled default map, which HermesStream warns about). A head map for HERMES or a missing file is an error
    before anything loads."""
    if policy not in POLICIES:
        raise ValueError(f"policy: expected one of {POLICIES}, got {policy!r}")
    if policy == "hermes":
        if head_map is not None:
            raise ValueError("head_map: only --policy h2svc takes a head map")
        return {"budget": budget}
    if head_map is not None and not os.path.isfile(os.fspath(head_map)):
        raise FileNotFoundError(f"head map: no such file: {os.fspath(head_map)}")
    return {"policy": policy, "head_map": None if head_map is None else os.fspath(head_map)}


def build_stream(loaded: LoadedModel, *, policy: str, budget: int, chunk_frames: int,
                 frame_size: tuple[int, int] | None, head_map: str | os.PathLike | None = None):
    """The stream for one video: HermesStream with `policy_kwargs(policy, budget, head_map)`; a configuration the
    model cannot hold (e.g. a budget past its positions, a head map of another model) is a ValueError naming the
    settings."""
    from hermes.stream import HermesStream

    kwargs = policy_kwargs(policy, budget, head_map)
    settings = f"budget={budget}" if policy == "hermes" else f"policy {policy}"
    try:
        return HermesStream(loaded.model, loaded.processor, chunk_frames=chunk_frames, frame_size=frame_size,
                            **kwargs)
    except ValueError as err:
        raise ValueError(f"cannot build the stream with {settings}, chunk_frames={chunk_frames}: {err}") from err


def parse_ask_at(item: str | tuple) -> tuple[float, str]:
    """(seconds, question) from "TIME:question" (TIME as `hermes.video.parse_time` reads it, e.g. 30s, 1:30)
    or from a (time, question) pair."""
    if isinstance(item, str):
        match = _ASK_AT.match(item)
        if not match:
            raise ValueError(f"ask_at: expected TIME:question (e.g. 30s:\"What happened?\"), got {item!r}")
        when, question = match.groups()
    elif isinstance(item, (tuple, list)) and len(item) == 2:
        when, question = item
    else:
        raise ValueError(f"ask_at: expected 'TIME:question' or (time, question), got {item!r}")
    seconds = parse_time(when) if isinstance(when, str) else float(when)
    if not (seconds >= 0 and seconds != float("inf")):
        raise ValueError(f"ask_at: expected a time >= 0, got {when!r}")
    return seconds, _question(question)


def _question(question) -> str:
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"question: expected a non-empty string, got {question!r}")
    return question.strip()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(model: str | os.PathLike | LoadedModel, video: str | os.PathLike, *, questions: Iterable[str] = (),
        ask_at: Sequence[str | tuple] = (), fps: float = 1.0, chunk_frames: int = 16, budget: int = 6000,
        policy: str = "hermes", head_map: str | os.PathLike | None = None,
        device: str | torch.device | None = None, dtype: str | torch.dtype = "auto",
        max_new_tokens: int = 64, on_record: Callable[[dict], None] | None = None,
        progress: bool = False) -> list[dict]:
    """Stream `video` through `model` with HERMES (or H2SVC) and answer questions; returns the records (also passed
    to `on_record` as they come).

    model:         a checkpoint folder, or a `LoadedModel` from `load_model` (reused across videos).
    questions:     asked after the whole video, in order; any iterable, read lazily (e.g. lines from a terminal).
    ask_at:        "TIME:question" strings or (seconds, question) pairs: each asked after the first chunk whose
                   last frame is at or past TIME (after the last chunk when the video is shorter).
    fps:           frames sampled per second of video, by timestamp (`hermes.video`).
    chunk_frames:  frames per chunk (the cache is sized for one chunk; fewer frames in all is a ValueError).
    budget:        visual tokens kept per layer (HERMES).
    policy:        "hermes" or "h2svc" (docs/h2svc.md); head_map: an H2SVC head map file (`python -m
                   hermes.policies.h2svc.profile`; None: the unprofiled default map, with a warning).
    device, dtype: used when `model` is a path (default: cuda if available; bfloat16 on cuda, float32 on cpu).
    progress:      a tqdm bar on stderr with each chunk's latency and the cache size.

    Records: {"type": "chunk", "index", "frames", "start", "end", "sources", "prepare_ms", "latency_ms",
    "compressed", "cache_length", "cache_capacity", "positions", "steps", "cache_bytes"} per chunk (times in
    seconds of video, sources the decoded-frame index of each sampled frame, prepare_ms the processor,
    latency_ms append_video: vision tower, prefill, guidance and compression; positions the smallest and
    largest RoPE position in the cache); {"type": "answer", "question", "answer", "at", "latency_ms"} per
    question, "at" being the seconds of video seen.
    """
    from tqdm import tqdm

    fps = float(as_fraction(fps, "fps"))
    check_positive_int("chunk_frames", chunk_frames)
    check_positive_int("budget", budget)
    check_positive_int("max_new_tokens", max_new_tokens)
    policy_kwargs(policy, budget, head_map)  # a bad policy or head map fails before anything loads
    schedule = sorted((parse_ask_at(item) for item in ask_at), key=lambda pair: pair[0])
    if not os.path.isfile(os.fspath(video)):
        raise FileNotFoundError(f"video: no such file: {os.fspath(video)}")
    loaded = model if isinstance(model, LoadedModel) else load_model(model, device, dtype)
    records: list[dict] = []

    def emit(record: dict) -> None:
        records.append(record)
        if on_record is not None:
            on_record(record)

    def ask(question: str, seen: float) -> None:
        start = time.perf_counter()
        answer = stream.ask(question, max_new_tokens=max_new_tokens)
        emit({"type": "answer", "question": question, "answer": answer.strip(), "at": seen,
              "latency_ms": 1000 * (time.perf_counter() - start)})

    def prepare(chunk) -> tuple[dict, float]:
        start = time.perf_counter()
        inputs = loaded.family.prepare_frames(loaded.processor, chunk.frames, fps)
        return inputs, 1000 * (time.perf_counter() - start)

    with VideoReader(video) as reader:
        chunks = reader.chunks(fps, chunk_frames)
        first = next(chunks, None)
        if first is None or len(first.times) < chunk_frames:
            sampled = 0 if first is None else len(first.times)
            raise ValueError(f"video: {sampled} frames sampled at {fps:g} fps, fewer than one chunk of "
                             f"{chunk_frames}; lower --chunk-frames or raise --fps")
        prepared = prepare(first)
        stream = build_stream(loaded, policy=policy, budget=budget, chunk_frames=chunk_frames,
                              frame_size=loaded.family.frame_size(loaded.model, prepared[0]), head_map=head_map)
        duration = reader.duration
        total = None if duration is None else -(-(int(duration * fps) + 1) // chunk_frames)
        bar = tqdm(total=total, unit="chunk", file=sys.stderr, disable=not progress, dynamic_ncols=True)
        pending = list(schedule)
        seen = 0.0
        try:
            for chunk in itertools.chain([first], chunks):
                inputs, prepare_ms = prepared if chunk is first else prepare(chunk)
                _sync(loaded.device)
                start = time.perf_counter()
                step = stream.append_video(**inputs)
                _sync(loaded.device)
                latency_ms = 1000 * (time.perf_counter() - start)
                stats = stream.stats()
                seen = chunk.end
                emit({"type": "chunk", "index": chunk.index, "frames": len(chunk.times), "start": chunk.start,
                      "end": chunk.end, "sources": chunk.sources, "prepare_ms": prepare_ms,
                      "latency_ms": latency_ms, "compressed": step is not None, "cache_length": stats["length"],
                      "cache_capacity": stats["capacity"], "positions": list(stats["positions"]),
                      "steps": stats["steps"], "cache_bytes": stats["bytes_allocated"]})
                bar.update()
                bar.set_postfix_str(f"{chunk.end:.0f} s, {latency_ms:.0f} ms/chunk, cache {stats['length']}/"
                                    f"{stats['capacity']} tokens ({stats['bytes_allocated'] / 2**20:.1f} MiB)")
                while pending and pending[0][0] <= chunk.end:
                    ask(pending.pop(0)[1], seen)
        finally:
            bar.close()
    for _, question in pending:
        ask(question, seen)
    for question in questions:
        ask(_question(question), seen)
    return records


def terminal_questions(source=None) -> Iterable[str]:
    """Questions typed on `source` (default stdin), one a line, until end of input or an empty line; a prompt
    goes to stderr when the input is a terminal."""
    source = sys.stdin if source is None else source
    prompt = source.isatty()
    while True:
        if prompt:
            print("question> ", end="", file=sys.stderr, flush=True)
        line = source.readline()
        if not line.strip():
            return
        yield line.strip()


def parser() -> argparse.ArgumentParser:
    def wrap(text: str) -> str:
        return textwrap.fill(text, width=100)

    p = argparse.ArgumentParser(
        prog="python -m hermes",
        description=wrap("Stream a video file through LLaVA-OneVision or Qwen2.5-VL with a HERMES KV cache (memory "
                         "stays at the budget however long the video) or an H2SVC one (per-head frame memories) and "
                         "answer questions about it."),
        epilog="\n\n".join([
            wrap("Questions: --question ones are asked after the whole video, --ask-at ones as the stream passes "
                 "their time; with neither, questions are read from stdin, one a line, until an empty line or end "
                 "of input."),
            wrap("Output: answers on stdout (with --json one JSON record per chunk and per answer); progress on "
                 "stderr. Exit status 0; 1 on an error (one line on stderr); 2 for a bad command line."),
            "Example:\n  python -m hermes --model ./llava-onevision-qwen2-7b-ov-hf --video talk.mp4 \\\n"
            "      --ask-at 1:30:\"Who is speaking?\" --question \"Summarise the video.\""]),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, metavar="PATH",
                   help="local checkpoint folder (config.json, weights, tokenizer, processor configs) of a "
                        "llava_onevision or qwen2_5_vl model")
    p.add_argument("--video", required=True, metavar="FILE", help="video file PyAV can decode (mp4, mkv, webm, ...)")
    p.add_argument("--question", action="append", default=[], metavar="TEXT",
                   help="question asked after the whole video (repeatable, asked in order)")
    p.add_argument("--ask-at", action="append", default=[], metavar="TIME:TEXT",
                   help="question asked once the stream reaches TIME (30, 30s, 12.5s, 1:30, 1:02:03), e.g. "
                        "--ask-at 30s:\"What just happened?\" (repeatable)")
    p.add_argument("--fps", type=float, default=1.0, help="frames sampled per second of video, by timestamp "
                                                          "(default 1)")
    p.add_argument("--chunk-frames", type=int, default=16,
                   help="sampled frames per chunk (default 16); the last chunk may be shorter; a video with "
                        "fewer frames than one chunk is an error")
    p.add_argument("--budget", type=int, default=6000,
                   help="visual tokens kept per layer, --policy hermes (default 6000)")
    p.add_argument("--policy", choices=POLICIES, default="hermes",
                   help="KV-cache policy: hermes (default) or h2svc (per-head frame memories)")
    p.add_argument("--head-map", metavar="PATH", default=None,
                   help="--policy h2svc: head map from python -m hermes.policies.h2svc.profile (checked against "
                        "the model); default: the unprofiled depth-order map, with a warning")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    p.add_argument("--dtype", choices=("auto", *DTYPES), default="auto",
                   help="model dtype (default auto: bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="longest answer in tokens (default 64)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads of torch (default: torch's choice; 1 avoids OpenMP spin-waits on a busy machine)")
    p.add_argument("--json", action="store_true",
                   help="one JSON record per line on stdout: {\"type\": \"chunk\", ...} per chunk, "
                        "{\"type\": \"answer\", ...} per answer")
    p.add_argument("--quiet", action="store_true", help="no progress bars (model loading, stream)")
    p.add_argument("--traceback", action="store_true", help="show the full traceback of an error")
    return p


def _print_record(record: dict, as_json: bool) -> None:
    """A record on stdout: JSON, or for text output answers only (tqdm.write keeps the bar on stderr intact)."""
    from tqdm import tqdm

    if as_json:
        tqdm.write(json.dumps(record), file=sys.stdout)
    elif record["type"] == "answer":
        minutes, seconds = divmod(record["at"], 60)
        tqdm.write(f"[{int(minutes)}:{seconds:04.1f}] Q: {record['question']}\n           A: {record['answer']}",
                   file=sys.stdout)
    sys.stdout.flush()


def run_command(body: Callable[[], None], show_traceback: bool = False) -> int:
    """Run a command's `body` under the commands' error contract and return the exit status: 0 when it returns;
    an error a user can fix (ValueError, OSError, ImportError, out of memory) printed as one line `error: ...` on
    stderr and 1; any other exception as one internal-error line and 1; 130 on Ctrl-C. With show_traceback the
    exception propagates instead (--traceback)."""
    try:
        body()
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # noqa: BLE001 (the command's contract: one line, no traceback)
        if show_traceback:
            raise
        message = " ".join(str(err).split()) or type(err).__name__
        if not isinstance(err, (ValueError, OSError, ImportError, torch.OutOfMemoryError)):
            message = f"internal error ({type(err).__name__}: {message}); rerun with --traceback for details"
        print(f"error: {message}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """The command: parse, `run`, print; returns the exit status."""
    args = parser().parse_args(argv)
    from transformers.utils import logging as transformers_logging

    transformers_logging.set_verbosity_error()  # load-time notices would bury the progress bar and answers
    if args.quiet:
        transformers_logging.disable_progress_bar()
    questions = args.question or (terminal_questions() if not args.ask_at else ())

    def body() -> None:
        if args.threads is not None:
            torch.set_num_threads(check_positive_int("threads", args.threads))
        run(args.model, args.video, questions=questions, ask_at=args.ask_at, fps=args.fps,
            chunk_frames=args.chunk_frames, budget=args.budget, policy=args.policy, head_map=args.head_map,
            device=args.device, dtype=args.dtype, max_new_tokens=args.max_new_tokens,
            on_record=lambda record: _print_record(record, args.json), progress=not args.quiet)

    return run_command(body, args.traceback)

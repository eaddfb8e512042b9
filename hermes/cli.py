"""`hermes` (or `python -m hermes`): stream a video file through LLaVA-OneVision, Qwen2.5-VL, Qwen3-VL or Qwen3.5
with a HERMES (or H2SVC) cache and answer questions about it; `run(...)` does the same from Python and returns the
records `--json` prints.

    hermes --model PATH --video FILE --question "What is the person holding?"
    hermes --model PATH --video FILE --policy h2svc --head-map map.json --ask-at 30s:"What just happened?" --json
    torchrun --nproc-per-node 2 -m hermes --tp 2 --model PATH --video FILE --question "..."   # docs/multi-gpu.md
    hermes --model PATH --live rtsp://camera.local/1 --watch "Is the door open?"          # docs/cli.md#live

Every input is checked before any weights load (`check_run`, `check_live_run`), the settings and the files before
torch or transformers is even imported (`check_arguments`, `check_live_arguments`). A live run (`--live`, or
`--video --realtime`) is `hermes.live.command.run_live`. Options, errors, records: docs/cli.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import re
import sys
import time
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

from hermes.commands import (LoadedModel, UsageError, check_checkpoint, check_positive_int, check_tp, check_tp_model,
                             checkpoint_folder, command_parser, load_model, load_processor, resolve_device,
                             resolve_dtype, run_main, tp_device, usage)
from hermes.live.sources import check_live_source
from hermes.registry import check_policy_name, get_policy
from hermes.video import VideoReader, as_fraction, parse_time

if TYPE_CHECKING:
    import torch

_ASK_AT = re.compile(r"^\s*(\d+(?::\d+){0,2}(?:\.\d+)?s?)\s*:(.*)$", re.DOTALL)


@dataclasses.dataclass
class RunCheck:
    """What `check_run` found before any weights load. From `check_arguments`: the question schedule (seconds,
    question), `tp`, the tensor-parallel degree (1: one process), the video's `duration` (seconds, None when its
    header does not say) and its frames' `size` (height, width); both None for a --live source (known once it
    opens). Then the device and dtype, for a checkpoint folder its family, processor and config, and `keep`, the
    frame size the processor keeps (`VideoReader.chunks`' keep; None for a --live source)."""

    schedule: list[tuple[float, str]]
    tp: int
    duration: float | None
    size: tuple[int, int] | None
    device: torch.device | None = None
    dtype: torch.dtype | None = None
    family: object = None
    processor: object = None
    config: object = None
    keep: tuple[int, int] | None = None


def check_arguments(model: str | os.PathLike | LoadedModel, video: str | os.PathLike, *, ask_at: Sequence = (),
                    fps: float = 1.0, chunk_frames: int = 16, budget: int = 6000, policy: str = "hermes",
                    head_map: str | os.PathLike | None = None, max_new_tokens: int = 64,
                    tp: int | None = None) -> RunCheck:
    """The checks of `check_run` that import neither torch, transformers nor any policy, in this order: the settings
    (the policy's name against the registry, `policy_kwargs`), tp against the processes torchrun started, the
    video's header, the checkpoint folder (a `LoadedModel`: nothing). Returns the RunCheck's schedule, tp, duration
    and size; raises as `check_run`."""
    schedule = _check_settings(ask_at, fps, chunk_frames, budget, policy, head_map, max_new_tokens)
    return _check_inputs(model, video, schedule, check_tp(tp))


def _check_settings(ask_at: Sequence, fps: float, chunk_frames: int, budget: int, policy: str,
                    head_map: str | os.PathLike | None, max_new_tokens: int) -> list[tuple[float, str]]:
    """The settings of every run (a file's or a live one), each refusal a UsageError naming it; a missing head map
    file a FileNotFoundError. Returns the --ask-at schedule, sorted by time."""
    usage(lambda: as_fraction(fps, "fps"))
    for name, value in (("chunk_frames", chunk_frames), ("budget", budget), ("max_new_tokens", max_new_tokens)):
        usage(lambda: check_positive_int(name, value))
    schedule = usage(lambda: sorted((parse_ask_at(item) for item in ask_at), key=lambda pair: pair[0]))
    usage(lambda: policy_kwargs(policy, budget, head_map))  # a missing head map file: FileNotFoundError
    return schedule


def _check_inputs(model: str | os.PathLike | LoadedModel, video: str | os.PathLike,
                  schedule: list[tuple[float, str]], tp: int) -> RunCheck:
    """The video file's header, then the checkpoint folder."""
    with VideoReader(video) as reader:  # the header: a video stream of frames of a sane size
        check = RunCheck(schedule, tp, reader.duration, reader.size)
    _check_folder(model)
    return check


def _check_folder(model: str | os.PathLike | LoadedModel) -> None:
    if not isinstance(model, LoadedModel):
        checkpoint_folder(model)  # its config.json is read (with transformers) by check_run


def check_live_arguments(model: str | os.PathLike | LoadedModel, source: str | os.PathLike, *, live: bool = True,
                         questions: Sequence[str] = (), ask_at: Sequence = (), watch: str | None = None,
                         fps: float = 1.0, chunk_frames: int = 16, budget: int = 6000, policy: str = "hermes",
                         head_map: str | os.PathLike | None = None, max_new_tokens: int = 64,
                         max_lag: float | None = None, open_timeout: float = 10.0, stall_timeout: float = 10.0,
                         reconnect: int = 0, tp: int | None = None) -> RunCheck:
    """The checks of `check_live_run` that import neither torch, transformers nor any policy, in this order
    (docs/cli.md#live): the settings (as `check_arguments`), the questions, the live settings (`max_lag` against the
    time a chunk takes to arrive, the timeouts, `reconnect`), tp (a live run is one process), the source (--live:
    its kind, `hermes.live.sources.check_live_source`, and `reconnect` for a URL only; a file, live=False: its
    header), the checkpoint folder. Every refusal of a setting or of a --live source is one line naming it
    (UsageError); a missing file or folder as `check_arguments`."""
    schedule = _check_settings(ask_at, fps, chunk_frames, budget, policy, head_map, max_new_tokens)
    for question in questions:
        usage(lambda: _question(question))
    if watch is not None:
        usage(lambda: _question(watch, "watch"))
    if max_lag is not None:
        usage(lambda: as_fraction(max_lag, "max_lag"))
        arriving = (chunk_frames - 1) / float(fps)  # LiveSession's own bound, in its own arithmetic
        if max_lag < arriving:
            raise UsageError(f"max_lag: a chunk of {chunk_frames} frames at {fps:g} fps takes {arriving:g} s to "
                             f"arrive; --max-lag must be at least that, got {max_lag:g}")
    for name, value in (("open_timeout", open_timeout), ("stall_timeout", stall_timeout)):
        usage(lambda: as_fraction(value, name))
    if isinstance(reconnect, bool) or not isinstance(reconnect, int) or reconnect < 0:
        raise UsageError(f"reconnect: expected a non-negative int, got {reconnect!r}")
    if check_tp(tp) > 1:
        raise UsageError("tp: a live run reads its source in one process; --tp is for --video without --realtime")
    if not live:
        if reconnect:
            raise UsageError("reconnect: only a network source (--live URL) is reopened, not a --video file")
        return _check_inputs(model, source, schedule, 1)
    kind = usage(lambda: check_live_source(source))
    if reconnect and kind != "url":
        raise UsageError(f"reconnect: only a network source (--live URL) is reopened, not {source!r}")
    _check_folder(model)
    return RunCheck(schedule, 1, None, None)


def check_run(model: str | os.PathLike | LoadedModel, video: str | os.PathLike, *, ask_at: Sequence = (),
              fps: float = 1.0, chunk_frames: int = 16, budget: int = 6000, policy: str = "hermes",
              head_map: str | os.PathLike | None = None, device: str | torch.device | None = None,
              dtype: str | torch.dtype = "auto", max_new_tokens: int = 64, tp: int | None = None) -> RunCheck:
    """Every check of `run` that needs no weights (docs/cli.md#stream-a-video-file), in this order: those of
    `check_arguments` (the settings, tp, the video's header, the checkpoint folder), the device, the checkpoint's
    config.json (its heads against tp) and its processor, the policy's class (an installed package's is imported
    here), the video's first chunk (decoded at the size the processor keeps) and the --ask-at times against the
    video, the budget against the positions, the head map. UsageError for a setting that cannot work;
    FileNotFoundError or ValueError for an input that cannot be read; ImportError for a policy's package that
    cannot be."""
    check = check_arguments(model, video, ask_at=ask_at, fps=fps, chunk_frames=chunk_frames, budget=budget,
                            policy=policy, head_map=head_map, max_new_tokens=max_new_tokens, tp=tp)
    _check_model(check, model, device, dtype, policy)
    check.keep = check.family.kept_size(check.processor, *check.size)
    fps = float(as_fraction(fps, "fps"))
    with VideoReader(video) as reader:
        first = next(usage(lambda: reader.chunks(fps, chunk_frames, keep=check.keep)))
    if len(first.times) < chunk_frames:
        raise UsageError(f"video: {len(first.times)} frames sampled at {fps:g} fps, fewer than one chunk of "
                         f"{chunk_frames}; lower --chunk-frames or raise --fps")
    late = [when for when, _ in check.schedule if check.duration is not None and when > check.duration]
    if late:
        raise UsageError(f"ask_at: {late[0]:g} s is past the end of the video ({check.duration:.2f} s): "
                         f"{os.fspath(video)}")
    _check_cache(check, policy, budget, chunk_frames, head_map)
    return check


def check_live_run(model: str | os.PathLike | LoadedModel, source: str | os.PathLike, *, live: bool = True,
                   questions: Sequence[str] = (), ask_at: Sequence = (), watch: str | None = None, fps: float = 1.0,
                   chunk_frames: int = 16, budget: int = 6000, policy: str = "hermes",
                   head_map: str | os.PathLike | None = None, device: str | torch.device | None = None,
                   dtype: str | torch.dtype = "auto", max_new_tokens: int = 64, max_lag: float | None = None,
                   open_timeout: float = 10.0, stall_timeout: float = 10.0, reconnect: int = 0) -> RunCheck:
    """Every check of `hermes.live.command.run_live` that needs no weights and opens no --live source
    (docs/cli.md#live): those of `check_live_arguments`, then for a file (live=False) the rest of `check_run`'s; for
    a --live source the device, the checkpoint's config.json and processor, the policy's class, the budget against
    the positions and the head map (as `check_run`). Raises as `check_run`."""
    check = check_live_arguments(model, source, live=live, questions=questions, ask_at=ask_at, watch=watch, fps=fps,
                                 chunk_frames=chunk_frames, budget=budget, policy=policy, head_map=head_map,
                                 max_new_tokens=max_new_tokens, max_lag=max_lag, open_timeout=open_timeout,
                                 stall_timeout=stall_timeout, reconnect=reconnect)
    if not live:
        return check_run(model, source, ask_at=ask_at, fps=fps, chunk_frames=chunk_frames, budget=budget,
                         policy=policy, head_map=head_map, device=device, dtype=dtype, max_new_tokens=max_new_tokens)
    _check_model(check, model, device, dtype, policy)
    _check_cache(check, policy, budget, chunk_frames, head_map)
    return check


def _check_model(check: RunCheck, model: str | os.PathLike | LoadedModel, device, dtype, policy: str) -> None:
    """Into `check`: the device and dtype, the checkpoint's config.json (its heads against tp) and processor (a
    `LoadedModel`'s own); then the policy's class is imported."""
    if isinstance(model, LoadedModel):
        check.device, check.dtype = model.device, next(model.model.parameters()).dtype
        check.family, check.processor, check.config = model.family, model.processor, model.model.config
    else:
        check.device = usage(lambda: resolve_device(device) if check.tp == 1 else tp_device(device))
        check.dtype = usage(lambda: resolve_dtype(dtype, check.device))
        check.config, check.family = check_checkpoint(model)
        if check.tp > 1:
            check_tp_model(check.config, check.family, check.tp)
        check.processor = load_processor(model, check.family)
    get_policy(policy)


def _check_cache(check: RunCheck, policy: str, budget: int, chunk_frames: int,
                 head_map: str | os.PathLike | None) -> None:
    """HERMES: the budget against the model's positions; H2SVC: the head map against the model."""
    from hermes.policies.h2svc.head_map import check_head_map, load_head_map
    from hermes.window import cache_layers
    from hermes_kernels import HermesConfig

    text = check.config.get_text_config()
    if policy == "hermes":
        tokenizer = getattr(check.processor, "tokenizer", check.processor)
        prefix_len = len(tokenizer(check.family.prefix_text(None), add_special_tokens=False)["input_ids"])
        try:
            HermesConfig.preset(check.family.preset_name, len(cache_layers(check.config)), budget, prefix_len,
                                max_positions=text.max_position_embeddings)
        except ValueError as err:
            raise UsageError(f"cannot build the stream with budget={budget}, chunk_frames={chunk_frames}: "
                             f"{err}") from err
    elif head_map is not None:
        profile = load_head_map(head_map)  # an unreadable file: ValueError (status 1)
        try:
            check_head_map(profile, check.config, f"head map {os.fspath(head_map)}")
        except ValueError as err:
            raise UsageError(f"cannot build the stream with policy {policy}, chunk_frames={chunk_frames}: "
                             f"{err}") from err


def policy_kwargs(policy: str, budget: int, head_map: str | os.PathLike | None = None) -> dict:
    """HermesStream keyword arguments that select the KV-cache `policy` and its settings: the one place the CLI
    maps a policy to the stream. "hermes": its budget; "h2svc": policy="h2svc" and the head map file (None: the
    unprofiled default map, which HermesStream warns about); any other registered policy (docs/policies.md#registry):
    policy=NAME alone, the policy's own defaults. A name no policy is registered or installed under (checked without
    importing any), a head map for a policy other than H2SVC or a missing head map file is an error before anything
    loads."""
    check_policy_name(policy)
    if head_map is not None and policy != "h2svc":
        raise ValueError("head_map: only --policy h2svc takes a head map")
    if policy == "hermes":
        return {"budget": budget}
    if policy != "h2svc":
        return {"policy": policy}
    if head_map is not None and not os.path.isfile(os.fspath(head_map)):
        raise FileNotFoundError(f"head map: no such file: {os.fspath(head_map)}")
    return {"policy": policy, "head_map": None if head_map is None else os.fspath(head_map)}


def build_stream(loaded: LoadedModel, *, policy: str, budget: int, chunk_frames: int,
                 frame_size: tuple[int, int] | None, head_map: str | os.PathLike | None = None):
    """The stream for one video: HermesStream with `policy_kwargs(policy, budget, head_map)`; a configuration the
    model cannot hold (e.g. a budget past its positions, a head map of another model) is a ValueError naming the
    settings."""
    from hermes.stream import HermesStream

    kwargs = usage(lambda: policy_kwargs(policy, budget, head_map))
    settings = f"budget={budget}" if policy == "hermes" else f"policy {policy}"
    try:
        return HermesStream(loaded.model, loaded.processor, chunk_frames=chunk_frames, frame_size=frame_size,
                            **kwargs)
    except ValueError as err:
        raise UsageError(f"cannot build the stream with {settings}, chunk_frames={chunk_frames}: {err}") from err


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


def _question(question, name: str = "question") -> str:
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"{name}: expected a non-empty string, got {question!r}")
    return question.strip()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def run(model: str | os.PathLike | LoadedModel, video: str | os.PathLike, *, questions: Iterable[str] = (),
        ask_at: Sequence[str | tuple] = (), fps: float = 1.0, chunk_frames: int = 16, budget: int = 6000,
        policy: str = "hermes", head_map: str | os.PathLike | None = None,
        device: str | torch.device | None = None, dtype: str | torch.dtype = "auto",
        max_new_tokens: int = 64, on_record: Callable[[dict], None] | None = None,
        progress: bool = False, tp: int | None = None) -> list[dict]:
    """Stream `video` through `model` with HERMES (or H2SVC) and answer questions; returns the records (also passed
    to `on_record` as they come).

    model:         a checkpoint folder, or a `LoadedModel` from `load_model` (reused across videos).
    questions:     asked after the whole video, in order; any iterable, read lazily (e.g. lines from a terminal).
    ask_at:        "TIME:question" strings or (seconds, question) pairs: each asked after the first chunk whose
                   last frame is at or past TIME (after the last chunk when TIME falls after its last frame; a
                   TIME past the video's length is a UsageError).
    fps:           frames sampled per second of video, by timestamp (`hermes.video`).
    chunk_frames:  frames per chunk (the cache is sized for one chunk; fewer frames in all is a ValueError).
    budget:        visual tokens kept per layer (HERMES).
    policy:        "hermes", "h2svc" (docs/h2svc.md) or another registered name (`hermes.registry.policy_names()`,
                   built with its own defaults); head_map: an H2SVC head map file (`hermes-profile`,
                   `hermes.profile_cli`; None: the unprofiled default map, with a warning).
    device, dtype: used when `model` is a path (default: cuda if available; bfloat16 on cuda, float32 on cpu).
    progress:      a tqdm bar on stderr with each chunk's latency and the cache size.
    tp:            tensor parallelism over the N processes torchrun started (docs/multi-gpu.md#launch): every rank
                   calls `run` alike and gets the same records (cache_bytes: its own share).

    Records: {"type": "chunk", "index", "frames", "start", "end", "sources", "prepare_ms", "latency_ms",
    "compressed", "cache_length", "cache_capacity", "positions", "steps", "cache_bytes"} per chunk (times in
    seconds of video, sources the decoded-frame index of each sampled frame, prepare_ms the processor,
    latency_ms append_video: vision tower, prefill, guidance and compression; positions the smallest and
    largest RoPE position in the cache); {"type": "answer", "question", "answer", "at", "latency_ms"} per
    question, "at" being the seconds of video seen.
    """
    from tqdm import tqdm

    check = check_run(model, video, ask_at=ask_at, fps=fps, chunk_frames=chunk_frames, budget=budget, policy=policy,
                      head_map=head_map, device=device, dtype=dtype, max_new_tokens=max_new_tokens, tp=tp)
    fps = float(as_fraction(fps, "fps"))
    loaded = model if isinstance(model, LoadedModel) else load_model(model, check.device, check.dtype,
                                                                      processor=check.processor, tp=check.tp)
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
        inputs = loaded.family.prepare_frames(loaded.processor, chunk.frames, fps, start=chunk.start)
        return inputs, 1000 * (time.perf_counter() - start)

    with VideoReader(video) as reader:
        chunks = reader.chunks(fps, chunk_frames, keep=check.keep)
        first = next(chunks)  # check_run has read it once: at least one chunk of chunk_frames
        prepared = prepare(first)
        stream = build_stream(loaded, policy=policy, budget=budget, chunk_frames=chunk_frames,
                              frame_size=loaded.family.frame_size(loaded.model, prepared[0]), head_map=head_map)
        duration = reader.duration
        total = None if duration is None else -(-(int(duration * fps) + 1) // chunk_frames)
        bar = tqdm(total=total, unit="chunk", file=sys.stderr, disable=not progress, dynamic_ncols=True)
        pending = list(check.schedule)
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
    p = command_parser(
        "hermes",
        "Stream a video file through LLaVA-OneVision, Qwen2.5-VL, Qwen3-VL or Qwen3.5 with a HERMES KV cache (memory "
        "stays at the budget however long the video) or an H2SVC one (per-head frame memories) and answer questions "
        "about it.",
        ["Questions: --question ones are asked after the whole video, --ask-at ones as the stream passes their time; "
         "with neither, questions are read from stdin, one a line, until an empty line or end of input.",
         "Live video: --live SOURCE (a URL, a capture device or - for a stream on stdin) or --video FILE --realtime "
         "(the file at its own speed) is streamed as it plays, never more than --max-lag behind: late frames are "
         "dropped. Questions typed on stdin (a terminal, or --questions -) are answered while it plays; --question "
         "ones when the source ends. A source that ends, disconnects or stalls ends the run (exit status 0, a line "
         "saying why); Ctrl-C prints the summary (exit status 130).",
         "Output: answers on stdout (with --json one JSON record per chunk and per answer; live: one per event and a "
         "summary); progress on stderr. Exit status 0; 1 on an error (one line on stderr); 2 for a bad command "
         "line; 130 on Ctrl-C.",
         "Several GPUs: torchrun --nproc-per-node N -m hermes --tp N ... splits every attention's heads over N "
         "processes (tensor parallelism); the first prints, the others stay silent.",
         "Example:\n  hermes --model ./llava-onevision-qwen2-7b-ov-hf --video talk.mp4 \\\n"
         "      --ask-at 1:30:\"Who is speaking?\" --question \"Summarise the video.\""],
        "local checkpoint folder (config.json, weights, tokenizer, processor configs) of a gemma4, llava_onevision, "
        "llava_onevision1_5, minicpmv4_6, qwen2_5_vl, qwen3_vl, qwen3_5 or qwen3_5_moe model")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--video", metavar="FILE", help="video file PyAV can decode (mp4, mkv, webm, ...)")
    source.add_argument("--live", metavar="SOURCE",
                        help="live source, streamed as it plays: a URL (rtsp, rtmp, srt, udp, tcp, http, https), "
                             "/dev/videoN or - (a container stream such as MPEG-TS on stdin)")
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
    p.add_argument("--policy", default="hermes", metavar="NAME",
                   help="KV-cache policy: hermes (default), h2svc (per-head frame memories) or one an installed "
                        "package registers (docs/policies.md#registry)")
    p.add_argument("--head-map", metavar="PATH", default=None,
                   help="--policy h2svc: head map from hermes-profile (checked against "
                        "the model); default: the unprofiled depth-order map, with a warning")
    p.add_argument("--max-new-tokens", type=int, default=64, help="longest answer in tokens (default 64)")
    p.add_argument("--tp", type=int, default=None, metavar="N",
                   help="tensor parallelism over the N processes torchrun started (torchrun --nproc-per-node N -m "
                        "hermes --tp N ...): each holds 1/N of every layer's heads; N must divide the KV heads")
    p.add_argument("--json", action="store_true",
                   help="one JSON record per line on stdout: {\"type\": \"chunk\", ...} per chunk, "
                        "{\"type\": \"answer\", ...} per answer (live: every event, then {\"type\": "
                        "\"summary\", ...})")
    live = p.add_argument_group("live video (--live SOURCE, or --video FILE --realtime)")
    live.add_argument("--realtime", action="store_true",
                      help="play the --video file at its own speed, as a camera would")
    live.add_argument("--max-lag", type=float, default=None, metavar="S",
                      help="seconds a sampled frame may wait before it is encoded; later ones are dropped "
                           "(default: one chunk's duration, chunk-frames / fps)")
    live.add_argument("--open-timeout", type=float, default=None, metavar="S",
                      help="--live: seconds to open the source (default 10)")
    live.add_argument("--stall-timeout", type=float, default=None, metavar="S",
                      help="--live: seconds without a frame before the source counts as stalled and ends "
                           "(default 10)")
    live.add_argument("--reconnect", type=int, default=None, metavar="N",
                      help="--live URL: reopen a source that ended, disconnected or stalled up to N times, keeping "
                           "the cache (default 0)")
    live.add_argument("--questions", choices=("-",), default=None, metavar="-",
                      help="questions typed on stdin, one a line, answered while the source plays (the default "
                           "when stdin is a terminal and the source is not -)")
    live.add_argument("--watch", metavar="TEXT", default=None,
                      help="question re-asked after every chunk; its answer is printed when it changes")
    live.add_argument("--verbose", action="store_true",
                      help="a line per chunk on stderr (video time, lag, drops, ms per stage, cache length) instead "
                           "of the progress line")
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


# options of a live run (argparse names), and those of them a --live source alone takes
LIVE_OPTIONS = ("max_lag", "questions", "watch", "verbose", "open_timeout", "stall_timeout", "reconnect")
SOURCE_OPTIONS = ("open_timeout", "stall_timeout", "reconnect")


def check_live_options(args: argparse.Namespace) -> None:
    """The live options against the run the command line asks for: --realtime with --live, an option of a live run
    without one, an option of a --live source with a file, --questions - with the stream on stdin; a UsageError
    naming the option."""
    if args.realtime and args.live is not None:
        raise UsageError("realtime: --realtime plays a --video file at its own speed; a --live source sets its own")
    for name in LIVE_OPTIONS:
        if getattr(args, name) in (None, False):
            continue
        option = "--" + name.replace("_", "-")
        if args.live is None and not args.realtime:
            raise UsageError(f"{name}: {option} is for a live run: --live SOURCE, or --video FILE --realtime")
        if name in SOURCE_OPTIONS and args.live is None:
            raise UsageError(f"{name}: {option} is for a --live source, not a --video file")
    if args.questions == "-" and args.live == "-":
        raise UsageError("questions: --questions - reads stdin, which carries the --live - stream")


def main(argv: Sequence[str] | None = None) -> int:
    """The command: parse, `run` (or `hermes.live.command.run_live` for --live or --realtime), print; returns the
    exit status."""
    args = parser().parse_args(argv)
    if args.live is not None or args.realtime:
        return _main_live(args)
    # under torchrun every rank runs the same calls; the first prints, the others are silent
    rank = int(os.environ.get("RANK", "0")) if (args.tp or 1) > 1 else 0

    def check() -> None:
        check_live_options(args)
        if (args.tp or 1) > 1 and not (args.question or args.ask_at):
            raise UsageError("question: under --tp pass the questions with --question or --ask-at (standard input "
                             "reaches one process only)")
        check_arguments(args.model, args.video, ask_at=args.ask_at, fps=args.fps, chunk_frames=args.chunk_frames,
                        budget=args.budget, policy=args.policy, head_map=args.head_map,
                        max_new_tokens=args.max_new_tokens, tp=args.tp)

    def body() -> None:
        questions = args.question or (terminal_questions() if not args.ask_at else ())
        run(args.model, args.video, questions=questions, ask_at=args.ask_at, fps=args.fps,
            chunk_frames=args.chunk_frames, budget=args.budget, policy=args.policy, head_map=args.head_map,
            device=args.device, dtype=args.dtype, max_new_tokens=args.max_new_tokens,
            on_record=(lambda record: _print_record(record, args.json)) if rank == 0 else None,
            progress=not args.quiet and rank == 0, tp=args.tp)

    return run_main(args, body, rank, check)


def _main_live(args: argparse.Namespace) -> int:
    """The command for a live run (docs/cli.md#live): checked by `check_live_options` and `check_live_arguments`
    before anything heavy loads, run by `hermes.live.command.run_live`, printed by its `LivePrinter`."""
    source = args.video if args.live is None else args.live
    given = {name: getattr(args, name) for name in ("max_lag", "open_timeout", "stall_timeout", "reconnect")
             if getattr(args, name) is not None}  # an option left out takes run_live's default
    settings = dict(live=args.live is not None, questions=args.question, ask_at=args.ask_at, watch=args.watch,
                    fps=args.fps, chunk_frames=args.chunk_frames, budget=args.budget, policy=args.policy,
                    head_map=args.head_map, max_new_tokens=args.max_new_tokens, **given)
    # typed questions: asked for, or a terminal on stdin while stdin does not carry the stream
    typed = args.questions == "-" or (args.live != "-" and sys.stdin is not None and sys.stdin.isatty())

    def check() -> None:
        check_live_options(args)
        check_live_arguments(args.model, source, **settings, tp=args.tp)

    def body() -> None:
        from hermes.live.command import LivePrinter, run_live

        printer = LivePrinter(as_json=args.json, verbose=args.verbose, progress=not args.quiet)
        run_live(args.model, source, **settings, typed=sys.stdin if typed else None, device=args.device,
                 dtype=args.dtype, on_record=printer.record)

    return run_main(args, body, 0, check)

"""`hermes-profile`: profile a checkpoint's attention heads on sample videos and write the H2SVC head map
(`hermes.policies.h2svc.profile` does the profiling; docs/cli.md#profiling-heads-for-h2svc). The parser scaffold and
the error contract are the `hermes` command's (`hermes.commands`). The profiler, torch and transformers are imported
once the command line parsed (`main`), so --help and a bad option answer at once."""
from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Sequence

from hermes.commands import UsageError, check_checkpoint, command_parser, load_model, resolve_device, run_main, usage

if TYPE_CHECKING:
    from hermes.policies.h2svc.head_map import HeadProfile

# the profiler's default question (`hermes.policies.h2svc.profile.DEFAULT_QUESTIONS`, which imports torch), for --help
DEFAULT_QUESTION = "What is happening in the video?"


def parser():
    p = command_parser(
        "hermes-profile",
        "Profile the attention heads of a LLaVA-OneVision, Qwen2.5-VL, Qwen3-VL or Qwen3.5 checkpoint on sample videos "
        "(eager attention, docs/h2svc.md §2; a hybrid model's full-attention layers) and write the H2SVC head map: "
        "every (layer, KV head) routed to the instant, short or episodic memory.",
        ["Output: the JSON head map at --out (model name and type, layers, KV heads, ratios, the class of every head, "
         "TAD_V2V / TAD_T2V / S per head, the clips used); a summary on stdout; progress on stderr. Exit status 0; 1 "
         "on an error (one line on stderr); 2 for a bad command line.",
         "Example:\n  hermes-profile --model ./llava-onevision-qwen2-7b-ov-hf \\\n"
         "      --videos clips/*.mp4 --max-frames 64 --out llava-ov-7b.h2svc.json"],
        "local checkpoint folder of a gemma4, llava_onevision, llava_onevision1_5, minicpmv4_6, qwen2_5_vl, qwen3_vl, "
        "qwen3_5 or qwen3_5_moe model")
    p.add_argument("--videos", required=True, nargs="+", metavar="FILE",
                   help="sample video files PyAV can decode (each one clip)")
    p.add_argument("--out", required=True, metavar="FILE", help="where to write the head map (JSON)")
    p.add_argument("--fps", type=float, default=1.0, help="frames sampled per second of video (default 1)")
    p.add_argument("--chunk-frames", type=int, default=16, help="frames per forward, as the stream's chunks "
                                                                "(default 16)")
    p.add_argument("--max-frames", type=int, default=None,
                   help="at most this many sampled frames per clip (default: the whole clip; attention costs "
                        "grow with the square of the clip's tokens)")
    p.add_argument("--question", action="append", default=None, metavar="TEXT",
                   help=f"question asked after each clip, the text queries of TAD_T2V (repeatable; default "
                        f"{DEFAULT_QUESTION!r})")
    p.add_argument("--answer-tokens", type=int, default=0,
                   help="greedy answer tokens fed back as more text queries (default 0)")
    p.add_argument("--instant-ratio", type=float, default=0.1, help="share of instant heads (default 0.1)")
    p.add_argument("--short-ratio", type=float, default=0.4, help="share of short heads (default 0.4); episodic "
                                                                  "heads are the rest")
    p.add_argument("--tp", type=int, default=None, metavar="N",
                   help="refused: the profiler runs in one process (it ranks every head of every layer together)")
    return p


def summary(profile: HeadProfile, path: str) -> str:
    """What the command prints: the file, the model, the class counts, then one line per layer with a letter
    per KV head (i instant, s short, e episodic)."""
    from hermes_kernels.policies.h2svc.config import CLASS_NAMES

    counts = ", ".join(f"{name} {count}" for name, count in zip(CLASS_NAMES, profile.counts()))
    frames = sum(clip["frames"] for clip in profile.clips)
    lines = [f"wrote {path}: {profile.model_type} ({profile.model_name or 'unnamed'}), {profile.num_layers} layers "
             f"x {profile.num_kv_heads} KV heads, {len(profile.clips)} clip(s), {frames} frames; {counts}"]
    width = len(str(profile.num_layers - 1))
    for layer, row in enumerate(profile.head_map.tolist()):
        lines.append(f"layer {layer:>{width}}: " + " ".join(CLASS_NAMES[c][0] for c in row))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """The command: parse, check the inputs, load, profile, write; returns the exit status."""
    args = parser().parse_args(argv)

    def body() -> None:
        from hermes.policies.h2svc.head_map import save_head_map
        from hermes.policies.h2svc.profile import DEFAULT_QUESTIONS, check_settings, profile_heads
        from hermes.video import VideoClip

        questions = args.question or DEFAULT_QUESTIONS
        if (args.tp or 1) > 1 or int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise UsageError("tp: hermes-profile runs in one process (it ranks every head of every layer together); "
                             "run it without torchrun and without --tp")
        usage(lambda: resolve_device(args.device))
        check_checkpoint(args.model)
        settings = dict(fps=args.fps, chunk_frames=args.chunk_frames, questions=questions,
                        instant_ratio=args.instant_ratio, short_ratio=args.short_ratio, max_frames=args.max_frames,
                        answer_tokens=args.answer_tokens)
        usage(lambda: check_settings(**settings))
        clips = [VideoClip(path) for path in args.videos]  # FileNotFoundError / ValueError "video: ..."
        folder = os.path.dirname(os.path.abspath(args.out))
        if not os.path.isdir(folder):
            raise FileNotFoundError(f"out: no such folder: {folder}")
        loaded = load_model(args.model, args.device, args.dtype)
        profile = profile_heads(loaded.model, loaded.processor, clips, fps=args.fps,
                                chunk_frames=args.chunk_frames, questions=questions,
                                instant_ratio=args.instant_ratio, short_ratio=args.short_ratio,
                                max_frames=args.max_frames, answer_tokens=args.answer_tokens,
                                progress=not args.quiet)
        save_head_map(profile, args.out)
        print(summary(profile, args.out))

    return run_main(args, body)


if __name__ == "__main__":
    sys.exit(main())

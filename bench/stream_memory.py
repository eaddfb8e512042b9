"""Cache bytes of one 512 s stream at the 7B/8B shapes, full cache vs HERMES vs H2SVC (cheap arithmetic: printed by
every `python -m bench`, --quick included).

What is counted: the fp16 keys and values of one stream, 2 (K, V) x D x 2 bytes per token per (layer, KV head);
not counted: positions (8 bytes per token and axis), H2SVC's slot tables and fp32 episodic features, model
weights, activations and allocator slack. Frames: LLaVA-OV samples one H2SVC frame per video frame (196 tokens at
384 px); Qwen2.5-VL one per temporal grid step of 2 sampled frames (196 tokens at 392 px), so at the same fps it
has half the frames and its H2SVC windows span twice the time; Qwen3-VL likewise (196 visual tokens at 448 px, 32 px
a merged token) plus the step's text, QWEN3_TEXT_PER_STEP tokens (docs/qwen3_vl.md). P = 14 prefix tokens.

    full     L·Hkv·(P + n·T_f)                      every frame of the stream kept (n = frames of 512 s)
    hermes   L·Hkv·(P + b), b = 6000                retained between chunks (`HermesCache`)
    h2svc    Σ_c H_c·(P + W_c·T_f)                  retained: default ratios, map and windows 4 / 16 / 64 frames
  allocated (what the caches reserve, flat for any stream length), with a 16-video-frame chunk and room 512:
    hermes   L·Hkv·(P + b + chunk + room)
    h2svc    Σ_c H_c·capacity_c, capacity_c = P + (W_c + F_max)·T_f + room     (`hermes.policies.h2svc.cache`)
"""
from __future__ import annotations

import math

import torch

from hermes_kernels.policies.h2svc.config import CLASS_NAMES
from hermes.policies.h2svc.blocks import class_capacity

from .shapes import PREFIX_LEN, TOKENS_PER_FRAME, get_shape
from .stages import cache_bytes

SECONDS = 512
FPS = (0.5, 1.0)
MODELS = ("llava-ov-7b", "qwen2.5-vl-7b", "qwen3-vl-8b")
CHUNK_VIDEO_FRAMES = 16
ROOM = 512
BUDGET = 6000
DTYPE = torch.float16
# <|vision_start|>, <|vision_end|> and the 10 tokens of "<00012.5 seconds>": Qwen's tokenizers give every digit a
# token of its own ("<", 5 digits, ".", 1 digit, " seconds", ">"; an estimate, not read from a released tokenizer)
QWEN3_TEXT_PER_STEP = 12


def frame_tokens(name: str) -> int:
    """T_f of a shape: TOKENS_PER_FRAME visual tokens, Qwen3-VL's and Qwen3.5's with their step's text."""
    return TOKENS_PER_FRAME + (QWEN3_TEXT_PER_STEP if get_shape(name).preset_name in ("qwen3_vl", "qwen3_5") else 0)


def memory_frames(name: str, seconds: float, fps: float) -> int:
    """H2SVC frames of a stream: sampled video frames (LLaVA-OV), temporal grid steps of 2 (Qwen-VL)."""
    video = math.floor(seconds * fps)
    return -(-video // 2) if get_shape(name).geometry.mrope else video


def stream_bytes(name: str, seconds: float = SECONDS, fps: float = 1.0) -> dict[str, int]:
    """K+V bytes of one stream of `seconds` at `fps` (module docstring): full, hermes, h2svc (retained) and
    hermes_allocated, h2svc_allocated."""
    shape = get_shape(name)
    per_token = 2 * shape.geometry.head_dim * DTYPE.itemsize
    heads = shape.geometry.num_layers * shape.geometry.num_kv_heads
    P, T_f = PREFIX_LEN, frame_tokens(name)
    frames = memory_frames(name, seconds, fps)
    chunk_frames = memory_frames(name, CHUNK_VIDEO_FRAMES, 1.0)
    retained = cache_bytes(shape, DTYPE, P, T_f, chunk_frames=chunk_frames, budget=BUDGET)
    cfg = shape.h2svc_config(P, T_f)
    allocated = sum(cfg.num_rows(c) * class_capacity(cfg, c, chunk_frames, ROOM) for c in range(len(CLASS_NAMES)))
    return {"frames": frames, "full": heads * (P + frames * T_f) * per_token,
            "hermes": retained[f"hermes b={BUDGET}"][0], "h2svc": retained["h2svc"][0],
            "hermes_allocated": heads * (P + BUDGET + chunk_frames * T_f + ROOM) * per_token,
            "h2svc_allocated": allocated * per_token}


def report() -> str:
    """The table: one row per model and fps, GB = 1e9 bytes."""
    gb = 1e9
    lines = [f"KV cache of one {SECONDS} s stream, fp16 K+V only (no positions, weights or activations), "
             f"prefix {PREFIX_LEN}, {TOKENS_PER_FRAME} visual tokens per frame (Qwen3-VL: + {QWEN3_TEXT_PER_STEP} of "
             f"text); allocated: with a {CHUNK_VIDEO_FRAMES}-frame chunk and {ROOM} slots of room",
             f"  {'model':<14} {'fps':>4} {'frames':>6} {'full GB':>8} {'HERMES b=6000':>14} {'H2SVC':>7} "
             f"{'H2SVC/full':>10} {'alloc HERMES':>13} {'alloc H2SVC':>12}"]
    for name in MODELS:
        for fps in FPS:
            b = stream_bytes(name, SECONDS, fps)
            lines.append(f"  {name:<14} {fps:>4} {b['frames']:>6} {b['full'] / gb:>8.2f} {b['hermes'] / gb:>14.3f} "
                         f"{b['h2svc'] / gb:>7.3f} {b['h2svc'] / b['full']:>10.3f} "
                         f"{b['hermes_allocated'] / gb:>13.3f} {b['h2svc_allocated'] / gb:>12.3f}")
    lines.append("  seed (H800, 512 s): 76.2 GB full vs 19.0 GB H2SVC as whole-GPU memory: both include the ~16 GB of "
                 "bf16 7B weights and the activations; without the weights ~60 vs ~3 GB, ~10x our full cache at 1 fps "
                 "(its fps and resolution are unstated) and ~5x our H2SVC (the rest: activations and whatever its "
                 "implementation keeps, unstated)")
    return "\n".join(lines)

"""Memory of one 512 s stream at the real shapes: uncompressed K/V, the HERMES and H2SVC caches as their policies
allocate them, a hybrid's linear-attention state and a sliding-window model's windows (cheap arithmetic, no timing:
printed by every `python -m bench`, --quick and --full included).

The frame assumptions (`FRAME_PIXELS`, `TEXT_PER_STEP`), what is counted and the formulas:
docs/benchmarks.md#memory-of-a-512-s-stream. `build_cache` makes a policy's cache on the meta device with the
arguments its `StreamPolicy` passes; tests/bench/test_stream_memory.py holds the formulas to it and to real caches.
"""
from __future__ import annotations

import dataclasses
import math

import torch
from transformers import Gemma4TextConfig

from hermes.cache import StreamCacheBase
from hermes.policies.h2svc.cache import H2SVCCache
from hermes.policies.hermes.cache import HermesCache
from hermes.window import SLIDING, kv_sources
from hermes_kernels.policies.h2svc.config import CLASS_NAMES
from hermes_kernels.rope import RotaryLayout

from .shapes import LINEAR_STATES, PREFIX_LEN, TOKENS_PER_FRAME, ModelShape, get_shape
from .stages import cache_bytes

SECONDS = 512
FPS = (0.5, 1.0)
MODELS = ("llava-ov-7b", "qwen2.5-vl-7b", "qwen3-vl-8b", "qwen3.5", "gemma4")
CHUNK_VIDEO_FRAMES = 16     # HermesStream's default chunk_frames
ROOM = 512                  # HermesStream's default room
BUDGET = 6000               # HermesStream's default budget
DTYPE = torch.bfloat16      # the released checkpoints' dtype: K/V and the linear layers' conv state
LINEAR_COPIES = 2           # a hybrid stream keeps each linear state twice: the committed state and a working copy
POSITION_BYTES = torch.int64.itemsize
# Square frames: (side in pixels, pixels per merged token = patch size x spatial merge) of the Qwen shapes, whose
# token count follows the frame size. LLaVA-OV-7B: 384 px SigLIP frames, 27 x 27 patches pooled to 14 x 14 = 196.
FRAME_PIXELS = {"qwen2.5-vl-7b": (392, 14 * 2), "qwen3-vl-8b": (448, 16 * 2), "qwen3.5": (448, 16 * 2),
                "gemma4": (384, 16 * 3)}
# Gemma 4: Gemma4VideoProcessor's default max_soft_tokens 70 fits a square frame of any size to 24 x 24 patches of 16
# px, 8 x 8 = 64 soft tokens after its 3 x 3 pooling (a 384 px side of 16 · 3 px per token)
# Text tokens of every temporal step of the timestamped families: <|vision_start|>, <|vision_end|> and the 10 tokens
# of "<00012.5 seconds>" (Qwen's tokenizers give every digit a token of its own; an estimate, not read from a
# released tokenizer)
TEXT_PER_STEP = {"qwen3-vl-8b": 12, "qwen3.5": 12, "gemma4": 9}
# Gemma 4's 9: " mm:ss " as 7 tokens (digits one each) and <|image>, <image|> (an estimate, as above)


@dataclasses.dataclass(frozen=True)
class WindowShape:
    """The sliding-window layers of a model: `layers` that compute their own keys (KV-shared ones hold none), their
    KV heads and head dim, and the window W (a query sees W - 1 keys before itself)."""

    layers: int
    kv_heads: int
    head_dim: int
    window: int

    @classmethod
    def from_config(cls, text_config) -> "WindowShape":
        """Read from a text config with `layer_types`, `sliding_window`, `num_kv_shared_layers` and per-layer head
        geometry (Gemma 4: `per_layer_config`)."""
        kinds = text_config.layer_types
        sources = kv_sources(kinds, text_config.num_kv_shared_layers or 0)
        own = [i for i, kind in enumerate(kinds) if kind == SLIDING and sources[i] == i]
        layer = text_config.per_layer_config[own[0]]
        return cls(layers=len(own), kv_heads=layer.num_key_value_heads, head_dim=layer.head_dim,
                   window=text_config.sliding_window)

    def nbytes(self, slots: int, dtype: torch.dtype) -> int:
        """K+V of `slots` tokens in every sliding layer of one stream."""
        return self.layers * self.kv_heads * slots * 2 * self.head_dim * dtype.itemsize


# The sliding-window part of the windowed shapes, by shape name: transformers 5.25's default Gemma4TextConfig (25 of
# its 30 layers, 4 KV heads of 256, a 512-token window)
WINDOWS: dict[str, WindowShape] = {"gemma4": WindowShape.from_config(Gemma4TextConfig())}


def frame_tokens(name: str) -> int:
    """T_f of a shape: its visual tokens per H2SVC frame (`FRAME_PIXELS`, else 196) plus its step's text."""
    side, per_token = FRAME_PIXELS.get(name, (None, None))
    visual = TOKENS_PER_FRAME if side is None else (side // per_token) ** 2
    return visual + TEXT_PER_STEP.get(name, 0)


def memory_frames(name: str, seconds: float, fps: float) -> int:
    """H2SVC frames of a stream: sampled video frames (LLaVA-OV), temporal grid steps of 2 (Qwen-VL)."""
    video = math.floor(seconds * fps)
    return -(-video // 2) if get_shape(name).geometry.mrope else video


def hermes_nbytes(shape: ModelShape, *, tokens_per_frame: int, chunk_frames: int, budget: int = BUDGET,
                  room: int = ROOM, dtype: torch.dtype = DTYPE, prefix_len: int = PREFIX_LEN,
                  batch_size: int = 1) -> int:
    """`HermesCache.nbytes()`: per layer and stream, capacity C = P + budget + chunk_frames·T_f + room slots of K
    and V [Hkv, C, D] in `dtype`, positions int64 [(3,) C] and the guidance scores float32 [C]."""
    g = shape.geometry
    capacity = prefix_len + budget + chunk_frames * tokens_per_frame + room
    per_slot = 2 * g.num_kv_heads * g.head_dim * dtype.itemsize + (3 if g.mrope else 1) * POSITION_BYTES + 4
    return g.num_layers * batch_size * capacity * per_slot


def h2svc_nbytes(shape: ModelShape, *, tokens_per_frame: int, chunk_frames: int, room: int = ROOM,
                 dtype: torch.dtype = DTYPE, prefix_len: int = PREFIX_LEN, batch_size: int = 1) -> int:
    """`H2SVCCache.nbytes()`: for each class c (H_c rows of the default ratios and map, window W_c frames) and stream,
    capacity_c = P + (W_c + chunk_frames)·T_f + room slots of K and V [H_c, capacity_c, D] in `dtype`, positions
    int64 [H_c, (3,) capacity_c], slot frames int64 [H_c, W_c]; the episodic class adds its frame features float32
    [H_e, W_e, D]."""
    g = shape.geometry
    cfg = shape.h2svc_config(prefix_len, tokens_per_frame)
    per_slot = 2 * g.head_dim * dtype.itemsize + (3 if g.mrope else 1) * POSITION_BYTES
    total = 0
    for c, name in enumerate(CLASS_NAMES):
        rows, window = cfg.num_rows(c), cfg.window(c)
        capacity = prefix_len + (window + chunk_frames) * tokens_per_frame + room
        features = window * g.head_dim * torch.float32.itemsize if name == "episodic" else 0
        total += rows * (capacity * per_slot + window * POSITION_BYTES + features)
    return batch_size * total


def build_cache(policy: str, shape: ModelShape, *, tokens_per_frame: int, chunk_frames: int, budget: int = BUDGET,
                room: int = ROOM, dtype: torch.dtype = DTYPE, prefix_len: int = PREFIX_LEN, batch_size: int = 1,
                device: torch.device | str = "meta") -> StreamCacheBase:
    """The cache of `policy` ("hermes" | "h2svc") at `shape` with the arguments its `StreamPolicy` passes
    (hermes.policies.*.policy) for chunks of `chunk_frames` H2SVC frames of `tokens_per_frame` tokens; on `device`
    (meta: nothing is allocated, `nbytes()` still counts every buffer)."""
    g = shape.geometry
    inv_freq = torch.ones(RotaryLayout.of(g.rotary, g.head_dim // 2).pairs, device=device)
    if policy == "hermes":
        return HermesCache(shape.config(budget, prefix_len), batch_size=batch_size, num_kv_heads=g.num_kv_heads,
                           head_dim=g.head_dim, capacity=prefix_len + budget + chunk_frames * tokens_per_frame + room,
                           dtype=dtype, inv_freq=inv_freq, rotary=g.rotary)
    if policy == "h2svc":
        return H2SVCCache(shape.h2svc_config(prefix_len, tokens_per_frame), batch_size=batch_size,
                          num_heads=g.num_heads, head_dim=g.head_dim, chunk_frames=chunk_frames, room=room,
                          dtype=dtype, inv_freq=inv_freq, rotary=g.rotary)
    raise ValueError(f"policy: expected 'hermes' or 'h2svc', got {policy!r}")


def linear_bytes(name: str) -> int:
    """One copy of the linear-attention layers' state of one stream at shape `name` (0 for a model without any)."""
    state = LINEAR_STATES.get(name)
    return 0 if state is None else state.nbytes(DTYPE)


def window_bytes(name: str, slots: int) -> int:
    """K+V of `slots` tokens in the sliding-window layers of one stream at shape `name` (0 for a model without)."""
    window = WINDOWS.get(name)
    return 0 if window is None else window.nbytes(slots, DTYPE)


def stream_bytes(name: str, seconds: float = SECONDS, fps: float = 1.0) -> dict[str, int]:
    """Bytes of one stream of `seconds` at `fps`: `full` (K+V of every full-attention layer, every token), `hermes`
    and `h2svc` (K+V retained between chunks), `hermes_allocated` and `h2svc_allocated` (the caches' nbytes at
    the defaults), `linear` (one copy of the linear-attention state), `window` (the sliding layers' W - 1 tokens,
    what transformers' cache keeps of them), `window_allocated` (the rings a stream allocates: W - 1 + max(chunk,
    room) slots) and `frames`."""
    shape = get_shape(name)
    g = shape.geometry
    P, T_f = PREFIX_LEN, frame_tokens(name)
    frames = memory_frames(name, seconds, fps)
    chunk_frames = memory_frames(name, CHUNK_VIDEO_FRAMES, 1.0)
    retained = cache_bytes(shape, DTYPE, P, T_f, chunk_frames=chunk_frames, budget=BUDGET)
    sizes = dict(tokens_per_frame=T_f, chunk_frames=chunk_frames)
    return {"frames": frames,
            "full": g.num_layers * g.num_kv_heads * (P + frames * T_f) * 2 * g.head_dim * DTYPE.itemsize,
            "hermes": retained[f"hermes b={BUDGET}"][0], "h2svc": retained["h2svc"][0],
            "hermes_allocated": hermes_nbytes(shape, **sizes), "h2svc_allocated": h2svc_nbytes(shape, **sizes),
            "linear": linear_bytes(name), "window": window_bytes(name, _window(name) - 1),
            "window_allocated": window_bytes(name, _window(name) - 1 + max(chunk_frames * T_f, ROOM))}


def _window(name: str) -> int:
    window = WINDOWS.get(name)
    return 1 if window is None else window.window


def totals(sizes: dict[str, int]) -> dict[str, int]:
    """What one stream holds in all: uncompressed (K/V, the one linear state and the windows a transformers cache
    keeps), HERMES and H2SVC (their caches, LINEAR_COPIES linear states and the rings)."""
    return {"full": sizes["full"] + sizes["linear"] + sizes["window"],
            "hermes": sizes["hermes_allocated"] + LINEAR_COPIES * sizes["linear"] + sizes["window_allocated"],
            "h2svc": sizes["h2svc_allocated"] + LINEAR_COPIES * sizes["linear"] + sizes["window_allocated"]}


def report() -> str:
    """The table: one row per model and fps, GB = 1e9 bytes; then how the hybrid's saving and ours compose."""
    gb = 1e9
    lines = [f"Memory of one {SECONDS} s stream, {str(DTYPE).removeprefix('torch.')} (GB = 1e9 B; no weights or "
             f"activations), prefix {PREFIX_LEN}, T_f tokens per H2SVC frame; full: K+V of every full-attention "
             "layer, every token",
             f"  kept: K+V held between chunks (HERMES b={BUDGET}; H2SVC windows 4/16/64 frames, default ratios); "
             f"alloc: the cache's nbytes with a {CHUNK_VIDEO_FRAMES}-video-frame chunk and {ROOM} slots of room",
             f"  linear: the linear-attention layers' conv + recurrent state x{LINEAR_COPIES} (committed + working "
             "copy); window: the sliding-window layers, W - 1 tokens (sliding-only: what transformers' cache keeps "
             "of them) / the rings a stream allocates (W - 1 + max(chunk, room) slots)",
             "  total: full + one linear state + windows (what transformers' cache keeps), alloc + linear x2 + rings",
             f"  {'model':<14} {'layers':>6} {'fps':>4} {'frames':>6} {'T_f':>4} {'full':>6} |{'kept HERMES':>12} "
             f"{'H2SVC':>6} |{'alloc HERMES':>13} {'H2SVC':>6} {'linear':>7} {'window':>13} |{'total full':>11} "
             f"{'HERMES':>7} {'H2SVC':>6}"]
    for name in MODELS:
        state, window = LINEAR_STATES.get(name), WINDOWS.get(name)
        full_layers = get_shape(name).geometry.num_layers
        others = (state.num_layers if state else 0) + (window.layers if window else 0)
        layers = f"{full_layers}/{full_layers + others}"
        for fps in FPS:
            b = stream_bytes(name, SECONDS, fps)
            t = totals(b)
            lines.append(f"  {name:<14} {layers:>6} {fps:>4} {b['frames']:>6} {frame_tokens(name):>4} "
                         f"{b['full'] / gb:>6.2f} |{b['hermes'] / gb:>12.3f} {b['h2svc'] / gb:>6.3f} |"
                         f"{b['hermes_allocated'] / gb:>13.3f} {b['h2svc_allocated'] / gb:>6.3f} "
                         f"{LINEAR_COPIES * b['linear'] / gb:>7.3f} "
                         f"{b['window'] / gb:>6.3f}/{b['window_allocated'] / gb:>6.3f} |{t['full'] / gb:>11.2f} "
                         f"{t['hermes'] / gb:>7.3f} {t['h2svc'] / gb:>6.3f}")
    hybrid, dense = totals(stream_bytes("qwen3.5")), totals(stream_bytes("qwen2.5-vl-7b"))
    full_layers = get_shape("qwen3.5").geometry.num_layers
    lines.append(f"  at 1 fps, qwen3.5 against qwen2.5-vl-7b uncompressed ({dense['full'] / gb:.2f} GB): uncompressed "
                 f"x{hybrid['full'] / dense['full']:.2f} ({full_layers} of "
                 f"{full_layers + LINEAR_STATES['qwen3.5'].num_layers} layers hold tokens), HERMES "
                 f"x{hybrid['hermes'] / dense['full']:.3f}, H2SVC x{hybrid['h2svc'] / dense['full']:.3f}")
    lines.append("  seed (H800, 512 s): 76.2 GB full vs 19.0 GB H2SVC as whole-GPU memory: both include the ~16 GB of "
                 "bf16 7B weights and the activations; without the weights ~60 vs ~3 GB, ~10x our full cache at 1 fps "
                 "(its fps and resolution are unstated) and ~5x our H2SVC (the rest: activations and whatever its "
                 "implementation keeps, unstated)")
    return "\n".join(lines)

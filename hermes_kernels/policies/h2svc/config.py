"""H2SVC configuration: the class windows, the class ratios and the head map in one frozen dataclass, plus presets.

docs/h2svc.md §1–2, §4 and the engine interface, docs/h2svc.md §7. Every (layer, KV head) belongs to one class: INSTANT
(FIFO over the newest W_s frames), SHORT (FIFO over W_w frames) or EPISODIC (STCE over N_e frames). The rows of
one class are stacked in (layer, head) order; `class_rows`, `layer_rows` and `heads_of` say which row is which.
"""
from __future__ import annotations

import dataclasses
import math
from fractions import Fraction
from typing import ClassVar, Sequence

import torch

from ...engine.checks import REINDEX_MODES

INSTANT, SHORT, EPISODIC = 0, 1, 2
CLASS_NAMES = ("instant", "short", "episodic")


def class_id(cls, name: str = "cls") -> int:
    """The class as an int (INSTANT / SHORT / EPISODIC) from the int or its name; ValueError/TypeError naming
    the argument `name` otherwise."""
    if isinstance(cls, str):
        if cls not in CLASS_NAMES:
            raise ValueError(f"{name}: expected one of {CLASS_NAMES} or 0/1/2, got {cls!r}")
        return CLASS_NAMES.index(cls)
    if not isinstance(cls, int) or isinstance(cls, bool):
        raise TypeError(f"{name}: expected a class int (INSTANT=0, SHORT=1, EPISODIC=2) or its name, "
                        f"got {type(cls).__name__}")
    if cls not in (INSTANT, SHORT, EPISODIC):
        raise ValueError(f"{name}: expected INSTANT=0, SHORT=1 or EPISODIC=2, got {cls}")
    return cls


def _decimal(ratio: float) -> Fraction:
    # (ours) a ratio counts as the decimal it prints as, so floor(0.1·H + ½) is exact: in binary floating point
    # 0.1·H + ½ can land a hair below an integer it should reach
    return Fraction(repr(float(ratio)))


def class_counts(num_heads: int, instant_ratio: float = 0.1, short_ratio: float = 0.4) -> tuple[int, int, int]:
    """(n_i, n_s, n_e) for H = num_heads heads (docs/h2svc.md §2):

    n_i = ⌊r_i·H + ½⌋,  n_s = ⌊(r_i + r_s)·H + ½⌋ − n_i,  n_e = H − n_i − n_s
    (with the default ratios n_s = ⌊0.5·H + ½⌋ − n_i). Ratios must lie in [0, 1] with r_i + r_s ≤ 1.
    """
    if not isinstance(num_heads, int) or isinstance(num_heads, bool) or num_heads < 1:
        raise ValueError(f"num_heads: expected an int >= 1, got {num_heads!r}")
    for name, ratio in (("instant_ratio", instant_ratio), ("short_ratio", short_ratio)):
        if not isinstance(ratio, (int, float)) or isinstance(ratio, bool) or not 0.0 <= ratio <= 1.0:
            raise ValueError(f"{name}: expected a number in [0, 1], got {ratio!r}")
    r_i, r_s = _decimal(instant_ratio), _decimal(short_ratio)
    if r_i + r_s > 1:
        raise ValueError(f"short_ratio: instant_ratio + short_ratio must be <= 1, got {instant_ratio} + {short_ratio}")
    half = Fraction(1, 2)
    n_i = math.floor(r_i * num_heads + half)
    n_s = math.floor((r_i + r_s) * num_heads + half) - n_i
    return n_i, n_s, num_heads - n_i - n_s


def default_head_map(num_layers: int, num_kv_heads: int, instant_ratio: float = 0.1,
                     short_ratio: float = 0.4) -> torch.Tensor:
    """The unprofiled head map, int64 [L, Hkv] (ours): the paper's depth order (its flowchart puts instant heads
    at the bottom, short in the middle, episodic at the top), i.e. `classify_heads` with score = layer index:
    heads in (layer, head) order, the first n_i instant, the next n_s short, the rest episodic (`class_counts`).
    """
    n_i, n_s, n_e = class_counts(num_layers * num_kv_heads, instant_ratio, short_ratio)
    flat = torch.tensor([INSTANT] * n_i + [SHORT] * n_s + [EPISODIC] * n_e, dtype=torch.int64)
    return flat.view(num_layers, num_kv_heads)


def _normalise_head_map(head_map, num_layers: int, num_kv_heads: int) -> tuple[tuple[int, ...], ...]:
    """head_map ([L, Hkv] int tensor or nested sequence of class ints) as a tuple of tuples (hashable)."""
    def refuse(why: str) -> None:
        raise ValueError(f"H2SVCConfig.head_map: {why} (got {head_map!r})")

    if isinstance(head_map, torch.Tensor):
        if head_map.dtype.is_floating_point or head_map.dtype.is_complex or head_map.dtype == torch.bool:
            refuse(f"expected an integer tensor of classes, got dtype {head_map.dtype}")
        if tuple(head_map.shape) != (num_layers, num_kv_heads):
            refuse(f"expected shape [L={num_layers}, Hkv={num_kv_heads}], got {tuple(head_map.shape)}")
        rows = head_map.tolist()
    else:
        if isinstance(head_map, (str, bytes)) or not isinstance(head_map, Sequence):
            refuse("expected an int tensor or a nested sequence [L, Hkv] of classes")
        rows = list(head_map)
        if len(rows) != num_layers or any(
                isinstance(row, (str, bytes)) or not isinstance(row, Sequence) or len(row) != num_kv_heads
                for row in rows):
            refuse(f"expected {num_layers} rows (layers) of {num_kv_heads} classes (KV heads)")
    for row in rows:
        for value in row:
            if not isinstance(value, int) or isinstance(value, bool) or value not in (INSTANT, SHORT, EPISODIC):
                refuse(f"every class must be INSTANT=0, SHORT=1 or EPISODIC=2, found {value!r}")
    return tuple(tuple(int(v) for v in row) for row in rows)


@dataclasses.dataclass(frozen=True)
class H2SVCConfig:
    """One H2SVC policy for a model with `num_layers` decoder layers of `num_kv_heads` KV heads (docs/h2svc.md).

    Fields:
        num_layers        L, decoder layers of the language model.
        num_kv_heads      Hkv, KV heads per layer (query heads follow their KV head under GQA).
        prefix_len        P, system-prompt tokens kept in every head on top of its frames (§1, ours).
        tokens_per_frame  T_f, visual tokens of one frame (LLaVA-OV 196; Qwen2.5-VL one temporal grid step).
        head_map          classes [L, Hkv] (INSTANT / SHORT / EPISODIC): an int tensor or nested sequence, stored
                          as a tuple of tuples of ints; None → `default_head_map` and `profiled = False`.
        instant_frames    W_s, frames kept by instant heads (FIFO, §1).
        short_frames      W_w, frames kept by short heads (FIFO, §1).
        episodic_frames   N_e, frames kept by episodic heads (STCE, §3); >= 2 because STCE never evicts its two
                          endpoints and needs room for one interior frame.
        instant_ratio     share of heads routed to the instant class (§2); only used to build the default map.
        short_ratio       share of heads routed to the short class (§2); episodic gets the rest.
        reindex           "eager": re-index positions every step; "lazy": only past max_positions - margin (§4).
        max_positions     the model's max_position_embeddings. Checked bound (ours, as HermesConfig's):
                          prefix_len + max(W_s, W_w, N_e)·tokens_per_frame + 1 <= max_positions, i.e. the largest
                          re-indexed memory plus one incoming token fits.
        margin            lazy re-indexing starts once a position exceeds max_positions - margin.

    Derived (not compared): `head_classes` int64 [L, Hkv] CPU tensor of the map, `profiled` (False when the map
    is the unprofiled default, so the stream can warn). A given head map is taken as is: the ratios do not
    have to reproduce it (ours: a profiled map may come from other ratios).
    """

    num_layers: int
    num_kv_heads: int
    prefix_len: int
    tokens_per_frame: int
    head_map: torch.Tensor | Sequence | None = None
    instant_frames: int = 4
    short_frames: int = 16
    episodic_frames: int = 64
    instant_ratio: float = 0.1
    short_ratio: float = 0.4
    reindex: str = "lazy"
    max_positions: int = 32768
    margin: int = 1024

    PRESETS: ClassVar[tuple[str, ...]] = ("llava_ov", "llava_ov1_5", "qwen2_5_vl", "qwen3_vl", "qwen3_5",
                                          "minicpmv4_6", "gemma4")

    head_classes: torch.Tensor = dataclasses.field(init=False, repr=False, compare=False)
    profiled: bool = dataclasses.field(init=False, repr=False, compare=False)
    _rows: tuple = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._validate()
        profiled = self.head_map is not None
        if profiled:
            head_map = _normalise_head_map(self.head_map, self.num_layers, self.num_kv_heads)
        else:
            head_map = tuple(tuple(row) for row in default_head_map(
                self.num_layers, self.num_kv_heads, self.instant_ratio, self.short_ratio).tolist())
        # row r of class c's stack is rows[c][r]: (layer, head) pairs in (layer, head) order (§5)
        rows = tuple(tuple((layer, head) for layer in range(self.num_layers) for head in range(self.num_kv_heads)
                           if head_map[layer][head] == c) for c in (INSTANT, SHORT, EPISODIC))
        object.__setattr__(self, "head_map", head_map)
        object.__setattr__(self, "head_classes", torch.tensor(head_map, dtype=torch.int64))
        object.__setattr__(self, "profiled", profiled)
        object.__setattr__(self, "_rows", rows)

    def _validate(self) -> None:
        def need(ok: bool, field: str, why: str) -> None:
            if not ok:
                raise ValueError(f"H2SVCConfig.{field}: {why} (got {getattr(self, field)!r})")

        for field in ("num_layers", "num_kv_heads", "prefix_len", "tokens_per_frame", "instant_frames",
                      "short_frames", "episodic_frames", "max_positions", "margin"):
            value = getattr(self, field)
            need(isinstance(value, int) and not isinstance(value, bool), field, "must be an int")
        need(self.num_layers >= 1, "num_layers", "must be >= 1")
        need(self.num_kv_heads >= 1, "num_kv_heads", "must be >= 1")
        need(self.prefix_len >= 0, "prefix_len", "must be >= 0")
        need(self.tokens_per_frame >= 1, "tokens_per_frame", "must be >= 1")
        need(self.instant_frames >= 1, "instant_frames", "must be >= 1")
        need(self.short_frames >= 1, "short_frames", "must be >= 1")
        need(self.episodic_frames >= 2, "episodic_frames",
             "must be >= 2 (STCE never evicts the oldest and newest frame, so it needs one more slot)")
        for field in ("instant_ratio", "short_ratio"):
            value = getattr(self, field)
            need(isinstance(value, (int, float)) and not isinstance(value, bool) and 0.0 <= value <= 1.0, field,
                 "must be a number in [0, 1]")
        need(_decimal(self.instant_ratio) + _decimal(self.short_ratio) <= 1, "short_ratio",
             f"instant_ratio + short_ratio must be <= 1 (instant_ratio={self.instant_ratio})")
        need(self.reindex in REINDEX_MODES, "reindex", f"must be one of {REINDEX_MODES}")
        need(0 <= self.margin < self.max_positions, "margin", "must lie in [0, max_positions)")
        largest = self.prefix_len + max(self.windows) * self.tokens_per_frame
        need(largest + 1 <= self.max_positions, "max_positions",
             f"must exceed prefix_len + max(instant_frames, short_frames, episodic_frames)·tokens_per_frame "
             f"= {largest} (room for the re-indexed memory and one incoming token)")

    @property
    def windows(self) -> tuple[int, int, int]:
        """(W_s, W_w, N_e): frames held by the INSTANT, SHORT and EPISODIC classes."""
        return self.instant_frames, self.short_frames, self.episodic_frames

    def window(self, cls) -> int:
        """Frames held by class `cls` (int or name): W_s, W_w or N_e."""
        return self.windows[class_id(cls)]

    def class_rows(self, cls) -> list[tuple[int, int]]:
        """The (layer, head) rows of class `cls` in (layer, head) order: row r of its stack is element r."""
        return list(self._rows[class_id(cls)])

    def num_rows(self, cls) -> int:
        """H_c, the number of (layer, KV head) rows of class `cls`."""
        return len(self._rows[class_id(cls)])

    def layer_rows(self, cls, layer: int) -> range:
        """The contiguous rows of `layer` inside class `cls`'s stack (empty range when it has none there)."""
        rows = self._rows[class_id(cls)]
        self._check_layer(layer)
        start = sum(1 for row_layer, _ in rows if row_layer < layer)
        return range(start, start + sum(1 for row_layer, _ in rows if row_layer == layer))

    def heads_of(self, cls, layer: int) -> list[int]:
        """The KV heads of `layer` in class `cls`, ascending."""
        self._check_layer(layer)
        return [head for row_layer, head in self._rows[class_id(cls)] if row_layer == layer]

    def _check_layer(self, layer: int) -> None:
        if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer: expected an int in [0, L={self.num_layers}), got {layer!r}")

    def needs_reindex(self, max_position: int) -> bool:
        """Re-index in this step? eager: always; lazy: once the largest position exceeds max_positions - margin
        (docs/h2svc.md §4, as HERMES §2.7). `max_position` is the cache's largest position, known on the host."""
        return self.reindex == "eager" or max_position > self.max_positions - self.margin

    def replace(self, **changes) -> "H2SVCConfig":
        """A copy with some fields changed (validated again). The stored head map is kept unless `head_map` is
        among the changes; an unprofiled config rebuilds its default map from the new shape and ratios."""
        if not self.profiled and "head_map" not in changes:
            changes["head_map"] = None
        return dataclasses.replace(self, **changes)

    @classmethod
    def preset(cls, name: str, num_layers: int, num_kv_heads: int, prefix_len: int, **kwargs) -> "H2SVCConfig":
        """The preset called `name`, one of PRESETS (a model family names its own: `ModelFamily.preset_name`);
        `kwargs` as that preset takes them (tokens_per_frame, head_map, max_positions, overrides)."""
        if name not in cls.PRESETS:
            raise ValueError(f"preset: H2SVCConfig has no preset {name!r}; presets: {cls.PRESETS}")
        return getattr(cls, name)(num_layers, num_kv_heads, prefix_len, **kwargs)

    @classmethod
    def llava_ov(cls, num_layers: int, num_kv_heads: int, prefix_len: int, head_map=None,
                 max_positions: int = 32768, **overrides) -> "H2SVCConfig":
        """LLaVA-OneVision (Qwen2 language model): 196 tokens per 384² frame (27² SigLIP patches downsampled 2× to
        14²), 32768 positions, the paper's defaults W_s = 4, W_w = 16, N_e = 64 and ratios 0.1 / 0.4 / 0.5."""
        params = dict(tokens_per_frame=196)
        params.update(overrides)
        return cls(num_layers=num_layers, num_kv_heads=num_kv_heads, prefix_len=prefix_len, head_map=head_map,
                   max_positions=max_positions, **params)

    @classmethod
    def llava_ov1_5(cls, num_layers: int, num_kv_heads: int, prefix_len: int, tokens_per_frame: int = 196,
                    head_map=None, max_positions: int = 32768, **overrides) -> "H2SVCConfig":
        """LLaVA-OneVision-1.5: one frame is one video frame (its tower has no temporal patch) of h'·w' merged
        tokens, 196 for 392² px input (28² patches of 14 px merged 2×2); 1D positions; the policies pass the
        checkpoint's max_position_embeddings; the paper's windows and ratios."""
        return cls(num_layers=num_layers, num_kv_heads=num_kv_heads, prefix_len=prefix_len,
                   tokens_per_frame=tokens_per_frame, head_map=head_map, max_positions=max_positions, **overrides)

    @classmethod
    def qwen2_5_vl(cls, num_layers: int, num_kv_heads: int, prefix_len: int, tokens_per_frame: int = 196,
                   head_map=None, max_positions: int = 128000, **overrides) -> "H2SVCConfig":
        """Qwen2.5-VL: one "frame" is one temporal grid step of the video (two sampled frames merged by the
        temporal patch size 2) with h'·w' merged tokens; 196 for 392² px input (28² patches of 14 px merged
        2×2 to 14²). Positions are 3D M-RoPE (t, h, w); 128000 positions; the paper's windows and ratios."""
        return cls(num_layers=num_layers, num_kv_heads=num_kv_heads, prefix_len=prefix_len,
                   tokens_per_frame=tokens_per_frame, head_map=head_map, max_positions=max_positions, **overrides)

    @classmethod
    def qwen3_vl(cls, num_layers: int, num_kv_heads: int, prefix_len: int, tokens_per_frame: int = 196,
                 head_map=None, max_positions: int = 262144, **overrides) -> "H2SVCConfig":
        """Qwen3-VL: as `qwen2_5_vl` (one frame = one temporal grid step of two sampled frames), with 16 px patches
        merged 2×2, so 196 tokens for 448² px input; 262144 positions (Qwen3-VL-8B); M-RoPE with interleaved
        sections (`RotaryLayout.interleaved`); the paper's windows and ratios."""
        return cls.qwen2_5_vl(num_layers, num_kv_heads, prefix_len, tokens_per_frame=tokens_per_frame,
                              head_map=head_map, max_positions=max_positions, **overrides)

    @classmethod
    def qwen3_5(cls, num_layers: int, num_kv_heads: int, prefix_len: int, tokens_per_frame: int = 196,
                head_map=None, max_positions: int = 32768, **overrides) -> "H2SVCConfig":
        """Qwen3.5 and Qwen3.5-MoE (docs/qwen3_5.md): `num_layers` counts the FULL-ATTENTION layers only, so
        `head_map` is [L_full, Hkv] over (full-attention layer, KV head) pairs in depth order; the linear-attention
        layers hold no tokens and are routed nowhere. Otherwise `qwen3_vl` (the same vision tower and video layout:
        196 tokens for 448² px input, one frame = one temporal grid step) with the 32768 positions of transformers
        5.24's default Qwen3.5 config (8 full-attention layers of 4 KV heads there)."""
        return cls.qwen2_5_vl(num_layers, num_kv_heads, prefix_len, tokens_per_frame=tokens_per_frame,
                              head_map=head_map, max_positions=max_positions, **overrides)

    @classmethod
    def minicpmv4_6(cls, num_layers: int, num_kv_heads: int, prefix_len: int, tokens_per_frame: int = 66,
                    head_map=None, max_positions: int = 32768, **overrides) -> "H2SVCConfig":
        """MiniCPM-V 4.6 (docs/families.md#minicpm-v-4-6): `qwen3_5`'s routing over the FULL-ATTENTION layers only
        (`head_map` [L_full, Hkv]); one frame is one video frame: <image>, 8 x 8 tokens for 448² px at patch 14
        (the two mergers fold 4 x 4 patches into one), </image> = 66 tokens; 1D positions; the 32768 positions of
        transformers 5.25's default MiniCPMV4_6Config."""
        return cls.qwen3_5(num_layers, num_kv_heads, prefix_len, tokens_per_frame=tokens_per_frame,
                           head_map=head_map, max_positions=max_positions, **overrides)

    @classmethod
    def gemma4(cls, num_layers: int, num_kv_heads: int, prefix_len: int, tokens_per_frame: int = 75,
               head_map=None, max_positions: int = 131072, **overrides) -> "H2SVCConfig":
        """Gemma 4 (docs/gemma4.md): `qwen3_5`'s routing over the layers the policies see only, the FULL-ATTENTION
        layers that keep keys and values of their own (`head_map` [L_full, Hkv] over their KV heads; any L_full >= 1);
        one frame is one video frame: " mm:ss " (7 tokens with a tokenizer that splits digits and keeps spaces, as
        Gemma's does), <|image>, 66 soft tokens for a 16:9 frame at the video processor's default 70 at most,
        <image|> = 75; 1D positions; the 131072 positions of transformers 5.25's default Gemma 4 text config; the
        paper's windows and ratios."""
        return cls.qwen3_5(num_layers, num_kv_heads, prefix_len, tokens_per_frame=tokens_per_frame,
                           head_map=head_map, max_positions=max_positions, **overrides)

"""The H2SVC head map on disk: what the offline profiler (docs/h2svc.md §2, `hermes.policies.h2svc.profile`) found,
written as JSON (`save_head_map`) and read back checked against the model it is loaded for (`load_head_map`):

    loaded = load_head_map("map.json", model)                          # ValueError if it does not fit `model`
    H2SVCConfig.llava_ov(L, Hkv, prefix_len, head_map=loaded.head_map)

Needs only torch and the standard library (the stream loads maps without the profiler's imports). The file's
fields: docs/cli.md#profiling-heads-for-h2svc.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import warnings
from importlib import metadata

import torch

from hermes.window import cache_kv_heads, cache_layers
from hermes_kernels.policies.h2svc.config import CLASS_NAMES, H2SVCConfig, class_counts

FORMAT = "hermes-kernels/h2svc-head-map"
FORMAT_VERSION = 1


@dataclasses.dataclass
class HeadProfile:
    """The result of profiling one model's heads (docs/h2svc.md §2), as `profile_heads` returns and the map file holds.

    model_name:    the checkpoint's `name_or_path` ("" for a model built in memory).
    model_type:    `config.model_type` (llava_onevision, qwen2_5_vl).
    num_layers:    L, decoder layers; num_kv_heads: Hkv per layer; num_heads: query heads per layer.
    instant_ratio, short_ratio: the class shares the map was drawn with.
    head_map:      int64 [L, Hkv] classes (INSTANT / SHORT / EPISODIC): what `H2SVCConfig(head_map=...)` takes.
    v2v, t2v:      float64 [L, Hkv] TAD_V2V / TAD_T2V, mean over the clips (query heads of a KV group averaged).
    scores:        float64 [L, Hkv] S(h) = ½(N(TAD_V2V) + N(TAD_T2V)).
    clips:         one dict per clip: source, frames (video frames sampled), memory_frames (n, H2SVC frames),
                   tokens_per_frame, text_queries (query tokens of T2V), tad_v2v / tad_t2v ([L][Hkv] lists).
    settings:      how the profile was taken (fps, chunk_frames, max_frames, questions, answer_tokens,
                   system_prompt, dtype, text_queries: which tokens were T2V's queries).
    package_version: hermes-kernels version that wrote it.
    """

    model_name: str
    model_type: str
    num_layers: int
    num_kv_heads: int
    num_heads: int
    instant_ratio: float
    short_ratio: float
    head_map: torch.Tensor
    v2v: torch.Tensor
    t2v: torch.Tensor
    scores: torch.Tensor
    clips: list[dict]
    settings: dict
    package_version: str = dataclasses.field(default_factory=lambda: installed_version())

    def counts(self) -> tuple[int, int, int]:
        """(instant, short, episodic) heads of the map."""
        return tuple(int((self.head_map == c).sum()) for c in range(len(CLASS_NAMES)))


def installed_version() -> str:
    """The installed hermes-kernels version ("unknown" when the package is only on the path)."""
    try:
        return metadata.version("hermes-kernels")
    except metadata.PackageNotFoundError:
        return "unknown"


def _grid(tensor: torch.Tensor) -> list[list[float]]:
    return [[float(x) for x in row] for row in tensor.tolist()]


def to_json(profile: HeadProfile) -> dict:
    """The map file's content (`FORMAT`, version `FORMAT_VERSION`; docs/cli.md#profiling-heads-for-h2svc) as a
    JSON-ready dict. Classes are stored by name, independent of the INSTANT / SHORT / EPISODIC numbering; floats as
    Python's shortest round-trip repr, so a saved profile loads back bit for bit. Window sizes are not stored: they
    size the memories, not the classes, so the routing does not depend on them."""
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "package_version": profile.package_version,
        "model": {"name": profile.model_name, "model_type": profile.model_type, "num_layers": profile.num_layers,
                  "num_kv_heads": profile.num_kv_heads, "num_heads": profile.num_heads},
        "ratios": {"instant": profile.instant_ratio, "short": profile.short_ratio},
        "head_map": [[CLASS_NAMES[c] for c in row] for row in profile.head_map.tolist()],
        "metrics": {"tad_v2v": _grid(profile.v2v), "tad_t2v": _grid(profile.t2v), "score": _grid(profile.scores)},
        "clips": profile.clips,
        "settings": profile.settings,
    }


def save_head_map(profile: HeadProfile, path: str | os.PathLike) -> str:
    """Write `profile` as a JSON head map at `path` (parent folder must exist); returns the path."""
    if not isinstance(profile, HeadProfile):
        raise TypeError(f"profile: expected a HeadProfile, got {type(profile).__name__}")
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"out: no such folder: {folder}")
    text = _format(to_json(profile))
    with open(path, "w") as f:
        f.write(text + "\n")
    return path


def _format(value, indent: str = "") -> str:
    """JSON text for people too: objects one key a line, lists of lists / objects one item a line, anything
    else (a row of a [L][Hkv] grid, a string, a number) compact on one line."""
    inner = indent + " "
    if isinstance(value, dict) and value:
        items = [f"{inner}{json.dumps(key)}: {_format(item, inner)}" for key, item in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + indent + "}"
    if isinstance(value, list) and value and all(isinstance(item, (list, dict)) for item in value):
        return "[\n" + ",\n".join(inner + _format(item, inner) for item in value) + "\n" + indent + "]"
    return json.dumps(value, allow_nan=False)


def _model_shape(model) -> tuple[str | None, int, int, str]:
    """(model_type or None, L, Hkv, name) of a loaded model, a transformers config or an H2SVCConfig."""
    if isinstance(model, H2SVCConfig):
        return None, model.num_layers, model.num_kv_heads, ""
    config = getattr(model, "config", model)
    get_text_config = getattr(config, "get_text_config", None)
    if not callable(get_text_config) or getattr(config, "model_type", None) is None:
        raise TypeError(f"model: expected a loaded model, its transformers config or an H2SVCConfig, got "
                        f"{type(model).__name__}")
    # a map covers the layers the caches hold: a hybrid model's full-attention layers (docs/qwen3_5.md#hybrid-cache),
    # Gemma 4's full-attention layers that compute keys (docs/gemma4.md#roles)
    return config.model_type, len(cache_layers(config)), cache_kv_heads(config), \
        getattr(config, "name_or_path", "") or ""


def check_head_map(profile: HeadProfile, model, source: str = "head map") -> None:
    """ValueError naming every difference when `profile` was not taken on a model of `model`'s type and shape
    (model_type, decoder layers, KV heads; an H2SVCConfig has no model type, so only the shape is compared).
    A different checkpoint name of the same type and shape only warns (ours: the same weights move between
    folders; a fine-tune of the same shape may still want its own profile)."""
    model_type, num_layers, num_kv_heads, name = _model_shape(model)
    differences = []
    if model_type is not None and model_type != profile.model_type:
        differences.append(f"model_type {profile.model_type!r} vs {model_type!r}")
    if num_layers != profile.num_layers:
        differences.append(f"layers {profile.num_layers} vs {num_layers}")
    if num_kv_heads != profile.num_kv_heads:
        differences.append(f"KV heads {profile.num_kv_heads} vs {num_kv_heads}")
    if differences:
        raise ValueError(f"{source}: profiled for another model: {'; '.join(differences)} (map vs model). The map "
                         f"was made for {profile.model_type} with {profile.num_layers} layers x "
                         f"{profile.num_kv_heads} KV heads ({profile.model_name or 'unnamed'}); profile this model "
                         f"with hermes-profile")
    base = os.path.basename(os.path.normpath(name)) if name else ""
    profiled = os.path.basename(os.path.normpath(profile.model_name)) if profile.model_name else ""
    if base and profiled and base != profiled:
        warnings.warn(f"{source}: profiled on {profile.model_name!r}, loaded for {name!r} (same type and shape)",
                      stacklevel=3)


def load_head_map(path: str | os.PathLike, model=None) -> HeadProfile:
    """Read a head map written by `save_head_map`; with `model` (a loaded model, its transformers config or an
    H2SVCConfig) check that it fits (`check_head_map`). Returns the HeadProfile; its `head_map` (int64 [L, Hkv])
    is what `H2SVCConfig(head_map=...)` takes.

    FileNotFoundError for a missing file; ValueError for a file that is not a valid head map (naming the field)
    or one made for another model.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"head map: no such file: {path}")
    source = f"head map {path}"
    try:
        with open(path) as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{source}: not a JSON head map ({err})") from err
    profile = from_json(data, source)
    if model is not None:
        check_head_map(profile, model, source)
    return profile


def from_json(data, source: str = "head map") -> HeadProfile:
    """A HeadProfile from the map file's content; ValueError naming the first field that is missing or wrong."""
    def fail(field: str, why: str):
        raise ValueError(f"{source}: {field}: {why}")

    def field(container, key: str, kind, where: str = ""):
        name = f"{where}{key}"
        if not isinstance(container, dict) or key not in container:
            fail(name, "missing")
        value = container[key]
        if isinstance(value, bool) or not isinstance(value, kind):  # JSON true/false are not numbers here
            fail(name, f"expected {kind.__name__ if isinstance(kind, type) else 'a number'}, got {value!r}")
        return value

    if not isinstance(data, dict) or data.get("format") != FORMAT:
        fail("format", f"expected {FORMAT!r} (a file written by save_head_map)")
    if field(data, "format_version", int) != FORMAT_VERSION:
        fail("format_version", f"expected {FORMAT_VERSION}, got {data['format_version']!r}")
    model = field(data, "model", dict)
    L = field(model, "num_layers", int, "model.")
    Hkv = field(model, "num_kv_heads", int, "model.")
    H = field(model, "num_heads", int, "model.")
    if L < 1 or Hkv < 1 or H < Hkv or H % Hkv:
        fail("model", f"expected num_layers >= 1 and num_heads a multiple of num_kv_heads >= 1, got {model!r}")
    ratios = field(data, "ratios", dict)
    instant, short = field(ratios, "instant", (int, float), "ratios."), field(ratios, "short", (int, float), "ratios.")
    try:
        class_counts(L * Hkv, instant, short)
    except ValueError as err:
        fail("ratios", str(err))

    def grid(values, name: str, parse) -> list[list]:
        if not isinstance(values, list) or len(values) != L or any(
                not isinstance(row, list) or len(row) != Hkv for row in values):
            fail(name, f"expected {L} rows (layers) of {Hkv} entries (KV heads)")
        return [[parse(x, name) for x in row] for row in values]

    def class_of(name, where):
        if name not in CLASS_NAMES:
            fail(where, f"expected class names {CLASS_NAMES}, found {name!r}")
        return CLASS_NAMES.index(name)

    def number(x, where):
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
            fail(where, f"expected finite numbers, found {x!r}")
        return float(x)

    head_map = torch.tensor(grid(data.get("head_map"), "head_map", class_of), dtype=torch.int64)
    metrics = field(data, "metrics", dict)
    v2v, t2v, scores = (torch.tensor(grid(metrics.get(key), f"metrics.{key}", number), dtype=torch.float64)
                        for key in ("tad_v2v", "tad_t2v", "score"))
    clips = field(data, "clips", list)
    for index, clip in enumerate(clips):
        for key in ("tad_v2v", "tad_t2v"):
            grid(field(clip, key, list, f"clips[{index}]."), f"clips[{index}].{key}", number)
    return HeadProfile(model_name=field(model, "name", str, "model."),
                       model_type=field(model, "model_type", str, "model."), num_layers=L, num_kv_heads=Hkv,
                       num_heads=H, instant_ratio=instant, short_ratio=short, head_map=head_map, v2v=v2v, t2v=t2v,
                       scores=scores, clips=clips, settings=field(data, "settings", dict),
                       package_version=field(data, "package_version", str))


__all__ = ["HeadProfile", "FORMAT", "FORMAT_VERSION", "save_head_map", "load_head_map", "check_head_map",
           "to_json", "from_json", "installed_version"]

"""The head-map file on its own (`hermes.policies.h2svc.head_map`), without a profiler run: every field `from_json`
checks, refused with the exact message that names it; the values at the edges of what is valid; the model shape a
map is checked against (configs of every kind, hybrid ones included); the file's text layout."""
import copy
import json
import types
import warnings
from importlib import metadata

import pytest
import torch
from transformers.models.qwen2 import configuration_qwen2
from transformers.models.qwen3_5 import configuration_qwen3_5

from hermes.policies.h2svc import head_map as module
from hermes.policies.h2svc.head_map import (HeadProfile, check_head_map, from_json, load_head_map, save_head_map,
                                            to_json)
from hermes_kernels.policies.h2svc.config import H2SVCConfig


def profile(num_layers=2, num_kv_heads=2, num_heads=4, name="ckpts/tiny", model_type="qwen2") -> HeadProfile:
    grid = torch.arange(num_layers * num_kv_heads, dtype=torch.float64).reshape(num_layers, num_kv_heads) / 8
    head_map = torch.arange(num_layers * num_kv_heads).reshape(num_layers, num_kv_heads) % 3
    per_clip = {"tad_v2v": grid.tolist(), "tad_t2v": (grid + 0.5).tolist()}
    return HeadProfile(model_name=name, model_type=model_type, num_layers=num_layers, num_kv_heads=num_kv_heads,
                       num_heads=num_heads, instant_ratio=0.25, short_ratio=0.25, head_map=head_map, v2v=grid,
                       t2v=grid + 0.5, scores=grid + 0.25,
                       clips=[{"source": "a.mp4", "frames": 3, **per_clip}], settings={"fps": 1.0},
                       package_version="9.9")


def same(a: HeadProfile, b: HeadProfile) -> bool:
    tensors = ("head_map", "v2v", "t2v", "scores")
    return all(torch.equal(getattr(a, k), getattr(b, k)) and getattr(a, k).dtype == getattr(b, k).dtype
               for k in tensors) and all(getattr(a, f.name) == getattr(b, f.name)
                                         for f in module.dataclasses.fields(HeadProfile) if f.name not in tensors)


@pytest.mark.parametrize("shape", [(2, 2, 4), (1, 1, 1), (3, 2, 2)], ids=["gqa", "one-layer-one-head", "mha"])
def test_a_map_round_trips_bit_for_bit(shape, tmp_path):
    """One layer, one head, and as many query heads as KV heads are valid maps."""
    original = profile(*shape)
    path = save_head_map(original, tmp_path / "map.json")
    back = load_head_map(path)
    assert same(back, original) and back.head_map.dtype == torch.int64 and back.v2v.dtype == torch.float64
    assert same(from_json(to_json(original)), original)


def _drop(path):
    def edit(data):
        *outer, last = path
        for key in outer:
            data = data[key]
        del data[last]
    return edit


def _set(path, value):
    def edit(data):
        *outer, last = path
        for key in outer:
            data = data[key]
        data[last] = value
    return edit


NUMBER_FIELD = "expected a number, got"
BAD = [
    ("not-a-dict", lambda d: d.clear() or d.update({"x": 1}), "format: expected 'hermes-kernels/h2svc-head-map' "
                                                             "(a file written by save_head_map)"),
    ("format", _set(["format"], "other"), "format: expected 'hermes-kernels/h2svc-head-map' (a file written by "
                                          "save_head_map)"),
    ("version-missing", _drop(["format_version"]), "format_version: missing"),
    ("version-bool", _set(["format_version"], True), "format_version: expected int, got True"),
    ("version-2", _set(["format_version"], 2), "format_version: expected 1, got 2"),
    ("model-missing", _drop(["model"]), "model: missing"),
    ("model-list", _set(["model"], []), "model: expected dict, got []"),
    ("layers-missing", _drop(["model", "num_layers"]), "model.num_layers: missing"),
    ("layers-float", _set(["model", "num_layers"], 2.0), "model.num_layers: expected int, got 2.0"),
    ("kv-heads-missing", _drop(["model", "num_kv_heads"]), "model.num_kv_heads: missing"),
    ("heads-missing", _drop(["model", "num_heads"]), "model.num_heads: missing"),
    ("name-missing", _drop(["model", "name"]), "model.name: missing"),
    ("type-number", _set(["model", "model_type"], 3), "model.model_type: expected str, got 3"),
    ("layers-0", _set(["model", "num_layers"], 0), "model: expected num_layers >= 1 and num_heads a multiple of "
                                                   "num_kv_heads >= 1, got "),
    ("kv-heads-0", _set(["model", "num_kv_heads"], 0), "model: expected num_layers >= 1"),
    ("heads-fewer", _set(["model", "num_heads"], 1), "model: expected num_layers >= 1"),
    ("heads-not-a-multiple", _set(["model", "num_heads"], 5), "model: expected num_layers >= 1"),
    ("ratios-missing", _drop(["ratios"]), "ratios: missing"),
    ("instant-missing", _drop(["ratios", "instant"]), "ratios.instant: missing"),
    ("instant-bool", _set(["ratios", "instant"], False), f"ratios.instant: {NUMBER_FIELD} False"),
    ("short-string", _set(["ratios", "short"], "0.4"), f"ratios.short: {NUMBER_FIELD} '0.4'"),
    ("ratios-sum", _set(["ratios", "short"], 0.8), "ratios: short_ratio: instant_ratio + short_ratio must be <= 1, "
                                                   "got 0.25 + 0.8"),
    ("instant-range", _set(["ratios", "instant"], 1.5), "ratios: instant_ratio: expected a number in [0, 1], got 1.5"),
    ("head-map-rows", _set(["head_map"], [["instant", "short"]]), "head_map: expected 2 rows (layers) of 2 entries "
                                                                  "(KV heads)"),
    ("head-map-missing", _drop(["head_map"]), "head_map: expected 2 rows (layers) of 2 entries (KV heads)"),
    ("head-map-class", _set(["head_map", 1, 0], "fast"), "head_map: expected class names ('instant', 'short', "
                                                         "'episodic'), found 'fast'"),
    ("metrics-missing", _drop(["metrics"]), "metrics: missing"),
    ("v2v-short-row", _set(["metrics", "tad_v2v", 0], [0.0]), "metrics.tad_v2v: expected 2 rows (layers) of 2 "
                                                              "entries (KV heads)"),
    ("t2v-nan", _set(["metrics", "tad_t2v", 1, 1], float("nan")), "metrics.tad_t2v: expected finite numbers, "
                                                                  "found nan"),
    ("score-string", _set(["metrics", "score", 0, 0], "1"), "metrics.score: expected finite numbers, found '1'"),
    ("score-bool", _set(["metrics", "score", 0, 0], True), "metrics.score: expected finite numbers, found True"),
    ("clips-missing", _drop(["clips"]), "clips: missing"),
    ("clip-v2v-missing", _drop(["clips", 0, "tad_v2v"]), "clips[0].tad_v2v: missing"),
    ("clip-t2v-inf", _set(["clips", 0, "tad_t2v", 0, 1], float("inf")), "clips[0].tad_t2v: expected finite numbers, "
                                                                        "found inf"),
    ("clip-t2v-rows", _set(["clips", 0, "tad_t2v"], [[0.0, 0.0]]), "clips[0].tad_t2v: expected 2 rows (layers) of 2 "
                                                                   "entries (KV heads)"),
    ("settings-missing", _drop(["settings"]), "settings: missing"),
    ("version-of-package", _set(["package_version"], 1), "package_version: expected str, got 1"),
]


@pytest.mark.parametrize("edit,message", [case[1:] for case in BAD], ids=[case[0] for case in BAD])
def test_a_bad_field_is_refused_naming_it(edit, message):
    data = copy.deepcopy(to_json(profile()))
    edit(data)
    with pytest.raises(ValueError) as error:
        from_json(data, "map.json")
    assert str(error.value).startswith(f"map.json: {message}"), str(error.value)
    with pytest.raises(ValueError, match=r"^head map: "):
        from_json(data)


def test_a_file_that_is_not_json_is_refused_naming_it(tmp_path):
    text, binary = tmp_path / "text.json", tmp_path / "binary.json"
    text.write_text("{not json")
    binary.write_bytes(b"\xff\xfe\x00{")
    for path in (text, binary):
        with pytest.raises(ValueError, match=f"^head map {path}: not a JSON head map \\("):
            load_head_map(path)
    with pytest.raises(FileNotFoundError, match=f"^head map: no such file: {tmp_path / 'none.json'}$"):
        load_head_map(tmp_path / "none.json")
    bad = to_json(profile())
    bad["format_version"] = 7
    (tmp_path / "v7.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=f"^head map {tmp_path / 'v7.json'}: format_version: expected 1, got 7$"):
        load_head_map(tmp_path / "v7.json")


def test_the_file_is_laid_out_for_people_and_refuses_non_finite_numbers(tmp_path):
    """Objects one key a line, nested one space deeper; grids one row a line; NaN is not JSON."""
    assert module._format({"a": [[1, 2], [3]], "b": {"c": "x"}, "d": [1, 2], "e": {}}) == (
        '{\n "a": [\n  [1, 2],\n  [3]\n ],\n "b": {\n  "c": "x"\n },\n "d": [1, 2],\n "e": {}\n}')
    assert module._format({"clips": [{"x": 1, "y": [[2]]}]}) == (
        '{\n "clips": [\n  {\n   "x": 1,\n   "y": [\n    [2]\n   ]\n  }\n ]\n}')
    broken = profile()
    broken.settings = {"fps": float("nan")}
    with pytest.raises(ValueError):
        save_head_map(broken, tmp_path / "nan.json")


def test_the_package_version_is_the_installed_one_or_unknown(monkeypatch):
    assert module.installed_version() == metadata.version("hermes-kernels")

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(module.metadata, "version", missing)
    assert module.installed_version() == "unknown"


def _qwen2(**overrides):
    values = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3)
    return configuration_qwen2.Qwen2Config(**{**values, **overrides})


def test_the_model_shape_of_every_kind_of_model():
    """A config, a model holding one, an H2SVCConfig; a config without KV heads has as many as query heads; a
    hybrid config counts its full-attention layers; a checkpoint's name comes with it."""
    config = _qwen2()
    assert module._model_shape(config) == ("qwen2", 3, 2, "")
    config.name_or_path = "ckpts/q"
    assert module._model_shape(type("Model", (), {"config": config})()) == ("qwen2", 3, 2, "ckpts/q")
    h2svc = H2SVCConfig(num_layers=5, num_kv_heads=3, prefix_len=1, tokens_per_frame=4)
    assert module._model_shape(h2svc) == (None, 5, 3, "")
    no_kv = _qwen2()
    no_kv.num_key_value_heads = None
    assert module._model_shape(no_kv)[1:3] == (3, 4)
    hybrid = configuration_qwen3_5.Qwen3_5TextConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=6, head_dim=16,
        layer_types=["linear_attention", "full_attention", "full_attention", "linear_attention", "full_attention",
                     "linear_attention"])
    assert module._model_shape(hybrid)[:3] == ("qwen3_5_text", 3, 2)
    for thing in ("qwen2", None, object()):
        with pytest.raises(TypeError, match="^model: expected a loaded model, its transformers config or an "
                                            "H2SVCConfig, got "):
            module._model_shape(thing)
    bare = types.SimpleNamespace(num_attention_heads=4, num_hidden_layers=2)  # no KV heads, layer types or name
    assert module._model_shape(types.SimpleNamespace(model_type="older", get_text_config=lambda: bare)) == (
        "older", 2, 4, "")
    with pytest.raises(TypeError, match="^model: expected a loaded model"):
        module._model_shape(types.SimpleNamespace(get_text_config=lambda: bare))
    typeless = _qwen2()
    typeless.model_type = None
    with pytest.raises(TypeError, match="^model: expected a loaded model"):
        module._model_shape(typeless)


def test_a_map_for_another_shape_names_every_difference():
    with pytest.raises(ValueError) as error:
        check_head_map(profile(num_layers=2, num_kv_heads=2, model_type="llava"), _qwen2(num_hidden_layers=4,
                                                                                        num_key_value_heads=1))
    assert str(error.value) == (
        "head map: profiled for another model: model_type 'llava' vs 'qwen2'; layers 2 vs 4; KV heads 2 vs 1 (map vs "
        "model). The map was made for llava with 2 layers x 2 KV heads (ckpts/tiny); profile this model with "
        "hermes-profile")
    with pytest.raises(ValueError, match=r"^mine: profiled for another model: layers 2 vs 3 .*\(unnamed\)"):
        check_head_map(profile(name=""), H2SVCConfig(num_layers=3, num_kv_heads=2, prefix_len=1, tokens_per_frame=4),
                       "mine")


def test_another_checkpoint_name_of_the_same_shape_only_warns(tmp_path):
    """The folder's last part is the name: the same name elsewhere is the same checkpoint; a map or a model without
    a name is never warned about."""
    config = _qwen2(num_hidden_layers=2)
    saved = profile(name="ckpts/tiny")
    for name, warns in (("elsewhere/tiny/", False), ("ckpts/other", True), ("", False)):
        config.name_or_path = name
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            check_head_map(saved, config)
        assert [str(w.message) for w in caught] == (
            ["head map: profiled on 'ckpts/tiny', loaded for 'ckpts/other' (same type and shape)"] if warns else [])
    config.name_or_path = "ckpts/other"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_head_map(profile(name=""), config)
    assert caught == []
    path = save_head_map(saved, tmp_path / "map.json")
    with pytest.warns(UserWarning, match=f"^head map {path}: profiled on 'ckpts/tiny'"):
        load_head_map(path, config)

"""`hermes-profile` in-process (`hermes.profile_cli`): every option reaches the profiler (a run with none at its
default equals `profile_heads` driven directly), the defaults and types are the ones docs/cli.md states, the summary
it prints, the refusals of tensor parallelism and their order, and `--help` as written in
tests/hermes/help/hermes-profile.txt. The subprocess run and the error lines: tests/hermes/policies/h2svc/."""
import argparse
import pathlib

import pytest
import torch

from hermes import profile_cli
from hermes.commands import load_model
from hermes.models import FAMILIES
from hermes.policies.h2svc.head_map import HeadProfile, load_head_map
from hermes.policies.h2svc.profile import DEFAULT_QUESTIONS, profile_heads
from hermes.video import VideoClip
from tests.hermes.video_files import write_video
from tests.utils import error_line

pytestmark = pytest.mark.usefixtures("single_thread")
HELP = pathlib.Path(__file__).parent / "help"


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    return write_video(tmp_path_factory.mktemp("clips") / "clip.mp4", [i / 4 for i in range(28)])


def test_every_option_reaches_the_profiler(tiny_checkpoints, clip, tmp_path, capsys):
    """Each option away from its default; the map written and the summary printed are those of profile_heads
    called with the same settings on the model loaded the same way."""
    checkpoint, out = tiny_checkpoints["qwen2_5_vl"], tmp_path / "map.json"
    argv = ["--model", checkpoint, "--videos", clip, clip, "--out", str(out), "--fps", "2", "--chunk-frames", "3",
            "--max-frames", "5", "--question", "what is shown ?", "--question", "where ?", "--answer-tokens", "1",
            "--instant-ratio", "0.25", "--short-ratio", "0.25", "--device", "cpu", "--dtype", "bfloat16",
            "--threads", "1", "--quiet", "--tp", "1"]
    assert profile_cli.main(argv) == 0
    printed = capsys.readouterr()
    loaded = load_model(checkpoint, "cpu", "bfloat16")
    expected = profile_heads(loaded.model, loaded.processor, [VideoClip(clip), VideoClip(clip)], fps=2.0,
                             chunk_frames=3, max_frames=5, questions=["what is shown ?", "where ?"], answer_tokens=1,
                             instant_ratio=0.25, short_ratio=0.25, progress=False)
    written = load_head_map(out, loaded.model)
    assert written.settings == expected.settings and written.settings["dtype"] == "bfloat16"
    assert written.clips == expected.clips and len(written.clips) == 2 and written.clips[0]["frames"] == 5
    assert (written.instant_ratio, written.short_ratio) == (0.25, 0.25)
    assert torch.equal(written.head_map, expected.head_map) and torch.equal(written.scores, expected.scores)
    assert printed.out == profile_cli.summary(written, str(out)) + "\n" and printed.err == ""


def test_progress_goes_to_stderr_unless_quiet(tiny_checkpoints, clip, tmp_path, capsys):
    argv = ["--model", tiny_checkpoints["llava_onevision"], "--videos", clip, "--out", str(tmp_path / "m.json"),
            "--max-frames", "2", "--chunk-frames", "2", "--threads", "1"]
    assert profile_cli.main(argv) == 0
    assert capsys.readouterr().err != ""
    assert profile_cli.main([*argv, "--quiet"]) == 0
    assert capsys.readouterr().err == ""


def test_defaults_and_types_are_the_documented_ones():
    """docs/cli.md#profiling-heads-for-h2svc: 1 fps, 16 frames a forward, the whole clip, the default question,
    no answer tokens, ratios 0.1 / 0.4; numbers parsed as their types."""
    args = profile_cli.parser().parse_args(["--model", "m", "--videos", "a.mp4", "--out", "o.json"])
    assert vars(args) == dict(model="m", videos=["a.mp4"], out="o.json", fps=1.0, chunk_frames=16, max_frames=None,
                              question=None, answer_tokens=0, instant_ratio=0.1, short_ratio=0.4, tp=None,
                              device=None, dtype="auto", threads=None, quiet=False, traceback=False)
    args = profile_cli.parser().parse_args(["--model", "m", "--videos", "a.mp4", "--out", "o.json", "--fps", "2",
                                            "--chunk-frames", "4", "--max-frames", "5", "--answer-tokens", "1",
                                            "--instant-ratio", "0", "--short-ratio", "1", "--tp", "2",
                                            "--question", "q1", "--question", "q2"])
    typed = (args.fps, args.chunk_frames, args.max_frames, args.answer_tokens, args.instant_ratio, args.short_ratio,
             args.tp, args.question)
    assert typed == (2.0, 4, 5, 1, 0.0, 1.0, 2, ["q1", "q2"])
    assert [type(value) for value in typed] == [float, int, int, int, float, float, int, list]


@pytest.mark.parametrize("missing", ["--videos", "--out", "--model"])
def test_a_missing_required_option_is_a_usage_error(missing, capsys):
    argv = {"--model": ["m"], "--videos": ["a.mp4"], "--out": ["o.json"]}
    argv.pop(missing)
    with pytest.raises(SystemExit) as exit_info:
        profile_cli.main([item for option, values in argv.items() for item in (option, *values)])
    assert exit_info.value.code == 2 and f"the following arguments are required: {missing}" in capsys.readouterr().err


@pytest.mark.parametrize("tp,world_size,refused", [(2, None, True), (None, "2", True), (1, "1", False),
                                                   (None, None, False)])
def test_tensor_parallelism_is_refused_first(tp, world_size, refused, tmp_path, capsys, monkeypatch):
    """Under --tp N > 1 or torchrun's WORLD_SIZE > 1 the command stops with a usage error before anything else is
    checked (here: a checkpoint folder that does not exist)."""
    if world_size is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world_size)
    argv = ["--model", str(tmp_path / "none"), "--videos", "a.mp4", "--out", str(tmp_path / "o.json")]
    line = error_line(profile_cli.main, capsys, argv + (["--tp", str(tp)] if tp else []), 2 if refused else 1)
    assert line.startswith("error: tp: hermes-profile runs in one process") == refused
    assert refused or line.startswith("error: model: no such folder")


def test_a_bad_device_is_refused_before_the_checkpoint_and_the_videos(tmp_path, capsys):
    argv = ["--model", str(tmp_path / "none"), "--videos", str(tmp_path / "none.mp4"), "--out",
            str(tmp_path / "o.json"), "--device", "tpu"]
    assert error_line(profile_cli.main, capsys, argv, 2).startswith("error: device: expected")


def test_the_summary_names_the_file_the_model_and_every_head():
    classes = torch.tensor([[0, 1, 2]] * 10 + [[2, 2, 1]])
    grid = torch.zeros(11, 3, dtype=torch.float64)
    profile = HeadProfile(model_name="", model_type="qwen2_5_vl", num_layers=11, num_kv_heads=3, num_heads=6,
                          instant_ratio=0.1, short_ratio=0.4, head_map=classes, v2v=grid, t2v=grid, scores=grid,
                          clips=[{"frames": 4}, {"frames": 7}], settings={})
    lines = profile_cli.summary(profile, "out/map.json").split("\n")
    assert lines[0] == ("wrote out/map.json: qwen2_5_vl (unnamed), 11 layers x 3 KV heads, 2 clip(s), 11 frames; "
                        "instant 10, short 11, episodic 12")
    assert lines[1:3] == ["layer  0: i s e", "layer  1: i s e"] and lines[-1] == "layer 10: e e s" and len(lines) == 12
    profile.model_name = "ckpts/q"
    assert profile_cli.summary(profile, "m.json").startswith("wrote m.json: qwen2_5_vl (ckpts/q), ")


def test_help_is_as_written(monkeypatch, capsys):
    """The whole --help text at 100 columns. After changing it on purpose, write the new text to the file:
    COLUMNS=100 python -m hermes.profile_cli --help > tests/hermes/help/hermes-profile.txt"""
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit) as exit_info:
        profile_cli.main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert text == (HELP / "hermes-profile.txt").read_text()
    assert all(model_type in text for model_type in FAMILIES), "--model's help names every supported model type"
    assert isinstance(profile_cli.parser(), argparse.ArgumentParser)


def test_help_states_the_profiler_s_own_default_question():
    """--help quotes the default question without importing the profiler (tests/hermes/test_imports.py); the run
    asks the profiler's DEFAULT_QUESTIONS: the two agree."""
    assert DEFAULT_QUESTIONS == (profile_cli.DEFAULT_QUESTION,)


@pytest.mark.parametrize("option,value,name", [("--max-frames", "0", "max_frames"), ("--answer-tokens", "-1",
                                                                                      "answer_tokens")])
def test_bad_settings_are_refused_before_the_model_loads(option, value, name, tiny_checkpoints, clip, tmp_path,
                                                         capsys, monkeypatch):
    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(profile_cli, "load_model", no_load)
    argv = ["--model", tiny_checkpoints["llava_onevision"], "--videos", clip, "--out", str(tmp_path / "o.json"),
            option, value]
    assert error_line(profile_cli.main, capsys, argv, 2).startswith(f"error: {name}: ")


def test_the_device_and_dtype_asked_for_are_the_ones_loaded(tiny_checkpoints, clip, tmp_path, capsys, monkeypatch):
    asked = []

    def recording(*args):
        asked.append(args)
        raise MemoryError("stop here")

    monkeypatch.setattr(profile_cli, "load_model", recording)
    argv = ["--model", tiny_checkpoints["llava_onevision"], "--videos", clip, "--out", str(tmp_path / "o.json"),
            "--device", "cpu", "--dtype", "float16"]
    assert error_line(profile_cli.main, capsys, argv, 1).startswith("error: ")
    assert asked == [(tiny_checkpoints["llava_onevision"], "cpu", "float16")]

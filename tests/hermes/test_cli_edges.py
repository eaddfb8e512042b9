"""`hermes` (hermes.cli) at its edges, in-process: the Python entry points' defaults are the command's, the parsed
options' defaults and types, the names in refusals, questions asked at one time in the order given, the checks
of an already loaded model, the progress bar, the chunk records' fields, the text output and the terminal prompt.
Whole runs and the error contract: test_cli.py and test_commands.py."""
import inspect
import io

import pytest

from hermes import cli
from hermes.commands import UsageError
from tests.hermes.video_files import write_video

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    return write_video(tmp_path_factory.mktemp("clips") / "clip.mp4", [i / 4 for i in range(40)])  # 10 s


def test_the_python_entry_points_default_to_the_command_s_settings():
    args = cli.parser().parse_args(["--model", "m", "--video", "v.mp4"])
    for function in (cli.run, cli.check_run):
        defaults = {name: p.default for name, p in inspect.signature(function).parameters.items()}
        for name in ("fps", "chunk_frames", "budget", "policy", "head_map", "device", "dtype", "max_new_tokens",
                     "tp"):
            assert defaults[name] == getattr(args, name), (function.__name__, name)
    assert inspect.signature(cli.run).parameters["progress"].default is False


def test_parsed_defaults_and_types():
    args = cli.parser().parse_args(["--model", "m", "--video", "v.mp4"])
    assert vars(args) == dict(model="m", video="v.mp4", question=[], ask_at=[], fps=1.0, chunk_frames=16,
                              budget=6000, policy="hermes", head_map=None, max_new_tokens=64, json=False, tp=None,
                              device=None, dtype="auto", threads=None, quiet=False, traceback=False, live=None,
                              realtime=False, max_lag=None, open_timeout=None, stall_timeout=None, reconnect=None,
                              questions=None, watch=None, verbose=False)
    args = cli.parser().parse_args(["--model", "m", "--video", "v.mp4", "--fps", "2", "--chunk-frames", "4",
                                    "--budget", "100", "--max-new-tokens", "3", "--tp", "2"])
    typed = (args.fps, args.chunk_frames, args.budget, args.max_new_tokens, args.tp)
    assert typed == (2.0, 4, 100, 3, 2) and [type(v) for v in typed] == [float, int, int, int, int]


@pytest.mark.parametrize("setting,value", [("fps", 0), ("chunk_frames", 0), ("budget", 0), ("max_new_tokens", 0)])
def test_a_bad_setting_is_refused_with_its_name(setting, value, clip, tiny_checkpoints):
    with pytest.raises(UsageError, match=f"^{setting}: "):
        cli.check_run(tiny_checkpoints["llava_onevision"], clip, **{setting: value})


def test_questions_at_one_time_keep_their_order(clip, loaded):
    check = cli.check_run(loaded["llava_onevision"], clip, ask_at=["4:b", "2:z", "4:a", (1, "y")], chunk_frames=4,
                          budget=200)
    assert check.schedule == [(1.0, "y"), (2.0, "z"), (4.0, "b"), (4.0, "a")]


def test_a_loaded_model_is_checked_as_it_is(clip, loaded):
    model = loaded["llava_onevision"]
    check = cli.check_run(model, clip, chunk_frames=4, budget=200, device="cuda:7", dtype="float16")  # unused
    assert check.device == model.device and check.dtype == next(model.model.parameters()).dtype
    assert check.tp == 1 and check.family is model.family and check.processor is model.processor


def test_progress_bar_and_chunk_records(clip, loaded, capsys):
    """Frames at 0 .. 9.75 s sampled at 1 fps: 10 samples, 3 chunks of 4 frames (the bar's total); one record per
    chunk with its fields."""
    records = cli.run(loaded["llava_onevision"], clip, chunk_frames=4, budget=200, questions=["what ?"],
                      progress=True, max_new_tokens=2)
    err = capsys.readouterr().err
    assert "3/3" in err and "chunk" in err and "ms/chunk" in err
    chunks = [r for r in records if r["type"] == "chunk"]
    assert [r["index"] for r in chunks] == [0, 1, 2] and [r["frames"] for r in chunks] == [4, 4, 2]
    assert set(chunks[0]) == {"type", "index", "frames", "start", "end", "sources", "prepare_ms", "latency_ms",
                              "compressed", "cache_length", "cache_capacity", "positions", "steps", "cache_bytes"}
    assert all(0 <= r["latency_ms"] < 60_000 and 0 <= r["prepare_ms"] < 60_000 for r in chunks)
    (answer,) = [r for r in records if r["type"] == "answer"]
    assert answer["at"] == chunks[-1]["end"] and 0 <= answer["latency_ms"] < 60_000
    cli.run(loaded["llava_onevision"], clip, chunk_frames=4, budget=200)
    assert capsys.readouterr().err == ""


def test_text_output_prints_answers_with_their_time(capsys):
    cli._print_record({"type": "answer", "question": "q?", "answer": "a.", "at": 75.25}, as_json=False)
    cli._print_record({"type": "chunk", "index": 0}, as_json=False)
    assert capsys.readouterr().out == "[1:15.2] Q: q?\n           A: a.\n"
    cli._print_record({"type": "chunk", "index": 0}, as_json=True)
    assert capsys.readouterr().out == '{"type": "chunk", "index": 0}\n'


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_the_terminal_gets_a_prompt_and_a_pipe_does_not(capsys, monkeypatch):
    assert list(cli.terminal_questions(Terminal("first\n second \n\nlater\n"))) == ["first", "second"]
    assert capsys.readouterr().err == "question> " * 3
    monkeypatch.setattr("sys.stdin", io.StringIO("piped\n"))
    assert list(cli.terminal_questions()) == ["piped"]
    assert capsys.readouterr().err == ""

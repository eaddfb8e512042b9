"""The commands' error contract at its edges (docs/cli.md#stream-a-video-file): an out-of-memory error is one line
and exit 1, not an internal error; Ctrl-C is exit 130; a question timed exactly at the video's length is asked; a
setting refused before anything loads (exit 2)."""
import pytest
import torch

from hermes import cli
from hermes.video import VideoReader
from tests.hermes.video_files import write_video
from tests.utils import error_line

pytestmark = pytest.mark.usefixtures("single_thread")

QUESTION = "what is the person holding ?"


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    """4 fps, frames at 0 .. 5.75 s: the video's length is 5.75 s."""
    return write_video(tmp_path_factory.mktemp("commands") / "clip.mp4", [i / 4 for i in range(24)])


def _argv(model, video, *extra):
    return ["--model", model, "--video", video, "--chunk-frames", "2", "--budget", "20", "--max-new-tokens", "2",
            "--question", QUESTION, "--quiet", "--device", "cpu", *extra]


@pytest.mark.parametrize("error,status,line", [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), 1,
     "error: CUDA out of memory. Tried to allocate 2.00 GiB"),
    (KeyboardInterrupt(), 130, "error: interrupted"),
])
def test_out_of_memory_and_ctrl_c_are_one_line(error, status, line, capsys, monkeypatch):
    """A run that runs out of memory prints that error's own line and exits 1 (a user can act on it: a smaller budget
    or chunk); Ctrl-C prints `error: interrupted` and exits 130; neither prints a traceback."""
    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(cli, "check_arguments", lambda *a, **k: None)  # no files: the run fails at once
    monkeypatch.setattr(cli, "run", fail)
    assert error_line(cli.main, capsys, _argv("model", "video.mp4"), status) == line


def test_a_question_at_exactly_the_videos_length_is_asked(loaded, clip):
    """An --ask-at time equal to the video's length (the stream header's: 5.751 s, the last frame at 5.75 s lasting
    1 ms) is accepted and asked after the last chunk; a time 1 ms later is past the end."""
    with VideoReader(clip) as reader:
        length = reader.duration
    records = cli.run(loaded["llava_onevision"], clip, ask_at=[(length, QUESTION)], fps=1, chunk_frames=2, budget=20,
                      max_new_tokens=2)
    assert [r["type"] for r in records] == ["chunk", "chunk", "chunk", "answer"]
    assert records[-1]["question"] == QUESTION and records[-1]["at"] == 5.0
    with pytest.raises(cli.UsageError, match=r"ask_at: 5.752 s is past the end of the video \(5.75 s\)"):
        cli.check_run(loaded["llava_onevision"], clip, ask_at=[(length + 0.001, QUESTION)], chunk_frames=2, budget=20)


def test_max_new_tokens_zero_is_refused_before_anything_loads(clip, capsys, monkeypatch):
    """--max-new-tokens 0: exit 2 with one line naming max_new_tokens, before the video, the checkpoint or the
    weights are read."""
    for name in ("load_model", "check_checkpoint", "load_processor", "VideoReader"):
        monkeypatch.setattr(cli, name, lambda *a, _name=name, **k: pytest.fail(f"{_name} ran before the checks"))
    argv = _argv("no-such-model", clip)
    argv[argv.index("--max-new-tokens") + 1] = "0"
    line = error_line(cli.main, capsys, argv, 2)
    assert line == "error: max_new_tokens: expected a positive int, got 0"

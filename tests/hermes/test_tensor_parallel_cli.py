"""The commands under tensor parallelism (docs/multi-gpu.md#launch): `torchrun --nproc-per-node 2 -m hermes --tp 2`
streams a video as one process does (LLaVA-OV; Qwen3-VL and Gemma 4, loaded with their families' tp_plans), rank 0
printing the records and the one progress bar, rank 1 nothing; settings that cannot work (--tp without torchrun, a tp
that does not divide the KV heads, processes without --tp, questions from standard input) are one line before any
weights load; `hermes-profile` refuses --tp.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from hermes import cli, profile_cli
from scaffolding.checkpoint import save_tiny_checkpoint
from tests.hermes.video_files import write_video
from tests.utils import REPO, error_line

pytestmark = pytest.mark.usefixtures("single_thread")

QUESTION = "what is the person holding ?"
RUN = ["--fps", "1", "--chunk-frames", "4", "--budget", "20", "--max-new-tokens", "6"]
LAUNCH = ("RANK", "LOCAL_RANK", "WORLD_SIZE")
TIMINGS = ("prepare_ms", "latency_ms")


@pytest.fixture(scope="module")
def video(tmp_path_factory):
    return write_video(tmp_path_factory.mktemp("videos") / "clip.mp4", [i / 4 for i in range(40)])  # 10 s, 3 chunks


@pytest.fixture(scope="module")
def folders(tiny_checkpoints, tmp_path_factory) -> dict:
    """model_type -> tiny checkpoint folder: the shared ones, Qwen3-VL's and Gemma 4's."""
    return {**tiny_checkpoints, **{model_type: save_tiny_checkpoint(tmp_path_factory.mktemp(model_type), model_type)
                                   for model_type in ("qwen3_vl", "gemma4")}}


def _launched(monkeypatch, world: int | None, rank: int = 0) -> None:
    """This process as torchrun's rank `rank` of `world` (None: not launched by torchrun)."""
    for name in LAUNCH:
        monkeypatch.delenv(name, raising=False)
    if world is not None:
        for name, value in zip(LAUNCH, (rank, rank, world)):
            monkeypatch.setenv(name, str(value))


@pytest.mark.parametrize("case, world, args, message", [
    ("--tp without torchrun", None, ["--tp", "2", "--question", QUESTION],
     r"^error: tp: --tp 2 needs 2 processes in one process group: launch with torchrun --nproc-per-node 2 -m hermes "
     r"--tp 2 \.\.\.$"),
    ("tp does not divide the KV heads", 4, ["--tp", "4", "--question", QUESTION],
     r"^error: tp: the model's 2 KV heads per layer do not split evenly over --tp 4; pick a tp that divides 2$"),
    ("processes without --tp", 2, ["--question", QUESTION],
     r"^error: tp: torchrun started 2 processes and --tp is 1; they must be equal$"),
    ("torchrun and --tp disagree", 2, ["--tp", "4", "--question", QUESTION],
     r"^error: tp: torchrun started 2 processes and --tp is 4"),
    ("questions from standard input", 2, ["--tp", "2"], r"^error: question: under --tp pass the questions with"),
    ("an indexed device", 2, ["--tp", "2", "--question", QUESTION, "--device", "cpu:0"],
     r"^error: device: under --tp every rank runs on cpu"),
])
def test_tp_settings_that_cannot_work_are_one_line_before_weights(case, world, args, message, tiny_checkpoints, video,
                                                                  capsys, monkeypatch):
    monkeypatch.setattr(cli, "load_model", lambda *a, **k: pytest.fail("the model loaded before the checks"))
    _launched(monkeypatch, world)
    line = error_line(cli.main, capsys, ["--model", tiny_checkpoints["llava_onevision"], "--video", video, "--quiet",
                                         *RUN, *args], status=2)
    assert re.search(message, line), line


def test_other_ranks_leave_usage_errors_to_rank_0(tiny_checkpoints, video, capsys, monkeypatch):
    """Every rank finds a usage error alike: rank 1 exits with the same status and prints nothing."""
    _launched(monkeypatch, 4, rank=1)
    assert cli.main(["--model", tiny_checkpoints["llava_onevision"], "--video", video, "--tp", "4", "--question",
                     QUESTION, *RUN]) == 2
    assert capsys.readouterr() == ("", "")


@pytest.mark.parametrize("world, args", [(None, ["--tp", "2"]), (2, [])])
def test_profile_refuses_tensor_parallelism(world, args, tiny_checkpoints, video, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(profile_cli, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    _launched(monkeypatch, world)
    line = error_line(profile_cli.main, capsys, ["--model", tiny_checkpoints["llava_onevision"], "--videos", video,
                                                 "--out", str(tmp_path / "map.json"), *args], status=2)
    assert line == ("error: tp: hermes-profile runs in one process (it ranks every head of every layer together); "
                    "run it without torchrun and without --tp")


def _without_timings(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMINGS + ("cache_bytes",)} for r in records]


@pytest.mark.parametrize("model_type", ["llava_onevision", "qwen3_vl", "gemma4"])
def test_torchrun_streams_as_one_process(model_type, folders, video, capsys, monkeypatch):
    """torchrun --nproc-per-node 2 -m hermes --tp 2 --json: the records of one process (the cache's bytes are rank
    0's share), printed once; the progress bar drawn as often as one process draws it (rank 1 draws none); exit
    0. Qwen3-VL: transformers' plan would leave its heads whole; Gemma 4: transformers' plan splits the vocabulary,
    which its forward from ids cannot take (docs/gemma4.md); the command loads each with its family's tp_plan."""
    _launched(monkeypatch, None)
    argv = ["--model", folders[model_type], "--video", video, "--question", QUESTION, *RUN,
            "--threads", "1", "--json"]
    assert cli.main(argv + ["--device", "cpu"]) == 0
    one = capsys.readouterr()
    expected = [json.loads(line) for line in one.out.splitlines()]
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "hermes", "--tp", "2",
               *argv]
    done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in done.stdout.splitlines()]
    assert _without_timings(records) == _without_timings(expected)
    chunks = [(r, e) for r, e in zip(records, expected) if r["type"] == "chunk"]
    assert len(chunks) == 3 and all(r["cache_bytes"] < e["cache_bytes"] for r, e in chunks)
    assert done.stderr.count(" 0/3 [") == one.err.count(" 0/3 [") > 0, done.stderr
    assert "Traceback" not in done.stderr and "error" not in done.stderr and "warning" not in done.stderr

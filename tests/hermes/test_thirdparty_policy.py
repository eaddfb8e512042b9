"""A policy from an installed package (an entry point of the group hermes.policies; docs/policies.md#registry) is
usable everywhere without touching our code: `hermes --policy fifo` in a fresh process streams and answers as
`hermes.cli.run(..., policy="fifo")` in this one, and `lmms-eval --model hermes --model_args policy=fifo,...` answers
as the stream driven by hand. An unknown name is refused before anything loads, naming the policy and listing the
known names; a broken package fails only the runs that ask for its policy. The package (tests/hermes/thirdparty.py)
re-exports the FIFO test policy and is imported by nothing but its entry point."""
import json
import os
import subprocess
import sys

import pytest

import hermes.registry as registry
import tests.hermes.stream as stream_tests
from hermes import cli
from hermes.commands import UsageError, load_model
from hermes.eval.settings import check_checkpoint_settings, parse_model_args
from scaffolding.checkpoint import save_tiny_checkpoint
from tests.hermes.eval.tasks import CHUNK_FRAMES, FPS, expected_mc, mc_docs, run_lmms_eval, write_tasks
from tests.hermes.stream import fifo_policy
from tests.hermes.thirdparty import FIFO_PACKAGE, write_distribution, write_fifo
from tests.hermes.video_files import write_video
from tests.utils import REPO, error_line

pytestmark = pytest.mark.usefixtures("single_thread")

QUESTION = "what is the person holding ?"
RUN = dict(fps=1, chunk_frames=4, max_new_tokens=4)
TIMINGS = ("prepare_ms", "latency_ms")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("llava_onevision"), "llava_onevision")


@pytest.fixture(scope="module")
def loaded(checkpoint):
    return load_model(checkpoint, device="cpu")


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    """4 fps, 0 .. 9.75 s: 10 samples at 1 fps, chunks of 4, 4 and 2 frames."""
    return write_video(tmp_path_factory.mktemp("clips") / "clip.mp4", [i / 4 for i in range(40)])


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The folder holding thirdparty_fifo and its dist-info: what PYTHONPATH points at to install it."""
    return write_fifo(tmp_path_factory.mktemp("site"))


@pytest.fixture
def installed(site, monkeypatch):
    """thirdparty_fifo on sys.path and the registry as if "fifo" had never been registered in this process (the FIFO
    test policy's module, which the shared stream tests import, is imported again through the entry point); all
    restored afterwards."""
    monkeypatch.setattr(registry, "_REGISTERED", {name: policy for name, policy in registry._REGISTERED.items()
                                                  if name != "fifo"})
    monkeypatch.delitem(sys.modules, fifo_policy.__name__)
    monkeypatch.setattr(stream_tests, "fifo_policy", fifo_policy)  # the package attribute the new import replaces
    monkeypatch.syspath_prepend(site)
    yield
    sys.modules.pop(FIFO_PACKAGE, None)


def python_path(*folders: str) -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [*folders, os.environ.get("PYTHONPATH")])))


def without_timings(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMINGS} for r in records]


def test_the_command_and_run_stream_with_an_installed_policy(checkpoint, loaded, clip, site, installed):
    """`python -m hermes --policy fifo` with the package on PYTHONPATH: exit 0 and the records of `run(...,
    policy="fifo")` here, whose first lookup of "fifo" imported the package. FIFO's signature: a step after every
    chunk and the same cache length once three frames are held, whatever a chunk brings (4, 4, 2 frames)."""
    assert FIFO_PACKAGE not in sys.modules and "fifo" not in registry._REGISTERED
    records = cli.run(loaded, clip, questions=[QUESTION], policy="fifo", **RUN)
    assert FIFO_PACKAGE in sys.modules and registry._REGISTERED["fifo"].__module__ == fifo_policy.__name__
    chunks = [r for r in records if r["type"] == "chunk"]
    assert [r["frames"] for r in chunks] == [4, 4, 2] and all(r["compressed"] for r in chunks)
    assert len({r["cache_length"] for r in chunks}) == 1
    assert [r["question"] for r in records if r["type"] == "answer"] == [QUESTION]
    command = [sys.executable, "-m", "hermes", "--model", checkpoint, "--video", clip, "--question", QUESTION,
               "--policy", "fifo", "--fps", "1", "--chunk-frames", "4", "--max-new-tokens", "4", "--device", "cpu",
               "--threads", "1", "--json", "--quiet"]
    done = subprocess.run(command, env=python_path(site, REPO), cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert without_timings([json.loads(line) for line in done.stdout.splitlines()]) == without_timings(records)


def test_an_unknown_policy_is_refused_before_anything_loads(checkpoint, clip, installed, capsys, monkeypatch):
    """Neither registered nor installed: exit 2, one line naming the policy and listing every known name (the
    installed one too, not imported for it), before the checkpoint is read; `run` raises the same."""
    for name in ("check_checkpoint", "load_model"):
        monkeypatch.setattr(cli, name, lambda *a, _name=name, **k: pytest.fail(f"{_name} ran before the checks"))
    line = error_line(cli.main, capsys, ["--model", checkpoint, "--video", clip, "--question", QUESTION, "--policy",
                                         "nope", "--quiet"], status=2)
    assert line.startswith("error: policy: expected one of [") and line.endswith("], got 'nope'")
    assert {"'fifo'", "'h2svc'", "'hermes'"} <= set(line.split("[")[1].split("]")[0].split(", "))
    assert FIFO_PACKAGE not in sys.modules
    with pytest.raises(UsageError, match=r"^policy: expected one of \[.*'fifo'.*\], got 'nope'$"):
        cli.run(checkpoint, clip, policy="nope")


def test_a_broken_installed_policy_fails_only_the_runs_that_ask_for_it(loaded, checkpoint, clip, tmp_path, capsys,
                                                                       monkeypatch):
    """A package whose module raises on import: `--policy broken-3p` is one line naming its entry point and its
    distribution (exit 1), before any weights load; a run with a built-in policy checks as ever."""
    monkeypatch.syspath_prepend(write_distribution(tmp_path, "broken_3p", {"broken-3p": "broken_3p"},
                                                   "raise RuntimeError('half installed')\n"))
    monkeypatch.setattr(cli, "load_model", lambda *a, **k: pytest.fail("the model loaded before the checks"))
    line = error_line(cli.main, capsys, ["--model", checkpoint, "--video", clip, "--question", QUESTION, "--policy",
                                         "broken-3p", "--chunk-frames", "4", "--quiet", "--device", "cpu"], status=1)
    assert line == ("error: policy: entry point broken-3p = broken_3p (group hermes.policies) of the distribution "
                    "broken_3p 0.1 failed to load: RuntimeError: half installed")
    assert cli.check_run(loaded, clip, chunk_frames=4, budget=200).tp == 1


# ---- lmms-eval --model hermes ---------------------------------------------------------------------------------
def test_the_plugin_takes_an_installed_policy_with_its_own_defaults(checkpoint, installed):
    """policy=fifo: its stream arguments are the name alone (no budget, no re-indexing mode), the package is imported
    by the checks before the weights; a budget, a head map or a re-indexing mode for it is one line each; an unknown
    name lists the known ones, the installed one too."""
    settings = parse_model_args(pretrained=checkpoint, policy="fifo")
    assert settings.budget is None and settings.stream_kwargs("generate_until") == {"policy": "fifo"}
    assert FIFO_PACKAGE not in sys.modules
    check_checkpoint_settings(settings)
    assert FIFO_PACKAGE in sys.modules
    with pytest.raises(ValueError) as info:
        parse_model_args(pretrained=checkpoint, policy="fifo", budget=100, head_map="map.json", reindex="lazy")
    assert str(info.value).splitlines() == [
        "budget: only policy=hermes takes a budget; policy=fifo takes none",
        "head_map: only policy=h2svc takes a head map",
        "reindex: only policy=hermes and policy=h2svc take a re-indexing mode; policy=fifo takes none (leave "
        "reindex=auto)"]
    with pytest.raises(ValueError, match=r"^policy: expected one of \[.*'fifo'.*\], got 'nope'$"):
        parse_model_args(pretrained=checkpoint, policy="nope")


def test_lmms_eval_answers_with_an_installed_policy(checkpoint, loaded, site, installed, tmp_path, monkeypatch):
    """`lmms-eval --model hermes --model_args policy=fifo,...` on the local generate_until task, the package on
    PYTHONPATH: every answer equals a FIFO stream driven by hand (cut at the task's "?"); the corrupt video's is
    empty."""
    tasks = write_tasks(tmp_path / "lmms")
    args = f"pretrained={checkpoint},policy=fifo,fps={FPS},chunk_frames={CHUNK_FRAMES},device=cpu,max_new_tokens=8"
    monkeypatch.setenv("PYTHONPATH", python_path(site)["PYTHONPATH"])
    done, samples = run_lmms_eval(tmp_path, tasks["include_path"], "hermes_mc", args)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    expected = expected_mc(loaded, mc_docs(tasks), "fifo", None)
    assert [s["filtered_resps"] for s in samples["hermes_mc"]] == expected
    assert expected[2] == "" and sum(answer != "" for answer in expected) >= 3  # the random model may say nothing

"""Qwen3.5 and Qwen3.5-MoE through saved tiny checkpoints: `python -m hermes --model DIR` under both policies (the
family found from config.json's model_type, the hybrid cache behind it), the H2SVC profiler routing the
full-attention layers only, and a checkpoint whose `layer_types` names a kind the caches do not hold refused from
its config before any weight loads (docs/qwen3_5.md)."""
import json
import os
import subprocess
import sys

import pytest

from hermes import cli
from hermes.commands import check_checkpoint, load_model
from hermes.linear_state import LINEAR
from hermes.policies.h2svc.head_map import load_head_map
from scaffolding.checkpoint import save_tiny_checkpoint
from tests.hermes.streams import QUESTION
from tests.hermes.video_files import write_video
from tests.utils import REPO

pytestmark = pytest.mark.usefixtures("single_thread")

RUN = ["--fps", "1", "--chunk-frames", "4", "--budget", "20", "--max-new-tokens", "3", "--question", QUESTION]
ENV = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {kind: save_tiny_checkpoint(tmp_path_factory.mktemp(kind), kind) for kind in ("qwen3_5", "qwen3_5_moe")}


@pytest.fixture(scope="module")
def video(tmp_path_factory):
    return write_video(tmp_path_factory.mktemp("videos") / "cfr.mp4", [i / 4 for i in range(40)])  # 10 s at 4 fps


def records_of(done) -> list[dict]:
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe"])
def test_the_command_streams_the_hybrid_checkpoint(checkpoints, video, kind):
    """`python -m hermes` on the saved checkpoint: exit 0, chunks of 4, 4, 2 frames, each compressing (HERMES) and
    an answer; H2SVC in this process on the same checkpoint steps every chunk and answers."""
    done = subprocess.run([sys.executable, "-m", "hermes", "--model", checkpoints[kind], "--video", video, *RUN,
                           "--device", "cpu", "--threads", "1", "--json", "--quiet"], env=ENV, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    records = records_of(done)
    assert [r["frames"] for r in records if r["type"] == "chunk"] == [4, 4, 2]
    assert all(r["compressed"] for r in records if r["type"] == "chunk")
    assert [r["type"] for r in records][-1] == "answer"
    loaded = load_model(checkpoints[kind], device="cpu")
    assert LINEAR in loaded.model.config.get_text_config().layer_types
    with pytest.warns(UserWarning, match="not profiled"):
        h2svc = cli.run(loaded, video, questions=[QUESTION], fps=1, chunk_frames=4, policy="h2svc", max_new_tokens=2)
    assert [r["type"] for r in h2svc] == ["chunk"] * 3 + ["answer"]


def test_the_profile_command_routes_the_full_attention_layers(checkpoints, video, tmp_path):
    """`hermes-profile` on the hybrid checkpoint: a map with one row per full-attention layer (3 of the 6 decoder
    layers), which a stream of the same model loads."""
    out = tmp_path / "map.json"
    done = subprocess.run(
        [sys.executable, "-m", "hermes.profile_cli", "--model", checkpoints["qwen3_5"], "--videos", video, "--out",
         str(out), "--chunk-frames", "4", "--question", QUESTION, "--threads", "1", "--quiet"],
        cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    loaded = load_model(checkpoints["qwen3_5"], device="cpu")
    profile = load_head_map(out, loaded.model)
    kinds = loaded.model.config.get_text_config().layer_types
    assert len(kinds) == 6 and profile.num_layers == kinds.count("full_attention") == 3
    assert len(profile.head_map) == 3


def test_an_unhandled_layer_kind_is_refused_before_the_weights(checkpoints, video, tmp_path):
    """A checkpoint whose config names a sliding-window layer: the command exits 2 with one line naming the kind,
    and no weight file is ever opened (the folder holds none)."""
    folder = tmp_path / "sliding"
    folder.mkdir()
    with open(os.path.join(checkpoints["qwen3_5"], "config.json")) as f:
        config = json.load(f)
    config["text_config"]["layer_types"][1] = "chunked_attention"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(Exception, match="chunked_attention"):
        check_checkpoint(folder)
    done = subprocess.run([sys.executable, "-m", "hermes", "--model", str(folder), "--video", video, *RUN,
                           "--device", "cpu"], env=ENV, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "layer_types" in lines[0] and "'chunked_attention'" in lines[0], lines


def test_the_checks_build_the_preset_over_the_full_attention_layers(checkpoints, video, monkeypatch):
    """`check_run`'s budget check builds the HERMES preset the stream builds: over the 3 full-attention layers of
    the 6 decoder layers (docs/qwen3_5.md), not over every decoder layer."""
    from hermes_kernels import HermesConfig
    seen = []
    build = HermesConfig.preset.__func__
    monkeypatch.setattr(HermesConfig, "preset", classmethod(
        lambda cls, name, num_layers, *args, **kwargs: seen.append((name, num_layers)) or build(
            cls, name, num_layers, *args, **kwargs)))
    cli.check_run(checkpoints["qwen3_5"], video, chunk_frames=4, budget=20, device="cpu")
    assert seen == [("qwen3_5", 3)]

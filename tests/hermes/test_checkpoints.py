"""Checkpoints as a trust boundary (docs/security.md#checkpoints): `hermes` and `hermes-profile` read local folders
only, nothing of a checkpoint's reaches the network or runs as code, and weights come from safetensors files. The
rule lives in `hermes.commands` (`checkpoint_folder`, `LOCAL_ONLY`, `weights_options`); these tests drive it through
the commands and through the helpers an evaluation harness calls."""
import json
import os
import pathlib
import re
import shutil
import socket
import sys

import pytest
import safetensors.torch
import torch
from transformers import AutoConfig, AutoImageProcessor, AutoModelForImageTextToText, AutoProcessor, AutoTokenizer
from transformers.video_processing_utils import BaseVideoProcessor

from hermes import cli, commands
from hermes import profile_cli
from tests.hermes.video_files import write_video
from tests.utils import REPO, error_line

pytestmark = pytest.mark.usefixtures("single_thread")

HUB_NAME = "Qwen/Qwen2.5-VL-7B-Instruct"
READERS = (AutoConfig, AutoModelForImageTextToText, AutoProcessor, AutoTokenizer, AutoImageProcessor)
# code a checkpoint may ship: importing it leaves a marker file beside it
PLANTED = "import pathlib\npathlib.Path(__file__).with_name('planted-ran').touch()\n"


@pytest.fixture
def reads(monkeypatch):
    """Every checkpoint read that code under hermes/ makes: (what, path, keyword arguments), in order."""
    calls = []

    def spy(name, real):
        def read(cls, path, *args, **kwargs):
            if sys._getframe(1).f_code.co_filename.startswith(os.path.join(REPO, "hermes") + os.sep):
                calls.append((name, os.fspath(path), kwargs))
            return real.__func__(cls, path, *args, **kwargs)
        return classmethod(read)

    for cls in READERS:
        monkeypatch.setattr(cls, "from_pretrained", spy(cls.__name__, cls.from_pretrained))
    monkeypatch.setattr(BaseVideoProcessor, "get_video_processor_dict",
                        spy("get_video_processor_dict", BaseVideoProcessor.get_video_processor_dict))
    return calls


@pytest.fixture
def no_network(monkeypatch):
    """Any socket connection fails the test (and is recorded, in case the failure is caught)."""
    attempts = []

    def refuse(*args, **kwargs):
        attempts.append(args)
        raise AssertionError(f"a network connection was attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    return attempts


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    return write_video(tmp_path_factory.mktemp("clip") / "clip.mp4", [i / 4 for i in range(12)])  # 3 s at 4 fps


@pytest.fixture
def checkpoint(tiny_checkpoints, tmp_path):
    """A copy of the tiny LLaVA-OV checkpoint this test may change."""
    return shutil.copytree(tiny_checkpoints["llava_onevision"], tmp_path / "checkpoint")


def check_and_load(path, clip):
    """What `hermes` does with a checkpoint before streaming: `check_run` (config, processor), then `load_model`."""
    cli.check_run(path, clip, chunk_frames=2, budget=20, device="cpu")
    return commands.load_model(path, device="cpu")


def test_every_checkpoint_read_is_local_and_runs_no_checkpoint_code(checkpoint, clip, reads):
    """Every from_pretrained the commands make passes local_files_only=True and trust_remote_code=False, the
    weights use_safetensors=True (the folder has model.safetensors); the reads cover config, weights, tokenizer
    and processors, so none is missed."""
    check_and_load(checkpoint, clip)
    assert {name for name, _, _ in reads} >= {"AutoConfig", "AutoModelForImageTextToText", "AutoTokenizer",
                                              "AutoImageProcessor", "get_video_processor_dict"}, reads
    for name, path, kwargs in reads:
        assert path == str(checkpoint) and kwargs.get("local_files_only") is True, (name, kwargs)
        if name != "get_video_processor_dict":  # it takes no trust_remote_code (it reads JSON only)
            assert kwargs.get("trust_remote_code") is False, (name, kwargs)
    weights = [kwargs for name, _, kwargs in reads if name == "AutoModelForImageTextToText"]
    assert weights and all(kwargs.get("use_safetensors") is True for kwargs in weights)


@pytest.mark.parametrize("command", ["hermes", "hermes-profile"])
def test_a_name_that_is_not_a_local_folder_is_refused_before_the_network(command, clip, tmp_path, reads, no_network,
                                                                         capsys, monkeypatch):
    """A Hub name (no such local folder): one line, status 1, before any from_pretrained and any connection."""
    monkeypatch.chdir(tmp_path)  # no folder of that name here
    if command == "hermes":
        main, argv = cli.main, ["--video", clip, "--question", "q"]
    else:
        main, argv = profile_cli.main, ["--videos", clip, "--out", str(tmp_path / "map.json")]
    line = error_line(main, capsys, ["--model", HUB_NAME, "--chunk-frames", "2", "--device", "cpu", "--quiet", *argv])
    assert line == (f"error: model: no such folder: {HUB_NAME} (expected a local checkpoint folder; names on the "
                    f"Hugging Face Hub are not downloaded: download it first, then pass its folder)")
    assert reads == [] and no_network == []


def test_code_shipped_with_a_checkpoint_never_runs(checkpoint, clip, no_network):
    """Every config names planted code (auto_map) for config, model, tokenizer and processors: the checkpoint
    loads with transformers' own classes and the planted module is never imported."""
    (checkpoint / "planted.py").write_text(PLANTED)
    maps = {"config.json": {"AutoConfig": "planted.Config", "AutoModelForImageTextToText": "planted.Model"},
            "tokenizer_config.json": {"AutoTokenizer": ["planted.Tokenizer", "planted.Tokenizer"]},
            "preprocessor_config.json": {"AutoImageProcessor": "planted.ImageProcessor"},
            "video_preprocessor_config.json": {"AutoVideoProcessor": "planted.VideoProcessor"},
            "processor_config.json": {"AutoProcessor": "planted.Processor"}}
    for name, auto_map in maps.items():
        content = json.loads((checkpoint / name).read_text())
        (checkpoint / name).write_text(json.dumps({**content, "auto_map": auto_map}))
    loaded = check_and_load(checkpoint, clip)
    assert type(loaded.model).__module__.startswith("transformers.models.llava_onevision")
    assert not (checkpoint / "planted-ran").exists(), "code shipped with the checkpoint ran"


class Planted:
    """A pickle that, when unpickled by a full unpickler, creates `path`."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return pathlib.Path.touch, (pathlib.Path(self.path),)


def test_a_pickle_beside_the_safetensors_weights_is_never_read(checkpoint, clip, no_network):
    marker = checkpoint / "planted-ran"
    torch.save({"weights": Planted(marker)}, checkpoint / "pytorch_model.bin")
    loaded = check_and_load(checkpoint, clip)
    assert not marker.exists(), "the pickled weights were unpickled"
    saved = safetensors.torch.load_file(checkpoint / "model.safetensors")
    torch.testing.assert_close(loaded.model.model.image_newline, saved["image_newline"], rtol=0, atol=0)


def test_a_checkpoint_with_only_pickled_weights_never_runs_them(checkpoint, clip, no_network, capsys):
    """Without safetensors, transformers reads a .bin with torch's weights-only unpickler: the planted object is
    refused, the command stops with one line (not torch's advice to unpickle in full), and nothing ran."""
    marker = checkpoint / "planted-ran"
    (checkpoint / "model.safetensors").unlink()
    torch.save({"weights": Planted(marker)}, checkpoint / "pytorch_model.bin")
    line = error_line(cli.main, capsys, ["--model", str(checkpoint), "--video", clip, "--chunk-frames", "2",
                                         "--budget", "20", "--question", "q", "--device", "cpu", "--quiet"])
    assert line == (f"error: model: the pickled weights in {checkpoint} hold objects other than tensors, which are "
                    f"never unpickled (torch's weights-only unpickler refused them); save the weights as safetensors")
    assert not marker.exists()

def test_no_code_in_the_tree_trusts_remote_code():
    """No source file under hermes/ or bench/ passes trust_remote_code other than False (an evaluation plugin or
    a benchmark that loads a checkpoint goes through `hermes.commands`)."""
    found = []
    for folder in ("hermes", "bench"):
        for path in pathlib.Path(REPO, folder).rglob("*.py"):
            for match in re.finditer(r"trust_remote_code\"?\s*[=:]\s*(\w+)", path.read_text()):
                if match.group(1) != "False":
                    found.append(f"{path.relative_to(REPO)}: {match.group(0)}")
    assert found == []

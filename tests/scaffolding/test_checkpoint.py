"""`python -m scaffolding.checkpoint`, the dry-run checkpoint of the `hermes` command from a checkout
(docs/api.md#not-installed): it saves the tests' own tiny model, and refuses a bad folder or model type before
writing anything."""
import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import Qwen2_5_VLForConditionalGeneration

from scaffolding.checkpoint import main
from scaffolding.models import tiny_qwen2_5_vl
from tests.utils import REPO


def test_the_command_saves_the_tests_tiny_model(tmp_path):
    out = tmp_path / "tiny"
    done = subprocess.run([sys.executable, "-m", "scaffolding.checkpoint", str(out), "--model-type", "qwen2_5_vl"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen2_5_vl"
    saved = Qwen2_5_VLForConditionalGeneration.from_pretrained(out).state_dict()
    expected = tiny_qwen2_5_vl().state_dict()
    assert saved.keys() == expected.keys()
    for name, tensor in saved.items():
        assert torch.equal(tensor, expected[name]), name
    for name in ("tokenizer.json", "preprocessor_config.json", "video_preprocessor_config.json",
                 "processor_config.json"):
        assert (out / name).is_file(), name


@pytest.mark.parametrize("argv, message", [
    (["--model-type", "qwen9"], "invalid choice: 'qwen9'"),
    (["--model-type", "qwen2_5_vl"], "OUT: "),
])
def test_bad_input_is_refused_before_anything_is_written(tmp_path, capsys, argv, message):
    out = tmp_path / "tiny"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit) as exit_:
        main([str(out), *argv])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
    assert os.listdir(out) == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"

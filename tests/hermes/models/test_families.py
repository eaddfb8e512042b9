"""Every model family against the family contract (docs/families.md): the registry is the table and covers the shared
stream checks, family files build on the base module alone, the base refuses a family that leaves out part of the
contract, the chunk a family encodes from prepared frames has the token and frame counts it announces, and its chat
text around the video."""
import ast
import os
import re

import numpy as np
import pytest

from hermes.models import FAMILIES, family_of, family_of_type
from hermes.models.base import ModelFamily, PilVideoProcessor
from hermes.models.processing import Processor
from scaffolding.processors import tiny_image_processor, tiny_video_processor_config
from tests.hermes.stream.policies import FAMILIES as CASES
from tests.utils import REPO

pytestmark = pytest.mark.usefixtures("single_thread")
MODELS = os.path.join(REPO, "hermes", "models")
REQUIRED_ATTRIBUTES = ("name", "preset_name", "pil_processor")


def test_the_registry_is_the_table(monkeypatch):
    """family_of_type reads FAMILIES; every registered family has a case in the shared stream checks (keyed by its
    preset) whose tiny model is of that family (one family may serve several model types: qwen3_5, qwen3_5_moe)."""
    for model_type, family in FAMILIES.items():
        assert type(family_of_type(model_type)) is family
        case = CASES[family.preset_name]
        assert FAMILIES[case.build(num_layers=1).config.model_type] is family
    monkeypatch.setitem(FAMILIES, "another", FAMILIES["qwen2_5_vl"])
    assert type(family_of_type("another")) is FAMILIES["qwen2_5_vl"]
    with pytest.raises(ValueError, match="'qwen2' is not supported; supported: llava_onevision, .*another"):
        family_of_type("qwen2")


def test_family_files_import_the_base_not_the_package():
    """The package's __init__ is the registry, which imports the families: a family file that imported the package
    (`from . import ...`, `hermes.models`) would close a cycle."""
    for file in sorted(os.listdir(MODELS)):
        if not file.endswith(".py") or file == "__init__.py":
            continue
        with open(os.path.join(MODELS, file)) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = ["." if node.level == 1 and node.module is None else node.module or ""]
            assert not any(name in (".", "hermes.models") for name in names), f"{file}:{node.lineno}"


def _family(leave_out: str):
    """A family class with every part of the contract but `leave_out`."""
    members = {name: "x" for name in REQUIRED_ATTRIBUTES}
    members.update({name: lambda self, *args, **kwargs: None for name in ModelFamily.__abstractmethods__})
    del members[leave_out]
    return type("Partial", (ModelFamily,), members)


def test_a_family_must_provide_the_contract():
    """A family that leaves out an attribute is refused when defined, one that leaves out a method when built; the
    contract table of docs/families.md lists exactly these members as the family's to provide."""
    for attribute in REQUIRED_ATTRIBUTES:
        with pytest.raises(TypeError, match=attribute):
            _family(attribute)
    for method in ModelFamily.__abstractmethods__:
        with pytest.raises(TypeError, match=method):
            _family(method)()
    with open(os.path.join(REPO, "docs", "families.md")) as f:
        page = f.read()
    table = page[page.index("**What a family provides.**"):page.index("**What the base provides**")]
    documented = set(re.findall(r"^\| `(\w+)` \| (?:attribute|method) \|", table, flags=re.MULTILINE))
    assert documented == set(REQUIRED_ATTRIBUTES) | ModelFamily.__abstractmethods__
    assert all(issubclass(family.pil_processor, PilVideoProcessor) for family in FAMILIES.values())


@pytest.mark.parametrize("frames", [3, 4])  # odd: a Qwen chunk's last temporal step repeats its last frame
@pytest.mark.parametrize("name", sorted(CASES))
def test_prepared_frames_have_the_announced_tokens(name, frames):
    """prepare_frames -> encode_video through the torchvision-free twin: the chunk's H2SVC frames are
    `memory_frames`, its tokens `tokens_per_chunk` = frames x `tokens_per_frame` at `frame_size`, its extent the
    largest offset (T - 1 for 1D RoPE): what the stream sizes its cache and clock from before any encoding."""
    case = CASES[name]
    model, tokenizer = case.build(), case.tokenizer()
    family, model_type = family_of(model), model.config.model_type
    twin = family.pil_video_processor(tiny_image_processor(model_type), tiny_video_processor_config(model_type))
    processor = Processor(tokenizer=tokenizer, video_processor=twin)
    clip = np.random.default_rng(frames).integers(0, 256, (frames, 12, 20, 3), dtype=np.uint8)
    inputs = family.prepare_frames(processor, clip, fps=2.0, start=9.5)
    chunk = family.encode_video(model, processor, batch_size=1, **inputs)
    frame_size = family.frame_size(model, inputs)
    tokens = chunk.embeds.shape[1]
    assert chunk.frames == family.memory_frames(inputs)
    assert tokens == family.tokens_per_chunk(model, frames, frame_size, tokenizer=tokenizer)
    assert tokens == chunk.frames * family.tokens_per_frame(model, frame_size, tokenizer=tokenizer)
    assert chunk.extent == (tokens - 1 if chunk.rel_positions is None else int(chunk.rel_positions.max()))


CHAT = {  # (prefix, question) with system prompt "S" and question "Q"
    "llava_ov": ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\n", "\nQ<|im_end|>\n<|im_start|>assistant\n"),
    "qwen2_5_vl": ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\n<|vision_start|>",
                   "<|vision_end|>Q<|im_end|>\n<|im_start|>assistant\n"),
    "llava_ov1_5": ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\n<|vision_start|>",  # Qwen2-VL's template
                    "<|vision_end|>Q<|im_end|>\n<|im_start|>assistant\n"),
    "qwen3_vl": ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\n", "Q<|im_end|>\n<|im_start|>assistant\n"),
    "qwen3_5": ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\n", "Q<|im_end|>\n<|im_start|>assistant\n"),
    "minicpmv4_6": ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\n<image_id>0</image_id>",  # the video's id
                    "Q<|im_end|>\n<|im_start|>assistant\n"),
    "gemma4": ("<bos><|turn>system\nS<turn|>\n<|turn>user\n", "Q<turn|>\n<|turn>model\n"),  # Gemma 4's turns
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_chat_text_around_the_video(name):
    """ChatML turns around the video, with each family's markers (Qwen3-VL's runs carry their own, docs/qwen3_vl.md);
    the default system prompt when none is given."""
    family = family_of(CASES[name].build(num_layers=1))
    assert (family.prefix_text("S"), family.question_text("Q")) == CHAT[name]
    assert family.prefix_text(None) == CHAT[name][0].replace("\nS<", "\nYou are a helpful assistant.<")

"""`python -m hermes` and `hermes.cli.run` on tiny LLaVA-OV and Qwen2.5-VL checkpoints saved with save_pretrained
(tokenizer and processor configs included), over synthetic .mp4 files; and the processors the CLI feeds frames
through (the torchvision-free twins of transformers' video processors, checked against the PIL image
processors and the video processor classes' own defaults).

One run of the real command in a subprocess (slow start of python + torch + transformers); the rest goes
through `hermes.cli.run` / `hermes.cli.main` in this process.
"""
import ast
import io
import json
import os
import re
import subprocess
import sys

import av
import numpy as np
import pytest
import torch
import transformers
from transformers import AutoImageProcessor, AutoProcessor
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, PILImageResampling
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize
from transformers.utils import is_torchvision_available
from transformers.video_processing_utils import BaseVideoProcessor, VideoProcessorMixin

import hermes.models.processing
from hermes.models import FAMILIES as MODEL_TYPES
from scaffolding.checkpoint import save_tiny_checkpoint
from scaffolding.processors import TINY_QWEN_PIXELS
from hermes import cli
from hermes.policies.h2svc.head_map import HeadProfile, save_head_map
from hermes.models import family_of_type
from hermes.models.llava_ov import LlavaOneVisionPilVideoProcessor
from hermes.models.processing import load_processor
from hermes.models.qwen2_5_vl import Qwen2_5_VLPilVideoProcessor
from hermes.stream import HermesStream
from tests.utils import REPO, error_line
from tests.hermes.video_files import (HEIGHT, WIDTH, decode_all, frame_index, write_gray, write_video,
                                      write_without_frames)

pytestmark = pytest.mark.usefixtures("single_thread")

FAMILIES = ("llava_onevision", "qwen2_5_vl")
QUESTION = "what is the person holding ?"
EARLY = "where is the ball ?"
# 14 samples at 1 fps -> chunks of 4, 4, 4, 2; 20 visual tokens kept (LLaVA: 64 per chunk, Qwen: 24), so
# every chunk compresses
RUN = dict(fps=1, chunk_frames=4, budget=20, max_new_tokens=6)
# the size the reader decodes the 48 x 64 files at: the smallest of their aspect ratio covering what the processor
# keeps (docs/security.md#video): LLaVA-OV's 16 x 16 square (x 1/3: 16 x 21.3, rounded up), Qwen2.5-VL's
# smart_resize (12 x 16, x 1/4)
DECODED = {"llava_onevision": (16, 22), "qwen2_5_vl": (12, 16)}
TIMINGS = ("prepare_ms", "latency_ms")


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    folder = tmp_path_factory.mktemp("videos")
    return {"cfr": write_video(folder / "cfr.mp4", [i / 4 for i in range(56)]),     # 4 fps, 0 .. 13.75 s
            "vfr": write_video(folder / "vfr.mp4", [0.0, 0.1, 0.2, 1.5, 1.6, 3.0, 3.05]),
            "short": write_video(folder / "short.mp4", [i / 4 for i in range(12)])}  # 3 samples at 1 fps


@pytest.fixture(scope="module")
def runs(loaded, videos):
    """family -> records of one `run` over the 4 fps file (EARLY at 5 s, QUESTION at the end), computed once."""
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = cli.run(loaded[family], videos["cfr"], questions=[QUESTION], ask_at=[f"5s:{EARLY}"],
                                    **RUN)
        return cache[family]
    return get


def without_timings(records):
    return [{k: v for k, v in r.items() if k not in TIMINGS} for r in records]


def error_of(capsys, argv, status=1) -> str:
    return error_line(cli.main, capsys, argv, status)


# ---- processors ---------------------------------------------------------------------------------------------
def random_frames(count, seed=0, height=HEIGHT, width=WIDTH):
    return np.random.default_rng(seed).integers(0, 256, (count, height, width, 3), dtype=np.uint8)


def test_llava_twin_equals_the_image_processors_base_view(loaded):
    """LLaVA-OV video frames = the image processor's first (whole-image) view resized to the tower's square,
    without the anyres tiles: exact, frame by frame."""
    processor = loaded["llava_onevision"].processor
    frames = random_frames(3)
    video = processor.video_processor(videos=[frames], return_tensors="pt")["pixel_values_videos"]
    assert video.shape == (1, 3, 3, 16, 16) and video.dtype == torch.float32
    image_processor = processor.video_processor.image_processor
    for f in range(3):
        views = image_processor(images=[frames[f]], return_tensors="np")["pixel_values"][0]
        assert views.shape[0] > 1  # anyres: the base view plus tiles
        np.testing.assert_array_equal(video[0, f].numpy(), views[0])


@pytest.mark.parametrize("count", [4, 3])
def test_qwen_twin_lays_out_patches_like_qwens_processors(loaded, count):
    """Qwen2.5-VL rows: grid (t, h, w) from smart_resize; rows of grid step t hold frames 2t and 2t+1 in the
    temporal slot of each patch (columns C, T, p, p), in the image processor's row order (merge windows); an
    odd clip repeats its last frame. Each frame's slice equals the PIL image processor's output exactly."""
    processor = loaded["qwen2_5_vl"].processor
    frames = random_frames(count, seed=count)
    out = processor.video_processor(videos=[frames], return_tensors="pt", do_sample_frames=False,
                                    cap_pixels_per_frame=False)
    height, width = smart_resize(HEIGHT, WIDTH, factor=4, min_pixels=TINY_QWEN_PIXELS[0],
                                 max_pixels=TINY_QWEN_PIXELS[1])
    grid = [-(-count // 2), height // 2, width // 2]
    assert out["video_grid_thw"].tolist() == [grid]
    rows_per_step = grid[1] * grid[2]
    rows = out["pixel_values_videos"].numpy().reshape(grid[0], rows_per_step, 3, 2, 2, 2)
    image_processor = processor.video_processor.image_processor
    for f in range(2 * grid[0]):
        image = image_processor(images=[frames[min(f, count - 1)]], return_tensors="np")
        assert image["image_grid_thw"].tolist() == [[1, grid[1], grid[2]]]
        expected = image["pixel_values"].reshape(rows_per_step, 3, 2, 2, 2)[:, :, 0]
        np.testing.assert_array_equal(rows[f // 2, :, :, f % 2], expected)


def transformers_class_defaults(relative_path: str, class_name: str) -> dict:
    """Class-level settings of a transformers processor class, read from its source (the Qwen2-VL video
    processor module imports torchvision, so it cannot be imported here)."""
    path = os.path.join(os.path.dirname(transformers.__file__), "models", relative_path)
    with open(path) as f:
        tree = ast.parse(f.read())
    body = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == class_name).body
    names = {"OPENAI_CLIP_MEAN": OPENAI_CLIP_MEAN, "OPENAI_CLIP_STD": OPENAI_CLIP_STD,
             "PILImageResampling": PILImageResampling}
    return {node.targets[0].id: eval(compile(ast.Expression(node.value), path, "eval"), names)
            for node in body if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
            and node.targets[0].id not in ("valid_kwargs", "model_input_names")}


@pytest.mark.parametrize("family,source,class_name", [
    ("llava_onevision", "llava_onevision/video_processing_llava_onevision.py", "LlavaOnevisionVideoProcessor"),
    ("qwen2_5_vl", "qwen2_vl/video_processing_qwen2_vl.py", "Qwen2VLVideoProcessor")])
def test_twin_defaults_are_the_video_processor_classes(family, source, class_name):
    """Settings a checkpoint leaves out take the transformers class's value (else its base's, else None, as
    the video processor's preprocess does); min_pixels / max_pixels are init-only aliases of size."""
    defaults = {"llava_onevision": LlavaOneVisionPilVideoProcessor,
                "qwen2_5_vl": Qwen2_5_VLPilVideoProcessor}[family].defaults
    declared = transformers_class_defaults(source, class_name)
    for key, value in defaults.items():
        if key in ("min_pixels", "max_pixels"):
            continue
        expected = declared[key] if key in declared else getattr(VideoProcessorMixin, key, None)
        assert value == expected, key


def test_qwen_twin_settings_follow_the_video_processors_init(loaded):
    """min_pixels / max_pixels override size (legacy preprocessor_config.json); unknown keys are ignored;
    a centre crop (not supported without torchvision) is refused; so are sampling and return types."""
    image_processor = loaded["qwen2_5_vl"].processor.video_processor.image_processor
    twin = Qwen2_5_VLPilVideoProcessor(image_processor, {"min_pixels": 100, "max_pixels": 400, "do_pad": True,
                                                         "size": {"shortest_edge": 1, "longest_edge": 2}})
    assert (twin.size.shortest_edge, twin.size.longest_edge) == (100, 400)
    with pytest.raises(ValueError, match="do_center_crop"):
        Qwen2_5_VLPilVideoProcessor(image_processor, {"do_center_crop": True})
    with pytest.raises(ValueError, match="do_sample_frames"):
        twin(videos=[random_frames(2)], do_sample_frames=True)
    with pytest.raises(TypeError, match="fps"):
        twin(videos=[random_frames(2)], fps=2)
    with pytest.raises(ValueError, match="return_tensors"):
        twin(videos=[random_frames(2)], return_tensors="np")
    with pytest.raises(TypeError, match="image_processor"):
        Qwen2_5_VLPilVideoProcessor(object(), {})


def test_load_processor_takes_autoprocessor_when_torchvision_imports(tiny_checkpoints, monkeypatch):
    """The GPU path: with torchvision the checkpoint's own processor (AutoProcessor) is used as is."""
    loaded_from = []
    monkeypatch.setattr(hermes.models.processing, "is_torchvision_available", lambda: True)
    monkeypatch.setattr(AutoProcessor, "from_pretrained", lambda path: loaded_from.append(path) or "real")
    assert load_processor(tiny_checkpoints["qwen2_5_vl"], family_of_type("qwen2_5_vl")) == "real"
    assert loaded_from == [tiny_checkpoints["qwen2_5_vl"]]


@pytest.mark.skipif(not is_torchvision_available(), reason="transformers' video processors need torchvision "
                    "(runs on machines that have it, e.g. bench/gpu_check.sh)")
@pytest.mark.parametrize("family", FAMILIES)
def test_twins_match_the_real_video_processors(tiny_checkpoints, family):
    """Frames already at the processed size (no resampling, where torchvision and PIL differ): the twin and
    transformers' video processor give the same tensors; at another size the same shapes and grid."""
    path = tiny_checkpoints[family]
    real = AutoProcessor.from_pretrained(path).video_processor
    config, _ = BaseVideoProcessor.get_video_processor_dict(path)
    twin = family_of_type(family).pil_video_processor(AutoImageProcessor.from_pretrained(path, backend="pil"), config)
    size = (16, 16) if family == "llava_onevision" else (12, 16)
    kwargs = {"do_sample_frames": False} | ({"cap_pixels_per_frame": False} if family == "qwen2_5_vl" else {})
    for frames, exact in ((random_frames(4, height=size[0], width=size[1]), True), (random_frames(3), False)):
        got, want = twin(videos=[frames], **kwargs), real(videos=[frames], return_tensors="pt", **kwargs)
        assert set(got) <= set(want)
        for key in got:
            assert got[key].shape == want[key].shape, key
            if exact or key == "video_grid_thw":
                torch.testing.assert_close(got[key], want[key].to(got[key].dtype), atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def processors(tmp_path_factory):
    """model_type -> (family, processor) of a tiny checkpoint of each family (no weights loaded)."""
    made = {}
    for model_type in ("llava_onevision", "qwen2_5_vl", "qwen3_vl"):
        family = family_of_type(model_type)
        made[model_type] = family, load_processor(save_tiny_checkpoint(tmp_path_factory.mktemp(model_type),
                                                                       model_type), family)
    return made


@pytest.mark.parametrize("model_type", ["llava_onevision", "qwen2_5_vl", "qwen3_vl"])
@pytest.mark.parametrize("height,width", [(HEIGHT, WIDTH), (90, 40), (30, 200), (7, 9)])
@pytest.mark.parametrize("count", [2, 4])
def test_kept_size_is_the_size_prepare_frames_makes(processors, model_type, height, width, count):
    """`kept_size` (what the reader may shrink frames to) is the size of the frames `prepare_frames` outputs, for
    frames of several shapes (wide, tall, smaller than the processor's size) and chunks of 2 and 4 frames."""
    family, processor = processors[model_type]
    inputs = family.prepare_frames(processor, random_frames(count, height=height, width=width), fps=1)
    if model_type == "llava_onevision":
        made = tuple(inputs["video"].shape[-2:])
    else:
        made = tuple(int(x) * processor.video_processor.patch_size for x in inputs["grid_thw"].reshape(3)[1:])
    assert family.kept_size(processor, height, width) == made


# ---- run --------------------------------------------------------------------------------------------------
def direct_stream(loaded, path, family, **policy):
    """The same video through HermesStream by hand: PyAV decodes every frame (scaled to DECODED), every fourth is
    kept (4 fps file at 1 fps), chunks of 4 go through the checkpoint's processor; EARLY is asked after chunk 1
    (4..7 s, the first to reach 5 s), QUESTION at the end. `policy`: HermesStream's policy arguments (default:
    HERMES at the run's budget). Returns (stats after each chunk, answers)."""
    _, frames = decode_all(path)
    assert [frame_index(f) for f in frames[::4]] == list(range(0, 56, 4))
    picked = decode_all(path, DECODED[family])[1][::4]
    model, processor = loaded.model, loaded.processor
    qwen = family == "qwen2_5_vl"
    frame_size = smart_resize(HEIGHT, WIDTH, factor=4, min_pixels=TINY_QWEN_PIXELS[0],
                              max_pixels=TINY_QWEN_PIXELS[1]) if qwen else None
    policy = policy or {"budget": RUN["budget"]}
    stream = HermesStream(model, processor, chunk_frames=4, frame_size=frame_size, **policy)
    stats, answers = [], []
    for index in range(0, len(picked), 4):
        out = processor.video_processor(videos=[np.stack(picked[index:index + 4])], return_tensors="pt")
        if qwen:
            stream.append_video(out["pixel_values_videos"], grid_thw=out["video_grid_thw"],
                                seconds_per_grid=processor.video_processor.temporal_patch_size / RUN["fps"])
        else:
            stream.append_video(out["pixel_values_videos"])
        stats.append(stream.stats())
        if index == 4:
            answers.append(stream.ask(EARLY, max_new_tokens=RUN["max_new_tokens"]).strip())
    answers.append(stream.ask(QUESTION, max_new_tokens=RUN["max_new_tokens"]).strip())
    return stats, answers


@pytest.mark.parametrize("family", FAMILIES)
def test_frames_reach_the_processor_at_the_size_it_keeps(family, loaded, videos, monkeypatch):
    """`run` decodes the 48 x 64 file at DECODED (check_run sets the reader's keep from the processor): that is
    the size of every chunk `prepare_frames` receives, in check_run and in the stream."""
    shapes, family_type = [], type(loaded[family].family)
    prepare = family_type.prepare_frames

    def record(self, processor, frames, fps, start=0.0):
        shapes.append(frames.shape)
        return prepare(self, processor, frames, fps, start)

    monkeypatch.setattr(family_type, "prepare_frames", record)
    cli.run(loaded[family], videos["cfr"], fps=1, chunk_frames=4, budget=RUN["budget"])
    assert shapes == [(4, *DECODED[family], 3)] * 3 + [(2, *DECODED[family], 3)]


@pytest.mark.parametrize("family", FAMILIES)
def test_run_matches_hermes_stream_driven_directly(family, loaded, videos, runs):
    """Four chunks (4, 4, 4, 2 frames: source frames 0, 4, ..., 52), the cache after each, and both answers
    equal a HermesStream fed the same frames by hand; EARLY comes after chunk 1, QUESTION after the last."""
    records = runs(family)
    chunks = [r for r in records if r["type"] == "chunk"]
    assert [r["type"] for r in records] == ["chunk", "chunk", "answer", "chunk", "chunk", "answer"]
    assert [c["frames"] for c in chunks] == [4, 4, 4, 2]
    assert [s for c in chunks for s in c["sources"]] == list(range(0, 56, 4))
    assert [(c["start"], c["end"]) for c in chunks] == [(0, 3), (4, 7), (8, 11), (12, 13)]
    stats, answers = direct_stream(loaded[family], videos["cfr"], family)
    assert [(c["cache_length"], c["cache_capacity"], c["positions"], c["steps"], c["cache_bytes"]) for c in chunks] \
        == [(s["length"], s["capacity"], list(s["positions"]), s["steps"], s["bytes_allocated"]) for s in stats]
    assert all(c["compressed"] for c in chunks) and stats[-1]["steps"] == 4
    asked = [r for r in records if r["type"] == "answer"]
    assert [(a["question"], a["at"]) for a in asked] == [(EARLY, 7), (QUESTION, 13)]
    assert [a["answer"] for a in asked] == answers
    assert all(a["answer"] for a in asked)


def test_command_json_in_a_subprocess(tiny_checkpoints, videos, runs):
    """`python -m hermes ... --json`: exit 0, every stdout line a JSON record, the same records as `run` (and
    so as HermesStream driven directly); the progress bar went to stderr."""
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    command = [sys.executable, "-m", "hermes", "--model", tiny_checkpoints["llava_onevision"], "--video", videos["cfr"],
               "--question", QUESTION, "--ask-at", f"5s:{EARLY}", "--fps", "1", "--chunk-frames", "4", "--budget",
               "20", "--max-new-tokens", "6", "--device", "cpu", "--threads", "1", "--json"]
    done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr and "chunk" in done.stderr
    records = [json.loads(line) for line in done.stdout.splitlines()]
    assert sum(r["type"] == "chunk" for r in records) == 4
    assert without_timings(records) == without_timings(runs("llava_onevision"))


def test_variable_frame_rate_file_and_late_questions(tiny_checkpoints, videos):
    """From a path: the VFR file's chunks hold the frames on screen at 0, 1, 2, 3 s; a question timed after the
    last sampled frame but within the video is asked after the last chunk; `on_record` sees every record as it is
    returned."""
    seen = []
    records = cli.run(tiny_checkpoints["llava_onevision"], videos["vfr"], ask_at=[(3.04, QUESTION)], fps=1,
                      chunk_frames=2, budget=20, max_new_tokens=2, device="cpu", on_record=seen.append)
    assert seen == records
    assert [r["sources"] for r in records if r["type"] == "chunk"] == [[0, 2], [4, 5]]
    assert [(r["type"], r.get("at")) for r in records[2:]] == [("answer", 3.0)]


def test_text_output_with_questions_from_the_terminal(tiny_checkpoints, videos, capsys, monkeypatch):
    """No --question / --ask-at: questions come from stdin, one a line, until an empty line."""
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"{QUESTION}\n{EARLY}\n\nnever asked\n"))
    argv = ["--model", tiny_checkpoints["qwen2_5_vl"], "--video", videos["cfr"], "--chunk-frames", "4", "--budget",
            "20", "--max-new-tokens", "3", "--device", "cpu", "--quiet"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split("Q: ")[1] for line in out if "Q: " in line] == [QUESTION, EARLY]
    assert [line.startswith("[0:13.0] Q: ") for line in out[::2]] == [True, True]
    assert len(out) == 4 and all(line.strip().startswith("A:") for line in out[1::2])


def test_questions_at_a_chunks_last_timestamp_and_at_zero(loaded, videos):
    """A question timed at a chunk's last frame (7 s: chunk 1 holds the frames at 4..7 s) comes right after that
    chunk, not after the next one; one at 0 s comes after the first chunk (no chunk ends before it)."""
    records = cli.run(loaded["llava_onevision"], videos["cfr"], ask_at=[f"7s:{EARLY}", f"0s:{QUESTION}"], **RUN)
    assert [r["type"] for r in records] == ["chunk", "answer", "chunk", "answer", "chunk", "chunk"]
    asked = [(r["question"], r["at"]) for r in records if r["type"] == "answer"]
    assert asked == [(QUESTION, 3), (EARLY, 7)]


@pytest.mark.parametrize("item,expected", [
    ("1:30:Who is speaking?", (90, "Who is speaking?")), ("30s: what ?", (30, "what ?")), ("1:02:03:q", (3723, "q")),
    ("12.5:a:b", (12.5, "a:b")), ((12.5, " q "), (12.5, "q")), (("1:30", "q"), (90, "q")), ("0s:q", (0, "q")),
    ("0:q", (0, "q")), ((0, "q"), (0, "q"))])
def test_parse_ask_at(item, expected):
    assert cli.parse_ask_at(item) == expected


@pytest.mark.parametrize("item", ["what ?", "30s:", "30s:  ", "soon:q", (-1, "q"), (float("nan"), "q"),
                                  (float("inf"), "q"), (3, ""), (1, 2, 3)])
def test_parse_ask_at_rejects(item):
    with pytest.raises(ValueError, match="ask_at|question|time"):
        cli.parse_ask_at(item)


@pytest.fixture(scope="module")
def head_maps(tmp_path_factory):
    """H2SVC head-map files for the tiny checkpoints (every class in every layer but the last)."""
    folder = tmp_path_factory.mktemp("maps")
    return {family: str(save_head_map(tiny_profile(family), folder / f"{family}.json")) for family in FAMILIES}


def tiny_profile(model_type: str) -> HeadProfile:
    head_map = torch.tensor([[2, 0], [1, 2], [0, 1], [2, 2]])
    zeros = torch.zeros(4, 2, dtype=torch.float64)
    return HeadProfile(model_name="", model_type=model_type, num_layers=4, num_kv_heads=2, num_heads=4,
                       instant_ratio=0.1, short_ratio=0.4, head_map=head_map, v2v=zeros, t2v=zeros, scores=zeros,
                       clips=[], settings={})


@pytest.mark.parametrize("family", FAMILIES)
def test_h2svc_run_matches_the_stream_driven_directly(family, loaded, videos, head_maps):
    """--policy h2svc --head-map PATH: the same records' cache stats (a step after every chunk) and answers as an
    H2SVC HermesStream fed the same frames by hand with that map."""
    records = cli.run(loaded[family], videos["cfr"], questions=[QUESTION], ask_at=[f"5s:{EARLY}"], policy="h2svc",
                      head_map=head_maps[family], fps=1, chunk_frames=4, max_new_tokens=RUN["max_new_tokens"])
    chunks = [r for r in records if r["type"] == "chunk"]
    stats, answers = direct_stream(loaded[family], videos["cfr"], family, policy="h2svc",
                                   head_map=head_maps[family])
    assert [(c["cache_length"], c["cache_capacity"], c["positions"], c["steps"], c["cache_bytes"]) for c in chunks] \
        == [(s["length"], s["capacity"], list(s["positions"]), s["steps"], s["bytes_allocated"]) for s in stats]
    assert all(c["compressed"] for c in chunks) and stats[-1]["steps"] == 4 and stats[-1]["frames_seen"] > 0
    assert [r["answer"] for r in records if r["type"] == "answer"] == answers


def test_h2svc_command_line(tiny_checkpoints, videos, head_maps, capsys):
    """`--policy h2svc --head-map PATH` from the command line answers; without --head-map the unprofiled default
    map is used with a warning: one line on stderr, without the source line Python prints under a warning."""
    argv = ["--model", tiny_checkpoints["llava_onevision"], "--video", videos["cfr"], "--chunk-frames", "4", "--policy",
            "h2svc", "--question", QUESTION, "--max-new-tokens", "3", "--device", "cpu", "--quiet", "--json"]
    assert cli.main(argv + ["--head-map", head_maps["llava_onevision"]]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["type"] for r in records] == ["chunk"] * 4 + ["answer"]
    assert cli.main(argv) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warning: head_map: not profiled") and "warnings.warn" not in err[0]


# ---- errors: one line, exit status 2 (usage) or 1 (unreadable input), no traceback ----------------------------
def test_help_lists_every_option(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for action in cli.parser()._actions:
        for option in action.option_strings:
            assert option in text
    assert "stdin" in text and "TIME:TEXT" in text
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--model", "x"])       # --video missing: argparse's usage error
    assert exit_info.value.code == 2


def test_help_is_as_written(monkeypatch, capsys):
    """The whole --help text at 100 columns. After changing it on purpose, write the new text to the file:
    COLUMNS=100 python -m hermes --help > tests/hermes/help/hermes.txt"""
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    with open(os.path.join(REPO, "tests", "hermes", "help", "hermes.txt")) as f:
        assert text == f.read()
    assert all(model_type in text for model_type in MODEL_TYPES), "--model's help names every supported model type"


@pytest.fixture(scope="module")
def bad_inputs(tmp_path_factory, videos):
    folder = tmp_path_factory.mktemp("bad")
    junk = folder / "junk.mp4"
    junk.write_bytes(os.urandom(4096))
    (folder / "llama").mkdir()
    (folder / "llama" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (folder / "empty").mkdir()
    return {"junk": str(junk), "llama": str(folder / "llama"), "empty": str(folder / "empty"),
            "missing": str(folder / "missing.mp4"), "wide": write_gray(folder / "wide.mkv", 2, 9000),
            "frameless": write_without_frames(folder / "frameless.mkv")}


# status 1: an input that cannot be read; 2: a setting that cannot work (the command's contract, hermes/cli.py)
@pytest.mark.parametrize("case,args,message,status", [
    ("missing video", ["--video", "{missing}"], r"video: no such file", 1),
    ("corrupt video", ["--video", "{junk}"], r"video: cannot read .*junk\.mp4", 1),
    ("missing model", ["--model", "{missing}"], r"model: no such folder", 1),
    ("not a checkpoint", ["--model", "{empty}"], r"has no config\.json", 1),
    ("unknown model type", ["--model", "{llama}"], r"model type 'llama' is not supported; supported: llava_onevision",
     2),
    ("frames too large", ["--video", "{wide}"], r"video: .*wide\.mkv declares 9000 x 2 px frames; the reader "
     r"decodes at most 8192 px a side", 1),
    ("no video frames", ["--video", "{frameless}"], r"video: .*frameless\.mkv has no video frames", 1),
    ("chunk too large", ["--chunk-frames", "4000000"], r"chunk_frames: 4000000 frames of 22 x 16 px would hold "
     r"3\.9 GiB, over the 1 GiB one chunk may hold", 2),
    ("shorter than one chunk", ["--video", "{short}"], r"video: 3 frames sampled at 1 fps, fewer than one chunk of 4",
     2),
    ("budget too small", ["--budget", "1"], r"budget=1.*HermesConfig\.budget: must be >= 2", 2),
    ("budget past the positions", ["--budget", "5000"],
     r"budget=5000.*max_positions: must exceed prefix_len \+ budget", 2),
    ("bad fps", ["--fps", "0"], r"fps: expected a positive finite number", 2),
    ("bad chunk", ["--chunk-frames", "0"], r"chunk_frames: expected a positive int", 2),
    ("bad ask-at", ["--ask-at", "soon:what ?"], r"ask_at: expected TIME:question", 2),
    ("ask-at past the end", ["--ask-at", "15s:what ?"], r"ask_at: 15 s is past the end of the video \(13\.75 s\)", 2),
    ("head map for hermes", ["--head-map", "{map}"], r"head_map: only --policy h2svc takes a head map", 2),
    ("missing head map", ["--policy", "h2svc", "--head-map", "{missing}"], r"head map: no such file", 1),
    ("corrupt head map", ["--policy", "h2svc", "--head-map", "{junk}"], r"head map .*junk\.mp4: not a JSON head map",
     1),
    ("head map of another model", ["--policy", "h2svc", "--head-map", "{qwen_map}"],
     r"policy h2svc, chunk_frames=4: head map .*model_type 'qwen2_5_vl' vs 'llava_onevision'", 2),
    ("unknown device", ["--device", "tpu"], r"device: expected", 2),
    ("bad threads", ["--threads", "0"], r"threads: expected a positive int", 2),
])
def test_bad_input_is_one_clear_line_before_the_model_loads(case, args, message, status, tiny_checkpoints, videos,
                                                           bad_inputs, head_maps, capsys, monkeypatch):
    """Every failure is one line naming the argument, with its exit status, and comes before any weights load."""
    monkeypatch.setattr(cli, "load_model", lambda *a, **k: pytest.fail("the model loaded before the checks"))
    paths = {**bad_inputs, **videos, "map": head_maps["llava_onevision"], "qwen_map": head_maps["qwen2_5_vl"]}
    argv = ["--model", tiny_checkpoints["llava_onevision"], "--video", videos["cfr"], "--chunk-frames", "4",
            "--question", "yes", "--quiet", "--device", "cpu"] + [a.format(**paths) for a in args]
    assert re.search(message, error_of(capsys, argv, status))
    assert capsys.readouterr().out == ""


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for CUDA where there is none")
def test_cuda_without_a_gpu_is_one_clear_line(tiny_checkpoints, videos, capsys):
    line = error_of(capsys, ["--model", tiny_checkpoints["llava_onevision"], "--video", videos["cfr"], "--device",
                             "cuda", "--chunk-frames", "4", "--question", "yes", "--quiet"], status=2)
    assert "device: cuda was asked for but torch sees no CUDA device" in line


def test_decoder_failing_mid_stream(tiny_checkpoints, videos, capsys, monkeypatch):
    """A decoding error after 5 s of video (injected into PyAV) stops the command with one line naming the
    time reached; the chunk done before it was already printed."""
    real_decode = av.container.InputContainer.decode

    def failing_decode(self, *args, **kwargs):
        for index, frame in enumerate(real_decode(self, *args, **kwargs)):
            if index == 20:
                raise av.error.InvalidDataError(1094995529, "Invalid data found when processing input")
            yield frame

    monkeypatch.setattr(av.container.InputContainer, "decode", failing_decode)
    argv = ["--model", tiny_checkpoints["llava_onevision"], "--video", videos["cfr"], "--chunk-frames", "4", "--budget",
            "20", "--question", "yes", "--json", "--quiet", "--device", "cpu"]
    assert cli.main(argv) == 1
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    assert captured.err.strip() == (f"error: video: decoding {videos['cfr']} failed after 4.75 s: [Errno 1094995529] "
                                    "Invalid data found when processing input")
    assert [json.loads(line)["type"] for line in captured.out.splitlines()] == ["chunk"]


def test_unexpected_errors_are_one_line_unless_traceback_is_asked(tiny_checkpoints, videos, capsys, monkeypatch):
    family = type(family_of_type("llava_onevision"))

    def broken(self, processor, frames, fps, start=0.0):
        raise RuntimeError("boom")

    monkeypatch.setattr(family, "prepare_frames", broken)
    argv = ["--model", tiny_checkpoints["llava_onevision"], "--video", videos["cfr"], "--chunk-frames", "4",
            "--budget", "20", "--question", "yes", "--quiet", "--device", "cpu"]
    line = error_of(capsys, argv)
    assert line == "error: internal error (RuntimeError: boom); rerun with --traceback for details"
    with pytest.raises(RuntimeError, match="boom"):
        cli.main(argv + ["--traceback"])


def test_console_scripts_run_the_commands():
    """`pip install` puts `hermes` and `hermes-profile` on the path; they are the commands' `main`."""
    from importlib.metadata import entry_points

    from hermes import profile_cli

    scripts = {ep.name: ep for ep in entry_points(group="console_scripts") if ep.name in ("hermes", "hermes-profile")}
    assert scripts["hermes"].load() is cli.main and scripts["hermes-profile"].load() is profile_cli.main
    done = subprocess.run([sys.executable, "-c", "import sys; from hermes.cli import main; sys.exit(main())",
                           "--help"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("usage: hermes ")

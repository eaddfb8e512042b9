"""Qwen3-VL through a saved tiny checkpoint: the torchvision-free twin of `Qwen3VLVideoProcessor` (against the PIL
image processor, the class's defaults, its smart_resize, and the real processor where torchvision loads),
`prepare_frames`, `python -m hermes --model DIR` (the family found from config.json's model_type, the frames' times
reaching the chunks) and the H2SVC profiler (`python -m hermes.policies.h2svc.profile`) against the model's own
eager attention over the whole clip."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor, smart_resize

from hermes import cli
from hermes.commands import load_model
from hermes.models.qwen3_vl import Qwen3_VL, Qwen3VLPilVideoProcessor
from hermes.policies.h2svc.head_map import load_head_map
from hermes.policies.h2svc.profile import profile_heads
from scaffolding.checkpoint import save_tiny_checkpoint
from scaffolding.processors import TINY_QWEN3_PIXELS
from hermes_kernels.policies.h2svc.reference import tad_t2v, tad_v2v
from tests.hermes.models.qwen3_vl_reference import PREFIX, full_inputs, own_forward, question_text
from tests.hermes.streams import QUESTION
from tests.hermes.video_files import HEIGHT, WIDTH, frame_image, write_video
from tests.utils import REPO, assert_close_verbose

pytestmark = pytest.mark.usefixtures("single_thread")

TAD_TOL = dict(atol=2e-6, rtol=2e-6)  # float32 probabilities summed into TADs of size ~1, as tests/hermes/policies


def torchvision_loads() -> bool:
    """torchvision imports (a build that fails to load, e.g. for another CUDA, counts as absent)."""
    try:
        import torchvision  # noqa: F401
    except Exception:
        return False
    return True


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("qwen3_vl"), "qwen3_vl")


@pytest.fixture(scope="module")
def loaded(checkpoint):
    return load_model(checkpoint, device="cpu")


@pytest.fixture(scope="module")
def video(tmp_path_factory):
    return write_video(tmp_path_factory.mktemp("videos") / "cfr.mp4", [i / 4 for i in range(40)])  # 10 s at 4 fps


def random_frames(count, height=HEIGHT, width=WIDTH, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (count, height, width, 3), dtype=np.uint8)


# ---- the processor ----------------------------------------------------------------------------------------
def test_twin_frames_equal_the_pil_image_processor(loaded):
    """With the per-frame cap a 48 x 64 frame gets 192 pixels (12 x 16, TINY_QWEN3_PIXELS); each temporal slot of
    the twin's rows equals the PIL image processor's output for that frame at that pixel count, exactly."""
    twin = loaded.processor.video_processor
    frames = random_frames(4)
    out = twin(videos=[frames], cap_pixels_per_frame=True)
    grid = [2, 6, 8]
    assert out["video_grid_thw"].tolist() == [grid]
    rows = out["pixel_values_videos"].numpy().reshape(2, 48, 3, 2, 2, 2)
    image_processor, pixels = twin.image_processor, TINY_QWEN3_PIXELS[2] * 16
    for f in range(4):
        image = image_processor(images=[frames[f]], size={"shortest_edge": pixels, "longest_edge": pixels},
                                image_mean=twin.image_mean, image_std=twin.image_std, return_tensors="np")
        assert image["image_grid_thw"].tolist() == [[1, 6, 8]]
        np.testing.assert_array_equal(rows[f // 2, :, :, f % 2], image["pixel_values"].reshape(48, 3, 2, 2, 2)[:, :, 0])


@pytest.mark.parametrize("count,cap", [(4, False), (8, False), (3, True), (16, True)])
def test_twin_sizes_a_clip_as_the_processors_smart_resize(loaded, count, cap):
    """The clip's size is Qwen3-VL's video smart_resize of (frames, height, width) under the clip budget, or the
    per-frame cap's: without the cap 8 frames get smaller frames than 4; with it the size holds for any count."""
    twin = loaded.processor.video_processor
    shortest, longest, tokens = TINY_QWEN3_PIXELS
    budget = max(min(tokens * 16, longest // count), int(shortest * 1.05)) * count if cap else longest
    height, width = smart_resize(count, HEIGHT, WIDTH, temporal_factor=2, factor=4, min_pixels=shortest,
                                 max_pixels=budget)
    grid = twin(videos=[random_frames(count)], cap_pixels_per_frame=cap)["video_grid_thw"]
    assert grid.tolist() == [[-(-count // 2), height // 2, width // 2]]


def test_twin_defaults_are_the_video_processor_class():
    """Settings a checkpoint leaves out take Qwen3VLVideoProcessor's class values; sampling stays refused."""
    for key, value in Qwen3VLPilVideoProcessor.defaults.items():
        assert value == getattr(Qwen3VLVideoProcessor, key, None), key
    twin = Qwen3VLPilVideoProcessor(__import__("transformers").Qwen2VLImageProcessorPil(), {})
    with pytest.raises(ValueError, match="do_sample_frames"):
        twin(videos=[random_frames(2)], do_sample_frames=True)


def test_prepare_frames_pads_and_times_each_step(loaded):
    """An odd chunk is padded with its last frame before the processor (which refuses a single frame); each
    step's time is the mean of its frames' (the last repeated); the grid and frame size feed the stream."""
    family, processor = Qwen3_VL(), loaded.processor
    for count, times in ((3, [4.5, 6.0]), (1, [4.0]), (4, [4.5, 6.5])):
        inputs = family.prepare_frames(processor, random_frames(count), 1, start=4)
        assert inputs["timestamps"] == times and family.memory_frames(inputs) == len(times)
        assert inputs["grid_thw"].tolist() == [[len(times), 6, 8]]
        assert family.frame_size(loaded.model, inputs) == (12, 16)


@pytest.mark.skipif(not torchvision_loads(), reason="transformers' Qwen3VLVideoProcessor needs torchvision (runs "
                    "where it loads, e.g. bench/gpu_check.sh)")
def test_twin_matches_the_real_video_processor(checkpoint, loaded):
    """Frames already at the processed size (no resampling, where torchvision and PIL differ): the twin and
    transformers' Qwen3VLVideoProcessor give the same tensors; at another size the same shapes and grid; and
    prepare_frames through the real processor gives the twin's grid and times."""
    from transformers import AutoVideoProcessor

    real, twin = AutoVideoProcessor.from_pretrained(checkpoint), loaded.processor.video_processor
    assert type(real).__name__ == "Qwen3VLVideoProcessor"
    for frames, exact in ((random_frames(4, 12, 16), True), (random_frames(4), False)):
        got = twin(videos=[frames], cap_pixels_per_frame=True)
        want = real(videos=[frames], return_tensors="pt", do_sample_frames=False, cap_pixels_per_frame=True)
        for key in got:
            assert got[key].shape == want[key].shape, key
            if exact or key == "video_grid_thw":
                torch.testing.assert_close(got[key], want[key].to(got[key].dtype), atol=1e-5, rtol=1e-5)
    processor = type("Processor", (), {"video_processor": real})()
    inputs = Qwen3_VL().prepare_frames(processor, random_frames(3), 2.0, start=1.0)
    expected = Qwen3_VL().prepare_frames(loaded.processor, random_frames(3), 2.0, start=1.0)
    assert inputs["timestamps"] == expected["timestamps"] and torch.equal(inputs["grid_thw"], expected["grid_thw"])


# ---- the CLI ----------------------------------------------------------------------------------------------
RUN = ["--fps", "1", "--chunk-frames", "4", "--budget", "20", "--max-new-tokens", "4", "--question", QUESTION]


def without_timings(records):
    return [{k: v for k, v in r.items() if k not in ("prepare_ms", "latency_ms")} for r in records]


def test_the_command_detects_qwen3_vl(checkpoint, loaded, video, monkeypatch):
    """`python -m hermes --model DIR` on the saved checkpoint: exit 0, the records of `cli.run` in this process
    (chunks of 4, 4, 2 frames, each compressing), whose chunks carried each step's time (0.5 s, 2.5 s, ...);
    H2SVC runs on it too (the frame size from the first chunk)."""
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-m", "hermes", "--model", checkpoint, "--video", video, *RUN, "--device",
                           "cpu", "--threads", "1", "--json", "--quiet"], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in done.stdout.splitlines()]
    stamps, encode = [], Qwen3_VL.encode_video
    monkeypatch.setattr(Qwen3_VL, "encode_video", lambda self, *a, **k: stamps.append(k["timestamps"]) or
                        encode(self, *a, **k))
    here = cli.run(loaded, video, questions=[QUESTION], fps=1, chunk_frames=4, budget=20, max_new_tokens=4)
    assert without_timings(records) == without_timings(here)
    assert [r["frames"] for r in records if r["type"] == "chunk"] == [4, 4, 2]
    assert all(r["compressed"] for r in records if r["type"] == "chunk")
    assert stamps == [[0.5, 2.5], [4.5, 6.5], [8.5]]
    with pytest.warns(UserWarning, match="not profiled"):
        h2svc = cli.run(loaded, video, questions=[QUESTION], fps=1, chunk_frames=4, policy="h2svc", max_new_tokens=2)
    assert [r["type"] for r in h2svc] == ["chunk"] * 3 + ["answer"]


# ---- the H2SVC profiler -----------------------------------------------------------------------------------
def test_profile_equals_the_models_own_attention(loaded):
    """Six frames at 1 fps in chunks of 4 and 2 (three temporal steps, 24 tokens each: timestamp, markers, 3 x 4
    visual tokens): the profiler's TAD_V2V / TAD_T2V equal the reference TADs of the model's own eager attention
    over the whole clip (its positions, its DeepStack), frames being the steps' runs."""
    model, processor = loaded.model, loaded.processor
    frames = np.stack([frame_image(i) for i in range(6)])
    profile = profile_heads(model, processor, [frames], fps=1, chunk_frames=4, questions=[QUESTION],
                            answer_tokens=0, progress=False)
    clip = profile.clips[0]
    assert (clip["memory_frames"], clip["tokens_per_frame"]) == (3, 24)
    chunks = []
    for part, times in ((frames[:4], [0.5, 2.5]), (frames[4:], [4.5])):
        out = processor.video_processor(videos=[part], cap_pixels_per_frame=True)
        chunks.append({"video": out["pixel_values_videos"], "grid_thw": out["video_grid_thw"], "timestamps": times})
    tok = processor.tokenizer
    inputs = full_inputs(model, tok, chunks, 1, question_text(QUESTION))
    attentions = own_forward(model, inputs, attention="eager", output_attentions=True).attentions
    probs = torch.stack([a[0] for a in attentions])
    P, S = len(tok(PREFIX, add_special_tokens=False)["input_ids"]), inputs["input_ids"].shape[1]
    frame_of_token = torch.tensor([-1] * P + [f for f in range(3) for _ in range(24)] + [-1] * (S - P - 72))
    Hkv = model.config.get_text_config().num_key_value_heads
    assert_close_verbose(torch.tensor(clip["tad_v2v"], dtype=torch.float64), tad_v2v(probs, frame_of_token, Hkv),
                         name="V2V", **TAD_TOL)
    assert_close_verbose(torch.tensor(clip["tad_t2v"], dtype=torch.float64),
                         tad_t2v(probs, frame_of_token, torch.arange(P + 72, S), Hkv), name="T2V", **TAD_TOL)


def test_the_profile_command_writes_a_map_for_the_model(checkpoint, loaded, video, tmp_path):
    out = tmp_path / "map.json"
    done = subprocess.run(
        [sys.executable, "-m", "hermes.profile_cli", "--model", checkpoint, "--videos", video, "--out",
         str(out), "--chunk-frames", "4", "--question", QUESTION, "--threads", "1", "--quiet"],
        cwd=REPO, env={**os.environ, "PYTHONPATH": REPO}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"wrote {out}: qwen3_vl")
    profile = load_head_map(out, loaded.model)
    assert profile.model_type == "qwen3_vl" and profile.clips[0]["tokens_per_frame"] == 24

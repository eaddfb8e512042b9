"""HermesStream on a tiny random LLaVA-OneVision-1.5 (RICE tower at one frame per patch row, Qwen3 decoder, 1D RoPE)
against transformers' own processing and forward of a whole short video: the chunks' patch rows are the whole
video's, the tokens are the processor's (`Exaone4_5_Processor`'s expansion of one <|video_pad|>) and sit at the
model's own positions, and with nothing evicted (both policies) the cache holds the keys and values of the model's
own forward of the whole video and the logits and answer are its own. Then what the family takes and refuses, its
presets, and the saved checkpoint through the `hermes` command. The shared stream behaviours run under this family
from tests/hermes/stream/ (`FAMILIES`)."""
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import DynamicCache
from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES
from transformers.models.exaone4_5.processing_exaone4_5 import Exaone4_5_Processor

from hermes import cli
from hermes.commands import load_model
from hermes.models import family_of
from hermes.models.llava_ov1_5 import LlavaOneVision1_5
from hermes.models.processing import Processor
from hermes.stream import HermesStream
from hermes_kernels import H2SVCConfig, HermesConfig
from scaffolding.checkpoint import save_tiny_checkpoint
from scaffolding.models import tiny_llava_ov1_5
from scaffolding.pixels import qwen_pixels
from scaffolding.processors import tiny_image_processor, tiny_video_processor_config
from scaffolding.tokenizer import tiny_tokenizer
from tests.hermes.models.qwen3_vl_reference import own_forward
from tests.hermes.models.test_family_inputs import Recorder, frames_of, same_inputs
from tests.hermes.models.test_qwen3_5_stream import error_bound
from tests.hermes.policies.h2svc.checks import MIXED_MAP
from tests.hermes.streams import QUESTION, layer_parts
from tests.hermes.video_files import write_video
from tests.utils import REPO

pytestmark = pytest.mark.usefixtures("single_thread")

MODEL_TYPE = "llava_onevision1_5"
FRAME = (12, 20)  # a 6 x 10 patch grid: 3 x 5 merged tokens per frame
FRAMES, CHUNK = 6, 2  # a whole video of 6 frames, streamed in chunks of 2
# the chat template of the released checkpoints (Qwen2-VL's): the video's pads between the vision markers
PREFIX = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n<|vision_start|>"


def question_text(question: str) -> str:
    return f"<|vision_end|>{question}<|im_end|>\n<|im_start|>assistant\n"


def processor() -> Processor:
    """The tiny checkpoint's tokenizer and torchvision-free twin of Qwen2VLVideoProcessor (temporal patch 1)."""
    twin = LlavaOneVision1_5().pil_video_processor(tiny_image_processor(MODEL_TYPE),
                                                   tiny_video_processor_config(MODEL_TYPE))
    return Processor(tokenizer=tiny_tokenizer(), video_processor=twin)


def video_pads(video_processor, grid: torch.Tensor) -> str:
    """transformers' expansion of one video's <|video_pad|> by the processor it maps llava_onevision1_5 to."""
    holder = SimpleNamespace(video_processor=video_processor, video_token="<|video_pad|>")
    return Exaone4_5_Processor.replace_video_token(holder, {"video_grid_thw": grid}, 0)


def whole_video(proc, videos: list[np.ndarray], question: str) -> dict:
    """The model's inputs for prefix + one whole video per stream + question, as the processor lays them out:
    input_ids [B, S], pixel_values_videos (stream-major), video_grid_thw [B, 3]."""
    out = [proc.video_processor(videos=[video], do_sample_frames=False) for video in videos]
    text = PREFIX + video_pads(proc.video_processor, out[0]["video_grid_thw"]) + question_text(question)
    ids = torch.tensor([proc.tokenizer(text, add_special_tokens=False)["input_ids"]] * len(videos))
    return {"input_ids": ids, "pixel_values_videos": torch.cat([o["pixel_values_videos"] for o in out]),
            "video_grid_thw": torch.cat([o["video_grid_thw"] for o in out])}


def chunks_of(proc, videos: list[np.ndarray]) -> list[dict]:
    """append_video arguments of each chunk of CHUNK frames for the streams in lockstep (one clip per stream, 1 fps)."""
    family, out = LlavaOneVision1_5(), []
    for start in range(0, FRAMES, CHUNK):
        inputs = [family.prepare_frames(proc, video[start:start + CHUNK], 1.0, start=start) for video in videos]
        out.append(dict(inputs[0], video=torch.cat([i["video"] for i in inputs])))
    return out


def random_videos(count: int = 2, seed: int = 0) -> list[np.ndarray]:
    return [frames_of(FRAMES, *FRAME, seed=seed + index) for index in range(count)]


def test_the_processor_is_the_one_transformers_maps_the_model_to():
    """transformers processes llava_onevision1_5 with EXAONE 4.5's processor, whose video tokens are the grid's merged
    patches (no markers per frame), through Qwen2-VL's video processor: the twin's layout."""
    assert PROCESSOR_MAPPING_NAMES[MODEL_TYPE] == "Exaone4_5_Processor"
    proc = processor()
    assert video_pads(proc.video_processor, torch.tensor([[6, 6, 10]])) == "<|video_pad|>" * 90


def test_a_whole_video_is_laid_out_and_placed_as_the_model_does():
    """Chunks of 2 frames: their patch rows and grids are the whole video's (rows of the same frames, t-major), their
    tokens the processor's pads (15 per frame), and every layer's cached positions the ones the model's own forward
    hands its language model (1D, counting tokens)."""
    model, proc = tiny_llava_ov1_5(), processor()
    video = random_videos(1)[0]
    chunks = chunks_of(proc, [video])
    whole = whole_video(proc, [video], QUESTION)
    assert torch.equal(torch.cat([chunk["video"] for chunk in chunks]), whole["pixel_values_videos"])
    assert [chunk["grid_thw"].tolist() for chunk in chunks] == [[[CHUNK, 6, 10]]] * 3
    assert whole["video_grid_thw"].tolist() == [[FRAMES, 6, 10]]
    seen = []
    hook = model.model.language_model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["position_ids"]), with_kwargs=True)
    try:
        own_forward(model, whole)
    finally:
        hook.remove()
    stream = HermesStream(model, proc.tokenizer, budget=400, chunk_frames=CHUNK, frame_size=FRAME, room=64)
    assert stream.chunk_tokens == 30
    for chunk in chunks:
        stream.append_video(**chunk)
    length = stream.cache.length
    pads = whole["input_ids"][0] == model.config.video_token_id
    assert length == len(stream.prefix_ids) + FRAMES * 15 == int(pads.nonzero().max()) + 1 and pads.sum() == 90
    for layer in range(stream.cfg.num_layers):
        assert torch.equal(stream.cache.layer_positions(layer)[0], seen[0][0, :length]), layer


@pytest.mark.parametrize("policy", ["hermes", "h2svc"])
def test_a_budget_above_the_video_is_the_models_own_forward(policy):
    """Two streams, two different whole videos in three chunks each, nothing evicted (HERMES: budget above the
    video; H2SVC: windows of every frame): every layer's cached keys and values (per KV head, its class's rows for
    H2SVC) are those of the model's own forward of prefix + whole video + question (its tower on the whole video at
    once), positions exactly its own, the next-token logits its own, and `ask` gives its greedy answer. Errors within
    twice the fp32 model's own off the float64 model's (`error_bound`)."""
    model, exact, proc = tiny_llava_ov1_5(), tiny_llava_ov1_5(dtype=torch.float64), processor()
    videos = random_videos(2, seed=10)
    whole = whole_video(proc, videos, QUESTION)
    own_cache, exact_cache = DynamicCache(config=model.config), DynamicCache(config=exact.config)
    own_logits = own_forward(model, whole, cache=own_cache, use_cache=True).logits[:, -1]
    exact_inputs = dict(whole, pixel_values_videos=whole["pixel_values_videos"].double())
    exact_logits = own_forward(exact, exact_inputs, cache=exact_cache, use_cache=True).logits[:, -1]
    with torch.no_grad():
        answer = model.generate(**whole, max_new_tokens=6, do_sample=False, pad_token_id=proc.tokenizer.pad_token_id,
                                eos_token_id=proc.tokenizer.eos_token_id)[:, whole["input_ids"].shape[1]:]

    args = dict(budget=400) if policy == "hermes" else dict(policy="h2svc", head_map=MIXED_MAP, instant_frames=6,
                                                            short_frames=6, episodic_frames=6)
    stream = HermesStream(model, proc.tokenizer, batch_size=2, chunk_frames=CHUNK, frame_size=FRAME, room=64, **args)
    for chunk in chunks_of(proc, videos):
        stream.append_video(**chunk)
    length, held = stream.cache.length, stream.cache.contents()
    positions = torch.arange(length).expand(2, -1)
    for layer in range(stream.cfg.num_layers):
        own, ref = own_cache.layers[layer], exact_cache.layers[layer]
        for heads, name in layer_parts(stream, layer):
            for kind in ("keys", "values"):
                error_bound(held[f"{name} {kind}"], getattr(own, kind)[:, heads, :length],
                            getattr(ref, kind)[:, heads, :length], f"{name} {kind}")
            got = held[f"{name} positions"]
            assert torch.equal(got, positions if policy == "hermes" else positions[:, None].expand_as(got)), name
    error_bound(stream.next_token_logits(QUESTION), own_logits, exact_logits, f"{policy} last-token logits")
    assert stream.ask(QUESTION, max_new_tokens=6) == proc.tokenizer.batch_decode(answer, skip_special_tokens=True)


def test_rotary_counts_and_presets():
    """1D rotary (the rotary module's own inv_freq), one video frame per H2SVC frame with h' x w' merged tokens, a
    chunk without positions whose extent is its last offset; the family's presets are `llava_ov`'s constants (HERMES)
    and the frame's tokens (H2SVC), and the streams build them."""
    model, family = tiny_llava_ov1_5(), LlavaOneVision1_5()
    inv_freq, layout = family.rotary(model)
    assert inv_freq is model.model.language_model.rotary_emb.inv_freq and layout is None
    assert type(family_of(model)) is LlavaOneVision1_5 and family.step_frames(model) == 1
    assert family.tokens_per_frame(model, FRAME) == 15 and family.tokens_per_chunk(model, 3, FRAME) == 45
    video, grid = qwen_pixels(2, 3, torch.Generator().manual_seed(1), *FRAME, temporal_patch_size=1)
    chunk = family.encode_video(model, None, video, 2, grid_thw=grid)
    assert chunk.embeds.shape == (2, 45, 64) and chunk.rel_positions is None
    assert (chunk.frames, chunk.extent, chunk.extra) == (3, 44, None)
    assert family.text_kwargs(torch.zeros(1, 3, dtype=torch.long)) == {}
    assert HermesConfig.preset("llava_ov1_5", 4, 40, 10) == HermesConfig.llava_ov(4, 40, 10)
    assert H2SVCConfig.preset("llava_ov1_5", 4, 2, 10, tokens_per_frame=15) == \
        H2SVCConfig(4, 2, 10, tokens_per_frame=15, max_positions=32768)
    tok = tiny_tokenizer()
    stream = HermesStream(model, tok, budget=40, chunk_frames=2, frame_size=FRAME)
    assert stream.cfg == HermesConfig.llava_ov(4, 40, stream.cfg.prefix_len, max_positions=4096)
    with pytest.warns(UserWarning, match="not profiled"):
        h2svc = HermesStream(model, tok, policy="h2svc", chunk_frames=2, frame_size=FRAME)
    assert (h2svc.cfg.tokens_per_frame, h2svc.cfg.max_positions) == (15, 4096)


def test_refusals_name_the_argument_before_the_tower_runs():
    """Rows of two frames (a temporal patch of 2), a missing grid, integer pixels and Qwen2.5-VL's timing are refused
    naming video, grid_thw and append_video, and the vision tower never runs."""
    model, family = tiny_llava_ov1_5(num_layers=1), LlavaOneVision1_5()
    g = torch.Generator().manual_seed(2)
    video, grid = qwen_pixels(1, 2, g, temporal_patch_size=1)
    paired, paired_grid = qwen_pixels(1, 4, g)  # [2, 8, 8]: the grid of `video`, rows twice as wide
    runs = []
    hook = model.model.visual.register_forward_pre_hook(lambda *args: runs.append(1))
    try:
        with pytest.raises(ValueError, match=r"^video: expected flattened patches \[B\*t\*h\*w=128, 12\]"):
            family.encode_video(model, None, paired, 1, grid_thw=paired_grid)
        with pytest.raises(ValueError, match=r"^grid_thw: LLaVA-OneVision-1.5 pixel values need"):
            family.encode_video(model, None, video, 1)
        with pytest.raises(TypeError, match=r"^video: expected floating pixel values \[B \* t \* h \* w, 12\]"):
            family.encode_video(model, None, video.long(), 1, grid_thw=grid)
        with pytest.raises(TypeError, match=r"^append_video: unexpected arguments for LLaVA-OneVision-1.5: "
                                            r"\['seconds_per_grid'\]"):
            family.encode_video(model, None, video, 1, grid_thw=grid, seconds_per_grid=1.0)
        assert runs == []
        family.encode_video(model, None, video, 1, grid_thw=grid)
    finally:
        hook.remove()
    assert runs == [1]


def test_prepare_frames_asks_for_frames_as_given_and_ignores_their_time():
    """The video processor gets the frames as given (no sampling, no pixel cap) and the output is video and grid
    alone: fps, start and times (a gap included) change nothing, bad times are still refused naming times; a video
    processor at temporal_patch_size 2 is refused naming processor."""
    family, proc = LlavaOneVision1_5(), processor()
    frames = frames_of(3, *FRAME, seed=3)
    want = family.prepare_frames(proc, frames, 1.0)
    assert sorted(want) == ["grid_thw", "video"] and want["grid_thw"].tolist() == [[3, 6, 10]]
    for fps, start, times in ((4.0, 2.5, None), (1.0, 0.0, [0.0, 5.0, 6.5]), (2.0, 0.0, np.array([1.0, 1.5, 2.0]))):
        assert same_inputs(family.prepare_frames(proc, frames, fps, start=start, times=times), want)
    with pytest.raises(ValueError, match=r"^times: expected increasing seconds"):
        family.prepare_frames(proc, frames, 1.0, times=[0.0, 2.0, 1.0])
    recorder = Recorder({"pixel_values_videos": torch.zeros(1), "video_grid_thw": torch.tensor([[2, 2, 2]])})
    recorder.temporal_patch_size = 1
    family.prepare_frames(Processor(tokenizer=None, video_processor=recorder), frames[:2], 1.0)
    (args, kwargs), = recorder.calls
    assert args == () and np.array_equal(kwargs.pop("videos")[0], frames[:2])
    assert kwargs == {"return_tensors": "pt", "do_sample_frames": False, "cap_pixels_per_frame": False}
    recorder.temporal_patch_size = 2
    with pytest.raises(ValueError, match=r"^processor: LLaVA-OneVision-1.5's tower takes one frame per patch row "
                                         r"\(temporal_patch_size 1\); the video processor's temporal_patch_size is 2"):
        family.prepare_frames(Processor(tokenizer=None, video_processor=recorder), frames[:2], 1.0)


def test_the_saved_checkpoint_runs_in_the_hermes_command(tmp_path):
    """`save_tiny_checkpoint` writes a folder `load_model` loads as this family, with the twin at the saved temporal
    patch of 1; `python -m hermes --model DIR` streams a 10 s video at 1 fps in chunks of 4, 4 and 2 frames (each
    compressing, 12 tokens a frame) and answers, exit 0; H2SVC runs on it in-process."""
    checkpoint = save_tiny_checkpoint(tmp_path / "model", MODEL_TYPE)
    loaded = load_model(checkpoint, device="cpu")
    assert type(loaded.family) is LlavaOneVision1_5 and loaded.processor.video_processor.temporal_patch_size == 1
    video = write_video(tmp_path / "cfr.mp4", [i / 4 for i in range(40)])
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-m", "hermes", "--model", checkpoint, "--video", video, "--fps", "1",
                           "--chunk-frames", "4", "--budget", "20", "--max-new-tokens", "4", "--question", QUESTION,
                           "--device", "cpu", "--threads", "1", "--json", "--quiet"], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in done.stdout.splitlines()]
    assert [(r["frames"], r["compressed"]) for r in records if r["type"] == "chunk"] == [(4, True), (4, True),
                                                                                        (2, True)]
    assert [r["type"] for r in records][-1] == "answer"
    with pytest.warns(UserWarning, match="not profiled"):
        h2svc = cli.run(loaded, video, questions=[QUESTION], fps=1, chunk_frames=4, policy="h2svc", max_new_tokens=2)
    assert [r["type"] for r in h2svc] == ["chunk"] * 3 + ["answer"]

"""What each family's `encode_video` takes and refuses, called directly (the streams reach it through
`append_video`): the refusals' names and expected shapes, one stream's pixels without a batch axis, frames at
the edges of a clip's length, raw frames through a processor, pixels in another dtype or on another device than the
model's, and the processor settings behind them (`patchify` against a plain loop, the twin's call, the options
`load_processor` passes on)."""
import re

import numpy as np
import pytest
import torch

from hermes.models import family_of, processing
from hermes.models.llava_ov import LlavaOneVision
from hermes.models.processing import Processor
from hermes.models.qwen2_5_vl import patchify
from hermes.models.qwen3_vl import TIMESTAMP_DIGITS
from scaffolding.models import tiny_llava_ov, tiny_qwen2_5_vl
from scaffolding.pixels import llava_pixels, qwen_pixels
from scaffolding.processors import tiny_image_processor, tiny_video_processor_config
from scaffolding.tokenizer import tiny_tokenizer

pytestmark = pytest.mark.usefixtures("single_thread")

LLAVA_SHAPE = r"\[B=1, F, C=3, 16, 16\]"


@pytest.fixture(scope="module")
def llava():
    return tiny_llava_ov(num_layers=1)


@pytest.fixture(scope="module")
def qwen():
    return tiny_qwen2_5_vl(num_layers=1)


def frames_of(count, height=16, width=16, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (count, height, width, 3), dtype=np.uint8)


def test_llava_refusals_name_the_video_and_the_expected_shape(llava):
    family = LlavaOneVision()
    with pytest.raises(TypeError, match=rf"^video: expected floating pixel values {LLAVA_SHAPE} \(or raw frames"):
        family.encode_video(llava, None, torch.zeros(1, 2, 3, 16, 16, dtype=torch.int64), 1)
    bad = {"no frames": torch.zeros(1, 0, 3, 16, 16), "two channels": torch.zeros(1, 2, 2, 16, 16),
           "another side": torch.zeros(1, 2, 3, 8, 8), "another batch": torch.zeros(2, 2, 3, 16, 16),
           "no batch axis for two streams": torch.zeros(2, 3, 16, 16)}
    for name, video in bad.items():
        batch = 2 if name == "no batch axis for two streams" else 1
        want = LLAVA_SHAPE.replace("B=1", f"B={batch}")
        got = re.escape(str(tuple(video.shape)))
        with pytest.raises(ValueError, match=rf"^video: expected pixel values {want}, got {got}$"):
            family.encode_video(llava, None, video, batch)
    with pytest.raises(TypeError, match=r"^append_video: unexpected arguments for LLaVA-OneVision: \['grid_thw'\]"):
        family.encode_video(llava, None, torch.zeros(1, 1, 3, 16, 16), 1, grid_thw=None)


def test_llava_one_stream_without_a_batch_axis_and_one_or_two_frames(llava):
    family = LlavaOneVision()
    for frames in (1, 2):
        video = llava_pixels(1, frames, torch.Generator().manual_seed(frames))
        batched = family.encode_video(llava, None, video, 1)
        alone = family.encode_video(llava, None, video[0], 1)
        assert batched.frames == alone.frames == frames and batched.embeds.shape == (1, 16 * frames, 64)
        assert torch.equal(alone.embeds, batched.embeds) and batched.extent == 16 * frames - 1
    assert family.tokens_per_frame(llava) == 16


@pytest.mark.parametrize("image_size", [6, 9])
def test_llava_tokens_per_frame_counts_whole_patches(image_size):
    """Frames of 6 and 9 pixels in patches of 2: a 3 x 3 grid (9 // 2 = 4: 4 x 4; the odd pixel is no patch),
    pooled to 2 x 2; the count is the tower's."""
    model = tiny_llava_ov(num_layers=1, image_size=image_size)
    count = LlavaOneVision().tokens_per_frame(model)
    chunk = LlavaOneVision().encode_video(model, None, llava_pixels(1, 1, torch.Generator(), image_size), 1)
    assert count == 4 and isinstance(count, int) and chunk.embeds.shape[1] == count


@pytest.mark.parametrize("tower", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("build", [tiny_llava_ov, tiny_qwen2_5_vl])
def test_pixels_follow_the_tower_and_embeddings_the_language_model_s_dtype(build, tower):
    """float32 pixels into a model whose language model is bfloat16 (its tower bfloat16 or float32): the tower gets
    its dtype, the chunk's embeddings are bfloat16 and equal what the tower gives for pixels cast by hand."""
    model = build(num_layers=1).to(tower)
    model.model.language_model.to(torch.bfloat16)
    family = family_of(model)
    g = torch.Generator().manual_seed(2)
    if build is tiny_llava_ov:
        video, kwargs = llava_pixels(1, 2, g), {}
    else:
        video, grid = qwen_pixels(1, 2, g)
        kwargs = {"grid_thw": grid}
    chunk = family.encode_video(model, None, video, 1, **kwargs)
    cast = family.encode_video(model, None, video.to(tower), 1, **kwargs)
    assert chunk.embeds.dtype == torch.bfloat16 and torch.equal(chunk.embeds, cast.embeds)


def test_llava_pixels_move_to_the_tower_and_embeddings_to_the_language_model():
    """The meta device stands in for a second device: CPU pixels reach a tower on it, and the features of a CPU
    tower reach a language model on it."""
    family = LlavaOneVision()
    video = llava_pixels(1, 2, torch.Generator().manual_seed(3))
    model = tiny_llava_ov(num_layers=1).to("meta")
    assert family.encode_video(model, None, video, 1).embeds.device.type == "meta"
    model = tiny_llava_ov(num_layers=1)
    model.model.language_model.to("meta")
    assert family.encode_video(model, None, video, 1).embeds.device.type == "meta"


def test_qwen2_5_vl_refuses_a_bad_interval_and_extra_arguments(qwen):
    family = family_of(qwen)
    video, grid = qwen_pixels(1, 2, torch.Generator().manual_seed(4))
    for bad in (0, -0.5, "1", None):
        with pytest.raises(ValueError, match=rf"^seconds_per_grid: expected a positive number, got {bad!r}"):
            family.encode_video(qwen, None, video, 1, grid_thw=grid, seconds_per_grid=bad)
    with pytest.raises(TypeError, match=r"^append_video: unexpected arguments for Qwen2.5-VL: \['fps'\]"):
        family.encode_video(qwen, None, video, 1, grid_thw=grid, fps=2)


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "llava_onevision"])
def test_raw_frames_go_through_the_processor(model_type):
    """Raw frames with a processor: the chunk equals the one of the processor's own output."""
    model = (tiny_qwen2_5_vl if model_type == "qwen2_5_vl" else tiny_llava_ov)(num_layers=1)
    family = family_of(model)
    twin = family.pil_video_processor(tiny_image_processor(model_type), tiny_video_processor_config(model_type))
    processor = Processor(tokenizer=tiny_tokenizer(), video_processor=twin)
    clip = frames_of(2, seed=5)
    chunk = family.encode_video(model, processor, [clip], 1)
    out = twin([clip])
    kwargs = {"grid_thw": out["video_grid_thw"]} if model_type == "qwen2_5_vl" else {}
    pixels = out["pixel_values_videos"]
    assert torch.equal(chunk.embeds, family.encode_video(model, None, pixels, 1, **kwargs).embeds)
    if model_type == "qwen2_5_vl":
        assert torch.equal(chunk.rel_positions, family.encode_video(model, None, pixels, 1, **kwargs).rel_positions)


def plain_patchify(frames, patch, merge, temporal):
    """patchify written as loops over the temporal steps and merge windows (the layout its docstring states)."""
    count, channels, height, width = frames.shape
    frames = np.concatenate([frames, np.repeat(frames[-1:], -count % temporal, axis=0)])
    rows = []
    for t in range(frames.shape[0] // temporal):
        for wy in range(height // (patch * merge)):
            for wx in range(width // (patch * merge)):
                for y in range(merge):
                    for x in range(merge):
                        top, left = (wy * merge + y) * patch, (wx * merge + x) * patch
                        block = frames[t * temporal:(t + 1) * temporal, :, top:top + patch, left:left + patch]
                        rows.append(block.transpose(1, 0, 2, 3).reshape(-1))
    return np.stack(rows)


@pytest.mark.parametrize("count,patch,temporal", [(4, 3, 3), (5, 3, 2), (1, 2, 2), (6, 1, 3)])
def test_patchify_matches_the_plain_loop(count, patch, temporal):
    merge = 2
    frames = np.random.default_rng(count).standard_normal((count, 3, 2 * patch * merge, patch * merge))
    frames = frames.astype(np.float32)
    rows, grid = patchify(frames, patch, merge, temporal)
    steps = -(-count // temporal)
    assert grid == (steps, 2 * merge, merge)
    assert rows.shape == (steps * 2 * merge * merge, 3 * temporal * patch * patch)
    assert np.array_equal(rows, plain_patchify(frames, patch, merge, temporal))


def test_the_twin_takes_one_clip_or_a_list_and_gives_float32_and_int64():
    twin = family_of(tiny_qwen2_5_vl(num_layers=1)).pil_video_processor(
        tiny_image_processor("qwen2_5_vl"), tiny_video_processor_config("qwen2_5_vl"))
    clip = frames_of(2, seed=6)
    one, listed = twin(clip), twin([clip])
    assert one["pixel_values_videos"].dtype == torch.float32 and one["video_grid_thw"].dtype == torch.int64
    assert all(torch.equal(one[key], listed[key]) for key in one)
    raw = family_of(tiny_qwen2_5_vl(num_layers=1)).pil_video_processor(
        tiny_image_processor("qwen2_5_vl"), dict(tiny_video_processor_config("qwen2_5_vl"), do_rescale=False,
                                                 do_normalize=False))
    assert raw(clip)["pixel_values_videos"].dtype == torch.float32  # uint8 frames neither rescaled nor normalised
    two = twin([clip, clip])
    assert two["video_grid_thw"].tolist() == [one["video_grid_thw"][0].tolist()] * 2


def test_the_twin_converts_frames_as_channels_last_rgb():
    """A red frame [H, W, 3] only 3 rows high, which would pass for a channels-first image: the twin reads its
    channels last (red above green everywhere), float32; an RGBA frame is converted to three channels."""
    twin = LlavaOneVision().pil_video_processor(tiny_image_processor("llava_onevision"),
                                                tiny_video_processor_config("llava_onevision"))
    frame = np.zeros((3, 16, 3), dtype=np.uint8)
    frame[..., 0] = 255  # pure red
    out = twin.frames(np.stack([frame]))
    assert out.shape == (1, 3, 16, 16) and out.dtype == np.float32
    red, green = out[0, 0], out[0, 1]
    assert (red > green).all()
    rgba = np.concatenate([frame, np.full((3, 16, 1), 255, dtype=np.uint8)], axis=-1)
    assert np.array_equal(twin.frames(np.stack([rgba])), out)


def test_load_processor_passes_the_options_on(monkeypatch, tmp_path):
    """With torchvision: AutoProcessor with every option. Without: the video processor's settings read with
    local_files_only only, the tokenizer and image processor with every option."""
    seen = {}
    options = {"local_files_only": True, "trust_remote_code": False}
    monkeypatch.setattr(processing, "is_torchvision_available", lambda: True)
    monkeypatch.setattr(processing.AutoProcessor, "from_pretrained",
                        lambda path, **kw: seen.setdefault("auto", (path, kw)) and "processor")
    assert processing.load_processor(tmp_path, None, **options) == "processor"
    assert seen["auto"] == (tmp_path, options)
    monkeypatch.setattr(processing, "is_torchvision_available", lambda: False)
    monkeypatch.setattr(processing.BaseVideoProcessor, "get_video_processor_dict",
                        lambda path, **kw: (seen.setdefault("config", (path, kw)), None)[1:] and ({"a": 1}, None))
    monkeypatch.setattr(processing.AutoTokenizer, "from_pretrained", lambda path, **kw: ("tokenizer", kw))
    monkeypatch.setattr(processing.AutoImageProcessor, "from_pretrained", lambda path, **kw: ("image", kw))

    class Family:
        def pil_video_processor(self, image, config):
            return image, config

    got = processing.load_processor(tmp_path, Family(), **options)
    assert seen["config"] == (str(tmp_path), {"local_files_only": True})
    assert got.tokenizer == ("tokenizer", options) and got.video_processor == (("image", options), {"a": 1})


# (21, 43), (33, 38), (20, 24), (25, 30): sizes where max_pixels off by a fraction of a pixel (longest_edge / frames
# in place of //) resizes otherwise
QWEN3_SIZES = [(16, 16), (9, 40), (31, 17), (48, 64), (70, 23), (100, 90), (21, 43), (33, 38), (20, 24), (25, 30)]


@pytest.mark.parametrize("shortest,longest,max_tokens,temporal", [
    (64, 128 * 128, 12, 2),   # the tiny checkpoint's: the per-frame token cap decides
    (400, 1001, 768, 2),      # the even share of an odd longest_edge decides (1001 // 2)
    (600, 1000, 768, 2),      # the floor, 1.05 x shortest_edge, decides
    (64, 1000, 768, 3),       # three frames a temporal step: the share is 1000 // 3
])
def test_qwen3_vl_frame_sizes_match_transformers_count(shortest, longest, max_tokens, temporal):
    """The twin's clip-wide resize (a clip of one temporal step) and `kept_size` against transformers' own count,
    `Qwen3VLVideoProcessor.get_num_of_video_patches`, on a real processor built from the same settings with the
    per-frame cap on (building one and counting need no torchvision; only its resize does)."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    from hermes.models.qwen3_vl import Qwen3_VL
    config = dict(tiny_video_processor_config("qwen3_vl"), size={"shortest_edge": shortest, "longest_edge": longest},
                  max_video_tokens=max_tokens, temporal_patch_size=temporal)
    twin = Qwen3_VL().pil_video_processor(tiny_image_processor("qwen3_vl"), config)
    counter = Qwen3VLVideoProcessor(size=config["size"], patch_size=2, merge_size=2, temporal_patch_size=temporal,
                                    cap_pixels_per_frame=True, max_video_tokens=max_tokens)
    processor = Processor(tokenizer=tiny_tokenizer(), video_processor=twin)
    for height, width in QWEN3_SIZES:
        want = counter.get_num_of_video_patches(temporal, height, width)
        grid = twin(frames_of(temporal, height, width), cap_pixels_per_frame=True)["video_grid_thw"][0].tolist()
        kept = Qwen3_VL().kept_size(processor, height, width)
        assert grid[0] == 1 and grid[1] * grid[2] == want, (height, width)
        assert (kept[0] // 2) * (kept[1] // 2) == want and list(kept) == [grid[1] * 2, grid[2] * 2], (height, width)


def test_qwen3_vl_a_twin_set_to_cap_caps_without_being_asked():
    """cap_pixels_per_frame set in the checkpoint's settings holds for a call that does not pass it."""
    from hermes.models.qwen3_vl import Qwen3_VL
    config = dict(tiny_video_processor_config("qwen3_vl"), size={"shortest_edge": 64, "longest_edge": 128 * 128},
                  max_video_tokens=12, cap_pixels_per_frame=True)
    twin = Qwen3_VL().pil_video_processor(tiny_image_processor("qwen3_vl"), config)
    clip = frames_of(2, 64, 64)
    capped = twin(clip)["video_grid_thw"][0].tolist()
    assert capped == twin(clip, cap_pixels_per_frame=True)["video_grid_thw"][0].tolist()
    assert capped != twin(clip, cap_pixels_per_frame=False)["video_grid_thw"][0].tolist()


class BosTokenizer:
    """The tiny tokenizer adding a BOS id in front unless asked not to, as many checkpoints' tokenizers do."""

    def __init__(self):
        self.inner = tiny_tokenizer(digits=True)

    def __call__(self, text, add_special_tokens=True):
        ids = self.inner(text, add_special_tokens=False)["input_ids"]
        return {"input_ids": ([999] if add_special_tokens else []) + list(ids)}


@pytest.fixture(scope="module")
def qwen3():
    from scaffolding.models import tiny_qwen3_vl
    return tiny_qwen3_vl(num_layers=1)


def qwen3_processor(model_type="qwen3_vl"):
    from hermes.models.qwen3_vl import Qwen3_VL
    twin = Qwen3_VL().pil_video_processor(tiny_image_processor(model_type), tiny_video_processor_config(model_type))
    return Processor(tokenizer=tiny_tokenizer(digits=True), video_processor=twin)


def test_qwen3_vl_timestamps_carry_no_special_tokens(qwen3):
    """A tokenizer that adds a BOS unless told not to: the timestamps are written without it (one run is its
    timestamp's 10 tokens, <|vision_start|>, 4 x 4 visual tokens and <|vision_end|> at 10 + 1 + 4)."""
    from hermes.models.qwen3_vl import Qwen3_VL
    family = Qwen3_VL()
    assert family.tokens_per_frame(qwen3, (16, 16), BosTokenizer()) == (TIMESTAMP_DIGITS + 5) + 2 + 16
    video, grid = qwen_pixels(1, 2, torch.Generator().manual_seed(7))
    chunk = family.encode_video(qwen3, BosTokenizer(), video, 1, grid_thw=grid, timestamps=[0.5])
    assert chunk.embeds.shape[1] == 28 and chunk.extent == 10 + 1 + 4


def test_qwen3_vl_refuses_a_processor_it_cannot_call(qwen3):
    from hermes.models.qwen3_vl import Qwen3_VL
    video, grid = qwen_pixels(1, 2, torch.Generator().manual_seed(8))
    for bad in (object(), Processor(tokenizer=None, video_processor=None), 5):
        with pytest.raises(TypeError, match=r"^processor: Qwen3-VL chunks carry text timestamps; pass the model's"):
            Qwen3_VL().encode_video(qwen3, bad, video, 1, grid_thw=grid, timestamps=[0.5])


def test_qwen3_vl_raw_frames_one_clip_or_a_list(qwen3):
    """Raw frames with a processor: one clip as an array [F, H, W, 3] or a list of one clip give the chunk of the
    processor's own output; raw frames with a tokenizer alone (no video processor) are refused naming video."""
    from hermes.models.qwen3_vl import Qwen3_VL
    family, processor = Qwen3_VL(), qwen3_processor()
    clip = frames_of(2, seed=9)
    out = family._process(processor.video_processor, [clip])
    want = family.encode_video(qwen3, processor, out["pixel_values_videos"], 1, grid_thw=out["video_grid_thw"],
                               timestamps=[0.5])
    for video in (clip, [clip]):
        got = family.encode_video(qwen3, processor, video, 1, timestamps=[0.5])
        assert torch.equal(got.embeds, want.embeds) and torch.equal(got.rel_positions, want.rel_positions)
    with pytest.raises(TypeError, match=r"^video: expected floating pixel values"):
        family.encode_video(qwen3, processor.tokenizer, clip, 1, timestamps=[0.5])


def test_qwen3_vl_deepstack_features_take_the_language_model_s_dtype():
    """A float32 tower before a bfloat16 language model: the chunk's embeddings and DeepStack features are
    bfloat16; the DeepStack mask marks the chunk's visual slots only."""
    from scaffolding.models import tiny_qwen3_vl
    model = tiny_qwen3_vl(num_layers=1)
    model.model.language_model.to(torch.bfloat16)
    family = family_of(model)
    video, grid = qwen_pixels(1, 2, torch.Generator().manual_seed(10))
    tokenizer = tiny_tokenizer(digits=True)
    chunk = family.encode_video(model, tokenizer, video, 1, grid_thw=grid, timestamps=[0.5])
    extra = chunk.extra(chunk.embeds.shape[1] + 3)
    assert chunk.embeds.dtype == torch.bfloat16 and len(extra["deepstack_visual_embeds"]) >= 1
    assert all(feature.dtype == torch.bfloat16 for feature in extra["deepstack_visual_embeds"])
    mask = extra["visual_pos_masks"]
    assert mask.dtype == torch.bool and mask.shape == (1, chunk.embeds.shape[1] + 3)
    assert mask.sum() == 16 and not mask[0, -3:].any()


class Recorder:
    """A video processor that records its calls and answers with fixed outputs."""

    def __init__(self, out):
        self.calls, self.out, self.temporal_patch_size = [], out, 2

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return self.out


@pytest.mark.parametrize("model_type", ["llava_onevision", "qwen2_5_vl", "qwen3_vl"])
def test_prepare_frames_asks_the_processor_for_tensors_without_sampling(model_type):
    """What `prepare_frames` asks of a checkpoint's video processor (transformers' own, where torchvision imports):
    torch tensors, the frames as given (no sampling: the reader sampled them), and for Qwen2.5-VL no per-frame cap,
    for Qwen3-VL the cap (docs/families.md#processors)."""
    family = family_of({"llava_onevision": tiny_llava_ov, "qwen2_5_vl": tiny_qwen2_5_vl}.get(
        model_type, __import__("scaffolding.models", fromlist=["x"]).tiny_qwen3_vl)(num_layers=1))
    recorder = Recorder({"pixel_values_videos": torch.zeros(1), "video_grid_thw": torch.tensor([[1, 2, 2]])})
    clip = frames_of(2)
    family.prepare_frames(Processor(tokenizer=None, video_processor=recorder), clip, 2.0)
    (args, kwargs), = recorder.calls
    videos = kwargs.pop("videos")
    assert args == () and len(videos) == 1 and np.array_equal(videos[0], clip)
    want = {"return_tensors": "pt", "do_sample_frames": False}
    if model_type != "llava_onevision":
        want["cap_pixels_per_frame"] = model_type == "qwen3_vl"
    assert kwargs == want and all(type(value) is type(want[key]) for key, value in kwargs.items())


def test_qwen2_5_vl_raw_frames_are_handed_to_the_processor_as_given(qwen):
    """encode_video with raw frames: the processor gets them as the first argument with return_tensors="pt", and
    its pixel values and grid are what the chunk encodes."""
    family = family_of(qwen)
    video, grid = qwen_pixels(1, 2, torch.Generator().manual_seed(11))
    recorder = Recorder({"pixel_values_videos": video, "video_grid_thw": grid})
    frames = [frames_of(2)]
    chunk = family.encode_video(qwen, Processor(tokenizer=None, video_processor=recorder), frames, 1)
    assert recorder.calls == [((frames,), {"return_tensors": "pt"})]
    assert torch.equal(chunk.embeds, family.encode_video(qwen, None, video, 1, grid_thw=grid).embeds)


def test_qwen_frame_counts_and_sizes_of_a_lockstep_batch(qwen):
    """memory_frames and frame_size read the first row of a grid of one row per stream."""
    family = family_of(qwen)
    inputs = {"grid_thw": torch.tensor([[3, 4, 6], [3, 4, 6]])}
    assert family.memory_frames(inputs) == 3 and family.frame_size(qwen, inputs) == (8, 12)
    assert family.memory_frames({"grid_thw": [3, 4, 6]}) == 3


def test_video_positions_are_made_on_the_device_asked():
    from hermes.models.qwen2_5_vl import video_rel_positions
    rel = video_rel_positions((2, 4, 6), 2, 1.5, device="meta")
    assert rel.device.type == "meta" and rel.shape == (3, 12) and rel.dtype == torch.int64


@pytest.mark.parametrize("model_type", ["llava_onevision", "qwen2_5_vl", "qwen3_vl"])
def test_a_chunk_lives_on_the_language_model_s_device(model_type):
    """The tower on the CPU, the language model on the meta device (standing in for a second device): the chunk's
    embeddings, positions and DeepStack arguments are made on the language model's device."""
    from scaffolding.models import tiny_qwen3_vl
    model = {"llava_onevision": tiny_llava_ov, "qwen2_5_vl": tiny_qwen2_5_vl, "qwen3_vl": tiny_qwen3_vl}[model_type](
        num_layers=1)
    model.model.language_model.to("meta")
    family = family_of(model)
    g = torch.Generator().manual_seed(12)
    if model_type == "llava_onevision":
        chunk = family.encode_video(model, None, llava_pixels(1, 2, g), 1)
    else:
        video, grid = qwen_pixels(1, 2, g)
        stamps = {"timestamps": [0.5]} if model_type == "qwen3_vl" else {}
        chunk = family.encode_video(model, tiny_tokenizer(digits=True), video, 1, grid_thw=grid, **stamps)
        assert chunk.rel_positions.device.type == "meta"
    assert chunk.embeds.device.type == "meta"
    if model_type == "qwen3_vl":
        extra = chunk.extra(chunk.embeds.shape[1])
        assert extra["visual_pos_masks"].device.type == "meta"
        assert all(feature.device.type == "meta" for feature in extra["deepstack_visual_embeds"])


def test_qwen_grid_and_patch_refusals(qwen):
    """Qwen2.5-VL's grid_thw and patches: a grid as [3] or one row for every stream is taken; a grid of another
    shape, a float grid, a zero or unmerged side and a zero step count are refused naming grid_thw; non-float
    patches name video and the patch width the model wants."""
    family = family_of(qwen)
    video, grid = qwen_pixels(2, 2, torch.Generator().manual_seed(13))
    both = family.encode_video(qwen, None, video, 2, grid_thw=grid)
    for same in (grid[0], grid[:1]):
        assert torch.equal(family.encode_video(qwen, None, video, 2, grid_thw=same).embeds, both.embeds)
    shape = r"^grid_thw: expected int \[3\] or \[B=2, 3\], got "
    for bad, message in (([[1, 8]], shape + r"\(1, 2\)"), ([[[1, 8, 8]] * 3], shape + r"\(1, 3, 3\)"),
                         ([[1, 8, 8]] * 3, shape + r"\(3, 3\)"), (grid.float(), shape + r"\(2, 3\)")):
        with pytest.raises(ValueError, match=message):
            family.encode_video(qwen, None, video, 2, grid_thw=torch.tensor(bad) if isinstance(bad, list) else bad)
    sides = r"^grid_thw: expected t >= 1 and h, w positive multiples of spatial_merge_size=2, got "
    for bad in ([0, 8, 8], [1, 0, 8], [1, 8, 0], [1, 7, 8], [1, 8, 7], [1, 1, 8]):
        with pytest.raises(ValueError, match=sides + re.escape(str(bad))):
            family.encode_video(qwen, None, video, 2, grid_thw=torch.tensor(bad))
    with pytest.raises(TypeError, match=r"^video: expected floating pixel values \[B \* t \* h \* w, 24\] with "
                                        r"grid_thw \(or raw frames"):
        family.encode_video(qwen, None, video.long(), 2, grid_thw=grid)


def test_qwen_patch_width_follows_the_model_s_patch_size():
    """A tower of patch 3: rows of 3 channels x 2 frames x 3 x 3 pixels (54) are taken, rows of another width are
    refused naming the width."""
    from types import SimpleNamespace
    vision = SimpleNamespace(in_channels=3, temporal_patch_size=2, patch_size=3, spatial_merge_size=2)
    model = SimpleNamespace(config=SimpleNamespace(vision_config=vision))
    family = family_of(tiny_qwen2_5_vl(num_layers=1))
    video, grid = family._check_patches(model, torch.zeros(16, 54), torch.tensor([1, 4, 4]), 1)
    assert grid == (1, 4, 4) and video.shape == (16, 54)
    with pytest.raises(ValueError, match=r"^video: expected flattened patches \[B\*t\*h\*w=16, 54\]"):
        family._check_patches(model, torch.zeros(16, 36), torch.tensor([1, 4, 4]), 1)


def test_qwen3_vl_timestamps_of_other_types(qwen3):
    """Seconds as a tensor are taken; a string or a bool is no time (refused naming timestamps); extra arguments
    are refused naming append_video."""
    from hermes.models.qwen3_vl import Qwen3_VL, timestamp_text
    for bad in ("1", True):
        with pytest.raises(ValueError, match=r"^timestamps: expected seconds in \[0, 100000\), got "):
            timestamp_text(bad)
    family = Qwen3_VL()
    video, grid = qwen_pixels(1, 2, torch.Generator().manual_seed(14))
    tokenizer = tiny_tokenizer(digits=True)
    listed = family.encode_video(qwen3, tokenizer, video, 1, grid_thw=grid, timestamps=[0.5])
    tensor = family.encode_video(qwen3, tokenizer, video, 1, grid_thw=grid, timestamps=torch.tensor([0.5]))
    assert torch.equal(listed.embeds, tensor.embeds)
    with pytest.raises(TypeError, match=r"^append_video: unexpected arguments for Qwen3-VL: \['fps'\]"):
        family.encode_video(qwen3, tokenizer, video, 1, grid_thw=grid, timestamps=[0.5], fps=1)


def test_qwen3_vl_prepared_frames_start_at_zero_seconds_by_default():
    """Two 16 x 16 frames at 2 fps with no start given: one temporal step at (0 + 0.5) / 2 = 0.25 s (its frames
    capped to 12 x 12 pixels, the tiny checkpoint's 12 tokens: a 6 x 6 patch grid)."""
    from hermes.models.qwen3_vl import Qwen3_VL
    prepared = Qwen3_VL().prepare_frames(qwen3_processor(), frames_of(2), 2.0)
    assert prepared["timestamps"] == [0.25] and prepared["grid_thw"].tolist() == [[1, 6, 6]]


def family_processor(name):
    """(family, processor with the tiny checkpoint's twin) of `name`; Qwen3.5 prepares frames as Qwen3-VL does."""
    from hermes.models.qwen2_5_vl import Qwen2_5_VL
    from hermes.models.qwen3_5 import Qwen3_5
    from hermes.models.qwen3_vl import Qwen3_VL
    family, model_type = {"llava_onevision": (LlavaOneVision(), "llava_onevision"),
                          "qwen2_5_vl": (Qwen2_5_VL(), "qwen2_5_vl"), "qwen3_vl": (Qwen3_VL(), "qwen3_vl"),
                          "qwen3_5": (Qwen3_5(), "qwen3_5")}[name]
    twin = family.pil_video_processor(tiny_image_processor(model_type), tiny_video_processor_config(model_type))
    return family, Processor(tokenizer=tiny_tokenizer(digits=True), video_processor=twin)


def same_inputs(got: dict, want: dict) -> bool:
    return got.keys() == want.keys() and all(
        torch.equal(got[key], want[key]) if isinstance(want[key], torch.Tensor) else got[key] == want[key]
        for key in want)


FAMILY_NAMES = ["llava_onevision", "qwen2_5_vl", "qwen3_vl", "qwen3_5"]


@pytest.mark.parametrize("name", FAMILY_NAMES)
@pytest.mark.parametrize("count,fps,start", [(4, 2.0, 0.0), (5, 3.0, 3.7), (3, 0.3, 1234.5), (1, 1.0, 2.0)])
def test_prepare_frames_with_even_times_is_today_s_output(name, count, fps, start):
    """The frames' own times, evenly spaced at 1 / fps from start (as a reader computes them), give exactly the
    output of fps and start alone: timestamps and seconds_per_grid to the bit (odd counts, fps whose period is no
    binary fraction, a late start)."""
    family, processor = family_processor(name)
    frames = frames_of(count, seed=count)
    times = [start + i / fps for i in range(count)]
    want = family.prepare_frames(processor, frames, fps, start=start)
    assert same_inputs(family.prepare_frames(processor, frames, fps, start=start, times=times), want)
    assert same_inputs(family.prepare_frames(processor, frames, fps, start=start, times=np.array(times)), want)


@pytest.mark.parametrize("name", ["qwen3_vl", "qwen3_5"])
def test_qwen3_vl_timestamps_across_a_gap_are_the_true_ones(name):
    """Frames at 0, 1, 7, 8 and 9 s (2 to 6 dropped) at 1 fps: the steps are stamped at their frames' true mean
    time, 0.5, 7.5 and 9 s (the last frame repeated), where even spacing would say 0.5, 2.5 and 4; the pixels and
    grid are the even clip's."""
    family, processor = family_processor(name)
    frames = frames_of(5, seed=20)
    gap = family.prepare_frames(processor, frames, 1.0, start=0.0, times=[0.0, 1.0, 7.0, 8.0, 9.0])
    even = family.prepare_frames(processor, frames, 1.0, start=0.0)
    assert gap["timestamps"] == [0.5, 7.5, 9.0] and even["timestamps"] == [0.5, 2.5, 4.0]
    assert torch.equal(gap["video"], even["video"]) and torch.equal(gap["grid_thw"], even["grid_thw"])


def test_qwen2_5_vl_seconds_per_grid_spans_the_chunk_s_true_time():
    """Frames at 0, 1, 7 and 8 s at 1 fps: M-RoPE spreads the chunk's true 8 s over its steps, T x 8 / 3 seconds
    per grid step (even frames: T / fps = 2); a frame a microsecond off the grid is still even."""
    family, processor = family_processor("qwen2_5_vl")
    frames = frames_of(4, seed=21)
    gap = family.prepare_frames(processor, frames, 1.0, times=[0.0, 1.0, 7.0, 8.0])
    assert gap["seconds_per_grid"] == pytest.approx(2 * 8 / 3)
    assert family.prepare_frames(processor, frames, 1.0, times=[5.0, 6.0, 7.0, 8.0 + 1e-7])["seconds_per_grid"] == 2.0
    stretched = family.prepare_frames(processor, frames, 1.0, times=[0.0, 2.0, 4.0, 6.0])
    assert stretched["seconds_per_grid"] == 4.0


def test_llava_ov_takes_times_and_ignores_them():
    family, processor = family_processor("llava_onevision")
    frames = frames_of(3, seed=22)
    assert same_inputs(family.prepare_frames(processor, frames, 1.0, times=[0.0, 5.0, 6.5]),
                       family.prepare_frames(processor, frames, 1.0))


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_prepare_frames_refuses_bad_times_before_the_processor_runs(name):
    """times of another length, not increasing, not finite or not numbers: one ValueError naming times, raised
    before the video processor is called."""
    family, _ = family_processor(name)
    recorder = Recorder({"pixel_values_videos": torch.zeros(1), "video_grid_thw": torch.tensor([[1, 2, 2]])})
    processor = Processor(tokenizer=tiny_tokenizer(digits=True), video_processor=recorder)
    bad = {"short": ([0.0, 1.0], r"the seconds of each of the 3 frames"),
           "long": ([0.0, 1.0, 2.0, 3.0], r"the seconds of each of the 3 frames"),
           "a string": ("012", r"the seconds of each of the 3 frames"),
           "not numbers": ([0.0, "a", 2.0], r"the seconds of each of the 3 frames"),
           "repeated": ([0.0, 1.0, 1.0], r"increasing"), "backwards": ([2.0, 1.0, 3.0], r"increasing"),
           "nan": ([0.0, float("nan"), 2.0], r"finite"), "inf": ([0.0, 1.0, float("inf")], r"finite")}
    for label, (times, message) in bad.items():
        with pytest.raises(ValueError, match=rf"^times: expected {message}"):
            family.prepare_frames(processor, frames_of(3), 1.0, times=times)
    assert recorder.calls == []

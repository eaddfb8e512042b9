"""The Gemma 4 family on the tiny random Gemma 4 against transformers' own: a chunk's token layout, vision blocks and
timestamps are what `Gemma4Processor` builds for the same frames, its embeddings and per-layer inputs what
`Gemma4Model.forward` hands its language model; the torchvision-free twin is the PIL image processor frame by frame
(transformers' `Gemma4VideoProcessor` needs torchvision, which this machine lacks); refusals name their argument
before the vision tower runs; the tiny checkpoint saves and loads; the presets; the chat text."""
import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForImageTextToText, Gemma4ImageProcessorPil, Gemma4Processor
from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
from transformers.models.gemma4.modeling_gemma4 import get_block_sequence_ids_for_mask
from transformers.video_utils import VideoMetadata

from hermes.models import family_of, family_of_type
from hermes.models.gemma4 import TIMESTAMP_LIMIT, Gemma4, chunk_layout, frame_text
from hermes.models.processing import Processor, load_processor
from hermes_kernels import H2SVCConfig, HermesConfig
from scaffolding.checkpoint import save_tiny_checkpoint
from scaffolding.models import tiny_gemma4
from scaffolding.processors import TINY_GEMMA4_PATCHES, tiny_image_processor, tiny_video_processor_config
from scaffolding.tokenizer import tiny_tokenizer

pytestmark = pytest.mark.usefixtures("single_thread")
SHAPE = r"\[B·F, max_patches, 12\] \(max_patches a multiple of pooling_kernel_size²=4\)"
GRID = (r"video_position_ids: expected a grid of columns x rows patches, both multiples of pooling_kernel_size=2, at "
        r"positions in \[0, 64\),")


@pytest.fixture(scope="module")
def model():
    return tiny_gemma4()


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer(digits=True, gemma=True)


@pytest.fixture(scope="module")
def processor(tok):
    twin = Gemma4().pil_video_processor(tiny_image_processor("gemma4"), tiny_video_processor_config("gemma4"))
    return Processor(tokenizer=tok, video_processor=twin)


def clips_of(count: int, frames: int, height: int = 48, width: int = 64, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (frames, height, width, 3), dtype=np.uint8) for _ in range(count)]


class TwinWithMetadata:
    """The twin as Gemma4Processor calls its video processor: the clips' tensors, plus each clip's metadata (its
    frames `indices` of a video at `fps`), from which the processor writes the timestamps."""

    def __init__(self, twin, fps: float, indices: list):
        self.twin, self.fps, self.indices = twin, fps, indices

    def __call__(self, videos, **kwargs):
        out = dict(self.twin(videos=list(videos)))
        out["video_metadata"] = [VideoMetadata(total_num_frames=len(clip), fps=self.fps, frames_indices=self.indices)
                                 for clip in videos]
        return out


def transformers_processor(monkeypatch, tok, twin, fps: float, indices: list) -> Gemma4Processor:
    """transformers' Gemma4Processor over the tiny tokenizer and image processor, with the twin (plus metadata) as
    its video processor. Its class check looks video processors up in a mapping that is a placeholder without
    torchvision, so it is switched off here."""
    monkeypatch.setattr(Gemma4Processor, "check_argument_for_proper_class", lambda self, name, arg: type(arg))
    return Gemma4Processor(Gemma4AudioFeatureExtractor(), tiny_image_processor("gemma4"), tok,
                           TwinWithMetadata(twin, fps, indices))


def layout_text(hf: Gemma4Processor, clip: np.ndarray) -> str:
    """The text Gemma4Processor writes for one clip (its replace_video_token), with its video processor's timing."""
    video = hf.video_processor(videos=[clip])
    return hf.replace_video_token(video, 0)


def chunk_text(seconds: list, soft_tokens: int) -> str:
    """The text of the family's layout for frames at `seconds` (`frame_text`, then the frame's vision markers)."""
    return "".join(f"{frame_text(t)}<|image>{'<|video|>' * soft_tokens}<image|>" for t in seconds)


def language_model_inputs(model, inputs: dict) -> dict:
    """The keyword arguments Gemma4Model.forward hands its language model for `inputs` (recorded by a hook)."""
    seen = {}

    def record(module, args, kwargs):
        seen.update(kwargs)

    hook = model.model.language_model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        with torch.no_grad():
            model.model(**inputs)
    finally:
        hook.remove()
    return seen


def test_a_chunk_is_the_processors_layout_and_the_models_inputs(monkeypatch, model, tok, processor):
    """Two streams of three 48 x 64 frames at 2 fps from 59 s (00:59, 00:59, 01:00): the chunk's token ids and vision
    blocks are Gemma4Processor's for the same frames (its replace_video_token, its mm_token_type_ids through
    get_block_sequence_ids_for_mask), its text that layout with the separator in front of the first frame too; its
    embeddings and per-layer inputs are exactly what Gemma4Model.forward gives its language model (the same ops on
    the same values: no tolerance), and per-layer inputs of the soft tokens' own ids would not be."""
    family, clips = Gemma4(), clips_of(2, 3)
    inputs = family.prepare_frames(processor, clips[0], fps=2.0, start=59.0)
    assert inputs["timestamps"] == [59.0, 59.5, 60.0]
    hf = transformers_processor(monkeypatch, tok, processor.video_processor, 2.0, [118, 119, 120])
    want = hf(text=["<|video|>"] * 2, videos=clips, return_tensors="pt")
    assert chunk_text(inputs["timestamps"], 63) == " " + layout_text(hf, clips[0])
    video = processor.video_processor(videos=clips)
    chunk = family.encode_video(model, processor, video["pixel_values_videos"], 2,
                                video_position_ids=video["video_position_ids"], timestamps=inputs["timestamps"])
    stamps = [tok(frame_text(t), add_special_tokens=False)["input_ids"] for t in inputs["timestamps"]]
    # 48 x 64 -> 28 x 36 pixels: 14 x 18 patches, 63 soft tokens a frame
    tokens, blocks = chunk_layout(stamps, 63, boi=model.config.boi_token_id, eoi=model.config.eoi_token_id,
                                  video_token=model.config.video_token_id)
    assert torch.equal(want["input_ids"], tokens.expand(2, -1))
    assert torch.equal(chunk.blocks, blocks) and torch.equal(
        get_block_sequence_ids_for_mask(want["mm_token_type_ids"], "cpu"), blocks.expand(2, -1))
    assert (chunk.frames, chunk.extent, chunk.rel_positions) == (3, tokens.numel() - 1, None)
    seen = language_model_inputs(model, dict(want))
    per_layer = chunk.lm_kwargs()["per_layer_inputs"]
    assert torch.equal(chunk.embeds, seen["inputs_embeds"]) and torch.equal(per_layer, seen["per_layer_inputs"])
    own_ids = model.model.language_model.get_per_layer_inputs(tokens[None])
    assert not torch.equal(own_ids, per_layer[:1])


def test_per_layer_inputs_only_for_the_chunks_own_forward(model, tok, processor, monkeypatch):
    """`extra` holds the chunk's per-layer inputs for a forward of its T tokens and refuses any other count; a model
    without per-layer inputs gets no `extra`."""
    family = Gemma4()
    inputs = family.prepare_frames(processor, clips_of(1, 1)[0], fps=1.0)
    chunk = family.encode_video(model, processor, batch_size=1, **inputs)
    count = chunk.embeds.shape[1]
    assert chunk.lm_kwargs(count)["per_layer_inputs"].shape == (1, count, 7, 8)
    for other in (count - 1, count + 5):
        with pytest.raises(ValueError, match=rf"^count: Gemma 4 chunks carry the per-layer inputs of their own "
                                             rf"{count} tokens only, got a forward of {other}$"):
            chunk.lm_kwargs(other)
    monkeypatch.setattr(model.model.language_model, "hidden_size_per_layer_input", 0)
    bare = family.encode_video(model, processor, batch_size=1, **inputs)
    assert bare.extra is None and bare.lm_kwargs() == {} and torch.equal(bare.embeds, chunk.embeds)


def test_raw_frames_go_through_the_processor(model, processor):
    """Raw clips (one per stream) encode as the pixels prepare_frames makes of them."""
    family, clips = Gemma4(), clips_of(2, 2, 30, 200)
    prepared = [family.prepare_frames(processor, clip, fps=1.0) for clip in clips]
    pixels = family.encode_video(model, processor, torch.cat([p["video"] for p in prepared]), 2,
                                 video_position_ids=torch.cat([p["video_position_ids"] for p in prepared]),
                                 timestamps=[0.0, 1.0])
    raw = family.encode_video(model, processor, clips, 2, timestamps=[0.0, 1.0])
    assert torch.equal(raw.embeds, pixels.embeds) and torch.equal(raw.blocks, pixels.blocks)


@pytest.mark.parametrize("height, width", [(48, 64), (28, 36), (90, 40), (30, 200), (4, 300), (7, 9)])
def test_the_twin_is_the_image_processor_frame_by_frame(processor, height, width):
    """Gemma4VideoProcessor cannot run here (torchvision); its PIL twin gives, frame by frame, the pixel rows, patch
    positions and soft-token count of transformers' Gemma4ImageProcessorPil at the video settings: frames resized
    down, up, to a side of one kernel (4 x 300), or left alone (28 x 36); two clips concatenate along the frames."""
    patch, soft, kernel = TINY_GEMMA4_PATCHES
    image = Gemma4ImageProcessorPil(patch_size=patch, max_soft_tokens=soft, pooling_kernel_size=kernel)
    clips = clips_of(2, 2, height, width, seed=height)
    clips[1] = clips[1][:1]
    got = processor.video_processor(videos=clips, return_tensors="pt")
    frames = [frame for clip in clips for frame in clip]
    want = [image(frame, return_tensors="pt", input_data_format="channels_last") for frame in frames]
    assert got["num_frames_per_video"].tolist() == [2, 1]
    assert got["num_soft_tokens_per_video"].tolist() == [int(want[0]["num_soft_tokens_per_image"][0])] * 2
    assert got["pixel_values_videos"].dtype == torch.float32 and got["video_position_ids"].dtype == torch.int64
    assert torch.equal(got["pixel_values_videos"], torch.cat([w["pixel_values"] for w in want]))
    assert torch.equal(got["video_position_ids"], torch.cat([w["image_position_ids"] for w in want]))


@pytest.mark.parametrize("height, width", [(48, 64), (90, 40), (30, 200)])
def test_tokens_per_frame_frame_size_and_kept_size(monkeypatch, model, tok, processor, height, width):
    """tokens_per_frame at `frame_size` of the prepared frames is the length of one frame's run in the processor's
    layout and of the chunk; `kept_size` is the size of the frames the processor makes."""
    family, clip = Gemma4(), clips_of(1, 2, height, width)[0]
    inputs = family.prepare_frames(processor, clip, fps=1.0)
    size = family.frame_size(model, inputs)
    rows = (inputs["video_position_ids"][0] != -1).all(dim=-1).sum()
    assert size == family.kept_size(processor, height, width) and size[0] * size[1] == rows * 4
    per_frame = family.tokens_per_frame(model, size, tokenizer=tok)
    hf = transformers_processor(monkeypatch, tok, processor.video_processor, 1.0, [0, 1])
    ids = hf(text=["<|video|>"], videos=[clip], return_tensors="pt")["input_ids"]
    chunk = family.encode_video(model, processor, batch_size=1, **inputs)
    assert ids.shape[1] == chunk.embeds.shape[1] == 2 * per_frame == family.tokens_per_chunk(model, 2, size, tok)
    assert family.memory_frames(inputs) == 2
    with pytest.raises(ValueError, match="^frame_size: Gemma 4's token count depends on the frame size"):
        family.tokens_per_frame(model, None, tokenizer=tok)


def test_timestamps_from_the_frames_own_times(monkeypatch, model, tok, processor):
    """`times` (a live source after drops) time the frames instead of fps and start: the chunk is the processor's for
    frames at 0 s, 61 s and 125.9 s (mm:ss truncates: 02:05); the times are checked."""
    family, clip = Gemma4(), clips_of(1, 3)[0]
    inputs = family.prepare_frames(processor, clip, fps=2.0, start=50.0, times=[0.0, 61.0, 125.9])
    assert inputs["timestamps"] == [0.0, 61.0, 125.9]
    hf = transformers_processor(monkeypatch, tok, processor.video_processor, 10.0, [0, 610, 1259])
    want = hf(text=["<|video|>"], videos=[clip], return_tensors="pt")
    text = layout_text(hf, clip)
    assert text.startswith("00:00 <|image>") and " 01:01 <|image>" in text and " 02:05 <|image>" in text
    assert chunk_text(inputs["timestamps"], 63) == " " + text
    seen = language_model_inputs(model, dict(want))
    chunk = family.encode_video(model, processor, batch_size=1, **inputs)
    assert torch.equal(chunk.embeds, seen["inputs_embeds"])
    assert torch.equal(chunk.lm_kwargs()["per_layer_inputs"], seen["per_layer_inputs"])
    for times in ([0.0, 1.0], [0.0, 2.0, 1.0]):
        with pytest.raises(ValueError, match="^times: "):
            family.prepare_frames(processor, clip, fps=2.0, times=times)
    with pytest.raises(ValueError, match="^fps: expected a positive number"):
        family.prepare_frames(processor, clip, fps=0)


def test_frame_text_is_the_processors_mm_ss():
    """The separator, then Gemma4Processor's mm:ss (truncated minutes and seconds) and a space; one token count
    from 0 s to just under 100 minutes, the limit; outside it refused, naming timestamps."""
    assert [frame_text(t) for t in (0, 59.99, 60.0, 61.5, 3599.9, TIMESTAMP_LIMIT - 0.01)] == \
        [" 00:00 ", " 00:59 ", " 01:00 ", " 01:01 ", " 59:59 ", " 99:59 "]
    tok = tiny_tokenizer(digits=True, gemma=True)
    assert {len(tok(frame_text(t))["input_ids"]) for t in (0.0, 600.0, TIMESTAMP_LIMIT - 0.01)} == {5}
    for bad in (-0.01, TIMESTAMP_LIMIT, float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match=r"^timestamps: expected seconds in \[0, 6000\)"):
            frame_text(bad)


class LongMinutes:
    """A tokenizer that writes minutes past 0 with one more token: runs of another length."""

    def __init__(self, tok):
        self.tok = tok

    def __call__(self, text, **kwargs):
        out = self.tok(text, **kwargs)
        return {"input_ids": out["input_ids"] + ([0] if " 00:" not in text else [])}


def test_refusals_name_the_argument_before_the_tower(monkeypatch, model, tok, processor):
    """Every wrong input is refused, naming its argument, before the vision tower runs (it raises if reached)."""
    family = Gemma4()
    inputs = family.prepare_frames(processor, clips_of(1, 3)[0], fps=1.0)
    video, positions, stamps = inputs["video"], inputs["video_position_ids"], inputs["timestamps"]

    def tower(*args, **kwargs):
        raise AssertionError("the vision tower ran")

    monkeypatch.setattr(model.model, "get_video_features", tower)
    shifted = positions.clone()
    shifted[1, 0] = shifted[1, 1]
    holed, negative = positions.clone(), positions.clone()
    holed[:, 5] = -1
    negative[:, 0, 0] = -2  # not padding (only -1 is): a patch left of the grid
    wide = torch.stack([torch.arange(66).repeat(2), torch.arange(2).repeat_interleave(66)], dim=-1)
    wide = torch.cat([wide, torch.full((280 - 132, 2), -1)]).expand(3, -1, -1)  # a whole grid past the table's 64
    keep = positions[0, :, 0] < 17  # the last column of patches dropped: 17 columns, not a multiple of 2
    narrow = torch.cat([positions[:, keep], torch.full((3, int((~keep).sum()), 2), -1)], dim=1)
    bad = [
        (dict(grid_thw=None), TypeError, r"^append_video: unexpected arguments for Gemma 4: \['grid_thw'\]$"),
        (dict(video=video.long()), TypeError, rf"^video: expected floating pixel values {SHAPE} with video_pos"),
        (dict(video=video[:, :, :8]), ValueError, rf"^video: expected patches {SHAPE.replace('B·F', 'B·F, B=1')}"),
        (dict(video=video[:, :278]), ValueError, r"^video: expected patches .* got \(3, 278, 12\)$"),
        (dict(video=video[0]), ValueError, r"^video: expected patches .* got \(280, 12\)$"),
        (dict(batch_size=2), ValueError, r"^video: expected patches \[B·F, B=2, .* got \(3, 280, 12\)$"),
        (dict(video_position_ids=None), ValueError, r"^video_position_ids: Gemma 4 patches need their"),
        (dict(video_position_ids=positions.float()), ValueError, r"^video_position_ids: expected integer positions"),
        (dict(video_position_ids=positions[:2]), ValueError, r"^video_position_ids: expected integer positions "
                                                             r"\[3, 280, 2\]"),
        (dict(video_position_ids=shifted), ValueError, r"^video_position_ids: the frames of streams in lockstep"),
        (dict(video_position_ids=wide), ValueError, rf"^{GRID} got 132 patches up to 66 x 2$"),
        (dict(video_position_ids=holed), ValueError, rf"^{GRID} got 251 patches up to 18 x 14$"),
        (dict(video_position_ids=negative), ValueError, rf"^{GRID} got 252 patches up to 18 x 14$"),
        (dict(video_position_ids=narrow), ValueError, rf"^{GRID} got 238 patches up to 17 x 14$"),
        (dict(timestamps=None), ValueError, r"^timestamps: expected the seconds of each of the 3 frames"),
        (dict(timestamps=stamps[:2]), ValueError, r"^timestamps: expected the seconds of each of the 3 frames"),
        (dict(timestamps=[1.0, -2.0, 3.0]), ValueError, r"^timestamps: expected seconds in \[0, 6000\)"),
        (dict(timestamps=[5990.0, 5999.0, 6000.0]), ValueError, r"^timestamps: expected seconds in \[0, 6000\)"),
        (dict(processor=LongMinutes(tok), timestamps=[58.0, 59.0, 60.0]), ValueError,
         r"^timestamps: the tokenizer gives \[5, 5, 6\] tokens for these timestamps and 5 for 00:00"),
        (dict(processor=None), TypeError, r"^processor: Gemma 4 chunks carry text timestamps"),
        (dict(video=clips_of(1, 4)[0], batch_size=2), ValueError,
         r"^video: expected one clip of frames per stream \(B=2\), got 1$"),
    ]
    for change, error, message in bad:
        args = dict(model=model, processor=processor, batch_size=1, **inputs) | change
        with pytest.raises(error, match=message):
            family.encode_video(**args)


def test_rotary_is_the_full_attention_layers(model):
    """The full-attention layers' frequencies (the compressed layers'), 1D: the module's own tensor, the pairs past
    a quarter of them at frequency 0 (proportional RoPE)."""
    inv_freq, layout = family_of(model).rotary(model)
    rotary = model.model.language_model.rotary_emb
    assert layout is None and inv_freq is rotary.full_attention_inv_freq and inv_freq.shape == (16,)
    assert bool((inv_freq[:4] > 0).all()) and not bool(inv_freq[4:].any())


@pytest.mark.parametrize("layers", [1, 2, 3, 5, 10])
def test_presets_take_any_count_of_full_attention_layers(layers):
    """HERMES: Qwen2.5-VL's constants at Gemma 4's 131072 positions, roles by fraction of the full-attention layers
    (one deep layer at least, a shallow one from 10 layers); H2SVC: Qwen3.5's routing over them, 75 tokens a frame."""
    hermes = HermesConfig.preset("gemma4", layers, 64, 14)
    assert hermes == HermesConfig.qwen2_5_vl(layers, 64, 14, max_positions=131072)
    roles = hermes.roles()
    assert roles[-1] == "deep" and ("shallow" in roles) == (layers >= 10)
    expected = {1: ["deep"], 2: ["mid", "deep"], 5: ["mid"] * 3 + ["deep"] * 2}
    assert roles == expected.get(layers, roles)
    h2svc = H2SVCConfig.preset("gemma4", layers, 2, 14)
    assert h2svc == H2SVCConfig.qwen3_5(layers, 2, 14, tokens_per_frame=75, max_positions=131072)
    assert h2svc.head_classes.shape == (layers, 2)


def test_chat_text_is_gemma_4s_template(tok):
    """bos, the system turn, the user turn open before the video; the question, the turn's end and the model turn
    after it; the system prompt and the question trimmed, as the template trims them; every piece a known token of
    the tiny tokenizer."""
    family = Gemma4()
    assert family.prefix_text("S") == "<bos><|turn>system\nS<turn|>\n<|turn>user\n"
    assert family.question_text("Q") == "Q<turn|>\n<|turn>model\n"
    assert family.prefix_text(None) == "<bos><|turn>system\nYou are a helpful assistant.<turn|>\n<|turn>user\n"
    assert (family.prefix_text(" S\n"), family.question_text(" Q\n")) == (family.prefix_text("S"),
                                                                          family.question_text("Q"))
    for text in (family.prefix_text(None), family.question_text("what is the person holding")):
        assert tok.unk_token_id not in tok(text, add_special_tokens=False)["input_ids"]


def test_the_tiny_checkpoint_saves_and_loads(tmp_path, model, tok, processor):
    """save_tiny_checkpoint("gemma4"): the same weights, a tokenizer with Gemma 4's named markers, the twin's settings
    (load_processor without torchvision), and processor_config.json naming Gemma4Processor."""
    folder = save_tiny_checkpoint(tmp_path / "gemma4", "gemma4")
    loaded = AutoModelForImageTextToText.from_pretrained(folder)
    assert type(family_of(loaded)) is Gemma4 and type(family_of_type("gemma4")) is Gemma4
    want = model.state_dict()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, want[name]), name
    saved = load_processor(folder, Gemma4())
    assert (saved.tokenizer.boi_token, saved.tokenizer.eoi_token, saved.tokenizer.image_token_id) == \
        ("<|image>", "<image|>", tok.convert_tokens_to_ids("<|image|>"))
    assert saved.tokenizer.get_vocab() == tok.get_vocab()
    clip = clips_of(1, 2, 30, 200)[0]
    got, want = (Gemma4().prepare_frames(p, clip, fps=1.0) for p in (saved, processor))
    assert all(torch.equal(got[key], want[key]) for key in ("video", "video_position_ids"))
    assert json.loads((tmp_path / "gemma4" / "processor_config.json").read_text()) == \
        {"processor_class": "Gemma4Processor"}

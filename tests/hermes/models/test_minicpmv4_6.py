"""MiniCPM-V 4.6 (docs/families.md#minicpm-v-4-6) against transformers' own code: a whole short video laid out by
MiniCPMV4_6Processor and run by MiniCPMV4_6ForConditionalGeneration is what a stream of the same frames holds, under
both policies with nothing evicted (the chunks' embeddings at their span of the processor's sequence, the positions
the model's rotary module is handed, every full-attention layer's keys and values, every linear-attention layer's
states, the next-token logits); the twin packs frames as the video processor does; the rotary layout is the module's;
bad chunks are refused before the vision tower; the `hermes` command runs on a saved tiny checkpoint. The behaviours
every policy shares run under this family from tests/hermes/stream/ (`FAMILIES`)."""
import numpy as np
import pytest
import torch
from transformers import DynamicCache
from transformers.models.minicpmv4_6.processing_minicpmv4_6 import MiniCPMV4_6Processor
from transformers.models.minicpmv4_6.video_processing_minicpmv4_6 import MiniCPMV4_6VideoProcessor
from transformers.processing_utils import ProcessorMixin

from hermes import cli
from hermes.models import family_of
from hermes.models.minicpmv4_6 import MiniCPMV4_6, MiniCPMV4_6PilVideoProcessor
from hermes.models.processing import Processor
from hermes.stream import HermesStream
from hermes_kernels.rope import RotaryLayout
from scaffolding.checkpoint import save_tiny_checkpoint
from scaffolding.models import tiny_minicpmv4_6
from scaffolding.processors import TINY_MINICPM_RESOLUTION, tiny_image_processor, tiny_video_processor_config
from scaffolding.tokenizer import tiny_minicpm_tokenizer
from tests.hermes.models.qwen3_vl_reference import own_forward
from tests.hermes.models.test_qwen3_5_stream import assert_hybrid_cache, error_bound
from tests.hermes.policies.h2svc.checks import MIXED_MAP
from tests.hermes.streams import MINICPM, MINICPM_FRAME, QUESTION
from tests.hermes.video_files import write_video

pytestmark = pytest.mark.usefixtures("single_thread")

# the chat template's text around a video (ChatML; the template writes one <|video_pad|> where the video goes, which
# the processor replaces by <image_id>0</image_id> and every frame's <image> ... </image>)
PREFIX = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
TAIL = f"{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
CHUNKS, FRAMES = 3, 2


@pytest.fixture
def transformers_processor(monkeypatch):
    """MiniCPMV4_6Processor over the tiny tokenizer and transformers' own video processor. Frames come at the size
    the processor would resize them to (24 x 32 at the tiny scale_resolution), so it runs with do_resize and
    do_normalize off: both are torchvision calls. Without torchvision transformers cannot look the video
    processor's class up to check it; that check alone is skipped, the processor's code runs as it is."""
    monkeypatch.setattr(ProcessorMixin, "check_argument_for_proper_class", lambda self, name, argument: None)
    video = MiniCPMV4_6VideoProcessor(scale_resolution=TINY_MINICPM_RESOLUTION, patch_size=2, do_resize=False,
                                      do_normalize=False, slice_mode=False)
    return MiniCPMV4_6Processor(image_processor=tiny_image_processor("minicpmv4_6"), video_processor=video,
                                tokenizer=tiny_minicpm_tokenizer())


def clips(g: np.random.Generator, batch: int) -> list[np.ndarray]:
    """One uint8 [CHUNKS * FRAMES, 24, 32, 3] video per stream."""
    return [g.integers(0, 256, (CHUNKS * FRAMES, *MINICPM_FRAME, 3), dtype=np.uint8) for _ in range(batch)]


def video_inputs(processor, videos: list[np.ndarray], text: str) -> dict:
    """The processor's model inputs for one `text` (holding one <|video_pad|>) per stream and its video."""
    out = processor(text=[text] * len(videos), videos=videos, do_sample_frames=False, return_tensors="pt")
    return {key: out[key] for key in ("input_ids", "pixel_values_videos", "target_sizes_videos")}


def input_embeds(model, inputs: dict) -> torch.Tensor:
    """[B, S, hidden]: the model's input embeddings, as MiniCPMV4_6Model.forward builds them (token embeddings, the
    video features scattered over the pads in order)."""
    with torch.no_grad():
        features = model.model.get_video_features(inputs["pixel_values_videos"], inputs["target_sizes_videos"])
        return model.get_input_embeddings()(inputs["input_ids"]).masked_scatter(
            (inputs["input_ids"] == model.config.video_token_id)[..., None], torch.cat(features.pooler_output))


def positions_seen(model) -> tuple[list, object]:
    """Every position_ids the text model's rotary module is handed ([3, B, T] per forward), and the hook."""
    seen = []
    hook = model.model.language_model.rotary_emb.register_forward_pre_hook(lambda module, args: seen.append(args[1]))
    return seen, hook


def spans(whole: dict, cuts: list[int], frames: int) -> list[dict]:
    """The processor's whole sequence cut at `cuts` (the prefix, then one span per chunk of `frames` frames per
    stream): each span's input_ids with the pixels and target sizes of its frames, stream-major as the processor
    packs them (the order of the span's pads)."""
    ids, pixels, sizes = whole["input_ids"], whole["pixel_values_videos"], whole["target_sizes_videos"]
    batch, per_stream = ids.shape[0], sizes.shape[0] // ids.shape[0]
    width = pixels.shape[-1] // sizes.shape[0]  # columns of one frame: h · w · patch
    out = [{"input_ids": ids[:, :cuts[0]]}]
    for index, (start, end) in enumerate(zip(cuts, cuts[1:])):
        rows = [b * per_stream + index * frames + f for b in range(batch) for f in range(frames)]
        out.append({"input_ids": ids[:, start:end], "target_sizes_videos": sizes[rows],
                    "pixel_values_videos": torch.cat([pixels[..., r * width:(r + 1) * width] for r in rows], -1)})
    return out


@pytest.mark.parametrize("policy", ["hermes", "h2svc"])
def test_a_budget_above_the_video_is_the_models_own_forward_and_cache(policy, transformers_processor):
    """Two streams, three chunks of two raw 24 x 32 frames through transformers' video processor, nothing evicted
    (HERMES: budget above the video; H2SVC: windows of every frame), against MiniCPMV4_6Processor's sequence of the
    whole video (prefix, <image_id>0</image_id>, six frames) run by the model itself into a `DynamicCache`, then the
    question on top: each chunk's embeddings are the model's input embeddings at its span (token embeddings, the
    frames' features over the pads); the positions are those the model hands its rotary module (the token index on
    every axis); every full-attention layer's keys and values (H2SVC: per class, its heads), every linear layer's conv
    and recurrent state and the next-token logits are the model's. The float64 model runs the whole video in one
    forward; the stream is off it by at most twice what the fp32 model's own forwards are, cut where the stream cuts
    (the chunked linear attention sums in the order its forwards cut it: one fp32 forward of the whole video is off
    the float64 model by several times less in the recurrent states than the same forwards cut at the chunks)."""
    processor = transformers_processor
    tok = processor.tokenizer
    model, exact = tiny_minicpmv4_6(), tiny_minicpmv4_6(dtype=torch.float64)
    videos = clips(np.random.default_rng(1), batch=2)
    whole = video_inputs(processor, videos, PREFIX + "<|video_pad|>")
    length = whole["input_ids"].shape[1]
    exact_whole = dict(whole, pixel_values_videos=whole["pixel_values_videos"].double())
    exact_cache = DynamicCache(config=exact.config)
    own_forward(exact, exact_whole, cache=exact_cache, use_cache=True)
    exact_embeds = input_embeds(exact, exact_whole)

    args = dict(budget=200) if policy == "hermes" else dict(
        policy="h2svc", head_map=MIXED_MAP[1:], instant_frames=8, short_frames=8, episodic_frames=8)
    stream = HermesStream(model, Processor(tokenizer=tok, video_processor=processor.video_processor), batch_size=2,
                          chunk_frames=FRAMES, frame_size=MINICPM_FRAME, room=64, **args)
    family, cuts = family_of(model), [stream.cache.length]
    assert whole["input_ids"][:, :cuts[0]].tolist() == [list(stream.prefix_ids)] * 2
    for index in range(CHUNKS):
        chunk = [video[index * FRAMES:(index + 1) * FRAMES] for video in videos]
        encoded = family.encode_video(model, stream.processor, chunk, 2)
        assert encoded.rel_positions is None and encoded.extent == encoded.embeds.shape[1] - 1
        cuts.append(cuts[-1] + encoded.embeds.shape[1])
        stream.append_video(chunk)
        own = input_embeds(model, spans(whole, cuts, FRAMES)[-1])
        error_bound(encoded.embeds, own, exact_embeds[:, cuts[-2]:cuts[-1]], f"chunk {index} embeddings")
    assert cuts[-1] == length
    own_cache = DynamicCache(config=model.config)
    seen, hook = positions_seen(model)
    try:
        for span in spans(whole, cuts, FRAMES):
            own_forward(model, span, cache=own_cache, use_cache=True)
    finally:
        hook.remove()
    positions = torch.cat(seen, dim=-1)
    assert torch.equal(positions, torch.arange(length).expand(3, 2, -1))
    positions = positions[0]
    cache = stream.cache
    assert cache.length == length and stream.stats()["reindexes"] == 0
    assert_hybrid_cache(stream, own_cache, exact_cache, positions)  # the decoder is tiny_qwen3_5's
    question = {"input_ids": tok([TAIL] * 2, add_special_tokens=False, return_tensors="pt")["input_ids"]}
    own_logits = own_forward(model, question, cache=own_cache, logits_to_keep=1).logits[:, -1]
    exact_logits = own_forward(exact, question, cache=exact_cache, logits_to_keep=1).logits[:, -1]
    error_bound(stream.next_token_logits(QUESTION), own_logits, exact_logits, f"{policy} last-token logits")


def test_the_twin_packs_frames_as_the_video_processor(transformers_processor):
    """The torchvision-free twin and transformers' video processor on the same clip (at the size both keep, rescaled,
    unnormalised: the video processor normalises through torchvision) give the same target_sizes_videos and the same
    pixel_values_videos [1, C, p, F·h·w·p] up to the rescale's rounding (v / 255 rounded to float32 by numpy and by
    torch: each within half an ulp of the exact quotient, so at most one ulp, eps · |v|, apart); the twin resizes any
    frame to the video processor's own `find_best_resize` (no slices, upscaled to about scale_resolution² at the
    frame's aspect ratio)."""
    real = transformers_processor.video_processor
    config = dict(tiny_video_processor_config("minicpmv4_6"), do_resize=False, do_normalize=False)
    twin = MiniCPMV4_6PilVideoProcessor(tiny_image_processor("minicpmv4_6"), config)
    clip = clips(np.random.default_rng(2), batch=1)[0][:3]
    ours = twin([clip], do_sample_frames=False, slice_mode=False)
    theirs = real(videos=[clip], return_tensors="pt", do_sample_frames=False, slice_mode=False)
    assert ours.keys() == {"pixel_values_videos", "target_sizes_videos"}
    assert all(ours[key].dtype == theirs[key].dtype for key in ours)
    assert torch.equal(ours["target_sizes_videos"], theirs["target_sizes_videos"])
    torch.testing.assert_close(ours["pixel_values_videos"], theirs["pixel_values_videos"], atol=0,
                               rtol=torch.finfo(torch.float32).eps)
    twin = MiniCPMV4_6PilVideoProcessor(tiny_image_processor("minicpmv4_6"), tiny_video_processor_config("minicpmv4_6"))
    for height, width in ((12, 20), (48, 64), (60, 17), (7, 7)):
        frame = np.zeros((1, height, width, 3), dtype=np.uint8)
        expected = real.find_best_resize((height, width), TINY_MINICPM_RESOLUTION, 2, allow_upscale=True)
        assert tuple(twin([frame])["target_sizes_videos"][0].tolist()) == tuple(x // 2 for x in expected)


def test_rotary_is_the_modules_with_one_position_on_every_axis():
    """inv_freq is the rotary module's [R/2] (8 pairs: 16 of 64 channels turn); the layout is 1D over those pairs:
    the module handed the same position on its three axes (what the model does) turns pair i by position · inv_freq[i],
    whatever its mrope_section."""
    model = tiny_minicpmv4_6(num_layers=1)
    rotary = model.model.language_model.rotary_emb
    inv_freq, layout = MiniCPMV4_6().rotary(model)
    assert inv_freq is rotary.inv_freq and layout == RotaryLayout.one_d(8)
    positions = torch.tensor([0, 5, 1234])
    cos, sin = rotary(torch.zeros(1), positions.expand(3, 1, -1))
    angles = positions[:, None].float() * inv_freq  # the module's own float32 product
    assert torch.equal(cos[0], angles.cos().repeat(1, 2)) and torch.equal(sin[0], angles.sin().repeat(1, 2))


def test_bad_chunks_are_refused_before_the_vision_tower():
    """Every bad chunk of the shared checks, a lockstep pair of clips of two frame sizes and a processor that cannot
    tokenize the markers raise naming the argument while the vision tower never runs; tokens_per_frame needs
    frame_size."""
    model, tok, family = MINICPM.build(num_layers=1), MINICPM.tokenizer(), MiniCPMV4_6()
    runs = []
    hook = model.model.vision_tower.register_forward_pre_hook(lambda *args: runs.append(1))
    twin = family.pil_video_processor(tiny_image_processor("minicpmv4_6"), tiny_video_processor_config("minicpmv4_6"))
    processor = Processor(tokenizer=tok, video_processor=twin)
    g = torch.Generator().manual_seed(3)
    try:
        for name, kwargs in MINICPM.bad_chunks(2, g).items():
            with pytest.raises((ValueError, TypeError), match="^(video|target_sizes|append_video): "):
                family.encode_video(model, tok, batch_size=2, **kwargs)
        wide, tall = (np.zeros((2, h, w, 3), dtype=np.uint8) for h, w in ((24, 32), (32, 24)))
        with pytest.raises(ValueError, match="^video: streams in lockstep"):
            family.encode_video(model, processor, [wide, tall], 2)
        with pytest.raises(TypeError, match="^processor: "):
            family.encode_video(model, None, **MINICPM.chunk(1, g), batch_size=1)
        assert runs == []
    finally:
        hook.remove()
    with pytest.raises(ValueError, match="^frame_size: "):
        family.tokens_per_frame(model, None, tokenizer=tok)
    assert family.tokens_per_frame(model, MINICPM_FRAME, tokenizer=tok) == 3 * 4 + 2


def test_the_command_streams_a_saved_checkpoint(tmp_path):
    """A saved tiny checkpoint through the `hermes` command's path (`cli.run` on the folder: its loading, the
    torchvision-free processor, prepare_frames and frame_size): chunks of 4, 4 and 2 frames of 14 tokens each (48 x 64
    video frames kept at 24 x 32), each compressing, and an answer."""
    folder = save_tiny_checkpoint(tmp_path / "tiny", "minicpmv4_6")
    video = write_video(tmp_path / "cfr.mp4", [i / 4 for i in range(40)])  # 10 s at 4 fps
    records = cli.run(folder, video, questions=[QUESTION], fps=1, chunk_frames=4, budget=20, device="cpu",
                      max_new_tokens=2)
    chunks = [r for r in records if r["type"] == "chunk"]
    assert [r["frames"] for r in chunks] == [4, 4, 2] and all(r["compressed"] for r in chunks)
    prefix = len(tiny_minicpm_tokenizer()(MiniCPMV4_6().prefix_text(None), add_special_tokens=False)["input_ids"])
    assert chunks[0]["positions"] == [0, prefix + 4 * 14 - 1]
    assert [r["type"] for r in records][-1] == "answer"

"""The Qwen3.5 family on tiny random Qwen3.5 and Qwen3.5-MoE models (hybrid decoders: linear, full, full, linear,
full, linear; partial interleaved M-RoPE; Qwen3-VL's tower without DeepStack) against the models' own code: the
positions of a whole stream equal get_rope_index, a chunk's embeddings are the model's own input embeddings at the
chunk's place, the rotary layout is the rotary module's, the counts the family announces are the chunk's. The
stream checks wait for the hybrid cache (tests/hermes/streams.py, `QWEN3_5`)."""
import types

import numpy as np
import pytest
import torch
from transformers import DynamicCache
from transformers.models.qwen3_5 import configuration_qwen3_5, modeling_qwen3_5
from transformers.models.qwen3_5_moe import configuration_qwen3_5_moe

from hermes.models import FAMILIES, family_of, family_of_type
from hermes.models.processing import Processor
from hermes.models.qwen3_5 import Qwen3_5
from hermes.models.qwen3_vl import Qwen3_VL, Qwen3VLPilVideoProcessor
from hermes_kernels import H2SVCConfig, HermesConfig
from hermes_kernels.rope import RotaryLayout
from scaffolding.checkpoint import save_tiny_checkpoint
from scaffolding.models import qwen3_5_layer_types, tiny_qwen3_5, tiny_qwen3_5_moe
from scaffolding.processors import tiny_image_processor, tiny_video_processor_config
from scaffolding.tokenizer import tiny_tokenizer
from tests.hermes.models.qwen3_vl_reference import PREFIX, full_inputs, own_forward, question_text, rope_index
from tests.hermes.models.test_qwen3_vl import chunks_at
from tests.hermes.streams import QUESTION, QWEN3_5
from tests.utils import assert_close_verbose

pytestmark = pytest.mark.usefixtures("single_thread")
BUILDERS = {"qwen3_5": tiny_qwen3_5, "qwen3_5_moe": tiny_qwen3_5_moe}


def test_registered_for_both_model_types():
    """One family for qwen3_5 and qwen3_5_moe, a Qwen3-VL without DeepStack, with its own presets in both policies
    and no tensor-parallel refusal; the tiny models are hybrid with the irregular layer types."""
    assert FAMILIES["qwen3_5"] is FAMILIES["qwen3_5_moe"] is Qwen3_5 and issubclass(Qwen3_5, Qwen3_VL)
    for model_type, build in BUILDERS.items():
        model = build()
        assert model.config.model_type == model_type and type(family_of(model)) is Qwen3_5
        assert model.config.text_config.layer_types == ["linear_attention", "full_attention", "full_attention",
                                                        "linear_attention", "full_attention", "linear_attention"]
    family = family_of_type("qwen3_5_moe")
    assert family.preset_name in HermesConfig.PRESETS and family.preset_name in H2SVCConfig.PRESETS
    assert family.pil_processor is Qwen3VLPilVideoProcessor and family.tp_plan is None
    assert qwen3_5_layer_types(1) == ["linear_attention", "full_attention", "linear_attention"]
    assert qwen3_5_layer_types(4) == ["linear_attention"] + ["full_attention"] * 2 + ["linear_attention"] + \
        ["full_attention"] * 2 + ["linear_attention"]


@pytest.mark.parametrize("config", [configuration_qwen3_5.Qwen3_5TextConfig,
                                    configuration_qwen3_5_moe.Qwen3_5MoeTextConfig])
def test_tensor_parallel_plan_splits_every_full_attention_head(config):
    """Why the family sets no tp_plan of its own: transformers' plan shards the full-attention projections by heads
    (q, k, v column-wise, o row-wise); the linear-attention projections are gathered after every one, so each rank
    holds whole linear states (docs/qwen3_5.md#tensor-parallel)."""
    plan = config.base_model_tp_plan
    assert [plan[f"layers.*.self_attn.{name}_proj"] for name in "qkvo"] == ["colwise"] * 3 + ["rowwise"]
    linear = {key: value for key, value in plan.items() if ".linear_attn." in key}
    assert len(linear) == 5 and set(linear.values()) == {"colwise_gather_output"}


def _as_model(rotary):
    return types.SimpleNamespace(model=types.SimpleNamespace(language_model=types.SimpleNamespace(rotary_emb=rotary)))


@pytest.mark.parametrize("case", ["tiny", "default"])
def test_rotary_is_partial_and_interleaved(case):
    """inv_freq is the rotary module's, over R/2 pairs (tiny: R = 16 of 64; transformers 5.24's default config: 64 of
    256, sections [11, 11, 10]); the layout puts every pair on the axis the module's recomposition takes it from."""
    if case == "tiny":
        rotary = tiny_qwen3_5().model.language_model.rotary_emb
        head_dim, sections = 64, [3, 3, 2]
    else:
        rotary = modeling_qwen3_5.Qwen3_5TextRotaryEmbedding(configuration_qwen3_5.Qwen3_5TextConfig())
        head_dim, sections = 256, [11, 11, 10]
    inv_freq, layout = Qwen3_5().rotary(_as_model(rotary))
    assert inv_freq is rotary.inv_freq and layout == RotaryLayout.interleaved(sections)
    assert layout.pairs == inv_freq.numel() == head_dim // 8 and layout.rotary_dim == head_dim // 4
    marked = torch.arange(3.0)[:, None, None].expand(3, 1, layout.pairs).clone()   # [axis, batch, pair] = axis
    assert rotary.recomposition_frequencies(marked)[0, :layout.pairs].long().tolist() == list(layout.axis)


def stream_positions(model, tok, chunks: list[dict], tail: str) -> tuple[torch.Tensor, list]:
    """int64 [3, S] positions of prefix + chunks + tail as a stream lays them out (every segment at the largest
    position so far + 1, docs/qwen3_vl.md#differences) from the family's chunks; and the chunks."""
    family = family_of(model)
    prefix = len(tok(family.prefix_text(None), add_special_tokens=False)["input_ids"])
    pieces, encoded = [torch.arange(prefix).expand(3, -1)], []
    for chunk in chunks:
        encoded.append(family.encode_video(model, tok, batch_size=1, **chunk))
        pieces.append(int(pieces[-1].max()) + 1 + encoded[-1].rel_positions)
    length = len(tok(tail, add_special_tokens=False)["input_ids"])
    pieces.append(int(pieces[-1].max()) + 1 + torch.arange(length).expand(3, -1))
    return torch.cat(pieces, dim=1), encoded


@pytest.mark.parametrize("model_type", sorted(BUILDERS))
def test_positions_equal_the_models_rope_index(model_type):
    """Three chunks of non-square frames (3 x 4 merged tokens: a step advances by max(h', w')) with timestamps
    crossing 10 s, text before and after: the positions the family's chunks give equal get_rope_index over the same
    text and frames; each chunk's extent is its largest offset, its frames its temporal steps."""
    g = torch.Generator().manual_seed(0)
    model, tok = BUILDERS[model_type](), tiny_tokenizer(digits=True)
    chunks = chunks_at(3, g, size=(12, 16))
    tail = question_text(QUESTION)
    positions, encoded = stream_positions(model, tok, chunks, tail)
    for chunk in encoded:
        assert chunk.extent == int(chunk.rel_positions.max()) and chunk.frames == 2
    assert torch.equal(positions, rope_index(model, full_inputs(model, tok, chunks, 1, tail))[:, 0])


def test_chunk_embeds_are_the_models_input_embeds():
    """Two streams in lockstep, two chunks: each chunk's embeddings are the model's own input embeddings (token
    embeddings with its video features scattered over the video pads, as Qwen3_5Model.forward builds them) over the
    chunk's span of the whole stream's ids: timestamps, markers and features in the model's layout; no `extra` (no
    DeepStack)."""
    g = torch.Generator().manual_seed(1)
    model, tok = tiny_qwen3_5(), tiny_tokenizer(digits=True)
    chunks = chunks_at(2, g, batch=2)
    inputs = full_inputs(model, tok, chunks, 2)
    with torch.no_grad():
        embeds = model.get_input_embeddings()(inputs["input_ids"])
        features = model.model.get_video_features(inputs["pixel_values_videos"], inputs["video_grid_thw"])
        mask = (inputs["input_ids"] == model.config.video_token_id)[..., None]
        expected = embeds.masked_scatter(mask, torch.cat(features.pooler_output))
        start = len(tok(PREFIX, add_special_tokens=False)["input_ids"])
        for chunk in chunks:
            encoded = Qwen3_5().encode_video(model, tok, batch_size=2, **chunk)
            T = encoded.embeds.shape[1]
            assert_close_verbose(encoded.embeds, expected[:, start:start + T], name="chunk embeds")
            assert encoded.extra is None and encoded.lm_kwargs(T + 5) == {}
            start += T
    assert start == inputs["input_ids"].shape[1]


@pytest.mark.parametrize("frames", [3, 4])  # odd: a chunk's last temporal step repeats its last frame
@pytest.mark.parametrize("model_type", sorted(BUILDERS))
def test_prepared_frames_have_the_announced_tokens(model_type, frames):
    """prepare_frames -> encode_video through the torchvision-free twin of the tiny checkpoint's settings: the
    chunk's frames are `memory_frames`, its tokens `tokens_per_chunk` = frames x `tokens_per_frame` at `frame_size`,
    its extent the largest offset (the family contract, docs/families.md#contract)."""
    model, tokenizer = BUILDERS[model_type](), tiny_tokenizer(digits=True)
    family = family_of(model)
    twin = family.pil_video_processor(tiny_image_processor(model_type), tiny_video_processor_config(model_type))
    processor = Processor(tokenizer=tokenizer, video_processor=twin)
    clip = np.random.default_rng(frames).integers(0, 256, (frames, 12, 20, 3), dtype=np.uint8)
    inputs = family.prepare_frames(processor, clip, fps=2.0, start=9.5)
    chunk = family.encode_video(model, processor, batch_size=1, **inputs)
    frame_size = family.frame_size(model, inputs)
    tokens = chunk.embeds.shape[1]
    assert chunk.frames == family.memory_frames(inputs) == 2
    assert tokens == family.tokens_per_chunk(model, frames, frame_size, tokenizer=tokenizer)
    assert tokens == chunk.frames * family.tokens_per_frame(model, frame_size, tokenizer=tokenizer)
    assert chunk.extent == int(chunk.rel_positions.max())


def test_bad_chunks_are_refused():
    """The shared case's bad chunks (grids, pixels, timestamps) are refused by the family, naming the argument."""
    g = torch.Generator().manual_seed(3)
    model = QWEN3_5.build()
    for chunk in QWEN3_5.bad_chunks(2, g).values():
        with pytest.raises((TypeError, ValueError), match="grid_thw|video|timestamps|append_video"):
            Qwen3_5().encode_video(model, QWEN3_5.tokenizer(), batch_size=2, **chunk)


def question_logits(model, tok, chunks, cached: bool) -> torch.Tensor:
    """The question's logits [1, Q, V] over prefix + frames + question: one forward over everything, or (`cached`)
    the question on top of transformers' DynamicCache after one forward over prefix + frames."""
    question = tok(question_text(QUESTION), add_special_tokens=False, return_tensors="pt")["input_ids"]
    whole = full_inputs(model, tok, chunks, 1, question_text(QUESTION))
    if not cached:
        return own_forward(model, whole).logits[:, -question.shape[1]:]
    video = full_inputs(model, tok, chunks, 1)
    cache = DynamicCache(config=model.config)
    own_forward(model, video, cache=cache, use_cache=True)
    length = video["input_ids"].shape[1]
    assert cache.get_seq_length() == length
    positions = rope_index(model, whole)[:, :, length:]
    return own_forward(model, {"input_ids": question, "position_ids": positions}, cache=cache).logits


@pytest.mark.parametrize("model_type", sorted(BUILDERS))
def test_a_dynamic_cache_forward_is_the_full_forward(model_type):
    """Sanity of the tiny hybrid model: prefix and frames into transformers' DynamicCache (K/V for the full-attention
    layers, conv and recurrent states for the linear ones), then the question on top gives the logits of one forward
    over everything, up to rounding.

    The bound, from the arithmetic: the two fp32 runs compute the same function and differ in summation order only
    (the question starts a new 64-token chunk of the chunked linear attention instead of continuing one, and attends
    to cached keys). Against the float64 model, each fp32 run is off by the fp32 model's own rounding error `own`
    (a reordering changes each rounding, not its size: at most twice the measured one, as flash-attention's tests
    bound theirs). transformers runs the linear attention in fp32 whatever the model's dtype, so the float64 model
    is not exact there: its cached and whole runs differ by `core`, the reordering of that fp32 arithmetic with all
    else in float64. Hence |cached32 - whole32| <= |cached32 - cached64| + |cached64 - whole64| + |whole64 - whole32|
    <= 2 own + core + own."""
    g = torch.Generator().manual_seed(4)
    model, exact, tok = BUILDERS[model_type](), BUILDERS[model_type](dtype=torch.float64), tiny_tokenizer(digits=True)
    exact.set_experts_implementation("eager")  # the grouped expert matmul takes no float64
    chunks = chunks_at(2, g)
    chunks64 = [dict(chunk, video=chunk["video"].double()) for chunk in chunks]
    whole, cached = (question_logits(model, tok, chunks, cached) for cached in (False, True))
    whole64, cached64 = (question_logits(exact, tok, chunks64, cached) for cached in (False, True))
    own = (whole.double() - whole64).abs().max().item()
    core = (cached64 - whole64).abs().max().item()
    assert core > 0  # the reordering is there to bound (a run that sums alike would need no bound)
    assert_close_verbose(cached, whole, atol=3 * own + core, rtol=0.0, name="cached question logits")


@pytest.mark.parametrize("model_type", sorted(BUILDERS))
def test_tiny_checkpoint_loads_as_the_family(model_type, tmp_path):
    """The tiny checkpoint (for the command-line tests) loads back as the same hybrid model, the family read off its
    model_type."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    folder = save_tiny_checkpoint(tmp_path / model_type, model_type)
    config = AutoConfig.from_pretrained(folder)
    assert config.model_type == model_type and type(family_of_type(config.model_type)) is Qwen3_5
    loaded = AutoModelForImageTextToText.from_pretrained(folder)
    built = BUILDERS[model_type]()
    assert loaded.config.text_config.layer_types == built.config.text_config.layer_types
    for (name, got), (_, want) in zip(loaded.state_dict().items(), built.state_dict().items()):
        assert torch.equal(got, want), name

"""HermesStream on a tiny random Qwen3-VL (interleaved M-RoPE, text timestamps between temporal steps, DeepStack)
against the model's own forward (`tests.hermes.models.qwen3_vl_reference`): positions equal get_rope_index over the
same frames, streamed logits and answers equal one full forward (both policies, nothing evicted), chunked prefills
(plain and fused with HERMES's guidance prompts) give the model's hidden states. The shared stream behaviours run
under this family from tests/hermes/stream/ (`FAMILIES`)."""
import re

import pytest
import torch

from hermes.models import family_of
from hermes.models.qwen3_vl import TIMESTAMP_DIGITS, Qwen3_VL, chunk_layout, step_times, timestamp_text
from hermes.stream import HermesStream
from scaffolding.models import tiny_qwen3_vl
from scaffolding.pixels import qwen_pixels
from scaffolding.tokenizer import tiny_tokenizer
from hermes_kernels.rope import RotaryLayout
from tests.hermes.models.qwen3_vl_reference import full_inputs, own_forward, question_text, rope_index
from tests.hermes.policies.h2svc.checks import MIXED_MAP
from tests.hermes.streams import QUESTION
from tests.utils import assert_close_verbose

pytestmark = pytest.mark.usefixtures("single_thread")


def chunks_at(count: int, g, batch: int = 1, frames: int = 4, size=(16, 16), start: float = 7.0) -> list[dict]:
    """`count` chunks of `frames` video frames sampled at 1 fps from `start` seconds: advancing timestamps (7.5 s,
    9.5 s, 11.5 s, ... by default: the integer part gains a digit inside the stream)."""
    out = []
    for index in range(count):
        video, grid = qwen_pixels(batch, frames, g, *size)
        out.append({"video": video, "grid_thw": grid,
                    "timestamps": step_times(frames, 1.0, start + index * frames, 2)})
    return out


def test_a_step_run_by_hand():
    """One step, a 3-token timestamp and 3 x 4 merged tokens: text counts on every axis, the visual tokens sit at
    (c, c + row, c + column) after <|vision_start|>, <|vision_end|> at c + max(3, 4); the next run starts after."""
    tokens, rel = chunk_layout([[7, 8, 9], [7, 8, 9]], (3, 4), vision_start=1, vision_end=2, video_token=5)
    run = [7, 8, 9, 1] + [5] * 12 + [2]
    assert tokens.tolist() == run * 2
    c = 4
    rows, cols = torch.arange(3).repeat_interleave(4), torch.arange(4).repeat(3)
    first = torch.cat([torch.arange(c).expand(3, -1),
                       torch.stack([torch.full((12,), c), c + rows, c + cols]),
                       torch.full((3, 1), c + 4)], dim=1)
    assert torch.equal(rel[:, :17], first) and torch.equal(rel[:, 17:], first + c + 4 + 1)


def test_timestamps_are_the_processors_zero_padded():
    """step_times is Qwen3VLProcessor's `_calculate_timestamps` (odd clips repeat the last frame); the text is its
    "<t seconds>" with the seconds zero-padded, one token count from 0 s to the largest time; out of range refused."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    for count, fps, start in ((4, 1.0, 0.0), (3, 2.0, 10.0), (1, 4.0, 99.75)):
        indices = [round((start + i / fps) * 24) for i in range(count)]
        assert step_times(count, fps, start, 2) == pytest.approx(
            Qwen3VLProcessor._calculate_timestamps(None, indices, 24, 2))
    assert timestamp_text(12.25) == "<00012.2 seconds>" and f"<{12.25:.1f} seconds>" == "<12.2 seconds>"
    tok = tiny_tokenizer(digits=True)
    counts = {len(tok(timestamp_text(t))["input_ids"]) for t in (0.0, 9.95, 10.0, 123.4, 10 ** TIMESTAMP_DIGITS - 0.1)}
    assert counts == {TIMESTAMP_DIGITS + 5}   # < d d d d d . d seconds >
    for bad in (-0.1, 10.0 ** TIMESTAMP_DIGITS, float("nan")):
        with pytest.raises(ValueError, match="timestamps"):
            timestamp_text(bad)


def test_rotary_layout_is_the_models_recomposition():
    """The family's layout puts every frequency pair on the axis the model's rotary module takes it from."""
    model = tiny_qwen3_vl()
    inv_freq, layout = family_of(model).rotary(model)
    rotary = model.model.language_model.rotary_emb
    pairs = inv_freq.numel()
    marked = torch.arange(3.0)[:, None, None].expand(3, 1, pairs).clone()   # [axis, batch, pair] = axis
    assert layout == RotaryLayout.interleaved([4, 2, 2]) and inv_freq is rotary.inv_freq
    assert rotary.recomposition_frequencies(marked)[0, :pairs].long().tolist() == list(layout.axis)


def test_positions_equal_the_models_rope_index():
    """Three chunks of non-square frames (3 x 4 merged tokens: the step advances by max(h', w')), timestamps
    crossing 10 s: every layer's cached positions equal get_rope_index over prefix + the same frames, and each
    chunk's extent is its largest offset."""
    g = torch.Generator().manual_seed(0)
    model, tok = tiny_qwen3_vl(), tiny_tokenizer(digits=True)
    chunks = chunks_at(3, g, size=(12, 16))
    stream = HermesStream(model, tok, budget=1000, chunk_frames=4, frame_size=(12, 16), room=64)
    for chunk in chunks:
        encoded = stream.family.encode_video(model, tok, batch_size=1, **chunk)
        assert encoded.extent == int(encoded.rel_positions.max()) and encoded.frames == 2
        stream.append_video(**chunk)
    expected = rope_index(model, full_inputs(model, tok, chunks, 1))[:, 0]
    assert stream.cache.length == expected.shape[1]
    for layer in range(stream.cfg.num_layers):
        assert torch.equal(stream.cache.layer_positions(layer)[0], expected), layer


@pytest.mark.parametrize("policy", ["hermes", "h2svc"])
def test_streaming_equals_the_models_own_forward(policy):
    """Two streams, three chunks, nothing evicted (HERMES: budget above the stream; H2SVC: windows of every frame):
    the next-token logits equal the model's own forward over prefix + frames + question (its get_rope_index, its
    DeepStack), and `ask` gives the model's own greedy answer."""
    g = torch.Generator().manual_seed(1)
    model, tok = tiny_qwen3_vl(), tiny_tokenizer(digits=True)
    chunks = chunks_at(3, g, batch=2)
    inputs = full_inputs(model, tok, chunks, 2, question_text(QUESTION))
    expected = own_forward(model, inputs, logits_to_keep=1).logits[:, -1]
    with torch.no_grad():
        answer = model.generate(**inputs, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id,
                                eos_token_id=tok.eos_token_id)[:, inputs["input_ids"].shape[1]:]
    args = dict(budget=400) if policy == "hermes" else dict(policy="h2svc", head_map=MIXED_MAP, instant_frames=6,
                                                            short_frames=6, episodic_frames=6)
    stream = HermesStream(model, tok, batch_size=2, chunk_frames=4, frame_size=(16, 16), room=64, **args)
    for chunk in chunks:
        stream.append_video(**chunk)
    assert_close_verbose(stream.next_token_logits(QUESTION), expected, name=f"{policy} last-token logits")
    assert stream.ask(QUESTION, max_new_tokens=6) == tok.batch_decode(answer, skip_special_tokens=True)


def hidden_inputs(model) -> tuple[list, list]:
    """Forward pre-hooks recording the hidden states entering every decoder layer and the final norm (DeepStack
    adds after layers 0 and 1, so layers 1 and 2 see it): (calls, hooks), calls[i] = one forward's [B, S, hidden]
    per module."""
    lm = model.model.language_model
    calls, modules = [], list(lm.layers) + [lm.norm]

    def record(index):
        def hook(module, args):
            if index == 0:
                calls.append([])
            calls[-1].append(args[0].detach().clone())
        return hook

    return calls, [module.register_forward_pre_hook(record(i)) for i, module in enumerate(modules)]


def test_deepstack_chunked_prefill_equals_the_models_forward(monkeypatch):
    """Chunk 1 goes in by a plain prefill, chunk 2 in HERMES's fused guidance forward (the budget is passed: its
    prompts ride behind it): the hidden states entering every layer at each chunk's tokens are the model's own,
    DeepStack included: off the float64 model's by at most twice what the model's own float32 forward is off; and
    without DeepStack the model's own states differ (the check has teeth)."""
    g = torch.Generator().manual_seed(2)
    model, exact, tok = tiny_qwen3_vl(), tiny_qwen3_vl(dtype=torch.float64), tiny_tokenizer(digits=True)
    chunks = chunks_at(2, g, batch=2)
    inputs = full_inputs(model, tok, chunks, 2)
    calls, hooks = hidden_inputs(model)
    exact_calls, exact_hooks = hidden_inputs(exact)
    try:
        own_forward(model, inputs)
        own_forward(exact, {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()})
        stream = HermesStream(model, tok, batch_size=2, budget=60, chunk_frames=4, frame_size=(16, 16), room=64)
        steps = [stream.append_video(**chunk) for chunk in chunks]
        with monkeypatch.context() as patch:
            patch.setattr(type(model.model.language_model), "_deepstack_process", lambda self, hidden, *a: hidden)
            own_forward(model, inputs)
    finally:
        for hook in hooks + exact_hooks:
            hook.remove()
    assert steps[0] is None and steps[1] is not None  # chunk 2 compressed: its prefill carried the prompts
    full, streamed, without = calls[0], calls[2:4], calls[4]  # calls[1]: the stream's prefix
    P, T = len(stream.prefix_ids), stream.chunk_tokens
    assert streamed[0][0].shape[1] == T < streamed[1][0].shape[1]
    for index, forward in enumerate(streamed):
        rows = slice(P + index * T, P + (index + 1) * T)
        for module, (got, own, want) in enumerate(zip(forward, full, exact_calls[0])):
            error = (got[:, :T].double() - want[:, rows]).abs().max()
            own_error = (own[:, rows].double() - want[:, rows]).abs().max()
            assert error <= 2 * own_error + 1e-6, f"chunk {index}, input of module {module}: {error} vs {own_error}"
        assert not torch.allclose(without[2][:, rows], full[2][:, rows], atol=1e-2)


def test_bad_processors_and_tokenizers_are_refused():
    """No tokenizer to write the timestamps (processor None); a tokenizer giving timestamps of different token
    counts (the steps' runs would differ in length): refused before the vision tower runs."""
    g = torch.Generator().manual_seed(3)
    model = tiny_qwen3_vl()
    chunk = chunks_at(1, g)[0]
    with pytest.raises(TypeError, match="processor"):
        Qwen3_VL().encode_video(model, None, batch_size=1, **chunk)

    def uneven(text, add_special_tokens=False):  # one token per significant digit
        return {"input_ids": [0] * len(text.strip("<>").split(".")[0].lstrip("0") or "0")}

    with pytest.raises(ValueError, match="token counts"):
        Qwen3_VL().encode_video(model, uneven, batch_size=1, **dict(chunk, timestamps=[9.5, 10.5]))


def test_tensor_parallel_plan_names_every_text_layer():
    """Why the family carries a tp_plan: transformers' plan for Qwen3-VL's text model shards its embeddings only.
    Ours: every rule names one module in each decoder layer of the text model and none in the vision tower (that
    its rules shard the weights as they say, on 2 ranks: tests/hermes/test_tensor_parallel.py)."""
    model = tiny_qwen3_vl()
    assert model.config.text_config.base_model_tp_plan == {"embed_tokens": "embedding_rowwise"}
    names = [name for name, _ in model.named_modules()]
    layers = model.config.text_config.num_hidden_layers
    for rule, style in Qwen3_VL.tp_plan.items():
        pattern = re.compile(re.escape(rule).replace(r"\*", r"\d+"))
        matched = [name for name in names if pattern.fullmatch(name)]
        assert matched == [rule.replace("*", str(i)) for i in range(layers)], rule
    styles = {rule.split("layers.*.")[1]: style for rule, style in Qwen3_VL.tp_plan.items()}
    assert [styles[f"self_attn.{p}_proj"] for p in "qkvo"] == ["colwise"] * 3 + ["rowwise"]
    assert [styles[f"mlp.{p}_proj"] for p in ("gate", "up", "down")] == ["colwise"] * 2 + ["rowwise"]

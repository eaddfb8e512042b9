"""Streams on the tiny Gemma 4 (sliding, sliding, full, sliding, full, sliding shared, full shared) against
transformers' own forward of the whole video (docs/gemma4.md): with nothing evicted, the cache is the model's own
`DynamicCache` — every full-attention layer's keys, values and positions, every sliding layer's window — and the
question's logits the model's; the dense and the MoE decoder, values from the key projection (`attention_k_eq_v`);
a checkpoint with a layer kind the family does not know is refused from its config.

float64 models on both sides: the two compute the same function with the keys cut into forwards differently
(summation order inside attention only; with nothing evicted every rotation the engine adds is by 0, exactly), so
they agree to float64 rounding over seven layers, far inside assert_close's float64 defaults (1e-7), and far from
what a wrong window, position, mask or shared layer gives (differences of order 1).
"""
import json

import pytest
import torch
from transformers import DynamicCache

from hermes.attention import attention_implementation
from hermes.commands import UsageError, check_checkpoint
from hermes.models.gemma4 import Gemma4, chunk_layout, frame_text
from hermes.stream import HermesStream
from hermes_kernels.policies.h2svc.config import EPISODIC, INSTANT, SHORT
from scaffolding.checkpoint import save_tiny_checkpoint
from scaffolding.models import tiny_gemma4
from scaffolding.tokenizer import tiny_tokenizer
from tests.hermes.streams import GEMMA4, QUESTION, layer_parts

pytestmark = pytest.mark.usefixtures("single_thread")

FULL = (2, 4)        # decoder indices of the tiny model's full-attention layers that compute keys (cache layers 0, 1)
SLIDING = (0, 1, 3)  # ... of its sliding layers that compute keys (5 and 6 read 3 and 4)
H2SVC_ALL = dict(policy="h2svc", head_map=[[EPISODIC, INSTANT], [SHORT, EPISODIC]], instant_frames=8,
                 short_frames=8, episodic_frames=8)


def whole_video(model, tok, chunks: list[dict], batch: int) -> dict:
    """The model's own inputs for prefix + every chunk + the question, for `batch` streams: input_ids [B, S] laid
    out as the processor lays out a video (`chunk_layout`), mm_token_type_ids, and the pixels and patch positions
    of every stream's frames in the order of their soft tokens (stream-major, then chunk order)."""
    family, config = Gemma4(), model.config
    ids = tok(family.prefix_text(None), add_special_tokens=False)["input_ids"]
    for chunk in chunks:
        stamps = [tok(frame_text(t), add_special_tokens=False)["input_ids"] for t in chunk["timestamps"]]
        patches = int((chunk["video_position_ids"][0] != -1).all(-1).sum())
        soft = patches // config.vision_config.pooling_kernel_size ** 2
        ids += chunk_layout(stamps, soft, boi=config.boi_token_id, eoi=config.eoi_token_id,
                            video_token=config.video_token_id)[0].tolist()
    ids += tok(family.question_text(QUESTION), add_special_tokens=False)["input_ids"]
    input_ids = torch.tensor([ids] * batch)
    frames = [chunk["video"].shape[0] // batch for chunk in chunks]
    per_stream = lambda key: torch.cat([chunk[key][b * n:(b + 1) * n] for b in range(batch)  # noqa: E731
                                        for chunk, n in zip(chunks, frames)])
    return {"input_ids": input_ids, "mm_token_type_ids": 2 * (input_ids == config.video_token_id).long(),
            "pixel_values_videos": per_stream("video").to(model.dtype), "video_position_ids": per_stream(
                "video_position_ids"), "num_frames_per_video": torch.full((batch,), sum(frames))}


def reference(model, inputs: dict, question_len: int):
    """transformers' forward of the whole sequence (sdpa, its own masks): (last-token logits [B, V], the
    DynamicCache of everything but the question)."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad(), attention_implementation(model, "sdpa"):
        head = {key: value[:, :-question_len] if key in ("input_ids", "mm_token_type_ids") else value
                for key, value in inputs.items()}
        model(**head, cache=cache, use_cache=True)
        held = DynamicCache(config=model.config)  # the whole video again, then the question on top of it
        logits = model(**inputs, cache=held, use_cache=True).logits[:, -1]
    return logits, cache


@pytest.mark.parametrize("policy,variant", [("hermes", {}), ("h2svc", {}), ("hermes", {"moe": True}),
                                            ("h2svc", {"moe": True}), ("hermes", {"attention_k_eq_v": True})],
                         ids=["hermes", "h2svc", "hermes-moe", "h2svc-moe", "hermes-k_eq_v"])
def test_a_budget_above_the_video_is_the_models_own_forward_and_cache(policy, variant):
    """Two streams, three chunks, nothing evicted (HERMES: budget above the stream, H2SVC: windows of every frame):
    the cache equals the model's own after its forward over the same tokens — each full layer's keys and values (its
    class's KV heads for H2SVC) at the model's positions, each sliding layer's last W - 1 keys and values at theirs,
    no copy for the KV-shared layers — and the question's next-token logits equal the model's."""
    g = torch.Generator().manual_seed(3)
    model, tok = tiny_gemma4(dtype=torch.float64, **variant), tiny_tokenizer(digits=True, gemma=True)
    if variant.get("moe"):
        model.set_experts_implementation("eager")  # the grouped expert matmul takes no float64
    chunks = []
    for index in range(3):
        chunk = GEMMA4.chunk(2, g)
        chunks.append(dict(chunk, timestamps=[2.0 * index, 2.0 * index + 1.0], video=chunk["video"].double()))
    args = dict(budget=1000) if policy == "hermes" else dict(H2SVC_ALL)
    stream = HermesStream(model, tok, batch_size=2, chunk_frames=2, frame_size=(8, 8), room=64, **args)
    for chunk in chunks:
        stream.append_video(**chunk)
    inputs = whole_video(model, tok, chunks, 2)
    question_len = len(tok(Gemma4().question_text(QUESTION), add_special_tokens=False)["input_ids"])
    logits, cache = reference(model, inputs, question_len)
    length = inputs["input_ids"].shape[1] - question_len
    assert stream.cache.length == length
    held = stream.cache.contents()
    for layer, decoder in enumerate(FULL):
        ref = cache.layers[decoder]
        for heads, name in layer_parts(stream, layer):
            torch.testing.assert_close(held[f"{name} keys"], ref.keys[:, heads])
            torch.testing.assert_close(held[f"{name} values"], ref.values[:, heads])
            positions = held[f"{name} positions"]
            assert torch.equal(positions, torch.arange(length).expand_as(positions)), name
    window = model.config.text_config.sliding_window
    for decoder in SLIDING:
        ref = cache.layers[decoder]
        torch.testing.assert_close(held[f"sliding layer {decoder} keys"], ref.keys)
        torch.testing.assert_close(held[f"sliding layer {decoder} values"], ref.values)
        assert held[f"sliding layer {decoder} positions"].tolist() == [list(range(length - window + 1, length))] * 2
    assert not [name for name in held if any(f"layer {d} " in name for d in (5, 6))]  # one copy: the source's
    torch.testing.assert_close(stream.next_token_logits(QUESTION), logits)


def test_a_layer_kind_the_family_does_not_know_is_refused_from_the_config(tmp_path):
    """A checkpoint whose config names a layer kind the caches do not hold is refused naming it, from config.json
    alone: the folder holds no weights."""
    folder = save_tiny_checkpoint(tmp_path / "gemma4", "gemma4")
    config = json.loads((tmp_path / folder / "config.json").read_text())
    config["text_config"]["layer_types"][1] = "chunked_attention"
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text(json.dumps(config))
    with pytest.raises(UsageError, match=r"^layer_types: gemma4 has layers of kind 'chunked_attention'"):
        check_checkpoint(bare)


def evicting_beside_whole(model, seed: int, chunks: int = 5):
    """Yield (index, evicting, whole) after each of `chunks` chunks of 2 frames fed to two streams of the float64
    `model`: H2SVC with both full layers' heads split over the classes and windows of 1, 2 and 3 frames (evicting
    from the second chunk on), and HERMES with a budget above the video (nothing evicted)."""
    g, tok = torch.Generator().manual_seed(seed), tiny_tokenizer(digits=True, gemma=True)
    evicting = HermesStream(model, tok, chunk_frames=2, frame_size=(8, 8), room=64, policy="h2svc",
                            head_map=[[EPISODIC, INSTANT], [SHORT, EPISODIC]], instant_frames=1, short_frames=2,
                            episodic_frames=3)
    whole = HermesStream(model, tok, chunk_frames=2, frame_size=(8, 8), room=64, budget=1000)
    for index in range(chunks):
        chunk = dict(GEMMA4.chunk(1, g), timestamps=[2.0 * index, 2.0 * index + 1.0])
        chunk["video"] = chunk["video"].double()
        evicting.append_video(**chunk)
        whole.append_video(**chunk)
        yield index, evicting, whole


def test_h2svc_evicting_keeps_the_sliding_layers_at_stream_positions():
    """H2SVC with windows of 1, 2 and 3 frames evicts from the second chunk on, so its length falls behind the
    stream's; the sliding layers still hold the last W - 1 tokens at stream positions, and the first one (whose input
    no eviction changes) the keys and values of a stream that never evicts: keys within the float32 angle rounding of
    turning them twice (2^-24 of each angle, at most the last position times the largest frequency, three angles),
    values bit for bit."""
    model = tiny_gemma4(dtype=torch.float64)
    inv_freq = model.model.language_model.rotary_emb.sliding_attention_inv_freq
    for index, evicting, whole in evicting_beside_whole(model, seed=5):
        ours, theirs = evicting.cache.contents(), whole.cache.contents()
        seen = whole.cache.length
        for decoder in SLIDING:
            assert torch.equal(ours[f"sliding layer {decoder} positions"], theirs[f"sliding layer {decoder} positions"])
        keys = theirs["sliding layer 0 keys"]
        bound = 3 * 2 ** -24 * seen * float(inv_freq.max()) * float(keys.abs().max()) * 2 ** 0.5
        torch.testing.assert_close(ours["sliding layer 0 keys"], keys, atol=bound, rtol=0)
        assert torch.equal(ours["sliding layer 0 values"], theirs["sliding layer 0 values"])
    assert evicting.cache.length < whole.cache.length  # evicted: the turn was not 0


def test_h2svc_evicting_holds_what_a_naive_frame_memory_holds():
    """A Gemma 4 whose first layer is full-attention (full, sliding, full, sliding, and a last full layer reading
    the second one's keys), H2SVC with windows of 1, 2 and 3 frames over five chunks of 2 frames, compared after
    every chunk with a naive frame memory written from the contract (docs/h2svc.md §3): each class of each full
    layer holds the prefix and the tokens of its frames (in slot order) at their stream positions; instant and
    short the last 1 and 2 frames; episodic 3 distinct frames seen so far, the newest among them. The first layer's
    input is the embeddings, which no eviction changes, so its classes hold the keys and values of a stream that
    never evicts at those positions: values bit for bit, keys within the float32 angle rounding of turning them to
    their positions (2^-24 of each angle, at most the last position times the largest frequency, three angles)."""
    types = ["full_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    model = tiny_gemma4(dtype=torch.float64, layer_types=types, num_kv_shared_layers=1)
    inv_freq = model.model.language_model.rotary_emb.full_attention_inv_freq
    for index, evicting, whole in evicting_beside_whole(model, seed=6):
        ours, theirs = evicting.cache.contents(), whole.cache.contents()
        prefix, per_frame = evicting.cfg.prefix_len, evicting.cfg.tokens_per_frame
        seen = 2 * (index + 1)
        assert whole.cache.length == prefix + seen * per_frame
        for layer in range(2):
            for heads, name in layer_parts(evicting, layer):
                frames = [f for f in ours[f"{name} slot_frames"][0, 0].tolist() if f >= 0]  # -1: an empty slot
                if name.endswith("episodic"):
                    assert len(set(frames)) == len(frames) == min(3, seen) and seen - 1 in frames
                    assert all(0 <= f < seen for f in frames)
                else:
                    held = 1 if name.endswith("instant") else 2
                    assert sorted(frames) == list(range(max(0, seen - held), seen)), name
                positions = list(range(prefix)) + [prefix + f * per_frame + t for f in frames for t in range(per_frame)]
                assert ours[f"{name} positions"][0, 0].tolist() == positions, name
                if layer == 0:
                    keys = theirs["layer 0 keys"][:, heads][..., positions, :]
                    angle = whole.cache.length * float(inv_freq.max())  # the largest angle of the three
                    bound = 3 * 2 ** -24 * angle * float(keys.abs().max()) * 2 ** 0.5
                    torch.testing.assert_close(ours[f"{name} keys"], keys, atol=bound, rtol=0)
                    assert torch.equal(ours[f"{name} values"], theirs["layer 0 values"][:, heads][..., positions, :])
    assert evicting.cache.length < whole.cache.length

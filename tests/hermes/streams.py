"""Integration checks of HermesStream shared by both model families (imported by test_stream_*.py).

Each family's test file defines a `case` fixture returning its `Case` (`CASES`): how to build the tiny model,
make a chunk of pixels, and encode it with the model's own vision path for reference runs. The other stream
test files (fused guidance, faults, ragged questions, threads, soak) parametrize over `CASES` themselves and
import names from here one by one. References never go through HERMES: they run the unpatched model (sdpa,
or eager for attention maps) over the full sequence or over a `DynamicCache` holding the same keys.
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Callable

import pytest
import torch
from transformers import DynamicCache

from hermes.testing import live_tensors
from hermes.testing import llava_pixels, qwen_pixels, tiny_llava_ov, tiny_qwen2_5_vl, tiny_tokenizer
import hermes.attention
from hermes.attention import attention_implementation
from hermes_kernels.policies.hermes.config import DEEP
from hermes.policies.hermes.guidance import GuidancePlan
from hermes.models import family_of
from hermes.models.qwen2_5_vl import video_rel_positions
from hermes.stream import HermesStream
from tests.utils import assert_close_verbose, poison_

QUESTION = "what is the person holding ?"


@dataclasses.dataclass
class Case:
    """A model family under test.

    build:      (**overrides) -> tiny model.
    frames:     frames per chunk.
    chunk:      (batch, generator) -> append_video keyword arguments (video=..., grid_thw=...).
    encode:     (model, chunk kwargs) -> (embeds [B, T, hidden], rel positions [3, T] or None) via the model's
                own vision path.
    stream_kwargs: extra HermesStream arguments (frame_size for Qwen2.5-VL).
    bad_chunks: (batch, generator) -> {name: append_video kwargs that must be rejected}.
    """

    name: str
    build: Callable
    frames: int
    chunk: Callable
    encode: Callable
    stream_kwargs: dict
    bad_chunks: Callable
    mrope: bool


LLAVA_FRAMES = 2


def _llava_chunk(batch, g):
    return {"video": llava_pixels(batch, LLAVA_FRAMES, g)}


def _llava_encode(model, chunk):
    features = model.model.get_video_features(chunk["video"], vision_feature_layer=-1,
                                              vision_feature_select_strategy="full").pooler_output
    return features[:, :-1], None


def _llava_bad_chunks(batch, g):
    return {
        "wrong frame size": {"video": torch.randn(batch, LLAVA_FRAMES, 3, 8, 8, generator=g)},
        "wrong channels": {"video": torch.randn(batch, LLAVA_FRAMES, 1, 16, 16, generator=g)},
        "wrong batch": {"video": llava_pixels(batch + 1, LLAVA_FRAMES, g)},
        "integer pixels": {"video": torch.zeros(batch, LLAVA_FRAMES, 3, 16, 16, dtype=torch.uint8)},
        "non-finite": {"video": llava_pixels(batch, LLAVA_FRAMES, g).index_fill_(1, torch.tensor([0]),
                                                                                float("nan"))},
        "unknown argument": {"video": llava_pixels(batch, LLAVA_FRAMES, g), "grid_thw": torch.tensor([1, 8, 8])},
    }


QWEN_FRAMES = 4
SECONDS_PER_GRID = 4.0  # t advances 8 per temporal step: time, not the grid, drives the positions


def _qwen_chunk(batch, g):
    video, grid = qwen_pixels(batch, QWEN_FRAMES, g)
    return {"video": video, "grid_thw": grid, "seconds_per_grid": SECONDS_PER_GRID}


def _qwen_encode(model, chunk):
    grid = chunk["grid_thw"]
    embeds = torch.stack(model.model.get_video_features(chunk["video"], grid).pooler_output)
    vision = model.config.vision_config
    interval = vision.tokens_per_second * chunk["seconds_per_grid"]
    return embeds, video_rel_positions(grid[0].tolist(), vision.spatial_merge_size, interval)


def _qwen_bad_chunks(batch, g):
    video, grid = qwen_pixels(batch, QWEN_FRAMES, g)
    return {
        "missing grid": {"video": video},
        "grid does not match rows": {"video": video, "grid_thw": torch.tensor([2, 4, 4])},
        "odd grid": {"video": video[: batch * 2 * 3 * 8], "grid_thw": torch.tensor([2, 3, 8])},
        "streams with different grids": {"video": video, "grid_thw": torch.tensor([[2, 8, 8], [1, 16, 8]])},
        "wrong patch size": {"video": video[:, :12], "grid_thw": grid},
        "non-finite": {"video": video.clone().fill_(float("inf")), "grid_thw": grid},
        "bad seconds_per_grid": {"video": video, "grid_thw": grid, "seconds_per_grid": 0.0},
    }


CASES = {
    "llava_ov": Case(name="llava_ov", build=tiny_llava_ov, frames=LLAVA_FRAMES, chunk=_llava_chunk,
                     encode=_llava_encode, stream_kwargs={}, bad_chunks=_llava_bad_chunks, mrope=False),
    "qwen2_5_vl": Case(name="qwen2_5_vl", build=tiny_qwen2_5_vl, frames=QWEN_FRAMES, chunk=_qwen_chunk,
                       encode=_qwen_encode, stream_kwargs={"frame_size": (16, 16)}, bad_chunks=_qwen_bad_chunks,
                       mrope=True),
}


def make_stream(case: Case, model, **kwargs) -> HermesStream:
    """A stream whose free slots (everything past the prefilled prefix) are poisoned: NaN keys/values and
    guidance scores, sentinel positions, so a read of a slot nobody wrote shows up in every check."""
    args = dict(chunk_frames=case.frames, room=160)
    args.update(case.stream_kwargs)
    args.update(kwargs)
    stream = HermesStream(model, tiny_tokenizer(), **args)
    length = stream.cache.length
    for stack in stream.cache._stacks:
        for buffer in (stack.keys, stack.values):
            poison_(buffer[..., length:, :])
        poison_(stack.positions[..., length:])
    poison_(stream.cache.guidance_attn)
    return stream


def full_positions(case: Case, prefix_len: int, rels: list, lengths: list[int], question_len: int,
                   batch: int) -> torch.Tensor:
    """Positions of prefix + chunks + question as one sequence: every segment starts at the largest
    position so far + 1 (docs/hermes.md §2.7); [B, S] or [3, B, S]."""
    pieces = [torch.arange(prefix_len).expand(3, -1)]
    for rel, length in zip(rels, lengths):
        start = int(pieces[-1].max()) + 1
        pieces.append(start + (torch.arange(length).expand(3, -1) if rel is None else rel))
    pieces.append(int(pieces[-1].max()) + 1 + torch.arange(question_len).expand(3, -1))
    positions = torch.cat(pieces, dim=1)
    if not case.mrope:
        return positions[0].expand(batch, -1)
    return positions[:, None, :].expand(3, batch, -1)


def reference_sequence(case: Case, model, chunks: list[dict], batch: int):
    """(embeds [B, S, hidden], positions, question ids [B, Tq]) of the whole stream as one sequence."""
    tok = tiny_tokenizer()
    fam = family_of(model)
    prefix = torch.tensor([tok(fam.prefix_text(None), add_special_tokens=False)["input_ids"]] * batch)
    question = torch.tensor([tok(fam.question_text(QUESTION), add_special_tokens=False)["input_ids"]] * batch)
    embed = model.get_input_embeddings()
    encoded = [case.encode(model, chunk) for chunk in chunks]
    embeds = torch.cat([embed(prefix)] + [e for e, _ in encoded] + [embed(question)], dim=1)
    positions = full_positions(case, prefix.shape[1], [r for _, r in encoded], [e.shape[1] for e, _ in encoded],
                               question.shape[1], batch)
    return embeds, positions, question


def reference_logits(model, embeds, positions) -> torch.Tensor:
    with attention_implementation(model, "sdpa"), torch.no_grad():
        hidden = model.model.language_model(inputs_embeds=embeds, position_ids=positions).last_hidden_state
        return model.lm_head(hidden[:, -1])


def reference_greedy(model, embeds, positions, new_tokens: int, mrope: bool) -> torch.Tensor:
    tok = tiny_tokenizer()
    extra = {"mm_token_type_ids": torch.zeros(embeds.shape[:2], dtype=torch.int32)} if mrope else {}
    with attention_implementation(model, "sdpa"), torch.no_grad():
        return model.generate(inputs_embeds=embeds, attention_mask=torch.ones(embeds.shape[:2], dtype=torch.long),
                              position_ids=positions, max_new_tokens=new_tokens, do_sample=False,
                              pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, **extra)


def snapshot(stream: HermesStream) -> tuple:
    """Everything a failed call must leave untouched: length and the valid slots of every layer."""
    cache = stream.cache
    return (cache.length, [cache.layer_keys(l).clone() for l in range(cache.num_layers)],
            [cache.layer_values(l).clone() for l in range(cache.num_layers)],
            [cache.layer_positions(l).clone() for l in range(cache.num_layers)])


def refuse_bad_questions(stream: HermesStream) -> None:
    """Questions `ask` must refuse before anything runs, either policy: an answer past the room, a list for a
    one-stream batch, beam search."""
    with pytest.raises(ValueError, match="room"):
        stream.ask(QUESTION, max_new_tokens=10_000)
    with pytest.raises(TypeError, match="question"):
        stream.ask([QUESTION], max_new_tokens=2)
    with pytest.raises(ValueError, match="num_beams"):
        stream.ask(QUESTION, max_new_tokens=2, num_beams=2)


def assert_unchanged(stream: HermesStream, before: tuple) -> None:
    after = snapshot(stream)
    assert after[0] == before[0], f"length changed {before[0]} -> {after[0]}"
    for name, a, b in zip(("keys", "values", "positions"), after[1:], before[1:]):
        for layer, (x, y) in enumerate(zip(a, b)):
            assert torch.equal(x, y), f"{name} of layer {layer} changed"




# ---- the checks ---------------------------------------------------------------------------------------------
def test_streaming_matches_full_forward_and_generate(case):
    """Budget >= the whole stream: chunk-by-chunk streaming gives the last-token logits of one forward over
    the full sequence, `ask` gives the full-sequence greedy answer, and the cache ends where it started."""
    g = torch.Generator().manual_seed(1)
    model = case.build()
    chunks = [case.chunk(2, g) for _ in range(3)]
    embeds, positions, question = reference_sequence(case, model, chunks, batch=2)
    expected_logits = reference_logits(model, embeds, positions)
    expected_answer = reference_greedy(model, embeds, positions, 6, case.mrope)

    stream = make_stream(case, model, budget=400, batch_size=2)
    for chunk in chunks:
        assert stream.append_video(**chunk) is None
    before = stream.cache.length
    assert_close_verbose(stream.next_token_logits(QUESTION), expected_logits, name="last-token logits")
    assert stream.cache.length == before
    answers = stream.ask(QUESTION, max_new_tokens=6)
    assert answers == stream.tokenizer.batch_decode(expected_answer, skip_special_tokens=True)
    assert stream.cache.length == before
    assert_close_verbose(stream.next_token_logits(QUESTION), expected_logits, name="logits after ask")


def eager_pooled(model, stream: HermesStream, stream_index: int, prompt_ids: list[int],
                 layers: list[int]) -> dict[int, torch.Tensor]:
    """Attention of `prompt_ids` over one stream's cached keys, from transformers' eager attention with
    output_attentions, pooled over heads then prompt tokens and restricted to the visual keys: {layer: [V]}.
    The prompt sits at layer 0's next positions (so only layers sharing layer 0's positions are comparable)."""
    cache, b = stream.cache, stream_index
    dynamic = DynamicCache()
    for layer in range(cache.num_layers):
        dynamic.update(cache.layer_keys(layer)[b:b + 1].clone(), cache.layer_values(layer)[b:b + 1].clone(), layer)
    ids = torch.tensor([prompt_ids])
    start = int(cache.layer_positions(0)[b].max()) + 1
    positions = start + torch.arange(ids.shape[1])[None]
    if cache.mrope:
        positions = positions.expand(3, -1, -1)
    with attention_implementation(model, "eager"), torch.no_grad():
        out = model.model.language_model(input_ids=ids, position_ids=positions, cache=dynamic, use_cache=True,
                                         output_attentions=True)
    P, N = cache.cfg.prefix_len, cache.length
    return {layer: out.attentions[layer][0].float().mean(dim=0).mean(dim=0)[P:N] for layer in layers}


@pytest.mark.parametrize("compressed", [False, True], ids=["before-compression", "after-lazy-compression"])
def test_guidance_scores_match_eager_attention(case, compressed):
    """Patched-attention guidance scores == eager output_attentions pooled over heads and query tokens, for
    the same prompt and cache: every layer before compression (local, mixed and global prompts packed in
    one forward), layer 0 after lazy compressions (layers then carry different positions)."""
    g = torch.Generator().manual_seed(2)
    model = case.build()
    stream = make_stream(case, model, budget=40 if compressed else 400, batch_size=2, shallow_ratio=0.25)
    for _ in range(3):
        stream.append_video(**case.chunk(2, g))
    stream.ask(QUESTION, max_new_tokens=3)  # history fills the prompts
    assert (stream.stats()["steps"] > 0) == compressed
    L = stream.cfg.num_layers
    layers = list(range(L)) if not compressed else [0]
    scores = stream.guidance_scores(layers=list(range(L)))
    plan = GuidancePlan.from_config(stream.cfg, list(range(L)))
    assert set(plan.kinds) == {"local", "mixed", "global"}
    prompts = plan.token_ids(stream.tokenizer, stream.last_convs)
    for index, kind in enumerate(plan.kinds):
        wanted = [l for l in layers if plan.kind_of_layer[l] == kind]
        if not wanted:
            continue
        for b in range(stream.batch_size):
            expected = eager_pooled(model, stream, b, prompts[b][index], wanted)
            for layer in wanted:
                assert_close_verbose(scores[layer, b], expected[layer], name=f"{kind} guidance, layer {layer}, "
                                     f"stream {b}")


def test_guidance_backends_agree_on_the_cache_views(case):
    """The Triton pooled-attention kernel (interpreter on CPU) reads the cache's strided views and the
    reordered guidance keys exactly like the torch backend."""
    g = torch.Generator().manual_seed(8)
    model = case.build()
    stream = make_stream(case, model, budget=400, batch_size=2, shallow_ratio=0.25)
    stream.append_video(**case.chunk(2, g))
    layers = list(range(stream.cfg.num_layers))
    stream.backend = "torch"
    expected = stream.guidance_scores(layers)
    stream.backend = "triton"
    assert_close_verbose(stream.guidance_scores(layers), expected, name="triton vs torch guidance")


def test_guidance_runs_only_needed_layers(case):
    """A layer whose ω is 1 gets no prompt, and the forward stops after the deepest layer that needs one."""
    g = torch.Generator().manual_seed(3)
    model = case.build()
    stream = make_stream(case, model, budget=400)
    stream.append_video(**case.chunk(1, g))
    omega = stream.cfg.omega.tolist()
    assert [kind is None for kind in stream.policy.plan.kind_of_layer] == [w == 1.0 for w in omega]
    assert "local" not in stream.policy.plan.kinds
    calls = []
    hooks = [layer.register_forward_hook(lambda *a, i=i: calls.append(i))
             for i, layer in enumerate(stream.language_model.layers)]
    try:
        scores = stream.guidance_scores(layers=[1])
    finally:
        for hook in hooks:
            hook.remove()
    assert calls == [0], "layer 1 raises after its score: only layer 0 completes, deeper layers never run"
    others = [l for l in range(stream.cfg.num_layers) if l != 1]
    assert torch.count_nonzero(scores[others]) == 0 and torch.count_nonzero(scores[1]) > 0


def rope_at(model, keys: torch.Tensor, positions: torch.Tensor, mrope: bool) -> torch.Tensor:
    """The model's own RoPE of pre-RoPE keys [Hkv, n, D] at positions [n] ([3, n] for M-RoPE)."""
    rotary = model.model.language_model.rotary_emb
    module = __import__(type(model.model.language_model.layers[0].self_attn).__module__, fromlist=["x"])
    pos = positions[:, None, :] if mrope else positions[None, :]
    cos, sin = rotary(keys, pos)  # [1, n, D] for both layouts
    rotated, _ = module.apply_rotary_pos_emb(keys[None], keys[None], cos, sin)
    return rotated[0]


def test_rotary_correction_is_exact_after_eager_compressions(case):
    """After compressions with eager re-indexing, every cached key (prefix and kept visual tokens) equals the
    model's pre-RoPE key of the same token rotated by the model's RoPE at its new position."""
    g = torch.Generator().manual_seed(4)
    model = case.build()
    L = model.config.text_config.num_hidden_layers
    pre = {l: [] for l in range(L)}

    def record(layer):
        def hook(module, args, output):
            attn = model.model.language_model.layers[layer].self_attn
            b, t, _ = output.shape
            pre[layer].append(output.view(b, t, -1, attn.head_dim).transpose(1, 2).detach().clone())
        return hook

    hooks = [model.model.language_model.layers[l].self_attn.k_proj.register_forward_hook(record(l))
             for l in range(L)]
    try:
        stream = make_stream(case, model, budget=24, batch_size=2, reindex="eager")
        P = stream.cfg.prefix_len
        tokens = [pre[l][0] for l in range(L)]            # prefix keys [B, Hkv, P, D]
        ids = [[list(range(P)) for _ in range(2)] for _ in range(L)]  # token index of every slot; None = summary
        for _ in range(4):
            seen = [len(pre[l]) for l in range(L)]
            result = stream.append_video(**case.chunk(2, g))
            for l in range(L):
                # the chunk's forward comes first; fused guidance prompts ride behind its T tokens
                chunk_keys = pre[l][seen[l]][:, :, :stream.chunk_tokens]
                base = tokens[l].shape[2]
                tokens[l] = torch.cat([tokens[l], chunk_keys], dim=2)
                for b in range(2):
                    ids[l][b] += list(range(base, base + chunk_keys.shape[2]))
            if result is None:
                continue
            assert result.compacted
            for l in range(L):
                for b in range(2):
                    visual = ids[l][b][P:]
                    kept = [visual[k] for k in result.keep[l, b].tolist() if k >= 0]
                    summary = stream.cfg.summary and int(stream.cfg.role[l]) == DEEP and len(kept) < len(visual)
                    ids[l][b] = ids[l][b][:P] + kept + ([None] if summary else [])
        assert stream.stats()["steps"] >= 2
    finally:
        for hook in hooks:
            hook.remove()
    for l in range(L):
        keys, positions = stream.cache.layer_keys(l), stream.cache.layer_positions(l)
        for b in range(2):
            slots = [j for j, token in enumerate(ids[l][b]) if token is not None]
            assert len(ids[l][b]) == stream.cache.length
            source = tokens[l][b][:, [ids[l][b][j] for j in slots]]
            expected = rope_at(model, source, positions[b][..., slots], case.mrope)
            assert_close_verbose(keys[b][:, slots], expected, name=f"keys of layer {l}, stream {b}")


def test_64_chunks_flat_memory_and_bounded_positions(case):
    """64 chunks through a budget of a few hundred tokens: same storage, length prefix + budget after every
    step, lazy re-indexing keeps positions below a small max_position_embeddings, and no tensor survives a
    step (the live-tensor census after step 16 equals the one after step 64)."""
    g = torch.Generator().manual_seed(5)
    max_positions = 512
    model = case.build(max_positions=max_positions)
    stream = make_stream(case, model, budget=200, margin=160)
    ptrs, nbytes = stream.cache.data_ptrs(), stream.stats()["bytes_allocated"]
    P, budget = stream.cfg.prefix_len, stream.cfg.budget
    census = {}
    for step in range(64):
        result = stream.append_video(**case.chunk(1, g))
        stats = stream.stats()
        if result is not None:
            assert stats["length"] == P + budget, f"step {step}: length {stats['length']}"
        assert stats["positions"][1] < max_positions, f"step {step}: positions {stats['positions']}"
        assert stream.cache.data_ptrs() == ptrs and stats["bytes_allocated"] == nbytes
        if step in (15, 63):
            census[step] = live_tensors()
    assert stats["steps"] >= 56 and stats["compactions"] >= 2
    assert census[63] == census[15], f"live tensors (count, bytes) grew over 48 steps: {census}"


def test_lockstep_batch_matches_streams_alone(case):
    """Two streams in lockstep end with the cache, scores and answers each would get alone, including after
    a question whose answers differ (guidance prompts then differ per stream)."""
    g = torch.Generator().manual_seed(6)
    model = case.build()
    chunks = [[case.chunk(1, g) for _ in range(2)] for _ in range(5)]
    batch = make_stream(case, model, budget=40, batch_size=2)
    alone = [make_stream(case, model, budget=40) for _ in range(2)]
    for step, pair in enumerate(chunks):
        # one clip per stream: pixel values stack along the batch; the grid and timing are shared
        merged = dict(pair[0], video=torch.cat([pair[0]["video"], pair[1]["video"]]))
        batch.append_video(**merged)
        for b, stream in enumerate(alone):
            stream.append_video(**pair[b])
        if step == 2:
            answers = batch.ask(QUESTION, max_new_tokens=4)
            assert answers == [stream.ask(QUESTION, max_new_tokens=4) for stream in alone]
    assert batch.stats()["steps"] >= 3
    for b, stream in enumerate(alone):
        assert batch.cache.length == stream.cache.length
        for l in range(batch.cfg.num_layers):
            assert torch.equal(batch.cache.layer_positions(l)[b], stream.cache.layer_positions(l)[0])
            assert_close_verbose(batch.cache.layer_keys(l)[b], stream.cache.layer_keys(l)[0], name=f"keys {l}")
            assert_close_verbose(batch.cache.layer_values(l)[b], stream.cache.layer_values(l)[0], name=f"values {l}")
        assert_close_verbose(batch.next_token_logits(QUESTION)[b], stream.next_token_logits(QUESTION)[0],
                             name="logits")


def test_reset_starts_a_new_video_in_the_same_buffers(case):
    """After reset() a stream behaves like a fresh one (no history, no steps) without reallocating."""
    g = torch.Generator().manual_seed(9)
    model = case.build()
    used = make_stream(case, model, budget=40)
    for _ in range(4):
        used.append_video(**case.chunk(1, g))
    used.ask(QUESTION, max_new_tokens=2)
    ptrs = used.cache.data_ptrs()
    used.reset()
    assert used.stats()["steps"] == 0 and used.last_convs == [None] and used.cache.data_ptrs() == ptrs
    fresh = make_stream(case, model, budget=40)
    for _ in range(4):
        chunk = case.chunk(1, g)
        used.append_video(**chunk)
        fresh.append_video(**chunk)
    assert used.stats() == fresh.stats()
    for l in range(used.cfg.num_layers):
        assert torch.equal(used.cache.layer_keys(l), fresh.cache.layer_keys(l))
        assert torch.equal(used.cache.layer_positions(l), fresh.cache.layer_positions(l))


def test_bad_input_raises_and_leaves_cache_unchanged(case):
    """Wrong frame shapes, oversized chunks and questions that do not fit raise clear errors before any write."""
    g = torch.Generator().manual_seed(7)
    model = case.build()
    stream = make_stream(case, model, budget=40, batch_size=2)
    for _ in range(3):
        stream.append_video(**case.chunk(2, g))
    for name, kwargs in case.bad_chunks(2, g).items():
        before = snapshot(stream)
        with pytest.raises((ValueError, TypeError), match="video|grid_thw|seconds_per_grid"):
            stream.append_video(**kwargs)
        assert_unchanged(stream, before)
    before = snapshot(stream)
    refuse_bad_questions(stream)
    assert_unchanged(stream, before)
    small = make_stream(case, model, budget=40, chunk_tokens=8)
    with pytest.raises(ValueError, match="chunk_tokens"):
        small.append_video(**case.chunk(1, g))
    with pytest.raises(ValueError, match="budget"):  # deep layers need one slot for the summary token
        make_stream(case, model, budget=1)
    with pytest.raises(ValueError, match="backend"):
        make_stream(case, model, budget=40, backend="cuda")


def run_in_two_threads(monkeypatch, drive, streams: list, meetings: int) -> list:
    """`drive(streams[i], i)` for i = 0, 1 in two threads on one model; returns their results in order. For the
    first `meetings` attention calls of each thread (one per layer and forward) the threads meet at a barrier
    between the layer's cache write and its attention, so each reads the shared model while the other has just
    written its own cache. An exception in a thread is re-raised here; a hung thread fails the test."""
    barrier = threading.Barrier(2, timeout=60)
    local, claim = threading.local(), hermes.attention.claim_update

    def claim_after_both_wrote(key):
        local.met = getattr(local, "met", 0) + 1
        if local.met <= meetings:
            barrier.wait()
        return claim(key)

    monkeypatch.setattr(hermes.attention, "claim_update", claim_after_both_wrote)
    results, errors = [None, None], []

    def run(index):
        try:
            results[index] = drive(streams[index], index)
        except BaseException as error:  # re-raised below, in the test's thread
            errors.append(error)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(index,)) for index in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not any(thread.is_alive() for thread in threads), "a thread hung"
    if errors:
        raise errors[0]
    return results

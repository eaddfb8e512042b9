"""Sliding-window and KV-shared layers in a stream cache (hermes.window, docs/gemma4.md), on the tiny Gemma 4's
decoder driven chunk by chunk with token ids, against transformers' own forward of the whole sequence.

float64 throughout: both sides compute the same function and differ only in how the keys are cut into forwards
(summation order inside attention), so they agree to float64 rounding, a few 1e-16 relative per operation over
seven layers; assert_close's float64 defaults (1e-7) sit nine orders above that and far below what a wrong window,
position or mask gives (differences of order 1)."""
from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from hermes.attention import attention_implementation, patch_model
from hermes.linear_state import layer_kinds
from hermes.policies.hermes.cache import HermesCache
from hermes.window import WindowLayout, kv_sources, window_mask
from hermes_kernels.policies.hermes.config import HermesConfig
from scaffolding.models import tiny_gemma4

P = 5
FRAME = 6  # soft tokens of one frame


@pytest.fixture(scope="module")
def model():
    return tiny_gemma4(dtype=torch.float64)


def sequence(model, chunks: int, seed: int = 0):
    """Token ids and mm_token_type_ids: a P-token prefix, `chunks` chunks of two frames ("t t <boi> video×6 <eoi>"),
    a 4-token question."""
    g = torch.Generator().manual_seed(seed)
    words = lambda n: torch.randint(20, 80, (n,), generator=g).tolist()  # noqa: E731 - ids of plain words
    config = model.config
    parts = [(words(P), [0] * P)]
    for _ in range(chunks):
        ids, types = [], []
        for _ in range(2):
            ids += words(2) + [config.boi_token_id] + [config.video_token_id] * FRAME + [config.eoi_token_id]
            types += [0, 0, 0] + [2] * FRAME + [0]
        parts.append((ids, types))
    parts.append((words(4), [0] * 4))
    return parts


def reference(model, parts):
    """transformers' forward of the whole sequence (sdpa, its own masks): (logits, its DynamicCache)."""
    ids = torch.tensor([sum((p[0] for p in parts), [])])
    types = torch.tensor([sum((p[1] for p in parts), [])])
    cache = DynamicCache(config=model.config)
    with torch.no_grad(), attention_implementation(model, "sdpa"):
        hidden = model.model(input_ids=ids, mm_token_type_ids=types, cache=cache, use_cache=True).last_hidden_state
    return model.lm_head(hidden), cache


def blocks_of(types: list[int]) -> torch.Tensor:
    """int64 [T]: the vision block of each token (runs of vision tokens, from 0), -1 for text."""
    vision = torch.tensor(types) > 0
    starts = vision & ~torch.cat([torch.tensor([False]), vision[:-1]])
    return torch.where(vision, torch.cumsum(starts.long(), 0) - 1, -1)


def hermes_cache(model, budget: int, forward_tokens: int = 64) -> HermesCache:
    patch_model(model)
    lm = model.model.language_model
    windows = WindowLayout.of(lm, layer_kinds(model.config), forward_tokens)
    cfg = HermesConfig.preset("qwen3_5", len(windows.full_layers), budget, P)
    return HermesCache(cfg, batch_size=1, num_kv_heads=2, head_dim=32, capacity=P + budget + forward_tokens,
                       dtype=torch.float64, inv_freq=lm.rotary_emb.full_attention_inv_freq, windows=windows)


def run(model, cache, ids: list[int], types: list[int] | None = None, read_only: bool = False) -> torch.Tensor:
    """One forward of the decoder over `ids` (vision tokens embedded as the pad token, as Gemma4Model does without
    pixels), the vision blocks from `types`; logits [1, T, V]."""
    lm = model.model.language_model
    tokens = torch.tensor([ids])
    tokens = torch.where(tokens == model.config.video_token_id, model.config.text_config.pad_token_id, tokens)
    blocks = None if types is None or not any(types) else blocks_of(types)
    with torch.no_grad(), cache.forward_context(blocks=blocks, read_only=read_only):
        hidden = lm(input_ids=tokens, position_ids=cache.default_position_ids(len(ids)), cache=cache,
                    use_cache=True).last_hidden_state
    return model.lm_head(hidden)


def test_the_layout_reads_the_config(model):
    windows = WindowLayout.of(model.model.language_model, layer_kinds(model.config), 10)
    assert windows.full_layers == (2, 4) and windows.sliding_layers == (0, 1, 3)
    assert windows.readers == {5: 3, 6: 4}  # transformers' kv_sharing_modes: the last earlier layer of the kind
    assert [m == "reuse" for m in model.config.text_config.kv_sharing_modes] == [i in windows.readers for i in
                                                                                range(7)]
    assert (windows.window, windows.slots, windows.num_kv_heads, windows.head_dim) == (24, 33, 2, 16)


def test_kv_sources_refuse_a_shared_kind_without_a_source():
    assert kv_sources(["full_attention"] * 3, 1) == (0, 1, 1)
    with pytest.raises(ValueError, match="num_kv_shared_layers: layer 2 .*sliding_attention"):
        kv_sources(["full_attention", "full_attention", "sliding_attention"], 1)
    with pytest.raises(ValueError, match="num_kv_shared_layers: expected"):
        kv_sources(["full_attention"], 1)


@pytest.mark.parametrize("forward_tokens", [64, 23], ids=["room", "ring-wraps"])
def test_a_stream_with_room_equals_the_whole_forward(model, forward_tokens):
    """Logits and every layer's keys and values (sliding windows included) equal transformers' forward of the whole
    sequence; with 23 tokens per forward the 46-slot rings wrap around twice."""
    parts = sequence(model, chunks=3)
    ref_logits, ref_cache = reference(model, parts)
    cache = hermes_cache(model, budget=1000, forward_tokens=forward_tokens)
    logits = torch.cat([run(model, cache, *part) for part in parts], dim=1)
    torch.testing.assert_close(logits, ref_logits)
    contents = cache.contents()
    for decoder, layer in enumerate(ref_cache.layers[:5]):
        name = f"layer {cache._cache_layer[decoder]}" if decoder in cache._cache_layer else f"sliding layer {decoder}"
        torch.testing.assert_close(contents[f"{name} keys"], layer.keys)
        torch.testing.assert_close(contents[f"{name} values"], layer.values)
    assert contents["sliding layer 0 positions"].tolist() == [list(range(cache.length - 23, cache.length))]
    assert not any(name.startswith(("layer 5", "layer 6", "sliding layer 5", "sliding layer 6")) for name in contents)


def test_the_vision_blocks_change_the_sliding_layers(model):
    """Without the blocks a frame's tokens see only the ones before them: the result differs from the model's."""
    parts = sequence(model, chunks=1)
    ref_logits, _ = reference(model, parts)
    cache = hermes_cache(model, budget=1000)
    logits = torch.cat([run(model, cache, ids) for ids, _ in parts], dim=1)
    assert (logits - ref_logits).abs().max() > 1e-3


def test_window_mask_by_hand():
    mask = window_mask(start=5, count=4, lo=3, window=3, blocks=torch.tensor([-1, 0, 0, 0]), device="cpu")[0, 0]
    # keys at positions 3..8, queries at 5..8, a window of 3 (a query and the 2 before it); block 0 = 6, 7, 8
    expected = [[1, 1, 1, 0, 0, 0],   # 5 sees 3, 4, 5
                [0, 1, 1, 1, 1, 1],   # 6 sees 4, 5, 6 and its block's 7, 8
                [0, 0, 1, 1, 1, 1],   # 7 sees 5, 6, 7 and 8, not 4 (out of the window)
                [0, 0, 0, 1, 1, 1]]   # 8 sees 6, 7, 8
    assert mask.int().tolist() == expected


def test_after_a_step_sliding_layers_keep_stream_positions(model):
    """A compression step shortens the full layers; the sliding layers' keys stay at stream positions, so the first
    layer (whose input no step changes) holds the uncompressed model's keys and values. (Layer 1's input already
    carries layer 0's attention over keys turned twice, below.)"""
    parts = sequence(model, chunks=3)
    _, ref_cache = reference(model, parts)
    cache = hermes_cache(model, budget=12)
    run(model, cache, *parts[0])
    for part in parts[1:-1]:
        run(model, cache, *part)
        if cache.length - P > cache.cfg.budget:
            attn = torch.rand(2, 1, cache.length - P, dtype=torch.float32)
            cache.compress(attn, backend="torch")
    run(model, cache, *parts[-1])
    assert cache.length < sum(len(p[0]) for p in parts)  # compressed
    contents = cache.contents()
    # the keys were turned twice (at the default position by the model, then by stream - default), the reference's
    # once: each angle is computed in float32 as transformers computes it, off by up to 2^-24 of itself (at most
    # position · max inv_freq), so each pair moves by up to |k| · (three angles' rounding)
    inv_freq = model.model.language_model.rotary_emb.sliding_attention_inv_freq
    positions = sum(len(p[0]) for p in parts)
    keys = ref_cache.layers[0].keys
    bound = 3 * 2 ** -24 * positions * float(inv_freq.max()) * float(keys.abs().max()) * 2 ** 0.5
    torch.testing.assert_close(contents["sliding layer 0 keys"], keys, atol=bound, rtol=0)
    assert torch.equal(contents["sliding layer 0 values"], ref_cache.layers[0].values)
    assert contents["sliding layer 1 positions"].tolist() == [list(range(positions - 23, positions))]


def test_a_failed_forward_leaves_every_kind_as_it_was(model, monkeypatch):
    parts = sequence(model, chunks=2)
    cache = hermes_cache(model, budget=1000, forward_tokens=23)
    for part in parts[:2]:
        run(model, cache, *part)
    before = {name: view.clone() for name, view in cache.contents().items()}
    length = cache.length
    reader = model.model.language_model.layers[5].self_attn

    def fail(*args, **kwargs):
        raise RuntimeError("injected")
    monkeypatch.setattr(reader.o_proj, "forward", fail)  # a KV-shared layer, after every layer that writes
    with pytest.raises(RuntimeError, match="injected"), cache.atomic():
        run(model, cache, *parts[2])
    monkeypatch.undo()
    assert cache.length == length
    after = cache.contents()
    assert after.keys() == before.keys()
    for name, view in before.items():
        assert torch.equal(after[name], view), name
    # and the stream goes on as if the failed forward had never run
    ref_logits, _ = reference(model, parts)
    logits = torch.cat([run(model, cache, *part) for part in parts[2:]], dim=1)
    torch.testing.assert_close(logits, ref_logits[:, -logits.shape[1]:])


def test_truncation_goes_back_within_the_rings_only(model):
    parts = sequence(model, chunks=2)
    cache = hermes_cache(model, budget=12, forward_tokens=32)
    for part in parts[:2]:
        run(model, cache, *part)
    windows_before = {n: v.clone() for n, v in cache.contents().items() if n.startswith("sliding")}
    length = cache.length
    run(model, cache, list(range(30, 40)))  # a question, stored
    cache.truncate(length)
    for name, view in windows_before.items():
        assert torch.equal(cache.contents()[name], view), name
    run(model, cache, *parts[2])
    cache.compress(torch.rand(2, 1, cache.length - P), backend="torch")
    with pytest.raises(ValueError, match="length: the sliding-window layers hold the tokens stored since the last "
                                         "step only"):
        cache.truncate(cache.length - 1)


def test_what_a_window_cannot_take_is_refused(model):
    cache = hermes_cache(model, budget=12, forward_tokens=16)
    with pytest.raises(ValueError, match="left_padding: a sliding-window layer"):
        with cache.forward_context(left_padding=torch.zeros(1, dtype=torch.int64)):
            pass
    with pytest.raises(ValueError, match="keep: the sliding-window layers"):
        with cache.forward_context(keep=2):
            pass
    with pytest.raises(ValueError, match="key_states: 17 incoming tokens do not fit the sliding layers' rings"):
        run(model, cache, list(range(20, 37)))
    with pytest.raises(ValueError, match=r"blocks: expected one block per incoming token \(3\)"):
        with torch.no_grad(), cache.forward_context(blocks=torch.zeros(2, dtype=torch.int64)):
            model.model.language_model(input_ids=torch.tensor([[20, 21, 22]]),
                                       position_ids=cache.default_position_ids(3), cache=cache, use_cache=True)


# ---- with eviction: the layer contract written out naively --------------------------------------------------------
def naive_attention(query, keys, values, mask) -> torch.Tensor:
    """float64 softmax(q kᵀ) v (Gemma 4's scaling is 1) with the G query heads of each KV head: query [H, T, D],
    keys/values [Hkv, S, D], mask bool [T, S]; [T, H, D]."""
    keys = keys.repeat_interleave(query.shape[0] // keys.shape[0], dim=0)
    values = values.repeat_interleave(query.shape[0] // values.shape[0], dim=0)
    scores = (query @ keys.transpose(1, 2)).masked_fill(~mask, float("-inf"))
    return (scores.softmax(dim=-1) @ values).transpose(0, 1)


def turn(x: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """x [H, T, D] turned by delta [T] positions with rotate_half pairs (i, i + D/2), angles in float64."""
    angle = delta.double()[:, None] * inv_freq.double()[None, :]
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def turn_bound(query, keys, values, delta: int, inv_freq) -> float:
    """How far a reader's output may move when its queries' turn by `delta` is computed with float32 angles (the
    engine's) instead of float64 (the naive one's): each pair's angle is off by up to 2^-24 · |delta · f| (f <= max
    inv_freq) plus its own float32 rounding, which moves q by up to that angle times |q|; a score moves by up to
    |Δq| |k|, and softmax's weights by up to twice the largest score change (in l1), so each output by that times
    max |v|."""
    angle = 2 * 2 ** -24 * (abs(delta) + 1) * float(inv_freq.max())
    score = angle * float(query.norm(dim=-1).max()) * float(keys.norm(dim=-1).max())
    return 2 * score * float(values.abs().max()) + 1e-12


def test_eviction_keeps_the_layer_contract(model, monkeypatch):
    """HERMES with a budget of 12 over three chunks and a question (a step after every chunk), lazy re-indexing and
    no summary token (the step's own arithmetic is held to a naive docs/hermes.md §2 for every family elsewhere;
    here the layer kinds): a step keeps in each full layer the prefix and the kept tokens it names, at their
    positions, and leaves every sliding window as it was; the KV-shared layers then attend over the compacted
    storage of their source (naive float64 attention over the source's contents, queries turned to the source's
    true positions) and over their source's window (stream positions, the window and vision blocks)."""
    parts = sequence(model, chunks=3)
    patch_model(model)
    lm = model.model.language_model
    windows = WindowLayout.of(lm, layer_kinds(model.config), 64)
    cfg = HermesConfig.preset("qwen3_5", 2, 12, P, reindex="lazy", summary=False)
    cache = HermesCache(cfg, batch_size=1, num_kv_heads=2, head_dim=32, capacity=P + 12 + 64, dtype=torch.float64,
                        inv_freq=lm.rotary_emb.full_attention_inv_freq, windows=windows)
    calls = []
    attend_side = cache.attend_side

    def recording(module, side, query, key, value, *args, **kwargs):
        out = attend_side(module, side, query, key, value, *args, **kwargs)
        calls.append((module.layer_idx, side, query.clone(), out[0].clone(), cache.current_forward))
        return out
    monkeypatch.setattr(cache, "attend_side", recording)
    steps = 0
    run(model, cache, *parts[0])
    for part in parts[1:]:
        calls.clear()
        start, seen = cache.length, cache._seen  # noqa: SLF001 - the stream position the naive model starts from
        run(model, cache, *part)
        held = cache.contents()
        for layer_idx, side, query, out, fwd in calls:
            if layer_idx not in windows.readers:
                continue
            source = windows.readers[layer_idx]
            count = query.shape[2]
            if side.sliding:  # the source's window at stream positions, the incoming turned there too
                ring, index = cache.windows, cache.windows.slot_of[source]
                first = max(0, seen - (windows.window - 1))
                positions = torch.arange(first, seen + fwd.count)
                keys = ring.keys[index][0][:, positions % windows.slots]
                values = ring.values[index][0][:, positions % windows.slots]
                q = turn(query[0], torch.full((count,), fwd.turn), lm.rotary_emb.sliding_attention_inv_freq)
                qpos = torch.arange(seen + fwd.count - count, seen + fwd.count)
                near = positions[None, :] > qpos[:, None] - windows.window
                block = torch.cat([torch.full((seen - first,), -1), blocks_of(part[1])])
                same = (block[None, :] == block[-count:, None]) & (block[-count:, None] >= 0)
                mask = near & ((positions[None, :] <= qpos[:, None]) | same)
                inv = lm.rotary_emb.sliding_attention_inv_freq
                delta = fwd.turn
            else:  # the source's full layer as it stands after the forward: its slots, queries at true positions
                layer = cache._cache_layer[source]  # noqa: SLF001
                keys, values = held[f"layer {layer} keys"][0], held[f"layer {layer} values"][0]
                positions = held[f"layer {layer} positions"][0]
                inv = lm.rotary_emb.full_attention_inv_freq
                true = positions[-count:]
                default = torch.arange(start + fwd.count - count, start + fwd.count)
                q = turn(query[0], true - default, inv)
                slots = torch.arange(keys.shape[1])
                mask = slots[None, :] <= slots[-count:, None]
                delta = int((true - default).abs().max())
            expected = naive_attention(q, keys, values, mask)
            bound = turn_bound(query, keys, values, delta, inv)
            assert (out[0] - expected).abs().max() <= bound, (layer_idx, side)
        if part is not parts[-1]:  # a step after every chunk (each brings more than the budget)
            before = {name: view.clone() for name, view in cache.contents().items()}
            result = cache.compress(torch.rand(2, 1, cache.length - P, dtype=torch.float32), backend="torch")
            steps += 1
            after = cache.contents()
            for layer in range(2):
                kept = result.keep[layer, 0][result.keep[layer, 0] >= 0] + P
                order = torch.cat([torch.arange(P), kept])
                for kind in ("keys", "values"):
                    assert torch.equal(after[f"layer {layer} {kind}"][0], before[f"layer {layer} {kind}"][0][:, order])
                assert torch.equal(after[f"layer {layer} positions"][0], before[f"layer {layer} positions"][0][order])
            for name, view in after.items():
                if name.startswith("sliding"):
                    assert torch.equal(view, before[name]), name
    assert steps == 3 and {call[0] for call in calls} >= {5, 6}

"""HermesCache (buffer, positions, modes, compression), the attention patch's plain path, and the guidance plan.

The cache is driven here the way a model drives it: `update` once per layer, in layer order, with the
keys/values of the incoming tokens. Compression is compared with the reference `compress_step` run on
contiguous copies of the same data.
"""
import functools

import pytest
import torch
from transformers import DynamicCache

import hermes.policies.hermes.policy
from hermes import HermesConfig, HermesStream
from hermes.attention import HERMES_ATTENTION, attention_name, patch_model
from hermes.cache import claim_update
from hermes.policies.hermes.cache import HermesCache
from hermes.policies.hermes.guidance import GLOBAL, LOCAL, GuidancePlan, guidance_prompts
from scaffolding.models import tiny_llava_ov, tiny_qwen2_5_vl
from scaffolding.pixels import llava_pixels, qwen_pixels
from scaffolding.tokenizer import tiny_tokenizer
from hermes_kernels.policies.hermes import reference as ref
from hermes_kernels.rope import RotaryLayout
from tests.utils import INTERLEAVED, TOL, assert_close_verbose, distinct_attention, inv_freq_for, poison_

pytestmark = pytest.mark.usefixtures("single_thread")

SECTION = [2, 3, 3]


def make_cache(L=4, B=2, Hkv=2, D=16, P=3, budget=10, capacity=40, dtype=torch.float32, mrope=False,
               reindex="eager", preset="llava_ov", max_positions=4096, stack_bounds=(), section=SECTION,
               **overrides):
    cfg = getattr(HermesConfig, preset)(L, budget, P, max_positions=max_positions, reindex=reindex, margin=64,
                                        **overrides)
    cache = HermesCache(cfg, batch_size=B, num_kv_heads=Hkv, head_dim=D, capacity=capacity, dtype=dtype,
                        inv_freq=inv_freq_for(D, 1e4), rotary=section if mrope else None,
                        stack_bounds=stack_bounds)
    for stack in cache._stacks:  # whatever is read before being written shows up as NaN
        poison_(stack.keys)
        poison_(stack.values)
    return cache


def feed(cache, count, g, rel=None, read_only=False, keep=None):
    """One forward's worth of updates; returns the incoming keys/values per layer and the returned views."""
    shape = (cache.batch_size, cache.num_kv_heads, count, cache.head_dim)
    sent, views = [], []
    with cache.forward_context(rel, read_only=read_only, keep=keep):
        for layer in range(cache.num_layers):
            k = torch.randn(shape, generator=g).to(cache.dtype)
            v = torch.randn(shape, generator=g).to(cache.dtype)
            sent.append((k, v))
            views.append(cache.update(k, v, layer) + (cache.incoming_delta(layer).clone(),))
    return sent, views


@pytest.mark.parametrize("mrope", [False, True], ids=["1d", "mrope"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_update_writes_in_place_and_returns_views(mrope, dtype):
    g = torch.Generator().manual_seed(0)
    cache = make_cache(dtype=dtype, mrope=mrope)
    ptrs = cache.data_ptrs()
    feed(cache, 5, g)
    assert cache.length == 5
    feed(cache, 7, g)
    _, views = feed(cache, 7, g)
    assert cache.length == 19
    for layer, (keys, values, delta) in enumerate(views):
        assert keys.shape == (2, 2, 19, 16)
        assert keys.untyped_storage().data_ptr() == cache._stacks[0].keys.untyped_storage().data_ptr()
        assert torch.equal(keys, cache.layer_keys(layer)) and torch.equal(values, cache.layer_values(layer))
        assert torch.isfinite(cache.layer_keys(layer)).all()
        # text continues from the last position; the model's defaults are already right, so delta is 0
        positions = cache.layer_positions(layer)
        expected = torch.arange(19).expand(2, 3, 19) if mrope else torch.arange(19).expand(2, 19)
        assert torch.equal(positions, expected)
        assert not delta.any()
    assert cache.data_ptrs() == ptrs


@pytest.mark.parametrize("mrope", [False, True], ids=["1d", "mrope"])
def test_positions_continue_per_layer_after_compression(mrope):
    """After a lazy step layers hold different positions; new tokens start at each layer's max + 1 and the
    delta against the default positions (length + i) is reported per layer and stream."""
    g = torch.Generator().manual_seed(1)
    cache = make_cache(mrope=mrope, reindex="lazy")
    feed(cache, 3, g)
    rel = torch.tensor([[0, 0, 0, 1, 1, 1], [0, 1, 2, 0, 1, 2], [0, 1, 2, 0, 1, 2]]) if mrope else None
    for _ in range(4):
        feed(cache, 6, g, rel=rel)
    cache.compress(distinct_attention(4, 2, cache.length - 3, g))
    assert cache.length == 13
    before = [cache.layer_positions(l).clone() for l in range(4)]
    assert any(not torch.equal(before[0], p) for p in before[1:]), "deep layers carry summary positions"
    _, views = feed(cache, 6, g, rel=rel)
    for layer in range(4):
        start = before[layer].flatten(1).amax(dim=1) + 1  # [B]
        new = cache.layer_positions(layer)[..., 13:]
        expected = start[:, None, None] + rel if mrope else start[:, None] + torch.arange(6)
        assert torch.equal(new, expected)
        assert torch.equal(views[layer][2], expected - (13 + torch.arange(6)))


def test_read_only_forward_leaves_the_length():
    g = torch.Generator().manual_seed(2)
    cache = make_cache()
    feed(cache, 8, g)
    kept = [cache.layer_keys(l).clone() for l in range(4)]
    sent, views = feed(cache, 4, g, read_only=True)
    assert cache.length == 8
    for layer in range(4):
        assert views[layer][0].shape[2] == 12
        assert torch.equal(views[layer][0][:, :, 8:], sent[layer][0])
        assert torch.equal(cache.layer_keys(layer), kept[layer])
    # keep: the first tokens stay, the rest are read-only scratch past the new length
    sent, views = feed(cache, 5, g, keep=2)
    assert cache.length == 10
    for layer in range(4):
        assert views[layer][0].shape[2] == 13
        assert torch.equal(cache.layer_keys(layer)[:, :, 8:], sent[layer][0][:, :, :2])
        assert torch.equal(cache.layer_keys(layer)[:, :, :8], kept[layer])
    with pytest.raises(ValueError, match="keep"):
        feed(cache, 4, g, read_only=True, keep=1)
    with pytest.raises(ValueError, match="keep"):
        feed(cache, 4, g, keep=-1)


def test_overflow_and_bad_shapes_raise_before_writing():
    g = torch.Generator().manual_seed(3)
    cache = make_cache(capacity=20)
    feed(cache, 18, g)
    snapshot = cache._stacks[0].keys.clone()
    with pytest.raises(ValueError, match="do not fit"):
        feed(cache, 3, g)
    with pytest.raises(ValueError, match="key_states"):
        with cache.forward_context():
            cache.update(torch.zeros(2, 3, 1, 16), torch.zeros(2, 3, 1, 16), 0)
    assert cache.length == 18
    assert torch.equal(cache._stacks[0].keys.nan_to_num(7.0), snapshot.nan_to_num(7.0))


def test_a_cache_takes_exactly_its_capacity():
    """Tokens fill the cache up to its capacity exactly (room 0 afterwards); one more is refused before writing."""
    g = torch.Generator().manual_seed(13)
    cache = make_cache(capacity=20)
    feed(cache, 17, g)
    assert cache.room() == 3
    feed(cache, 3, g)
    assert cache.length == cache.capacity == 20 and cache.room() == 0
    with pytest.raises(ValueError, match="do not fit"):
        feed(cache, 1, g)
    cache.truncate(19)
    feed(cache, 1, g)
    assert cache.length == 20


def test_truncate_crop_reset():
    g = torch.Generator().manual_seed(4)
    cache = make_cache()
    feed(cache, 10, g)
    cache.truncate(6)
    assert cache.length == 6 and cache.get_seq_length() == 6
    cache.crop(-2)
    assert cache.length == 4
    with pytest.raises(ValueError, match="length"):
        cache.truncate(5)
    ptrs = cache.data_ptrs()
    cache.reset()
    assert cache.length == 0 and cache.stats()["steps"] == 0 and cache.data_ptrs() == ptrs


@pytest.mark.parametrize("section,reindex,dtype,B,P", [
    (None, "eager", torch.float32, 2, 3), (None, "lazy", torch.float16, 1, 0),
    (SECTION, "eager", torch.float32, 2, 5), (SECTION, "lazy", torch.bfloat16, 3, 3),
    (INTERLEAVED[16], "eager", torch.bfloat16, 2, 3)], ids=["1d-eager", "1d-lazy", "mrope-eager", "mrope-lazy",
                                                         "interleaved-eager"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_compress_matches_reference_on_the_buffer_views(section, reindex, dtype, B, P, backend):
    """`HermesCache.compress` hands strided views of its buffer to hermes_kernels.compress_step (both
    backends; Triton through the interpreter on CPU): the result equals the reference step on contiguous
    copies, slots past the new length are untouched, storage stays. M-RoPE with contiguous (Qwen2.5-VL) and
    interleaved (Qwen3-VL) sections."""
    g = torch.Generator().manual_seed(5)
    mrope = section is not None
    cache = make_cache(B=B, P=P, dtype=dtype, mrope=mrope, reindex=reindex, preset="qwen2_5_vl", section=section)
    feed(cache, P, g)
    rel = torch.tensor([[0, 0, 2, 2], [0, 1, 0, 1], [0, 1, 0, 1]]) if mrope else None
    for _ in range(5):
        feed(cache, 4, g, rel=rel)
    N = cache.length
    stack = cache._stacks[0]
    keys, values = stack.keys[..., :N, :].clone(), stack.values[..., :N, :].clone()
    positions = stack.positions[..., :N].clone()
    tail = stack.keys[..., N:, :].clone()
    attn = distinct_attention(4, B, N - P, g)
    ptrs = cache.data_ptrs()
    expected = ref.compress_step(keys, values, positions, attn, cache.cfg, stack.inv_freq, section)
    result = cache.compress(attn, backend=backend)
    assert result.length == expected.length == cache.length == P + 10
    assert torch.equal(result.keep, expected.keep)
    n = result.length
    atol, rtol = TOL[dtype]
    assert_close_verbose(stack.keys[..., :n, :], keys[..., :n, :], atol, rtol, "keys")
    assert_close_verbose(stack.values[..., :n, :], values[..., :n, :], atol, rtol, "values")
    assert torch.equal(stack.positions[..., :n], positions[..., :n])
    assert torch.equal(stack.keys[..., N:, :].nan_to_num(7.0), tail.nan_to_num(7.0))
    assert cache.data_ptrs() == ptrs and cache.stats()["steps"] == 1


def test_compress_rejects_bad_attention_without_writing():
    g = torch.Generator().manual_seed(6)
    cache = make_cache()
    for _ in range(4):
        feed(cache, 5, g)
    before = (cache._stacks[0].keys.clone(), cache._stacks[0].positions.clone(), cache.length)
    bad = distinct_attention(4, 2, cache.length - 3, g)
    bad[1, 0, 2] = float("nan")
    good = distinct_attention(4, 2, cache.length - 3, g)
    for attn, backend, match in ((bad, "auto", "non-finite"), (distinct_attention(4, 2, 5, g), "auto", "attn"),
                                 (good, "cuda", "backend")):
        with pytest.raises(ValueError, match=match):
            cache.compress(attn, backend=backend)
    assert torch.equal(cache._stacks[0].keys.nan_to_num(7.0), before[0].nan_to_num(7.0))
    assert torch.equal(cache._stacks[0].positions, before[1]) and cache.length == before[2]
    assert not cache.undefined  # rejected input is not a failed step: the cache stays usable
    cache.compress(good)


@pytest.mark.parametrize("section, kind", [(None, "1d"), (SECTION, "sections"), (INTERLEAVED[16], "interleaved")])
def test_the_cache_keeps_one_rotary_layout(section, kind):
    """`rotary` is stored as the RotaryLayout of D/2 pairs, 1D included; `mrope` (three position axes) is
    what the layout says, not whether a section was given."""
    cache = make_cache(mrope=section is not None, section=section)
    assert isinstance(cache.rotary, RotaryLayout) and cache.rotary.kind == kind
    assert cache.rotary.pairs == 8 and cache.mrope is (kind != "1d")
    assert cache._stacks[0].positions.dim() == (4 if cache.mrope else 3)
    assert cache.default_position_ids(5).shape == ((3, 2, 5) if cache.mrope else (2, 5))
    one_d = HermesCache(HermesConfig.llava_ov(4, 10, 3), batch_size=1, num_kv_heads=2, head_dim=16, capacity=40,
                        dtype=torch.float32, inv_freq=inv_freq_for(16), rotary=RotaryLayout.one_d(8))
    assert not one_d.mrope and one_d.rotary == RotaryLayout.one_d(8)
    partial = HermesCache(HermesConfig.llava_ov(4, 10, 3), batch_size=1, num_kv_heads=2, head_dim=16, capacity=40,
                          dtype=torch.float32, inv_freq=inv_freq_for(8), rotary=INTERLEAVED[8])
    assert partial.rotary.rotary_dim == 8 and partial.mrope and partial._stacks[0].inv_freq.shape == (4,)


def test_construction_errors():
    cfg = HermesConfig.llava_ov(4, 10, 3)
    args = dict(batch_size=1, num_kv_heads=2, head_dim=16, capacity=40, dtype=torch.float32,
                inv_freq=inv_freq_for(16))
    for change, match in (({"capacity": 13}, "capacity"), ({"head_dim": 15}, "head_dim"),
                          ({"inv_freq": inv_freq_for(8)}, "inv_freq"), ({"rotary": [2, 2, 2]}, "^rotary"),
                          # an explicit layout of fewer pairs is partial rotary: inv_freq must then be its [R/2]
                          ({"rotary": INTERLEAVED[8]}, r"^inv_freq: expected a tensor of shape \[R/2=4\]"),
                          ({"rotary": RotaryLayout.interleaved((6, 3, 3))}, "^rotary: .* more than the head's D/2=8"),
                          ({"layer_devices": ["cpu"] * 3}, "layer_devices"),
                          # the geometry's positive ints, each named exactly (a message's first word)
                          ({"batch_size": 0}, "^batch_size: expected a positive int, got 0$"),
                          ({"num_kv_heads": 0}, "^num_kv_heads: expected a positive int, got 0$"),
                          ({"head_dim": 0}, "^head_dim: expected a positive int, got 0$"),
                          ({"head_dim": 16.0}, "^head_dim: expected a positive int, got 16.0$"),
                          ({"stack_bounds": [0]}, "stack_bounds"), ({"stack_bounds": [4]}, "stack_bounds"),
                          ({"stack_bounds": [3, 1]}, "stack_bounds"), ({"stack_bounds": [2, 2]}, "stack_bounds"),
                          ({"stack_bounds": [1.5]}, "stack_bounds")):
        with pytest.raises(ValueError, match=match):
            HermesCache(cfg, **{**args, **change})
    with pytest.raises(TypeError, match="cfg"):
        HermesCache(None, **args)


def test_layers_on_two_devices_get_two_stacks():
    cfg = HermesConfig.llava_ov(4, 10, 3)
    cache = HermesCache(cfg, batch_size=1, num_kv_heads=2, head_dim=16, capacity=40, dtype=torch.float32,
                        inv_freq=inv_freq_for(16), layer_devices=["cpu", "cpu", "meta", "meta"])
    assert [(s.device.type, s.first, s.keys.shape[0]) for s in cache._stacks] == [("cpu", 0, 2), ("meta", 2, 2)]
    assert len(cache) == 4 and cache.get_max_length() == 40
    split = HermesCache(cfg, batch_size=1, num_kv_heads=2, head_dim=16, capacity=40, dtype=torch.float32,
                        inv_freq=inv_freq_for(16), layer_devices=["cpu", "cpu", "meta", "meta"], stack_bounds=[1, 2])
    assert [(s.device.type, s.first, s.keys.shape[0]) for s in split._stacks] == \
        [("cpu", 0, 1), ("cpu", 1, 1), ("meta", 2, 2)]


def test_claim_update_is_tied_to_the_returned_tensor():
    g = torch.Generator().manual_seed(7)
    cache = make_cache()
    with cache.forward_context():
        keys, _ = cache.update(torch.randn(2, 2, 3, 16, generator=g), torch.randn(2, 2, 3, 16, generator=g), 0)
        assert claim_update(keys.clone()) is None
        assert claim_update(keys) == (cache, 0)
        assert claim_update(keys) is None  # consumed once


@pytest.mark.parametrize("split", [1, 5])
def test_patched_attention_without_hermes_cache_is_the_models_own(split):
    """With no HermesCache the registered function is plain causal attention: prefill in two pieces over a
    DynamicCache (queries after cached keys, bottom-right causality) equals the unpatched one-shot forward."""
    model = tiny_llava_ov(seed=3)
    lm = model.model.language_model
    ids = torch.randint(0, 60, (2, 11), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        expected = lm(input_ids=ids).last_hidden_state
        patch_model(model)
        assert attention_name(model.config.text_config) == HERMES_ATTENTION
        assert attention_name(model.config.vision_config) != HERMES_ATTENTION
        cache = DynamicCache()
        first = lm(input_ids=ids[:, :split], cache=cache, use_cache=True).last_hidden_state
        second = lm(input_ids=ids[:, split:], cache=cache, use_cache=True).last_hidden_state
    assert_close_verbose(torch.cat([first, second], dim=1), expected, name="hidden states")


def test_guidance_prompts_are_appendix_b():
    assert LOCAL == ("Describe the current scene in detail, focusing on specific objects, fine-grained actions, "
                     "and spatial relationships.")
    assert GLOBAL == ("Summarize the video narrative, identifying main characters, key events, timeline changes, "
                      "and the overall theme.")
    plain = guidance_prompts()
    assert plain == {"local": LOCAL, "global": GLOBAL, "mixed": LOCAL + "; " + GLOBAL}
    told = guidance_prompts("Q? A.")
    assert told["local"] == "Find recent details related to: Q? A.. " + LOCAL
    assert told["global"] == "Context summary: Q? A.. " + GLOBAL
    assert told["mixed"] == told["local"] + "; " + told["global"]


@pytest.mark.parametrize("preset,L,skipped", [("llava_ov", 28, [0, 1, 2]), ("qwen2_5_vl", 28, [0, 1]),
                                               ("qwen2_5_vl", 4, [])])
def test_guidance_plan_skips_layers_that_ignore_attention(preset, L, skipped):
    """Layers with ω = 1 (shallow; LLaVA-OV's first mid layer) need no prompt; the local prompt never runs
    with the presets; mid layers read the mixed prompt and deep layers the global one."""
    cfg = getattr(HermesConfig, preset)(L, 100, 5)
    plan = GuidancePlan.from_config(cfg)
    assert [l for l, kind in enumerate(plan.kind_of_layer) if kind is None] == skipped
    assert plan.kinds == ("mixed", "global")
    for layer, kind in enumerate(plan.kind_of_layer):
        if kind is not None:
            assert kind == {1: "mixed", 2: "global"}[int(cfg.role[layer])]
    every = GuidancePlan.from_config(cfg, range(L))
    assert every.kinds == (("local",) if cfg.shallow_end else ()) + ("mixed", "global")
    with pytest.raises(ValueError, match="layers"):
        GuidancePlan.from_config(cfg, [L])


# Triton (the interpreter on CPU, ~0.5 s per step) runs the lazy layouts, where the shared decision matters
@pytest.mark.parametrize("backend, mrope, reindex, dtype, bounds", [
    ("torch", False, "lazy", torch.float32, [2]), ("torch", True, "lazy", torch.bfloat16, [1, 3]),
    ("torch", False, "eager", torch.float16, [3]), ("triton", False, "lazy", torch.float32, [2]),
    ("triton", True, "lazy", torch.bfloat16, [1, 3])])
def test_split_stacks_match_one_stack(backend, mrope, reindex, dtype, bounds):
    """A cache laid out as several stacks (`stack_bounds`, the layout of a `device_map` split) and a one-stack cache
    fed the same chunks agree after every compression: same keep, flag, length and stats, and exactly the same
    keys, values and positions in every layer (each layer's arithmetic does not depend on which layers share its
    stack). With lazy re-indexing the deep layers' summary positions run ahead of the others, so some step has
    one stack past the threshold and another below it: only one decision for the whole cache keeps them equal."""
    caches = [make_cache(dtype=dtype, mrope=mrope, reindex=reindex, max_positions=104, stack_bounds=b)
              for b in ((), bounds)]
    assert [len(c._stacks) for c in caches] == [1, len(bounds) + 1]
    cfg = caches[0].cfg
    threshold = cfg.max_positions - cfg.margin
    rel = torch.tensor([[0, 0, 2, 2, 4, 4], [0, 1, 0, 1, 0, 1], [0, 1, 0, 1, 0, 1]]) if mrope else None
    streams = [torch.Generator().manual_seed(9) for _ in caches]  # same seed: the same keys/values for both
    g = torch.Generator().manual_seed(10)
    for cache, stream in zip(caches, streams):
        feed(cache, cfg.prefix_len, stream)
    straddled = False
    for _ in range(8):
        for cache, stream in zip(caches, streams):
            feed(cache, 6, stream, rel=rel)
        N = caches[0].length
        if N - cfg.prefix_len <= cfg.budget:
            continue
        tops = [int(s.positions[..., :N].max()) for s in caches[1]._stacks]
        straddled |= min(tops) <= threshold < max(tops)
        attn = distinct_attention(4, 2, N - cfg.prefix_len, g)
        one, split = (cache.compress(attn, backend=backend) for cache in caches)
        assert (split.length, bool(split.reindexed)) == (one.length, bool(one.reindexed))
        assert torch.equal(split.keep, one.keep)
        for layer in range(cfg.num_layers):
            for name in ("keys", "values", "positions"):
                get = getattr(HermesCache, f"layer_{name}")
                assert_close_verbose(get(caches[1], layer), get(caches[0], layer), 0.0, 0.0, f"{name} {layer}")
    stats = caches[0].stats()
    assert caches[1].stats() == stats and stats["steps"] == 7 and stats["reindexes"] >= 1
    assert straddled or reindex == "eager", "no step had stacks on both sides of the lazy threshold"


def test_split_cache_rejects_bad_attention_without_writing():
    g = torch.Generator().manual_seed(11)
    cache = make_cache(stack_bounds=[1, 3])
    for _ in range(4):
        feed(cache, 5, g)
    length = cache.length
    before = [(s.keys.clone(), s.values.clone(), s.positions.clone()) for s in cache._stacks]
    bad = distinct_attention(4, 2, cache.length - 3, g)
    bad[3, 1, 2] = float("inf")
    for attn, match in ((bad, "non-finite"), (distinct_attention(4, 2, 5, g), "attn"),
                        (distinct_attention(4, 1, cache.length - 3, g), "attn")):
        with pytest.raises(ValueError, match=match):
            cache.compress(attn)
    assert cache.length == length and cache.stats()["steps"] == 0
    for stack, saved in zip(cache._stacks, before):
        for now, then in zip((stack.keys, stack.values, stack.positions), saved):
            assert torch.equal(now.nan_to_num(7.0), then.nan_to_num(7.0))


FAMILIES = {
    "llava_ov": (tiny_llava_ov, 2, {}, lambda g: {"video": llava_pixels(1, 2, g)}),
    "qwen2_5_vl": (tiny_qwen2_5_vl, 4, {"frame_size": (16, 16)},
                   lambda g: dict(zip(("video", "grid_thw"), qwen_pixels(1, 4, g)), seconds_per_grid=4.0)),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_stream_over_split_stacks_matches_one_stack(family, monkeypatch):
    """HermesStream on a tiny model whose cache is split into three stacks (as a model spread over devices with
    `device_map` gets it) gives the one-stack stream's cache, step results and answer, through appends with
    lazy compressions (some re-indexing) and a question."""
    build, frames, kwargs, chunk = FAMILIES[family]
    model = build(max_positions=256)
    args = dict(chunk_frames=frames, room=160, budget=40, margin=196, **kwargs)  # lazy threshold: position 60
    one = HermesStream(model, tiny_tokenizer(), **args)
    split_cache = functools.partial(HermesCache, stack_bounds=[1, 3])
    monkeypatch.setattr(hermes.policies.hermes.policy, "HermesCache", split_cache)
    split = HermesStream(model, tiny_tokenizer(), **args)
    assert [len(s.cache._stacks) for s in (one, split)] == [1, 3]
    g = torch.Generator().manual_seed(12)
    for _ in range(8):
        clip = chunk(g)
        results = [stream.append_video(**clip) for stream in (one, split)]
        assert (results[0] is None) == (results[1] is None)
        if results[0] is not None:
            assert torch.equal(results[0].keep, results[1].keep)
            assert bool(results[0].reindexed) == bool(results[1].reindexed)
    assert split.stats() == one.stats() and one.stats()["reindexes"] >= 1
    for layer in range(one.cfg.num_layers):
        for name in ("keys", "values", "positions"):
            get = getattr(HermesCache, f"layer_{name}")
            assert_close_verbose(get(split.cache, layer), get(one.cache, layer), 0.0, 0.0, f"{name} {layer}")
    assert split.ask("what is the person holding ?", max_new_tokens=4) == \
        one.ask("what is the person holding ?", max_new_tokens=4)

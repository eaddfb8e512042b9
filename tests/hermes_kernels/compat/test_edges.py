"""The adapter's edges against the stand-in (docs/integrations.md): a value exactly at a limit, a state refused before
anything is written, a default used when the instance lacks a field, and what a caller may do between the selection
and the shrink. Every comparison with the oracle is exact for keep indices and positions."""
from __future__ import annotations

import pytest
import torch

from hermes_kernels.compat import IncompatibleInstance, KeepIndices, accelerate, read_layers
from scaffolding.standin import layer_pairs
from tests.hermes_kernels.compat.cases import (BUDGET, CHUNK, GRID, HEAD_DIM, KV_HEADS, LAYERS, PREFIX, Case, compare,
                                               drive, make_instance, random_chunks, record_keeps, sync)

pytestmark = pytest.mark.usefixtures("single_thread")

KINDS = ("llava_ov", "qwen2_5_vl")
MARGIN = 1024  # the released lazy re-index margin (ReleasedSchedule.margin)


def _grid(case):
    return GRID if case.kind == "qwen2_5_vl" else None


def _stream(ref, fast, case, chunks):
    """Encode `chunks` into both instances and compress, comparing after each; the keep indices must agree."""
    ref_keeps, fast_keeps = record_keeps(ref), record_keeps(fast)
    for keys, values in chunks:
        ref.encode_chunk(keys, values, _grid(case))
        fast.encode_chunk([k.clone() for k in keys], [v.clone() for v in values], _grid(case))
        ref.predict_and_compress()
        fast.predict_and_compress()
        assert fast_keeps == ref_keeps, "keep indices differ"
        compare(ref, fast, case)
    assert min(ref.boundary_margins) > 1e-5, "inputs not tie-free"
    return ref_keeps


def _state_over_budget(case, chunks=2):
    """The oracle after `chunks` chunks (the last one not compressed) and an accelerated twin holding a copy."""
    ref, fast = make_instance(case), make_instance(case, case.container)
    handle = accelerate(fast)
    stream = list(random_chunks(case))
    for keys, values in stream[:chunks - 1]:
        ref.encode_chunk(keys, values, _grid(case))
        ref.predict_and_compress()
    ref.encode_chunk(*stream[chunks - 1], _grid(case))
    sync(fast, ref)
    return ref, fast, handle


def _released_keep(ref):
    """The oracle's keep indices (lists) for its current cache, from its own guidance attention."""
    loc, glo = ref.predict_next_question()
    lists = [ref._compute_attention_scores_manually(ref._ids(t), ref.kv_cache) for t in (loc, glo, loc + "; " + glo)]
    return ref.prune_kv_cache_by_attention(*lists, num_keep=ref.kv_size)


def _snapshot(model):
    return ([(k.clone(), v.clone()) for k, v in layer_pairs(model.kv_cache)],
            [None if p is None else p.clone() for p in model._position_ids_cache])


def _unchanged(model, snapshot) -> bool:
    pairs, positions = snapshot
    return all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(layer_pairs(model.kv_cache), pairs)) \
        and all((p is None and q is None) or torch.equal(p, q) for p, q in zip(model._position_ids_cache, positions))


# -- one handle, two videos ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_one_handle_serves_a_second_video_with_another_prefix_length(kind):
    """A handle reused after the instance starts a new video (encode_init_prompt) whose system prefix is 3 tokens
    longer: selections, shrinks and positions follow the new prefix, as the released step does."""
    case = Case(kind, chunks=3)
    ref, fast = make_instance(case), make_instance(case)
    handle = accelerate(fast)
    _stream(ref, fast, case, random_chunks(case))
    gen = torch.Generator().manual_seed(77)
    keys = [torch.randn(1, KV_HEADS, PREFIX + 3, HEAD_DIM, generator=gen) for _ in range(LAYERS)]
    values = [torch.randn(1, KV_HEADS, PREFIX + 3, HEAD_DIM, generator=gen) for _ in range(LAYERS)]
    ref.start(keys, values)
    fast.start([k.clone() for k in keys], [v.clone() for v in values])
    keeps = _stream(ref, fast, case, random_chunks(Case(kind, chunks=3, seed=4)))
    assert all(layer[:PREFIX + 3] == list(range(PREFIX + 3)) for keep in keeps for layer in keep)
    assert handle.stats["shrinks"] == 4 and fast.visual_start_idx == PREFIX + 3


# -- the lazy re-index threshold and the default limit --------------------------------------------------------------

def _top_at(model, kind: str, top: int) -> None:
    """Shift every layer's video positions so that the largest position is `top` (LLaVA-OV: each layer's last entry;
    Qwen2.5-VL: the largest over the three axes), keeping the prefix's."""
    for layer, pos in enumerate(model._position_ids_cache):
        shifted = pos.clone()
        shifted[..., PREFIX:] += top - pos.max()
        model._position_ids_cache[layer] = shifted


def _shrink_at(case, top: int):
    ref, fast, _ = _state_over_budget(case)
    _top_at(ref, case.kind, top)
    sync(fast, ref)
    keep = _released_keep(ref)
    ref._shrink_positions_and_rerotate_keys(keep)
    fast._shrink_positions_and_rerotate_keys(keep)
    compare(ref, fast, case)
    return ref.reindexes[-1]


@pytest.mark.parametrize("kind", KINDS)
def test_the_lazy_threshold_hit_exactly_does_not_reindex(kind):
    """Lazy re-indexing fires once the largest position exceeds max_position_embeddings - 1024: a largest position
    equal to that keeps the positions, one more re-indexes them, as in the released shrink."""
    case = Case(kind, streaming=True)
    assert _shrink_at(case, case.max_positions - MARGIN) is False
    assert _shrink_at(case, case.max_positions - MARGIN + 1) is True


@pytest.mark.parametrize("kind,default", [("llava_ov", 32768), ("qwen2_5_vl", 128000)])
def test_the_default_position_limit_per_kind_when_the_config_lacks_it(kind, default):
    """A language model config without max_position_embeddings: the released default of each class (32768 for
    LLaVA-OV, 128000 for Qwen2.5-VL) sets the lazy threshold."""
    for top, reindexed in ((default - MARGIN, False), (default - MARGIN + 1, True)):
        case = Case(kind, streaming=True)
        ref, fast = make_instance(case), make_instance(case)
        for model in (ref, fast):
            del model.language_model.config.max_position_embeddings
        handle = accelerate(fast)
        stream = list(random_chunks(case))
        ref.encode_chunk(*stream[0], _grid(case))
        ref.predict_and_compress()
        ref.encode_chunk(*stream[1], _grid(case))
        _top_at(ref, kind, top)
        sync(fast, ref)
        keep = _released_keep(ref)
        ref._shrink_positions_and_rerotate_keys(keep)
        fast._shrink_positions_and_rerotate_keys(keep)
        # the oracle's fp32 cos/sin tables at a position p are off by up to p * 2^-24 rad each (the adapter rotates
        # by the fp32 angle of the integer delta); keys are N(0, 1), so |k| < 8
        compare(ref, fast, case, key_atol=8 * 2 * top * 2.0 ** -24)
        assert ref.reindexes[-1] is reindexed and handle._lm.max_positions == default


# -- keep indices handed to the shrink -----------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_keep_indices_at_the_layer_length_are_dropped(kind):
    """An index equal to the layer's length is out of range: dropped as the released shrink drops it, never read."""
    case = Case(kind)
    ref, fast, _ = _state_over_budget(case)
    keep = _released_keep(ref)
    lengths = [k.shape[2] for k, _ in layer_pairs(fast.kv_cache)]
    ref._shrink_positions_and_rerotate_keys(keep)
    fast._shrink_positions_and_rerotate_keys([layer + [n] for layer, n in zip(keep, lengths)])
    compare(ref, fast, case)


def _edit_last(keep, layer: int, length: int) -> torch.Tensor:
    """Layer `layer`'s keep indices with the last kept visual token swapped for the latest one not kept."""
    kept = set(keep[layer].tolist())
    other = max(i for i in range(PREFIX, length) if i not in kept)
    return torch.tensor(sorted(kept - {int(keep[layer][-1])} | {other}), dtype=torch.int64)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("how", ["replaced", "in place"])
def test_a_keep_entry_edited_before_the_shrink_is_honoured(kind, how):
    """A caller changing the accelerated selection's keep indices before handing them to the shrink (replacing a
    layer's entry, or writing into it): the shrink keeps what it is handed, as the released shrink would."""
    case = Case(kind)
    ref, fast, handle = _state_over_budget(case)
    length = layer_pairs(fast.kv_cache)[0][0].shape[2]
    keep = handle.select(handle.guidance_attention(*fast.predict_next_question()), fast.kv_size)
    assert isinstance(keep, KeepIndices) and keep.untouched()
    edited = _edit_last(keep, 2, length)
    with torch.inference_mode():  # the released flow runs under inference mode, where its tensors may be written
        if how == "replaced":
            keep[2] = edited
        else:
            keep[2].copy_(edited)
    ref._shrink_positions_and_rerotate_keys([t.tolist() for t in keep])
    fast._shrink_positions_and_rerotate_keys(keep)
    compare(ref, fast, case)
    assert not keep.untouched()


# -- when the guidance pass runs -----------------------------------------------------------------------------------

def test_a_cache_exactly_kv_size_long_skips_the_guidance():
    """The released pseudo_forward shrinks only a cache longer than kv_size; at exactly kv_size the adapter runs no
    guidance pass: no tokenizer call, the cache's tensors and positions as they were."""
    case = Case("llava_ov", kv_size=PREFIX + CHUNK)
    ref, fast = make_instance(case), make_instance(case)
    handle = accelerate(fast)
    keys, values = next(iter(random_chunks(case)))
    ref.encode_chunk(keys, values)
    fast.encode_chunk(keys, values)
    assert read_layers(fast.kv_cache)[0][0][0].shape[2] == fast.kv_size
    calls = []
    tokenizer = fast.processor.tokenizer
    fast.processor.tokenizer = lambda text: calls.append(text) or tokenizer(text)
    before, snapshot = list(layer_pairs(fast.kv_cache)), _snapshot(fast)
    ref.predict_and_compress()
    fast.predict_and_compress()
    assert calls == [] and handle.stats["guidance_skipped"] == 1 and handle.stats["guidance_passes"] == 0
    assert all(a[0] is b[0] and a[1] is b[1] for a, b in zip(before, layer_pairs(fast.kv_cache)))
    assert _unchanged(fast, snapshot) and ref.reindexes == []
    compare(ref, fast, case)


@pytest.mark.parametrize("kind,guidance", [("llava_ov", "embeddings"), ("qwen2_5_vl", "embeddings"),
                                           ("llava_ov", "propagated")])
def test_a_rotary_attention_scaling_other_than_one(kind, guidance):
    """A rotary module whose attention_scaling is not 1 (YaRN-style) scales the prompt's queries and keys, as the
    model's own tables do: the same keep indices as the released step, whose stand-in models the scale."""
    attn = "sdpa" if guidance == "embeddings" else "eager"
    case = Case(kind, attention_scaling=1.7, attn_implementation=attn, chunks=4, seed=2)
    _, _, handle, keeps, _ = drive(case)
    assert handle.guidance_mode() == guidance and len(keeps) == 3


@pytest.mark.parametrize("kind", KINDS)
def test_an_instance_without_mid_layers(kind):
    """short_term_threshold == long_term_threshold (valid: 0 <= short <= long <= num_layers): shallow layers, then
    deep ones, no mid layer; the stream matches the released step."""
    case = Case(kind, chunks=4)
    ref, fast = make_instance(case), make_instance(case)
    for model in (ref, fast):
        model.short_term_threshold = model.long_term_threshold = 4
    handle = accelerate(fast)
    assert (handle.config(BUDGET).shallow_end, handle.config(BUDGET).deep_start) == (4, 4)
    keeps = _stream(ref, fast, case, random_chunks(case))
    assert len(keeps) == 3


# -- states refused before anything is written ---------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_a_prefix_only_cache(kind):
    """A cache holding only the system prefix: the direct calls that need visual tokens (the guidance attention,
    the shrink) are refused naming visual_start_idx, nothing changed; pseudo_forward does nothing, as the released
    one (nothing to compress under kv_size)."""
    case = Case(kind)
    model = make_instance(case)
    handle = accelerate(model)
    snapshot = _snapshot(model)
    with pytest.raises(IncompatibleInstance, match=r"hold nothing after the prefix \(visual_start_idx=5\)"):
        handle.guidance_attention()
    with pytest.raises(IncompatibleInstance, match="visual_start_idx=5"):
        model._shrink_positions_and_rerotate_keys([list(range(PREFIX))] * LAYERS)
    assert _unchanged(model, snapshot)
    model.predict_and_compress()
    assert handle.stats["guidance_skipped"] == 1 and _unchanged(model, snapshot)


@pytest.mark.parametrize("kind", KINDS)
def test_the_callers_container_type_is_kept(kind):
    """A tuple of (keys, values) pairs stays a tuple of pairs after every accelerated shrink."""
    case = Case(kind, container="tuple", chunks=3)
    ref, fast, handle, _, _ = drive(case)
    assert type(fast.kv_cache) is tuple and all(type(pair) is tuple for pair in fast.kv_cache)
    assert handle.stats["shrinks"] == 2


def _broadcast_keys(model):
    pairs = layer_pairs(model.kv_cache)
    k, v = pairs[4]
    model.kv_cache[4] = (k[:, :, :1].expand_as(k), v)


def _broadcast_values(model):
    k, v = layer_pairs(model.kv_cache)[7]
    model.kv_cache[7] = (k, v[:, :1].expand_as(v))


@pytest.mark.parametrize("broadcast", [_broadcast_keys, _broadcast_values], ids=["keys", "values"])
@pytest.mark.parametrize("call", ["pseudo_forward", "shrink"])
def test_broadcast_views_are_refused_with_the_state_unchanged(broadcast, call):
    """A layer whose keys or values are a broadcast view (a stride of 0; the shrink writes the cache in place) is
    refused before any layer is written."""
    case = Case("llava_ov")
    _, model, _ = _state_over_budget(case)
    broadcast(model)
    snapshot = _snapshot(model)
    keep = [list(range(PREFIX + BUDGET - (layer >= model.long_term_threshold))) for layer in range(LAYERS)]
    with pytest.raises(IncompatibleInstance, match="broadcast views"):
        if call == "pseudo_forward":
            model.pseudo_forward()
        else:
            model._shrink_positions_and_rerotate_keys(keep)
    assert _unchanged(model, snapshot)


# -- the selection contract's arguments ----------------------------------------------------------------------------

def _lists(visual=30, q_lens=(7, 9, 16)):
    gen = torch.Generator().manual_seed(5)
    return [[torch.randn(1, 4, q, PREFIX + visual + q, generator=gen).softmax(-1) for _ in range(LAYERS)]
            for q in q_lens]


@pytest.mark.parametrize("change,message", [
    (lambda a: dict(num_keep=1), r"num_keep=1, expected an int >= 2"),
    (lambda a: dict(num_keep=2.0), r"num_keep=2.0, expected an int >= 2"),
    (lambda a: dict(attn_weights_mixed=a[2][:-1]), r"attn_weights_mixed: expected 10 per-layer attention tensors"),
    (lambda a: dict(attn_weights_global=torch.stack(a[1])), r"attn_weights_global: expected 10 per-layer .* Tensor"),
    (lambda a: dict(attn_weights_mixed=a[2][:3] + [a[2][3][0]] + a[2][4:]), r"layer 3: attention \(4, 16, 51\)"),
    (lambda a: dict(attn_weights_global=a[1][:8] + [a[1][8][:0]] + a[1][9:]), r"layer 8: attention \(0, 4, 9, 44\)"),
    (lambda a: dict(attn_weights_global=a[1][:9] + [a[1][9][..., :14]]),
     r"layer 9: attention \(1, 4, 9, 14\), expected \[1, H, q, L \+ q\] with L > visual_start_idx=5"),
    (lambda a: dict(attn_weights_mixed=a[2][:5] + ["no"] + a[2][6:]), r"layer 5: attention str"),
])
def test_the_selection_refuses_bad_arguments_naming_them(change, message):
    """prune_kv_cache_by_attention called directly: each bad argument is refused with a message naming it."""
    model = make_instance(Case("llava_ov"))
    accelerate(model)
    lists = _lists()
    arguments = dict(attn_weights_local=lists[0], attn_weights_global=lists[1], attn_weights_mixed=lists[2],
                     num_keep=BUDGET)
    arguments.update(change(lists))
    with pytest.raises(IncompatibleInstance, match="prune_kv_cache_by_attention: " + message):
        model.prune_kv_cache_by_attention(**arguments)


def test_the_selection_takes_the_smallest_budget():
    """num_keep = 2, the smallest budget (deep layers keep one visual token and the summary), from fp16 attention:
    the released selection's keep indices."""
    case = Case("qwen2_5_vl")
    ref, fast = make_instance(case), make_instance(case)
    accelerate(fast)
    lists = [[w.to(torch.float16) for w in prompt] for prompt in _lists(visual=12)]
    want = ref.prune_kv_cache_by_attention(*lists, num_keep=2)
    got = fast.prune_kv_cache_by_attention(*lists, num_keep=2)
    assert [t.tolist() for t in got] == want and got.relative.shape == (LAYERS, 1, 2)

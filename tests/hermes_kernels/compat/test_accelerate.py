"""`hermes_kernels.compat.accelerate` against the stand-in of the released HERMES classes (docs/integrations.md).

Every comparison is on tie-free inputs (the drive checks each selection's top-k margins) and exact for keep indices,
lengths and positions; keys and values agree within the tolerance of the released numerics (fp16 rotary tables).
"""
from __future__ import annotations

import types

import pytest
import torch

from hermes_kernels.compat import IncompatibleInstance, KeepIndices, accelerate, read_layers
from hermes_kernels.compat.handle import MARKER
from hermes_kernels.compat.schedule import METHODS
from scaffolding.standin import ReleasedLLaVAOV, ReleasedQwenVL, rotate_half
from tests.hermes_kernels.compat.cases import (BUDGET, CHUNK, CONTAINERS, GRID, HEADS, KV_HEADS, LAYERS, PREFIX, Case,
                                               compare, drive, make_instance, random_chunks, sync)

pytestmark = pytest.mark.usefixtures("single_thread")

KINDS = ("llava_ov", "qwen2_5_vl")
# (kind, streaming, dtype, container, seed): fp32 streams free-running, fp16 ones in lockstep (see cases.drive)
DRIVES = [
    ("llava_ov", True, torch.float32, "list", 0),
    ("llava_ov", False, torch.float32, "legacy", 0),
    ("llava_ov", True, torch.float16, "list", 0),
    ("llava_ov", False, torch.float16, "list", 0),
    ("qwen2_5_vl", True, torch.float32, "layered", 0),
    ("qwen2_5_vl", False, torch.float32, "legacy", 0),
    ("qwen2_5_vl", True, torch.float16, "legacy", 0),
    ("qwen2_5_vl", False, torch.float16, "layered", 0),
]


def _ids(drives):
    return [f"{k}-{'lazy' if s else 'eager'}-{str(d).removeprefix('torch.')}-{c}" for k, s, d, c, _ in drives]


@pytest.mark.parametrize("kind,streaming,dtype,container,seed", DRIVES, ids=_ids(DRIVES))
def test_a_stream_matches_the_released_step(kind, streaming, dtype, container, seed):
    """Six chunks through the released-style step and through the accelerated instance: the same keep indices,
    lengths and positions after every chunk, keys and values within tolerance; the first chunk (under the budget)
    skips the guidance pass; lazy re-indexing fires in some steps and not others; the container is kept."""
    case = Case(kind, dtype, streaming, container, seed=seed)
    ref, fast, handle, keeps, _ = drive(case, lockstep=dtype == torch.float16)
    assert handle.stats == {"guidance_passes": 5, "guidance_skipped": 1, "selections": 5, "shrinks": 5}
    assert len(keeps) == 5
    assert type(fast.kv_cache) is CONTAINERS[container]
    assert read_layers(fast.kv_cache)[0][0][0].shape[2] == PREFIX + BUDGET
    if streaming:
        assert any(ref.reindexes) and not all(ref.reindexes), ref.reindexes
    else:
        assert all(ref.reindexes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gemma4_s_head_width_and_proportional_rope_match_the_released_step(dtype):
    """Heads of Gemma 4's full-attention width (D 512) whose rotary module holds its proportional inv_freq (the
    first 64 of 256 pairs turn, the others have frequency 0), two query heads over one KV head: three chunks through
    the released-style step and through the accelerated instance give the same keep indices, lengths and positions,
    keys and values within tolerance, lazy re-indexing firing in a step."""
    case = Case("llava_ov", dtype, True, "list", chunks=3, heads=2, kv_heads=1, head_dim=512, proportional=True)
    ref, fast, handle, keeps, _ = drive(case, lockstep=dtype == torch.float16)
    assert read_layers(fast.kv_cache)[0][0][0].shape[-1] == 512 and len(keeps) == 2
    assert any(ref.reindexes)


@pytest.mark.parametrize("kind", KINDS)
def test_eager_attention_takes_the_propagated_guidance(kind):
    """With attn_implementation="eager" the released code runs the model with output_attentions=True (hidden states
    propagated, causal); guidance="released" follows it. The twin's cache is a DynamicCache look-alike that the
    guidance forward appends to, as transformers does: the adapter puts it back."""
    case = Case(kind, torch.float32, True, "layered", attn_implementation="eager", seed=1)
    ref, fast, handle, _, _ = drive(case)
    assert handle.guidance_mode() == "propagated"
    assert read_layers(fast.kv_cache)[0][0][0].shape[2] == PREFIX + BUDGET


@pytest.mark.parametrize("guidance,oracle,fast", [("propagated", "eager", "sdpa"), ("embeddings", "sdpa", "eager")])
def test_the_guidance_option_overrides_the_attention_implementation(guidance, oracle, fast):
    case = Case("llava_ov", torch.float32, False, "list", attn_implementation=oracle, fast_attn_implementation=fast,
                seed=1)
    _, _, handle, _, _ = drive(case, guidance=guidance)
    assert handle.guidance_mode() == guidance


def _attention_lists(case, visual, q_lens=(7, 9, 16), seed=5):
    """Random per-layer attention [1, H, q, P + V + q] of the local, global and mixed prompts (softmax rows)."""
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(1, HEADS, q, PREFIX + visual + q, generator=gen).mul(3).softmax(-1) for _ in range(LAYERS)]
            for q in q_lens]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("visual", [64, BUDGET, BUDGET - 1, 12])
def test_the_selection_contract(kind, visual):
    """prune_kv_cache_by_attention: the same per-layer keep indices as the released selection, from the same
    attention lists (V over the budget, at it, one under it, far under it)."""
    case = Case(kind)
    ref, fast = make_instance(case), make_instance(case)
    handle = accelerate(fast)
    lists = _attention_lists(case, visual)
    want = ref.prune_kv_cache_by_attention(*lists, num_keep=BUDGET)
    got = fast.prune_kv_cache_by_attention(*lists, num_keep=BUDGET)
    assert isinstance(got, KeepIndices) and [t.tolist() for t in got] == want
    assert min(ref.boundary_margins) > 1e-5
    assert handle.stats["selections"] == 1


def _two_states(case, chunks=4):
    """The oracle after `chunks` chunks and the accelerated twin holding a copy of its state."""
    ref, fast = make_instance(case), make_instance(case, case.container)
    handle = accelerate(fast)
    grid = GRID if case.kind == "qwen2_5_vl" else None
    for keys, values in list(random_chunks(case))[:chunks]:
        ref.encode_chunk(keys, values, grid)
        ref.predict_and_compress()
    ref.encode_chunk(*next(iter(random_chunks(Case(case.kind, case.dtype, seed=9)))), grid)
    sync(fast, ref)
    return ref, fast, handle


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("streaming", [True, False], ids=["lazy", "eager"])
def test_the_shrink_contract_on_plain_lists(kind, streaming):
    """_shrink_positions_and_rerotate_keys on keep lists as any caller may pass them (shuffled, duplicated, with
    out-of-range entries, which the released code sanitises), and with one layer's positions missing (the released
    code restarts them at 0..L-1): the same cache and positions as the released shrink."""
    case = Case(kind, torch.float32, streaming)
    ref, fast, handle = _two_states(case)
    loc, glo = ref.predict_next_question()
    lists = [ref._compute_attention_scores_manually(ref._ids(t), ref.kv_cache) for t in (loc, glo, loc + "; " + glo)]
    keep = ref.prune_kv_cache_by_attention(*lists, num_keep=BUDGET)
    gen = torch.Generator().manual_seed(3)
    messy = []
    for layer in keep:
        order = torch.randperm(len(layer), generator=gen).tolist()
        messy.append([layer[i] for i in order] + layer[:3] + [-4, 10 ** 6])
    for model in (ref, fast):
        model._position_ids_cache[2] = None
    ref._shrink_positions_and_rerotate_keys(keep)
    fast._shrink_positions_and_rerotate_keys(messy)
    compare(ref, fast, case)
    assert handle.stats["shrinks"] == 1


def test_the_guidance_pass_is_skipped_when_no_compression_follows():
    """A cache no longer than kv_size: no tokenizer call, no forward, nothing changed."""
    case = Case("llava_ov")
    fast = make_instance(case)
    handle = accelerate(fast)
    fast.encode_chunk(*next(iter(random_chunks(case))))
    calls = []
    tokenizer = fast.processor.tokenizer
    fast.processor.tokenizer = lambda text: calls.append(text) or tokenizer(text)
    before = [(k, v) for k, v in fast.kv_cache]
    positions = [p.clone() for p in fast._position_ids_cache]
    assert read_layers(fast.kv_cache)[0][0][0].shape[2] <= fast.kv_size
    fast.predict_and_compress()
    assert calls == [] and handle.stats["guidance_skipped"] == 1 and handle.stats["guidance_passes"] == 0
    assert all(a[0] is b[0] and a[1] is b[1] for a, b in zip(before, fast.kv_cache))
    assert all(torch.equal(a, b) for a, b in zip(positions, fast._position_ids_cache))


def test_the_released_qwen_fp16_softmax_changes_the_pooled_attention_by_fp16_rounding_only():
    """The released Qwen manual path rounds attention probabilities to fp16; the adapter pools in fp32. Their
    pooled attention agrees to fp16 precision (so keep sets can only differ at fp16 near-ties)."""
    case = Case("qwen2_5_vl")
    ref, fast, handle = _two_states(case, chunks=2)
    ref.softmax_dtype = torch.float16
    loc, glo = ref.predict_next_question()
    mixed = ref._compute_attention_scores_manually(ref._ids(loc + "; " + glo), ref.kv_cache)
    got = handle.guidance_attention(loc, glo)
    P, s, e = PREFIX, fast.short_term_threshold, fast.long_term_threshold
    for layer in range(s, e):
        w = mixed[layer]
        want = w[0].float().mean(0)[:, P:w.shape[3] - w.shape[2]].mean(0)
        torch.testing.assert_close(got[layer, 0], want, rtol=2e-3, atol=1e-5)
    assert torch.equal(got[:s], torch.zeros_like(got[:s]))


def test_restore_puts_the_original_methods_back():
    case = Case("qwen2_5_vl")
    model = make_instance(case)
    handle = accelerate(model)
    for name in METHODS.values():
        assert getattr(model, name).__self__ is handle
    assert getattr(model, MARKER) is handle
    handle.restore()
    for name in METHODS.values():
        assert name not in vars(model) and getattr(model, name).__self__ is model
    assert MARKER not in vars(model) and not handle.active
    handle.restore()  # idempotent
    with accelerate(model, parts=("shrink",)) as again:
        assert "_shrink_positions_and_rerotate_keys" in vars(model) and "pseudo_forward" not in vars(model)
        assert again.active
    assert "_shrink_positions_and_rerotate_keys" not in vars(model)


def test_an_instance_attribute_in_the_way_is_put_back():
    model = make_instance(Case("llava_ov"))
    mine = types.MethodType(lambda self, *a: "mine", model)
    model.pseudo_forward = mine
    handle = accelerate(model)
    assert model.pseudo_forward.__self__ is handle
    handle.restore()
    assert model.pseudo_forward is mine


# -- bad instances: a clear error naming what is missing, nothing changed ---------------------------------------

def _untouched(model) -> bool:
    return not any(name in vars(model) for name in (*METHODS.values(), MARKER))


@pytest.mark.parametrize("attribute", ["kv_size", "visual_start_idx", "short_term_threshold", "long_term_threshold",
                                       "streaming", "num_layers", "_position_ids_cache", "language_model",
                                       "apply_kv_cache_pruning_strict", "processor"])
def test_a_missing_attribute_is_named(attribute):
    model = make_instance(Case("llava_ov"))
    if attribute in vars(model):
        delattr(model, attribute)
    else:  # a method: hide it on the instance
        setattr(model, attribute, None)
    name = "processor.tokenizer" if attribute == "processor" else attribute
    with pytest.raises(IncompatibleInstance, match=name):
        accelerate(model)
    if attribute != "apply_kv_cache_pruning_strict":
        assert _untouched(model)


@pytest.mark.parametrize("change,message", [
    (lambda m: setattr(m, "kv_size", 1), "kv_size"),
    (lambda m: setattr(m, "short_term_threshold", 8), "short_term_threshold=8"),
    (lambda m: setattr(m, "_position_ids_cache", [None] * 3), "_position_ids_cache: holds 3"),
    (lambda m: delattr(m.language_model.model.rotary_emb, "inv_freq"), "inv_freq"),
    (lambda m: setattr(m.language_model.config, "num_key_value_heads", 3), "num_key_value_heads"),
])
def test_a_malformed_instance_is_refused(change, message):
    model = make_instance(Case("llava_ov"))
    change(model)
    with pytest.raises(IncompatibleInstance, match=message):
        accelerate(model)
    assert _untouched(model)


def test_a_qwen_kind_needs_the_mrope_section():
    model = make_instance(Case("llava_ov"))
    with pytest.raises(IncompatibleInstance, match="_mrope_section"):
        accelerate(model, kind="qwen2_5_vl")
    qwen = make_instance(Case("qwen2_5_vl"))
    qwen._mrope_section = [2, 3, 4]
    with pytest.raises(IncompatibleInstance, match="_mrope_section.*sums to 9"):
        accelerate(qwen)
    assert _untouched(model) and _untouched(qwen)


def test_bad_arguments_and_a_second_accelerate():
    model = make_instance(Case("llava_ov"))
    with pytest.raises(ValueError, match="guidance"):
        accelerate(model, guidance="paper")
    with pytest.raises(ValueError, match="kind"):
        accelerate(model, kind="qwen3")
    with pytest.raises(ValueError, match="parts"):
        accelerate(model, parts=("shrink", "shrink"))
    with pytest.raises(ValueError, match="backend"):
        accelerate(model, backend="cuda")
    handle = accelerate(model)
    with pytest.raises(IncompatibleInstance, match="already accelerated"):
        accelerate(model)
    handle.restore()
    accelerate(model).restore()


def _state(model):
    pairs, _ = read_layers(model.kv_cache)
    return ([(k.clone(), v.clone()) for k, v in pairs],
            [None if p is None else p.clone() for p in model._position_ids_cache])


def _same_state(model, state) -> bool:
    pairs, _ = read_layers(model.kv_cache)
    return all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(pairs, state[0])) and all(
        (p is None and q is None) or torch.equal(p, q) for p, q in zip(model._position_ids_cache, state[1]))


def _shorter_layer(model):
    model.kv_cache[4] = (model.kv_cache[4][0][:, :, :-1], model.kv_cache[4][1][:, :, :-1])


def _int_cache(model):
    model.kv_cache = [(k.to(torch.int32), v.to(torch.int32)) for k, v in model.kv_cache]


def _matrix_positions(model):
    model._position_ids_cache[3] = model._position_ids_cache[3].view(1, -1)


def _shuffled_positions(model):
    model._position_ids_cache[6] = model._position_ids_cache[6].flip(0)


@pytest.mark.parametrize("break_it,call,message", [
    (_shorter_layer, "pseudo_forward", "different lengths"),
    (_int_cache, "pseudo_forward", "torch.int32"),
    (_matrix_positions, "pseudo_forward", r"_position_ids_cache\[3\]"),
    (_shuffled_positions, "shrink", r"layer\(s\) \[6\].*strictly increasing"),
    (lambda m: None, "shrink_without_prefix", "whole prefix"),
    (lambda m: setattr(m, "allocate_budget_by_depth", lambda total, n: [total - n + 1] + [1] * (n - 1)),
     "pseudo_forward", "allocate_budget_by_depth"),
    (lambda m: setattr(m, "kv_cache", None), "pseudo_forward", "kv_cache: is None"),
])
def test_a_bad_state_at_call_time_is_refused_before_anything_changes(break_it, call, message):
    case = Case("llava_ov")
    model = make_instance(case)
    accelerate(model)
    for keys, values in list(random_chunks(case))[:2]:
        model.encode_chunk(keys, values)
    break_it(model)
    state = _state(model) if model.kv_cache is not None else None
    keep = [list(range(PREFIX + BUDGET - (layer >= model.long_term_threshold))) for layer in range(LAYERS)]
    with pytest.raises(IncompatibleInstance, match=message):
        if call == "pseudo_forward":
            model.pseudo_forward()
        elif call == "shrink":
            model._shrink_positions_and_rerotate_keys(keep)
        else:
            model._shrink_positions_and_rerotate_keys([k[1:] for k in keep])
    assert state is None or _same_state(model, state)


def test_the_prune_contract_refuses_unequal_visual_spans():
    model = make_instance(Case("qwen2_5_vl"))
    accelerate(model)
    lists = _attention_lists(Case("qwen2_5_vl"), 30)
    lists[1][8] = lists[1][8][..., 1:]
    with pytest.raises(IncompatibleInstance, match="interpolates"):
        model.prune_kv_cache_by_attention(*lists, num_keep=BUDGET)


def test_the_standin_rotary_tables_match_a_direct_rotation():
    """The oracle's own rotary helper: rotating by delta through old/new tables is rotating by the delta."""
    model = make_instance(Case("llava_ov"))
    x = torch.randn(1, KV_HEADS, 6, 16, dtype=torch.float64)
    old, new = torch.tensor([3, 9, 40, 41, 100, 7]), torch.tensor([0, 1, 2, 3, 4, 5])
    got = model._rotate(x, old, new)
    angle = (new - old).double()[:, None] * model._rotary().inv_freq.double()
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    torch.testing.assert_close(got, x * cos + rotate_half(x) * sin, atol=1e-5, rtol=1e-5)  # fp32 tables
    assert isinstance(model, ReleasedLLaVAOV) and not isinstance(model, ReleasedQwenVL)
    assert CHUNK > BUDGET - (PREFIX + CHUNK) > 0  # the first chunk stays under the budget, the second goes over


@pytest.mark.parametrize("kind,streaming", [("llava_ov", True), ("qwen2_5_vl", False)])
def test_the_triton_backend_matches_too(kind, streaming):
    """The same stream with every op on the Triton kernels (the interpreter on a CPU-only machine)."""
    case = Case(kind, torch.float32, streaming, "list", chunks=4)
    _, _, handle, keeps, _ = drive(case, backend="triton")
    assert handle.backend == "triton" and len(keeps) == 3

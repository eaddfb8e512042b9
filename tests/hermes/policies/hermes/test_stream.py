"""HERMES through the models, on both tiny families (`tests/hermes/streams.py` CASES): streaming equals one full
forward while nothing is evicted, guidance scores equal eager `output_attentions` pooled by hand, the rotary
correction of compacted keys is exact, memory stays flat over many chunks, and faults on the Triton backend. The
behaviours every policy shares (faults, lockstep, threads, reset, bad input) are tests/hermes/stream/.
"""
import pytest
import torch
from transformers import DynamicCache

from hermes.attention import attention_implementation
from hermes.policies.hermes.guidance import GuidancePlan
from hermes.stream import HermesStream
from scaffolding.census import live_tensors
from hermes_kernels.policies.hermes.config import DEEP
from tests.hermes.stream.policies import POLICIES, assert_same_stream, assert_state, fault
from tests.hermes.streams import (CASES, QUESTION, make_stream, reference_greedy, reference_logits,
                                  reference_sequence, rope_at)
from tests.utils import assert_close_verbose

pytestmark = pytest.mark.usefixtures("single_thread")

HERMES = POLICIES["hermes"]


@pytest.fixture(params=list(CASES))
def case(request):
    return CASES[request.param]


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


def test_guidance_of_the_triton_and_torch_backends_agrees_on_the_cache_views(case):
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
            assert bool(result.reindexed)
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
    assert stats["steps"] >= 56 and stats["reindexes"] >= 2
    assert census[63] == census[15], f"live tensors (count, bytes) grew over 48 steps: {census}"


def test_append_failures_on_the_triton_backend(case, monkeypatch):
    """The faults that reach the kernels, one after the other on one stream whose pooled attention and compression
    run on Triton (the interpreter on CPU, slow: a 2-layer model and one step per stream): the guidance pass failing
    after the kernel wrote its scores, a non-finite score caught by validation, a KeyboardInterrupt in the last
    layer; then both streams take the next chunk with a Triton step and agree bit for bit."""
    g = torch.Generator().manual_seed(32)
    model = case.build(num_layers=2)
    faulty, clean = (make_stream(case, model, budget=64, room=70, backend="triton") for _ in range(2))
    for _ in range(2):
        chunk = case.chunk(1, g)
        for stream in (faulty, clean):
            stream.append_video(**chunk)
    scored = sum(kind is not None for kind in faulty.policy.plan.kind_of_layer)
    for phase, error in (("guidance", torch.OutOfMemoryError), ("scores validation", torch.OutOfMemoryError),
                         ("last layer", KeyboardInterrupt)):
        before = HERMES.state(faulty)
        with fault(model, phase, error, monkeypatch, after=scored - 1 if phase == "guidance" else 0), \
                pytest.raises(ValueError if phase == "scores validation" else error, match="injected|non-finite"):
            faulty.append_video(**case.chunk(1, g))
        assert_state(HERMES, faulty, before)
    chunk = case.chunk(1, g)
    results = [stream.append_video(**chunk) for stream in (faulty, clean)]
    assert results[0] is not None and torch.equal(results[0].keep, results[1].keep)
    assert_same_stream(HERMES, faulty, clean)


def test_a_budget_below_the_summary_slot_is_refused(case):
    """Deep layers give one of their budget's slots to the summary token: a budget of 1 leaves none."""
    with pytest.raises(ValueError, match="budget"):
        make_stream(case, case.build(), budget=1)

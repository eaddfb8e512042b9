"""Guidance fused into the chunk's prefill (docs/hermes.md §4) against the separate guidance pass, on both tiny models.

The fused forward must store the chunk exactly as a plain prefill does (its rows go through their own attention
call), give every prompt the cache and the whole chunk, and keep nothing of the prompts: the pooled attention
then agrees with the separate pass (which runs after the prefill) to float rounding, the keep sets are the same
and the caches are byte-identical after every step.
"""
import pytest
import torch

from tests.hermes.streams import CASES, QUESTION, make_stream
from tests.utils import assert_close_verbose

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(params=list(CASES))
def case(request):
    return CASES[request.param]


def record_steps(stream) -> list:
    """Wrap the stream's `cache.compress` to record (attn copy, result) of every step."""
    steps, compress = [], stream.cache.compress

    def recorded(attn, backend="auto"):
        steps.append([attn.clone()])
        steps[-1].append(compress(attn, backend=backend))
        return steps[-1][1]

    stream.cache.compress = recorded
    return steps


def assert_same_cache(a, b) -> None:
    """Length, step counters and every valid key, value and position bit for bit."""
    assert a.stats() == b.stats()
    for layer in range(a.cfg.num_layers):
        for name in ("keys", "values", "positions"):
            x, y = (getattr(s.cache, f"layer_{name}")(layer) for s in (a, b))
            assert torch.equal(x, y), f"{name} of layer {layer} differ between fused and separate guidance"


def test_fused_guidance_matches_the_separate_pass(case):
    """Two streams in lockstep, fed the same chunks, one fused and one separate: per step the same keep sets,
    pooled attention within float tolerance and byte-identical caches, including steps after a question whose
    answers differ per stream (the guidance prompts then tokenize to different lengths: padded per stream)."""
    g = torch.Generator().manual_seed(21)
    model = case.build()
    fused, separate = (make_stream(case, model, budget=40, batch_size=2, fused_guidance=flag) for flag in (True, False))
    steps = {"fused": record_steps(fused), "separate": record_steps(separate)}
    ragged_steps = 0
    for index in range(7):
        chunk = case.chunk(2, g)
        results = [stream.append_video(**chunk) for stream in (fused, separate)]
        assert (results[0] is None) == (results[1] is None)
        if index == 2:
            questions = [QUESTION, "yes"]
            assert fused.ask(questions, max_new_tokens=3) == separate.ask(questions, max_new_tokens=3)
            prompts = fused.policy.plan.token_ids(fused.tokenizer, fused.last_convs)
            assert [len(p) for p in prompts[0]] != [len(p) for p in prompts[1]], "the prompts should be ragged"
        if results[0] is not None:
            ragged_steps += index > 2
            (attn_f, result_f), (attn_s, result_s) = steps["fused"][-1], steps["separate"][-1]
            assert_close_verbose(attn_f, attn_s, name=f"pooled guidance attention, chunk {index}")
            assert torch.count_nonzero(attn_f) > 0
            assert torch.equal(result_f.keep, result_s.keep), f"keep sets differ at chunk {index}"
            assert bool(result_f.reindexed) == bool(result_s.reindexed)
        assert_same_cache(fused, separate)
    assert len(steps["fused"]) >= 5 and ragged_steps >= 3


def test_one_forward_per_chunk_and_no_lm_head(case):
    """A compressing chunk costs one decoder forward fused, two separate; the LM head never runs for either."""
    g = torch.Generator().manual_seed(22)
    model = case.build()
    calls = {"decoder": 0, "lm_head": 0}
    # pre-hooks: a separate guidance pass stops inside the forward (after its last scored layer)
    hooks = [model.model.language_model.register_forward_pre_hook(
                 lambda *a: calls.__setitem__("decoder", calls["decoder"] + 1)),
             model.lm_head.register_forward_pre_hook(lambda *a: calls.__setitem__("lm_head", calls["lm_head"] + 1))]
    try:
        for fused_guidance, expected in ((True, 1), (False, 2)):
            stream = make_stream(case, model, budget=40, fused_guidance=fused_guidance)
            stream.append_video(**case.chunk(1, g))
            stream.append_video(**case.chunk(1, g))
            calls.update(decoder=0, lm_head=0)
            assert stream.append_video(**case.chunk(1, g)) is not None
            assert calls == {"decoder": expected, "lm_head": 0}, f"fused_guidance={fused_guidance}: {calls}"
    finally:
        for hook in hooks:
            hook.remove()


def test_fused_guidance_on_the_triton_backend(case):
    """The Triton pooled-attention kernel (interpreter on CPU) inside the fused forward, with ragged prompts
    over two streams, gives the torch backend's scores and keep sets; the caches agree to float rounding."""
    g = torch.Generator().manual_seed(23)
    model = case.build()
    streams = {backend: make_stream(case, model, budget=40, batch_size=2, backend=backend)
               for backend in ("torch", "triton")}
    steps = {backend: record_steps(stream) for backend, stream in streams.items()}
    chunks = [case.chunk(2, g) for _ in range(3)]
    for backend, stream in streams.items():
        stream.append_video(**chunks[0])
        stream.last_convs = ["what ? yes", "what is the person holding ? a red cup"]  # ragged prompts
        stream.append_video(**chunks[1])
    (attn_t, result_t), (attn_r, result_r) = steps["triton"][-1], steps["torch"][-1]
    assert_close_verbose(attn_t, attn_r, name="triton vs torch fused guidance")
    assert torch.equal(result_t.keep, result_r.keep)
    for layer in range(streams["torch"].cfg.num_layers):
        assert_close_verbose(streams["triton"].cache.layer_keys(layer), streams["torch"].cache.layer_keys(layer),
                             name=f"keys of layer {layer}")


def test_fused_switch_with_no_prompt_to_run(case):
    """A policy whose every layer has ω = 1 reads no attention: the fused switch then prefills alone and the
    step runs on recency only."""
    g = torch.Generator().manual_seed(24)
    model = case.build()
    stream = make_stream(case, model, budget=40, deep_ratio=0.0, omega0=1.0, gamma=0.0)
    assert stream.policy.plan.kinds == ()
    results = [stream.append_video(**case.chunk(1, g)) for _ in range(3)]
    assert results[-1] is not None and stream.stats()["length"] == stream.cfg.prefix_len + 40


def test_prompt_rows_are_computed_only_while_a_deeper_layer_scores_them():
    """`GuidanceState.read_rows`: a layer computes the rows of the prompts some deeper layer scores, the span over
    streams (ragged prompts included), and none from the last scoring layer on. With LLaVA-OV's plan on 4 layers
    (layer 1 scores the mixed prompt, layers 2-3 the global one), layer 0 runs both prompts, layers 1-2 the global
    one only. The guidance tests against eager attention (tests/hermes/streams.py) check that no needed row is
    dropped."""
    from hermes.policies.hermes.guidance import GuidanceState
    segments = (((0, 42), (42, 62)), ((0, 40), (40, 58)))  # the second stream's prompts tokenize shorter
    state = GuidanceState(stored=32, segments=segments, segment_of_layer=(None, 0, 1, 1), last_layer=3)
    assert [state.read_rows(layer) for layer in range(4)] == [(0, 62), (40, 62), (40, 62), None]
    local_first = GuidanceState(stored=0, segments=(((0, 5), (5, 9), (9, 12)),),
                                segment_of_layer=(0, 0, 1, None, 2), last_layer=4)
    assert [local_first.read_rows(layer) for layer in range(5)] == [(0, 12), (5, 12), (9, 12), (9, 12), None]


def test_guidance_prompts_follow_the_last_conversation(case, monkeypatch):
    """The policy tokenizes the guidance prompts once per change of the streams' last conversations: every
    compressing chunk still runs the prompts of the conversation at that moment (before a question, after one,
    after another, after a reset), on both the fused and the separate path."""
    import hermes.policies.hermes.policy as hs
    g = torch.Generator().manual_seed(24)
    model = case.build()
    real = hs.run_guidance
    for fused_guidance in (True, False):
        stream = make_stream(case, model, budget=40, batch_size=2, fused_guidance=fused_guidance)
        seen = []
        monkeypatch.setattr(hs, "run_guidance", lambda *a, **k: seen.append(a[3]) or real(*a, **k))
        wanted = []
        for index in range(9):
            if index in (3, 5):
                stream.ask([QUESTION, "yes"] if index == 3 else ["yes", QUESTION], max_new_tokens=2)
            if index == 7:
                stream.reset()
            before = len(seen)
            stream.append_video(**case.chunk(2, g))
            if len(seen) > before:
                wanted.append(stream.policy.plan.token_ids(stream.tokenizer, stream.last_convs))
        assert len(seen) >= 4 and seen == wanted
        assert len({str(ids) for ids in seen}) >= 3, "the questions should change the prompts"

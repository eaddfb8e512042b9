"""Failure atomicity of HermesStream under every policy: an exception in any phase of `append_video`, `ask`,
`next_token_logits` or `guidance_scores` leaves the stream as it was, and it then goes on exactly like a stream
that never saw the call.

Faults are injected with hooks and patches (nothing in the library knows about them; `policies.fault`): the vision
tower, decoder layer 0 before its cache write, the last decoder layer after its cache write (the counters have
moved by then), HERMES's pooled guidance attention (inside the fused prefill, after the chunk's last cache write,
or in the separate pass), and the step's own validation (non-finite scores for HERMES, non-finite arriving values
of an H2SVC episodic head). The raised errors are torch.OutOfMemoryError (what a CUDA OOM raises) and
KeyboardInterrupt; validation raises its own ValueError. Each faulty stream is compared with a clean stream that
never received the failed call. A failure while the step is rewriting the cache cannot be undone: the cache is
then `undefined` until `reset()`.
"""
import pytest
import torch

from hermes.cache import StreamCacheBase
from tests.hermes.stream.policies import (ERRORS, POLICIES, assert_same_stream, assert_state, fault, warmed_pair)
from tests.hermes.streams import QUESTION

pytestmark = pytest.mark.usefixtures("single_thread")

POLICY_FAULTS = [pytest.param(POLICIES[name], f, id=f"{name}-{f.id}") for name in POLICIES
                 for f in POLICIES[name].faults]


def scored_layers(stream) -> int:
    """Layers whose guidance score a HERMES step reads (the guidance fault fails at the last of them)."""
    return sum(kind is not None for kind in stream.policy.plan.kind_of_layer)


@pytest.mark.parametrize("policy,injected", POLICY_FAULTS)
def test_append_failure_leaves_the_stream_as_it_was(case, policy, injected, monkeypatch):
    """A chunk that would run the policy's step fails in `injected.phase`: the stream is as it was, equal to a
    clean stream that never saw the chunk, and both then take three more chunks with the same step results.
    (room=70 for HERMES reproduces a bug once fixed: with the failed chunk left appended, every later chunk ran out
    of room.)"""
    g = torch.Generator().manual_seed(31)
    model = case.build()
    faulty, clean = warmed_pair(policy, case, model, g, **policy.fault_kwargs, **injected.stream_kwargs)
    before = policy.state(faulty)
    after = scored_layers(faulty) - 1 if injected.phase == "guidance" else 0
    with fault(model, injected.phase, injected.error, monkeypatch, after=after), \
            pytest.raises(injected.error, match="injected|non-finite"):
        faulty.append_video(**case.chunk(1, g))
    assert_state(policy, faulty, before)
    assert_same_stream(policy, faulty, clean)
    for index in range(3):
        clip = case.chunk(1, g)
        results = [stream.append_video(**clip) for stream in (faulty, clean)]
        assert results[0] is not None and policy.same_result(*results)
        if index == 0:
            assert_same_stream(policy, faulty, clean)
    assert_same_stream(policy, faulty, clean)


@pytest.mark.parametrize("error", list(ERRORS))
def test_question_failures_leave_the_stream_as_it_was(case, policy, error, monkeypatch):
    """`ask` failing in a decode step (its question already stored), `next_token_logits` failing in a layer and,
    for HERMES, `guidance_scores` failing in the pooled attention: each leaves the stream as it was (history
    included), and the next question gets the answer a stream that never failed gives. Ragged questions over two
    streams, so the padding context is torn down too (a hybrid model, which refuses ragged batches: the same
    question twice)."""
    g = torch.Generator().manual_seed(33)
    model = case.build()
    faulty, clean = (policy.stream(case, model, batch_size=2) for _ in range(2))
    for _ in range(3):
        clip = case.chunk(2, g)
        for stream in (faulty, clean):
            stream.append_video(**clip)
    questions = [QUESTION, QUESTION if case.linear or case.windows else "yes"]
    for stream in (faulty, clean):
        stream.ask(questions, max_new_tokens=2)
    error = ERRORS[error]
    calls = [("last layer", 1, lambda: faulty.ask(questions, max_new_tokens=4)),  # the first decode step fails
             ("first layer", 0, lambda: faulty.next_token_logits(questions))]
    if policy.guidance:
        calls.append(("guidance", 0, lambda: faulty.guidance_scores()))
    for phase, after, call in calls:
        before = policy.state(faulty)
        with fault(model, phase, error, monkeypatch, after=after), pytest.raises(error, match="injected"):
            call()
        assert_state(policy, faulty, before)
        assert_same_stream(policy, faulty, clean)
    assert faulty.ask(questions, max_new_tokens=4) == clean.ask(questions, max_new_tokens=4)
    clip = case.chunk(2, g)
    for stream in (faulty, clean):
        stream.append_video(**clip)
    assert_same_stream(policy, faulty, clean)


def test_failure_inside_the_step_writes_needs_a_reset(case, policy, monkeypatch):
    """An exception escaping the in-place step after it began rewriting the cache (a device error mid-write)
    cannot be rolled back: the cache says `undefined`, every call and a direct forward raise until reset(), and
    after reset() the stream is a fresh one in the same buffers."""
    g = torch.Generator().manual_seed(34)
    model = case.build()
    stream = policy.stream(case, model)
    stream.append_video(**case.chunk(1, g))
    ptrs = stream.cache.data_ptrs()
    with policy.step_fails(monkeypatch), pytest.raises(torch.OutOfMemoryError, match="injected"):
        stream.append_video(**case.chunk(1, g))
    assert stream.cache.undefined
    for call in (lambda: stream.append_video(**case.chunk(1, g)), lambda: stream.ask(QUESTION, max_new_tokens=2),
                 lambda: stream.next_token_logits(QUESTION), lambda: stream.guidance_scores()):
        with pytest.raises(RuntimeError, match="reset"):
            call()
    # the cache itself, behind the front: a direct forward and a direct step name what failed
    refused = rf"{type(stream.cache).__name__}: a failed {policy.failed_step} left the cache undefined; call reset"
    with pytest.raises(RuntimeError, match=refused), torch.no_grad():
        stream.language_model(input_ids=torch.tensor([[3, 4]]), cache=stream.cache, use_cache=True)
    with pytest.raises(RuntimeError, match=refused):
        policy.direct_step(stream.cache)
    stream.reset()
    assert stream.cache.data_ptrs() == ptrs and not stream.cache.undefined
    fresh = policy.stream(case, model)
    for _ in range(3):
        clip = case.chunk(1, g)
        for s in (stream, fresh):
            s.append_video(**clip)
    assert_same_stream(policy, stream, fresh)


def test_an_interrupt_after_a_completed_step_keeps_the_stepped_cache(case, policy, monkeypatch):
    """An exception raised right after the in-place step has finished (inside the call, before it returns) cannot
    undo the step: the cache keeps the stepped state — counters and slots agree, equal to a stream whose call went
    through — and takes the next chunks like it."""
    g = torch.Generator().manual_seed(36)
    model = case.build()
    faulty, clean = warmed_pair(policy, case, model, g, **policy.fault_kwargs)
    finish = StreamCacheBase._step_in_place

    def then_interrupt(cache, step):
        finish(cache, step)
        raise KeyboardInterrupt("injected after the step")

    clip = case.chunk(1, g)
    with monkeypatch.context() as patch:
        patch.setattr(StreamCacheBase, "_step_in_place", then_interrupt)
        with pytest.raises(KeyboardInterrupt, match="injected"):
            faulty.append_video(**clip)
    assert clean.append_video(**clip) is not None
    assert not faulty.cache.undefined
    assert_same_stream(policy, faulty, clean)
    for _ in range(2):
        clip = case.chunk(1, g)
        results = [stream.append_video(**clip) for stream in (faulty, clean)]
        assert policy.same_result(*results)
    assert_same_stream(policy, faulty, clean)


def test_interrupted_reset_is_reported(case, policy, monkeypatch):
    """A reset() whose prefix prefill fails leaves no prefix: calls say so and a second reset() recovers."""
    g = torch.Generator().manual_seed(35)
    model = case.build()
    stream = policy.stream(case, model)
    with fault(model, "first layer", KeyboardInterrupt, monkeypatch), pytest.raises(KeyboardInterrupt):
        stream.reset()
    with pytest.raises(RuntimeError, match="prefix"):
        stream.append_video(**case.chunk(1, g))
    stream.reset()
    assert stream.stats()["length"] == stream.cfg.prefix_len
    stream.append_video(**case.chunk(1, g))


def test_a_direct_forward_failing_in_a_middle_layer_leaves_the_cache(case, policy):
    """The cache used without the front (as any transformers Cache): a text forward that raises in a middle layer,
    after the earlier layers stored their tokens, leaves its length and valid slots as they were (the length moves
    only once the last layer has stored), and the stream then goes on like a clean one."""
    g = torch.Generator().manual_seed(36)
    model = case.build()
    faulty, clean = warmed_pair(policy, case, model, g, **policy.fault_kwargs)
    before = policy.state(faulty)
    layers = faulty.language_model.layers

    def fail(module, args):
        raise RuntimeError("injected in a middle layer")

    handle = layers[len(layers) // 2].register_forward_pre_hook(fail)
    try:
        with pytest.raises(RuntimeError, match="injected"), torch.no_grad():
            faulty.language_model(input_ids=torch.tensor([[3, 4, 5]] * faulty.batch_size), cache=faulty.cache,
                                  use_cache=True)
    finally:
        handle.remove()
    assert_state(policy, faulty, before)
    clip = case.chunk(1, g)
    assert policy.same_result(*(stream.append_video(**clip) for stream in (faulty, clean)))
    assert_same_stream(policy, faulty, clean)

"""Failure atomicity of HermesStream: an exception in any phase of `append_video`, `ask`, `next_token_logits` or
`guidance_scores` leaves the stream as it was, and it then goes on exactly like a stream that never saw the call.

Faults are injected with hooks and patches (nothing in the library knows about them):
  vision      the vision tower raises while encoding the chunk;
  first layer decoder layer 0 raises before its cache write;
  last layer  the last decoder layer raises after its cache write (the length has moved by then);
  guidance    the pooled guidance attention of the last scored layer raises (inside the fused prefill, after
              the chunk's last cache write, or in the separate pass);
  validation  the pooled attention comes back non-finite: `HermesCache.compress` rejects it before writing.
The raised errors are torch.OutOfMemoryError (what a CUDA OOM raises) and KeyboardInterrupt; validation raises its
own ValueError. Each faulty stream is compared with a clean stream that never received the failed chunk: same
state right after the failure, then the same keep sets, caches byte for byte and logits after the next chunk.
A failure while the compaction is moving rows cannot be undone: the cache is then `undefined` until `reset()`.
"""
import contextlib
import importlib

import pytest
import torch

import hermes_kernels as hk
from tests.hermes.streams import CASES, QUESTION, make_stream, snapshot

pytestmark = pytest.mark.usefixtures("single_thread")

COMPACT = importlib.import_module("hermes_kernels.policies.hermes.compaction")  # the module (hk.compact is the op)
PHASES = ("vision", "first layer", "last layer", "guidance", "validation")
ERRORS = {"oom": torch.OutOfMemoryError, "interrupt": KeyboardInterrupt}


@pytest.fixture(params=list(CASES))
def case(request):
    return CASES[request.param]


def vision_tower(model):
    return getattr(model.model, "vision_tower", None) or model.model.visual


@contextlib.contextmanager
def fault(model, phase: str, error: type, monkeypatch, after: int = 0):
    """Make `phase` fail with `error` (a non-finite pooled attention for "validation") on its (after + 1)-th run."""
    runs = [0]

    def raiser(*args, **kwargs):
        runs[0] += 1
        if runs[0] > after:
            raise error(f"injected into {phase}")

    layers = model.model.language_model.layers
    hooks, pooled = [], hk.pooled_attention
    with monkeypatch.context() as patch:
        if phase == "vision":
            hooks.append(vision_tower(model).register_forward_pre_hook(raiser))
        elif phase == "first layer":
            hooks.append(layers[0].register_forward_pre_hook(raiser))
        elif phase == "last layer":
            hooks.append(layers[-1].mlp.register_forward_pre_hook(raiser))
        elif phase == "guidance":
            # the kernel runs and writes its scores, then the pass fails (as a later layer would)
            patch.setattr(hk, "pooled_attention", lambda *a, **k: (pooled(*a, **k), raiser())[0])
        elif phase == "validation":
            patch.setattr(hk, "pooled_attention", lambda *a, **k: pooled(*a, **k).fill_(float("nan")))
        else:
            raise ValueError(phase)
        try:
            yield
        finally:
            for hook in hooks:
                hook.remove()


def state(stream) -> tuple:
    """Everything a failed call must leave as it was."""
    return snapshot(stream), stream.stats(), list(stream.last_convs), stream.last_step


def assert_state(stream, before: tuple) -> None:
    (length, *tensors), stats, convs, last_step = before
    (now_length, *now_tensors), now_stats, now_convs, now_step = state(stream)
    assert (now_length, now_stats, now_convs) == (length, stats, convs)
    assert now_step is last_step
    for name, a, b in zip(("keys", "values", "positions"), now_tensors, tensors):
        for layer, (x, y) in enumerate(zip(a, b)):
            assert torch.equal(x, y), f"{name} of layer {layer} changed"


def assert_same_stream(a, b) -> None:
    assert a.stats() == b.stats() and a.last_convs == b.last_convs
    for layer in range(a.cfg.num_layers):
        for name in ("keys", "values", "positions"):
            x, y = (getattr(s.cache, f"layer_{name}")(layer) for s in (a, b))
            assert torch.equal(x, y), f"{name} of layer {layer} differ from the stream that never failed"
    assert torch.equal(a.next_token_logits(QUESTION), b.next_token_logits(QUESTION))


def fail_then_continue(case, model, faulty, clean, phase, error, monkeypatch, g) -> None:
    """`faulty` fails on a chunk that would trigger a step; `clean` never sees it; both take the next one."""
    before = state(faulty)
    expected = ValueError if phase == "validation" else error
    # the guidance pass fails at its last scored layer: fused, the chunk is in the cache by then
    after = sum(kind is not None for kind in faulty.policy.plan.kind_of_layer) - 1 if phase == "guidance" else 0
    with fault(model, phase, error, monkeypatch, after=after), pytest.raises(expected, match="injected|non-finite"):
        faulty.append_video(**case.chunk(1, g))
    assert_state(faulty, before)
    assert_same_stream(faulty, clean)
    chunk = case.chunk(1, g)
    results = [stream.append_video(**chunk) for stream in (faulty, clean)]
    assert results[0] is not None and torch.equal(results[0].keep, results[1].keep)
    assert_same_stream(faulty, clean)


# every phase with both errors, fused; the separate guidance pass adds a second forward after the prefill, so the
# phases from the last layer on also run with it (vision and layer 0 fail the same forward either way)
MATRIX = [(phase, error, mode) for phase in PHASES for error in ERRORS for mode in ("fused", "separate")
          if (phase != "validation" or error == "oom")
          and (mode == "fused" or phase in ("last layer", "guidance", "validation"))]


# room=70 reproduces a bug once fixed: with the failed chunk left appended, every later chunk ran out of room
@pytest.mark.parametrize("phase,error,mode", MATRIX)
def test_append_failure_leaves_the_stream_as_it_was(case, phase, error, mode, monkeypatch):
    g = torch.Generator().manual_seed(31)
    model = case.build()
    faulty, clean = (make_stream(case, model, budget=64, room=70, fused_guidance=mode == "fused")
                     for _ in range(2))
    for _ in range(2):  # exactly the budget: the next chunk triggers guidance and a step
        chunk = case.chunk(1, g)
        for stream in (faulty, clean):
            assert stream.append_video(**chunk) is None
    fail_then_continue(case, model, faulty, clean, phase, ERRORS[error], monkeypatch, g)
    for _ in range(2):
        chunk = case.chunk(1, g)
        assert faulty.append_video(**chunk) is not None and clean.append_video(**chunk) is not None
    assert_same_stream(faulty, clean)


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
    for phase, error in (("guidance", torch.OutOfMemoryError), ("validation", torch.OutOfMemoryError),
                         ("last layer", KeyboardInterrupt)):
        before = state(faulty)
        with fault(model, phase, error, monkeypatch, after=scored - 1 if phase == "guidance" else 0), \
                pytest.raises(ValueError if phase == "validation" else error, match="injected|non-finite"):
            faulty.append_video(**case.chunk(1, g))
        assert_state(faulty, before)
    chunk = case.chunk(1, g)
    results = [stream.append_video(**chunk) for stream in (faulty, clean)]
    assert results[0] is not None and torch.equal(results[0].keep, results[1].keep)
    assert_same_stream(faulty, clean)


@pytest.mark.parametrize("error", list(ERRORS))
def test_question_failures_leave_the_stream_as_it_was(case, error, monkeypatch):
    """`ask` failing in a decode step (its question already stored), `next_token_logits` failing in a layer and
    `guidance_scores` failing in the pooled attention: each leaves the stream as it was (history included),
    and the next question gets the answer a stream that never failed gives. Ragged questions over two streams,
    so the padding context is torn down too."""
    g = torch.Generator().manual_seed(33)
    model = case.build()
    faulty, clean = (make_stream(case, model, budget=40, batch_size=2) for _ in range(2))
    for _ in range(3):
        chunk = case.chunk(2, g)
        for stream in (faulty, clean):
            stream.append_video(**chunk)
    questions = [QUESTION, "yes"]
    for stream in (faulty, clean):
        stream.ask(questions, max_new_tokens=2)
    error = ERRORS[error]
    calls = [
        ("last layer", 1, lambda: faulty.ask(questions, max_new_tokens=4)),  # the first decode step fails
        ("first layer", 0, lambda: faulty.next_token_logits(questions)),
        ("guidance", 0, lambda: faulty.guidance_scores()),
    ]
    for phase, after, call in calls:
        before = state(faulty)
        with fault(model, phase, error, monkeypatch, after=after), pytest.raises(error, match="injected"):
            call()
        assert_state(faulty, before)
        assert_same_stream(faulty, clean)
    assert faulty.ask(questions, max_new_tokens=4) == clean.ask(questions, max_new_tokens=4)
    chunk = case.chunk(2, g)
    for stream in (faulty, clean):
        stream.append_video(**chunk)
    assert_same_stream(faulty, clean)


def test_failure_inside_the_compaction_needs_a_reset(case, monkeypatch):
    """An exception escaping the compaction after it moved rows (a device error mid-write) cannot be rolled back:
    the cache says `undefined`, every call raises until reset(), and after reset() the stream is a fresh one."""
    g = torch.Generator().manual_seed(34)
    model = case.build()
    stream = make_stream(case, model, budget=40)
    stream.append_video(**case.chunk(1, g))
    compact = COMPACT.compact_torch

    def fails_after_writing(*args, **kwargs):
        compact(*args, **kwargs)
        raise torch.OutOfMemoryError("injected after the rows moved")

    with monkeypatch.context() as patch:
        patch.setattr(COMPACT, "compact_torch", fails_after_writing)
        with pytest.raises(torch.OutOfMemoryError):
            stream.append_video(**case.chunk(1, g))
    assert stream.cache.undefined
    for call in (lambda: stream.append_video(**case.chunk(1, g)), lambda: stream.ask(QUESTION, max_new_tokens=2),
                 lambda: stream.next_token_logits(QUESTION), lambda: stream.guidance_scores()):
        with pytest.raises(RuntimeError, match="reset"):
            call()
    with pytest.raises(RuntimeError, match="reset"), torch.no_grad():  # a direct forward with the cache too
        stream.language_model(input_ids=torch.tensor([[3, 4]]), cache=stream.cache, use_cache=True)
    stream.reset()
    fresh = make_stream(case, model, budget=40)
    for _ in range(3):
        chunk = case.chunk(1, g)
        for s in (stream, fresh):
            s.append_video(**chunk)
    assert_same_stream(stream, fresh)


def test_interrupted_reset_is_reported(case, monkeypatch):
    """A reset() whose prefix prefill fails leaves no prefix: calls say so and a second reset() recovers."""
    g = torch.Generator().manual_seed(35)
    model = case.build()
    stream = make_stream(case, model, budget=40)
    with fault(model, "first layer", KeyboardInterrupt, monkeypatch), pytest.raises(KeyboardInterrupt):
        stream.reset()
    with pytest.raises(RuntimeError, match="prefix"):
        stream.append_video(**case.chunk(1, g))
    stream.reset()
    assert stream.stats()["length"] == stream.cfg.prefix_len
    stream.append_video(**case.chunk(1, g))

"""Two streams on one model driven from two threads at once give the answers they give one after the other.

The attention function finds its cache through the tensor `cache.update` just returned (`claim_update`), kept
per thread. To make sure the threads really interleave where a shared hand-off would mix them up, the first
forwards meet at a barrier between each layer's cache write and its attention call: both threads have written
before either claims. A process-wide hand-off then gives one thread the other's keys (or none) and its results
go wrong; the per-thread one keeps both right. After the barrier phase the threads run freely.
"""
import pytest
import torch

from tests.hermes.streams import CASES, QUESTION, make_stream, run_in_two_threads

pytestmark = pytest.mark.usefixtures("single_thread")

CHUNKS = 5
ASK_AT = 2


@pytest.fixture(params=list(CASES))
def case(request):
    return CASES[request.param]


def drive(stream, chunks, question) -> dict:
    """Everything observable from one stream's run: step results, an answer, final logits and cache."""
    out = {"keep": [], "answers": []}
    for index, chunk in enumerate(chunks):
        result = stream.append_video(**chunk)
        out["keep"].append(None if result is None else result.keep.clone())
        if index == ASK_AT:
            out["answers"].append(stream.ask(question, max_new_tokens=4))
    out["logits"] = stream.next_token_logits(question)
    out["cache"] = [(stream.cache.layer_keys(l).clone(), stream.cache.layer_positions(l).clone())
                    for l in range(stream.cfg.num_layers)]
    return out


def assert_same_run(a: dict, b: dict, name: str) -> None:
    assert a["answers"] == b["answers"], name
    assert all((x is None and y is None) or torch.equal(x, y) for x, y in zip(a["keep"], b["keep"])), name
    assert torch.equal(a["logits"], b["logits"]), name
    for layer, ((ka, pa), (kb, pb)) in enumerate(zip(a["cache"], b["cache"])):
        assert torch.equal(ka, kb) and torch.equal(pa, pb), f"{name}: layer {layer}"


def test_two_threads_two_streams_one_model(case, monkeypatch):
    g = torch.Generator().manual_seed(51)
    model = case.build()
    chunks = [[case.chunk(1, g) for _ in range(CHUNKS)] for _ in range(2)]
    questions = [QUESTION, "yes"]
    one_after_other = [drive(make_stream(case, model, budget=40), chunks[i], questions[i]) for i in range(2)]

    streams = [make_stream(case, model, budget=40) for _ in range(2)]
    meetings = 2 * streams[0].cfg.num_layers  # the first two forwards of each thread, every layer
    results = run_in_two_threads(monkeypatch, lambda stream, i: drive(stream, chunks[i], questions[i]), streams,
                                 meetings)
    for index in range(2):
        assert_same_run(results[index], one_after_other[index], f"stream {index}")

"""Two streams of one policy on one model driven from two threads at once give what they give one after the other.

The attention function finds its cache through the tensor `cache.update` just returned (`claim_update`), kept
per thread. To make sure the threads really interleave where a shared hand-off would mix them up, the first
forwards meet at a barrier between each layer's cache write and its attention call: both threads have written
before either claims. A process-wide hand-off then gives one thread the other's keys (or none) and its results
go wrong; the per-thread one keeps both right. After the barrier phase the threads run freely.
"""
import pytest
import torch

from tests.hermes.streams import QUESTION, run_in_two_threads
from tests.utils import same_bytes

pytestmark = pytest.mark.usefixtures("single_thread")

CHUNKS = 5
ASK_AT = 2


def drive(policy, stream, chunks, question) -> dict:
    """Everything observable from one stream's run: step results, an answer, final logits and valid slots."""
    out = {"steps": [], "answers": []}
    for index, chunk in enumerate(chunks):
        out["steps"].append(stream.append_video(**chunk))
        if index == ASK_AT:
            out["answers"].append(stream.ask(question, max_new_tokens=4))
    out["logits"] = stream.next_token_logits(question)
    out["cache"] = policy.state(stream)
    return out


def assert_same_run(policy, a: dict, b: dict, name: str) -> None:
    assert a["answers"] == b["answers"], name
    assert all(policy.same_result(x, y) for x, y in zip(a["steps"], b["steps"])), name
    assert torch.equal(a["logits"], b["logits"]), name
    (host_a, _, tensors_a), (host_b, _, tensors_b) = a["cache"], b["cache"]
    assert host_a == host_b, name
    for group, (xs, ys) in enumerate(zip(tensors_a, tensors_b)):
        assert all(same_bytes(x, y) for x, y in zip(xs, ys)), f"{name}: tensor group {group}"


def test_two_threads_two_streams_one_model(case, policy, monkeypatch):
    g = torch.Generator().manual_seed(51)
    model = case.build()
    chunks = [[case.chunk(1, g) for _ in range(CHUNKS)] for _ in range(2)]
    questions = [QUESTION, "yes"]
    one_after_other = [drive(policy, policy.stream(case, model), chunks[i], questions[i]) for i in range(2)]

    streams = [policy.stream(case, model) for _ in range(2)]
    meetings = 2 * streams[0].cfg.num_layers  # the first two forwards of each thread, every layer
    results = run_in_two_threads(monkeypatch, lambda stream, i: drive(policy, stream, chunks[i], questions[i]),
                                 streams, meetings)
    for index in range(2):
        assert_same_run(policy, results[index], one_after_other[index], f"stream {index}")

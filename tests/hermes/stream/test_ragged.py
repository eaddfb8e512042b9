"""Ragged question batches: streams in lockstep asked questions of different token lengths.

The batch is left-padded to the longest question; every stream's real tokens take the positions they would
take alone (from its next position on) and the padding slots are hidden from every query of the question's
prefill and of every decode step. So each stream's logits and greedy answer equal that stream asked alone.
"""
import pytest
import torch

from tests.hermes.streams import CASES, QUESTION, make_stream
from tests.utils import assert_close_verbose

pytestmark = pytest.mark.usefixtures("single_thread")

QUESTIONS = ["yes", QUESTION + " where is the red cup ?"]


@pytest.fixture(params=list(CASES))
def case(request):
    return CASES[request.param]


def lockstep_and_alone(case, model, chunks):
    """A two-stream batch and two single streams fed the same clips (with compressions on the way)."""
    batch = make_stream(case, model, budget=40, batch_size=2)
    alone = [make_stream(case, model, budget=40) for _ in range(2)]
    for pair in chunks:
        batch.append_video(**dict(pair[0], video=torch.cat([pair[0]["video"], pair[1]["video"]])))
        for b, stream in enumerate(alone):
            stream.append_video(**pair[b])
    return batch, alone


def test_ragged_batch_matches_each_stream_alone(case):
    """Logits, greedy answers, history and the caches after more chunks (whose guidance prompts are then ragged
    too) equal those of each stream run alone."""
    g = torch.Generator().manual_seed(41)
    model = case.build()
    chunks = [[case.chunk(1, g) for _ in range(2)] for _ in range(3)]
    batch, alone = lockstep_and_alone(case, model, chunks)
    assert batch.stats()["steps"] >= 1
    lengths = [len(batch._encode(batch.family.question_text(q))) for q in QUESTIONS]
    assert lengths[0] < lengths[1], lengths
    length = batch.cache.length
    logits = batch.next_token_logits(QUESTIONS)
    for b, stream in enumerate(alone):
        assert_close_verbose(logits[b], stream.next_token_logits(QUESTIONS[b])[0], name=f"logits of stream {b}")
    answers = batch.ask(QUESTIONS, max_new_tokens=6)
    assert answers == [stream.ask(QUESTIONS[b], max_new_tokens=6) for b, stream in enumerate(alone)]
    assert batch.cache.length == length and batch.cache.hidden_keys() is None
    assert batch.last_convs == [stream.last_convs[0] for stream in alone]
    for _ in range(2):
        pair = [case.chunk(1, g) for _ in range(2)]
        batch.append_video(**dict(pair[0], video=torch.cat([pair[0]["video"], pair[1]["video"]])))
        for b, stream in enumerate(alone):
            stream.append_video(**pair[b])
    for b, stream in enumerate(alone):
        for layer in range(batch.cfg.num_layers):
            assert torch.equal(batch.cache.layer_positions(layer)[b], stream.cache.layer_positions(layer)[0])
            assert_close_verbose(batch.cache.layer_keys(layer)[b], stream.cache.layer_keys(layer)[0],
                                 name=f"keys of layer {layer}, stream {b}")
        assert_close_verbose(batch.next_token_logits(QUESTIONS)[b], stream.next_token_logits(QUESTIONS[b])[0],
                             name=f"logits of stream {b} after more chunks")


def step_logits(stream, questions, new_tokens: int) -> list[torch.Tensor]:
    """The LM head's output [B, vocab] of every forward of one `ask` (its prefill, then each decode step)."""
    seen = []
    hook = stream.model.lm_head.register_forward_hook(lambda module, args, out: seen.append(out[:, -1].clone()))
    try:
        stream.ask(questions, max_new_tokens=new_tokens, eos_token_id=None)  # no early stop: every step runs
    finally:
        hook.remove()
    assert len(seen) == new_tokens
    return seen


def test_padding_is_hidden_in_every_decode_step(case):
    """The short question's stream decodes next to its padding for every step: the logits of each step equal
    those of the stream asked alone."""
    g = torch.Generator().manual_seed(42)
    model = case.build()
    chunks = [[case.chunk(1, g) for _ in range(2)] for _ in range(2)]
    batch, alone = lockstep_and_alone(case, model, chunks)
    steps = step_logits(batch, QUESTIONS, 5)
    for b, stream in enumerate(alone):
        for index, (got, expected) in enumerate(zip(steps, step_logits(stream, QUESTIONS[b], 5))):
            assert_close_verbose(got[b], expected[0], name=f"stream {b}, forward {index} of the answer")

"""Streams in lockstep under every policy: a batch of two streams ends with the cache, step results and answers each
stream gets alone, with the same question for both and with questions of different token lengths.

A ragged question batch is left-padded to the longest question; every stream's real tokens take the positions they
would take alone (from its next position on) and the padding slots are hidden from every query of the question's
prefill and of every decode step. So each stream's logits and greedy answer equal that stream asked alone. A hybrid
model (Qwen3.5) refuses a ragged batch, leaving the stream as it was: padding would run through its linear layers.
"""
import pytest
import torch

from tests.hermes.stream.policies import assert_state, lockstep_and_alone, stacked
from tests.hermes.streams import QUESTION
from tests.utils import assert_close_verbose

pytestmark = pytest.mark.usefixtures("single_thread")

QUESTIONS = ["yes", QUESTION + " where is the red cup ?"]


def refused_on_hybrid(case, policy, batch) -> bool:
    """On a hybrid model: every way of asking QUESTIONS raises ValueError naming `question` before any forward and
    leaves the stream as it was (True: the caller's checks do not apply); False elsewhere."""
    if not (case.linear or case.windows):
        return False
    before = policy.state(batch)
    for ask in (batch.next_token_logits, batch.ask):
        with pytest.raises(ValueError, match="question: .*hybrid"):
            ask(QUESTIONS)
    assert_state(policy, batch, before)
    return True


def test_lockstep_batch_matches_streams_alone(case, policy):
    """Two streams in lockstep end with the cache, steps and answers each would get alone, including after a
    question whose answers differ (HERMES's guidance prompts then differ per stream)."""
    g = torch.Generator().manual_seed(6)
    model = case.build()
    batch = policy.stream(case, model, batch_size=2)
    alone = [policy.stream(case, model) for _ in range(2)]
    for step in range(5):
        pair = [case.chunk(1, g) for _ in range(2)]
        # one clip per stream: pixel values stack along the batch; the grid and timing are shared
        batch.append_video(**stacked(pair))
        for b, stream in enumerate(alone):
            stream.append_video(**pair[b])
        if step == 2:
            answers = batch.ask(QUESTION, max_new_tokens=4)
            assert answers == [stream.ask(QUESTION, max_new_tokens=4) for stream in alone]
    assert batch.stats()["steps"] >= 3
    for b, stream in enumerate(alone):
        policy.same_rows(batch, stream, b, 0)
        assert_close_verbose(batch.next_token_logits(QUESTION)[b], stream.next_token_logits(QUESTION)[0],
                             name="logits")


def test_ragged_batch_matches_each_stream_alone(case, policy):
    """Logits, greedy answers, history and the caches after more chunks (HERMES: whose guidance prompts are then
    ragged too) equal those of each stream run alone; the policy's own lockstep check holds (H2SVC: STCE kept
    different frames in different rows and streams)."""
    g = torch.Generator().manual_seed(41)
    model = case.build()
    clips = [[case.chunk(1, g) for _ in range(2)] for _ in range(3)]
    batch, alone = lockstep_and_alone(policy, case, model, clips)
    assert batch.stats()["steps"] >= 1
    if refused_on_hybrid(case, policy, batch):
        return
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
        batch.append_video(**stacked(pair))
        for b, stream in enumerate(alone):
            stream.append_video(**pair[b])
    for b, stream in enumerate(alone):
        policy.same_rows(batch, stream, b, 0)
        assert_close_verbose(batch.next_token_logits(QUESTIONS)[b], stream.next_token_logits(QUESTIONS[b])[0],
                             name=f"logits of stream {b} after more chunks")
    if policy.check_lockstep is not None:
        policy.check_lockstep(batch, alone)
    assert batch.ask(QUESTIONS, max_new_tokens=5) == [s.ask(QUESTIONS[b], max_new_tokens=5)
                                                      for b, s in enumerate(alone)]


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


def test_padding_is_hidden_in_every_decode_step(case, policy):
    """The short question's stream decodes next to its padding for every step: the logits of each step equal
    those of the stream asked alone."""
    g = torch.Generator().manual_seed(42)
    model = case.build()
    clips = [[case.chunk(1, g) for _ in range(2)] for _ in range(2)]
    batch, alone = lockstep_and_alone(policy, case, model, clips)
    if refused_on_hybrid(case, policy, batch):
        return
    steps = step_logits(batch, QUESTIONS, 5)
    for b, stream in enumerate(alone):
        for index, (got, expected) in enumerate(zip(steps, step_logits(stream, QUESTIONS[b], 5))):
            assert_close_verbose(got[b], expected[0], name=f"stream {b}, forward {index} of the answer")


def test_pad_token_id_zero_pads_and_ends_the_answers(case, policy):
    """A tokenizer whose pad token has id 0 pads ragged questions with 0 and hands `generate` 0 as the pad token,
    not its end-of-sequence id (`pad_token_id or eos` once took 0 for missing): a stream stopping early is padded
    with the pad id."""
    g = torch.Generator().manual_seed(43)
    model = case.build()
    batch = policy.stream(case, model, batch_size=2)
    vocab = batch.tokenizer.get_vocab()
    pad = next(token for token, index in vocab.items() if index == 0)
    batch.tokenizer.pad_token = pad
    assert batch.tokenizer.pad_token_id == 0 and batch.tokenizer.eos_token_id != 0
    batch.append_video(**dict(case.chunk(2, g)))
    if refused_on_hybrid(case, policy, batch):
        return
    ids, pads = batch._question_ids(QUESTIONS)[1:]
    assert pads is not None and bool((ids[0, :int(pads[0])] == 0).all())
    seen = {}
    generate = batch.model.generate

    def spy(**kwargs):
        seen.update(kwargs)
        return generate(**kwargs)

    batch.model.generate = spy
    try:
        batch.ask(QUESTIONS, max_new_tokens=2)
    finally:
        del batch.model.generate
    assert seen["pad_token_id"] == 0


def test_ask_generates_up_to_the_documented_64_tokens_by_default(case, policy, monkeypatch):
    """`ask(question)` without max_new_tokens generates at most 64 tokens (docs/stream.md), the same answer as
    asking for 64 explicitly."""
    model = case.build()
    stream = policy.stream(case, model)
    stream.append_video(**case.chunk(1, torch.Generator().manual_seed(8)))
    asked = []
    generate = stream._generate

    def recording(ids, pads, max_new_tokens, **kwargs):
        asked.append(max_new_tokens)
        return generate(ids, pads, max_new_tokens, **kwargs)

    monkeypatch.setattr(stream, "_generate", recording)
    assert stream.ask(QUESTION) == stream.ask(QUESTION, max_new_tokens=64)
    assert asked == [64, 64]

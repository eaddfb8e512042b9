"""The third policy of the shared checks (fifo_policy.py) is a real policy: it evicts the oldest frames, and what the
model then computes from its cache equals an independent reference, a full-sequence forward in which every token
sees only the frames the FIFO memory held when it was computed, at the positions the tokens had in the stream."""
import pytest
import torch

from tests.hermes.policies.h2svc.checks import masked_reference_logits
from tests.hermes.stream.policies import POLICIES
from tests.hermes.streams import CASES, QUESTION, reference_sequence
from tests.utils import assert_close_verbose

pytestmark = pytest.mark.usefixtures("single_thread")

KEPT = 3  # the registry's FIFO streams keep 3 frames; every chunk brings 2


def visible(prefix_len: int, tokens_per_frame: int, chunks: int, question_len: int) -> torch.Tensor:
    """bool [S, S] over prefix + chunks·2 frames + question, from the FIFO rule alone: a token sees the prefix, the
    frames held when its chunk was prefilled (the newest KEPT after each chunk), its own chunk, causally."""
    P, T_f = prefix_len, tokens_per_frame
    held, seen_by_chunk = [], []
    for chunk in range(chunks + 1):  # the last "chunk" is the question
        seen_by_chunk.append(set(held))
        held = (held + [2 * chunk, 2 * chunk + 1])[-KEPT:]
    S = P + chunks * 2 * T_f + question_len
    frame = torch.full((S,), -1)
    frame[P:S - question_len] = torch.arange(2 * chunks).repeat_interleave(T_f)
    chunk_of = torch.where(frame >= 0, frame // 2, chunks)
    chunk_of[:P] = -1
    sees_held = torch.tensor([[int(frame[k]) in seen_by_chunk[int(chunk_of[q])] if chunk_of[q] >= 0 else False
                               for k in range(S)] for q in range(S)])
    same_chunk = chunk_of[:, None] == chunk_of[None, :]
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    return causal & (sees_held | same_chunk | (frame < 0)[None, :] & (chunk_of < 0)[None, :])


@pytest.mark.parametrize("name", list(CASES))
def test_fifo_evicts_the_oldest_frames_and_matches_the_reference(name):
    case = CASES[name]
    g = torch.Generator().manual_seed(61)
    model = case.build()
    stream = POLICIES["fifo"].stream(case, model)
    chunks = [case.chunk(1, g) for _ in range(3)]
    steps = [stream.append_video(**chunk) for chunk in chunks]
    assert [(step.dropped, step.held) for step in steps] == [(0, 2), (1, 3), (2, 3)]
    P, T_f = stream.cfg.prefix_len, stream.cfg.tokens_per_frame
    assert stream.cache.length == P + KEPT * T_f and stream.stats()["steps"] == 3
    embeds, positions, question = reference_sequence(case, model, chunks, 1)
    # the kept tokens are the last KEPT frames, at the positions they had in the stream
    kept = torch.cat([torch.arange(P), torch.arange(P + 3 * T_f, P + 6 * T_f)])
    layer_positions = stream.cache.layer_positions(0)[0]
    assert torch.equal(layer_positions, positions[..., 0, kept] if case.mrope else positions[0, kept])
    mask = visible(P, T_f, 3, question.shape[1])
    heads = model.config.get_text_config().num_key_value_heads
    masks = {layer: mask.expand(heads, -1, -1) for layer in range(stream.cfg.num_layers)}
    expected = masked_reference_logits(model, embeds, positions, masks)
    assert_close_verbose(stream.next_token_logits(QUESTION), expected, name="logits after the evictions")

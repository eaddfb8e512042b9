"""Bad input to the front under every policy: chunks of the wrong shape, dtype or values, a chunk larger than the
cache was sized for, questions that do not fit and bad settings raise clear errors before any forward, leaving every
buffer (free slots included) byte-identical; the stream then goes on."""
import pytest
import torch

from tests.hermes.policies.h2svc.checks import chunk as frames_chunk
from tests.hermes.stream.policies import assert_same_buffers, assert_state
from tests.hermes.streams import refuse_bad_questions

pytestmark = pytest.mark.usefixtures("single_thread")


def test_bad_input_raises_and_leaves_every_buffer_unchanged(case, policy):
    g = torch.Generator().manual_seed(7)
    model = case.build()
    stream = policy.stream(case, model, batch_size=2)
    for _ in range(3):
        stream.append_video(**case.chunk(2, g))
    buffers, state = policy.buffers(stream), policy.state(stream)
    for name, kwargs in case.bad_chunks(2, g).items():
        with pytest.raises((ValueError, TypeError), match="video|grid_thw|seconds_per_grid|timestamps|target_sizes"):
            stream.append_video(**kwargs)
    with pytest.raises(ValueError, match="chunk_tokens"):  # one frame more than the cache was sized for
        stream.append_video(**frames_chunk(case, 2, g, 3))
    refuse_bad_questions(stream)
    if not policy.guidance:
        with pytest.raises(ValueError, match="guidance_scores"):
            stream.guidance_scores()
    assert_same_buffers(policy, stream, buffers)
    assert_state(policy, stream, state)
    assert stream.append_video(**case.chunk(2, g)) is not None or not policy.every_chunk


def test_bad_settings_are_refused(case, policy):
    """A cache sized for chunks smaller than one frame (at construction or at the first chunk) and an unknown
    backend are refused, naming the setting."""
    g = torch.Generator().manual_seed(8)
    model = case.build()
    with pytest.raises(ValueError, match="chunk_tokens"):
        small = policy.stream(case, model, chunk_tokens=8)
        small.append_video(**case.chunk(1, g))
    with pytest.raises(ValueError, match="backend"):
        policy.stream(case, model, backend="cuda")


def test_the_room_check_admits_exactly_the_room_left(case, policy):
    """The front's room check takes as many tokens as the cache has room for, not one more."""
    g = torch.Generator().manual_seed(10)
    stream = policy.stream(case, case.build())
    stream.append_video(**case.chunk(1, g))
    room = stream.cache.room()
    assert room > 0
    stream.check_room(room)
    with pytest.raises(ValueError, match="room"):
        stream.check_room(room + 1)

"""`reset()` under every policy: a new video in the same buffers, the stream then equal to a fresh one."""
import pytest
import torch

from tests.hermes.stream.policies import assert_same_stream
from tests.hermes.streams import QUESTION

pytestmark = pytest.mark.usefixtures("single_thread")


def test_reset_starts_a_new_video_in_the_same_buffers(case, policy):
    """After reset() a stream behaves like a fresh one (no history, no steps) without reallocating."""
    g = torch.Generator().manual_seed(9)
    model = case.build()
    used = policy.stream(case, model)
    for _ in range(4):
        used.append_video(**case.chunk(1, g))
    used.ask(QUESTION, max_new_tokens=2)
    ptrs = used.cache.data_ptrs()
    used.reset()
    assert used.stats()["steps"] == 0 and used.last_convs == [None] and used.last_step is None
    assert used.cache.data_ptrs() == ptrs
    fresh = policy.stream(case, model)
    for _ in range(4):
        chunk = case.chunk(1, g)
        used.append_video(**chunk)
        fresh.append_video(**chunk)
    assert_same_stream(policy, used, fresh)

"""`append_video` under every policy: it returns the policy's step result for a chunk that ran a step (None for one
that did not), and `last_step` holds the latest result until the next step replaces it."""
import pytest
import torch

pytestmark = pytest.mark.usefixtures("single_thread")


def test_last_step_is_the_latest_step_result(case, policy):
    g = torch.Generator().manual_seed(12)
    stream = policy.stream(case, case.build())
    assert stream.last_step is None
    seen = None
    for _ in range(policy.warm + 3):
        result = stream.append_video(**case.chunk(1, g))
        if result is not None:
            assert result is not seen
            seen = result
        assert stream.last_step is seen
    assert seen is not None, "the chunks should have run the policy's step"

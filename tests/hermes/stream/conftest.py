"""The two axes every shared stream check runs over: the model family (`case`) and the policy (`policy`)."""
import pytest

from tests.hermes.stream.policies import POLICIES
from tests.hermes.streams import CASES


@pytest.fixture(params=list(CASES))
def case(request):
    return CASES[request.param]


@pytest.fixture(params=list(POLICIES))
def policy(request):
    return POLICIES[request.param]

"""The two axes every shared stream check runs over: the model family (`case`) and the policy (`policy`)."""
import pytest

from tests.hermes.stream.policies import FAMILIES, POLICIES


@pytest.fixture(params=list(FAMILIES))
def case(request):
    return FAMILIES[request.param]


@pytest.fixture(params=list(POLICIES))
def policy(request):
    return POLICIES[request.param]

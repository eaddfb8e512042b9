"""hermes_kernels.engine.ranks and hermes_kernels.engine.workspace at their edges: the counting ranks' torch ops on an
empty row set, their int64 result; scratch on the device it is asked for (the meta device stands in for CUDA on a
CPU-only machine). The ranks themselves are checked against each other by the compaction and H2SVC step tests."""
import pytest
import torch

from hermes_kernels.engine import native
from hermes_kernels.engine.ranks import dense_rank, dense_rank_counting
from hermes_kernels.engine.workspace import scratch


@pytest.fixture(params=["torch-ops", "c"])
def counting(request, monkeypatch):
    """dense_rank_counting through the torch ops (the C library switched off) or the C loop."""
    if request.param == "torch-ops":
        monkeypatch.setenv(native.ENV_SWITCH, "0")
    elif native.library("compact_cpu") is None:
        pytest.skip(native.unavailable_reason("compact_cpu"))
    return dense_rank_counting


@pytest.mark.parametrize("shape", [(3, 0), (0, 5), (0, 0)])
def test_counting_ranks_of_nothing(counting, shape):
    values = torch.zeros(shape, dtype=torch.int64)
    ranks = counting(values, torch.ones(shape, dtype=torch.bool))
    assert ranks.shape == shape and ranks.dtype == torch.int64


def test_counting_ranks_are_int64_and_equal_the_sort(counting):
    gen = torch.Generator().manual_seed(0)
    values = torch.randint(0, 50, (4, 3, 17), generator=gen)
    valid = torch.rand(4, 3, 17, generator=gen) > 0.3
    ranks = counting(values, valid)
    assert ranks.dtype == torch.int64 and ranks.shape == values.shape
    assert torch.equal(ranks[valid], dense_rank(values, valid)[valid])


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_scratch_is_on_the_device_asked_for(device):
    out = scratch((2, 3), torch.float16, torch.device(device))
    assert out.device.type == device and out.dtype == torch.float16 and out.shape == (2, 3)

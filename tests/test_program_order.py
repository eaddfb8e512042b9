"""The interpreter's program order (tests/program_order.py): a deliberately order-dependent kernel passes in the
interpreter's own order and fails reversed and shuffled; an order-free one passes in every order."""
import pytest
import torch
import triton
import triton.language as tl

from hermes_kernels.engine.launch import launch
from tests.program_order import program_order
from tests.utils import DEVICE

pytestmark = pytest.mark.skipif(DEVICE != "cpu", reason="reorders the Triton interpreter's programs (no CUDA)")


@triton.jit
def _chain_kernel(out_ptr):
    """out[i] = out[i - 1] + 1: program i reads what program i - 1 wrote. Right only when programs run in order
    (a race on a GPU)."""
    i = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    before = tl.load(out_ptr + i - 1, mask=i > 0, other=0)
    tl.store(out_ptr + i, before + 1)


@triton.jit
def _own_slot_kernel(out_ptr):
    """out[i] = i + 1: every program writes only its own slot."""
    i = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    tl.store(out_ptr + i, i + 1)


def _run(kernel) -> torch.Tensor:
    out = torch.zeros(24, dtype=torch.int64)
    launch(kernel, (6, 4), out)  # a 2-D grid: every axis of the grid is permuted
    return out


EXPECTED = torch.arange(1, 25)


def test_an_order_dependent_kernel_passes_in_order_and_fails_reversed_and_shuffled():
    with program_order("in-order"):
        assert torch.equal(_run(_chain_kernel), EXPECTED)
    for order, seed in (("reversed", 0), ("shuffled", 0), ("shuffled", 1)):
        with program_order(order, seed):
            assert not torch.equal(_run(_chain_kernel), EXPECTED), (order, seed)


@pytest.mark.parametrize("order", ["in-order", "reversed", "shuffled"])
def test_an_order_free_kernel_passes_in_every_order_and_runs_each_program_once(order):
    with program_order(order, seed=3):
        assert torch.equal(_run(_own_slot_kernel), EXPECTED)


def test_orders_nest_and_the_shuffle_is_seeded():
    seen = []

    @triton.jit
    def record(out_ptr, counter_ptr):
        # the k-th program to run writes k at its own grid index
        k = tl.load(counter_ptr)
        tl.store(out_ptr + tl.program_id(0), k)
        tl.store(counter_ptr, k + 1)

    def order_of_programs() -> list[int]:
        out, counter = torch.zeros(16, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
        launch(record, (16,), out, counter)
        return out.argsort().tolist()

    with program_order("reversed"):
        with program_order("in-order"):
            seen.append(order_of_programs())
        seen.append(order_of_programs())
    with program_order("shuffled", seed=5):
        seen.append(order_of_programs())
    with program_order("shuffled", seed=5):
        seen.append(order_of_programs())
    assert seen[0] == list(range(16))
    assert seen[1] == list(range(15, -1, -1))
    assert seen[2] == seen[3] and sorted(seen[2]) == list(range(16)) and seen[2] not in seen[:2]
    with pytest.raises(ValueError, match="order"):
        with program_order("backwards"):
            pass

"""Pick the Triton interpreter when there is no GPU (it must be set before triton is first imported), the
interpreter's program order (`--program-order`, docs/testing.md#program-order), and the fixtures the test folders
share. Helpers live in importable modules (tests/utils.py, tests/hermes/streams.py)."""
import os
import zlib

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.program_order import ORDERS, program_order  # noqa: E402
from tests.utils import DEVICE, TORCH_OPS  # noqa: E402 (after the interpreter switch: it imports triton)


def pytest_addoption(parser):
    parser.addoption("--program-order", choices=ORDERS, default="in-order",
                     help="run every interpreted Triton launch's programs in this order (default: in-order, the "
                          "interpreter's own); needs the interpreter (no CUDA)")
    parser.addoption("--program-seed", type=int, default=0, help="seed of --program-order shuffled (default 0)")


def pytest_configure(config):
    if config.getoption("--program-order") != "in-order" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        raise pytest.UsageError("--program-order: reorders the Triton interpreter's programs, and this run compiles "
                                "for a GPU (TRITON_INTERPRET is not set)")


@pytest.fixture(autouse=True)
def _program_order(request):
    """Every test under --program-order's order; a shuffled test draws from a seed of its own (the run's seed and
    its node id), so it fails the same way when run alone."""
    order = request.config.getoption("--program-order")
    if order == "in-order":
        yield
        return
    seed = zlib.crc32(f"{request.config.getoption('--program-seed')}:{request.node.nodeid}".encode())
    with program_order(order, seed):
        yield


@pytest.fixture
def backend(request, monkeypatch):
    """Indirect `backend` parameter: "torch-ops" is the torch backend with its C row kernel switched off
    (HERMES_KERNELS_NATIVE=0), so both CPU movers of the compaction are tested; other names pass through."""
    if request.param == TORCH_OPS:
        if DEVICE != "cpu":
            pytest.skip("torch-ops is the torch backend itself on CUDA tensors (the C row kernel is CPU-only)")
        monkeypatch.setenv("HERMES_KERNELS_NATIVE", "0")
        return "torch"
    return request.param


@pytest.fixture
def single_thread():
    """One intra-op thread, restored afterwards. Tiny models are latency-bound: on a shared runner OpenMP
    spin-waits make their forwards many times slower, and one thread also gives the same float sums as a
    `--threads 1` subprocess. Modules opt in with `pytestmark = pytest.mark.usefixtures("single_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


TINY_FAMILIES = ("llava_onevision", "qwen2_5_vl")


@pytest.fixture(scope="module")
def tiny_checkpoints(tmp_path_factory):
    """model_type -> folder of a tiny random-weight checkpoint saved with save_pretrained (no download)."""
    from scaffolding.checkpoint import save_tiny_checkpoint
    return {family: save_tiny_checkpoint(tmp_path_factory.mktemp(family), family) for family in TINY_FAMILIES}


@pytest.fixture(scope="module")
def loaded(tiny_checkpoints):
    """model_type -> `hermes.commands.load_model` of the tiny checkpoint on the CPU."""
    from hermes.commands import load_model
    return {family: load_model(path, device="cpu") for family, path in tiny_checkpoints.items()}

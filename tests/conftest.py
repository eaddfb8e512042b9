"""Pick the Triton interpreter when there is no GPU: it must be set before triton is first imported."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


TORCH_OPS = "torch-ops"


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

"""H2SVC stage (a), frame features: hk.frame_features on every backend against hermes_kernels.policies.h2svc.reference.

Fresh random values in every cache dtype, odd token counts and head dims, contiguous tensors and strided views of
larger NaN-tailed buffers (as the step passes the arriving frames' slots). The Triton output is poisoned before
the kernel writes it; bad inputs are refused naming the argument, inputs unchanged.
"""
from __future__ import annotations

import importlib

import pytest
import torch

import hermes_kernels as hk
from hermes_kernels.policies.h2svc import reference as ref
from tests.utils import DEVICE
from tests.utils import assert_close_verbose, poison_

features_module = importlib.import_module("hermes_kernels.policies.h2svc.features")

BACKENDS = ["torch", "triton"]
F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
# (H, B, F, T_f, D, dtype, layout): "view" = the frames' token slots of a larger buffer whose other slots are NaN
CASES = [
    (2, 3, 4, 7, 16, F32, "contiguous"),
    (3, 1, 1, 1, 128, BF16, "view"),
    (1, 2, 5, 196, 64, F16, "view"),
    (2, 2, 3, 33, 24, F64, "contiguous"),
    (4, 1, 2, 5, 128, F32, "view"),
    # Gemma 4's widths: its full-attention layers' D 512 (several channel blocks per frame) and D 256
    (2, 1, 2, 9, 512, BF16, "view"),
    (1, 2, 3, 5, 512, F32, "contiguous"),
    (1, 1, 2, 7, 256, F16, "view"),
]


@pytest.fixture(autouse=True)
def poisoned_output(monkeypatch):
    monkeypatch.setattr(features_module, "_output", lambda shape, dtype, device: poison_(
        torch.empty(shape, dtype=dtype, device=device)))


def make_values(case, seed: int):
    """values [H, B, F·T_f, D] and the buffer it views (None when contiguous)."""
    H, B, F, T, D, dtype, layout = case
    g = torch.Generator().manual_seed(seed)
    data = torch.randn(H, B, F * T, D, generator=g).to(dtype)
    if layout == "contiguous":
        return data.to(DEVICE), None
    buffer = torch.full((H, B, F * T + 9, D + 3), float("nan"), dtype=dtype)
    buffer[:, :, 4:4 + F * T, :D] = data
    buffer = buffer.to(DEVICE)
    return buffer[:, :, 4:4 + F * T, :D], buffer


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"H{c[0]}B{c[1]}F{c[2]}T{c[3]}D{c[4]}-{str(c[5])[6:]}-{c[6]}")
def test_matches_reference(case, backend):
    values, buffer = make_values(case, seed=CASES.index(case))
    before = values.clone()
    got = hk.frame_features(values, case[3], backend=backend)
    want = ref.frame_features(values.cpu(), case[3])
    assert got.dtype == want.dtype == (F64 if case[5] == F64 else F32)
    assert got.shape == (case[0], case[1], case[2], case[4])
    assert_close_verbose(got.cpu(), want, name="features")
    assert torch.equal(values, before), "values changed"
    if buffer is not None:  # the NaN tail around the view is read by nobody: a read would put NaN in a feature
        assert not torch.isnan(got).any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_constant_frames_give_their_value(backend):
    """A frame whose tokens all hold one vector has exactly that vector as its feature (every dtype's sum of
    equal values divided by T_f is exact for these small integers)."""
    base = torch.arange(3 * 16, dtype=F32).view(1, 1, 3, 1, 16).expand(1, 1, 3, 5, 16).reshape(1, 1, 15, 16)
    for dtype in (F32, BF16, F16):
        got = hk.frame_features(base.to(dtype).to(DEVICE), 5, backend=backend).cpu()
        assert torch.equal(got, base[:, :, ::5]), dtype


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_input_raises_before_writing(backend):
    values = torch.randn(2, 1, 12, 16, device=DEVICE)
    snapshot = values.clone()
    bad_calls = [
        (ValueError, "values", (values[0], 4)),
        (TypeError, "values", (values.to(torch.int32), 4)),
        (TypeError, "values", (values.numpy() if DEVICE == "cpu" else values.tolist(), 4)),
        (ValueError, "values", (values, 5)),  # 12 tokens are not whole frames of 5
        (ValueError, "tokens_per_frame", (values, 0)),
        (TypeError, "tokens_per_frame", (values, 4.0)),
        (ValueError, "values", (values[:, :, :0], 4)),
    ]
    for error, name, args in bad_calls:
        with pytest.raises(error, match=f"^{name}"):
            hk.frame_features(*args, backend=backend)
    with pytest.raises(ValueError, match="^backend"):
        hk.frame_features(values, 4, backend="cuda")
    assert torch.equal(values, snapshot)

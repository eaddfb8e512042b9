"""Pooled guidance attention (docs/hermes.md §2.3): both backends against `reference.pooled_attention`.

Inputs are drawn in float64, rounded to the tested dtype, and the oracle runs in float64 on the rounded values. Both
backends read fp16/bf16/fp32 values exactly and accumulate in fp32 (fp64 input is computed in fp32 by Triton), so every
input dtype is held to the float32 tolerance against that exact answer. Pooled values are averages of probabilities,
of order 1/N, so the absolute part of that tolerance is scaled by 1/N.
"""
from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

import hermes_kernels as hk
from hermes_kernels.policies.hermes.reference import pooled_attention as reference_pooled_attention
from hermes_kernels.policies.hermes.pooling import pooled_attention_torch, pooled_attention_triton
from hermes_kernels.engine.launch import launch_count
from tests.utils import DEVICE
from tests.utils import TOL, assert_close_verbose, poison_

# the stage file itself: the package attribute `hermes_kernels.pooled_attention` is the public op, not this module
STAGE_MODULE = importlib.import_module("hermes_kernels.policies.hermes.pooling")
STAGES = {"torch": pooled_attention_torch, "triton": pooled_attention_triton}
# every input dtype is computed in fp32 (module docstring), so the fp32 tolerance is the per-dtype tolerance
FP32_TOL = TOL[torch.float32]


@dataclasses.dataclass(frozen=True)
class Case:
    lead: tuple[int, ...]  # (B,) or stacked (L, B)
    heads: int
    kv_heads: int
    queries: int
    keys: int
    head_dim: int
    dtype: torch.dtype
    scale: float | None = None

    def __str__(self) -> str:
        dt = str(self.dtype).removeprefix("torch.")
        return (f"lead{'x'.join(map(str, self.lead))}-H{self.heads}-Hkv{self.kv_heads}-Q{self.queries}-N{self.keys}"
                f"-D{self.head_dim}-{dt}" + ("" if self.scale is None else f"-s{self.scale}"))


# A covering set: Q=1 / Q>>1 / Q=N; GQA ratio 1, 2, 4, 7; D 40, 48, 64, 128, 256 and 512; N never a power of two;
# B 1, 2, 3; plain and stacked; every dtype more than once; several query-row blocks (G·Q > 32) and several key tiles
# (N > 64).
CASES = [
    Case((2,), 4, 4, 1, 37, 64, torch.float32),
    Case((1,), 28, 4, 1, 45, 128, torch.float16),
    Case((3,), 8, 2, 17, 45, 64, torch.bfloat16),
    Case((2, 1), 7, 1, 23, 23, 128, torch.float32),
    Case((3, 2), 4, 1, 30, 53, 64, torch.float16),
    Case((2, 3), 4, 4, 23, 23, 64, torch.bfloat16),
    Case((1,), 14, 2, 40, 70, 128, torch.bfloat16),
    Case((2, 1), 8, 2, 9, 130, 64, torch.float32, scale=0.3),
    Case((1, 1), 7, 1, 70, 70, 64, torch.float16),
    Case((1,), 4, 1, 5, 37, 128, torch.float64),
    # head dims that are no multiple of the kernels' dims per dot (32 fp16/bf16, 16 fp32): a partial last chunk
    Case((2,), 14, 2, 5, 45, 48, torch.float16),
    Case((1,), 8, 2, 9, 70, 40, torch.float32),
    # Gemma 4's full-attention layers (D 512, 8 heads over 4 KV heads) and its sliding-window width (D 256): many
    # chunks of dims per dot
    Case((1,), 8, 4, 3, 37, 512, torch.bfloat16),
    Case((2, 1), 4, 1, 5, 70, 512, torch.float32),
    Case((1,), 2, 2, 4, 23, 512, torch.float64),
    Case((1,), 8, 2, 9, 45, 256, torch.float16),
]
if DEVICE == "cuda":
    # the LLaVA-OV-7B guidance shape (docs/hermes.md §4), all 28 layers in one call
    CASES += [Case((28, 1), 28, 4, 40, 9150, 128, torch.float16), Case((28, 1), 28, 4, 40, 9150, 128, torch.bfloat16)]


def make_inputs(case: Case, seed: int, magnitude: float = 2.0) -> tuple[torch.Tensor, torch.Tensor]:
    """q [*lead, H, Q, D], k [*lead, Hkv, N, D] in `case.dtype`; magnitude 2 gives logits of std ~4 (peaked rows)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(*case.lead, case.heads, case.queries, case.head_dim, generator=gen, dtype=torch.float64)
    k = torch.randn(*case.lead, case.kv_heads, case.keys, case.head_dim, generator=gen, dtype=torch.float64)
    return (magnitude * q).to(DEVICE, case.dtype), (magnitude * k).to(DEVICE, case.dtype)


def exact(q: torch.Tensor, k: torch.Tensor, scale: float | None) -> torch.Tensor:
    """The oracle in float64 on the (already rounded) inputs."""
    return reference_pooled_attention(q.double(), k.double(), scale)


def assert_matches_reference(actual: torch.Tensor, q: torch.Tensor, k: torch.Tensor, scale: float | None,
                             name: str) -> None:
    """Compare with the float64 oracle: fp32 relative tolerance, absolute tolerance scaled to values of order 1/N."""
    atol, rtol = FP32_TOL
    assert actual.dtype == torch.float32, f"{name}: dtype {actual.dtype}, expected float32"
    assert_close_verbose(actual, exact(q, k, scale), atol / k.shape[-2], rtol, name=name)


def poisoned_output(case: Case) -> torch.Tensor:
    return poison_(torch.empty(*case.lead, case.keys, dtype=torch.float32, device=DEVICE))


@pytest.mark.parametrize("backend", list(STAGES))
@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_reference(case: Case, backend: str) -> None:
    q, k = make_inputs(case, seed=1)
    out = poisoned_output(case)
    result = STAGES[backend](q, k, case.scale, out=out)
    assert result.data_ptr() == out.data_ptr() and result.dtype == torch.float32
    assert_matches_reference(out, q, k, case.scale, f"{backend} pooled attention")


@pytest.mark.parametrize("backend", list(STAGES))
@pytest.mark.parametrize("case", [CASES[1], CASES[3], CASES[6], CASES[8]], ids=str)
def test_total_is_one_with_large_logits(case: Case, backend: str) -> None:
    """Each query row's softmax sums to 1 over keys, so the pooled total of every stream is 1; logits of std ~36
    (maxima past 88) overflow exp in fp32 in any softmax that does not subtract its row maximum."""
    q, k = make_inputs(case, seed=2, magnitude=6.0)
    result = STAGES[backend](q, k, case.scale, out=poisoned_output(case))
    total = result.double().sum(dim=-1)
    assert_close_verbose(total, torch.ones_like(total), *FP32_TOL, name=f"{backend} pooled total")
    assert_matches_reference(result, q, k, case.scale, f"{backend} pooled attention")


@pytest.mark.parametrize("backend", ["auto", *STAGES])
def test_public_op_dispatch(backend: str) -> None:
    """`hk.pooled_attention` returns a fresh float32 tensor of the contract's shape for plain and stacked inputs."""
    for case in (CASES[2], CASES[4]):
        q, k = make_inputs(case, seed=3)
        result = hk.pooled_attention(q, k, case.scale, backend=backend)
        assert result.shape == (*case.lead, case.keys) and result.dtype == torch.float32
        assert_matches_reference(result, q, k, case.scale, f"{backend} pooled attention")


@pytest.mark.parametrize("backend", list(STAGES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_views(backend: str, dtype: torch.dtype) -> None:
    """The model cache passes `buffer[..., :N, :]` of a larger [L, B, Hkv, capacity, D] buffer; queries may come
    head-last from the projection ([L, B, Q, H, D] transposed)."""
    gen = torch.Generator().manual_seed(4)
    L, B, H, Hkv, Q, N, D, capacity = 2, 2, 8, 2, 6, 41, 64, 57
    buffer = (2 * torch.randn(L, B, Hkv, capacity, D, generator=gen, dtype=torch.float64)).to(DEVICE, dtype)
    q = (2 * torch.randn(L, B, Q, H, D, generator=gen, dtype=torch.float64)).to(DEVICE, dtype).transpose(2, 3)
    k = buffer[..., :N, :]
    padded = poison_(torch.empty(L, B, N + 5, dtype=torch.float32, device=DEVICE))
    out = padded[..., 2:N + 2]
    STAGES[backend](q, k, None, out=out)
    assert_matches_reference(out, q, k, None, f"{backend} pooled attention (views)")
    assert padded[..., :2].isnan().all() and padded[..., N + 2:].isnan().all(), "wrote outside `out`"


@pytest.mark.parametrize("chunk", ["two-groups", "five-rows"])
def test_torch_chunking(chunk: str, monkeypatch) -> None:
    """The torch twin bounds its logits per chunk: several whole GQA groups at a time (last chunk partial), or
    blocks of one group's query rows when a group alone is over the bound."""
    case = CASES[4]
    rows = case.heads // case.kv_heads * case.queries
    assert rows > case.head_dim  # so a group's logits, not its upcast keys, set the chunk size
    bound = 2 * rows * case.keys if chunk == "two-groups" else 5 * case.keys
    monkeypatch.setattr(STAGE_MODULE, "_TORCH_CHUNK_ELEMS", bound)
    q, k = make_inputs(case, seed=7)
    out = poisoned_output(case)
    pooled_attention_torch(q, k, case.scale, out=out)
    assert_matches_reference(out, q, k, case.scale, f"torch pooled attention ({chunk})")


def test_triton_is_deterministic() -> None:
    q, k = make_inputs(CASES[6], seed=5)
    first = pooled_attention_triton(q, k, None)
    second = pooled_attention_triton(q, k, None)
    assert torch.equal(first, second)


def test_triton_launch_count_is_constant_in_layers_and_streams() -> None:
    """One pass-1 and one pass-2 launch for the whole stacked input, whatever L and B are."""
    counts = {}
    for L, B in ((2, 1), (28, 1), (28, 3)):
        q, k = make_inputs(Case((L, B), 2, 1, 2, 19, 64, torch.float16), seed=6)
        before = launch_count()
        hk.pooled_attention(q, k, backend="triton")
        counts[(L, B)] = launch_count() - before
    assert set(counts.values()) == {2}, counts


def _bad_inputs():
    """(description, q, k, scale, exception type, the argument the message must start with)."""
    q = torch.randn(2, 4, 3, 64, device=DEVICE)
    k = torch.randn(2, 2, 11, 64, device=DEVICE)
    yield "q not a tensor", q.tolist(), k, None, TypeError, "q"
    yield "q 3-d", q[0], k, None, ValueError, "q"
    yield "k rank differs", q, k[None], None, ValueError, "k"
    yield "integer q", q.to(torch.int32), k, None, TypeError, "q"
    yield "k dtype differs", q, k.half(), None, TypeError, "k"
    yield "head dim differs", q, k[..., :32], None, ValueError, "k"
    yield "streams differ", q, k[:1], None, ValueError, "k"
    yield "H not a multiple of Hkv", q[:, :3], k, None, ValueError, "k"
    yield "more queries than keys", torch.randn(2, 4, 12, 64, device=DEVICE), k, None, ValueError, "q"
    yield "zero scale", q, k, 0.0, ValueError, "scale"
    yield "negative scale", q, k, -1.0, ValueError, "scale"
    yield "k on another device", q, k.to("meta"), None, ValueError, "k"
    yield "stacked k layers differ", torch.randn(3, 2, 4, 3, 64, device=DEVICE), \
        torch.randn(2, 2, 2, 11, 64, device=DEVICE), None, ValueError, "k"


def _unchanged_after(call, *tensors) -> None:
    """Run `call` (which must raise) and check it launched nothing and left every readable tensor as it was."""
    readable = [t for t in tensors if isinstance(t, torch.Tensor) and t.device.type != "meta"]
    snapshot = [t.clone() for t in readable]
    before = launch_count()
    call()
    assert launch_count() == before
    assert all(torch.equal(a, b) for a, b in zip(snapshot, readable))


@pytest.mark.parametrize("backend", ["auto", *STAGES])
@pytest.mark.parametrize("bad", list(_bad_inputs()), ids=lambda bad: bad[0])
def test_bad_inputs_raise_before_any_work(bad, backend: str) -> None:
    _, q, k, scale, error, argument = bad

    def call():
        with pytest.raises(error, match=rf"^{argument}:"):
            hk.pooled_attention(q, k, scale, backend=backend)
    _unchanged_after(call, q, k)


def test_unknown_backend_raises() -> None:
    q, k = make_inputs(CASES[0], seed=8)
    with pytest.raises(ValueError, match="^backend:"):
        hk.pooled_attention(q, k, backend="cuda")


@pytest.mark.parametrize("backend", list(STAGES))
@pytest.mark.parametrize("bad_out", ["float64", "wrong shape"])
def test_bad_out_raises_before_any_write(backend: str, bad_out: str) -> None:
    case = CASES[2]
    q, k = make_inputs(case, seed=9)
    out = poison_(torch.empty(*case.lead, case.keys + (bad_out == "wrong shape"), device=DEVICE,
                              dtype=torch.float64 if bad_out == "float64" else torch.float32))

    def call():
        with pytest.raises(ValueError, match="^out:"):
            STAGES[backend](q, k, None, out=out)
    _unchanged_after(call, q, k)
    assert out.isnan().all()

"""Stage 2, smoothed scores S~ (docs/hermes.md §2.3–2.4): both backends against `reference.hermes_scores`.

Scores are computed in attn's dtype (float32, or float64), so each dtype is held to its own tolerance. Every case
runs the stage function on a poisoned output buffer and the public op; one launch per call on the Triton path.
"""
from __future__ import annotations

import dataclasses
import zlib

import pytest
import torch

import hermes_kernels as hk
from hermes_kernels import HermesConfig
from hermes_kernels.policies.hermes.reference import hermes_scores as reference_scores
from hermes_kernels.policies.hermes.scoring import hermes_scores_torch, hermes_scores_triton
from hermes_kernels.engine.launch import launch_count
from tests.utils import DEVICE
from tests.utils import assert_close_verbose, poison_

STAGES = {"torch": hermes_scores_torch, "triton": hermes_scores_triton}


@dataclasses.dataclass(frozen=True)
class Case:
    preset: str
    layers: int
    streams: int
    visual: int
    dtype: torch.dtype = torch.float32
    cascade: bool | None = None  # None: the preset's own choice
    rows: str = "softmax"  # "softmax": pooled-attention-like; "flat": some rows constant or nearly so
    strided: bool = False  # attn as a non-contiguous view

    def __str__(self) -> str:
        dt = str(self.dtype).removeprefix("torch.")
        cascade = "" if self.cascade is None else f"-cascade{int(self.cascade)}"
        return (f"{self.preset}-L{self.layers}-B{self.streams}-V{self.visual}-{dt}{cascade}-{self.rows}"
                + ("-strided" if self.strided else ""))

    def config(self) -> HermesConfig:
        overrides = {} if self.cascade is None else {"cascade": self.cascade}
        return getattr(HermesConfig, self.preset)(self.layers, 16, 14, **overrides)


CASES = [
    Case("llava_ov", 5, 3, 37),
    Case("llava_ov", 5, 1, 23, cascade=False),
    Case("qwen2_5_vl", 4, 1, 23, torch.float64),
    Case("qwen2_5_vl", 3, 3, 50, cascade=False, rows="flat"),
    Case("paper", 5, 3, 41),
    Case("paper", 4, 2, 29, torch.float64, cascade=True, strided=True),
    Case("llava_ov", 28, 1, 19, cascade=False),
    Case("qwen2_5_vl", 28, 3, 7, torch.float64),
    Case("paper", 3, 2, 1),
    Case("llava_ov", 1, 2, 30, rows="flat"),
    Case("qwen2_5_vl", 2, 1, 2100, strided=True),  # several token tiles per row on the Triton path
]


def make_attn(case: Case, seed: int) -> torch.Tensor:
    """Pooled-attention-like rows [L, B, V]: a softmax share of the visual tokens; "flat" makes stream 0 constant
    (max = min, A = 0) and stream 1 a near-constant row whose spread is comparable to eps."""
    g = torch.Generator().manual_seed(seed)
    L, B, V = case.layers, case.streams, case.visual
    attn = torch.softmax(3 * torch.randn(L, B, V + 5, generator=g, dtype=torch.float64), dim=-1)[..., :V]
    if case.rows == "flat":
        attn[:, 0] = 0.25
        if B > 1:
            attn[:, 1] = 0.5 + 1e-6 * torch.rand(L, V, generator=g, dtype=torch.float64)
    attn = attn.to(case.dtype)
    if case.strided:
        # every other token of a wider buffer, with streams outermost
        wide = torch.zeros(B, L, 2 * V, dtype=case.dtype)
        wide[..., ::2] = attn.transpose(0, 1)
        attn = wide.to(DEVICE).transpose(0, 1)[..., ::2]
        assert not attn.is_contiguous()
        return attn
    return attn.to(DEVICE)


@pytest.mark.parametrize("backend", list(STAGES))
@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_reference(case: Case, backend: str):
    cfg = case.config()
    attn = make_attn(case, seed=zlib.crc32(str(case).encode()))
    before = attn.clone()
    expected = reference_scores(attn, cfg)
    out = poison_(torch.empty(attn.shape, dtype=case.dtype, device=DEVICE))
    got = STAGES[backend](attn, cfg, out=out)
    assert got.data_ptr() == out.data_ptr(), "the stage did not write into out"
    assert_close_verbose(out, expected, name="scores (out=)")
    public = hk.hermes_scores(attn, cfg, backend=backend)
    assert public.dtype == expected.dtype and public.shape == expected.shape
    assert_close_verbose(public, expected, name="scores")
    assert torch.equal(attn, before), "attn was modified"


@pytest.mark.parametrize("backend", list(STAGES))
def test_cascade_switch_changes_scores(backend: str):
    """cascade on and off (memoised per config) each follow the reference, and the two genuinely differ."""
    case = Case("qwen2_5_vl", 6, 2, 33)
    attn = make_attn(case, seed=3)
    results = {}
    for cascade in (True, False, True):
        cfg = case.config().replace(cascade=cascade)
        results[cascade] = hk.hermes_scores(attn, cfg, backend=backend)
        assert_close_verbose(results[cascade], reference_scores(attn, cfg), name=f"scores cascade={cascade}")
    assert (results[True] - results[False]).abs().max() > 1e-3


def test_one_triton_launch_whatever_layers_and_streams():
    counts = {}
    for L, B in [(2, 1), (28, 1), (2, 3), (28, 3)]:
        attn = make_attn(Case("llava_ov", L, B, 9), seed=L + B)
        before = launch_count()
        hk.hermes_scores(attn, Case("llava_ov", L, B, 9).config(), backend="triton")
        counts[(L, B)] = launch_count() - before
    assert set(counts.values()) == {1}, f"launches per call: {counts}"


@pytest.mark.parametrize("backend", list(STAGES))
def test_bad_input_raises(backend: str):
    cfg = HermesConfig.llava_ov(4, 8, 2)
    attn = make_attn(Case("llava_ov", 4, 2, 12), seed=11)
    with pytest.raises(ValueError, match="attn"):
        hk.hermes_scores(attn[:3], cfg, backend=backend)  # wrong L
    with pytest.raises(ValueError, match="attn"):
        hk.hermes_scores(attn[0], cfg, backend=backend)  # wrong rank
    for bad_value in (float("nan"), float("inf")):
        broken = attn.clone()
        broken[2, 1, 5] = bad_value
        with pytest.raises(ValueError, match=r"layer\(s\) \[2\]"):
            hk.hermes_scores(broken, cfg, backend=backend)
    for dtype in (torch.float16, torch.bfloat16, torch.int64):
        with pytest.raises(TypeError, match="attn"):
            hk.hermes_scores(attn.to(dtype), cfg, backend=backend)
    with pytest.raises(TypeError, match="cfg"):
        hk.hermes_scores(attn, {"num_layers": 4}, backend=backend)
    with pytest.raises(ValueError, match="backend"):
        hk.hermes_scores(attn, cfg, backend=backend + "-x")
    out = poison_(torch.empty(4, 2, 11, device=DEVICE))
    with pytest.raises(ValueError, match="out"):
        STAGES[backend](attn, cfg, out=out)
    assert torch.isnan(out).all(), "a rejected call wrote into out"

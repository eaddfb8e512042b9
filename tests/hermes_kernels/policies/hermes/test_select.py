"""Stage 3, selection (docs/hermes.md §2.5, eq. 6): both backends against the reference `select_keep`.

The keep indices must equal the reference's exactly: on tie-free scores (`distinct_attention`), and on scores full
of repeated values, where ties must go to the lower index as the reference's stable sort does. Outputs (keep and
the optional destination map) are poisoned before the call so an unwritten slot fails.
"""
from __future__ import annotations

import dataclasses
import zlib

import pytest
import torch

import hermes_kernels as hk
from hermes_kernels import HermesConfig
from hermes_kernels.policies.hermes.reference import hermes_scores as reference_scores
from hermes_kernels.policies.hermes.reference import select_keep as reference_select_keep
from hermes_kernels.policies.hermes.select import destination_map, select_keep_torch, select_keep_triton
from hermes_kernels.engine.launch import launch_count
from tests.utils import DEVICE
from tests.utils import distinct_attention, poison_

STAGES = {"torch": select_keep_torch, "triton": select_keep_triton}
INT32_POISON = torch.iinfo(torch.int32).min


@dataclasses.dataclass(frozen=True)
class Case:
    preset: str
    layers: int
    streams: int
    visual: int
    budget: int
    summary: bool = True
    dtype: torch.dtype = torch.float32
    strided: bool = False  # scores as a non-contiguous view

    def __str__(self) -> str:
        dt = str(self.dtype).removeprefix("torch.")
        return (f"{self.preset}-L{self.layers}-B{self.streams}-V{self.visual}-b{self.budget}-summary{int(self.summary)}"
                f"-{dt}" + ("-strided" if self.strided else ""))

    def config(self) -> HermesConfig:
        return getattr(HermesConfig, self.preset)(self.layers, self.budget, 3, summary=self.summary)

    def seed(self) -> int:
        return zlib.crc32(str(self).encode())


# V below, at (b-1 and b) and above the budget; V = 1; L small and 28; B 1 and 3; summary on/off; fp32/fp64
CASES = [
    Case("llava_ov", 5, 3, 37, 16),
    Case("qwen2_5_vl", 4, 1, 12, 16),
    Case("paper", 4, 3, 16, 16, dtype=torch.float64),
    Case("llava_ov", 4, 2, 15, 16, strided=True),
    Case("qwen2_5_vl", 5, 1, 17, 16, summary=False),
    Case("paper", 3, 3, 1, 2),
    Case("llava_ov", 3, 1, 1, 1, summary=False),
    Case("paper", 28, 1, 20, 8),
    Case("llava_ov", 2, 3, 70, 30, summary=False, dtype=torch.float64),
    Case("qwen2_5_vl", 4, 1, 2500, 1000, strided=True),  # several token tiles per row on the Triton path
    Case("llava_ov", 4, 1, 2500, 2000, dtype=torch.float64),  # keeps most of the row
]

# repeated values everywhere: -0.0 and +0.0 tie with each other, infinities tie among themselves
TIE_PALETTE = [float("-inf"), -1.5, -0.0, 0.0, 0.25, 1.0, float("inf")]
TIE_CASES = [
    Case("llava_ov", 5, 3, 37, 16),
    Case("qwen2_5_vl", 3, 2, 17, 16, dtype=torch.float64),
    Case("paper", 4, 1, 40, 9, summary=False, strided=True),
    Case("llava_ov", 2, 1, 1500, 700),
]


def as_scores(values: torch.Tensor, case: Case) -> torch.Tensor:
    """values [L, B, V] on DEVICE in the case's dtype, as a non-contiguous view when the case asks for one."""
    values = values.to(case.dtype)
    if not case.strided:
        return values.to(DEVICE)
    L, B, V = values.shape
    wide = torch.zeros(B, L, V, 2, dtype=case.dtype)
    wide[..., 1] = values.transpose(0, 1)
    scores = wide.to(DEVICE).transpose(0, 1)[..., 1]
    assert not scores.is_contiguous()
    return scores


def tied_scores(case: Case) -> torch.Tensor:
    g = torch.Generator().manual_seed(case.seed())
    palette = torch.tensor(TIE_PALETTE, dtype=torch.float64)
    values = palette[torch.randint(0, len(TIE_PALETTE), (case.layers, case.streams, case.visual), generator=g)]
    values[0, 0] = 0.25  # one constant row: every comparison is a tie
    return as_scores(values, case)


def expected_destination(keep: torch.Tensor, num_visual: int) -> torch.Tensor:
    """dest[l, b, keep[l, b, s]] = s for the kept slots, -1 elsewhere (the definition, row by row)."""
    L, B, _ = keep.shape
    dest = torch.full((L, B, num_visual), -1, dtype=torch.int32)
    for layer in range(L):
        for b in range(B):
            kept = keep[layer, b][keep[layer, b] >= 0].cpu()
            dest[layer, b, kept] = torch.arange(kept.numel(), dtype=torch.int32)
    return dest


def check_stage(scores: torch.Tensor, cfg: HermesConfig, backend: str) -> None:
    """Stage function into poisoned buffers (with the destination map) and the public op, both against the oracle."""
    L, B, V = scores.shape
    before = scores.clone()
    expected = reference_select_keep(scores, cfg)
    out = poison_(torch.empty(L, B, min(cfg.budget, V), dtype=torch.int64, device=DEVICE))
    dest_out = torch.full((L, B, V), INT32_POISON, dtype=torch.int32, device=DEVICE)
    keep, dest = STAGES[backend](scores, cfg, out=out, with_destination=True, dest_out=dest_out)
    assert keep.data_ptr() == out.data_ptr() and dest.data_ptr() == dest_out.data_ptr(), "outputs not written in place"
    assert torch.equal(out.cpu(), expected.cpu()), f"keep differs from the reference:\n{out}\n{expected}"
    assert torch.equal(dest_out.cpu(), expected_destination(expected, V)), "destination map is wrong"
    public = hk.select_keep(scores, cfg, backend=backend)
    assert public.dtype == torch.int64 and torch.equal(public.cpu(), expected.cpu()), "public op differs"
    assert torch.equal(scores, before), "scores were modified"


@pytest.mark.parametrize("backend", list(STAGES))
@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_reference_without_ties(case: Case, backend: str):
    g = torch.Generator().manual_seed(case.seed())
    scores = as_scores(distinct_attention(case.layers, case.streams, case.visual, g), case)
    check_stage(scores, case.config(), backend)


@pytest.mark.parametrize("backend", list(STAGES))
@pytest.mark.parametrize("case", TIE_CASES, ids=str)
def test_ties_go_to_the_lower_index(case: Case, backend: str):
    check_stage(tied_scores(case), case.config(), backend)


@pytest.mark.parametrize("backend", list(STAGES))
def test_scores_from_the_scoring_stage(backend: str):
    """Realistic input: S~ of the reference scoring (smooth, many near-equal values in deep layers)."""
    cfg = HermesConfig.llava_ov(6, 20, 3)
    g = torch.Generator().manual_seed(21)
    attn = torch.softmax(3 * torch.randn(6, 2, 45, generator=g), dim=-1).to(DEVICE)
    check_stage(reference_scores(attn, cfg), cfg, backend)


def test_destination_map_helper():
    cfg = HermesConfig.qwen2_5_vl(5, 9, 3)
    g = torch.Generator().manual_seed(4)
    keep = reference_select_keep(distinct_attention(5, 3, 26, g, device=DEVICE), cfg)
    assert torch.equal(destination_map(keep, 26).cpu(), expected_destination(keep, 26))


def test_one_triton_launch_whatever_layers_and_streams():
    counts = {}
    for L, B in [(2, 1), (28, 1), (2, 3)]:
        g = torch.Generator().manual_seed(L + B)
        scores = distinct_attention(L, B, 6, g, device=DEVICE)
        before = launch_count()
        hk.select_keep(scores, HermesConfig.llava_ov(L, 4, 2), backend="triton")
        counts[(L, B)] = launch_count() - before
    assert set(counts.values()) == {1}, f"launches per call: {counts}"


@pytest.mark.parametrize("backend", list(STAGES))
def test_bad_input_raises(backend: str):
    cfg = HermesConfig.llava_ov(4, 8, 2)
    g = torch.Generator().manual_seed(8)
    scores = distinct_attention(4, 2, 12, g, device=DEVICE)
    with pytest.raises(ValueError, match="scores"):
        hk.select_keep(scores[:3], cfg, backend=backend)  # wrong L
    with pytest.raises(ValueError, match="scores"):
        hk.select_keep(scores[0], cfg, backend=backend)  # wrong rank
    with pytest.raises(ValueError, match="scores"):
        hk.select_keep(scores[..., :0], cfg, backend=backend)  # no visual token
    for dtype in (torch.float16, torch.bfloat16, torch.int64):
        with pytest.raises(TypeError, match="scores"):
            hk.select_keep(scores.to(dtype), cfg, backend=backend)
    with pytest.raises(TypeError, match="cfg"):
        hk.select_keep(scores, {"num_layers": 4}, backend=backend)
    with pytest.raises(ValueError, match="backend"):
        hk.select_keep(scores, cfg, backend=backend + "-x")
    for name, buf in (("out", torch.empty(4, 2, 7, dtype=torch.int64, device=DEVICE)),
                      ("out", torch.empty(4, 2, 8, dtype=torch.int32, device=DEVICE)),
                      ("out", torch.empty(4, 2, 16, dtype=torch.int64, device=DEVICE)[..., ::2]),
                      ("dest_out", torch.empty(4, 2, 12, dtype=torch.int64, device=DEVICE))):
        poisoned = poison_(buf) if buf.dtype == torch.int64 else buf.fill_(INT32_POISON)
        snapshot = poisoned.clone()
        with pytest.raises(ValueError, match=name):
            STAGES[backend](scores, cfg, with_destination=True, **{name: poisoned})
        assert torch.equal(poisoned, snapshot), f"a rejected call wrote into {name}"

"""Test helpers: the device under test, verbose comparisons, per-dtype tolerances, poisoning, synthetic caches."""
from __future__ import annotations

import os

import pytest
import torch

from hermes_kernels import native
from hermes_kernels.rope import RotaryLayout

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout: subprocesses run from it
TORCH_OPS = "torch-ops"  # a `backend` parameter: the torch backend with its C loops switched off (conftest)

# (atol, rtol) per storage dtype of the compared tensor
TOL = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


def assert_close_verbose(actual: torch.Tensor, expected: torch.Tensor, atol: float | None = None,
                         rtol: float | None = None, name: str = "tensor") -> None:
    """torch.allclose with a report: how many elements differ, the worst ones and where. NaN never passes."""
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}"
    default_atol, default_rtol = TOL.get(expected.dtype, (0.0, 0.0))
    atol = default_atol if atol is None else atol
    rtol = default_rtol if rtol is None else rtol
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    if not a.is_floating_point():
        bad = a != e
    else:
        bad = ~((a - e).abs() <= atol + rtol * e.abs())
        bad |= torch.isnan(a) | torch.isnan(e)
    if bad.any():
        idx = bad.nonzero()[:8].tolist()
        worst = [(tuple(i), a[tuple(i)].item(), e[tuple(i)].item()) for i in idx]
        raise AssertionError(f"{name}: {int(bad.sum())} of {bad.numel()} elements differ (atol={atol}, rtol={rtol}); "
                             f"first (index, actual, expected): {worst}")


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill with a value no correct kernel writes: NaN for floats, a large negative sentinel for ints."""
    return t.fill_(float("nan") if t.is_floating_point() else -(2 ** 40))


# Interleaved M-RoPE layouts (Qwen3-VL, docs/hermes.md §2.8) of the test grids, by head dim D, beside contiguous
# (t, h, w) pair counts (Qwen2.5-VL) and None (1D): Qwen3-VL-8B's at D = 128 and small ones at odd row sizes.
INTERLEAVED = {128: RotaryLayout.interleaved((24, 20, 20)), 16: RotaryLayout.interleaved((4, 2, 2)),
               12: RotaryLayout.interleaved((2, 2, 2)), 8: RotaryLayout.interleaved((2, 1, 1))}


def rope_id(mrope_section) -> str:
    """Test id of a rotary description: 1d, mrope2-3-3 (contiguous sections: counts or a layout), il4-2-2
    (interleaved)."""
    if mrope_section is None:
        return "1d"
    layout = mrope_section if isinstance(mrope_section, RotaryLayout) else RotaryLayout.sections(mrope_section)
    if layout.num_axes == 1:
        return "1d"
    return {"sections": "mrope", "interleaved": "il"}.get(layout.kind, layout.kind) + "-".join(map(str, layout.counts))


def inv_freq_for(head_dim: int, theta: float = 1e6, device="cpu") -> torch.Tensor:
    """Standard RoPE inverse frequencies [D/2] float32."""
    return 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)


def distinct_attention(L: int, B: int, V: int, generator: torch.Generator, device="cpu") -> torch.Tensor:
    """Pooled-attention-like scores [L, B, V] float32 without ties: a random permutation of well-separated
    values per row, so the selected sets cannot depend on rounding."""
    base = torch.rand(L, B, V, generator=generator).argsort(dim=-1).to(torch.float32)
    return ((base + 1.0) / (V * V)).to(device)


def synthetic_positions(L: int, B: int, N: int, prefix_len: int, generator: torch.Generator, mrope: bool = False,
                        start: int = 0, device="cpu") -> torch.Tensor:
    """Positions like those of a cache after earlier steps: prefix 0..P-1, then visual positions strictly increasing
    with random gaps, different per layer and stream. int64 [L, B, N], or [L, B, 3, N] with M-RoPE axes
    (t increasing in runs, h/w cycling over a small grid, all offset by the prefix)."""
    V = N - prefix_len
    prefix = torch.arange(prefix_len).expand(L, B, prefix_len)
    gaps = torch.randint(1, 4, (L, B, V), generator=generator)
    visual = prefix_len + start + gaps.cumsum(-1) - 1
    flat = torch.cat([prefix, visual], dim=-1)
    if not mrope:
        return flat.to(device)
    t = torch.cat([prefix, prefix_len + start + (gaps.cumsum(-1) - 1) // 4], dim=-1)
    grid = torch.arange(V) % 4
    h = torch.cat([prefix, (prefix_len + start + grid // 2).expand(L, B, V)], dim=-1)
    w = torch.cat([prefix, (prefix_len + start + grid % 2).expand(L, B, V)], dim=-1)
    return torch.stack([t, h, w], dim=2).to(device)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """a and b hold the same bytes (NaN payloads included, so a poisoned tensor compares equal to its copy)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.detach().cpu().contiguous().view(torch.uint8), b.detach().cpu().contiguous().view(torch.uint8))


def error_line(main, capsys, argv, status: int = 1) -> str:
    """Run a command's `main(argv)` in-process; assert its exit status, one stderr line `error: ...` and no
    traceback; return that line."""
    assert main(argv) == status
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def require_c_library(name: str) -> None:
    """Skip when no C compiler is installed; fail when one is but hermes_kernels/<name>.c did not build."""
    reason = native.unavailable_reason(name)
    if reason is not None and reason.startswith("no C compiler"):
        pytest.skip(reason)
    assert reason is None, f"{name}.c did not build: {reason}"

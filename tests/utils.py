"""Test helpers: the device under test, verbose comparisons, per-dtype tolerances, poisoning, synthetic caches."""
from __future__ import annotations

import os

import torch

from hermes_kernels.engine import native
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


# Partial rotary (Qwen3.5: the first R channels of a head turn, [R, D) never do) at interpreter shapes, by name:
# (head dim D, layout of R/2 pairs). "il": D 32, R 8, interleaved M-RoPE [2, 1, 1] (the tiny Qwen3.5's); "1d": D 16,
# R 8, 1D RoPE. Qwen3.5's published D 256, R 64, interleaved [11, 11, 10] is `QWEN3_5_ROTARY`.
PARTIAL = {"il": (32, RotaryLayout.interleaved((2, 1, 1))), "1d": (16, RotaryLayout.one_d(4))}
QWEN3_5_ROTARY = RotaryLayout.interleaved((11, 11, 10))


def rope_id(mrope_section, head_dim: int | None = None) -> str:
    """Test id of a rotary description: 1d, mrope2-3-3 (contiguous sections: counts or a layout), il4-2-2
    (interleaved); with `head_dim`, a layout of fewer pairs than D/2 (partial rotary) adds its width, e.g.
    il2-1-1-R8."""
    if mrope_section is None:
        return "1d"
    layout = mrope_section if isinstance(mrope_section, RotaryLayout) else RotaryLayout.sections(mrope_section)
    partial = f"-R{layout.rotary_dim}" if head_dim is not None and layout.rotary_dim < head_dim else ""
    if layout.num_axes == 1:
        return "1d" + partial
    return ({"sections": "mrope", "interleaved": "il"}.get(layout.kind, layout.kind) + "-".join(map(str, layout.counts))
            + partial)


def inv_freq_for(head_dim: int, theta: float = 1e6, device="cpu") -> torch.Tensor:
    """Standard RoPE inverse frequencies [D/2] float32."""
    return 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)


def rotary_width(head_dim: int, rotary) -> int:
    """R, the channels of a head that turn: D, unless `rotary` is a `RotaryLayout` of fewer pairs (partial)."""
    return rotary.rotary_dim if isinstance(rotary, RotaryLayout) else head_dim


def inv_freq_of(head_dim: int, rotary, theta: float = 1e6, device="cpu") -> torch.Tensor:
    """inv_freq [R/2] float32 of a head of `head_dim` under `rotary` (R = `rotary_width`)."""
    return inv_freq_for(rotary_width(head_dim, rotary), theta, device)


def frozen_channels(inv_freq: torch.Tensor) -> torch.Tensor:
    """bool [2·inv_freq.numel()]: the channels of a 1D rotate-half head whose pair has frequency 0 (both halves)."""
    still = (inv_freq == 0).cpu()
    return torch.cat([still, still])


# A negative quiet NaN with a payload, as raw bits per dtype: bytes that neither a rotation (by any angle, zero
# included) nor a round trip through another float dtype gives back.
_ODD_NAN = {torch.float64: 0xFFF8_0000_0000_0123 - 2 ** 64, torch.float32: 0xFFC0_0123 - 2 ** 32,
            torch.float16: 0xFE23 - 2 ** 16, torch.bfloat16: 0xFFC3 - 2 ** 16}
_INT_OF = {8: torch.int64, 4: torch.int32, 2: torch.int16}


def poison_tail_(x: torch.Tensor, R: int, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Channels [R, D) of the rows of x [..., D] where `rows` (bool, x.shape[:-1]; default all) is True: every
    other channel −0.0 and the first a negative NaN with a payload, the rest as they were (so tails still differ
    from row to row). A partial-rotary kernel must move these bytes as they are: a rotation by angle 0 turns some
    −0.0 into +0.0, and a round trip through the work dtype may lose the NaN's sign and payload (torch's bf16 does). In
    place; returns x."""
    if R >= x.shape[-1]:
        return x
    bits = x.view(_INT_OF[x.element_size()])
    pattern = x[..., R:].clone()
    pattern[..., 1::2] = -0.0
    pattern.view(bits.dtype)[..., 0] = _ODD_NAN[x.dtype]
    keep = torch.ones(x.shape[:-1], dtype=torch.bool, device=x.device) if rows is None else rows
    bits[..., R:] = torch.where(keep.unsqueeze(-1), pattern.view(bits.dtype), bits[..., R:])
    return x


def assert_tails_equal(got: torch.Tensor, want: torch.Tensor, R: int, copied: torch.Tensor | None = None,
                       name: str = "keys") -> None:
    """Channels [R, D) of keys [..., n, D] (partial rotary): byte-equal to want's in the slots where `copied` (bool
    broadcastable to [..., n]; default all) is True — rows that moved or stayed carry the cache's own bytes — and
    within want's dtype tolerance elsewhere (summary slots: means). Nothing to check when R = D."""
    if R >= got.shape[-1]:
        return
    got, want = got[..., R:].cpu(), want[..., R:].cpu()
    copied = torch.ones(got.shape[:-1], dtype=torch.bool) if copied is None else copied.cpu().expand(got.shape[:-1])
    assert same_bytes(got[copied], want[copied]), \
        f"{name}: tail channels [{R}, {got.shape[-1] + R}) are not the bytes they should carry"
    if not bool(copied.all()):
        assert_close_verbose(got[~copied], want[~copied], name=f"{name} (tail of a summary)")


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
    import pytest  # here, not at the top: the task writer of .ci/smoke/eval.py imports this module without pytest

    reason = native.unavailable_reason(name)
    if reason is not None and reason.startswith("no C compiler"):
        pytest.skip(reason)
    assert reason is None, f"{name}.c did not build: {reason}"

"""Work memory of the launchers and the torch row mover: `scratch`, the one allocation seam the tests poison (NaN,
the smallest int), so a kernel that reads work memory before writing it fails there (docs/testing.md#standard).
"""
from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["scratch"]


def scratch(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Uninitialised work memory; every op writes it before reading it (tests poison it through this seam)."""
    return torch.empty(shape, dtype=dtype, device=device)

"""The one dispatch point: every op's `backend="auto"|"triton"|"torch"` is resolved here.

"triton" runs the Triton kernels (CUDA tensors; CPU through TRITON_INTERPRET=1 for testing), "torch" the vectorised
PyTorch twins (on CPU some of their loops run in small C files, `hermes_kernels.engine.native`), "auto" Triton for CUDA
tensors and torch elsewhere.
"""
from __future__ import annotations

from typing import Callable

import torch

BACKENDS = ("auto", "triton", "torch")


def check_backend(backend) -> str:
    """ValueError naming `backend` unless it is one of BACKENDS."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    return backend


def resolve_backend(backend: str, device: torch.device) -> str:
    """"triton" or "torch": what `backend` means for tensors on `device` ("auto": Triton on CUDA, torch elsewhere)."""
    check_backend(backend)
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return backend


def pick(backend: str, device: torch.device, triton_impl: Callable, torch_impl: Callable) -> Callable:
    """The implementation `backend` resolves to on `device`."""
    return triton_impl if resolve_backend(backend, device) == "triton" else torch_impl

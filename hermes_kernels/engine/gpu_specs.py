"""Compile specifications of the Triton kernels, for the GPU compile guard (`python -m bench.kernels`,
tests/hermes_kernels/test_gpu_specs.py), which builds every kernel for sm_80 and sm_90 without a GPU.

A spec (`gpu_spec`) names the kernels it covers, their spill bound, and a driver that calls the policy's own launcher
at one case (`HermesCase`, `H2SVCCase`). Drivers live in each policy folder's `gpu_specs.py`, apart from the kernels,
and `registered_specs()` imports them; `jit_kernels()` lists every @triton.jit kernel of the package, so one that no
spec launches fails the guard. docs/benchmarks.md#kernels.
"""
from __future__ import annotations

import ast
import dataclasses
import importlib
import pkgutil
import textwrap
from typing import Callable

import torch

__all__ = ["GpuSpec", "gpu_spec", "registered_specs", "jit_kernels", "kernel_name", "meta"]


def meta(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A meta tensor: shape, strides and dtype without memory."""
    return torch.empty(shape, dtype=dtype, device="meta")


@dataclasses.dataclass(frozen=True)
class GpuSpec:
    """A registered spec: `drive(case)` calls the launcher(s) of `kernels` at every case of type `case_type`;
    each kernel may spill at most `max_spill_bytes` (ptxas spill stores) on every target."""

    name: str
    kernels: tuple
    drive: Callable
    max_spill_bytes: int
    case_type: type


_SPECS: list[GpuSpec] = []


def gpu_spec(*kernels, case: type | None = None, max_spill_bytes: int = 0) -> Callable[[Callable], Callable]:
    """Register the decorated driver as the compile spec of `kernels` (the @triton.jit objects it launches),
    driven at every case of type `case`: a policy's case dataclass with a `label` (HERMES: `HermesCase`, one
    compression step; H2SVC: `H2SVCCase`, one step of every class block)."""
    if not kernels:
        raise ValueError("kernels: name at least one kernel the spec covers")
    if not isinstance(max_spill_bytes, int) or max_spill_bytes < 0:
        raise ValueError(f"max_spill_bytes: expected an int >= 0, got {max_spill_bytes!r}")
    if not (isinstance(case, type) and dataclasses.is_dataclass(case)
            and "label" in {field.name for field in dataclasses.fields(case)}):
        raise ValueError(f"case: expected a policy's case dataclass with a `label` field, got {case!r}")

    def register(drive: Callable) -> Callable:
        _SPECS.append(GpuSpec(f"{drive.__module__}.{drive.__name__}", tuple(kernels), drive, max_spill_bytes,
                              case))
        return drive
    return register


LIBRARY = __package__.partition(".")[0]  # hermes_kernels: this module sits in its engine folder
SPEC_MODULE = "gpu_specs"  # the name of a policy folder's module of specs


def _package_modules() -> list:
    """Every module of hermes_kernels and its subpackages, imported (so their specs are registered)."""
    package = importlib.import_module(LIBRARY)
    return [package] + [importlib.import_module(info.name)
                        for info in pkgutil.walk_packages(package.__path__, prefix=f"{LIBRARY}.")]


def registered_specs() -> list[GpuSpec]:
    """The specs of every `gpu_specs` module of the package's subpackages (imported here: no kernel module imports
    them)."""
    package = importlib.import_module(LIBRARY)
    for info in pkgutil.walk_packages(package.__path__, prefix=f"{LIBRARY}."):
        if info.name.rpartition(".")[2] == SPEC_MODULE and info.name != __name__:
            importlib.import_module(info.name)
    return list(_SPECS)


def kernel_name(kernel) -> str:
    """module.function of a @triton.jit object."""
    return f"{kernel.fn.__module__}.{kernel.fn.__name__}"


def _callees(jit_fn, jit_type) -> set[str]:
    """Names of the @triton.jit functions a jit function's body refers to (helpers it calls or passes on)."""
    found = set()
    for node in ast.walk(ast.parse(textwrap.dedent(jit_fn.src))):
        if isinstance(node, ast.Name) and isinstance(jit_fn.fn.__globals__.get(node.id), jit_type):
            found.add(kernel_name(jit_fn.fn.__globals__[node.id]))
    return found


def jit_kernels() -> dict[str, object]:
    """Every @triton.jit kernel defined in the package, by `kernel_name`; helpers that other jit functions call
    (compiled into their callers) are left out. Needs the compiler mode: under TRITON_INTERPRET=1 there are only
    interpreter objects, and this raises RuntimeError."""
    from triton.runtime.jit import JITFunction

    found = {}
    for module in _package_modules():
        for value in vars(module).values():
            if isinstance(value, JITFunction) and value.fn.__module__ == module.__name__:
                found[kernel_name(value)] = value
            elif type(value).__name__ == "InterpretedFunction":
                raise RuntimeError("jit_kernels: triton is in interpreter mode (TRITON_INTERPRET=1); the compile "
                                   "guard needs the compiler")
    called = set().union(*(_callees(fn, JITFunction) for fn in found.values())) if found else set()
    return {name: fn for name, fn in found.items() if name not in called}

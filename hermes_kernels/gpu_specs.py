"""Compile specifications of the Triton kernels, for the GPU compile guard (`python -m bench.kernels`,
tests/test_compile.py), which builds every kernel for sm_80 and sm_90 without a GPU.

A spec lives beside its kernels: it names the kernels it covers, the spill bound the guard enforces on them, and a
driver that calls the module's own launcher for one `SpecCase` (the tensors one streaming compression step hands
the kernels at one model shape and cache dtype):

    @gpu_spec(_my_kernel, max_spill_bytes=0)
    def _my_gpu_spec(case: SpecCase) -> None:
        my_launcher(case.guidance_attn(), case.cfg)

The guard runs every driver inside `launch.recording()` on meta tensors (no memory, no data), so the signatures,
constexprs and block sizes it compiles are the ones the launchers really produce; nothing is written by hand that
could drift from them. `jit_kernels()` lists every @triton.jit kernel of the package; one that no spec launches
fails the guard's test, so a new kernel cannot go unguarded.
"""
from __future__ import annotations

import ast
import dataclasses
import importlib
import pkgutil
import textwrap
from typing import Callable

import torch

from hermes.config import HermesConfig

__all__ = ["SpecCase", "GpuSpec", "gpu_spec", "registered_specs", "jit_kernels", "kernel_name"]


@dataclasses.dataclass(frozen=True)
class SpecCase:
    """One compression step the launchers are driven at: model geometry, cache dtype, budget and chunk.

    The tensors are laid out as `hermes.cache.HermesCache` and `hermes.stream` hand them to the kernels: K/V and
    positions are views `[..., :N]` of buffers with `capacity` slots, the pooled attention a view of the cache's
    `guidance_attn` [L, B, capacity], the guidance queries a head-transposed view of a [B, Q, H, D] projection.
    reindex: "eager" / "lazy" (the config's trigger, decided on the device) or "given" (a caller-made flag, as
    `compress_stacks` passes for a cache split over devices).
    """

    label: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    mrope_section: tuple[int, int, int] | None
    dtype: torch.dtype
    cfg: HermesConfig
    chunk_tokens: int
    capacity: int
    guidance_tokens: tuple[int, ...]
    reindex: str
    batch: int = 1

    @property
    def num_tokens(self) -> int:
        """N = prefix + budget + chunk: the cache length at the start of a step."""
        return self.cfg.prefix_len + self.cfg.budget + self.chunk_tokens

    @property
    def num_visual(self) -> int:
        """V = N - prefix."""
        return self.num_tokens - self.cfg.prefix_len

    @staticmethod
    def empty(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A meta tensor: shape, strides and dtype without memory."""
        return torch.empty(shape, dtype=dtype, device="meta")

    def cache(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """keys, values [L, B, Hkv, N, D] and int64 positions [L, B, N] / [L, B, 3, N], views of the buffers."""
        L, B, Hkv, D, N = self.num_layers, self.batch, self.num_kv_heads, self.head_dim, self.num_tokens
        keys = self.empty(L, B, Hkv, self.capacity, D, dtype=self.dtype)[..., :N, :]
        values = self.empty(L, B, Hkv, self.capacity, D, dtype=self.dtype)[..., :N, :]
        axes = () if self.mrope_section is None else (3,)
        positions = self.empty(L, B, *axes, self.capacity, dtype=torch.int64)[..., :N]
        return keys, values, positions

    def guidance_attn(self) -> torch.Tensor:
        """float32 [L, B, V]: the view of the cache's pooled-attention buffer a step is given."""
        return self.empty(self.num_layers, self.batch, self.capacity)[..., :self.num_visual]

    def scores(self) -> torch.Tensor:
        """float32 [L, B, V] as the scoring stage returns it (contiguous)."""
        return self.empty(self.num_layers, self.batch, self.num_visual)

    def keep(self) -> torch.Tensor:
        """int64 [L, B, min(budget, V)] as the selection stage returns it (contiguous)."""
        return self.empty(self.num_layers, self.batch, min(self.cfg.budget, self.num_visual), dtype=torch.int64)

    def inv_freq(self) -> torch.Tensor:
        """float32 [D/2] rotary inverse frequencies."""
        return self.empty(self.head_dim // 2)

    def compacted_flag(self) -> torch.Tensor | None:
        """The caller's 0-dim bool re-index decision when `reindex` is "given", else None."""
        return self.empty(dtype=torch.bool) if self.reindex == "given" else None

    def guidance(self, q_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """q [B, H, Q, D] (transposed view of a [B, Q, H, D] projection) and k [B, Hkv, N + Q, D] (one layer of the
        cache buffer: the cache followed by the prompt's own keys), in the cache dtype."""
        B, H, Hkv, D = self.batch, self.num_heads, self.num_kv_heads, self.head_dim
        q = self.empty(B, q_len, H, D, dtype=self.dtype).transpose(1, 2)
        k = self.empty(B, Hkv, self.capacity, D, dtype=self.dtype)[:, :, :self.num_tokens + q_len]
        return q, k


@dataclasses.dataclass(frozen=True)
class GpuSpec:
    """A registered spec: `drive(case)` calls the launcher(s) of `kernels`; each kernel may spill at most
    `max_spill_bytes` (ptxas spill stores) on every target."""

    name: str
    kernels: tuple
    drive: Callable[[SpecCase], None]
    max_spill_bytes: int


_SPECS: list[GpuSpec] = []


def gpu_spec(*kernels, max_spill_bytes: int = 0) -> Callable[[Callable[[SpecCase], None]], Callable]:
    """Register the decorated driver as the compile spec of `kernels` (the @triton.jit objects it launches)."""
    if not kernels:
        raise ValueError("kernels: name at least one kernel the spec covers")
    if not isinstance(max_spill_bytes, int) or max_spill_bytes < 0:
        raise ValueError(f"max_spill_bytes: expected an int >= 0, got {max_spill_bytes!r}")

    def register(drive: Callable[[SpecCase], None]) -> Callable[[SpecCase], None]:
        _SPECS.append(GpuSpec(f"{drive.__module__}.{drive.__name__}", tuple(kernels), drive, max_spill_bytes))
        return drive
    return register


def _package_modules() -> list:
    """Every module of hermes_kernels and its subpackages, imported (so their specs are registered)."""
    package = importlib.import_module(__package__)
    return [package] + [importlib.import_module(info.name)
                        for info in pkgutil.walk_packages(package.__path__, prefix=f"{__package__}.")]


def registered_specs() -> list[GpuSpec]:
    """The specs of every module of the package."""
    _package_modules()
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

"""Compile specifications of the Triton kernels, for the GPU compile guard (`python -m bench.kernels`,
tests/hermes_kernels/test_gpu_specs.py), which builds every kernel for sm_80 and sm_90 without a GPU.

A spec lives beside its kernels (or beside the launcher that chains them: the H2SVC step's spec, in
policies/h2svc/step.py, also covers the feature and STCE kernels the step launches): it names the kernels it covers, the
spill bound the guard enforces on them, and a driver that calls the module's own launcher for one case: a `SpecCase`
(the tensors one HERMES streaming compression step hands the kernels at one model shape and cache dtype) or an
`H2SVCCase` (the class blocks one H2SVC step updates). A driver is driven at every case of the type it is registered
for:

    @gpu_spec(_my_kernel, max_spill_bytes=0)
    def _my_gpu_spec(case: SpecCase) -> None:
        my_launcher(case.guidance_attn(), case.cfg)

    @gpu_spec(_my_h2svc_kernel, case=H2SVCCase)
    def _my_h2svc_gpu_spec(case: H2SVCCase) -> None:
        for cls in case.classes:
            my_h2svc_launcher(case.block(cls).keys, case.cfg.window(cls), ...)

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
from typing import Callable, NamedTuple

import torch

from .policies.h2svc.config import EPISODIC, INSTANT, SHORT, H2SVCConfig
from .policies.hermes.config import HermesConfig

__all__ = ["SpecCase", "H2SVCCase", "H2SVCBlock", "GpuSpec", "gpu_spec", "registered_specs", "jit_kernels",
           "kernel_name"]


def _meta(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A meta tensor: shape, strides and dtype without memory."""
    return torch.empty(shape, dtype=dtype, device="meta")


@dataclasses.dataclass(frozen=True)
class SpecCase:
    """One compression step the launchers are driven at: model geometry, cache dtype, budget and chunk.

    The tensors are laid out as `hermes.policies.hermes.cache.HermesCache` and `hermes.stream` hand them to the kernels:
    K/V and positions are views `[..., :N]` of buffers with `capacity` slots, the pooled attention a view of the cache's
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

    empty = staticmethod(_meta)

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


class H2SVCBlock(NamedTuple):
    """One class block as `hk.h2svc_step` takes it (meta tensors); features is None for a FIFO class."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    slot_frames: torch.Tensor
    features: torch.Tensor | None


@dataclasses.dataclass(frozen=True)
class H2SVCCase:
    """One H2SVC streaming step the launchers are driven at: every class block of a model (the config's head map)
    with a full memory (held = W frames in the home slots) and a just-prefilled chunk of F frames behind it, in one
    cache dtype, re-indexing on or off (the caller's decision for the step).

    Blocks are laid out as the engine interface, docs/h2svc.md §7 and bench/stages.py's `ClassBlock` lay them out: keys
    / values [H_c, B, C, D] with C = P + (W + F)·T_f, positions int64 [H_c, B, C] (1D) or [H_c, B, 3, C] (M-RoPE),
    slot_frames int64 [H_c, B, W], features float32 [H_c, B, W, D] (EPISODIC only). The stream has seen 2·N_e
    frames before the chunk, and a re-indexing step aligns to next_position = P + (largest window)·T_f, as the
    benchmark's step does.
    """

    label: str
    head_dim: int
    mrope_section: tuple[int, int, int] | None
    dtype: torch.dtype
    cfg: H2SVCConfig
    chunk_frames: int
    reindex: bool
    batch: int = 1

    @property
    def classes(self) -> tuple[int, ...]:
        """The classes that have rows in the head map, in INSTANT, SHORT, EPISODIC order."""
        return tuple(c for c in (INSTANT, SHORT, EPISODIC) if self.cfg.num_rows(c))

    @property
    def first_frame(self) -> int:
        """Stream index of the chunk's first frame (newer than every held frame)."""
        return 2 * self.cfg.window(EPISODIC)

    @property
    def next_position(self) -> int:
        """The re-index target R: P + the largest retained visual token count over the classes."""
        return self.cfg.prefix_len + max(self.cfg.window(c) for c in self.classes) * self.cfg.tokens_per_frame

    def block(self, cls: int) -> H2SVCBlock:
        """The state of class `cls`'s block at the start of the step (after the chunk's prefill)."""
        H, B, D, W = self.cfg.num_rows(cls), self.batch, self.head_dim, self.cfg.window(cls)
        C = self.cfg.prefix_len + (W + self.chunk_frames) * self.cfg.tokens_per_frame
        axes = () if self.mrope_section is None else (3,)
        features = _meta(H, B, W, D) if cls == EPISODIC else None
        return H2SVCBlock(_meta(H, B, C, D, dtype=self.dtype), _meta(H, B, C, D, dtype=self.dtype),
                          _meta(H, B, *axes, C, dtype=torch.int64), _meta(H, B, W, dtype=torch.int64), features)

    def inv_freq(self) -> torch.Tensor:
        """float32 [D/2] rotary inverse frequencies."""
        return _meta(self.head_dim // 2)


@dataclasses.dataclass(frozen=True)
class GpuSpec:
    """A registered spec: `drive(case)` calls the launcher(s) of `kernels` at every case of type `case_type`;
    each kernel may spill at most `max_spill_bytes` (ptxas spill stores) on every target."""

    name: str
    kernels: tuple
    drive: Callable
    max_spill_bytes: int
    case_type: type = SpecCase


_SPECS: list[GpuSpec] = []


def gpu_spec(*kernels, max_spill_bytes: int = 0, case: type = SpecCase) -> Callable[[Callable], Callable]:
    """Register the decorated driver as the compile spec of `kernels` (the @triton.jit objects it launches),
    driven at every case of type `case` (SpecCase: a HERMES step; H2SVCCase: an H2SVC step)."""
    if not kernels:
        raise ValueError("kernels: name at least one kernel the spec covers")
    if not isinstance(max_spill_bytes, int) or max_spill_bytes < 0:
        raise ValueError(f"max_spill_bytes: expected an int >= 0, got {max_spill_bytes!r}")
    if case not in (SpecCase, H2SVCCase):
        raise ValueError(f"case: expected SpecCase or H2SVCCase, got {case!r}")

    def register(drive: Callable) -> Callable:
        _SPECS.append(GpuSpec(f"{drive.__module__}.{drive.__name__}", tuple(kernels), drive, max_spill_bytes,
                              case))
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

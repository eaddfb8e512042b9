"""Run every Triton launch's programs in another order under the interpreter: reversed, or shuffled with a seed
(docs/testing.md#program-order).

A GPU runs a launch's programs in no set order; Triton 3.9's interpreter runs them in grid order, so a kernel in
which one program reads what another writes passes on the CPU and races on a GPU. `program_order` wraps the
interpreter builder's `set_grid_dim` and `set_grid_idx` so the k-th program to run gets the k-th grid index of a
permutation: every program still runs exactly once, and nothing else of the interpreter changes.
"""
from __future__ import annotations

import contextlib
import random
from typing import Iterator

ORDERS = ("in-order", "reversed", "shuffled")


@contextlib.contextmanager
def program_order(order: str, seed: int = 0) -> Iterator[None]:
    """Inside the block, every interpreted launch runs its programs in `order`: "in-order" (the interpreter's own),
    "reversed", or "shuffled" (a permutation per launch drawn from random.Random(seed)). Nests: the inner order
    holds inside its block and the outer one again after it."""
    if order not in ORDERS:
        raise ValueError(f"order: expected one of {ORDERS}, got {order!r}")
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    rng = random.Random(seed)
    outer = {name: vars(builder)[name] for name in ("set_grid_dim", "set_grid_idx") if name in vars(builder)}
    # the interpreter's own methods (not an outer block's wrappers): an inner order replaces an outer one
    set_dim, set_idx = type(builder).set_grid_dim.__get__(builder), type(builder).set_grid_idx.__get__(builder)
    grid: dict[str, object] = {}

    def permuted_dim(nx: int, ny: int, nz: int) -> None:
        set_dim(nx, ny, nz)
        programs = list(range(nx * ny * nz))
        if order == "reversed":
            programs.reverse()
        elif order == "shuffled":
            rng.shuffle(programs)
        grid.update(shape=(nx, ny, nz), programs=programs)

    def permuted_idx(x: int, y: int, z: int) -> None:
        _, ny, nz = grid["shape"]
        k = grid["programs"][(x * ny + y) * nz + z]
        set_idx(k // (ny * nz), k // nz % ny, k % nz)

    builder.set_grid_dim, builder.set_grid_idx = permuted_dim, permuted_idx
    try:
        yield
    finally:
        for name in ("set_grid_dim", "set_grid_idx"):
            if name in outer:
                setattr(builder, name, outer[name])
            else:
                delattr(builder, name)

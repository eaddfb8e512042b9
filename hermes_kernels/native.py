"""The C row kernels of the torch backend on CPU: built from this package's `.c` files with the system C compiler
on first use, once per process, and loaded with ctypes.

Why C: on CPU the compaction is a row move (read each kept row, rotate keys, write it to its slot). Any
formulation in torch ops stages the rows through a gather buffer and then writes them out again, and that alone
costs about twice a single pass (see `rows.py`); a plain loop over rows moves every row once, in place. The C
code takes no torch headers: tensors go in as data pointers and element strides, so a build takes well under a
second and needs only a C compiler (`$CC`, else `cc`), as Triton's own launcher stubs do.

Built per process into a temporary folder (the library stays mapped after the folder is removed), with
`-march=native` when the compiler accepts it, so nothing compiled for one CPU is ever loaded on another.
`HERMES_KERNELS_NATIVE=0` in the environment turns the C path off; so does a missing or failing compiler. Either
way the torch ops path runs instead, and `unavailable_reason(name)` says why.
"""
from __future__ import annotations

import ctypes
import functools
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

__all__ = ["library", "unavailable_reason", "ENV_SWITCH"]

ENV_SWITCH = "HERMES_KERNELS_NATIVE"
_SOURCE_DIR = Path(__file__).parent
# -ffp-contract=off: every product and sum rounds on its own, as the torch ops of the reference do
_FLAGS = ["-O3", "-std=c11", "-fPIC", "-shared", "-pthread", "-ffp-contract=off"]


def _compiler() -> str | None:
    chosen = os.environ.get("CC")
    if chosen:
        return shutil.which(chosen)
    return shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


@functools.lru_cache(maxsize=None)
def _build(name: str) -> tuple[ctypes.CDLL | None, str | None]:
    compiler = _compiler()
    if compiler is None:
        return None, "no C compiler found ($CC, cc, gcc, clang)"
    source = _SOURCE_DIR / f"{name}.c"
    with tempfile.TemporaryDirectory(prefix="hermes_kernels_", ignore_cleanup_errors=True) as folder:
        target = Path(folder) / f"{name}.so"
        errors = ""
        for arch in (["-march=native"], []):
            try:
                done = subprocess.run([compiler, *_FLAGS, *arch, str(source), "-o", str(target)],
                                      capture_output=True, text=True)
            except OSError as exc:
                return None, f"running {compiler} failed: {exc}"
            if done.returncode == 0:
                try:
                    return ctypes.CDLL(str(target)), None
                except OSError as exc:  # e.g. a temporary folder mounted noexec
                    return None, f"loading the built {target.name} failed: {exc}"
            errors = done.stderr.strip()
    return None, f"{compiler} failed on {source.name}: {errors[-500:]}"


def _switched_off() -> bool:
    return os.environ.get(ENV_SWITCH, "1") == "0"


def library(name: str) -> ctypes.CDLL | None:
    """The loaded C library built from hermes_kernels/<name>.c, or None when it cannot be had or is switched off
    (the switch is read on every call; the build happens once per process)."""
    return None if _switched_off() else _build(name)[0]


def unavailable_reason(name: str) -> str | None:
    """Why `library(name)` is None, or None when it is available."""
    if _switched_off():
        return f"{ENV_SWITCH}=0 in the environment"
    return _build(name)[1]

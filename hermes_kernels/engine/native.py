"""The C loops of the torch backend on CPU: built from this package's `.c` files with the system C compiler on first
use, once per machine (cached on disk), and loaded with ctypes (`library`, `unavailable_reason`).

Why C: the compaction on CPU is a row move, and a loop over rows moves each row once, in place, where torch ops stage
the rows through a gather buffer first. The C code takes no torch headers (data pointers and element strides in), so
a build needs only a C compiler. The build cache is a trust boundary. With `HERMES_KERNELS_NATIVE=0`, no compiler or
a library that does not load, the torch ops path runs instead. docs/api.md#cpu-code, docs/security.md#native-cache.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import warnings
from pathlib import Path

__all__ = ["library", "unavailable_reason", "cache_folder", "Build", "ENV_SWITCH", "CACHE_ENV"]

ENV_SWITCH = "HERMES_KERNELS_NATIVE"
CACHE_ENV = "HERMES_KERNELS_CACHE"
_SOURCE_DIR = Path(__file__).parent
# -ffp-contract=off: every product and sum rounds on its own, as the torch ops of the reference do
_FLAGS = ["-O3", "-std=c11", "-fPIC", "-shared", "-pthread", "-ffp-contract=off"]
_ARCHES = (["-march=native"], [])  # in order of preference
_KEY_FORMAT = "hermes_kernels.engine.native/1"  # bump when the key's contents change
# /proc/cpuinfo fields of the first processor that describe what -march=native sees (x86, then Arm)
_CPU_FIELDS = ("vendor_id", "cpu family", "model", "model name", "flags",
               "CPU implementer", "CPU architecture", "CPU variant", "CPU part", "Features")


@dataclasses.dataclass(frozen=True)
class Build:
    """What `_build(name)` did: "cached" (loaded a library built earlier), "built" (compiled it now, also after a
    cached file failed to load) or "failed" (no library: see `unavailable_reason`). `path` is the file loaded
    (or last tried); `in_cache` is False when the cache folder was unusable and a temporary folder held the build."""
    name: str
    action: str
    path: str | None = None
    key: str | None = None
    in_cache: bool = False
    compiles: int = 0


last_build: Build | None = None  # the record of the latest `_build` call of this process
compiler_runs = 0  # compilations run by this process
_warned: set[str] = set()  # the cache warnings given by this process (each is said once)


def _compiler() -> str | None:
    """The compiler's path: `$CC` when set (None when it names no program: no fallback, see `_no_compiler`), else
    the first of cc, gcc and clang on PATH."""
    chosen = os.environ.get("CC")
    if chosen:
        return shutil.which(chosen)
    return shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _no_compiler() -> str:
    """Why `_compiler()` is None. A `$CC` that names no program is refused rather than replaced: the user chose
    that compiler, and building with another one would hide the mistake."""
    chosen = os.environ.get("CC")
    if chosen:
        return (f"no C compiler: CC={chosen!r} names no program on PATH (CC takes one compiler, no arguments; "
                f"unset CC to use cc, gcc or clang)")
    return "no C compiler found ($CC, cc, gcc, clang)"


@functools.lru_cache(maxsize=None)
def _compiler_version(compiler: str) -> str:
    """The compiler's `--version` output (or how asking failed): part of the cache key, read once per process."""
    try:
        done = subprocess.run([compiler, "--version"], capture_output=True, text=True, errors="replace",
                              timeout=60)  # a name or message that is not UTF-8 is replaced, never raised
    except (OSError, subprocess.SubprocessError) as exc:
        return f"--version failed: {exc}"
    return f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"


@functools.lru_cache(maxsize=None)
def _cpu_description() -> str:
    """The machine and the first processor's model and feature lines of /proc/cpuinfo (when there is one)."""
    lines = [platform.machine()]
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            for line in info:
                if not line.strip():
                    break  # the end of the first processor's block
                field, _, value = line.partition(":")
                if field.strip() in _CPU_FIELDS:
                    lines.append(f"{field.strip()}: {value.strip()}")
    except OSError:
        pass
    if len(lines) == 1:  # no /proc/cpuinfo (macOS, BSD): what the platform module can tell
        lines.append(platform.processor())
    return "\n".join(lines)


def cache_folder() -> Path:
    """Where built libraries are cached: `$HERMES_KERNELS_CACHE`, else `$XDG_CACHE_HOME/hermes_kernels`, else
    `~/.cache/hermes_kernels` (read on every build)."""
    chosen = os.environ.get(CACHE_ENV)
    if chosen:
        return Path(chosen).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hermes_kernels"


def _key(name: str, source: bytes, compiler: str, arch: list[str]) -> str:
    digest = hashlib.sha256()
    for part in (_KEY_FORMAT, name, compiler, _compiler_version(compiler), "\0".join([*_FLAGS, *arch]),
                 _cpu_description()):
        digest.update(part.encode("utf-8", "replace") + b"\0\0")
    digest.update(source)
    return digest.hexdigest()[:32]


def _untrusted(info: os.stat_result, what: str) -> str | None:
    """Why a folder or file with this status is not trusted (owned by another user, or writable by its group or
    others), or None: the rule ssh applies to its files."""
    if info.st_uid != os.geteuid():
        return f"{what} belongs to uid {info.st_uid}, not to this user (uid {os.geteuid()})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{what} is writable by its group or others (mode {stat.S_IMODE(info.st_mode):04o})"
    return None


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=5)  # at the caller of `library`


def _usable_folder() -> Path | None:
    """The cache folder, created 0700 when missing; None when it cannot be created or is not trusted (then
    with a warning that says why)."""
    try:
        folder = cache_folder()
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = os.stat(folder)
    except OSError:  # e.g. a parent that is a file, or no permission
        return None
    reason = _untrusted(info, str(folder))
    if reason is not None:
        _warn_once(f"hermes_kernels: the build cache is not used: {reason}; building in a private temporary "
                   f"folder instead")
        return None
    return folder


def _trusted_file(path: Path) -> bool:
    """Whether a cached library may be loaded: a regular file of this user that its group and others cannot write,
    opened without following a symbolic link. False (with a warning) for one that exists but fails that; False
    (silently) for none."""
    try:
        handle = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return False
    except OSError as exc:  # ELOOP: a symbolic link
        reason = f"{path} is a symbolic link" if os.path.islink(path) else f"{path} cannot be opened: {exc}"
    else:
        try:
            info = os.fstat(handle)
        finally:
            os.close(handle)
        reason = _untrusted(info, str(path)) if stat.S_ISREG(info.st_mode) else f"{path} is not a regular file"
        if reason is None:
            return True
    _warn_once(f"hermes_kernels: a cached library is not loaded: {reason}; building it anew")
    return False


def _record(build: Build) -> Build:
    global last_build
    last_build = build
    return build


@functools.lru_cache(maxsize=None)
def _build(name: str) -> tuple[ctypes.CDLL | None, str | None]:
    compiler = _compiler()
    if compiler is None:
        _record(Build(name, "failed"))
        return None, _no_compiler()
    source = _SOURCE_DIR / f"{name}.c"
    try:
        code = source.read_bytes()
    except OSError as exc:
        _record(Build(name, "failed"))
        return None, f"reading {source} failed: {exc}"
    keys = [_key(name, code, compiler, arch) for arch in _ARCHES]
    folder = _usable_folder()
    if folder is not None:
        for key in keys:
            cached = folder / f"{name}-{key}.so"
            if os.path.lexists(cached):
                # the first library found decides: a corrupt or untrusted one is rebuilt below (once), replacing
                # it (a rename replaces a symbolic link, not its target), never loaded around
                if not _trusted_file(cached):
                    break
                try:
                    library = ctypes.CDLL(str(cached))
                except OSError:
                    break
                _record(Build(name, "cached", str(cached), key, True))
                return library, None
    scratch: list[str] = []
    try:
        return _compile(name, compiler, source, keys, folder, scratch)
    finally:
        for path in scratch:  # the loaded library stays mapped
            shutil.rmtree(path, ignore_errors=True)


def _compile(name: str, compiler: str, source: Path, keys: list[str], folder: Path | None,
             scratch: list[str]) -> tuple[ctypes.CDLL | None, str | None]:
    """Compile `source` with each arch flag in turn until one works; into the cache folder when it is writable
    (a unique file renamed to the final name), else into a temporary folder (appended to `scratch`)."""
    global compiler_runs
    errors, compiles = "", 0
    for arch, key in zip(_ARCHES, keys):
        final = None
        if folder is not None:
            try:
                handle, output = tempfile.mkstemp(dir=folder, prefix=f"{name}-{key}.", suffix=".tmp")
                os.close(handle)
                final = folder / f"{name}-{key}.so"
            except OSError:  # the folder exists but cannot be written: per-process build
                folder = None
        if final is None:
            if not scratch:
                try:
                    scratch.append(tempfile.mkdtemp(prefix="hermes_kernels_"))
                except OSError as exc:
                    _record(Build(name, "failed", None, key, False, compiles))
                    return None, f"no folder to build {name} in: {cache_folder()} is unusable and {exc}"
            output = os.path.join(scratch[0], f"{name}-{key}.so")
        try:
            compiles += 1
            compiler_runs += 1
            done = subprocess.run([compiler, *_FLAGS, *arch, str(source), "-o", output],
                                  capture_output=True, text=True, errors="replace")
        except OSError as exc:
            _unlink(output if final is not None else None)
            _record(Build(name, "failed", None, key, final is not None, compiles))
            return None, f"running {compiler} failed: {exc}"
        if done.returncode != 0:
            _unlink(output if final is not None else None)
            errors = done.stderr.strip()
            continue
        target = output
        if final is not None:
            try:
                os.chmod(output, 0o755)  # the linker may keep mkstemp's 0o600
            except OSError:
                pass
            try:
                os.replace(output, final)  # atomic: another process sees the old file, or none, or this one
                target = str(final)
            except OSError:  # load the uniquely named file instead
                pass
        try:
            library = ctypes.CDLL(target)
        except OSError as exc:  # e.g. a folder mounted noexec
            _unlink(target if target != str(final) else None)
            _record(Build(name, "failed", target, key, final is not None, compiles))
            return None, f"loading the built {Path(target).name} failed: {exc}"
        if final is not None and target != str(final):
            _unlink(target)  # not renamed: loaded under its temporary name, which stays mapped
        _record(Build(name, "built", target, key, final is not None, compiles))
        return library, None
    _record(Build(name, "failed", None, keys[-1], folder is not None, compiles))
    return None, f"{compiler} failed on {source.name}: {errors[-500:]}"


def _unlink(path: str | None) -> None:
    if path is not None:
        try:
            os.unlink(path)
        except OSError:
            pass


def _switched_off() -> bool:
    return os.environ.get(ENV_SWITCH, "1") == "0"


def library(name: str) -> ctypes.CDLL | None:
    """The loaded C library built from hermes_kernels/<name>.c, or None when it cannot be had or is switched off
    (the switch is read on every call; the library is looked up or built once per process, and built once per
    machine when the cache folder is writable)."""
    return None if _switched_off() else _build(name)[0]


def unavailable_reason(name: str) -> str | None:
    """Why `library(name)` is None, or None when it is available."""
    if _switched_off():
        return f"{ENV_SWITCH}=0 in the environment"
    return _build(name)[1]

"""The C build cache of `hermes_kernels.engine.native`: built once per machine, keyed by source, compiler, flags and
CPU, safe under concurrent first builds, still working when the cache folder cannot be used, and a trust boundary: a
library is loaded only from a private folder (docs/security.md). Every test points HERMES_KERNELS_CACHE at its own
tmp folder; the cross-process ones run `python -c` from the checkout."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import warnings

import pytest

from hermes_kernels.engine import native
from tests.utils import REPO

# run in a subprocess: build or load one library, then report what happened as one JSON line
REPORT = """
import json, os, sys, time
import hermes_kernels.engine.native as n
go = os.environ.get("HK_TEST_GO")
if go:  # say "imported", then wait for the starting signal, so that concurrent builds overlap
    open(f"{go}.ready.{os.getpid()}", "w").close()
    while not os.path.exists(go):
        time.sleep(0.002)
name, symbol = sys.argv[1], sys.argv[2]
lib = n.library(name)
b = n.last_build
print(json.dumps(dict(action=b.action, path=b.path, key=b.key, in_cache=b.in_cache, runs=n.compiler_runs,
                      reason=n.unavailable_reason(name), symbol=lib is not None and hasattr(lib, symbol))))
"""


@pytest.fixture(autouse=True)
def needs_a_compiler():
    """Skip without a C compiler (as `tests.utils.require_c_library`), without building anything here."""
    if native._compiler() is None:
        pytest.skip("no C compiler found ($CC, cc, gcc, clang)")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache folder of this test's own, and builds forgotten before and after the test."""
    folder = tmp_path / "cache"
    monkeypatch.setenv(native.CACHE_ENV, str(folder))
    monkeypatch.delenv(native.ENV_SWITCH, raising=False)
    monkeypatch.setattr(native, "_warned", set())
    native._build.cache_clear()
    yield folder
    native._build.cache_clear()


def environment(cache_folder, **extra) -> dict:
    env = {key: value for key, value in os.environ.items() if key != native.ENV_SWITCH}
    env[native.CACHE_ENV] = str(cache_folder)
    env.update(extra)
    return env


def start(name: str, symbol: str, cache_folder, **extra) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", REPORT, name, symbol], cwd=REPO, env=environment(cache_folder,
                            **extra), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def report(process: subprocess.Popen) -> dict:
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def libraries(folder) -> list[str]:
    return sorted(path.name for path in folder.iterdir())


def load(name: str) -> native.Build:
    """Build or load `name` afresh in this process; the library must work."""
    native._build.cache_clear()
    assert native.library(name) is not None, native.unavailable_reason(name)
    return native.last_build


def test_a_second_process_loads_the_cached_library_without_compiling(cache):
    first = report(start("compact_cpu", "hermes_dense_rank", cache))
    assert first["action"] == "built" and first["runs"] == 1 and first["in_cache"], first
    assert first["symbol"] and first["reason"] is None
    assert libraries(cache) == [f"compact_cpu-{first['key']}.so"]
    second = report(start("compact_cpu", "hermes_dense_rank", cache))
    assert second["action"] == "cached" and second["runs"] == 0, second
    assert second["path"] == first["path"] and second["symbol"] and second["reason"] is None
    assert libraries(cache) == [f"compact_cpu-{first['key']}.so"]


def test_a_changed_source_or_flag_builds_anew(cache, tmp_path, monkeypatch):
    original = load("stce_cpu")
    assert original.action == "built" and original.in_cache
    assert load("stce_cpu").action == "cached"
    runs = native.compiler_runs

    edited = tmp_path / "source"
    edited.mkdir()
    text = (native._SOURCE_DIR / "stce_cpu.c").read_text()
    (edited / "stce_cpu.c").write_text(text + "/* one more comment */\n")
    with monkeypatch.context() as patch:
        patch.setattr(native, "_SOURCE_DIR", edited)
        changed = load("stce_cpu")
    assert changed.action == "built" and changed.key != original.key
    assert native.compiler_runs == runs + 1

    with monkeypatch.context() as patch:
        patch.setattr(native, "_FLAGS", [*native._FLAGS, "-DHERMES_KERNELS_TEST_FLAG=1"])
        flagged = load("stce_cpu")
    assert flagged.action == "built" and flagged.key not in (original.key, changed.key)
    assert native.compiler_runs == runs + 2
    assert len(libraries(cache)) == 3
    again = load("stce_cpu")  # the original source and flags: still cached
    assert again.action == "cached" and again.key == original.key


def test_the_key_depends_on_the_cpu_the_compiler_and_the_arch_flag(cache, monkeypatch):
    source = (native._SOURCE_DIR / "stce_cpu.c").read_bytes()
    compiler = native._compiler()
    here = native._key("stce_cpu", source, compiler, ["-march=native"])
    assert native._key("stce_cpu", source, compiler, ["-march=native"]) == here
    assert native._key("stce_cpu", source, compiler, []) != here
    with monkeypatch.context() as patch:
        patch.setattr(native, "_compiler_version", lambda compiler: "cc 99.0 (another one)")
        assert native._key("stce_cpu", source, compiler, ["-march=native"]) != here

    built_here = load("stce_cpu")
    assert built_here.key == here
    monkeypatch.setattr(native, "_cpu_description", lambda: "x86_64\nmodel name: Another CPU\nflags: fpu sse")
    assert native._key("stce_cpu", source, compiler, ["-march=native"]) != here
    elsewhere = load("stce_cpu")
    assert elsewhere.action == "built" and elsewhere.key != here, "a library built for another CPU was loaded"
    assert len(libraries(cache)) == 2


def test_the_cpu_description_names_the_processor():
    described = native._cpu_description()
    assert described.splitlines()[0] == native.platform.machine()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as info:
            first = info.read().split("\n\n")[0]
        for field in ("model name", "flags", "Features", "CPU part"):
            line = next((line for line in first.splitlines() if line.split(":")[0].strip() == field), None)
            if line is not None:
                assert f"{field}: {line.partition(':')[2].strip()}" in described.splitlines()


# a compiler that writes its output slowly: it logs the output path it was given, writes a placeholder there,
# waits, then runs the real compiler on the same arguments (a long window in which a half-written library exists)
SLOW_CC = """#!{python}
import os, sys, time
args = sys.argv[1:]
if "-o" in args:
    output = args[args.index("-o") + 1]
    with open({log!r}, "a") as log:
        log.write(output + "\\n")
    with open(output, "wb") as partial:
        partial.write(b"PARTIAL")
    time.sleep(1.0)
os.execv({real!r}, [{real!r}, *args])
"""


@pytest.mark.parametrize("compiler", ["system", "slow"])
def test_two_concurrent_first_builds_both_succeed_and_leave_one_file(cache, tmp_path, compiler):
    """Two processes start their first build at once on an empty folder: both get a working library, the folder
    ends with the one library of the key and no temporary file, and no half-written file ever has the final name
    (with the slow compiler: each compiled into its own temporary file in the folder, and the folder is watched
    throughout for a placeholder under a final name)."""
    go, extra, log = tmp_path / "go", {}, tmp_path / "cc.log"
    if compiler == "slow":
        wrapper = tmp_path / "slow-cc"
        wrapper.write_text(SLOW_CC.format(python=sys.executable, log=str(log), real=native._compiler()))
        wrapper.chmod(0o755)
        extra["CC"] = str(wrapper)
    processes = [start("stce_cpu", "hermes_stce_rows", cache, HK_TEST_GO=str(go), **extra) for _ in range(2)]
    deadline = time.monotonic() + 120
    while len(list(tmp_path.glob("go.ready.*"))) < 2 and time.monotonic() < deadline:
        assert all(process.poll() is None for process in processes), [report(p) for p in processes]
        time.sleep(0.01)
    go.touch()
    final_name, half_written = re.compile(r"stce_cpu-[0-9a-f]{32}\.so"), set()
    while any(process.poll() is None for process in processes):
        for path in cache.glob("*") if cache.is_dir() else ():
            try:
                if final_name.fullmatch(path.name) and path.read_bytes()[:7] == b"PARTIAL":
                    half_written.add(path.name)
            except OSError:
                pass
        time.sleep(0.005)
    reports = [report(process) for process in processes]
    for got in reports:
        assert got["action"] in ("built", "cached") and got["symbol"] and got["reason"] is None, got
    assert reports[0]["key"] == reports[1]["key"]
    assert not half_written, f"a half-written library had the final name: {half_written}"
    assert libraries(cache) == [f"stce_cpu-{reports[0]['key']}.so"], "a temporary file or a second library is left"
    if compiler == "slow":
        outputs = log.read_text().split()
        assert [got["action"] for got in reports] == ["built", "built"] and len(outputs) == 2
        assert len(set(outputs)) == 2, f"both builds wrote {outputs[0]}"
        for output in outputs:
            assert os.path.dirname(output) == str(cache) and not final_name.fullmatch(os.path.basename(output))
    assert (cache / libraries(cache)[0]).read_bytes()[:4] == b"\x7fELF"
    third = report(start("stce_cpu", "hermes_stce_rows", cache, **extra))
    assert third["action"] == "cached" and third["symbol"], third


def test_a_cache_folder_that_cannot_be_created_still_gives_a_library(tmp_path, monkeypatch, cache):
    blocker = tmp_path / "a file"
    blocker.write_text("not a folder")
    monkeypatch.setenv(native.CACHE_ENV, str(blocker / "cache"))
    build = load("stce_cpu")
    assert build.action == "built" and not build.in_cache
    assert not build.path.startswith(str(blocker)) and not os.path.exists(build.path), "the temporary folder stays"
    assert hasattr(native.library("stce_cpu"), "hermes_stce_rows")
    assert blocker.read_text() == "not a folder"


def test_a_cache_folder_that_cannot_be_written_still_gives_a_library(cache, monkeypatch):
    """Root ignores permission bits, so an unwritable folder is a mkstemp that refuses."""
    cache.mkdir()
    mkstemp = native.tempfile.mkstemp

    def refuse(*args, dir=None, **kwargs):
        if dir is not None and os.path.samefile(dir, cache):
            raise PermissionError(13, "Permission denied", str(dir))
        return mkstemp(*args, dir=dir, **kwargs)
    monkeypatch.setattr(native.tempfile, "mkstemp", refuse)
    build = load("stce_cpu")
    assert build.action == "built" and not build.in_cache and not os.path.exists(build.path)
    assert libraries(cache) == []


def test_a_corrupt_cached_file_is_rebuilt_once(cache):
    source = (native._SOURCE_DIR / "stce_cpu.c").read_bytes()
    key = native._key("stce_cpu", source, native._compiler(), native._ARCHES[0])
    cache.mkdir()
    corrupt = cache / f"stce_cpu-{key}.so"
    corrupt.write_bytes(b"\x7fELF half a library")
    runs = native.compiler_runs
    build = load("stce_cpu")
    assert build.action == "built" and build.path == str(corrupt) and native.compiler_runs == runs + 1
    assert corrupt.read_bytes()[:4] == b"\x7fELF" and corrupt.stat().st_size > 1000
    assert libraries(cache) == [corrupt.name]


def test_a_library_that_never_loads_is_rebuilt_once_then_reported(cache, monkeypatch):
    load("stce_cpu")  # a cached file exists

    def unloadable(path):
        raise OSError(f"{path}: failed to map segment from shared object")
    monkeypatch.setattr(native.ctypes, "CDLL", unloadable)
    runs = native.compiler_runs
    native._build.cache_clear()
    assert native.library("stce_cpu") is None
    assert "failed to map segment" in native.unavailable_reason("stce_cpu")
    assert native.last_build.action == "failed" and native.compiler_runs == runs + 1


def test_the_default_folder_follows_xdg_then_home(monkeypatch, tmp_path):
    monkeypatch.delenv(native.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert native.cache_folder() == tmp_path / "xdg" / "hermes_kernels"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert native.cache_folder() == tmp_path / "home" / ".cache" / "hermes_kernels"
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path / "moved"))
    assert native.cache_folder() == tmp_path / "moved"


def test_clearing_the_folder_clears_the_cache(cache):
    first = load("stce_cpu")
    shutil.rmtree(cache)
    again = load("stce_cpu")
    assert first.action == again.action == "built" and again.key == first.key


def test_a_compiler_without_march_native_builds_and_caches_without_the_arch_flag(cache, tmp_path, monkeypatch):
    no_native = tmp_path / "cc-no-native"
    no_native.write_text(f'#!/bin/sh\ncase "$*" in *-march=native*) echo "unknown -march=native" >&2; exit 1;; esac\n'
                         f'exec {native._compiler()} "$@"\n')
    no_native.chmod(0o755)
    monkeypatch.setenv("CC", str(no_native))
    source = (native._SOURCE_DIR / "stce_cpu.c").read_bytes()
    plain_key = native._key("stce_cpu", source, str(no_native), [])
    first = load("stce_cpu")
    assert first.action == "built" and first.key == plain_key and first.compiles == 2
    assert libraries(cache) == [f"stce_cpu-{plain_key}.so"]
    again = load("stce_cpu")
    assert again.action == "cached" and again.key == plain_key and again.compiles == 0


def test_a_corrupt_cached_library_beside_a_valid_one_is_rebuilt_not_loaded_around(cache):
    """The -march=native key's file is corrupt and the plain key's file is a working library: a new process
    rebuilds the corrupt one (the preferred flag) and does not load the other in its place."""
    first = report(start("stce_cpu", "hermes_stce_rows", cache))
    assert first["key"] == keys_of("stce_cpu")[0], "the compiler rejects -march=native: nothing to compare"
    preferred, fallback = (cache / f"stce_cpu-{key}.so" for key in keys_of("stce_cpu"))
    shutil.copy(preferred, fallback)
    (cache / "corrupt").write_bytes(b"\x7fELF half a library")
    os.replace(cache / "corrupt", preferred)
    second = report(start("stce_cpu", "hermes_stce_rows", cache))
    assert (second["action"], second["key"], second["path"]) == ("built", first["key"], str(preferred)), second
    assert second["runs"] == 1 and second["symbol"] and preferred.stat().st_size > 1000


def test_a_cc_that_names_no_program_gives_no_library_and_says_why(cache, monkeypatch):
    """$CC naming a missing program is not replaced by cc, gcc or clang (which are there): no library, no
    compilation, a reason that names CC, and the torch ops path runs."""
    monkeypatch.setenv("CC", "no-such-compiler-here")
    runs = native.compiler_runs
    native._build.cache_clear()
    assert native._compiler() is None and native.library("stce_cpu") is None
    reason = native.unavailable_reason("stce_cpu")
    assert reason.startswith("no C compiler") and "CC='no-such-compiler-here' names no program" in reason
    assert "unset CC" in reason and native.last_build.action == "failed" and native.compiler_runs == runs
    assert not cache.exists() or libraries(cache) == []
    monkeypatch.delenv("CC")
    native._build.cache_clear()
    assert native.library("stce_cpu") is not None, "unsetting CC brings the fallback compilers back"


# ---- the cache as a trust boundary (docs/security.md) -----------------------------------------------------------
# a library that, when loaded, creates a marker file: it proves whether a planted library ran
PLANTED = """#include <stdio.h>
__attribute__((constructor)) static void planted(void) { FILE *f = fopen(MARKER, "w"); if (f) fclose(f); }
int hermes_stce_rows(void) { return 0; }
int hermes_dense_rank(void) { return 0; }
"""


def keys_of(name: str) -> list[str]:
    source = (native._SOURCE_DIR / f"{name}.c").read_bytes()
    return [native._key(name, source, native._compiler(), arch) for arch in native._ARCHES]


def planted_library(folder, marker) -> str:
    """Compile PLANTED (creating `marker` when loaded) into `folder`; its path."""
    folder.mkdir(exist_ok=True)
    (folder / "planted.c").write_text(PLANTED)
    output = folder / "planted.so"
    subprocess.run([native._compiler(), "-shared", "-fPIC", f'-DMARKER="{marker}"', str(folder / "planted.c"),
                    "-o", str(output)], check=True, capture_output=True, timeout=120)
    return str(output)


def plant(cache, tmp_path, name: str = "stce_cpu", link: bool = False):
    """A planted library under every key of `name` in `cache` (copies, or symbolic links to it with `link`);
    returns the marker file that shows it was loaded."""
    marker = tmp_path / "planted-ran"
    source = planted_library(tmp_path / "planted", marker)
    cache.mkdir(mode=0o700, exist_ok=True)
    for key in keys_of(name):
        target = cache / f"{name}-{key}.so"
        os.symlink(source, target) if link else shutil.copy(source, target)
    return marker


def load_warning(name: str) -> tuple[native.Build, list[str]]:
    """Build or load `name` afresh; the warnings given, as strings."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build = load(name)
    return build, [str(w.message) for w in caught]


def test_the_cache_folder_is_created_private_whatever_the_umask(cache):
    old = os.umask(0)
    try:
        load("stce_cpu")
    finally:
        os.umask(old)
    assert oct(cache.stat().st_mode & 0o777) == oct(0o700)
    assert load("stce_cpu").action == "cached"


def test_a_folder_writable_by_others_is_not_loaded_from(cache, tmp_path):
    """A 0777 cache folder holding a library under the right key: the library never runs; the build goes to a
    private temporary folder, the planted file stays, and one warning says why."""
    marker = plant(cache, tmp_path)
    cache.chmod(0o777)
    before = sorted((path.name, path.read_bytes()) for path in cache.iterdir())
    build, said = load_warning("stce_cpu")
    assert not marker.exists(), "the planted library was loaded"
    assert build.action == "built" and not build.in_cache and not build.path.startswith(str(cache))
    assert sorted((path.name, path.read_bytes()) for path in cache.iterdir()) == before
    assert said == [f"hermes_kernels: the build cache is not used: {cache} is writable by its group or others "
                    f"(mode 0777); building in a private temporary folder instead"]
    assert hasattr(native.library("stce_cpu"), "hermes_stce_rows")


def test_a_group_writable_folder_is_said_once_for_every_library_in_a_new_process(cache, tmp_path):
    """In a second process, both libraries from a 0770 folder: neither planted file runs and stderr has the one
    warning line, once."""
    marker = plant(cache, tmp_path, "stce_cpu")
    plant(cache, tmp_path, "compact_cpu")
    cache.chmod(0o770)
    script = REPORT + "\nprint(json.dumps(dict(other=n.library('compact_cpu') is not None, b=n.last_build.in_cache)))"
    process = subprocess.Popen([sys.executable, "-W", "default", "-c", script, "stce_cpu", "hermes_stce_rows"],
                               cwd=REPO, env=environment(cache), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err
    first, second = (json.loads(line) for line in out.strip().splitlines()[-2:])
    assert first["action"] == "built" and not first["in_cache"] and first["symbol"]
    assert second == {"other": True, "b": False}
    assert not marker.exists(), "a planted library was loaded"
    said = [line for line in err.splitlines() if "hermes_kernels:" in line]
    assert len(said) == 1 and f"{cache} is writable by its group or others (mode 0770)" in said[0], err


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user needs root")
@pytest.mark.parametrize("owned", ["folder", "file"])
def test_a_folder_or_library_of_another_user_is_not_loaded(cache, tmp_path, owned):
    """The cache folder (0700) or the library in it belongs to uid 65534: the planted library never runs. Another
    user's folder: the build goes elsewhere; another user's file in this user's folder: rebuilt in its place."""
    marker = plant(cache, tmp_path)
    for path in [cache] if owned == "folder" else list(cache.iterdir()):
        os.chown(path, 65534, 65534)
    build, said = load_warning("stce_cpu")
    assert not marker.exists(), "the planted library was loaded"
    assert len(said) == 1 and "belongs to uid 65534, not to this user (uid 0)" in said[0]
    if owned == "folder":
        assert build.action == "built" and not build.in_cache and not build.path.startswith(str(cache))
    else:
        assert build.action == "built" and build.in_cache and build.path == str(cache / f"stce_cpu-{build.key}.so")
        assert os.stat(build.path).st_uid == 0 and load("stce_cpu").action == "cached"


@pytest.mark.parametrize("planted", ["symlink", "writable file"])
def test_a_symlink_or_a_writable_file_in_the_cache_is_not_followed(cache, tmp_path, planted):
    """In a trusted folder, the key's name is a symbolic link to a library elsewhere, or a library others may
    write: it never runs; the build replaces the entry with a regular file (the link's target is left alone), and
    the next process loads that."""
    marker = plant(cache, tmp_path, link=planted == "symlink")
    if planted == "writable file":
        for path in cache.iterdir():
            path.chmod(0o666)
    target = (tmp_path / "planted" / "planted.so").read_bytes()
    build, said = load_warning("stce_cpu")
    assert not marker.exists(), "the planted library was loaded"
    assert build.action == "built" and build.in_cache
    reason = "is a symbolic link" if planted == "symlink" else "is writable by its group or others (mode 0666)"
    assert len(said) == 1 and reason in said[0], said
    rebuilt = cache / f"stce_cpu-{build.key}.so"
    assert not rebuilt.is_symlink() and rebuilt.stat().st_mode & 0o022 == 0
    assert (tmp_path / "planted" / "planted.so").read_bytes() == target
    assert load("stce_cpu").action == "cached"
    again = report(start("stce_cpu", "hermes_stce_rows", cache))
    assert again["action"] == "cached" and again["path"] == str(rebuilt) and not marker.exists()

"""hermes_kernels.engine.native's smaller rules, in-process (docs/security.md#native-cache): the reason given when there
is no compiler at all, each cache warning said once, which files the cache loads (a missing one silently not, a folder,
a socket or a group-writable file with a warning naming it), and the builds' fallbacks when the cache folder cannot
be written and the first flag fails, or when no temporary folder can be made."""
from __future__ import annotations

import os
import socket
import warnings

import pytest

from hermes_kernels.engine import native
from tests.hermes_kernels.test_native import cache, load  # noqa: F401 (the fixture, and a fresh build)


def test_no_compiler_on_the_path(monkeypatch, tmp_path):
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert native._compiler() is None
    assert native._no_compiler() == "no C compiler found ($CC, cc, gcc, clang)"


def test_a_cache_warning_is_said_once(monkeypatch):
    monkeypatch.setattr(native, "_warned", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for message in ("first", "first", "second", "first"):
            native._warn_once(message)
    assert [str(w.message) for w in caught] == ["first", "second"]


def _trusted(path, monkeypatch) -> tuple[bool, list[str]]:
    monkeypatch.setattr(native, "_warned", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        verdict = native._trusted_file(path)
    return verdict, [str(w.message) for w in caught]


def test_which_files_the_cache_loads(tmp_path, monkeypatch):
    private = tmp_path / "private.so"
    private.write_bytes(b"\x7fELF")
    private.chmod(0o755)
    assert _trusted(private, monkeypatch) == (True, [])
    assert _trusted(tmp_path / "missing.so", monkeypatch) == (False, [])
    folder = tmp_path / "folder.so"
    folder.mkdir(mode=0o755)
    assert _trusted(folder, monkeypatch) == (False, [f"hermes_kernels: a cached library is not loaded: {folder} is "
                                                     f"not a regular file; building it anew"])
    shared = tmp_path / "shared.so"
    shared.write_bytes(b"\x7fELF")
    shared.chmod(0o775)
    verdict, said = _trusted(shared, monkeypatch)
    assert not verdict and said == [f"hermes_kernels: a cached library is not loaded: {shared} is writable by its "
                                    f"group or others (mode 0775); building it anew"]
    plug = tmp_path / "plug.so"
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(plug))
        verdict, said = _trusted(plug, monkeypatch)
    assert not verdict and len(said) == 1 and f"{plug} cannot be opened: " in said[0]


def test_an_unwritable_folder_and_a_compiler_without_march_native(cache, tmp_path, monkeypatch):  # noqa: F811
    """The cache folder refuses new files and the first flag fails: the second try builds in a private temporary
    folder too, never in the working directory."""
    cache.mkdir()
    no_native = tmp_path / "cc-no-native"
    no_native.write_text(f'#!/bin/sh\ncase "$*" in *-march=native*) echo "unknown -march=native" >&2; exit 1;; esac\n'
                         f'exec {native._compiler()} "$@"\n')
    no_native.chmod(0o755)
    monkeypatch.setenv("CC", str(no_native))
    mkstemp = native.tempfile.mkstemp

    def refuse(*args, dir=None, **kwargs):
        if dir is not None and os.path.abspath(dir) == os.path.abspath(cache):
            raise PermissionError(13, "Permission denied", str(dir))
        return mkstemp(*args, dir=dir, **kwargs)

    monkeypatch.setattr(native.tempfile, "mkstemp", refuse)
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    build = load("stce_cpu")
    assert build.action == "built" and not build.in_cache and build.compiles == 2
    assert os.listdir(work) == [] and os.listdir(cache) == []


def test_no_folder_to_build_in(cache, tmp_path, monkeypatch):  # noqa: F811
    blocker = tmp_path / "a file"
    blocker.write_text("")
    monkeypatch.setenv(native.CACHE_ENV, str(blocker / "cache"))

    def no_temporary(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(native.tempfile, "mkdtemp", no_temporary)
    native._build.cache_clear()
    assert native.library("stce_cpu") is None
    reason = native.unavailable_reason("stce_cpu")
    assert reason.startswith(f"no folder to build stce_cpu in: {blocker / 'cache'} is unusable and ")
    assert "No space left on device" in reason
    build = native.last_build
    assert (build.name, build.action, build.compiles) == ("stce_cpu", "failed", 0)


@pytest.fixture(autouse=True)
def needs_a_compiler():
    if native._compiler() is None:
        pytest.skip("no C compiler found ($CC, cc, gcc, clang)")


def keys_of(name: str, compiler: str) -> list[str]:
    source = (native._SOURCE_DIR / f"{name}.c").read_bytes()
    return [native._key(name, source, compiler, arch) for arch in native._ARCHES]


def script(path, body: str) -> str:
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return str(path)


def test_a_compiler_that_always_fails_leaves_nothing_and_says_its_last_words(cache, tmp_path, monkeypatch):  # noqa: F811
    """Every flag fails: no library, the record names the last key tried, every flag counted, the cache folder
    empty (the temporary outputs removed), and the reason ends with the compiler's last 500 characters of
    error output, as text."""
    words = "x" * 600 + "0123456789"
    monkeypatch.setenv("CC", script(tmp_path / "cc-fails", f'echo "{words}" >&2; exit 1'))
    native._build.cache_clear()
    assert native.library("stce_cpu") is None
    compiler = native._compiler()
    assert native.unavailable_reason("stce_cpu") == f"{compiler} failed on stce_cpu.c: {words[-500:]}"
    keys = keys_of("stce_cpu", compiler)
    assert native.last_build == native.Build("stce_cpu", "failed", None, keys[-1], True, len(native._ARCHES))
    assert os.listdir(cache) == []


def test_a_compiler_that_cannot_run_is_reported_with_the_first_key(cache, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv("CC", script(tmp_path / "cc", "exit 0"))

    def cannot_run(*args, **kwargs):
        raise OSError(8, "Exec format error")
    monkeypatch.setattr(native.subprocess, "run", cannot_run)
    native._build.cache_clear()
    assert native.library("stce_cpu") is None
    compiler = native._compiler()
    assert native.unavailable_reason("stce_cpu") == f"running {compiler} failed: [Errno 8] Exec format error"
    key = keys_of("stce_cpu", compiler)[0]
    assert native.last_build == native.Build("stce_cpu", "failed", None, key, True, 1)
    assert os.listdir(cache) == []


def test_no_folder_to_build_in_is_recorded_with_the_first_key(cache, tmp_path, monkeypatch):  # noqa: F811
    blocker = tmp_path / "a file"
    blocker.write_text("")
    monkeypatch.setenv(native.CACHE_ENV, str(blocker / "cache"))
    monkeypatch.setattr(native.tempfile, "mkdtemp", lambda *a, **k: (_ for _ in ()).throw(OSError(28, "full")))
    native._build.cache_clear()
    assert native.library("stce_cpu") is None
    key = keys_of("stce_cpu", native._compiler())[0]
    assert native.last_build == native.Build("stce_cpu", "failed", None, key, False, 0)


def test_a_built_library_that_does_not_load_stays_in_the_cache_and_is_named(cache, monkeypatch):  # noqa: F811
    """The build renamed into the cache, then loading it fails: the record names the cached file, which stays
    (the next process tries it, and rebuilds it when it does not load)."""
    monkeypatch.setattr(native.ctypes, "CDLL", lambda path: (_ for _ in ()).throw(OSError(f"{path}: no")))
    native._build.cache_clear()
    assert native.library("stce_cpu") is None
    key = keys_of("stce_cpu", native._compiler())[0]
    final = cache / f"stce_cpu-{key}.so"
    assert native.unavailable_reason("stce_cpu") == f"loading the built {final.name} failed: {final}: no"
    assert native.last_build == native.Build("stce_cpu", "failed", str(final), key, True, 1)
    assert os.listdir(cache) == [final.name]


def test_a_library_that_cannot_be_renamed_is_loaded_under_its_temporary_name(cache, monkeypatch):  # noqa: F811
    """The rename into the cache fails: the library is loaded from its unique temporary file, which is then
    removed (it stays mapped), and the record names it."""
    def no_rename(source, target):
        raise OSError(18, "Invalid cross-device link")
    monkeypatch.setattr(native.os, "replace", no_rename)
    build = load("stce_cpu")
    key = keys_of("stce_cpu", native._compiler())[0]
    assert (build.name, build.action, build.key, build.in_cache, build.compiles) == ("stce_cpu", "built", key, True, 1)
    assert build.path.startswith(str(cache / f"stce_cpu-{key}.")) and build.path.endswith(".tmp")
    assert os.listdir(cache) == []


def test_a_cache_folder_under_missing_parents_is_created(cache, tmp_path, monkeypatch):  # noqa: F811
    nested = tmp_path / "a" / "b" / "cache"
    monkeypatch.setenv(native.CACHE_ENV, str(nested))
    build = load("stce_cpu")
    assert build.in_cache and build.path == str(nested / f"stce_cpu-{build.key}.so") and build.name == "stce_cpu"


def test_a_compiler_path_that_is_not_utf8_still_keys_the_cache(cache, tmp_path, monkeypatch):  # noqa: F811
    """A compiler found under a file name that is not UTF-8 (the environment hands it over with surrogate escapes):
    the key is still made and the library built."""
    folder = tmp_path / "bin"
    folder.mkdir()
    odd = os.fsdecode(os.fsencode(str(folder)) + b"/cc-\xff")
    os.symlink(native._compiler(), odd)
    monkeypatch.setenv("CC", odd)
    build = load("stce_cpu")
    assert build.action == "built" and build.key == keys_of("stce_cpu", odd)[0]


def test_compiler_errors_that_are_not_utf8_are_reported(cache, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv("CC", script(tmp_path / "cc-latin1", r"printf 'erreur \351\n' >&2; exit 1"))
    native._build.cache_clear()
    assert native.library("stce_cpu") is None
    assert native.unavailable_reason("stce_cpu").endswith("failed on stce_cpu.c: erreur \ufffd")


@pytest.mark.parametrize("present,chosen", [(("cc", "gcc", "clang"), "cc"), (("gcc", "clang"), "gcc"),
                                            (("clang",), "clang"), (("gcc",), "gcc")])
def test_without_cc_the_first_of_cc_gcc_clang_on_the_path(tmp_path, monkeypatch, present, chosen):
    monkeypatch.delenv("CC", raising=False)
    for name in present:
        script(tmp_path / name, "exit 0")
    monkeypatch.setenv("PATH", str(tmp_path))
    assert native._compiler() == str(tmp_path / chosen)


def test_no_folder_after_a_failed_flag_is_recorded_with_the_second_key(cache, tmp_path, monkeypatch):  # noqa: F811
    """The first flag fails in the cache folder, then the folder refuses the second try's file and no temporary
    folder can be made: the record names the second key, one compilation, not in the cache."""
    real = native._compiler()
    monkeypatch.setenv("CC", script(tmp_path / "cc-no-native",
                                    f'case "$*" in *-march=native*) exit 1;; esac\nexec {real} "$@"'))
    mkstemp, calls = native.tempfile.mkstemp, []

    def second_refused(*args, **kwargs):
        calls.append(kwargs.get("dir"))
        if len(calls) > 1:
            raise PermissionError(13, "Permission denied")
        return mkstemp(*args, **kwargs)
    monkeypatch.setattr(native.tempfile, "mkstemp", second_refused)
    monkeypatch.setattr(native.tempfile, "mkdtemp", lambda *a, **k: (_ for _ in ()).throw(OSError(28, "full")))
    native._build.cache_clear()
    assert native.library("stce_cpu") is None
    keys = keys_of("stce_cpu", native._compiler())
    build = native.last_build
    assert build == native.Build("stce_cpu", "failed", None, keys[1], False, 1) and build.in_cache is False
    assert os.listdir(cache) == []


def test_a_temporary_library_that_neither_renames_nor_loads_is_removed(cache, monkeypatch):  # noqa: F811
    monkeypatch.setattr(native.os, "replace", lambda source, target: (_ for _ in ()).throw(OSError(18, "no")))
    monkeypatch.setattr(native.ctypes, "CDLL", lambda path: (_ for _ in ()).throw(OSError(f"{path}: no")))
    native._build.cache_clear()
    assert native.library("stce_cpu") is None
    build = native.last_build
    assert build.action == "failed" and build.path.endswith(".tmp") and build.in_cache
    assert os.listdir(cache) == []

"""The one ctypes face of the C files (hermes_kernels/engine/bindings.py): every exported C function is declared there
with the argument types of its C prototype, the loaded functions carry them, and no other module of the package calls
into a library with ctypes (native.py only builds and loads)."""
from __future__ import annotations

import ctypes
import pathlib
import re

import pytest
import torch

import hermes_kernels
from hermes_kernels.engine import bindings, native
from tests.utils import require_c_library

PACKAGE = pathlib.Path(hermes_kernels.__file__).parent
ENGINE = PACKAGE / "engine"  # the C files and their bindings
# C parameter type -> the ctypes type a binding declares for it (pointers of any type are data pointers)
C_TYPES = {"int64_t": ctypes.c_int64, "int32_t": ctypes.c_int32, "int": ctypes.c_int}
EXPORTED = re.compile(r"^int (hermes_\w+)\(([^)]*)\)\s*\{", re.MULTILINE)


def exported_functions() -> dict[str, tuple[str, tuple]]:
    """name -> (library, ctypes argument types) of every non-static function of the package's .c files."""
    found = {}
    for source in sorted(ENGINE.glob("*.c")):
        for name, params in EXPORTED.findall(source.read_text()):
            types = tuple(ctypes.c_void_p if "*" in p else C_TYPES[p.split()[-2]] for p in params.split(","))
            found[name] = (source.stem, types)
    return found


def test_every_exported_c_function_is_declared_with_its_prototype_types():
    exported = exported_functions()
    assert len(exported) >= 4, "the prototype pattern found too few C functions: it no longer matches the sources"
    assert {name: (library, tuple(types)) for name, (library, types) in bindings._SIGNATURES.items()} == exported


@pytest.mark.parametrize("name", sorted(bindings._SIGNATURES))
def test_loaded_functions_carry_the_declared_types(name):
    library = bindings._SIGNATURES[name][0]
    require_c_library(library)
    function = bindings._function(name)
    assert function is getattr(native.library(library), name)
    assert tuple(function.argtypes) == bindings._SIGNATURES[name][1] and function.restype is ctypes.c_int


def test_no_module_but_the_bindings_and_the_loader_uses_ctypes():
    users = sorted(str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")
                   if re.search(r"^\s*(import ctypes|from ctypes)", path.read_text(), re.MULTILINE))
    assert users == ["engine/bindings.py", "engine/native.py"]


def test_a_missing_library_is_named_before_any_call(monkeypatch):
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    with pytest.raises(RuntimeError, match=f"stce_cpu.c: hermes_stce_rows cannot run: {native.ENV_SWITCH}=0"):
        bindings._function("hermes_stce_rows")


def test_compact_rows_refuses_an_axis_map_of_another_width_before_the_call(monkeypatch):
    """The rotary pair count the C walk turns is the cos / sin table's width: an axis map of another width (or a sin
    table of another shape) is refused, naming `axis`, before the library is even looked up."""
    monkeypatch.setattr(bindings, "_function", lambda name: pytest.fail("the C function was reached"))
    keys = torch.zeros(1, 1, 1, 4, 16)
    table = torch.ones(3, 4)
    for axis, sin in ((torch.zeros(8, dtype=torch.int32), table), (torch.zeros(4, dtype=torch.int32), table[:, :2])):
        with pytest.raises(ValueError, match=r"^axis: expected \[R/2=4\]"):
            bindings.compact_rows(keys, keys.clone(), 0, torch.zeros(1, 1, 4, dtype=torch.int64),
                                  torch.zeros(1, 1, 1, 4, dtype=torch.int32), 1, axis, table, sin, 0, 1, 0,
                                  torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int32),
                                  torch.zeros(1, dtype=torch.float64), torch.zeros(1, dtype=torch.float64), False)

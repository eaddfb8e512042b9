"""The layers of the tree as docs/layout.md draws them, read from the imports themselves (an AST pass over every
module, relative imports resolved): the policies and the engine under them import no command-line module, and the
kernel library's top level holds the names a reader came for, its plumbing one folder down."""
from __future__ import annotations

import ast
import pathlib

from tests.utils import REPO

# the command layer: parsing, the error contract, file decoding for the commands, the commands themselves
COMMAND_LAYER = ("hermes.cli", "hermes.commands", "hermes.profile_cli", "hermes.__main__", "hermes.video",
                 "hermes.live.command")
# what may sit at the top of hermes_kernels: the package's face (docs/api.md), its version, the rotary layouts
KERNELS_TOP = {"__init__.py", "version.py", "rope.py", "results.py"}


def imports_of(path: pathlib.Path) -> set[str]:
    """The modules `path` imports, absolute (`from . import x` resolved against its package)."""
    module = ".".join(path.relative_to(REPO).with_suffix("").parts)
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            stem = ".".join(base + ([node.module] if node.module else []))
            found.add(stem)
            found |= {f"{stem}.{alias.name}" for alias in node.names}
    return found


def test_no_policy_module_imports_the_command_layer():
    """A policy (its cache, its attention, H2SVC's profiler core) is used by the stream and by the commands; it
    never reaches up into them."""
    offenders = []
    for top in ("hermes/policies", "hermes_kernels"):
        for path in sorted(pathlib.Path(REPO, top).rglob("*.py")):
            wrong = sorted(name for name in imports_of(path) if name.startswith(COMMAND_LAYER))
            if wrong:
                offenders.append(f"{path.relative_to(REPO)}: {wrong}")
    assert not offenders, offenders


def test_the_kernel_library_s_top_level_is_its_face():
    """hermes_kernels' top level: the public package, its version, the rotary layouts and result types of the
    public names, the ops under policies/, the released code's adapter under compat/; everything else (dispatch,
    launch, the C build and its sources, row movers, checks, ...) in one folder of its own."""
    top = pathlib.Path(REPO, "hermes_kernels")
    files = {p.name for p in top.iterdir() if p.is_file() and p.suffix in (".py", ".c")}
    folders = {p.name for p in top.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert files == KERNELS_TOP, sorted(files ^ KERNELS_TOP)
    assert folders == {"policies", "compat", "engine"}, sorted(folders)

"""What `pip install` puts in the wheel: the kernel library and the model glue, every subpackage of both, and nothing
that runs only from the checkout (scaffolding/, tests/, bench/); no installed module imports those
(docs/testing.md#scaffolding). Reads setup.py's package list without installing anything."""
import ast
import os
import pathlib

import setuptools  # noqa: F401 (before distutils: setuptools provides it)
from distutils.core import run_setup

from tests.utils import REPO

INSTALLED = ("hermes_kernels", "hermes")
CHECKOUT_ONLY = ("scaffolding", "tests", "bench")


def setup_packages(monkeypatch) -> list[str]:
    monkeypatch.chdir(REPO)  # find_packages searches the working directory
    return run_setup(os.path.join(REPO, "setup.py"), stop_after="init").packages


def test_setup_installs_both_layers_whole_and_no_checkout_only_package(monkeypatch):
    packages = setup_packages(monkeypatch)
    on_disk = sorted(".".join(init.parent.relative_to(REPO).parts) for top in INSTALLED
                     for init in pathlib.Path(REPO, top).rglob("__init__.py"))
    assert sorted(packages) == on_disk
    assert not [name for name in packages if name.split(".")[0] in CHECKOUT_ONLY], packages
    assert (pathlib.Path(REPO) / "scaffolding" / "__init__.py").is_file()  # the package left out is there to leave


def test_no_installed_module_imports_a_checkout_only_package():
    offenders = []
    for top in INSTALLED:
        for path in sorted(pathlib.Path(REPO, top).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = []
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0:
                    names = [node.module or ""]
                offenders += [f"{path.relative_to(REPO)}:{node.lineno} {name}" for name in names
                              if name.split(".")[0] in CHECKOUT_ONLY]
    assert not offenders, offenders

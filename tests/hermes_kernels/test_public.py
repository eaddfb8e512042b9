"""The kernel library's public names are the ones docs/api.md#public lists for `hermes_kernels`, no more (plumbing
such as launch counters or backend resolution stays importable from its module, outside `__all__`), and the
version has one source."""
import re
from pathlib import Path

import hermes_kernels as hk
from hermes_kernels import version

API = Path(__file__).resolve().parents[2] / "docs" / "api.md"


def documented_public_names() -> set[str]:
    """Backticked names of the rows of the Public table whose module column is exactly `hermes_kernels`."""
    text = API.read_text(encoding="utf-8")
    table = text[text.index("### Public {#public}"):text.index("### Internal {#internal}")]
    names = set()
    for row in table.splitlines():
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        if len(cells) == 2 and re.fullmatch(r"`hermes_kernels`( \(.*\))?", cells[1]):
            names.update(re.findall(r"`(\w+)`", cells[0]))
    return names


def test_all_is_the_documented_public_surface():
    assert set(hk.__all__) == documented_public_names()
    assert len(hk.__all__) == len(set(hk.__all__))
    for name in hk.__all__:
        assert hasattr(hk, name), name


def test_plumbing_is_not_public():
    for name in ("launch_count", "resolve_backend", "BACKENDS", "launch", "pick", "scratch"):
        assert name not in hk.__all__


def test_one_version():
    assert hk.__version__ == version.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+", hk.__version__)
    changelog = (API.parents[1] / "CHANGELOG.md").read_text(encoding="utf-8")
    assert f"## {hk.__version__}" in changelog, "CHANGELOG.md has no entry for the current version"

"""Every pointer the code's docstrings and comments give a reader resolves: each `docs/<page>.md` exists, each
`#anchor` and `§` section after it is on that page, each dotted module path (`hermes_kernels.rope.RotaryLayout`)
imports, each file path exists, and "`file.py`'s `Name`" names something defined in that file.

mkdocs build --strict checks the links inside docs/; this is the same guarantee for the code (docs/testing.md).
"""
from __future__ import annotations

import ast
import functools
import importlib
import io
import re
import tokenize
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SOURCES = ("hermes_kernels", "hermes", "bench", "tests", "scaffolding")
PACKAGES = ("hermes_kernels", "hermes", "bench", "tests", "scaffolding")
# a docs page, with an optional #anchor or a § section right after it
DOC = re.compile(r"docs/([a-z0-9_-]+\.md)(?:#([\w-]+)|,? ?(§[0-9]+(?:\.[0-9]+)*))?")
# a dotted path into one of the packages (not a file name such as docs/hermes.md)
MODULE = re.compile(r"(?<![\w/.-])((?:" + "|".join(PACKAGES) + r")(?:\.[A-Za-z_]\w*)+)")
# a source file path; `policies/h2svc/step.py` style paths are tried under each package too
FILE = re.compile(r"(?<![\w/.-])((?:[\w-]+/)+[\w-]+\.(?:py|c|sh|md))")
# "`path.py`'s `Name`" or "path.py's `Name`": Name must be defined in that file
OWNED = re.compile(r"`?((?:[\w-]+/)*[\w-]+\.py)`?'s `([A-Za-z_]\w*)")
# files of other repositories the docstrings cite (the released HERMES code, github.com/haowei-freesky/HERMES)
EXTERNAL = ("inference/",)


def _python_files() -> list[Path]:
    return sorted(p for root in SOURCES if (REPO / root).is_dir() for p in (REPO / root).rglob("*.py")
                  if "__pycache__" not in p.parts and p != Path(__file__).resolve())  # not this file's examples


def _texts(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every docstring and comment of a Python file."""
    source = path.read_text(encoding="utf-8")
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                found.append((node.body[0].lineno, doc))
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            found.append((token.start[0], token.string))
    return found


def _citations() -> list[tuple[str, str, str]]:
    """(where, kind, target) of every citation; one parametrised check each."""
    cited = []
    for path in _python_files():
        rel = path.relative_to(REPO)
        for line, text in _texts(path):
            flat = " ".join(text.split())  # citations wrap across docstring lines
            where = f"{rel}:{line}"
            for page, anchor, section in DOC.findall(flat):
                cited.append((where, "doc", f"{page}#{anchor}" if anchor else f"{page}{section and ' ' + section}"))
            for module in MODULE.findall(flat):
                cited.append((where, "module", module.rstrip(".")))
            for file in FILE.findall(flat):
                if not file.startswith(("docs/", *EXTERNAL)):
                    cited.append((where, "file", f"{rel}|{file}"))
            for file, name in OWNED.findall(flat):
                cited.append((where, "owned", f"{rel}|{file}|{name}"))
    return sorted(set(cited))


def _slug(heading: str) -> str:
    """The id Python-Markdown's toc extension gives a heading without an explicit {#id}."""
    text = re.sub(r"[^\w\s-]", "", heading).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


@functools.lru_cache(maxsize=None)
def _page(name: str) -> tuple[set[str], list[str]]:
    """(anchors, heading texts) of docs/<name>."""
    anchors, headings = set(), []
    for line in (REPO / "docs" / name).read_text(encoding="utf-8").splitlines():
        match = re.match(r"#+\s+(.*?)\s*(?:\{#([\w-]+)\})?\s*$", line)
        if match:
            headings.append(match[1])
            anchors.add(match[2] or _slug(match[1]))
        anchors.update(re.findall(r'(?:id|name)="([\w-]+)"', line))
    return anchors, headings


def _resolve_file(citing: str, file: str) -> Path | None:
    """The cited file: from the repo root, under each package, or beside the citing file's folders."""
    here = (REPO / citing).parent
    bases = [REPO, *(REPO / p for p in PACKAGES), *here.parents, here]
    for base in bases:
        if (base / file).exists():
            return base / file
    return None


CITATIONS = _citations()


def test_there_are_citations_to_check():
    kinds = {kind for _, kind, _ in CITATIONS}
    assert {"doc", "module", "file"} <= kinds and len(CITATIONS) > 100, CITATIONS[:5]


@pytest.mark.parametrize("where, kind, target", CITATIONS, ids=[f"{w} {k} {t}" for w, k, t in CITATIONS])
def test_citation_resolves(where, kind, target):
    if kind == "doc":
        page, _, rest = target.partition("#") if "#" in target else target.partition(" ")
        assert (REPO / "docs" / page).is_file(), f"{where}: docs/{page} does not exist"
        anchors, headings = _page(page)
        if "#" in target:
            assert rest in anchors, f"{where}: docs/{page} has no anchor #{rest}"
        elif rest:
            assert any(h.startswith(rest + " ") or h == rest for h in headings), \
                f"{where}: docs/{page} has no section {rest}"
    elif kind == "module":
        parts = target.split(".")
        for cut in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            for attr in parts[cut:]:
                assert hasattr(obj, attr), f"{where}: {target}: {'.'.join(parts[:cut])} has no {attr}"
                obj = getattr(obj, attr)
            return
        pytest.fail(f"{where}: {target} does not import")
    elif kind == "file":
        citing, file = target.split("|")
        assert _resolve_file(citing, file) is not None, f"{where}: {file} does not exist"
    else:
        citing, file, name = target.split("|")
        path = _resolve_file(citing, file)
        assert path is not None, f"{where}: {file} does not exist"
        defined = re.search(rf"^\s*(?:class|def)\s+{name}\b|^\s*{name}\s*[:=]", path.read_text(encoding="utf-8"),
                            re.M)
        assert defined, f"{where}: {file} defines no {name}"

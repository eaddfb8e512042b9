"""The README's quick starts run as written and print what their comments say (docs must be true).

Each ```python block of README.md that needs no model checkpoint is executed in a fresh namespace; a line
`print(...)  # expected` must print `expected` (up to a ':' that starts an explanation in the comment).
"""
from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)
# blocks that load a real checkpoint (`from_pretrained(path, ...)`) are examples of use, not runnable here
RUNNABLE = [block for block in BLOCKS if "from_pretrained" not in block]


def test_the_readme_has_runnable_quick_starts():
    assert len(RUNNABLE) >= 2, "README.md lost its ops quick starts"


@pytest.mark.parametrize("block", RUNNABLE, ids=[f"block{i}" for i in range(len(RUNNABLE))])
def test_quick_start_prints_what_it_says(block):
    expected = []
    for line in block.splitlines():
        match = re.match(r"\s*print\(.*\)\s*#\s*(.*)$", line)
        if match:
            expected.append(match[1].split(":")[0].strip())
    assert expected, "a quick start should show what it prints"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block, str(README), "exec"), {})  # noqa: S102 (the README's own code)
    printed = [line.strip() for line in out.getvalue().splitlines()]
    assert printed == expected

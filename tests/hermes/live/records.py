"""The JSON lines of a live run (docs/cli.md#live), read back: `live_main` runs `hermes ARGV --json --quiet` in the
test's process, `records_of` parses stdout, `of_type` picks one kind of record."""
from __future__ import annotations

import json

from hermes import cli


def records_of(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines()]


def live_main(capsys, argv: list[str]) -> tuple[int, list[dict], list[str]]:
    """`hermes ARGV --json --quiet` in this process: exit status, the JSON records on stdout, the stderr lines."""
    status = cli.main([*argv, "--json", "--quiet"])
    out, err = capsys.readouterr()
    return status, records_of(out), err.splitlines()


def of_type(records: list[dict], kind: str) -> list[dict]:
    return [r for r in records if r["type"] == kind]

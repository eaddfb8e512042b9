"""The mutation audit, one module (or a group) at a time: mutmut over the module with the tests that pin it down
(docs/testing.md#mutation-audit). Not run in CI: a whole-tree audit takes hours.

`SELECTIONS` holds each module's test selection (or why it is left out); each run works on a copy of the checkout
in its own folder with a generated `[tool.mutmut]` table and records its row in the results file; mutants judged
equivalent are listed in `bench/mutation_equivalent.toml`. Usage (`python -m bench.mutation ...`), the work folders
and the score: docs/testing.md#per-module.
"""
from __future__ import annotations

import argparse
import datetime
import fnmatch
import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("hermes_kernels", "hermes")
WORK = Path("/tmp/hermes-mutation")
EQUIVALENT = REPO / "bench" / "mutation_equivalent.toml"
# what the copied tests need beside the mutated packages (mutmut copies tests/ itself): the checkout-only package
# scaffolding/ (tiny models, the released-class stand-in), bench/ (its smoke tests), docs/ and the packaging files
ALSO_COPY = ["scaffolding", "bench", "docs", "setup.py", "README.md", "mkdocs.yml", "CHANGELOG.md"]
NOT_TRITON = "not triton"  # the interpreter runs are slow and test the kernels, not these modules
NO_THREADS = "not triton and not thread"  # a forked worker must not start threads (docs/testing.md#how)

# Module (glob) -> the tests that pin it down: pytest arguments, then -k. First match wins. A selection is "fast
# and sufficient": the tests written for the module, plus the callers' tests where only they reach a branch.
KERNEL_POLICIES = ["tests/hermes_kernels/policies", "tests/hermes_kernels/test_rope.py"]
SELECTIONS: list[tuple[str, list[str], str]] = [
    ("hermes_kernels/compat/*.py", ["tests/hermes_kernels/compat"], NOT_TRITON),
    ("hermes_kernels/engine/native.py", ["tests/hermes_kernels/test_native.py",
                                         "tests/hermes_kernels/test_native_edges.py",
                                         "tests/hermes_kernels/test_bindings.py"], NO_THREADS),
    ("hermes_kernels/engine/bindings.py", ["tests/hermes_kernels/test_bindings.py",
                                           "tests/hermes_kernels/test_native.py", *KERNEL_POLICIES], NO_THREADS),
    ("hermes_kernels/engine/dispatch.py", ["tests/hermes_kernels/policies/hermes"], NOT_TRITON),
    ("hermes_kernels/engine/dtypes.py", KERNEL_POLICIES, NOT_TRITON),
    ("hermes_kernels/results.py", KERNEL_POLICIES, NOT_TRITON),
    ("hermes_kernels/engine/workspace.py", ["tests/hermes_kernels/test_ranks.py", *KERNEL_POLICIES], NOT_TRITON),
    ("hermes_kernels/engine/ranks.py", ["tests/hermes_kernels/test_ranks.py", *KERNEL_POLICIES], NOT_TRITON),
    ("hermes_kernels/engine/geometry.py", ["tests/hermes_kernels/test_geometry.py"], NOT_TRITON),
    ("hermes_kernels/engine/checks.py", ["tests/hermes_kernels"], NOT_TRITON),
    ("hermes_kernels/rope.py", KERNEL_POLICIES, NOT_TRITON),
    ("hermes_kernels/engine/rows_*.py", KERNEL_POLICIES, NOT_TRITON),
    ("hermes_kernels/policies/*", KERNEL_POLICIES, NOT_TRITON),
    ("hermes/video.py", ["tests/hermes/test_video.py", "tests/hermes/test_video_edges.py"], NO_THREADS),
    ("hermes/commands.py", ["tests/hermes/test_commands.py", "tests/hermes/test_commands_edges.py",
                            "tests/hermes/test_cli.py", "tests/hermes/test_checkpoints.py"], NO_THREADS),
    ("hermes/cli.py", ["tests/hermes/test_cli.py", "tests/hermes/test_cli_edges.py", "tests/hermes/test_commands.py"],
     NO_THREADS),
    ("hermes/profile_cli.py", ["tests/hermes/test_profile_cli.py", "tests/hermes/policies/h2svc/test_profile.py",
                               "tests/hermes/test_checkpoints.py"], NO_THREADS),
    ("hermes/eval/*.py", ["tests/hermes/eval"], NO_THREADS),
    ("hermes/policies/h2svc/head_map.py", ["tests/hermes/policies/h2svc/test_head_map.py",
                                           "tests/hermes/policies/h2svc/test_profile.py",
                                           "tests/hermes/policies/h2svc/test_policy.py"], NO_THREADS),
    ("hermes/policies/h2svc/tad.py", ["tests/hermes/policies/h2svc/test_tad.py",
                                      "tests/hermes/policies/h2svc/test_profile.py"], NO_THREADS),
    ("hermes/policies/h2svc/*.py", ["tests/hermes/policies/h2svc", "tests/hermes/stream"], NO_THREADS),
    ("hermes/policies/hermes/*.py", ["tests/hermes/policies/hermes", "tests/hermes/stream"], NO_THREADS),
    ("hermes/models/*.py", ["tests/hermes/models", "tests/hermes/test_cli.py"], NO_THREADS),
    ("hermes/linear_state.py", ["tests/hermes/test_linear_state.py", "tests/hermes/models/test_qwen3_5_stream.py",
                                "tests/hermes/stream"], "(qwen3_5 or linear_state) and not triton and not thread"),
    ("hermes/policy.py", ["tests/hermes/test_policy.py", "tests/hermes/test_policy_registry.py",
                          "tests/hermes/stream/test_fifo_policy.py"], NO_THREADS),
    ("hermes/registry.py", ["tests/hermes/test_policy_registry.py", "tests/hermes/test_thirdparty_policy.py",
                            "tests/hermes/test_policy.py"], NO_THREADS),
    ("hermes/attention.py", ["tests/hermes/test_attention.py", "tests/hermes/stream"], NO_THREADS),
    ("hermes/*.py", ["tests/hermes/stream", "tests/hermes/policies"], NO_THREADS),
]
# Modules the audit leaves out, and why.
LEFT_OUT: list[tuple[str, str]] = [
    ("*/__init__.py", "re-exports only"),
    ("hermes/__main__.py", "one call of cli.main"),
    ("hermes_kernels/version.py", "the version string"),
    ("hermes_kernels/engine/launch.py", "Triton launches: their tests run the interpreter (CUDA: bench/gpu_check.sh)"),
    ("hermes_kernels/engine/gpu_specs.py", "the GPU compile guard's registry (CUDA: bench/gpu_check.sh)"),
    ("hermes_kernels/policies/*/gpu_specs.py", "the GPU compile guard's specs (CUDA: bench/gpu_check.sh)"),
    ("hermes_kernels/policies/*/gpu_case.py", "the GPU compile guard's inputs (CUDA: bench/gpu_check.sh)"),
    ("hermes_kernels/policies/hermes/compaction_triton.py", "Triton kernels and their launcher only"),
    ("hermes_kernels/engine/rounding.py", "one @triton.jit helper (its kernels' tests run the interpreter)"),
]


def modules() -> list[str]:
    """Every Python module of both packages, as paths from the checkout."""
    return sorted(str(p.relative_to(REPO)) for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")
                  if "__pycache__" not in p.parts)


def left_out(module: str) -> str | None:
    return next((why for pattern, why in LEFT_OUT if fnmatch.fnmatch(module, pattern)), None)


def selection(module: str) -> tuple[list[str], str]:
    """(test paths, -k expression) of a module; ValueError for a module no rule covers."""
    for pattern, tests, keyword in SELECTIONS:
        if fnmatch.fnmatch(module, pattern):
            found = [t for t in tests if (REPO / t).exists()]
            if not found:  # pytest without paths would run the whole suite
                raise ValueError(f"{module}: none of its tests exists: {tests}")
            return found, keyword
    raise ValueError(f"{module}: no test selection in bench/mutation.py's SELECTIONS")


def expand(argument: str) -> list[str]:
    """The modules one command-line argument names: paths, globs or folders, comma-separated for a group."""
    found = []
    for part in argument.split(","):
        path = REPO / part
        pattern = f"{part.rstrip('/')}/*" if path.is_dir() else part
        matched = [m for m in modules() if fnmatch.fnmatch(m, pattern) and not left_out(m)]
        if not matched:
            raise SystemExit(f"error: {part}: no module to mutate (see --list)")
        found += [m for m in matched if m not in found]
    return found


def changed(base: str) -> list[str]:
    """The audited modules `git diff base` touches (committed or not)."""
    out = subprocess.run(["git", "diff", "--name-only", base], cwd=REPO, check=True, capture_output=True,
                         text=True).stdout.split()
    return [m for m in modules() if m in out and not left_out(m)]


def checkout_files() -> list[str]:
    """Tracked and untracked (not ignored) files of the checkout: what a run's work folder holds."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=REPO,
                         check=True, capture_output=True, text=True).stdout
    return [f for f in out.split("\0") if f and (REPO / f).is_file()]


def _toml_list(values: list[str]) -> str:
    return "[" + ", ".join(json.dumps(v) for v in values) + "]"


def prepare(work: Path, mutate: list[str], tests: list[str], keyword: str) -> None:
    """Copy the checkout into `work` (changed files only, modification times kept: mutmut compares them) and
    write its pyproject.toml with the `[tool.mutmut]` table of this run."""
    work.mkdir(parents=True, exist_ok=True)
    files = checkout_files()
    for root in (work, work / "mutants"):  # a file the checkout no longer has must not be collected or imported
        for top in ("tests", *ALSO_COPY, *PACKAGES):
            for path in (root / top).rglob("*.py") if (root / top).is_dir() else ():
                name = str(path.relative_to(root))
                if name not in files and "__pycache__" not in path.parts:
                    path.unlink()
    for name in files:
        source, target = REPO / name, work / name
        if target.exists() and target.stat().st_mtime == source.stat().st_mtime and \
                target.stat().st_size == source.stat().st_size:
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)
    base = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"].get("mutmut", {})
    patterns = base.get("do_not_mutate_patterns", [])
    table = [
        "[tool.mutmut]",
        f"source_paths = {_toml_list(list(PACKAGES))}",
        f"only_mutate = {_toml_list(mutate)}",
        f"also_copy = {_toml_list(ALSO_COPY)}",
        "do_not_mutate_patterns = [" + ", ".join(f"'{p}'" for p in patterns) + "]",
        f"pytest_add_cli_args = {_toml_list(['-p', 'no:randomly', '-x', '-q', '-k', keyword])}",
        f"pytest_add_cli_args_test_selection = {_toml_list(tests)}",
        f"timeout_multiplier = {float(base.get('timeout_multiplier', 40.0))}",
    ]
    text = (REPO / "pyproject.toml").read_text()
    start = text.find("[tool.mutmut]")
    if start >= 0:  # the checkout's own table, replaced up to the next table
        end = text.find("\n[", start + 1)
        text = text[:start] + (text[end + 1:] if end >= 0 else "")
    os.chmod(work / "pyproject.toml", 0o644)
    (work / "pyproject.toml").write_text(text.rstrip() + "\n\n" + "\n".join(table) + "\n")


STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests", 34: "skipped", 36: "timeout",
          24: "timeout", -24: "timeout", 152: "timeout", 255: "timeout", -11: "crashed", -9: "crashed",
          -6: "crashed", None: "not checked"}


def verdicts(work: Path, module: str) -> dict[str, str]:
    """mutant name -> status, from mutmut's record of the module (mutants/<module>.meta)."""
    meta = work / "mutants" / (module + ".meta")
    if not meta.exists():
        return {}
    codes = json.loads(meta.read_text())["exit_code_by_key"]
    return {name: STATUS.get(code, "suspicious") for name, code in codes.items()}


def equivalent() -> dict[str, str]:
    """mutant name -> the reason group it is judged equivalent under (bench/mutation_equivalent.toml)."""
    if not EQUIVALENT.exists():
        return {}
    groups = tomllib.loads(EQUIVALENT.read_text()).get("group", [])
    return {name: group["reason"] for group in groups for name in group["mutants"]}


def row(module: str, found: dict[str, str], seconds: float | None, judged: dict[str, str]) -> dict:
    """One module's counts; the score is detected / (mutants - equivalent - not run), detected being killed,
    timed out or crashed (a mutated size handed to a C loop)."""
    count = {s: sum(v == s for v in found.values()) for s in
             ("killed", "timeout", "crashed", "survived", "no tests", "skipped", "suspicious", "not checked")}
    survivors = sorted(n for n, v in found.items() if v in ("survived", "suspicious"))
    same = [n for n in survivors if n in judged]
    detected = count["killed"] + count["timeout"] + count["crashed"]
    scored = len(found) - len(same) - count["no tests"] - count["skipped"] - count["not checked"]
    return {"module": module, "mutants": len(found), **count, "equivalent": len(same),
            "score": round(100 * detected / scored, 1) if scored else None, "seconds": seconds,
            "survivors": [n for n in survivors if n not in judged]}


def run(mutate: list[str], work_root: Path, workers: int, timeout: float | None, survivors: bool = False) -> list[dict]:
    """One mutmut run over `mutate` (a module or a group sharing one selection); a row per module. With
    `survivors`, the mutants that survived in this work folder before are tested again (after tests were added)."""
    tests, keywords = [], []
    for module in mutate:
        own, keyword = selection(module)
        tests += [t for t in own if t not in tests]
        keywords.append(keyword)
    keyword = NO_THREADS if NO_THREADS in keywords else keywords[0]
    work = work_root / "+".join(m.replace("/", ".").removesuffix(".py") for m in mutate)
    prepare(work, mutate, tests, keyword)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    command = ["nice", "-n", "19", sys.executable, "-m", "mutmut", "run", "--max-children", str(workers)]
    if survivors:
        again = [n for m in mutate for n, v in verdicts(work, m).items() if v in ("survived", "suspicious")]
        if not again:
            print(f"   {', '.join(mutate)}: no survivors to test again", flush=True)
        command += again
    print(f"== {', '.join(mutate)}: {' '.join(tests)} -k '{keyword}' (work folder {work})", flush=True)
    start = time.perf_counter()
    with open(work / "mutmut.log", "w") as log:
        try:
            subprocess.run(command, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
        except subprocess.TimeoutExpired:
            print(f"   stopped after {timeout:.0f} s: the counts are of the mutants checked by then", flush=True)
    seconds = round(time.perf_counter() - start)
    judged = equivalent()
    rows = []
    for module in mutate:
        found = verdicts(work, module)
        if not found:
            tail = (work / "mutmut.log").read_text(errors="replace")[-1500:]
            print(f"   {module}: no verdicts (a failing clean run?); the end of {work / 'mutmut.log'}:\n{tail}",
                  flush=True)
        rows.append(row(module, found, seconds, judged))  # a group's rows share its run's time
        rows[-1].update(tests=tests, keyword=keyword, group=mutate, date=datetime.date.today().isoformat())
        print(f"   {module}: {table_line(rows[-1])}", flush=True)
    return rows


def table_line(r: dict) -> str:
    score = "" if r["score"] is None else f"{r['score']:.1f} %"
    seconds = "" if r["seconds"] is None else f"{r['seconds'] / 60:.0f} min"
    if len(r.get("group", [])) > 1:
        seconds += f" (a run of {len(r['group'])})"
    return (f"| `{r['module']}` | {r['mutants']} | {r['killed']} | {r['timeout']} | {r['crashed']} | "
            f"{r['survived'] + r['suspicious']} | {r['equivalent']} | {r['no tests']} | {r['not checked']} | {score} | "
            f"{seconds} |")


TABLE_HEAD = ("| module | mutants | killed | timeout | crashed | survived | of which equivalent | no tests | "
              "not run yet | score | time |\n| --- " + "| ---: " * 10 + "|")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.mutation", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("modules", nargs="*", help="module paths, globs or folders; a comma-separated group is one run")
    p.add_argument("--changed", metavar="REV", help="every audited module `git diff REV` touches")
    p.add_argument("--list", action="store_true", help="every module with its selection or why it is left out")
    p.add_argument("--table", action="store_true", help="print the results table of --results")
    p.add_argument("--workers", type=int, default=2, help="mutants tested at once (mutmut --max-children; default 2)")
    p.add_argument("--timeout", type=float, default=None, help="stop a run after this many seconds")
    p.add_argument("--survivors", action="store_true", help="test the survivors of an earlier run again (mutmut "
                   "run NAME ...), e.g. after adding tests; the time recorded is then this run's")
    p.add_argument("--work", type=Path, default=WORK, help=f"work folders' parent (default {WORK})")
    p.add_argument("--results", type=Path, default=None, help="JSON file of the rows, updated per module "
                   "(default: <work>/results.json)")
    args = p.parse_args(argv)
    results_path = args.results or args.work / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    if args.list:
        for module in modules():
            why = left_out(module)
            if why:
                print(f"{module}: left out ({why})")
            else:
                tests, keyword = selection(module)
                print(f"{module}: {' '.join(tests)} -k '{keyword}'")
        return 0
    if args.table:
        judged = equivalent()
        print(TABLE_HEAD)
        for module in sorted(results):
            r = results[module]
            work = args.work / "+".join(m.replace("/", ".").removesuffix(".py") for m in r["group"])
            found = verdicts(work, module)  # re-read: survivors re-tested since (mutmut run NAME) count now
            fresh = row(module, found, r["seconds"], judged) if found else r
            print(table_line(fresh))
        return 0
    runs = [expand(a) for a in args.modules] + ([[m] for m in changed(args.changed)] if args.changed else [])
    if not runs:
        p.error("name modules, --changed REV, --list or --table")
    for group in runs:
        for r in run(group, args.work, args.workers, args.timeout, args.survivors):
            if args.survivors and r["module"] in results:  # the table keeps the full run's time
                r["seconds_survivors"], r["seconds"] = r["seconds"], results[r["module"]]["seconds"]
            results[r["module"]] = r
            results_path.parent.mkdir(parents=True, exist_ok=True)
            results_path.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

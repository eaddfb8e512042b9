"""bench/mutation.py, the per-module mutation driver (docs/testing.md#per-module), without running mutmut: every
module of both packages has a test selection that exists or a reason to be left out, and a run's work folder gets
the `[tool.mutmut]` table of that run."""
import tomllib

import pytest

from bench import mutation


def test_every_module_has_a_selection_or_a_reason():
    for module in mutation.modules():
        if mutation.left_out(module) is None:
            tests, keyword = mutation.selection(module)
            assert tests and all((mutation.REPO / t).exists() for t in tests), module
            assert "not triton" in keyword


def test_a_selection_that_does_not_exist_is_refused(monkeypatch):
    monkeypatch.setattr(mutation, "SELECTIONS", [("hermes/*.py", ["tests/no_such_test.py"], "not triton")])
    with pytest.raises(ValueError, match="none of its tests exists"):
        mutation.selection("hermes/video.py")


def test_the_work_folder_holds_the_checkout_and_the_runs_table(tmp_path):
    mutation.prepare(tmp_path, ["hermes/video.py"], ["tests/hermes/test_video.py"], "not triton")
    assert (tmp_path / "hermes" / "video.py").read_text() == (mutation.REPO / "hermes" / "video.py").read_text()
    assert (tmp_path / "scaffolding" / "standin" / "released.py").exists()
    table = tomllib.loads((tmp_path / "pyproject.toml").read_text())["tool"]["mutmut"]
    assert table["only_mutate"] == ["hermes/video.py"] and table["source_paths"] == ["hermes_kernels", "hermes"]
    assert table["pytest_add_cli_args_test_selection"] == ["tests/hermes/test_video.py"]
    assert table["pytest_add_cli_args"][-2:] == ["-k", "not triton"] and "scaffolding" in table["also_copy"]
    stale = tmp_path / "tests" / "test_gone.py"
    stale.write_text("")
    mutation.prepare(tmp_path, ["hermes/video.py"], ["tests/hermes/test_video.py"], "not triton")
    assert not stale.exists()  # a test the checkout no longer has is not collected


def test_scores_count_detected_over_mutants_not_judged_equivalent():
    found = {"a": "killed", "b": "timeout", "c": "survived", "d": "survived", "e": "no tests", "f": "crashed"}
    row = mutation.row("m.py", found, 60, {"d": "a reason"})
    assert (row["mutants"], row["killed"], row["survived"], row["equivalent"]) == (6, 1, 2, 1)
    assert row["score"] == 75.0 and row["survivors"] == ["c"]  # 3 detected of 6 - 1 equivalent - 1 without tests

"""`lmms-eval --model hermes` through lmms-eval's own command line, in a subprocess, offline, on the local tasks of
tasks.py: the answers in its samples output equal HermesStream driven by hand with the same settings.

One run per (family, policy), each over all three tasks (generate_until, multiple_choice by loglikelihood,
generate_until_multi_round); two of the four runs use --batch_size 2 (videos a and b share a lockstep batch), so
batch 2 is checked against the batch-1 streams of the reference.
"""
from __future__ import annotations

import importlib.metadata
import os
import re
import sys

import pytest

from tests.hermes.eval.tasks import (expected_ll, expected_mc, expected_rounds, ll_docs, mc_docs, model_args,
                                     round_docs, run_lmms_eval, tiny_head_map, write_tasks)

pytestmark = pytest.mark.usefixtures("single_thread")

RUNS = [("llava_onevision", "hermes", 1), ("llava_onevision", "h2svc", 2), ("qwen2_5_vl", "hermes", 2),
        ("qwen2_5_vl", "h2svc", 1)]
IDS = [f"{family}-{policy}-batch{batch}" for family, policy, batch in RUNS]
TASKS = "hermes_mc,hermes_ll,hermes_rounds"


def require_plugin() -> None:
    """Fail (never skip) when lmms-eval or the plugin's entry point is missing: CI must run these tests."""
    command = os.path.join(os.path.dirname(sys.executable), "lmms-eval")
    points = [ep.name for ep in importlib.metadata.entry_points(group="lmms_eval.models")]
    if not os.path.isfile(command) or "hermes" not in points:
        pytest.fail("lmms-eval or the hermes entry point is not installed: run the README's test command "
                    "(pip install ... -e \".[test,model,bench,eval]\" && pip install --no-deps lmms-eval==0.7.3)")


@pytest.fixture(scope="module")
def local_tasks(tmp_path_factory):
    return write_tasks(tmp_path_factory.mktemp("lmms"))


@pytest.fixture(scope="module")
def runs(tiny_checkpoints, local_tasks, tmp_path_factory):
    """(family, policy, batch) -> (completed process, samples by task), each run once, on first use."""
    require_plugin()
    cache = {}

    def get(family, policy, batch):
        key = (family, policy, batch)
        if key not in cache:
            folder = tmp_path_factory.mktemp(f"{family}-{policy}")
            head_map = tiny_head_map(folder, family) if policy == "h2svc" else None
            done, samples = run_lmms_eval(folder, local_tasks["include_path"], TASKS,
                                          model_args(tiny_checkpoints[family], policy, head_map), batch)
            assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
            cache[key] = done, samples, head_map
        return cache[key]
    return get


@pytest.mark.parametrize("family,policy,batch", RUNS, ids=IDS)
def test_offline_answers_equal_the_stream_driven_directly(family, policy, batch, runs, loaded, local_tasks):
    """hermes_mc (generate_until): every readable video's answer equals a fresh batch-1 stream fed the whole video
    (eager re-indexing) and asked the task's prompt with its max_new_tokens, cut at its until string; the corrupt
    video's sample is the empty answer."""
    _, samples, head_map = runs(family, policy, batch)
    expected = expected_mc(loaded[family], mc_docs(local_tasks), policy, head_map)
    assert [s["filtered_resps"] for s in samples["hermes_mc"]] == expected
    assert sum(answer != "" for answer in expected) == 4


@pytest.mark.parametrize("family,policy,batch", RUNS, ids=IDS)
def test_loglikelihood_equals_the_streams_next_token_logits(family, policy, batch, runs, loaded, local_tasks):
    """hermes_ll (multiple_choice): each choice's (negative log-probability, is greedy) equals the stream's
    next-token logits after the question, exactly at batch 1 (lmms-eval writes the floats as their strings). At
    batch 2 the lockstep forwards sum over two rows in another float32 order, so the values move in their last
    bits (by up to 4e-6 on these models); what a score decides is compared there: the greedy flags and the option
    chosen (lmms-eval picks the smallest loss)."""
    _, samples, head_map = runs(family, policy, batch)
    expected = expected_ll(loaded[family], ll_docs(local_tasks), policy, head_map)
    got = [[(float(value), greedy == "True") for value, greedy in s["filtered_resps"]] for s in samples["hermes_ll"]]
    if batch == 1:
        assert got == expected
    else:
        def decisions(scores):
            return [([greedy for _, greedy in doc], min(range(len(doc)), key=lambda i: doc[i][0])) for doc in scores]
        assert decisions(got) == decisions(expected)


@pytest.mark.parametrize("family,policy,batch", RUNS, ids=IDS)
def test_multi_round_answers_equal_the_stream_asked_at_each_time(family, policy, batch, runs, loaded, local_tasks):
    """hermes_rounds (generate_until_multi_round): prefix clips continue one stream, (path, seconds) rounds stream
    up to their time, a round without video asks at once; every answer equals one stream fed the same frames in
    chunks cut at the questions (lazy re-indexing); the request on an unreadable clip answers "" in every round."""
    _, samples, head_map = runs(family, policy, batch)
    expected = expected_rounds(loaded[family], round_docs(local_tasks), policy, head_map)
    assert [s["filtered_resps"] for s in samples["hermes_rounds"]] == expected
    assert [len(answers) for answers in expected] == [3, 3, 2] and all(expected[0] + expected[1])


def test_a_corrupt_video_skips_its_samples_with_one_error_line_and_the_run_goes_on(runs):
    """The unreadable video: one error line per request type that met it (naming the sample, the file and PyAV's
    reason), the run exits 0 with every task's results, and the report says what was streamed and asked."""
    done, samples, _ = runs(*RUNS[0])
    log = done.stdout + done.stderr
    errors = [line for line in log.splitlines() if "hermes: skipped" in line]
    assert len(errors) == 2, errors
    assert "hermes_mc/2 (1 question(s) answered as empty): video: cannot read" in errors[0] + errors[1]
    assert "hermes_rounds/2 (all its rounds answered as empty): video: cannot read" in errors[0] + errors[1]
    assert all("bad.mp4" in line and "ERROR" in line for line in errors)  # loguru level
    assert sorted(samples) == ["hermes_ll", "hermes_mc", "hermes_rounds"]
    reports = set(re.findall(r"hermes: (\S+): (\d+) video\(s\) streamed for (\d+) question\(s\); (\d+) skipped", log))
    # a asked twice, b, c; bad skipped / two videos for nine scored choices / two requests of three rounds each
    assert reports == {("generate_until", "3", "4", "1"), ("loglikelihood", "2", "9", "0"),
                       ("generate_until_multi_round", "2", "6", "1")}

"""Local lmms-eval tasks for the plugin's tests, the command that runs them offline, and the answers of
HermesStream driven by hand with the same settings (imported by the tests of this folder).

`write_tasks(folder)` writes short .mp4 files, an unreadable one, and three tasks over local JSON datasets:
`hermes_mc` (generate_until, multiple-choice prompts; two questions share a video, one video is corrupt),
`hermes_ll` (multiple_choice, scored by loglikelihood over one-token options) and `hermes_rounds`
(generate_until_multi_round: one request on OVO-Bench-style prefix clips, one at timestamps of one file, one
whose first clip is unreadable). Nothing is downloaded.
"""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import numpy as np
import torch

from hermes.eval.requests import cut_answer
from hermes.policies.h2svc.head_map import HeadProfile, save_head_map
from hermes.stream import HermesStream
from hermes.video import VideoReader
from tests.hermes.video_files import write_video
from tests.utils import REPO

# the settings every run here uses: 4-frame chunks at 1 fps, a 20-token HERMES budget (LLaVA-OV's tiny tower gives
# 16 tokens a frame, Qwen2.5-VL's 6 per grid step), so chunks compress from the second one on
FPS, CHUNK_FRAMES, BUDGET, MAX_NEW_TOKENS = 1, 4, 20, 4
CHOICES = ("cup", "ball", "red")
QUESTIONS = ("what is the person holding ?", "where is the ball ?", "what is the man doing ?",
             "is the woman holding a red cup ?", "where is the person ?")


def write_videos(folder) -> dict[str, str]:
    """a and b: 10 samples at 1 fps each (a 4 fps file, b 2 fps: other frames), so they share lockstep batches;
    c: 6 samples; a_3 / a_7: a's first 3 / 7 seconds (prefix clips); bad: not a video."""
    os.makedirs(folder, exist_ok=True)
    paths = {"a": write_video(os.path.join(folder, "a.mp4"), [i / 4 for i in range(40)]),
             "b": write_video(os.path.join(folder, "b.mp4"), [i / 2 for i in range(20)]),
             "c": write_video(os.path.join(folder, "c.mp4"), [i / 4 for i in range(24)]),
             "a_3": write_video(os.path.join(folder, "a_3.mp4"), [i / 4 for i in range(13)]),
             "a_7": write_video(os.path.join(folder, "a_7.mp4"), [i / 4 for i in range(29)])}
    paths["bad"] = os.path.join(folder, "bad.mp4")
    with open(paths["bad"], "wb") as f:
        f.write(b"\x00\x00\x00\x18ftypmp42 this is not a video")
    return paths


def mc_docs(v: dict) -> list[dict]:
    """hermes_mc: a VideoMME-style question with lettered options; a is asked twice, bad once."""
    video_of = [v["a"], v["b"], v["bad"], v["a"], v["c"]]
    return [{"video": path, "question": f"{q}\nA. cup\nB. ball\nanswer with the letter .", "answer": "A"}
            for path, q in zip(video_of, QUESTIONS)]


def ll_docs(v: dict) -> list[dict]:
    return [{"video": path, "question": q, "answer": i % 3} for i, (path, q) in
            enumerate(zip([v["a"], v["b"], v["a"]], QUESTIONS))]


def round_docs(v: dict) -> list[dict]:
    """hermes_rounds: doc 0 asks on a's prefix clips at 3 s and 7 s, then on a itself; doc 1 asks at 2.5 s and
    5 s of c, and once more with no new video; doc 2's first clip cannot be read."""
    return [
        {"rounds": [{"video": v["a_3"], "end": None, "question": QUESTIONS[0]},
                    {"video": v["a_7"], "end": None, "question": QUESTIONS[1]},
                    {"video": v["a"], "end": None, "question": QUESTIONS[2]}], "answer": "x"},
        {"rounds": [{"video": v["c"], "end": 2.5, "question": QUESTIONS[3]},
                    {"video": v["c"], "end": 5.0, "question": QUESTIONS[4]},
                    {"video": None, "end": None, "question": QUESTIONS[0]}], "answer": "x"},
        {"rounds": [{"video": v["bad"], "end": None, "question": QUESTIONS[0]},
                    {"video": v["a"], "end": None, "question": QUESTIONS[1]}], "answer": "x"},
    ]


ROUNDS_UTILS = '''"""doc_to_visual / doc_to_text of the multi-round test task, in lmms-eval's multi-round protocol."""


def visual(r):
    if r["video"] is None:
        return []
    return [r["video"] if r["end"] is None else (r["video"], r["end"])]


def doc_to_visual(doc):
    return visual(doc["rounds"][0])


def doc_to_text(doc, lmms_eval_specific_kwargs=None, previous_output=None, round_idx=None, previous_round_info=None):
    if round_idx is None:
        return doc["rounds"][0]["question"]
    if round_idx == len(doc["rounds"]):
        return None, None, True, previous_output, None
    r = doc["rounds"][round_idx]
    return visual(r), r["question"], False, previous_output, None


def process_results(doc, results):
    answers = results[0] if results and isinstance(results[0], list) else results
    return {"rounds_answered": sum(bool(a) for a in answers) / len(doc["rounds"])}
'''

MC_YAML = """task: hermes_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_visual: video
doc_to_text: question
doc_to_target: answer
generation_kwargs:
  max_new_tokens: {max_new_tokens}
  until: ["?"]
  temperature: 0
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
metadata:
  version: 0.0
"""

LL_YAML = """task: hermes_ll
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_visual: video
doc_to_text: question
doc_to_target: answer
doc_to_choice: {choices}
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 0.0
"""

ROUNDS_YAML = """task: hermes_rounds
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until_multi_round
doc_to_visual: !function utils.doc_to_visual
doc_to_text: !function utils.doc_to_text
doc_to_target: answer
process_results: !function utils.process_results
generation_kwargs:
  max_new_tokens: {max_new_tokens}
  temperature: 0
  do_sample: false
metric_list:
  - metric: rounds_answered
    aggregation: mean
    higher_is_better: true
metadata:
  version: 0.0
"""


def write_tasks(folder) -> dict[str, str]:
    """The videos and the three tasks under `folder` (tasks/ is lmms-eval's --include_path); returns the paths."""
    videos = write_videos(os.path.join(folder, "videos"))
    tasks = os.path.join(folder, "tasks")
    os.makedirs(tasks, exist_ok=True)
    for name, docs, yaml in (("hermes_mc", mc_docs(videos), MC_YAML), ("hermes_ll", ll_docs(videos), LL_YAML),
                             ("hermes_rounds", round_docs(videos), ROUNDS_YAML)):
        data = os.path.join(tasks, f"{name}.json")
        with open(data, "w") as f:
            f.write("\n".join(json.dumps(doc) for doc in docs))
        with open(os.path.join(tasks, f"{name}.yaml"), "w") as f:
            f.write(yaml.format(data=data, max_new_tokens=MAX_NEW_TOKENS, choices=json.dumps(list(CHOICES))))
    with open(os.path.join(tasks, "utils.py"), "w") as f:
        f.write(ROUNDS_UTILS)
    return {**videos, "include_path": tasks}


def tiny_head_map(folder, model_type: str) -> str:
    """An H2SVC head-map file for a tiny checkpoint (4 layers, 2 KV heads; every class in every layer but one)."""
    zeros = torch.zeros(4, 2, dtype=torch.float64)
    profile = HeadProfile(model_name="", model_type=model_type, num_layers=4, num_kv_heads=2, num_heads=4,
                          instant_ratio=0.1, short_ratio=0.4, head_map=torch.tensor([[2, 0], [1, 2], [0, 1], [2, 2]]),
                          v2v=zeros, t2v=zeros, scores=zeros, clips=[], settings={})
    return save_head_map(profile, os.path.join(folder, f"{model_type}.h2svc.json"))


def model_args(checkpoint: str, policy: str, head_map: str | None = None, **extra) -> str:
    """--model_args of a run with the settings above."""
    args = dict(pretrained=checkpoint, fps=FPS, chunk_frames=CHUNK_FRAMES, device="cpu", max_new_tokens=8, **extra)
    args.update(budget=BUDGET) if policy == "hermes" else args.update(policy="h2svc", head_map=head_map)
    return ",".join(f"{key}={value}" for key, value in args.items())


def run_lmms_eval(folder, include_path: str, tasks: str, args: str, batch_size: int = 1):
    """`lmms-eval --model hermes` in a subprocess, offline, one torch thread (the sums of the in-process reference);
    returns (CompletedProcess, {task: samples in doc order})."""
    out = os.path.join(folder, "out")
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HOME=os.path.join(folder, "hf"),
               OMP_NUM_THREADS="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    command = [os.path.join(os.path.dirname(sys.executable), "lmms-eval"), "--model", "hermes", "--model_args", args,
               "--tasks", tasks, "--include_path", include_path, "--batch_size", str(batch_size), "--log_samples",
               "--output_path", out]
    done = subprocess.run(command, env=env, cwd=folder, capture_output=True, text=True, timeout=600)
    samples = {}
    for path in glob.glob(os.path.join(out, "**", "*_samples_*.jsonl"), recursive=True):
        task = path.rsplit("_samples_", 1)[1][:-len(".jsonl")]
        with open(path) as f:
            samples[task] = sorted((json.loads(line) for line in f), key=lambda s: s["doc_id"])
    return done, samples


# ---- HermesStream driven by hand ---------------------------------------------------------------------------------
def new_stream(loaded, frames: np.ndarray, policy: str, head_map: str | None, reindex: str):
    """A batch-1 stream sized from the first chunk (as the `hermes` command sizes it) and its prepared inputs."""
    inputs = loaded.family.prepare_frames(loaded.processor, frames, FPS, start=0.0)
    # the plugin's mapping (EvalSettings.stream_kwargs): another policy than the built-ins gets its own defaults
    policy_args = {"hermes": dict(budget=BUDGET, reindex=reindex),
                   "h2svc": dict(policy="h2svc", head_map=head_map, reindex=reindex)}.get(policy, dict(policy=policy))
    stream = HermesStream(loaded.model, loaded.processor, chunk_frames=CHUNK_FRAMES,
                          frame_size=loaded.family.frame_size(loaded.model, inputs), **policy_args)
    return stream


def samples_of(path: str) -> list[tuple[float, np.ndarray]]:
    """(time, frame) of every frame sampled at FPS."""
    with VideoReader(path) as reader:
        return [(c.times[0], c.frames[0]) for c in reader.chunks(FPS, 1)]


def append(loaded, stream, samples) -> None:
    """Append `samples` in chunks of CHUNK_FRAMES (the last may be shorter)."""
    for i in range(0, len(samples), CHUNK_FRAMES):
        part = samples[i:i + CHUNK_FRAMES]
        frames = np.stack([frame for _, frame in part])
        stream.append_video(**loaded.family.prepare_frames(loaded.processor, frames, FPS, start=part[0][0]))


def offline_stream(loaded, path: str, policy: str, head_map: str | None):
    """A stream holding the whole video of `path`, re-indexed eagerly (the offline default)."""
    samples = samples_of(path)
    stream = new_stream(loaded, np.stack([f for _, f in samples[:CHUNK_FRAMES]]), policy, head_map, "eager")
    append(loaded, stream, samples)
    return stream


def expected_mc(loaded, docs: list[dict], policy: str, head_map: str | None) -> list[str]:
    """hermes_mc's answers: each readable video streamed, its question asked, cut at "?" ("" for the bad one)."""
    answers = []
    for doc in docs:
        if doc["video"].endswith("bad.mp4"):
            answers.append("")
            continue
        stream = offline_stream(loaded, doc["video"], policy, head_map)
        answers.append(cut_answer(stream.ask(doc["question"], max_new_tokens=MAX_NEW_TOKENS), ["?"]))
    return answers


def expected_ll(loaded, docs: list[dict], policy: str, head_map: str | None) -> list[list[tuple[float, bool]]]:
    """hermes_ll's (negative log-probability, is greedy) per doc and choice, from the stream's next-token logits."""
    tokenizer = loaded.processor.tokenizer
    out = []
    for doc in docs:
        logits = offline_stream(loaded, doc["video"], policy, head_map).next_token_logits(doc["question"])[0].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        ids = [tokenizer(choice, add_special_tokens=False)["input_ids"] for choice in CHOICES]
        assert all(len(i) == 1 for i in ids)
        out.append([(-logprobs[i[0]].item(), bool(logits.argmax() == i[0])) for i in ids])
    return out


def expected_rounds(loaded, docs: list[dict], policy: str, head_map: str | None) -> list[list[str]]:
    """hermes_rounds' answers: each round streams the frames sampled after the last streamed one, up to its end
    (a prefix clip: to the clip's end), in chunks of CHUNK_FRAMES cut at the question, then asks; lazily
    re-indexed (the streaming default). A doc whose first clip is unreadable answers "" in every round."""
    out = []
    for doc in docs:
        if doc["rounds"][0]["video"].endswith("bad.mp4"):
            out.append([""] * len(doc["rounds"]))
            continue
        stream, last, answers = None, -1.0, []
        for r in doc["rounds"]:
            if r["video"] is not None:
                new = [(t, f) for t, f in samples_of(r["video"]) if t > last and (r["end"] is None or t <= r["end"])]
                if stream is None:
                    stream = new_stream(loaded, np.stack([f for _, f in new[:CHUNK_FRAMES]]), policy, head_map,
                                        "lazy")
                append(loaded, stream, new)
                last = new[-1][0] if new else last
            answers.append(cut_answer(stream.ask(r["question"], max_new_tokens=MAX_NEW_TOKENS), ()))
        out.append(answers)
    return out

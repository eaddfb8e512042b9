"""Gemma 4 through its saved tiny checkpoint: `python -m hermes --model DIR` under both policies (dense and MoE),
`hermes --live` on a loopback TCP stream with a question asked while it plays, and `hermes-profile`
routing the full-attention layers that compute keys, its streamed TADs equal to the reference on transformers' own
eager attention maps of the whole sequence (sliding windows, vision blocks and KV-shared layers as the model runs
them; docs/gemma4.md)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from hermes import cli
from hermes.attention import attention_implementation
from hermes.commands import load_model
from hermes.models.gemma4 import Gemma4, chunk_layout, frame_text
from hermes.policies.h2svc.head_map import load_head_map
from hermes.policies.h2svc.profile import profile_heads
from hermes.window import cache_kv_heads, cache_layers
from hermes_kernels.policies.h2svc.reference import tad_t2v, tad_v2v
from scaffolding.checkpoint import save_tiny_checkpoint
from tests.hermes.live.records import live_main, of_type
from tests.hermes.live.servers import TcpServer, ts_chunks
from tests.hermes.streams import QUESTION
from tests.hermes.video_files import write_video
from tests.utils import REPO, assert_close_verbose

pytestmark = pytest.mark.usefixtures("single_thread")

RUN = ["--fps", "1", "--chunk-frames", "2", "--budget", "30", "--max-new-tokens", "3", "--question", QUESTION]
ENV = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
# float32 probabilities summed into TADs of size ~1: the two paths differ by float32 rounding only (as for the other
# families' profiler test, tests/hermes/policies/h2svc/test_profile.py)
TAD_TOL = dict(atol=2e-6, rtol=2e-6)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    """"gemma4" (dense) and "gemma4_moe" (the MoE block beside each MLP) -> tiny checkpoint folder, positions raised
    to 16384: H2SVC's default episodic window (64 frames of 70 tokens) needs more than the tiny model's 4096."""
    folders = {}
    for variant in ("gemma4", "gemma4_moe"):
        folder = folders[variant] = save_tiny_checkpoint(tmp_path_factory.mktemp(variant), variant)
        path = os.path.join(folder, "config.json")
        with open(path) as f:
            config = json.load(f)
        config["text_config"]["max_position_embeddings"] = 16384
        with open(path, "w") as f:
            json.dump(config, f)
    return folders


@pytest.fixture(scope="module")
def checkpoint(checkpoints):
    return checkpoints["gemma4"]


@pytest.fixture(scope="module")
def video(tmp_path_factory):
    return write_video(tmp_path_factory.mktemp("videos") / "cfr.mp4", [i / 4 for i in range(24)])  # 6 s at 4 fps


@pytest.mark.parametrize("variant", ["gemma4", "gemma4_moe"])
def test_the_command_streams_the_checkpoint(variant, checkpoints, video):
    """`python -m hermes` on the saved checkpoint, dense and MoE: exit 0, three chunks of 2 frames, the later ones
    compressing, and an answer; H2SVC in this process on the same checkpoint steps every chunk and answers."""
    checkpoint = checkpoints[variant]
    loaded = load_model(checkpoint, device="cpu")
    assert loaded.model.config.text_config.enable_moe_block == (variant == "gemma4_moe")
    done = subprocess.run([sys.executable, "-m", "hermes", "--model", checkpoint, "--video", video, *RUN,
                           "--device", "cpu", "--threads", "1", "--json", "--quiet"], env=ENV, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in done.stdout.splitlines()]
    chunks = [r for r in records if r["type"] == "chunk"]
    assert [r["frames"] for r in chunks] == [2, 2, 2] and any(r["compressed"] for r in chunks)
    assert records[-1]["type"] == "answer"
    with pytest.warns(UserWarning, match="not profiled"):
        h2svc = cli.run(loaded, video, questions=[QUESTION], fps=1, chunk_frames=2, policy="h2svc", max_new_tokens=2)
    assert [r["type"] for r in h2svc] == ["chunk"] * 3 + ["answer"]


@pytest.mark.parametrize("policy", ["hermes", "h2svc"])
def test_live_tcp_answers_while_it_plays(policy, checkpoint, capsys):
    """`hermes --live tcp://127.0.0.1:PORT` on the checkpoint: 6 s of MPEG-TS at 4 fps sampled at 2, chunks of 4
    samples, the first question asked at 1 s (answered after the first chunk, seen 1.5 s), the --question at the
    end; nothing dropped (--max-lag 60: the server does not pace), the stream compressing past its budget."""
    early = "where is the ball ?"
    with TcpServer([(ts_chunks(24, 4), "close")]) as server:
        status, records, err = live_main(capsys, [
            "--model", checkpoint, "--live", server.url, "--fps", "2", "--chunk-frames", "4", "--budget", "30",
            "--max-new-tokens", "3", "--max-lag", "60", "--policy", policy, "--device", "cpu", "--threads", "1",
            "--ask-at", f"1:{early}", "--question", QUESTION])
    assert status == 0, err
    assert any("head_map: not profiled" in line for line in err) == (policy == "h2svc")
    assert [(r["type"], r.get("question")) for r in records] == [
        ("chunk", None), ("answer", early), ("chunk", None), ("chunk", None), ("answer", QUESTION), ("ended", None),
        ("summary", None)]
    chunks = of_type(records, "chunk")
    assert [(r["start"], r["end"], r["frames"], r["dropped"]) for r in chunks] == [
        (0.0, 1.5, 4, 0), (2.0, 3.5, 4, 0), (4.0, 5.5, 4, 0)]
    assert [r["seen"] for r in of_type(records, "answer")] == [1.5, 5.5]
    assert chunks[-1]["compressed"] and records[-1]["dropped"] == 0 and records[-2]["reason"] == "end of stream"


def reference_tads(model, processor, clip: np.ndarray, chunk_frames: int):
    """(tad_v2v, tad_t2v) float64 [L, Hkv] of one clip, L the layers the caches hold, from transformers' eager
    attention maps of the whole sequence (prefix, every chunk laid out as the processor lays out a video, the
    question) through the full model (its own masks: sliding windows, vision blocks, KV sharing)."""
    family, tok, config = Gemma4(), processor.tokenizer, model.config
    ids = tok(family.prefix_text(None), add_special_tokens=False)["input_ids"]
    frame_of_token, pixels, positions = [-1] * len(ids), [], []
    for start in range(0, len(clip), chunk_frames):
        inputs = family.prepare_frames(processor, clip[start:start + chunk_frames], 1.0, start=float(start))
        stamps = [tok(frame_text(t), add_special_tokens=False)["input_ids"] for t in inputs["timestamps"]]
        patches = int((inputs["video_position_ids"][0] != -1).all(-1).sum())
        soft = patches // config.vision_config.pooling_kernel_size ** 2
        chunk = chunk_layout(stamps, soft, boi=config.boi_token_id, eoi=config.eoi_token_id,
                             video_token=config.video_token_id)[0].tolist()
        per_frame = len(chunk) // len(stamps)
        frame_of_token += [start + t // per_frame for t in range(len(chunk))]
        ids += chunk
        pixels.append(inputs["video"])
        positions.append(inputs["video_position_ids"])
    question = tok(family.question_text(QUESTION), add_special_tokens=False)["input_ids"]
    input_ids = torch.tensor([ids + question])
    with torch.no_grad(), attention_implementation(model, "eager"):
        out = model.model(input_ids=input_ids, mm_token_type_ids=2 * (input_ids == config.video_token_id).long(),
                          pixel_values_videos=torch.cat(pixels), video_position_ids=torch.cat(positions),
                          num_frames_per_video=torch.tensor([len(clip)]), output_attentions=True)
    probs = torch.stack([out.attentions[layer][0] for layer in cache_layers(config)])
    frames = torch.tensor(frame_of_token + [-1] * len(question))
    text = torch.arange(len(frame_of_token), len(frames))
    kv_heads = cache_kv_heads(config)
    return tad_v2v(probs, frames, kv_heads), tad_t2v(probs, frames, text, kv_heads)


def test_the_profiler_routes_the_full_layers_and_equals_the_full_maps(checkpoint, video, tmp_path):
    """hermes-profile on the checkpoint writes a map with a row per full-attention layer that computes keys (2 of the
    7 decoder layers), which a stream of the model loads; in process, a clip of 5 frames in chunks of 2 with one
    question: TAD_V2V and TAD_T2V equal the reference on the whole sequence's eager attention maps."""
    out = tmp_path / "map.json"
    done = subprocess.run(
        [sys.executable, "-m", "hermes.profile_cli", "--model", checkpoint, "--videos", video, "--out", str(out),
         "--chunk-frames", "2", "--question", QUESTION, "--threads", "1", "--quiet"],
        cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    loaded = load_model(checkpoint, device="cpu")
    profile = load_head_map(out, loaded.model)
    assert profile.num_layers == len(profile.head_map) == 2 == len(cache_layers(loaded.model.config))
    clip = np.random.default_rng(0).integers(0, 256, (5, 16, 16, 3), dtype=np.uint8)
    profile = profile_heads(loaded.model, loaded.processor, [clip], fps=1, chunk_frames=2, questions=[QUESTION],
                            query_block=5, progress=False)
    v2v, t2v = reference_tads(loaded.model, loaded.processor, clip, 2)
    assert_close_verbose(torch.tensor(profile.clips[0]["tad_v2v"], dtype=torch.float64), v2v, name="V2V", **TAD_TOL)
    assert_close_verbose(torch.tensor(profile.clips[0]["tad_t2v"], dtype=torch.float64), t2v, name="T2V", **TAD_TOL)

"""The H2SVC head profiler (`hermes.policies.h2svc.profile`) and head-map files (`hermes.policies.h2svc.head_map`) on
tiny LLaVA-OV and Qwen2.5-VL checkpoints saved with save_pretrained, over synthetic .mp4 files and frame arrays.

The key check: the profiler's streamed reduction (eager attention per query block, folded into TAD sums, chunk
by chunk through a DynamicCache) equals the reference `tad_v2v` / `tad_t2v` applied to the full [L, H, S, S]
probabilities of transformers' own eager attention (`output_attentions=True`) over the whole sequence, whose
positions and frame indices the test lays out itself. One run of the real command in a subprocess; the rest
in-process.
"""
import json
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

from scaffolding.models import tiny_llava_ov
from hermes_kernels.policies.h2svc.config import H2SVCConfig, class_counts
from hermes.policies.h2svc.head_map import load_head_map, save_head_map
from hermes.policies.h2svc import profile as profiler
from hermes.policies.h2svc import tad
from hermes.policies.h2svc.head_map import FORMAT
from hermes.policies.h2svc.profile import profile_heads
from hermes.profile_cli import main
from hermes_kernels.policies.h2svc.reference import classify_heads, head_scores, tad_t2v, tad_v2v
from hermes.attention import attention_name
from hermes.models import family_of
from hermes.video import VideoClip, VideoReader
from tests.utils import REPO, assert_close_verbose, error_line
from tests.hermes.video_files import frame_image, write_video

pytestmark = pytest.mark.usefixtures("single_thread")

FAMILIES = ("llava_onevision", "qwen2_5_vl")
QUESTIONS = ("what is the person holding ?", "where is the ball ?")
# float32 probabilities summed into TADs of size ~1: the two paths differ by float32 rounding only
TAD_TOL = dict(atol=2e-6, rtol=2e-6)




@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("videos")
    corrupt = folder / "corrupt.mp4"
    corrupt.write_bytes(b"\x00\x00\x00\x18ftypmp42 this is not a video" * 8)
    return {"clip": write_video(folder / "clip.mp4", [i / 4 for i in range(28)]),  # 7 samples at 1 fps
            "corrupt": str(corrupt)}


def frames_array(count: int, offset: int = 40) -> np.ndarray:
    """uint8 [count, 48, 64, 3] frames already sampled (a clip given as an array)."""
    return np.stack([frame_image(offset + i) for i in range(count)])


# ---- the reference side, laid out independently of the profiler -----------------------------------------------
def encoded_chunks(model, processor, chunks, fps):
    """[(embeds [1, T, hidden], rel positions or None, frames n_c, tokens per frame)] through the family's
    processor and vision path; frames counted from the processor's own output (LLaVA-OV: video frames,
    Qwen2.5-VL: temporal grid steps)."""
    family = family_of(model)
    out = []
    for frames in chunks:
        inputs = family.prepare_frames(processor, frames, fps)
        if "grid_thw" in inputs:
            count = int(inputs["grid_thw"][0, 0])
        else:
            count = inputs["video"].shape[1]
        chunk = family.encode_video(model, processor, inputs.pop("video"), 1, **inputs)
        out.append((chunk.embeds, chunk.rel_positions, count, chunk.embeds.shape[1] // count))
    return out


def layout_positions(prefix_len: int, chunks, tail_len: int, mrope: bool) -> torch.Tensor:
    """Positions of prefix + chunks + tail as one sequence: each segment starts at the largest position so far
    + 1, video chunks at their relative offsets; [1, S] or [3, 1, S]."""
    pieces = [torch.arange(prefix_len).expand(3, -1)]
    for embeds, rel, _, _ in chunks:
        start = int(pieces[-1].max()) + 1
        pieces.append(start + (torch.arange(embeds.shape[1]).expand(3, -1) if rel is None else rel))
    pieces.append(int(pieces[-1].max()) + 1 + torch.arange(tail_len).expand(3, -1))
    positions = torch.cat(pieces, dim=1)
    return positions[:, None] if mrope else positions[:1]


def eager_probs(model, embeds, positions) -> tuple[torch.Tensor, torch.Tensor]:
    """(probabilities float32 [L, H, S, S] of one sequence from transformers' eager attention, last-token logits)."""
    before = attention_name(model.config.get_text_config())
    model.set_attn_implementation({"text_config": "eager"})
    try:
        with torch.no_grad():
            out = model.model.language_model(inputs_embeds=embeds, position_ids=positions, output_attentions=True)
            logits = model.get_output_embeddings()(out.last_hidden_state[:, -1])
    finally:
        model.set_attn_implementation({"text_config": before})
    return torch.stack([a[0] for a in out.attentions]), logits


def reference_tads(model, processor, chunks, fps, questions, answer_tokens):
    """(tad_v2v, tad_t2v) float64 [L, Hkv] of one clip from full attention maps: V2V from the sequence of the
    first question, T2V the mean over the questions, each question followed by its greedy answer tokens (found
    here by full forwards, stopping before end-of-sequence)."""
    family = family_of(model)
    tok = processor.tokenizer
    embed = model.get_input_embeddings()
    layout = family.rotary(model)[1]
    mrope = layout is not None and layout.num_axes == 3
    Hkv = model.config.get_text_config().num_key_value_heads
    prefix = tok(family.prefix_text(None), add_special_tokens=False)["input_ids"]
    encoded = encoded_chunks(model, processor, chunks, fps)
    frame_of_token = [-1] * len(prefix)
    seen = 0
    for embeds, _, count, per_frame in encoded:
        frame_of_token += [seen + t // per_frame for t in range(embeds.shape[1])]
        seen += count
    v2v, t2v = None, []
    for question in questions:
        tail = tok(family.question_text(question), add_special_tokens=False)["input_ids"]
        question_len = len(tail)
        while True:
            ids = torch.tensor([prefix]), torch.tensor([tail])
            embeds = torch.cat([embed(ids[0])] + [e for e, _, _, _ in encoded] + [embed(ids[1])], dim=1)
            probs, logits = eager_probs(model, embeds, layout_positions(len(prefix), encoded, len(tail), mrope))
            token = int(logits.argmax())
            if len(tail) - question_len == answer_tokens or token == tok.eos_token_id:
                break
            tail = tail + [token]
        frames = torch.tensor(frame_of_token + [-1] * len(tail))
        text = torch.arange(len(frame_of_token), len(frames))
        if v2v is None:
            v2v = tad_v2v(probs, frames, Hkv)
        t2v.append(tad_t2v(probs, frames, text, Hkv))
    return v2v, torch.stack(t2v).mean(dim=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_streamed_tad_equals_reference_on_full_attention_maps(loaded, files, family):
    """Two clips (an .mp4 decoded at 1 fps and a frame array), 3-frame chunks (odd: Qwen2.5-VL pads the last
    grid step of each chunk), query blocks of 5 rows, two questions with 2 greedy answer tokens each: every clip's
    TAD_V2V / TAD_T2V equal the reference on full eager attention maps; the profile's metrics are their means
    over clips, S and the map follow from them; the model's attention implementation is left as it was."""
    model, processor = loaded[family].model, loaded[family].processor
    before = attention_name(model.config.get_text_config())
    array = frames_array(5)
    profile = profile_heads(model, processor, [VideoClip(files["clip"]), array], fps=1, chunk_frames=3,
                            questions=QUESTIONS, answer_tokens=2, query_block=5, progress=False)
    assert attention_name(model.config.get_text_config()) == before

    with VideoReader(files["clip"]) as reader:
        decoded = [chunk.frames for chunk in reader.chunks(1, 3)]
    assert [len(c) for c in decoded] == [3, 3, 1]
    expected = [reference_tads(model, processor, chunks, 1.0, QUESTIONS, 2)
                for chunks in (decoded, [array[:3], array[3:]])]
    for index, (clip, (v2v, t2v)) in enumerate(zip(profile.clips, expected)):
        assert_close_verbose(torch.tensor(clip["tad_v2v"], dtype=torch.float64), v2v, name=f"clip {index} V2V",
                             **TAD_TOL)
        assert_close_verbose(torch.tensor(clip["tad_t2v"], dtype=torch.float64), t2v, name=f"clip {index} T2V",
                             **TAD_TOL)
        assert clip["text_queries"] > 2 * 2  # the question tokens and the answer tokens of both questions
    v2v = torch.stack([v for v, _ in expected]).mean(dim=0)
    t2v = torch.stack([t for _, t in expected]).mean(dim=0)
    assert_close_verbose(profile.v2v, v2v, name="mean V2V", **TAD_TOL)
    assert_close_verbose(profile.t2v, t2v, name="mean T2V", **TAD_TOL)
    assert_close_verbose(profile.scores, head_scores(v2v, t2v), name="S(h)", atol=1e-4, rtol=0)
    assert torch.equal(profile.head_map, classify_heads(profile.scores))
    per_frame = 16 if family == "llava_onevision" else 3 * 4  # 16 x 16 tower / 12 x 16 px Qwen frames
    memory_frames = [7, 5] if family == "llava_onevision" else [2 + 2 + 1, 2 + 1]
    assert [c["tokens_per_frame"] for c in profile.clips] == [per_frame] * 2
    assert [c["memory_frames"] for c in profile.clips] == memory_frames
    assert [c["frames"] for c in profile.clips] == [7, 5]


def test_query_blocks_and_max_frames(loaded, files, monkeypatch):
    """The reduction only ever sees blocks of query rows: by default as many rows as fit BLOCK_BYTES (here the
    whole forward), with BLOCK_BYTES = 1 one row at a time, and the sums agree. max_frames cuts the clip (whole
    chunks, then part of one) as profiling the cut frames given as an array does."""
    model, processor = loaded["llava_onevision"].model, loaded["llava_onevision"].processor
    args = dict(fps=1, chunk_frames=4, questions=QUESTIONS[:1], progress=False)
    blocks = []
    add = profiler.TADSums.add
    monkeypatch.setattr(profiler.TADSums, "add", lambda self, layer, probs, rows: (
        blocks.append((tuple(probs.shape), rows.stop - rows.start)), add(self, layer, probs, rows)))
    whole = profile_heads(model, processor, [VideoClip(files["clip"])], max_frames=6, **args)
    family = family_of(model)
    prefix, question = (len(processor.tokenizer(text)["input_ids"])
                        for text in (family.prefix_text(None), family.question_text(QUESTIONS[0])))
    # per layer (4 of 4 query heads): the prefix, chunks of 4 and 2 frames of 16 tokens, the question
    assert [rows for _, rows in blocks] == [prefix] * 4 + [4 * 16] * 4 + [2 * 16] * 4 + [question] * 4
    assert all(shape[:2] == (4, rows) for shape, rows in blocks)
    blocks.clear()
    monkeypatch.setattr(tad, "BLOCK_BYTES", 1)
    by_rows = profile_heads(model, processor, [VideoClip(files["clip"])], max_frames=6, **args)
    assert {rows for _, rows in blocks} == {1} and len(blocks) == 4 * (prefix + 6 * 16 + question)
    assert_close_verbose(by_rows.v2v, whole.v2v, name="V2V by rows vs one block", **TAD_TOL)
    assert_close_verbose(by_rows.t2v, whole.t2v, name="T2V by rows vs one block", **TAD_TOL)
    with VideoReader(files["clip"]) as reader:
        frames = np.concatenate([chunk.frames for chunk in reader.chunks(1, 4)])[:6]
    cut = profile_heads(model, processor, [frames], **args)
    assert whole.clips[0]["frames"] == 6 and whole.clips[0]["memory_frames"] == 6
    assert_close_verbose(cut.v2v, whole.v2v, name="max_frames vs the cut array", **TAD_TOL)


@pytest.mark.parametrize("ratios,counts", [((0.1, 0.4), (1, 3, 4)), ((0.25, 0.5), (2, 4, 2)), ((0.0, 0.0), (0, 0, 8))])
def test_classification_counts(loaded, ratios, counts):
    """8 heads (4 layers x 2 KV heads): n_i = ⌊r_i·8 + ½⌋, n_s = ⌊(r_i + r_s)·8 + ½⌋ − n_i, the rest episodic; the
    heads of lowest S are instant, the highest episodic."""
    model, processor = loaded["qwen2_5_vl"].model, loaded["qwen2_5_vl"].processor
    profile = profile_heads(model, processor, [frames_array(4)], fps=2, chunk_frames=2, questions=QUESTIONS[0],
                            instant_ratio=ratios[0], short_ratio=ratios[1], progress=False)
    assert profile.counts() == counts == class_counts(8, *ratios)
    assert torch.equal(profile.head_map, classify_heads(profile.scores, *ratios))
    order = profile.head_map.flatten()[profile.scores.flatten().argsort(stable=True)]
    assert order.tolist() == sorted(order.tolist())


@pytest.fixture(scope="module")
def saved(loaded, tmp_path_factory):
    """A LLaVA-OV profile and its map file."""
    model, processor = loaded["llava_onevision"].model, loaded["llava_onevision"].processor
    profile = profile_heads(model, processor, [frames_array(3)], fps=1, chunk_frames=2,
                            questions=[QUESTIONS[0], 'what is "it" [in] the\tcup ?'], progress=False)
    path = save_head_map(profile, tmp_path_factory.mktemp("maps") / "map.json")
    return profile, path


def test_map_round_trips(loaded, saved):
    """save -> load gives the same profile bit for bit; the loaded map builds a profiled H2SVCConfig."""
    profile, path = saved
    back = load_head_map(path, loaded["llava_onevision"].model)
    for field in ("model_name", "model_type", "num_layers", "num_kv_heads", "num_heads", "instant_ratio",
                  "short_ratio", "clips", "settings", "package_version"):
        assert getattr(back, field) == getattr(profile, field), field
    for field in ("head_map", "v2v", "t2v", "scores"):
        assert getattr(back, field).dtype == getattr(profile, field).dtype
        assert torch.equal(getattr(back, field), getattr(profile, field)), field
    with open(path) as f:
        data = json.load(f)
    assert data["format"] == FORMAT and data["model"]["name"] == profile.model_name != ""
    assert {name for row in data["head_map"] for name in row} <= {"instant", "short", "episodic"}
    cfg = H2SVCConfig.llava_ov(back.num_layers, back.num_kv_heads, prefix_len=10, head_map=back.head_map,
                               tokens_per_frame=16)
    assert cfg.profiled and torch.equal(cfg.head_classes, profile.head_map)
    # checked against an H2SVCConfig of the same shape (no model type to compare): loaded, no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        against_config = load_head_map(path, H2SVCConfig(num_layers=4, num_kv_heads=2, prefix_len=0,
                                                         tokens_per_frame=16))
    assert torch.equal(against_config.head_map, profile.head_map)
    assert H2SVCConfig.llava_ov(4, 2, prefix_len=10, head_map=against_config.head_map, tokens_per_frame=16).profiled


def test_map_for_another_model_is_refused(loaded, saved, tmp_path):
    """Another model type, another layer count, another KV-head count: ValueError naming what differs; the same
    shape under another checkpoint name only warns."""
    _, path = saved
    with pytest.raises(ValueError, match=r"model_type 'llava_onevision' vs 'qwen2_5_vl'"):
        load_head_map(path, loaded["qwen2_5_vl"].model)
    with pytest.raises(ValueError, match=r"layers 4 vs 3"):
        load_head_map(path, tiny_llava_ov(num_layers=3))
    with pytest.raises(ValueError, match=r"KV heads 2 vs 4"):
        load_head_map(path, H2SVCConfig(num_layers=4, num_kv_heads=4, prefix_len=0, tokens_per_frame=16))
    config = loaded["llava_onevision"].model.config
    other = type(config).from_dict(config.to_dict())
    other.text_config.num_key_value_heads = 1
    with pytest.raises(ValueError, match=r"KV heads 2 vs 1"):
        load_head_map(path, other)
    other.name_or_path = "/elsewhere/another-checkpoint"
    other.text_config.num_key_value_heads = 2
    with pytest.warns(UserWarning, match="another-checkpoint"):
        load_head_map(path, other)
    with pytest.raises(TypeError, match="model"):
        load_head_map(path, "llava")


def test_bad_map_files_are_refused(saved, tmp_path):
    _, path = saved
    with open(path) as f:
        data = json.load(f)

    def write(content) -> str:
        target = tmp_path / "bad.json"
        target.write_text(content if isinstance(content, str) else json.dumps(content))
        return str(target)

    with pytest.raises(FileNotFoundError, match="no such file"):
        load_head_map(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="not a JSON head map"):
        load_head_map(write("{not json"))
    with pytest.raises(ValueError, match="format"):
        load_head_map(write({**data, "format": "something else"}))
    with pytest.raises(ValueError, match=r"head_map: expected 4 rows"):
        load_head_map(write({**data, "head_map": data["head_map"][:3]}))
    with pytest.raises(ValueError, match=r"head_map: expected class names"):
        load_head_map(write({**data, "head_map": [["fast", "short"]] + data["head_map"][1:]}))
    with pytest.raises(ValueError, match=r"metrics.score"):
        load_head_map(write({**data, "metrics": {**data["metrics"], "score": [[1.0]] * 4}}))
    with pytest.raises(ValueError, match=r"model.num_kv_heads: missing"):
        load_head_map(write({**data, "model": {k: v for k, v in data["model"].items() if k != "num_kv_heads"}}))
    with pytest.raises(ValueError, match=r"ratios"):
        load_head_map(write({**data, "ratios": {"instant": 0.7, "short": 0.7}}))


def test_bad_inputs_fail_before_any_forward(loaded, files, monkeypatch, tmp_path):
    """Missing or corrupt files, bad arguments: errors before the model runs; an error inside a clip leaves the
    model's attention implementation as it was."""
    model, processor = loaded["qwen2_5_vl"].model, loaded["qwen2_5_vl"].processor
    calls = []
    monkeypatch.setattr(profiler, "_profile_clip", lambda *a, **k: calls.append(1))
    cases = [
        (TypeError, r"videos: expected a uint8 \[F, H, W, 3\] array or a clip \(a video file: "
                    r"hermes.video.VideoClip\(path\)\), got str", dict(videos=[files["clip"]])),
        (ValueError, "videos: expected frame arrays", dict(videos=[np.zeros((2, 8, 8, 3), dtype=np.float32)])),
        (ValueError, "videos", dict(videos=[])),
        (ValueError, "fps", dict(fps=0)),
        (ValueError, "chunk_frames", dict(chunk_frames=0)),
        (ValueError, "max_frames", dict(max_frames=-1)),
        (ValueError, "answer_tokens", dict(answer_tokens=-1)),
        (ValueError, "questions", dict(questions=["  "])),
        (ValueError, "short_ratio", dict(instant_ratio=0.6, short_ratio=0.6)),
    ]
    with pytest.raises(FileNotFoundError, match="video: no such file"):
        VideoClip(tmp_path / "missing.mp4")
    with pytest.raises(ValueError, match="video: cannot read"):
        VideoClip(files["corrupt"])
    for error, message, kwargs in cases:
        args = dict(videos=[VideoClip(files["clip"])], progress=False)
        args.update(kwargs)
        with pytest.raises(error, match=message):
            profile_heads(model, processor, args.pop("videos"), **args)
    assert calls == []
    monkeypatch.undo()

    before = attention_name(model.config.get_text_config())
    family = family_of(model)

    def failing(*args, **kwargs):
        raise RuntimeError("vision tower failed")

    monkeypatch.setattr(type(family), "encode_video", failing)
    with pytest.raises(RuntimeError, match="vision tower failed"):
        profile_heads(model, processor, [frames_array(2)], progress=False)
    assert attention_name(model.config.get_text_config()) == before


# ---- the command ------------------------------------------------------------------------------------------
def error_of(capsys, argv, status: int = 1) -> str:
    return error_line(main, capsys, argv, status)


def test_command_writes_a_map_that_loads(tiny_checkpoints, loaded, files, tmp_path):
    """The real command in a subprocess: exit 0, a summary on stdout, a map that loads for the model and equals
    the in-process profile of the same clip."""
    out = tmp_path / "map.json"
    result = subprocess.run(
        [sys.executable, "-m", "hermes.profile_cli", "--model", tiny_checkpoints["qwen2_5_vl"], "--videos",
         files["clip"], "--out", str(out), "--chunk-frames", "4", "--question", QUESTIONS[0], "--threads", "1",
         "--quiet"],
        cwd=REPO, env={**os.environ, "PYTHONPATH": REPO}, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"wrote {out}: qwen2_5_vl") and "layer 3:" in result.stdout
    assert "RuntimeWarning" not in result.stderr
    model = loaded["qwen2_5_vl"].model
    back = load_head_map(out, model)
    expected = profile_heads(model, loaded["qwen2_5_vl"].processor, [VideoClip(files["clip"])], chunk_frames=4,
                             questions=QUESTIONS[0], progress=False)
    assert back.model_name == tiny_checkpoints["qwen2_5_vl"] and back.clips[0]["source"] == files["clip"]
    assert_close_verbose(back.v2v, expected.v2v, name="command V2V", **TAD_TOL)
    assert_close_verbose(back.t2v, expected.t2v, name="command T2V", **TAD_TOL)
    assert torch.equal(back.head_map, expected.head_map)


def test_command_errors_are_one_line(tiny_checkpoints, files, tmp_path, capsys):
    model = tiny_checkpoints["llava_onevision"]
    out = str(tmp_path / "map.json")
    base = ["--model", model, "--out", out, "--videos"]
    assert "no such file" in error_of(capsys, base + [str(tmp_path / "missing.mp4")])
    assert "video: cannot read" in error_of(capsys, base + [files["corrupt"]])
    assert "model: no such folder" in error_of(capsys, ["--model", str(tmp_path / "nope"), "--out", out,
                                                        "--videos", files["clip"]])
    assert "out: no such folder" in error_of(capsys, ["--model", model, "--out", str(tmp_path / "a" / "m.json"),
                                                      "--videos", files["clip"]])
    assert "short_ratio" in error_of(capsys, base + [files["clip"], "--instant-ratio", "0.9"], status=2)
    assert "device: expected" in error_of(capsys, base + [files["clip"], "--device", "tpu"], status=2)
    assert not os.path.exists(out)
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    assert "--videos FILE [FILE ...]" in capsys.readouterr().out

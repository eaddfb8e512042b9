"""The lmms-eval model class in this process: its arguments (checked before any weights load), lockstep batches
(batch 1 answers equal batch N answers), failures inside a batch, and the requests it refuses."""
from __future__ import annotations

import json

import pytest
import torch
from lmms_eval.api.instance import Instance

import hermes.eval.model as eval_model
from hermes import commands
from hermes.eval.feed import UnreadableVideo, VideoFeed
from hermes.eval.model import HermesModel
from hermes.eval.settings import parse_model_args
from tests.hermes.eval.tasks import BUDGET, CHUNK_FRAMES, FPS, QUESTIONS, tiny_head_map, write_videos

pytestmark = pytest.mark.usefixtures("single_thread")

TASK, SPLIT = "hermes_local", "test"


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    return write_videos(tmp_path_factory.mktemp("videos"))


def build(checkpoint, **args) -> HermesModel:
    budget = {} if args.get("policy") == "h2svc" else {"budget": BUDGET}
    return HermesModel(pretrained=checkpoint, fps=FPS, chunk_frames=CHUNK_FRAMES, device="cpu", **budget, **args)


def requests(model: HermesModel, docs: list[dict], request_type: str = "generate_until") -> list[Instance]:
    """generate_until (or loglikelihood, continuation = doc["choice"]) Instances over `docs`, as lmms-eval builds
    them, with the docs in the model's task_dict."""
    model.task_dict = {TASK: {SPLIT: docs}}
    out = []
    for doc_id, doc in enumerate(docs):
        second = {"max_new_tokens": doc.get("max_new_tokens", 3), "until": ["?"]} \
            if request_type == "generate_until" else doc["choice"]
        out.append(Instance(request_type=request_type, idx=0, metadata={"task": TASK, "doc_id": doc_id, "repeats": 1},
                            arguments=(doc["question"], second, lambda d: [d["video"]], doc_id, TASK, SPLIT)))
    return out


def docs_over(videos, names, lengths=None) -> list[dict]:
    lengths = lengths or [3] * len(names)
    return [{"video": videos[name], "question": QUESTIONS[i % len(QUESTIONS)], "max_new_tokens": n}
            for i, (name, n) in enumerate(zip(names, lengths))]


def spy_batches(monkeypatch) -> list[int]:
    """The batch size of every stream the model takes, in order."""
    sizes = []
    original = HermesModel._stream_for

    def spy(self, batch_size, frame_size, request_type):
        sizes.append(batch_size)
        return original(self, batch_size, frame_size, request_type)
    monkeypatch.setattr(HermesModel, "_stream_for", spy)
    return sizes


# ---- arguments ----------------------------------------------------------------------------------------------------
BAD_ARGS = [
    (dict(budget=0), "budget: expected a positive int, got 0"),
    (dict(fps=0), "fps: expected a positive finite number, got 0"),
    (dict(chunk_frames=2.5), "chunk_frames: expected a positive int, got 2.5"),
    (dict(max_new_tokens=-1), "max_new_tokens: expected a positive int, got -1"),
    (dict(room=0), "room: expected a positive int, got 0"),
    (dict(policy="snapkv"), "policy: expected one of ["),  # the registry's names (test_thirdparty_policy.py)
    (dict(reindex="sometimes"), "reindex: expected one of ('auto', 'lazy', 'eager'), got 'sometimes'"),
    (dict(backend="gpu"), "backend: expected one of"),
    (dict(dtype="int8"), "dtype: expected auto or one of"),
    (dict(device="tpu"), "device: "),
    (dict(batch_size="auto"), "batch_size: expected a positive int, got 'auto'"),
    (dict(max_batch_size=8), "max_batch_size: only used with --batch_size auto"),
    (dict(budgte=4000), "budgte: not an argument of --model hermes"),
    (dict(pretrained=None), "pretrained: required"),
    (dict(pretrained="/no/such/checkpoint"), "pretrained: no such folder: /no/such/checkpoint"),
    (dict(head_map="map.json"), "head_map: only policy=h2svc takes a head map"),
    (dict(policy="h2svc", budget=4000), "budget: only policy=hermes takes a budget"),
    (dict(policy="h2svc", head_map="/no/map.json"), "head_map: head map: no such file: /no/map.json"),
    (dict(budget=10 ** 6), "budget: 1000000 does not fit"),
]


@pytest.fixture
def no_weights(monkeypatch):
    """Loading weights fails the test: every check has to come before it."""
    def load_model(*args, **kwargs):
        raise AssertionError("weights were loaded before the arguments were checked")
    monkeypatch.setattr(commands, "load_model", load_model)


@pytest.mark.parametrize("args,line", BAD_ARGS, ids=[next(iter(a)) + f"-{i}" for i, (a, _) in enumerate(BAD_ARGS)])
def test_a_bad_argument_is_one_line_naming_it_before_any_weights_load(args, line, tiny_checkpoints, no_weights):
    base = dict(pretrained=tiny_checkpoints["llava_onevision"], device="cpu")
    with pytest.raises(ValueError) as info:
        HermesModel(**{**base, **args})
    assert str(info.value).startswith(line) and "\n" not in str(info.value), str(info.value)


def test_every_bad_argument_gets_its_own_line(tiny_checkpoints, no_weights):
    with pytest.raises(ValueError) as info:
        HermesModel(pretrained=tiny_checkpoints["qwen2_5_vl"], budget=-1, fps="fast", reindex="no", unknown=1)
    lines = str(info.value).splitlines()
    assert [line.split(":")[0] for line in lines] == ["unknown", "budget", "reindex", "fps"]


def test_checkpoint_problems_name_the_argument_before_any_weights_load(tiny_checkpoints, tmp_path, no_weights):
    """An unsupported model type names pretrained; a head map profiled on the other family names head_map."""
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ValueError, match=r"^pretrained: .*model type 'bert' is not supported"):
        HermesModel(pretrained=str(tmp_path / "bert"), device="cpu")
    other = tiny_head_map(tmp_path, "qwen2_5_vl")
    with pytest.raises(ValueError, match=r"^head_map: head map .*profiled for another model"):
        HermesModel(pretrained=tiny_checkpoints["llava_onevision"], policy="h2svc", head_map=other, device="cpu")


def test_defaults_follow_the_paper_and_reindexing_follows_the_request_type(tiny_checkpoints):
    """budget 6000 (the paper's 6K; 4K is budget=4000), 1 fps, 16-frame chunks; auto re-indexing is eager for
    offline requests, lazy for multi-round ones, and an explicit mode wins."""
    settings = parse_model_args(pretrained=tiny_checkpoints["llava_onevision"])
    assert (settings.budget, settings.fps, settings.chunk_frames, settings.reindex) == (6000, 1.0, 16, "auto")
    assert [settings.reindex_for(t) for t in ("generate_until", "loglikelihood", "generate_until_multi_round")] \
        == ["eager", "eager", "lazy"]
    lazy = parse_model_args(pretrained=tiny_checkpoints["llava_onevision"], reindex="lazy")
    assert lazy.reindex_for("generate_until") == "lazy"
    assert parse_model_args(pretrained=tiny_checkpoints["llava_onevision"], policy="h2svc").budget is None


# ---- batches --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family,policy", [("llava_onevision", "hermes"), ("qwen2_5_vl", "h2svc")])
def test_batch_n_answers_equal_batch_1_answers(family, policy, tiny_checkpoints, videos, tmp_path, monkeypatch):
    """Five questions over a, b, c (a and b have equal shapes; a asked three times with two answer lengths): at
    batch 1 three streams of one; at batches 2 and 3 c streams alone and a and b share one lockstep stream pair;
    every answer is the same at every batch size, and each video is streamed once."""
    extra = dict(policy="h2svc", head_map=tiny_head_map(tmp_path, family)) if policy == "h2svc" else {}
    docs = docs_over(videos, ["a", "b", "a", "c", "a"], lengths=[3, 3, 5, 3, 3])
    answers = {}
    for batch in (1, 2, 3):
        sizes = spy_batches(monkeypatch)
        model = build(tiny_checkpoints[family], batch_size=batch, **extra)
        answers[batch] = model.generate_until(requests(model, docs))
        assert sizes == ([1, 1, 1] if batch == 1 else [1, 2])  # by shape: c (6 samples), then a and b (10)
        assert model.counts["generate_until"] == {"videos": 3, "questions": 5}
        monkeypatch.undo()
    assert answers[1] == answers[2] == answers[3]
    assert all(answers[1])


def test_videos_ending_apart_in_one_batch_stream_again_one_at_a_time(tiny_checkpoints, videos, monkeypatch):
    """If videos of different lengths land in one lockstep batch (their measured shapes made alike here), the batch
    is streamed again one video at a time: the answers are those of batch 1."""
    docs = docs_over(videos, ["a", "c"])
    model = build(tiny_checkpoints["llava_onevision"])
    single = model.generate_until(requests(model, docs))
    monkeypatch.setattr(eval_model, "sampled_shape", lambda path, fps: (10, 48, 64))
    sizes = spy_batches(monkeypatch)
    model = build(tiny_checkpoints["llava_onevision"], batch_size=2)
    assert model.generate_until(requests(model, docs)) == single
    assert sizes == [2, 1, 1]


@pytest.mark.parametrize("batch", [1, 2])
def test_a_video_failing_mid_stream_skips_only_its_questions(batch, tiny_checkpoints, videos, monkeypatch):
    """Decoding b fails after its first chunk (at batch 1 between a and c, which then reuses the failed stream;
    at batch 2 in a lockstep pair with a, then alone): b's question is answered as empty with one error line; a
    and c answer as in a clean run (the next video starts from a reset stream)."""
    docs = docs_over(videos, ["a", "b", "c", "a"])
    model = build(tiny_checkpoints["qwen2_5_vl"], batch_size=batch)
    clean = model.generate_until(requests(model, docs))
    original = VideoFeed._next_sample

    def failing(self):
        if self.path == videos["b"] and self.streamed_to is not None and self.streamed_to >= CHUNK_FRAMES:
            raise UnreadableVideo(f"video: decoding {self.path} failed after 4.00 s: injected")
        return original(self)
    monkeypatch.setattr(VideoFeed, "_next_sample", failing)
    errors = []
    monkeypatch.setattr(eval_model.logger, "error", errors.append)
    answers = model.generate_until(requests(model, docs))
    assert answers == [clean[0], "", clean[2], clean[3]] and clean[1]
    assert errors == [f"hermes: skipped {TASK}/1 (1 question(s) answered as empty): video: decoding {videos['b']} "
                      "failed after 4.00 s: injected"]
    assert model.counts["generate_until"] == {"videos": 2, "questions": 3, "skipped": 1}


# ---- refusals -------------------------------------------------------------------------------------------------
@pytest.fixture
def nothing_streams(monkeypatch):
    def refuse(self, path):
        raise AssertionError("a video was opened before the requests were checked")
    monkeypatch.setattr(VideoFeed, "open", refuse)


def test_multi_token_continuations_are_refused_naming_the_tasks(tiny_checkpoints, videos, nothing_streams):
    """A continuation of two tokens: one ValueError naming the task, the tasks that need several tokens and the
    generation variants to run instead, raised before any video is opened."""
    model = build(tiny_checkpoints["llava_onevision"])
    docs = [{**doc, "choice": choice} for doc, choice in zip(docs_over(videos, ["a", "b"]), [" cup", " red cup"])]
    with pytest.raises(ValueError) as info:
        model.loglikelihood(requests(model, docs, "loglikelihood"))
    message = str(info.value)
    assert message.startswith(f"loglikelihood: task {TASK} scores a continuation of 2 tokens (' red cup', {TASK}/1)")
    assert "egoschema_mcppl" in message and "worldqa_mc_ppl" in message and "videomme" in message


def test_requests_the_adapter_cannot_stream_are_refused(tiny_checkpoints, videos, nothing_streams):
    """Two videos in one request, an image in a round, a prompt too long for room: ValueErrors naming the sample
    (and `room`), before any video is opened."""
    model = build(tiny_checkpoints["llava_onevision"], room=8)
    docs = docs_over(videos, ["a"])
    two = requests(model, docs)
    two[0].arguments = two[0].arguments[:2] + (lambda d: [videos["a"], videos["b"]],) + two[0].arguments[3:]
    with pytest.raises(ValueError, match=f"^{TASK}/0: --model hermes streams one video file per request"):
        model.generate_until(two)
    with pytest.raises(ValueError, match=f"^room: {TASK}/0's prompt and answer need [0-9]+ cache slots, more than "
                                         "room=8; pass room="):
        model.generate_until(requests(model, docs))
    with pytest.raises(ValueError, match="a round's visuals are paths or \\(path, seconds\\) pairs, got Tensor"):
        HermesModel._round_visuals([torch.zeros(3, 8, 8)], "t/0")
    assert HermesModel._round_visuals([videos["a"], (videos["c"], 2)], "t/0") == [(videos["a"], None),
                                                                                  (videos["c"], 2.0)]


def test_a_question_before_any_frame_is_refused(tiny_checkpoints):
    model = build(tiny_checkpoints["llava_onevision"])
    model.task_dict = {TASK: {SPLIT: [{"q": "x"}]}}
    request = Instance(request_type="generate_until_multi_round", idx=0,
                       metadata={"task": TASK, "doc_id": 0, "repeats": 1},
                       arguments=(QUESTIONS[0], {}, lambda d: [], None, 0, TASK, SPLIT))
    with pytest.raises(ValueError, match=f"^{TASK}/0: round 0 asks before any video frame"):
        model.generate_until_multi_round([request])


# ---- streams and room -----------------------------------------------------------------------------------------
def test_each_frame_size_streams_on_a_stream_built_for_it(tiny_checkpoints, videos, tmp_path, monkeypatch):
    """Qwen2.5-VL sizes a stream's chunks from the processed frame size (a: 48 x 64 frames, 12 x 16 processed, 24
    tokens a chunk; a square video: 64 x 64, 16 x 16 processed, 32 tokens). Asked about a and the square video in
    one call, then a again in the next (the model keeps its last stream across calls), at batch 1: every video
    streams on a stream built for its own frame size (a kept stream is reused only for the same size: the size is
    part of the reuse key), in both orders, and the answers are those of models that stream each video alone."""
    from tests.hermes.video_files import write_video

    square = write_video(tmp_path / "square.mp4", [i / 4 for i in range(40)], height=64, width=64)
    calls = [[videos["a"], square], [videos["a"]]]
    docs = [[{"video": path, "question": QUESTIONS[i], "max_new_tokens": 3} for i, path in enumerate(paths)]
            for paths in calls]
    alone = []
    for call in docs:
        answers = []
        for doc in call:
            model = build(tiny_checkpoints["qwen2_5_vl"])
            answers += model.generate_until(requests(model, [doc]))
        alone.append(answers)
    taken = []
    original = HermesModel._stream_for

    def spy(self, batch_size, frame_size, request_type):
        stream = original(self, batch_size, frame_size, request_type)
        taken.append((frame_size, stream.frame_size))
        return stream
    monkeypatch.setattr(HermesModel, "_stream_for", spy)
    model = build(tiny_checkpoints["qwen2_5_vl"])
    assert [model.generate_until(requests(model, call)) for call in docs] == alone
    wanted = [size for size, _ in taken]
    assert len(wanted) == 3 and wanted[0] == wanted[2] != wanted[1], taken
    assert all(built == size for size, built in taken), f"(frame size, stream built for): {taken}"


def test_a_prompt_that_fills_the_room_exactly_is_accepted_and_one_token_more_is_refused(tiny_checkpoints, videos,
                                                                                         monkeypatch):
    """`room` bounds a question's prompt tokens plus its max_new_tokens: a request whose prompt and answer need
    exactly `room` slots is streamed and answered; one more answer token and it is refused naming `room` and the
    slots it needs, before any video is opened."""
    room = 80  # also past what the guidance prompts of a compressing chunk need
    model = build(tiny_checkpoints["llava_onevision"], room=room)
    question = QUESTIONS[0]
    prompt = len(model.tokenizer(model.family.question_text(question), add_special_tokens=False)["input_ids"])
    assert 0 < prompt < room
    fits = [{"video": videos["a"], "question": question, "max_new_tokens": room - prompt}]
    answers = model.generate_until(requests(model, fits))
    assert answers[0] and model.counts["generate_until"] == {"videos": 1, "questions": 1}

    def refuse(self, path):
        raise AssertionError("a video was opened before the requests were checked")
    monkeypatch.setattr(VideoFeed, "open", refuse)
    over = [dict(fits[0], max_new_tokens=room - prompt + 1)]
    with pytest.raises(ValueError, match=rf"^room: {TASK}/0's prompt and answer need {room + 1} cache slots, more "
                                         rf"than room={room}; pass room={room + 1} \(or more\) in --model_args$"):
        model.generate_until(requests(model, over))


@pytest.fixture(scope="module")
def gemma4_checkpoint(tmp_path_factory):
    """A tiny Gemma 4 checkpoint, its positions raised to 16384 (H2SVC's default episodic window of 64 frames of ~70
    tokens needs more than the tiny model's 4096)."""
    from scaffolding.checkpoint import save_tiny_checkpoint
    folder = save_tiny_checkpoint(tmp_path_factory.mktemp("gemma4"), "gemma4")
    with open(f"{folder}/config.json") as f:
        config = json.load(f)
    config["text_config"]["max_position_embeddings"] = 16384
    with open(f"{folder}/config.json", "w") as f:
        json.dump(config, f)
    return folder


@pytest.mark.parametrize("policy", ["hermes", "h2svc"])
def test_gemma4_answers_under_both_policies(policy, gemma4_checkpoint, videos):
    """Three questions over two videos on Gemma 4 (sliding-window and KV-shared layers): every question answered,
    each video streamed once."""
    model = build(gemma4_checkpoint, **({"policy": policy} if policy == "h2svc" else {}))
    answers = model.generate_until(requests(model, docs_over(videos, ["a", "c", "a"])))
    assert len(answers) == 3 and all(isinstance(a, str) for a in answers)
    assert model.counts["generate_until"] == {"videos": 2, "questions": 3}


def test_lockstep_batches_are_refused_where_questions_cannot_be_padded(gemma4_checkpoint, no_weights):
    """A lockstep batch pads its streams' questions to one length, which sliding-window layers would take in: Gemma 4
    with batch_size 2 is refused in one line naming batch_size, before any weights load."""
    with pytest.raises(ValueError, match=r"^batch_size: Gemma 4's sliding-window layers take no padded question "
                                         r"batch .*pass batch_size 1, got 2$"):
        HermesModel(pretrained=gemma4_checkpoint, device="cpu", batch_size=2)

"""The streaming front under `policy="h2svc"` (docs/h2svc.md, HermesStream): head maps (files checked against the
model, tensors, configs, the warned default), bad input that leaves every buffer byte-identical, injected faults
(vision tower, a layer before and after its cache write, the step's validation, a failure inside the step's
writes), two streams in lockstep vs each alone, ragged questions, two threads, reset, and a cache split into
blocks per device (laid out on one device) vs one block per class.
"""
import functools

import pytest
import torch

import hermes.policies.h2svc.policy
import hermes_kernels as hk
from hermes.testing import tiny_llava_ov, tiny_qwen2_5_vl, tiny_tokenizer
from hermes_kernels.policies.h2svc.config import CLASS_NAMES, EPISODIC, INSTANT, SHORT, H2SVCConfig, default_head_map
from hermes.policies.h2svc.head_map import HeadProfile, save_head_map
from hermes.policies.h2svc.cache import H2SVCCache
from hermes.stream import HermesStream
from tests.hermes.policies.h2svc.checks import (CASES, MIXED_MAP, QUESTION, assert_same_buffers, assert_unchanged,
                                                chunk, h2svc_stream, merge, snapshot, whole_buffers)
from tests.hermes.streams import refuse_bad_questions, run_in_two_threads
from tests.utils import assert_close_verbose

pytestmark = pytest.mark.usefixtures("single_thread")

FRAMES = 2
WINDOWS = dict(instant_frames=1, short_frames=2, episodic_frames=3)  # every chunk after the second evicts


@pytest.fixture(params=list(CASES))
def case(request):
    return CASES[request.param]


def stream_of(case, model, **kwargs):
    return h2svc_stream(case, model, FRAMES, **{**WINDOWS, **kwargs})


def assert_same_stream(a, b) -> None:
    """Same counters, stats, history and valid slots; the same logits for the next question."""
    assert a.stats() == b.stats() and a.last_convs == b.last_convs
    assert a.cache._counters() == b.cache._counters()
    for layer in range(a.cfg.num_layers):
        for cls in range(len(CLASS_NAMES)):
            if not a.cfg.heads_of(cls, layer):
                continue
            for name in ("keys", "values", "positions", "slot_frames"):
                view = getattr(H2SVCCache, f"class_{name}")
                assert torch.equal(view(a.cache, cls, layer), view(b.cache, cls, layer)), (name, cls, layer)
            if cls == EPISODIC:
                held = a.cache.held["episodic"]
                assert torch.equal(a.cache.class_features(layer)[:, :, :held],
                                   b.cache.class_features(layer)[:, :, :held])
    assert torch.equal(a.next_token_logits(QUESTION), b.next_token_logits(QUESTION))


# ---- head maps ------------------------------------------------------------------------------------------------
def profile_for(model_type: str, head_map) -> HeadProfile:
    head_map = torch.as_tensor(head_map, dtype=torch.int64)
    zeros = torch.zeros(head_map.shape, dtype=torch.float64)
    return HeadProfile(model_name="", model_type=model_type, num_layers=head_map.shape[0],
                       num_kv_heads=head_map.shape[1], num_heads=2 * head_map.shape[1], instant_ratio=0.1,
                       short_ratio=0.4, head_map=head_map, v2v=zeros, t2v=zeros, scores=zeros, clips=[], settings={})


def test_head_maps_from_files_tensors_configs_and_the_default(tmp_path, recwarn):
    """A profiler file for this model is loaded (no warning); files for another model type, layer count or KV-head
    count are refused naming what differs; a tensor of the wrong shape or classes is refused; an H2SVCConfig is
    taken whole (and checked); no map gives the documented default with a warning that it is not profiled."""
    model = tiny_llava_ov()
    tokenizer = tiny_tokenizer()
    make = functools.partial(HermesStream, model, tokenizer, policy="h2svc", chunk_frames=2, room=64)
    interleaved = [[EPISODIC, INSTANT], [SHORT, SHORT], [INSTANT, EPISODIC], [EPISODIC, SHORT]]
    path = save_head_map(profile_for("llava_onevision", interleaved), tmp_path / "map.json")
    stream = make(head_map=str(path))
    assert stream.cfg.profiled and stream.cfg.head_classes.tolist() == interleaved
    assert make(head_map=profile_for("llava_onevision", interleaved)).cfg.head_classes.tolist() == interleaved
    assert not [w for w in recwarn.list if "profiled" in str(w.message)]
    for profile, message in ((profile_for("qwen2_5_vl", interleaved), "model_type 'qwen2_5_vl' vs 'llava_onevision'"),
                             (profile_for("llava_onevision", interleaved[:3]), "layers 3 vs 4"),
                             (profile_for("llava_onevision", [row * 2 for row in interleaved]), "KV heads 4 vs 2")):
        other = save_head_map(profile, tmp_path / "other.json")
        with pytest.raises(ValueError, match=message):
            make(head_map=other)
        with pytest.raises(ValueError, match=message):
            make(head_map=profile)
    with pytest.raises(ValueError, match="head_map"):
        make(head_map=torch.zeros(3, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="head_map"):
        make(head_map=[[0, 3]] * 4)
    with pytest.raises(FileNotFoundError, match="head map"):
        make(head_map=str(tmp_path / "missing.json"))
    prefix_len = stream.cfg.prefix_len
    config = H2SVCConfig.llava_ov(4, 2, prefix_len, head_map=interleaved, tokens_per_frame=16, episodic_frames=5)
    assert make(head_map=config).cfg is config
    for wrong in (config.replace(num_layers=3, head_map=interleaved[:3]), config.replace(prefix_len=prefix_len + 1),
                  config.replace(tokens_per_frame=8)):
        with pytest.raises(ValueError, match="head_map: the H2SVCConfig"):
            make(head_map=wrong)
    with pytest.raises(TypeError, match="H2SVCConfig alone"):
        make(head_map=config, short_frames=4)
    with pytest.warns(UserWarning, match="not profiled"):
        default = make()
    assert not default.cfg.profiled and torch.equal(default.cfg.head_classes, default_head_map(4, 2))
    assert make(head_map=interleaved, short_frames=5, reindex="eager").cfg.window(SHORT) == 5
    with pytest.raises(ValueError, match="frame_size"):  # Qwen2.5-VL's frame tokens depend on the frame size
        HermesStream(tiny_qwen2_5_vl(), tokenizer, policy="h2svc", head_map=MIXED_MAP, chunk_tokens=64)


# ---- bad input, faults ----------------------------------------------------------------------------------------
def test_bad_frames_and_questions_leave_every_buffer_byte_identical(case):
    """Chunks of the wrong shape, dtype or values and questions that do not fit raise before any forward: every
    buffer of every block (free slots included) is byte-identical afterwards, and the stream goes on."""
    g = torch.Generator().manual_seed(61)
    model = case.build()
    stream = stream_of(case, model, batch_size=2)
    for _ in range(3):
        stream.append_video(**chunk(case, 2, g, FRAMES))
    before, state = whole_buffers(stream), snapshot(stream)
    for name, kwargs in case.bad_chunks(2, g).items():
        with pytest.raises((ValueError, TypeError), match="video|grid_thw|seconds_per_grid"):
            stream.append_video(**kwargs)
    with pytest.raises(ValueError, match="chunk_tokens"):  # more frames than the cache was sized for
        stream.append_video(**chunk(case, 2, g, FRAMES + 1))
    refuse_bad_questions(stream)
    with pytest.raises(ValueError, match="guidance_scores"):
        stream.guidance_scores()
    assert_same_buffers(stream, before)
    assert_unchanged(stream, state)
    assert stream.append_video(**chunk(case, 2, g, FRAMES)).num_frames == FRAMES


def vision_tower(model):
    return getattr(model.model, "vision_tower", None) or model.model.visual


def nan_values(model, layer: int):
    """A hook making `layer`'s values NaN: an episodic row then fails the step's validation (CPU)."""
    attention = model.model.language_model.layers[layer].self_attn
    return attention.v_proj.register_forward_hook(lambda module, args, out: out.fill_(float("nan")))


# the step's validation raises its own ValueError: one run of it
FAULTS = [pytest.param(phase, error, id=f"{phase}-{name}") for phase in ("vision", "first layer", "last layer")
          for name, error in (("oom", torch.OutOfMemoryError), ("interrupt", KeyboardInterrupt))] + \
         [pytest.param("step validation", ValueError, id="step validation")]


@pytest.mark.parametrize("phase,error", FAULTS)
def test_append_failure_leaves_the_stream_as_it_was(case, phase, error):
    """A chunk failing in the vision tower, in layer 0 (before its cache write), in the last layer (after its cache
    write: the counters have moved by then) or in the step's validation (non-finite values of an episodic head's
    arriving frames, ValueError) leaves the stream as it was; it then takes the next chunks exactly like a stream
    that never saw the failed one."""
    g = torch.Generator().manual_seed(62)
    model = case.build()
    faulty, clean = stream_of(case, model), stream_of(case, model)
    for _ in range(3):
        clip = chunk(case, 1, g, FRAMES)
        for stream in (faulty, clean):
            stream.append_video(**clip)
    before = snapshot(faulty)

    def raiser(*args, **kwargs):
        raise error(f"injected into {phase}")

    layers = model.model.language_model.layers
    hook = {"vision": lambda: vision_tower(model).register_forward_pre_hook(raiser),
            "first layer": lambda: layers[0].register_forward_pre_hook(raiser),
            "last layer": lambda: layers[-1].mlp.register_forward_pre_hook(raiser),
            "step validation": lambda: nan_values(model, 3)}[phase]()
    try:
        with pytest.raises(error, match="injected|non-finite"):
            faulty.append_video(**chunk(case, 1, g, FRAMES))
    finally:
        hook.remove()
    assert_unchanged(faulty, before)
    assert_same_stream(faulty, clean)
    for _ in range(2):
        clip = chunk(case, 1, g, FRAMES)
        results = [stream.append_video(**clip) for stream in (faulty, clean)]
        assert results[0] == results[1]
    assert_same_stream(faulty, clean)


def test_question_failures_leave_the_stream_as_it_was(case):
    """`ask` failing in a decode step (its question already stored) and `next_token_logits` failing in a layer
    leave the stream as it was, ragged questions over two streams included."""
    g = torch.Generator().manual_seed(63)
    model = case.build()
    faulty, clean = stream_of(case, model, batch_size=2), stream_of(case, model, batch_size=2)
    for _ in range(3):
        clip = chunk(case, 2, g, FRAMES)
        for stream in (faulty, clean):
            stream.append_video(**clip)
    questions = [QUESTION, "yes"]
    calls = [(model.model.language_model.layers[-1].mlp, 1, lambda: faulty.ask(questions, max_new_tokens=4)),
             (model.model.language_model.layers[0], 0, lambda: faulty.next_token_logits(questions))]
    for module, after, call in calls:
        runs = [0]

        def raiser(*args, **kwargs):
            runs[0] += 1
            if runs[0] > after:
                raise torch.OutOfMemoryError("injected")

        before = snapshot(faulty)
        hook = module.register_forward_pre_hook(raiser)
        try:
            with pytest.raises(torch.OutOfMemoryError, match="injected"):
                call()
        finally:
            hook.remove()
        assert_unchanged(faulty, before)
        assert_same_stream(faulty, clean)
    assert faulty.ask(questions, max_new_tokens=4) == clean.ask(questions, max_new_tokens=4)


def test_failure_inside_the_step_writes_needs_a_reset(case, monkeypatch):
    """An exception escaping the step after a class block was rewritten cannot be rolled back: the cache says
    `undefined`, every call raises until reset(), and after reset() the stream is a fresh one (same buffers)."""
    g = torch.Generator().manual_seed(64)
    model = case.build()
    stream = stream_of(case, model)
    stream.append_video(**chunk(case, 1, g, FRAMES))
    ptrs = stream.cache.data_ptrs()
    step, calls = hk.h2svc_step, []

    def fails_after_the_first_block(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("injected after the first block moved")
        return step(*args, **kwargs)

    monkeypatch.setattr(hk, "h2svc_step", fails_after_the_first_block)
    with pytest.raises(torch.OutOfMemoryError):
        stream.append_video(**chunk(case, 1, g, FRAMES))
    monkeypatch.setattr(hk, "h2svc_step", step)
    assert stream.cache.undefined
    for call in (lambda: stream.append_video(**chunk(case, 1, g, FRAMES)),
                 lambda: stream.ask(QUESTION, max_new_tokens=2), lambda: stream.next_token_logits(QUESTION)):
        with pytest.raises(RuntimeError, match="reset"):
            call()
    stream.reset()
    assert stream.cache.data_ptrs() == ptrs
    fresh = stream_of(case, model)
    for _ in range(3):
        clip = chunk(case, 1, g, FRAMES)
        for s in (stream, fresh):
            s.append_video(**clip)
    assert_same_stream(stream, fresh)


# ---- lockstep, ragged questions, threads, split blocks --------------------------------------------------------
def test_lockstep_streams_equal_each_stream_alone_and_ragged_questions(case):
    """Two streams in lockstep end with the class blocks, answers and logits each gets alone, through STCE
    evictions (per-stream keep sets differ) and questions of different token lengths."""
    g = torch.Generator().manual_seed(65)
    model = case.build()
    batch = stream_of(case, model, batch_size=2)
    alone = [stream_of(case, model) for _ in range(2)]
    questions = ["yes", QUESTION + " where is the red cup ?"]
    for step in range(5):
        pair = [chunk(case, 1, g, FRAMES) for _ in range(2)]
        batch.append_video(**merge(pair))
        for b, stream in enumerate(alone):
            stream.append_video(**pair[b])
        if step == 2:
            assert batch.ask(questions, max_new_tokens=4) == [s.ask(questions[b], max_new_tokens=4)
                                                             for b, s in enumerate(alone)]
    episodic = []
    for b, stream in enumerate(alone):
        for layer in range(batch.cfg.num_layers):
            for cls in range(len(CLASS_NAMES)):
                if not batch.cfg.heads_of(cls, layer):
                    continue
                assert torch.equal(batch.cache.class_slot_frames(cls, layer)[b],
                                   stream.cache.class_slot_frames(cls, layer)[0])
                assert torch.equal(batch.cache.class_positions(cls, layer)[b],
                                   stream.cache.class_positions(cls, layer)[0])
                for name in ("keys", "values"):
                    get = getattr(H2SVCCache, f"class_{name}")
                    assert_close_verbose(get(batch.cache, cls, layer)[b], get(stream.cache, cls, layer)[0],
                                         name=f"{name} {CLASS_NAMES[cls]} {layer}")
                if cls == EPISODIC:
                    episodic.append(stream.cache.class_slot_frames(cls, layer)[0].sort(-1).values)
    assert any(not torch.equal(x, episodic[0]) for x in episodic), "STCE kept the same frames everywhere"
    logits = batch.next_token_logits(questions)
    for b, stream in enumerate(alone):
        assert_close_verbose(logits[b], stream.next_token_logits(questions[b])[0], name=f"logits of stream {b}")
    assert batch.ask(questions, max_new_tokens=5) == [s.ask(questions[b], max_new_tokens=5)
                                                      for b, s in enumerate(alone)]


def test_two_threads_two_streams_one_model(case, monkeypatch):
    """Two H2SVC streams on one model driven from two threads (meeting at a barrier between each layer's cache
    write and its attention for the first forwards) give what they give one after the other."""
    g = torch.Generator().manual_seed(66)
    model = case.build()
    clips = [[chunk(case, 1, g, FRAMES) for _ in range(4)] for _ in range(2)]
    questions = [QUESTION, "yes"]

    def drive(stream, index):
        for clip in clips[index]:
            stream.append_video(**clip)
        return stream.ask(questions[index], max_new_tokens=3), stream.next_token_logits(questions[index])

    expected = [drive(stream_of(case, model), i) for i in range(2)]
    streams = [stream_of(case, model) for _ in range(2)]
    results = run_in_two_threads(monkeypatch, drive, streams, 2 * model.config.text_config.num_hidden_layers)
    for (answer, logits), (want_answer, want_logits) in zip(results, expected):
        assert answer == want_answer and torch.equal(logits, want_logits)


def test_split_blocks_and_reset_match_one_block_per_class(case, monkeypatch):
    """A cache split into blocks at layers 1 and 3 (what a model spread over devices gets: every class block of a
    layer on that layer's device) gives the one-block stream's results, re-indexes included; reset() then starts
    a new video in the same buffers, equal to a fresh stream."""
    g = torch.Generator().manual_seed(67)
    model = case.build(max_positions=256)
    args = dict(reindex="lazy", margin=180)  # re-index once a position passes 76
    one = stream_of(case, model, **args)
    monkeypatch.setattr(hermes.policies.h2svc.policy, "H2SVCCache", functools.partial(H2SVCCache, stack_bounds=[1, 3]))
    split = stream_of(case, model, **args)
    assert len(one.cache.blocks) == 3 and len(split.cache.blocks) > 3
    assert {b.layers for b in split.cache.blocks} == {range(0, 1), range(1, 3), range(3, 4)}
    for _ in range(10):
        clip = chunk(case, 1, g, FRAMES)
        results = [stream.append_video(**clip) for stream in (one, split)]
        assert results[0] == results[1]
    assert one.stats()["compactions"] >= 1
    assert_same_stream(one, split)
    assert one.ask(QUESTION, max_new_tokens=4) == split.ask(QUESTION, max_new_tokens=4)
    ptrs = split.cache.data_ptrs()
    split.reset()
    fresh = stream_of(case, model, **args)
    assert split.cache.data_ptrs() == ptrs and split.stats()["frames_seen"] == 0
    for _ in range(3):
        clip = chunk(case, 1, g, FRAMES)
        for stream in (split, fresh):
            stream.append_video(**clip)
    assert split.stats() == fresh.stats()
    assert torch.equal(split.next_token_logits(QUESTION), fresh.next_token_logits(QUESTION))


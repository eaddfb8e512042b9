"""H2SVC behind the streaming front (docs/h2svc.md): head maps (files checked against the model, tensors, configs,
the warned default) and a cache split into blocks per device (laid out on one device) vs one block per class. The
behaviours every policy shares (faults, lockstep and ragged questions, threads, reset, bad input) are
tests/hermes/stream/.
"""
import functools

import pytest
import torch

import hermes.policies.h2svc.policy
from hermes.policies.h2svc.cache import H2SVCCache
from hermes.policies.h2svc.head_map import HeadProfile, save_head_map
from hermes.stream import HermesStream
from scaffolding.models import tiny_llava_ov, tiny_qwen2_5_vl
from scaffolding.tokenizer import tiny_tokenizer
from hermes_kernels.policies.h2svc.config import EPISODIC, INSTANT, SHORT, H2SVCConfig, default_head_map
from tests.hermes.policies.h2svc.checks import MIXED_MAP, chunk
from tests.hermes.stream.policies import POLICIES, assert_same_stream
from tests.hermes.streams import CASES, QUESTION

pytestmark = pytest.mark.usefixtures("single_thread")

FRAMES = 2
H2SVC = POLICIES["h2svc"]


@pytest.fixture(params=list(CASES))
def case(request):
    return CASES[request.param]


def stream_of(case, model, **kwargs):
    return H2SVC.stream(case, model, **kwargs)


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
    assert one.stats()["reindexes"] >= 1
    assert_same_stream(H2SVC, one, split)
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

"""Streams on the tiny hybrid Qwen3.5 (decoder layers linear, full, full, linear, full, linear) against references
that never go through the engine (docs/qwen3_5.md#hybrid-cache):
- nothing evicted (both policies): the cache equals the model's own `DynamicCache` after one forward of the whole
  video (full-attention keys, values, positions; linear-attention conv and recurrent states) and the logits equal
  one forward over everything;
- HERMES with eviction: every step equals a naive per-layer implementation of docs/hermes.md §2 written here over
  the full-attention layers, fed the guidance attention the stream computed; the step leaves the linear states alone;
- guidance, `ask`, `truncate` / `crop` and a forward run outside any context keep the linear-state rules; a fault
  in a middle linear-attention layer leaves the stream as it was; the MoE twin streams under both policies.
"""
import math

import pytest
import torch
from transformers import DynamicCache
from transformers.models.qwen3_5 import modeling_qwen3_5

from hermes.policies.hermes import policy as hermes_policy
from hermes.stream import HermesStream
from hermes_kernels.policies.h2svc.config import CLASS_NAMES, CLASSES
from scaffolding.models import tiny_qwen3_5, tiny_qwen3_5_moe
from scaffolding.tokenizer import tiny_tokenizer
from tests.hermes.models.qwen3_vl_reference import full_inputs, own_forward, question_text, rope_index
from tests.hermes.models.test_qwen3_vl import chunks_at
from tests.hermes.policies.h2svc.checks import MIXED_MAP
from tests.hermes.stream.policies import POLICIES, assert_same_stream
from tests.hermes.streams import QUESTION
from tests.utils import assert_close_verbose, same_bytes

pytestmark = pytest.mark.usefixtures("single_thread")

FRAME = (8, 8)      # 2 x 2 merged tokens: a temporal step is 16 tokens with its timestamp, a 4-frame chunk 32
FULL = (1, 2, 4)    # decoder indices of the tiny model's full-attention layers (cache layers 0, 1, 2)
LINEAR = (0, 3, 5)  # ... and of its linear-attention layers
H2SVC_ALL = dict(policy="h2svc", head_map=MIXED_MAP[1:], instant_frames=8, short_frames=8, episodic_frames=8)


def tokenizer():
    return tiny_tokenizer(digits=True)


def stream_of(model, policy: str = "hermes", **kwargs) -> HermesStream:
    args = dict(budget=400) if policy == "hermes" else dict(H2SVC_ALL)
    args.update(kwargs)
    return HermesStream(model, tokenizer(), chunk_frames=4, frame_size=FRAME, room=64, **args)


def video(count: int, g: torch.Generator, batch: int = 1) -> list[dict]:
    """`count` chunks of 4 frames of 8 x 8 at advancing timestamps (7.5 s, 9.5 s, 11.5 s, ...)."""
    return chunks_at(count, g, batch=batch, size=FRAME)


def linear_states(stream) -> dict[str, torch.Tensor]:
    return {name: view.clone() for name, view in stream.cache.linear_contents().items()}


def assert_same_linear(a: dict, b: dict, what: str) -> None:
    assert list(a) == list(b) and a, what
    for name in a:
        assert torch.equal(a[name], b[name]), f"{what}: {name}"


def contents(stream) -> dict[str, torch.Tensor]:
    return {name: view.clone() for name, view in stream.cache.contents().items()}


def assert_same_contents(a: dict, b: dict, what: str) -> None:
    assert list(a) == list(b), what
    for name in a:
        assert same_bytes(a[name], b[name]), f"{what}: {name}"


# ---- 1. nothing evicted: the model's own forward and DynamicCache ------------------------------------------------
def error_bound(got: torch.Tensor, own: torch.Tensor, exact: torch.Tensor, name: str) -> None:
    """got (streamed, fp32) is off the float64 model's `exact` by at most twice what the fp32 model's own forward
    `own` is off (plus fp32 rounding of the values' size: a state the reference gets exactly still rounds)."""
    assert got.shape == exact.shape, f"{name}: {tuple(got.shape)} vs {tuple(exact.shape)}"
    error = (got.double() - exact).abs().max().item()
    own_error = (own.double() - exact).abs().max().item()
    floor = 4 * torch.finfo(torch.float32).eps * exact.abs().max().item()
    assert error <= 2 * own_error + floor, f"{name}: off by {error:.3g}, the model's own fp32 forward by {own_error:.3g}"


@pytest.mark.parametrize("policy", ["hermes", "h2svc"])
def test_a_budget_above_the_video_is_the_models_own_forward_and_cache(policy):
    """Two streams, three chunks at advancing timestamps, nothing evicted (HERMES: budget above the stream, H2SVC:
    windows of every frame): the next-token logits equal the model's own forward over prefix + frames + question,
    and the cache equals the model's own `DynamicCache` after its forward over prefix + frames: every full-attention
    layer's keys, values (per KV head, its class's rows for H2SVC) and positions (get_rope_index), every
    linear-attention layer's conv and recurrent state. Errors within twice the fp32 model's own off the float64
    model's."""
    g = torch.Generator().manual_seed(1)
    model, exact, tok = tiny_qwen3_5(), tiny_qwen3_5(dtype=torch.float64), tokenizer()
    chunks = video(3, g, batch=2)
    whole = full_inputs(model, tok, chunks, 2, question_text(QUESTION))
    prefix_video = full_inputs(model, tok, chunks, 2)
    as64 = {name: v.double() if v.is_floating_point() else v for name, v in whole.items()}
    own_logits = own_forward(model, whole, logits_to_keep=1).logits[:, -1]
    exact_logits = own_forward(exact, as64, logits_to_keep=1).logits[:, -1]
    own_cache, exact_cache = DynamicCache(config=model.config), DynamicCache(config=exact.config)
    own_forward(model, prefix_video, cache=own_cache, use_cache=True)
    own_forward(exact, {name: v.double() if v.is_floating_point() else v for name, v in prefix_video.items()},
                cache=exact_cache, use_cache=True)
    positions = rope_index(model, prefix_video).permute(1, 0, 2)  # [B, 3, S]

    stream = stream_of(model, policy, batch_size=2)
    for chunk in chunks:
        stream.append_video(**chunk)
    cache = stream.cache
    assert cache.length == positions.shape[-1] and stream.stats()["reindexes"] == 0
    error_bound(stream.next_token_logits(QUESTION), own_logits, exact_logits, f"{policy} last-token logits")
    held = cache.contents()
    for layer, decoder in enumerate(FULL):
        own, ref = own_cache.layers[decoder], exact_cache.layers[decoder]
        if policy == "hermes":
            parts = [(slice(None), f"layer {layer}")]
        else:
            parts = [(stream.cfg.heads_of(cls, layer), f"layer {layer} {name}")
                     for cls, name in zip(CLASSES, CLASS_NAMES) if stream.cfg.heads_of(cls, layer)]
        for heads, name in parts:
            for kind in ("keys", "values"):
                error_bound(held[f"{name} {kind}"], getattr(own, kind)[:, heads], getattr(ref, kind)[:, heads],
                            f"{name} {kind}")
            got = held[f"{name} positions"]
            assert torch.equal(got, positions if policy == "hermes" else positions[:, None].expand_as(got)), name
    linear = cache.linear_contents()
    assert len(linear) == 2 * len(LINEAR)
    for decoder in LINEAR:
        own, ref = own_cache.layers[decoder], exact_cache.layers[decoder]
        error_bound(linear[f"linear layer {decoder} conv state"], own.conv_states[0], ref.conv_states[0],
                    f"conv state of layer {decoder}")
        error_bound(linear[f"linear layer {decoder} recurrent state"], own.recurrent_states[0],
                    ref.recurrent_states[0], f"recurrent state of layer {decoder}")

"""The policies under test by the shared stream checks (tests/hermes/stream/test_*.py), one entry per policy in
`POLICIES`: how to build a stream whose free slots are poisoned, which faults to inject, how to make the in-place
step fail in the middle of its writes and what the cache then says. What a failed call must leave untouched and how
two streams compare are read from the cache's public contract (`contents()`, `buffers()`, `counters`) for every
policy; a policy overrides them only where it checks more.

Every shared check runs once per policy and model family (the `policy` x `case` fixtures of this folder's conftest
parametrise over `POLICIES` and `FAMILIES`), so a behaviour the front promises for every policy and family is
written once.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable

import torch

import hermes_kernels as hk
from hermes.policy import attention_layers
from hermes.stream import HermesStream
from hermes_kernels.policies.h2svc.config import EPISODIC
from hermes_kernels.policies.hermes import compaction
from tests.hermes.policies.h2svc.checks import h2svc_step_fails, h2svc_stream
from tests.hermes.policies.h2svc.checks import snapshot as h2svc_snapshot
from tests.hermes.stream import fifo_policy
from tests.hermes.streams import CASES, GEMMA4, LLAVA_OV1_5, MINICPM, QUESTION, QWEN3_5, QWEN3_VL, make_stream
from tests.utils import TOL, assert_close_verbose, poison_, same_bytes

ERRORS = {"oom": torch.OutOfMemoryError, "interrupt": KeyboardInterrupt}
# the model families of the shared checks: the per-policy tests' CASES, Qwen3-VL (DeepStack, timestamps) and Qwen3.5
# (hybrid: linear-attention layers whose states the caches carry, partial rotary) and LLaVA-OneVision-1.5 (Qwen's patch
# rows, 1D RoPE) and MiniCPM-V 4.6 (Qwen3.5's hybrid decoder at 1D positions, <image> markers around every frame) and
# Gemma 4 (sliding-window and KV-shared layers beside the full-attention ones)
FAMILIES = {**CASES, QWEN3_VL.name: QWEN3_VL, QWEN3_5.name: QWEN3_5, LLAVA_OV1_5.name: LLAVA_OV1_5,
            MINICPM.name: MINICPM, GEMMA4.name: GEMMA4}
H2SVC_WINDOWS = dict(instant_frames=1, short_frames=2, episodic_frames=3)  # every chunk after the second evicts


def vision_tower(model):
    return getattr(model.model, "vision_tower", None) or model.model.visual


@dataclasses.dataclass(frozen=True)
class Fault:
    """One injected failure of `append_video`: `phase` raising `error` (ValueError: the step's own validation
    refuses), on a stream built with `stream_kwargs`."""

    phase: str
    error: type
    stream_kwargs: dict = dataclasses.field(default_factory=dict)

    @property
    def id(self) -> str:
        extra = "-".join(f"{k}={v}" for k, v in self.stream_kwargs.items())
        name = "valueerror" if self.error is ValueError else next(k for k, v in ERRORS.items() if v is self.error)
        return "-".join(filter(None, (self.phase.replace(" ", "_"), name, extra)))


def cache_state(stream) -> tuple:
    """What a failed call must leave as it was: (the cache's counters, stats, history), the last step object, and
    every valid slot the cache holds (`contents()`), cloned."""
    host = (stream.cache.counters, stream.stats(), list(stream.last_convs))
    return host, stream.last_step, [[view.clone() for view in stream.cache.contents().values()]]


def cache_buffers(stream) -> list[torch.Tensor]:
    """Clones of every buffer of the cache, free slots included (what bad input must leave byte for byte)."""
    return [t.clone() for t in stream.cache.buffers()]


def same_rows(a, b, stream_a: int, stream_b: int) -> None:
    """Stream a of `a` holds what stream b of `b` holds: the same length and named contents, keys and values
    equal up to the dtype's tolerance (a batch computes them apart), as are a hybrid model's linear-attention states;
    H2SVC's frame features (means of those values) within the bound that follows from it (`features_bound`);
    everything else (positions, slot frames) exactly."""
    assert a.cache.length == b.cache.length
    x, y = a.cache.contents(), b.cache.contents()
    assert list(x) == list(y)
    for name in x:
        if name.endswith(("keys", "values", "state")):
            assert_close_verbose(x[name][stream_a], y[name][stream_b], name=name)
        elif name.endswith(" features"):
            values = x[name.removesuffix("features") + "values"][stream_a]
            assert_close_verbose(x[name][stream_a], y[name][stream_b], atol=features_bound(values), rtol=0.0,
                                 name=name)
        else:
            assert torch.equal(x[name][stream_a], y[name][stream_b]), name


def features_bound(values: torch.Tensor) -> float:
    """How far two frame features (fp32 means of T value rows, docs/h2svc.md §3) may differ when their values
    differ within the values' tolerance (atol + rtol |v|): the mean of the differences is within it too, at most
    atol + rtol M (M = max |v|), and each mean's own fp32 sum rounds by at most T u M (u the unit roundoff), T
    bounded here by the block's row count."""
    atol, rtol = TOL[values.dtype]
    largest = values.abs().max().item()
    return atol + rtol * largest + 2 * values.shape[-2] * torch.finfo(torch.float32).eps / 2 * largest


@dataclasses.dataclass(frozen=True)
class PolicyCase:
    """One policy as the shared checks drive it (module docstring).

    stream(case, model, **kw): a stream of the policy on the family `case` with poisoned free slots.
    warm: chunks to append before the next one runs the policy's step (HERMES: until the budget is reached).
    fault_kwargs: stream arguments of the fault tests; faults: the `Fault`s `append_video` is tested with.
    same_result(r0, r1): two step results agree.
    step_fails(monkeypatch): a context in which the policy's in-place step raises after it began writing.
    failed_step: how the cache names that step once it left the cache undefined; direct_step(cache): the step
        called on the cache itself.
    guidance: the policy runs a guidance pass (`HermesStream.guidance_scores`).
    every_chunk: the policy steps after every chunk (else only once a chunk passes the budget).
    check_lockstep(batch, alone): a policy's own check of two streams in lockstep, or None.
    state(stream) / buffers(stream): what a failed call must leave as it was / every buffer, free slots included
        (bad input must leave even those); same_rows(a, b, stream_a, stream_b): the valid slots of stream a of
        `a` equal those of stream b of `b`. Default: from the cache's public contract.
    """

    name: str
    stream: Callable
    warm: int
    fault_kwargs: dict
    faults: tuple
    same_result: Callable
    step_fails: Callable
    failed_step: str
    direct_step: Callable
    guidance: bool
    every_chunk: bool
    check_lockstep: Callable | None = None
    state: Callable = cache_state
    buffers: Callable = cache_buffers
    same_rows: Callable = same_rows


# ---- HERMES ----------------------------------------------------------------------------------------------------
def _hermes_stream(case, model, **kwargs) -> HermesStream:
    return make_stream(case, model, **{"budget": 40, **kwargs})


def _hermes_same_result(r0, r1) -> bool:
    return (r0 is None) == (r1 is None) and (r0 is None or torch.equal(r0.keep, r1.keep))


@contextlib.contextmanager
def _hermes_step_fails(monkeypatch):
    compact = compaction.compact_torch

    def fails_after_writing(*args, **kwargs):
        compact(*args, **kwargs)
        raise torch.OutOfMemoryError("injected after the rows moved")

    with monkeypatch.context() as patch:
        patch.setattr(compaction, "compact_torch", fails_after_writing)
        yield


# every phase with both errors, fused; the separate guidance pass adds a second forward after the prefill, so the
# phases from the last layer on also run with it (vision and layer 0 fail the same forward either way)
HERMES_FAULTS = tuple(Fault(phase, ERRORS[error], {} if mode == "fused" else {"fused_guidance": False})
                      for phase in ("vision", "first layer", "last layer", "guidance") for error in ERRORS
                      for mode in ("fused", "separate") if mode == "fused" or phase in ("last layer", "guidance")) + \
    (Fault("scores validation", ValueError), Fault("scores validation", ValueError, {"fused_guidance": False}))


# ---- H2SVC -----------------------------------------------------------------------------------------------------
def _h2svc_stream(case, model, **kwargs) -> HermesStream:
    return h2svc_stream(case, model, 2, **{**H2SVC_WINDOWS, **kwargs})


def _h2svc_state(stream) -> tuple:
    """`cache_state` with the slot frames and the episodic features whole (past the held slots too)."""
    counters, stats, convs, last_step, blocks = h2svc_snapshot(stream)
    return (counters, stats, convs), last_step, blocks


def _h2svc_kept_frames_differ(batch, alone) -> None:
    """STCE's keep sets are per (row, stream): over rows and streams the episodic frames kept are not all equal."""
    kept = [stream.cache.class_slot_frames(EPISODIC, layer)[0].sort(-1).values for stream in alone
            for layer in range(batch.cfg.num_layers) if batch.cfg.heads_of(EPISODIC, layer)]
    assert any(not torch.equal(x, kept[0]) for x in kept), "STCE kept the same frames everywhere"


H2SVC_FAULTS = tuple(Fault(phase, ERRORS[error]) for phase in ("vision", "first layer", "last layer")
                     for error in ERRORS) + (Fault("values validation", ValueError),)


# ---- FIFO (tests/hermes/stream/fifo_policy.py) --------------------------------------------------------------
def _fifo_stream(case, model, **kwargs) -> HermesStream:
    """Keeps 3 frames: a chunk brings 2 (LLaVA-OV frames, Qwen temporal steps), so from the second chunk on every
    step evicts."""
    stream = HermesStream(model, case.tokenizer(), policy="fifo", frames=3,
                          **{"chunk_frames": case.frames, "room": 160, **case.stream_kwargs, **kwargs})
    length = stream.cache.length
    for stack in stream.cache._stacks:
        for buffer in (stack.keys, stack.values):
            poison_(buffer[..., length:, :])
        poison_(stack.positions[..., length:])
    return stream


@contextlib.contextmanager
def _fifo_step_fails(monkeypatch):
    shift = fifo_policy.shift_down

    def fails_after_moving(*args):
        shift(*args)
        raise torch.OutOfMemoryError("injected after the slots moved")

    with monkeypatch.context() as patch:
        patch.setattr(fifo_policy, "shift_down", fails_after_moving)
        yield


POLICIES = {
    "hermes": PolicyCase(name="hermes", stream=_hermes_stream, warm=2, fault_kwargs=dict(budget=64, room=70),
                         faults=HERMES_FAULTS, same_result=_hermes_same_result, step_fails=_hermes_step_fails,
                         failed_step="compression step", direct_step=lambda cache: cache.compress(torch.zeros(1)),
                         guidance=True, every_chunk=False),
    "h2svc": PolicyCase(name="h2svc", stream=_h2svc_stream, warm=3, fault_kwargs={}, faults=H2SVC_FAULTS,
                        same_result=lambda r0, r1: r0 == r1, step_fails=h2svc_step_fails, failed_step="step",
                        direct_step=lambda cache: cache.step(), guidance=False, every_chunk=True,
                        check_lockstep=_h2svc_kept_frames_differ, state=_h2svc_state),
    "fifo": PolicyCase(name="fifo", stream=_fifo_stream, warm=2, fault_kwargs={},
                       faults=tuple(Fault(phase, ERRORS[error]) for phase in ("vision", "first layer", "last layer")
                                    for error in ERRORS),
                       same_result=lambda r0, r1: r0 == r1, step_fails=_fifo_step_fails, failed_step="eviction",
                       direct_step=lambda cache: cache.evict(1), guidance=False, every_chunk=True),
}


# ---- what the checks share ----------------------------------------------------------------------------------
def assert_state(policy: PolicyCase, stream, before: tuple) -> None:
    """`stream` is as `policy.state` recorded it: host state equal, the same last step object, valid slots byte
    for byte (NaN poison included)."""
    host, last_step, tensors = policy.state(stream)
    assert host == before[0]
    assert last_step is before[1]
    for index, (now, then) in enumerate(zip(tensors, before[2])):
        for x, y in zip(now, then):
            assert same_bytes(x, y), f"tensor group {index} changed"


def assert_same_buffers(policy: PolicyCase, stream, before: list[torch.Tensor]) -> None:
    for index, (now, then) in enumerate(zip(policy.buffers(stream), before)):
        assert same_bytes(now, then), f"buffer {index} changed"


def assert_same_stream(policy: PolicyCase, a, b) -> None:
    """Same stats, history and valid slots; the same logits for the next question."""
    assert a.stats() == b.stats() and a.last_convs == b.last_convs
    assert a.cache.counters == b.cache.counters
    for index in range(a.batch_size):
        policy.same_rows(a, b, index, index)
    assert torch.equal(a.next_token_logits(QUESTION), b.next_token_logits(QUESTION))


@contextlib.contextmanager
def fault(model, phase: str, error: type, monkeypatch, after: int = 0):
    """Make `phase` fail with `error` on its (after + 1)-th run: the vision tower, decoder layer 0 (before its
    cache write), the last decoder layer (after its cache write; Qwen3.5's is a linear-attention layer, after its
    state write), the pooled guidance attention (after the kernel
    wrote its scores), or the step's validation: "scores validation" makes the pooled attention non-finite (the
    HERMES step refuses it), "values validation" the last attention layer's values (an H2SVC episodic head's arriving
    frames, refused by the step)."""
    runs = [0]

    def raiser(*args, **kwargs):
        runs[0] += 1
        if runs[0] > after:
            raise error(f"injected into {phase}")

    layers = model.model.language_model.layers
    hooks, pooled = [], hk.pooled_attention
    with monkeypatch.context() as patch:
        if phase == "vision":
            hooks.append(vision_tower(model).register_forward_pre_hook(raiser))
        elif phase == "first layer":
            hooks.append(layers[0].register_forward_pre_hook(raiser))
        elif phase == "last layer":
            hooks.append(layers[-1].mlp.register_forward_pre_hook(raiser))
        elif phase == "guidance":
            patch.setattr(hk, "pooled_attention", lambda *a, **k: (pooled(*a, **k), raiser())[0])
        elif phase == "scores validation":
            patch.setattr(hk, "pooled_attention", lambda *a, **k: pooled(*a, **k).fill_(float("nan")))
        elif phase == "values validation":
            hooks.append(attention_layers(model)[-1].self_attn.v_proj.register_forward_hook(
                lambda module, args, out: out.fill_(float("nan"))))
        else:
            raise ValueError(phase)
        try:
            yield
        finally:
            for hook in hooks:
                hook.remove()


def warmed_pair(policy: PolicyCase, case, model, g, batch: int = 1, **kwargs) -> tuple:
    """Two streams of `policy` fed the same `policy.warm` chunks: the next chunk runs the policy's step."""
    streams = tuple(policy.stream(case, model, batch_size=batch, **kwargs) for _ in range(2))
    for _ in range(policy.warm):
        clip = case.chunk(batch, g)
        for stream in streams:
            assert (stream.append_video(**clip) is None) is not policy.every_chunk
    return streams


def stacked(pair: list[dict]) -> dict:
    """The append_video arguments of two streams' clips in lockstep: the first's, with the two streams' pixel values
    (and Gemma 4's patch positions) one after the other."""
    merged = dict(pair[0], video=torch.cat([pair[0]["video"], pair[1]["video"]]))
    if "video_position_ids" in merged:
        merged["video_position_ids"] = torch.cat([pair[0]["video_position_ids"], pair[1]["video_position_ids"]])
    return merged


def lockstep_and_alone(policy: PolicyCase, case, model, clips: list) -> tuple:
    """A two-stream batch and two single streams of `policy` fed the same clips (one pair per chunk)."""
    batch = policy.stream(case, model, batch_size=2)
    alone = [policy.stream(case, model) for _ in range(2)]
    for pair in clips:
        batch.append_video(**stacked(pair))
        for b, stream in enumerate(alone):
            stream.append_video(**pair[b])
    return batch, alone

"""Helpers of the adapter tests (tests/hermes_kernels/compat/test_*.py): twin instances of the released-class stand-in
(one kept as the oracle, one accelerated), random chunks, and a drive that compares them chunk by chunk.

Imports torch, the kernel library and the stand-in (scaffolding/standin/) only, so the isolated test (transformers
and hermes unimportable) uses it too.
"""
from __future__ import annotations

import dataclasses

import torch

from hermes_kernels.compat import accelerate
from scaffolding.rotary import proportional_inv_freq
from scaffolding.standin import (LayeredDynamicCache, LegacyDynamicCache, ReleasedLLaVAOV, ReleasedQwenVL, TinyCausalLM,
                                 TinyLanguageModel, TinyTokenizer, layer_pairs, with_layers)

LAYERS, HEADS, KV_HEADS, HEAD_DIM = 10, 4, 2, 16      # thresholds int(0.1·10) = 1, int(0.7·10) = 7
PREFIX, BUDGET, CHUNK = 5, 40, 24                      # the first chunk stays under the budget, later ones not
GRID = (2, 3, 4)                                       # a Qwen chunk: 2 temporal steps of a 3 x 4 merged grid
LAZY_LIMIT = {"llava_ov": 1100, "qwen2_5_vl": 1040}    # max_position_embeddings that make lazy re-indexing fire
CONTAINERS = {"list": list, "tuple": tuple, "legacy": LegacyDynamicCache, "layered": LayeredDynamicCache}


@dataclasses.dataclass
class Case:
    kind: str = "llava_ov"
    dtype: torch.dtype = torch.float32
    streaming: bool = True
    container: object = "list"                   # a CONTAINERS name or a callable on the (keys, values) pairs
    attn_implementation: str = "sdpa"
    seed: int = 0
    fast_attn_implementation: str | None = None   # the accelerated twin's, when it differs from the oracle's
    chunks: int = 6
    kv_size: int = BUDGET
    attention_scaling: float = 1.0               # the rotary module's (YaRN-style rotaries set one other than 1)
    heads: int = HEADS                           # query heads; the hidden size is heads · head_dim (the released
    kv_heads: int = KV_HEADS                     # guidance pass reads head_dim as hidden_size // heads)
    head_dim: int = HEAD_DIM
    proportional: bool = False                   # the rotary module's inv_freq is Gemma 4's (most pairs at frequency 0)

    @property
    def max_positions(self) -> int:
        return LAZY_LIMIT[self.kind] if self.streaming else 32768


def make_instance(case: Case, container="list", fast: bool = False):
    """A stand-in instance with its own tiny language model (weights from case.seed) and the prefix cache in
    `container` (a name of CONTAINERS, or a callable taking the list of (keys, values) pairs)."""
    impl = case.fast_attn_implementation if fast and case.fast_attn_implementation else case.attn_implementation
    common = dict(num_layers=LAYERS, heads=case.heads, kv_heads=case.kv_heads, head_dim=case.head_dim,
                  hidden=case.heads * case.head_dim, max_positions=case.max_positions, attn_implementation=impl,
                  seed=case.seed)
    if case.kind == "llava_ov":
        model = ReleasedLLaVAOV(TinyCausalLM(**common), TinyTokenizer(), case.kv_size, streaming=case.streaming)
    else:
        model = ReleasedQwenVL(TinyLanguageModel(mrope_section=(2, 3, 3), **common), TinyTokenizer(), case.kv_size,
                               streaming=case.streaming)
        model.softmax_dtype = torch.float32  # exact pooled attention; the fp16 softmax is tested on its own
    model._rotary().attention_scaling = case.attention_scaling
    if case.proportional:
        model._rotary().inv_freq.copy_(proportional_inv_freq(case.head_dim))
    gen = torch.Generator().manual_seed(1000 + case.seed)
    shape = (1, case.kv_heads, PREFIX, case.head_dim)
    keys = [torch.randn(*shape, generator=gen).to(case.dtype) for _ in range(LAYERS)]
    values = [torch.randn(*shape, generator=gen).to(case.dtype) for _ in range(LAYERS)]
    model.start(keys, values, CONTAINERS.get(container, container) if isinstance(container, str) else container)
    return model


def random_chunks(case: Case):
    gen = torch.Generator().manual_seed(2000 + case.seed)
    for _ in range(case.chunks):
        shape = (1, case.kv_heads, CHUNK, case.head_dim)
        yield ([torch.randn(*shape, generator=gen).to(case.dtype) for _ in range(LAYERS)],
               [torch.randn(*shape, generator=gen).to(case.dtype) for _ in range(LAYERS)])


def record_keeps(model) -> list:
    """Wrap the instance's apply_kv_cache_pruning_strict to log the keep indices it is handed, as lists."""
    log = []
    original = model.apply_kv_cache_pruning_strict

    def apply(keep):
        log.append([[int(i) for i in layer] for layer in keep])
        return original(keep)

    model.apply_kv_cache_pruning_strict = apply
    return log


def key_tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(atol, rtol) of keys: the stand-in rotates through cos/sin tables in the cache dtype (released numerics),
    the adapter by fp32 angles, so fp16 keys differ by a few fp16 steps after several re-indexings."""
    return (2e-2, 1e-2) if dtype == torch.float16 else (1e-4, 1e-4)


def compare(ref, fast, case: Case, key_atol: float | None = None) -> float:
    """Identical lengths and positions, keys and values within tolerance (keys: `key_atol` if given); returns the
    largest key error. Both caches are read by the stand-in's own reader, not by the adapter's `read_layers`."""
    ref_pairs, fast_pairs = layer_pairs(ref.kv_cache), layer_pairs(fast.kv_cache)
    atol, rtol = key_tolerance(case.dtype) if key_atol is None else (key_atol, 0.0)
    worst = 0.0
    for layer, ((rk, rv), (fk, fv)) in enumerate(zip(ref_pairs, fast_pairs)):
        assert fk.shape == rk.shape, f"layer {layer}: keys {tuple(fk.shape)} != {tuple(rk.shape)}"
        assert fk.dtype == rk.dtype
        rp, fp = ref._position_ids_cache[layer], fast._position_ids_cache[layer]
        assert fp.dtype == rp.dtype and torch.equal(fp, rp), f"layer {layer}: positions {fp} != {rp}"
        torch.testing.assert_close(fk.float(), rk.float(), atol=atol, rtol=rtol, msg=f"layer {layer} keys")
        torch.testing.assert_close(fv.float(), rv.float(), atol=2e-3 if case.dtype == torch.float16 else 1e-5,
                                   rtol=2e-3 if case.dtype == torch.float16 else 1e-5, msg=f"layer {layer} values")
        worst = max(worst, (fk.float() - rk.float()).abs().max().item())
    return worst


def sync(fast, ref) -> None:
    """Give the accelerated twin the oracle's cache and positions (copies), in the twin's own container."""
    fast.kv_cache = with_layers(fast.kv_cache, [(k.clone(), v.clone()) for k, v in layer_pairs(ref.kv_cache)])
    fast._position_ids_cache = [p.clone() for p in ref._position_ids_cache]


def drive(case: Case, guidance: str = "released", backend: str = "torch", lockstep: bool = False):
    """Stream case.chunks random chunks through the oracle and an accelerated twin (its cache in case.container),
    comparing after every chunk; with `lockstep` the twin starts every chunk from the oracle's state (fp16 caches:
    the oracle's keys drift from the twin's by its fp16 rotary tables, which a later near-tie would amplify).
    The selections must be tie-free: every top-k boundary gap is over 1e-5 of the score there.
    Returns (oracle, accelerated instance, handle, keep logs, largest key error)."""
    ref, fast = make_instance(case), make_instance(case, case.container, fast=True)
    handle = accelerate(fast, backend=backend, guidance=guidance)
    ref_keeps, fast_keeps = record_keeps(ref), record_keeps(fast)
    grid = GRID if case.kind == "qwen2_5_vl" else None
    worst = 0.0
    for keys, values in random_chunks(case):
        ref.encode_chunk(keys, values, grid)
        fast.encode_chunk([k.clone() for k in keys], [v.clone() for v in values], grid)
        if lockstep:
            sync(fast, ref)
        ref.predict_and_compress()
        fast.predict_and_compress()
        assert fast_keeps == ref_keeps, "keep indices differ"
        worst = max(worst, compare(ref, fast, case))
    assert min(ref.boundary_margins) > 1e-5, f"inputs not tie-free: a relative top-k gap of {min(ref.boundary_margins)}"
    return ref, fast, handle, ref_keeps, worst

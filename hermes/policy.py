"""The policy contract of the streaming front, and the registry the front finds policies in (docs/policies.md).

A policy is what the front (`hermes.stream.HermesStream`) needs to keep a stream's KV cache small: a config, a
cache (a `hermes.cache.StreamCacheBase`) and what runs after each chunk of video is encoded. The front does
everything else, the same way for every policy: encoding, room checks, failure atomicity, questions, threads,
reset. Policies are registered by name (`register_policy`) and looked up by the name a stream is built with
(`HermesStream(..., policy="h2svc")`); the built-in ones, "hermes" and "h2svc", are imported on first lookup, so
the front imports no policy.

    @register_policy
    class MyPolicy(StreamPolicy):
        name = "mine"

        def __init__(self, stream, *, my_setting=1):
            shape = ModelGeometry.of(stream)
            self.cfg = ...
            self.cache = MyCache(...)        # a StreamCacheBase subclass

        def append_chunk(self, stream, chunk):
            prefill(stream.language_model, self.cache, chunk)
            return self.cache.my_step()
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import TYPE_CHECKING, Any, ClassVar, Sequence

import torch

from hermes_kernels.rope import RotaryLayout

if TYPE_CHECKING:
    from hermes.cache import StreamCacheBase
    from hermes.models import VideoChunk
    from hermes.stream import HermesStream

# the built-in policies: name -> the module that registers it (imported on first lookup)
_BUILT_IN = {"hermes": "hermes.policies.hermes.policy", "h2svc": "hermes.policies.h2svc.policy"}
_REGISTERED: dict[str, type["StreamPolicy"]] = {}


@dataclasses.dataclass(frozen=True)
class ModelGeometry:
    """What a policy reads off the model and the stream to build its config and size its cache.

    num_layers, num_heads, num_kv_heads, head_dim: the language model's decoder layers and attention heads.
    dtype:         keys' and values' storage dtype (the model's).
    max_positions: the model's max_position_embeddings.
    prefix_len:    P, tokens of the stream's system prefix.
    inv_freq:      [D/2] rotary inverse frequencies from the model's rotary module; rotary: the axis of
                   each frequency pair (`RotaryLayout`), or None for 1D RoPE (`ModelFamily.rotary`).
    layer_devices: the device of every layer (a model split with `device_map` has several).
    """

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    max_positions: int
    prefix_len: int
    inv_freq: torch.Tensor
    rotary: RotaryLayout | None
    layer_devices: list[torch.device]

    @classmethod
    def of(cls, stream: "HermesStream") -> "ModelGeometry":
        """The geometry of the stream's model (its text config, first attention module and rotary module)."""
        text_config = stream.model.config.get_text_config()
        layers = stream.language_model.layers
        attention = layers[0].self_attn
        inv_freq, rotary = stream.family.rotary(stream.model)
        return cls(num_layers=len(layers), num_heads=text_config.num_attention_heads,
                   num_kv_heads=text_config.num_key_value_heads, head_dim=attention.head_dim,
                   dtype=attention.k_proj.weight.dtype, max_positions=text_config.max_position_embeddings,
                   prefix_len=len(stream.prefix_ids), inv_freq=inv_freq, rotary=rotary,
                   layer_devices=[layer.self_attn.k_proj.weight.device for layer in layers])


class StreamPolicy:
    """A KV-cache policy behind `HermesStream` (module docstring; docs/policies.md).

    A subclass sets `name` (the key streams are built with), takes the stream and its own keyword arguments in
    `__init__` (the stream's `policy_args`) and sets `cfg` (its config) and `cache` (a `StreamCacheBase`), then
    implements `append_chunk`. Everything it does inside `append_chunk` runs in the cache's `atomic()`: a failure
    before the cache's in-place step leaves the stream as it was.
    """

    name: ClassVar[str]
    cfg: Any
    cache: "StreamCacheBase"

    def append_chunk(self, stream: "HermesStream", chunk: "VideoChunk") -> Any:
        """Store one encoded chunk in the cache and run the policy's step; return the step's result, or None when
        no step ran. Raise ValueError before any forward when the chunk cannot be stored."""
        raise NotImplementedError

    def guidance_scores(self, stream: "HermesStream", layers: Sequence[int] | None) -> torch.Tensor:
        """Pooled guidance attention [L, B, V] over the cache as it is, for policies that score with a guidance
        pass (HERMES); the others refuse."""
        raise ValueError(f"guidance_scores: the {type(self).__name__} runs no guidance pass")


def register_policy(cls: type[StreamPolicy]) -> type[StreamPolicy]:
    """Register a `StreamPolicy` subclass under its `name` (usable as a class decorator); a name taken by another
    class is refused."""
    if not (isinstance(cls, type) and issubclass(cls, StreamPolicy)):
        raise TypeError(f"policy: expected a StreamPolicy subclass, got {cls!r}")
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise ValueError(f"policy: {cls.__name__} needs a class attribute `name` (a non-empty string)")
    if _REGISTERED.get(name, cls) is not cls:
        raise ValueError(f"policy: the name {name!r} is taken by {_REGISTERED[name].__name__}")
    _REGISTERED[name] = cls
    return cls


def policy_names() -> list[str]:
    """The names a stream can be built with: the built-in policies and every registered one."""
    return sorted(set(_BUILT_IN) | set(_REGISTERED))


def get_policy(name: str) -> type[StreamPolicy]:
    """The policy class registered as `name` (a built-in one is imported first); ValueError naming `policy`."""
    if name not in _REGISTERED and name in _BUILT_IN:
        importlib.import_module(_BUILT_IN[name])
    if name not in _REGISTERED:
        raise ValueError(f"policy: expected one of {policy_names()}, got {name!r}")
    return _REGISTERED[name]

"""The policy contract of the streaming front: `StreamSetup` (everything a policy is built from, complete before the
policy exists) and `StreamPolicy` (what a policy implements) (docs/policies.md).

A policy is a config, a cache (`hermes.cache.StreamCacheBase`) and `append_chunk`, what runs after each chunk of
video is encoded; the front (`hermes.stream.HermesStream`) does the rest, the same way for every policy. Policies
register by name (`register_policy`, from `hermes.registry`, where the front finds them); the built-in ones,
"hermes" and "h2svc", and installed packages' are imported on first lookup, so the front imports no policy.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar, Sequence

import torch

from hermes.linear_state import FULL, LINEAR, SLIDING, LinearLayout, layer_kinds
from hermes.models import ModelFamily, family_of
from hermes.parallel import HeadShard, head_shard
# the registry, importable from here beside the base class a policy subclasses (docs/policies.md#registry)
from hermes.registry import get_policy, policy_names, register_policy  # noqa: F401
from hermes_kernels.engine.checks import check_positive_int
from hermes_kernels.engine.dispatch import check_backend
from hermes.window import WindowLayout, cache_layers
from hermes_kernels.engine.geometry import ModelGeometry

if TYPE_CHECKING:
    from hermes.cache import StreamCacheBase
    from hermes.models import VideoChunk


def attention_layers(model: torch.nn.Module, family: ModelFamily | None = None) -> list[torch.nn.Module]:
    """The decoder layers whose keys the policy caches hold, in depth order: the full-attention layers that compute
    their own keys (every layer of most models; not a hybrid model's linear-attention layers, nor Gemma 4's
    sliding-window and KV-shared layers). ValueError naming `layer_types` for a kind the caches do not hold."""
    family = family or family_of(model)
    layers = family.language_model(model).layers
    return [layers[i] for i in cache_layers(model.config)]


def geometry_of(model: torch.nn.Module, family: ModelFamily | None = None) -> ModelGeometry:
    """The `ModelGeometry` of a loaded model: its text config (heads, positions, RoPE base), its first attention
    module (head dim) and the family's rotary layout; `num_layers` counts the layers that hold a KV cache (a
    hybrid model's full-attention layers)."""
    family = family or family_of(model)
    text_config = model.config.get_text_config()
    layers = attention_layers(model, family)
    rope = getattr(text_config, "rope_parameters", None) or {}
    rope = rope.get(FULL, rope)  # per layer kind (Gemma 4): the full-attention layers'
    _, rotary = family.rotary(model)
    attention = layers[0].self_attn
    return ModelGeometry(num_layers=len(layers), num_heads=text_config.num_attention_heads,
                         num_kv_heads=text_config.num_attention_heads // attention.num_key_value_groups,
                         head_dim=attention.head_dim,
                         max_positions=text_config.max_position_embeddings,
                         rope_theta=rope.get("rope_theta", getattr(text_config, "rope_theta", None)), rotary=rotary)


@dataclasses.dataclass(frozen=True, eq=False)
class StreamSetup:
    """Everything a policy is built from, checked and complete before the policy is constructed
    (docs/policies.md#setup).

    model, processor, tokenizer: the loaded model, its processor and the tokenizer questions and prompts use.
    family:        the model's `hermes.models.ModelFamily`; language_model: its decoder stack.
    batch_size:    B streams in lockstep; chunk_tokens: the most tokens one chunk brings; room: slots past the kept
                   tokens and a chunk (guidance prompts, a question and its answer); frame_size: (height, width) of
                   the processed frames, or None.
    prefix_ids:    the system prefix's token ids (P = prefix_len of them, never evicted).
    backend:       "auto" | "triton" | "torch": the backend of the policy's kernels.
    geometry:      the model's `hermes_kernels.engine.geometry.ModelGeometry`; under tensor parallelism with this rank's
                   head counts (what its caches hold).
    shard:         this rank's `hermes.parallel.HeadShard` of a model loaded with `DistributedConfig(tp_size=N)`,
                   else None (docs/multi-gpu.md).
    dtype:         keys' and values' storage dtype (the model's); inv_freq: [R/2] rotary inverse frequencies taken
                   from the model's rotary module (never recomputed); layer_devices: the device of every layer that
                   holds keys (the full-attention layers, in depth order).
    linear:        a hybrid model's `hermes.linear_state.LinearLayout` (which decoder layer is which, the
                   linear-attention layers' state shapes), None when every layer is full attention
                   (docs/qwen3_5.md#hybrid-cache).
    windows:       a `hermes.window.WindowLayout` for a decoder with sliding-window or KV-shared layers (Gemma 4,
                   docs/gemma4.md), else None.
    """

    model: torch.nn.Module
    processor: Any
    tokenizer: Any
    family: ModelFamily
    language_model: torch.nn.Module
    batch_size: int
    chunk_tokens: int
    room: int
    frame_size: tuple[int, int] | None
    prefix_ids: tuple[int, ...]
    backend: str
    geometry: ModelGeometry
    dtype: torch.dtype
    inv_freq: torch.Tensor
    layer_devices: tuple[torch.device, ...]
    shard: HeadShard | None = None
    linear: LinearLayout | None = None
    windows: WindowLayout | None = None

    @property
    def prefix_len(self) -> int:
        """P: tokens of the system prefix."""
        return len(self.prefix_ids)

    @classmethod
    def build(cls, model: torch.nn.Module, processor=None, *, batch_size: int = 1, chunk_frames: int = 16,
              chunk_tokens: int | None = None, frame_size: tuple[int, int] | None = None, room: int = 512,
              system_prompt: str | None = None, backend: str = "auto") -> "StreamSetup":
        """Check `HermesStream`'s own arguments (docs/stream.md) and read the model: ValueError / TypeError naming
        the argument."""
        family = family_of(model)
        kinds = layer_kinds(model.config)  # a layer kind the caches do not hold: refused first
        tokenizer = getattr(processor, "tokenizer", processor)
        if tokenizer is None or not callable(tokenizer):
            raise TypeError("processor: expected the model's processor or a tokenizer (guidance prompts and "
                            f"questions are tokenized), got {type(processor).__name__}")
        for name, value in (("batch_size", batch_size), ("chunk_frames", chunk_frames), ("room", room)):
            check_positive_int(name, value)
        check_backend(backend)
        language_model = family.language_model(model)
        shard = head_shard(model, family, language_model)  # tensor parallelism the stream cannot run: refused first
        prefix_ids = tuple(tokenizer(family.prefix_text(system_prompt), add_special_tokens=False)["input_ids"])
        if chunk_tokens is None:
            chunk_tokens = family.tokens_per_chunk(model, chunk_frames, frame_size, tokenizer=tokenizer)
        check_positive_int("chunk_tokens", chunk_tokens)
        layers = attention_layers(model, family)
        linear = LinearLayout.of(language_model, kinds) if LINEAR in kinds else None
        shared = getattr(model.config.get_text_config(), "num_kv_shared_layers", 0)
        # the most tokens one forward brings: a chunk, or text within room (guidance never rides in a chunk here)
        forward_tokens = max(chunk_tokens, room)
        windows = WindowLayout.of(language_model, kinds, forward_tokens) if SLIDING in kinds or shared else None
        geometry = geometry_of(model, family)
        if shard is not None:
            # the full-attention layers may have their own KV head count (Gemma 4): each must split evenly too
            if geometry.num_kv_heads % shard.count:
                raise ValueError(f"model: the {geometry.num_kv_heads} KV heads of the full-attention layers do not "
                                 f"split evenly over {shard.count} ranks; tp_size must divide them")
            if shard.num_kv_heads != geometry.num_kv_heads:  # the policy layers have their own KV heads
                shard = dataclasses.replace(shard, num_kv_heads=geometry.num_kv_heads)
            geometry = shard.local(geometry)
            if windows is not None:
                windows = dataclasses.replace(windows, num_kv_heads=windows.num_kv_heads // shard.count)
        inv_freq, _ = family.rotary(model)
        return cls(model=model, processor=processor, tokenizer=tokenizer, family=family,
                   language_model=language_model, batch_size=batch_size, chunk_tokens=chunk_tokens, room=room,
                   frame_size=frame_size, prefix_ids=prefix_ids, backend=backend,
                   geometry=geometry,
                   dtype=layers[0].self_attn.k_proj.weight.dtype, inv_freq=inv_freq,
                   layer_devices=tuple(layer.self_attn.k_proj.weight.device for layer in layers), shard=shard,
                   linear=linear, windows=windows)


class StreamPolicy:
    """A KV-cache policy behind `HermesStream` (docs/policies.md).

    A subclass sets `name` (the key streams are built with); its `__init__(setup, **policy_args)` calls
    `super().__init__(setup)` and sets `cfg` (its config) and `cache` (a `StreamCacheBase`); it implements
    `append_chunk`. The front runs `append_chunk` inside the cache's `atomic()`: a failure before the cache's
    in-place step leaves the stream as it was.
    """

    name: ClassVar[str]
    cfg: Any
    cache: "StreamCacheBase"

    def __init__(self, setup: StreamSetup):
        self.setup = setup

    def append_chunk(self, chunk: "VideoChunk", history: tuple[str | None, ...]) -> Any:
        """Store one encoded chunk (embeds [B, T, hidden]) in the cache and run the policy's step; return the step's
        result, or None when no step ran. `history`: each stream's last question and answer ("q a"), None before
        the first. Raise ValueError before any forward when the chunk cannot be stored."""
        raise NotImplementedError

    def guidance_scores(self, layers: Sequence[int] | None, history: tuple[str | None, ...]) -> torch.Tensor:
        """Pooled guidance attention float32 [L, B, V] over the cache as it is, for policies that score with a
        guidance pass (HERMES); the others refuse."""
        raise ValueError(f"guidance_scores: the {type(self).__name__} runs no guidance pass")

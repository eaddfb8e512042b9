"""H2SVC behind the streaming front: `HermesStream(model, processor, policy="h2svc", head_map=...)`
(docs/stream.md#h2svc).

`H2SVCPolicy` is the "h2svc" entry of the policy registry (`hermes.policy`): from the stream's setup it builds the
`H2SVCConfig` (the family's preset, a head map, window / ratio / re-index overrides) and the `H2SVCCache`, and after
a chunk's prefill it runs `cache.step`; the front owns the rest. Its arguments: docs/stream.md#h2svc-behind-the-front;
under tensor parallelism: docs/multi-gpu.md#h2svc.
"""
from __future__ import annotations

import os
import warnings

from hermes.cache import prefill
from hermes.models import VideoChunk
from hermes.parallel import HeadShard
from hermes.policy import StreamPolicy, StreamSetup, register_policy
from hermes_kernels.policies.h2svc.config import H2SVCConfig
from hermes_kernels.results import H2SVCChunkResult

from .blocks import CLASSES
from .cache import H2SVCCache
from .head_map import HeadProfile, check_head_map, load_head_map


@register_policy
class H2SVCPolicy(StreamPolicy):
    """H2SVC (docs/h2svc.md) for a `HermesStream`: the config, an `H2SVCCache`, and a step after every chunk.

    Args (HermesStream keyword arguments):
        head_map:         which class every (layer, KV head) belongs to:
                          - a path to a profiler JSON (`hermes-profile`), checked against
                            the model (`load_head_map`: another model type or shape is refused);
                          - a `HeadProfile` (checked the same way);
                          - an int [L, Hkv] map (tensor or nested lists) of INSTANT / SHORT / EPISODIC;
                          - an `H2SVCConfig` for the whole policy (then no other policy argument; its layers, KV
                            heads, prefix_len and tokens_per_frame must match the model and the stream);
                          always of the whole model: under tensor parallelism each rank takes its KV heads' columns.
                          - None: the documented default map (`default_head_map`: depth order with the paper's ratios),
                            with a warning that it is not profiled.
        tokens_per_frame: T_f; default from the family (LLaVA-OV: the tower's pooled grid; Qwen2.5-VL: from the
                          stream's frame_size, one temporal grid step; Qwen3-VL: that step with its timestamp).
        reindex, instant_frames, short_frames, episodic_frames, instant_ratio, short_ratio, margin, max_positions:
                          `H2SVCConfig` fields over the family's preset (max_positions defaults to the model's
                          max_position_embeddings).
    """

    name = "h2svc"

    def __init__(self, setup: StreamSetup, *, head_map=None, tokens_per_frame: int | None = None, **overrides):
        super().__init__(setup)
        model, geometry, P, shard = setup.model, setup.geometry, setup.prefix_len, setup.shard
        kv_heads = geometry.num_kv_heads if shard is None else shard.num_kv_heads  # the map's: the whole model's
        try:
            frame_tokens = setup.family.tokens_per_frame(model, setup.frame_size, tokenizer=setup.tokenizer)
        except ValueError:  # Qwen-VL without frame_size: tokens_per_frame (or the config) must say it
            frame_tokens = None
        if isinstance(head_map, H2SVCConfig):
            if overrides or tokens_per_frame is not None:
                raise TypeError("head_map: pass an H2SVCConfig alone, or a map with tokens_per_frame / overrides")
            config = head_map
            expected = (geometry.num_layers, kv_heads, P, frame_tokens or config.tokens_per_frame)
            got = (config.num_layers, config.num_kv_heads, config.prefix_len, config.tokens_per_frame)
            if got != expected:
                raise ValueError(f"head_map: the H2SVCConfig has (layers, KV heads, prefix_len, tokens_per_frame) = "
                                 f"{got}; the model and stream need {expected}")
        else:
            if tokens_per_frame is None:
                tokens_per_frame = frame_tokens if frame_tokens is not None else \
                    setup.family.tokens_per_frame(model, setup.frame_size, tokenizer=setup.tokenizer)  # raises
            overrides.setdefault("max_positions", geometry.max_positions)
            config = H2SVCConfig.preset(setup.family.preset_name, geometry.num_layers, kv_heads, P,
                                        tokens_per_frame=tokens_per_frame, head_map=self._head_map(head_map, model),
                                        **overrides)
        if not config.profiled:
            warnings.warn("head_map: not profiled; using the default map (the H2SVC paper's class shares, 10 % "
                          "instant and 40 % short, assigned by layer depth: the lowest heads instant, then short, the "
                          "top episodic). Profile the model with hermes-profile and pass head_map=PATH", stacklevel=3)
        chunk_frames = setup.chunk_tokens // config.tokens_per_frame
        if chunk_frames < 1:
            raise ValueError(f"chunk_tokens: {setup.chunk_tokens} tokens hold no whole frame of "
                             f"tokens_per_frame={config.tokens_per_frame}")
        # every rank moves the host counters of the classes of the whole map, held here or not, so all stay in step
        classes = tuple(c for c in CLASSES if config.num_rows(c))
        self.cfg = config if shard is None else rank_config(config, shard)
        self.cache = H2SVCCache(
            self.cfg, batch_size=setup.batch_size, num_heads=geometry.num_heads, head_dim=geometry.head_dim,
            chunk_frames=chunk_frames, room=setup.room, dtype=setup.dtype, inv_freq=setup.inv_freq,
            rotary=geometry.rotary, layer_devices=setup.layer_devices, classes=classes,
            group=None if shard is None else shard.group, linear=setup.linear,
            windows=setup.windows)

    @staticmethod
    def _head_map(head_map, model):
        """The int [L, Hkv] map (or None) from a path, a HeadProfile, or a map given as is."""
        if isinstance(head_map, (str, os.PathLike)):
            return load_head_map(head_map, model).head_map
        if isinstance(head_map, HeadProfile):
            check_head_map(head_map, model)
            return head_map.head_map
        return head_map

    def append_chunk(self, chunk: VideoChunk, history: tuple[str | None, ...]) -> H2SVCChunkResult:
        """Prefill `chunk` as a chunk of frames (frame-window masks, `hermes.policies.h2svc.attention`), then one step
        over every class block. ValueError before any forward when its frames are not of the configured size."""
        count, T_f = chunk.embeds.shape[1], self.cfg.tokens_per_frame
        if count != chunk.frames * T_f:
            raise ValueError(f"video: the chunk has {count} tokens in {chunk.frames} frames; the H2SVC cache was built "
                             f"for frames of tokens_per_frame={T_f} (frame_size)")
        prefill(self.setup.language_model, self.cache, chunk, frames=chunk.frames, extent=chunk.extent)
        return self.cache.step(backend=self.setup.backend)


def rank_config(config: H2SVCConfig, shard: HeadShard) -> H2SVCConfig:
    """This rank's part of a whole-model config: the head map's columns of its KV heads (`shard.kv_heads`), as a
    config of Hkv/N heads; every other field as given."""
    heads = shard.kv_heads
    return config.replace(num_kv_heads=len(heads), head_map=config.head_classes[:, heads.start:heads.stop])


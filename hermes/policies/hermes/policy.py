"""HERMES behind the streaming front: `HermesStream(model, processor, budget=6000)` (the default policy).

After every chunk whose visual tokens exceed the budget the policy scores the cache with the guidance prompts
(`guidance`) and runs one in-place compression step (`HermesCache.compress`), so the cache holds prefix + budget
tokens between chunks. By default (`fused_guidance=True`) the prompts ride behind the chunk in its own prefill
forward (docs/hermes.md §4); `fused_guidance=False` runs the prefill and then a separate guidance pass. The last
question and answer of each stream (the front's `history`) fill the guidance prompts of the next steps.
"""
from __future__ import annotations

from typing import Sequence

import torch

from hermes.cache import prefill
from hermes.models import VideoChunk
from hermes.policy import StreamPolicy, StreamSetup, register_policy
from hermes_kernels.policies.hermes.config import HermesConfig
from hermes_kernels.policies.hermes.tensor_parallel import group_mean
from hermes_kernels.results import CompressResult

from .cache import HermesCache
from .guidance import GuidancePlan, guidance_length, run_guidance


@register_policy
class HermesPolicy(StreamPolicy):
    """HERMES behind the front (docs/hermes.md §2): the family preset, a `HermesCache` sized prefix + budget + chunk
    + room, and what follows a chunk's prefill: guidance + one compression step once the budget is exceeded.

    Args (HermesStream keyword arguments):
        budget:         visual tokens kept per layer (|M|).
        reindex:        "lazy" (streaming, default) or "eager" re-indexing of positions (§2.7).
        config:         a full `HermesConfig` instead of the family preset (prefix_len and num_layers must match).
        fused_guidance: True: guidance prompts in the chunk's own prefill forward (§4); False: a separate guidance
                        pass after the prefill; None (default): True, except on a hybrid model (Qwen3.5), whose
                        linear-attention states would take the prompts in (docs/qwen3_5.md#guidance), and on a model
                        with sliding-window layers (Gemma 4), whose rings would (docs/gemma4.md#roles).
        overrides:      further preset fields (e.g. margin=..., summary=False).
    """

    name = "hermes"

    def __init__(self, setup: StreamSetup, *, budget: int = 6000, reindex: str = "lazy",
                 config: HermesConfig | None = None, fused_guidance: bool | None = None, **overrides):
        super().__init__(setup)
        side = setup.linear is not None or setup.windows is not None
        if fused_guidance is None:
            fused_guidance = not side
        if not isinstance(fused_guidance, bool):
            raise TypeError(f"fused_guidance: expected a bool or None, got {fused_guidance!r}")
        if fused_guidance and side:
            raise ValueError("fused_guidance: the guidance prompts would pass through the linear-attention layers' "
                             "states or the sliding-window layers' rings; leave it None or False "
                             "(docs/qwen3_5.md#guidance, docs/gemma4.md#roles)")
        geometry, P = setup.geometry, setup.prefix_len
        if config is None:
            config = HermesConfig.preset(setup.family.preset_name, geometry.num_layers, budget, P,
                                         max_positions=geometry.max_positions, reindex=reindex, **overrides)
        elif overrides or not isinstance(config, HermesConfig):
            raise TypeError("config: pass a HermesConfig alone, or budget/reindex/overrides for the preset")
        if config.num_layers != geometry.num_layers or config.prefix_len != P:
            raise ValueError(f"config: expected num_layers={geometry.num_layers} and prefix_len={P} "
                             f"(the prefix tokens), got {config.num_layers} and {config.prefix_len}")
        self.cfg = config
        self.fused_guidance = fused_guidance
        # tensor parallelism: the ranks' pooled attention (each over its own heads) is averaged once per step
        self.group = None if setup.shard is None else setup.shard.group
        self.cache = HermesCache(
            config, batch_size=setup.batch_size, num_kv_heads=geometry.num_kv_heads, head_dim=geometry.head_dim,
            capacity=config.prefix_len + config.budget + setup.chunk_tokens + setup.room, dtype=setup.dtype,
            inv_freq=setup.inv_freq, rotary=geometry.rotary, layer_devices=setup.layer_devices, group=self.group,
            linear=setup.linear, windows=setup.windows)
        self.plan = GuidancePlan.from_config(config)
        self._prompt_ids: tuple[tuple, list] | None = None  # (history, its prompts' token ids)

    def prompt_ids(self, history: tuple[str | None, ...]) -> list[list[list[int]]]:
        """`plan.token_ids` for the streams' last conversations, tokenized again only when those change (every
        compressing chunk needs them)."""
        key = tuple(history)
        if self._prompt_ids is None or self._prompt_ids[0] != key:
            self._prompt_ids = key, self.plan.token_ids(self.setup.tokenizer, history)
        return self._prompt_ids[1]

    def append_chunk(self, chunk: VideoChunk, history: tuple[str | None, ...]) -> CompressResult | None:
        """Prefill `chunk`; past the budget score and compress (the step's result), else None. Raises ValueError
        before any forward when the chunk and its guidance prompts do not fit the cache."""
        cache, cfg, setup = self.cache, self.cfg, self.setup
        count = chunk.embeds.shape[1]
        compress = cache.length + count - cfg.prefix_len > cfg.budget
        ids = self.prompt_ids(history) if compress else None
        needed = cache.length + count + (guidance_length(ids) if compress else 0)
        if needed > cache.capacity:
            raise ValueError(f"room: the chunk ({count} tokens) and the guidance prompts need {needed} slots, "
                             f"the cache has {cache.capacity}; raise room or chunk_tokens")
        if compress and self.fused_guidance and self.plan.kinds:
            attn = run_guidance(setup.language_model, cache, self.plan, ids, setup.backend, chunk=chunk)
        else:
            prefill(setup.language_model, cache, chunk)
            if not compress:
                return None
            attn = run_guidance(setup.language_model, cache, self.plan, ids, setup.backend)
        return cache.compress(attn, backend=setup.backend)

    def guidance_scores(self, layers: Sequence[int] | None, history: tuple[str | None, ...]) -> torch.Tensor:
        """Pooled guidance attention [L, B, V] of a read-only pass over the cache as it is (a copy; under tensor
        parallelism averaged over the ranks, the same on every rank)."""
        plan = self.plan if layers is None else GuidancePlan.from_config(self.cfg, layers)
        ids = plan.token_ids(self.setup.tokenizer, history)
        self.cache.check_room(guidance_length(ids))
        attn = run_guidance(self.setup.language_model, self.cache, plan, ids, self.setup.backend)
        return attn.clone() if self.group is None else group_mean(attn, self.group)

"""Guidance prompts and the guidance pass that feeds HERMES's attention score (DESIGN.md §2.3, paper app. B).

Which prompt a layer reads follows its role: shallow layers the local prompt, mid layers the mixed prompt
(local + "; " + global), deep layers the global prompt. A layer whose recency weight ω_l is 1 never reads
its attention score (S = R), so by default no prompt is run for it: with the presets the local prompt is
never computed, and the first mid layer of LLaVA-OV (ω = 1.0) is skipped as well.

The prompts that are needed run as ONE forward over the language model: their token ids are packed one
after the other and the attention function (`hermes.attention`) keeps them apart (each sees the cache and,
causally, itself). The pass is read-only (nothing stays in the cache), gives every prompt the positions
right after each layer's last position, and stops after the deepest layer that needs a score.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from hermes.attention import GuidanceDone, GuidanceState
from hermes.cache import HermesCache
from hermes.config import DEEP, MID, SHALLOW, HermesConfig

LOCAL = ("Describe the current scene in detail, focusing on specific objects, fine-grained actions, "
         "and spatial relationships.")
GLOBAL = ("Summarize the video narrative, identifying main characters, key events, timeline changes, "
          "and the overall theme.")
PROMPT_OF_ROLE = {SHALLOW: "local", MID: "mixed", DEEP: "global"}
PROMPT_ORDER = ("local", "mixed", "global")


def guidance_prompts(last_conv: str | None = None) -> dict[str, str]:
    """The three guidance prompts of appendix B, with the last question and answer filled in when given."""
    if last_conv:
        local = f"Find recent details related to: {last_conv}. {LOCAL}"
        global_ = f"Context summary: {last_conv}. {GLOBAL}"
    else:
        local, global_ = LOCAL, GLOBAL
    return {"local": local, "mixed": f"{local}; {global_}", "global": global_}


@dataclasses.dataclass(frozen=True)
class GuidancePlan:
    """Which prompts run and which layer reads which one.

    kinds:          the prompts run, in packing order (a subset of local, mixed, global).
    kind_of_layer:  per layer, the prompt whose score it needs, or None.
    """

    kinds: tuple[str, ...]
    kind_of_layer: tuple[str | None, ...]

    @classmethod
    def from_config(cls, cfg: HermesConfig, layers: Sequence[int] | None = None) -> "GuidancePlan":
        """Scores for `layers` (default: every layer whose ω_l < 1), each with its role's prompt."""
        if layers is None:
            layers = [layer for layer in range(cfg.num_layers) if float(cfg.omega[layer]) < 1.0]
        wanted = set(layers)
        if not wanted <= set(range(cfg.num_layers)):
            raise ValueError(f"layers: expected indices in [0, {cfg.num_layers}), got {sorted(layers)}")
        kind_of_layer = tuple(PROMPT_OF_ROLE[int(cfg.role[layer])] if layer in wanted else None
                              for layer in range(cfg.num_layers))
        kinds = tuple(kind for kind in PROMPT_ORDER if kind in kind_of_layer)
        return cls(kinds=kinds, kind_of_layer=kind_of_layer)

    def token_ids(self, tokenizer, last_convs: Sequence[str | None]) -> list[list[list[int]]]:
        """Per stream, the token ids of each prompt in `kinds` (no special tokens)."""
        out = []
        for last_conv in last_convs:
            prompts = guidance_prompts(last_conv)
            out.append([tokenizer(prompts[kind], add_special_tokens=False)["input_ids"] for kind in self.kinds])
        return out


def guidance_length(ids: list[list[list[int]]]) -> int:
    """Most tokens one stream's packed guidance prompts take (the room they need past the length)."""
    return max((sum(len(p) for p in stream) for stream in ids), default=0)


def run_guidance(language_model: torch.nn.Module, cache: HermesCache, plan: GuidancePlan,
                 ids: list[list[list[int]]], backend: str = "auto") -> torch.Tensor:
    """Pooled guidance attention float32 [L, B, V] (V = length - prefix_len; zeros for layers without a
    prompt), written to and returned as a view of `cache.guidance_attn`. Read-only: the cache is unchanged.

    ids: per stream, the token ids of each prompt in `plan.kinds` (`GuidancePlan.token_ids`). Streams whose
    prompts tokenize to the same lengths share one forward; otherwise each stream runs its own.
    backend: of `hermes_kernels.pooled_attention`.
    """
    visual = cache.length - cache.cfg.prefix_len
    if visual < 1:
        raise ValueError(f"cache: no visual token to score (length {cache.length}, prefix_len "
                         f"{cache.cfg.prefix_len})")
    if len(ids) != cache.batch_size:
        raise ValueError(f"ids: expected prompt ids for {cache.batch_size} streams, got {len(ids)}")
    attn = cache.guidance_attn[:, :, :visual]
    attn.zero_()
    if not plan.kinds:
        return attn
    lengths = [[len(p) for p in stream] for stream in ids]
    if all(length == lengths[0] for length in lengths):
        groups = [slice(0, cache.batch_size)]
    else:
        groups = [slice(b, b + 1) for b in range(cache.batch_size)]
    for rows in groups:
        _guidance_forward(language_model, cache, plan, ids[rows], rows, backend)
    return attn


def _guidance_forward(language_model, cache: HermesCache, plan: GuidancePlan, ids, rows: slice,
                      backend: str) -> None:
    """One packed read-only forward for the streams `rows` (all with the same prompt lengths)."""
    device = cache.guidance_attn.device
    bounds, start = [], 0
    for prompt in ids[0]:
        bounds.append((start, start + len(prompt)))
        start += len(prompt)
    input_ids = torch.tensor([[token for prompt in stream for token in prompt] for stream in ids], device=device)
    rel = torch.cat([torch.arange(hi - lo, device=device) for lo, hi in bounds])
    if cache.mrope:
        rel = rel.expand(3, -1)
    segment_of = {kind: index for index, kind in enumerate(plan.kinds)}
    segment_of_layer = tuple(None if kind is None else segment_of[kind] for kind in plan.kind_of_layer)
    last_layer = max(layer for layer, seg in enumerate(segment_of_layer) if seg is not None)
    position_ids = cache.default_position_ids(input_ids.shape[1])
    position_ids = position_ids[:, rows] if cache.mrope else position_ids[rows]
    cache.guidance = GuidanceState(segments=tuple(bounds), segment_of_layer=segment_of_layer, last_layer=last_layer,
                                   backend=backend)
    try:
        with cache.forward_context(rel, read_only=True, rows=rows):
            language_model(input_ids=input_ids, position_ids=position_ids, cache=cache, use_cache=True)
    except GuidanceDone:
        pass
    finally:
        cache.guidance = None

"""Guidance prompts and the guidance pass that feeds HERMES's attention score (docs/hermes.md §2.3, paper app. B).

`guidance_prompts` gives the local, mixed and global prompts a layer reads by its role; `GuidancePlan` says which
prompts run and which layers score with them (none for a layer whose ω is 1); `run_guidance` runs them as one
forward over the language model, packed per stream, with `GuidanceState` telling the attention function
(`hermes.attention`) which rows each layer computes. The pass runs fused behind a chunk's prefill or on its own
(docs/hermes.md §4); both: docs/stream.md#hermes-behind-the-front.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from hermes.models import VideoChunk
from hermes_kernels.policies.hermes.config import DEEP, MID, SHALLOW, HermesConfig

from .attention import GuidanceDone
from .cache import HermesCache

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


@dataclasses.dataclass(frozen=True)
class GuidanceState:
    """What the attention function needs during a guidance pass (set on `cache.guidance`).

    stored:           the forward's leading tokens that are a chunk being stored (guidance fused into its
                      prefill); 0 for a guidance pass on its own. The prompt tokens follow them.
    segments:         per stream, the (start, end) range of each prompt among the prompt tokens (the forward's
                      tokens after the `stored` ones); each prompt attends to the cache, the stored chunk and,
                      causally, itself, never to another prompt. Slots past a stream's last prompt are padding.
    segment_of_layer: per layer, the index of the prompt whose pooled attention it needs, or None.
    last_layer:       the deepest layer that needs a score: a pass on its own stops after it; fused, the prompt
                      rows are not computed from there on. Before it, a layer computes only the rows of prompts a
                      deeper layer scores (`read_rows`).
    backend:          `hermes_kernels` backend of the pooled attention ("auto" | "triton" | "torch").
    """

    stored: int
    segments: tuple[tuple[tuple[int, int], ...], ...]
    segment_of_layer: tuple[int | None, ...]
    last_layer: int
    backend: str = "auto"

    def runs(self, segment: int) -> list[tuple[slice, int, int]]:
        """(streams, start, end): runs of consecutive streams whose prompt `segment` has the same range, so that
        each run's pooled attention is one call (one run when the streams' prompts tokenize alike)."""
        runs: list[tuple[slice, int, int]] = []
        for b, bounds in enumerate(self.segments):
            lo, hi = bounds[segment]
            if runs and runs[-1][1:] == (lo, hi):
                runs[-1] = (slice(runs[-1][0].start, b + 1), lo, hi)
            else:
                runs.append((slice(b, b + 1), lo, hi))
        return runs

    def read_rows(self, layer: int) -> tuple[int, int] | None:
        """(start, end) among the prompt tokens: the rows whose output at `layer` some deeper layer reads (the
        span, over streams, of every prompt a deeper layer scores); None when no deeper layer scores one."""
        later = {segment for segment in self.segment_of_layer[layer + 1:] if segment is not None}
        if not later:
            return None
        bounds = [stream[segment] for stream in self.segments for segment in later]
        return min(lo for lo, _ in bounds), max(hi for _, hi in bounds)


def run_guidance(language_model: torch.nn.Module, cache: HermesCache, plan: GuidancePlan,
                 ids: list[list[list[int]]], backend: str = "auto", chunk: VideoChunk | None = None) -> torch.Tensor:
    """Pooled guidance attention float32 [L, B, V] (V = visual tokens after the pass; zeros for layers without
    a prompt), written to and returned as a view of `cache.guidance_attn`.

    ids:     per stream, the token ids of each prompt in `plan.kinds` (`GuidancePlan.token_ids`).
    backend: of `hermes_kernels.pooled_attention`.
    chunk:   a chunk to prefill in the same forward (fused, docs/hermes.md §4): its tokens are stored, exactly as a
             plain prefill stores them, and the prompts see them; V then counts them. Needs `plan.kinds`.
             Without it the pass is read-only: the cache is unchanged.
    """
    stored = 0 if chunk is None else chunk.embeds.shape[1]
    visual = cache.length + stored - cache.cfg.prefix_len
    if visual < 1:
        raise ValueError(f"cache: no visual token to score (length {cache.length}, prefix_len "
                         f"{cache.cfg.prefix_len})")
    if len(ids) != cache.batch_size or any(len(stream) != len(plan.kinds) for stream in ids):
        raise ValueError(f"ids: expected {len(plan.kinds)} prompts for each of {cache.batch_size} streams")
    if chunk is not None and not plan.kinds:
        raise ValueError("chunk: a fused prefill needs at least one guidance prompt (plan.kinds is empty)")
    # linear-attention states or sliding-window rings: a prompt would see the prompts packed before it
    hybrid = cache.linear_states is not None or cache.windows is not None
    if chunk is not None and hybrid:
        raise ValueError("chunk: a hybrid model's guidance cannot ride in a chunk's prefill (the prompts would pass "
                         "through the linear-attention layers' states); run it on its own (docs/qwen3_5.md#guidance)")
    attn = cache.guidance_attn[:, :, :visual]
    attn.zero_()
    if not hybrid or len(plan.kinds) < 2:
        if plan.kinds:
            _guidance_forward(language_model, cache, plan, ids, backend, chunk)
        return attn
    # a hybrid model: one read-only forward per prompt, as a packed prompt would read the one before it through
    # the linear-attention layers' recurrent state
    for index, kind in enumerate(plan.kinds):
        single = GuidancePlan(kinds=(kind,), kind_of_layer=tuple(k if k == kind else None for k in plan.kind_of_layer))
        _guidance_forward(language_model, cache, single, [[stream[index]] for stream in ids], backend, None)
    return attn


def _guidance_forward(language_model, cache: HermesCache, plan: GuidancePlan, ids, backend: str,
                      chunk: VideoChunk | None) -> None:
    """One forward: [the chunk's T tokens, stored] + each stream's packed prompts, padded to the longest."""
    device = cache.guidance_attn.device
    segments = []
    for stream in ids:
        bounds, start = [], 0
        for prompt in stream:
            bounds.append((start, start + len(prompt)))
            start += len(prompt)
        segments.append(tuple(bounds))
    count = max(bounds[-1][1] for bounds in segments)
    # padding: token 0 at the prompts' first position; no prompt attends to it
    tokens = [[token for prompt in stream for token in prompt] for stream in ids]
    input_ids = torch.tensor([row + [0] * (count - len(row)) for row in tokens], device=device)
    rel = torch.zeros(len(ids), count, dtype=torch.int64)
    for b, bounds in enumerate(segments):
        for lo, hi in bounds:
            rel[b, lo:hi] = torch.arange(hi - lo)
    rel = rel.to(device)
    segment_of = {kind: index for index, kind in enumerate(plan.kinds)}
    segment_of_layer = tuple(None if kind is None else segment_of[kind] for kind in plan.kind_of_layer)
    last_layer = max(layer for layer, seg in enumerate(segment_of_layer) if seg is not None)
    stored = 0 if chunk is None else chunk.embeds.shape[1]
    inputs = {"input_ids": input_ids}
    if chunk is not None:  # the chunk's tokens first, with the family's extra arguments (Qwen3-VL's DeepStack)
        chunk_rel = chunk.rel_positions
        chunk_rel = torch.arange(stored, device=device) if chunk_rel is None else chunk_rel.to(device)
        # the prompts start right after the chunk's largest offset, where a pass after its prefill puts them
        rel = rel + (chunk_rel.max() + 1)
        inputs = {"inputs_embeds": torch.cat([chunk.embeds, language_model.embed_tokens(input_ids)], dim=1),
                  **chunk.lm_kwargs(stored + count)}
    if cache.mrope:
        rel = rel.unsqueeze(1).expand(-1, 3, -1)
    if chunk is not None:
        chunk_rel = chunk_rel.expand(3, -1) if cache.mrope and chunk_rel.dim() == 1 else chunk_rel
        rel = torch.cat([chunk_rel.expand(len(ids), *chunk_rel.shape), rel], dim=-1)
    cache.guidance = GuidanceState(stored=stored, segments=tuple(segments), segment_of_layer=segment_of_layer,
                                   last_layer=last_layer, backend=backend)
    context = cache.forward_context(rel, keep=stored) if stored else cache.forward_context(rel, read_only=True)
    try:
        with context:
            language_model(**inputs, position_ids=cache.default_position_ids(stored + count), cache=cache,
                           use_cache=True)
    except GuidanceDone:
        pass
    finally:
        cache.guidance = None

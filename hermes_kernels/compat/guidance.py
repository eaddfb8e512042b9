"""The released HERMES classes' guidance pass, `pseudo_forward(local_question, global_question)`, run by this
library's `pooled_attention` (docs/integrations.md#what-it-changes).

Skipped when no compression follows (the cache is not longer than `kv_size`); otherwise the mixed prompt for mid
layers and the global prompt for deep layers are pooled by `pooled_attention` without materialising attention, and
the shallow layers' local prompt, whose weight is zero there, is not run at all. The queries and keys come from the
prompt's input embeddings in every layer ("embeddings") or from hidden states propagated through the model
("propagated"), as the released code chooses by attention implementation (docs/integrations.md#differences).
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from ..policies.hermes import ops
from ..rope import apply_rotary_delta
from .caches import IncompatibleInstance, read_layers, write_layers
from .checks import cache_layers, held_positions
from .schedule import GUIDANCE_MODES, LLAVA_OV, QWEN2_5_VL

DEFAULT_LOCAL = "What is happening in the video?"      # the released pseudo_forward's defaults
DEFAULT_GLOBAL = "What is the main topic of the video?"


class GuidancePass:
    """The guidance pass of `Accelerated` (handle.py), which mixes it in; it reads the handle's `model`, `kind`,
    `backend`, `guidance`, `stats`, `_lm` and `_freq()`, and hands its pooled attention to `select()` (step.py)."""

    def guidance_mode(self) -> str:
        """The path this call takes: "embeddings" (queries and keys of every layer from the prompt's input
        embeddings, no causal mask among the prompt's tokens) or "propagated" (hidden states through the model,
        causal); "released" follows the released code's choice by attention implementation."""
        if self.guidance != "released":
            return self.guidance
        impl = getattr(self._lm.module.config, "_attn_implementation", None)
        return "embeddings" if impl in ("sdpa", "flash_attention_2") else "propagated"

    def _tokens(self, text: str, device: torch.device) -> torch.Tensor:
        ids = self.model.processor.tokenizer(text).input_ids
        return torch.as_tensor([list(ids)], dtype=torch.int64, device=device)

    def _prompt_qk(self, layer: int, hidden: torch.Tensor, start) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompt's RoPE'd queries [1, H, Q, D] and keys [1, Hkv, Q, D] at `layer`, at positions start.."""
        lm = self._lm
        block = lm.layers[layer]
        weight = getattr(block.self_attn.q_proj, "weight", None)
        h = block.input_layernorm(hidden.to(weight.device) if isinstance(weight, torch.Tensor) else hidden)
        Q = h.shape[1]
        q = block.self_attn.q_proj(h).view(1, Q, lm.heads, lm.head_dim).transpose(1, 2)
        k = block.self_attn.k_proj(h).view(1, Q, lm.kv_heads, lm.head_dim).transpose(1, 2)
        pos = torch.as_tensor(start, device=q.device).to(torch.int64) + torch.arange(Q, device=q.device)
        freq = self._freq(q.device)
        q, k = apply_rotary_delta(q, pos, freq), apply_rotary_delta(k, pos, freq)
        scaling = float(getattr(lm.rotary, "attention_scaling", 1.0) or 1.0)
        if scaling != 1.0:
            q, k = q * scaling, k * scaling
        return q, k

    def _hidden_states(self, ids: torch.Tensor, starts, pairs, container) -> Sequence[torch.Tensor]:
        """Inputs of every decoder layer for the prompt `ids`: one forward of the language model over the cache
        (the instance's per-layer position hooks set as the released eager path sets them); the cache is put back
        as it was if the forward appended to it."""
        m, lm = self.model, self._lm.module
        Q = ids.shape[1]

        def layer_positions(start):
            pos = torch.as_tensor(start, device=ids.device).to(torch.int64) + torch.arange(Q, device=ids.device)
            return pos.to(torch.float32).view(1, 1, Q).expand(3, 1, Q).clone() if self.kind == QWEN2_5_VL \
                else pos.view(1, Q)

        per_layer = getattr(m, "_layer_position_ids", None)
        if isinstance(per_layer, dict):
            per_layer.clear()
            per_layer.update({layer: layer_positions(start) for layer, start in enumerate(starts)})
        if callable(getattr(m, "_set_rotary_required_len", None)):
            m._set_rotary_required_len(int(max(int(s) for s in starts)) + Q)
        try:
            kwargs = dict(input_ids=ids, past_key_values=m.kv_cache, use_cache=False, output_hidden_states=True,
                          output_attentions=False, position_ids=layer_positions(starts[0]))
            if self.kind == LLAVA_OV:
                kwargs.update(cache_position=None, attention_mask=None)
            out = lm(**kwargs)
        finally:
            if isinstance(per_layer, dict):
                per_layer.clear()
            after, _ = read_layers(m.kv_cache)
            if len(after) != len(pairs) or any(a[0] is not b[0] for a, b in zip(after, pairs)):
                m.kv_cache = write_layers(m.kv_cache, container, pairs)
        hidden = getattr(out, "hidden_states", None)
        if hidden is None or len(hidden) < m.num_layers:
            raise IncompatibleInstance("pseudo_forward: language_model(output_hidden_states=True) returned no "
                                       "hidden_states per layer (needed by guidance='propagated')")
        return hidden

    def _pool(self, layers: range, ids: torch.Tensor, pairs, container, starts, mode: str,
              out: torch.Tensor) -> None:
        """Pooled attention of prompt `ids` over the visual keys of `layers`, written into out[layers] [.., 1, V]."""
        if len(layers) == 0:
            return
        m, lm = self.model, self._lm
        P, N, Q = m.visual_start_idx, pairs[0][0].shape[2], ids.shape[1]
        if mode == "embeddings":  # every layer reads the prompt's input embeddings
            hidden = [m.get_input_embeddings()(ids)] * m.num_layers
        else:  # layer l reads what layer l - 1 made of the prompt
            hidden = self._hidden_states(ids, starts, pairs, container)
        groups: list[list[int]] = []
        for layer in layers:  # consecutive layers on one device pool in one call
            if groups and pairs[groups[-1][-1]][0].device == pairs[layer][0].device:
                groups[-1].append(layer)
            else:
                groups.append([layer])
        for group in groups:
            device, cache_dtype = pairs[group[0]][0].device, pairs[group[0]][0].dtype
            q_bufs, k_buf = [], None
            for i, layer in enumerate(group):
                q, k = self._prompt_qk(layer, hidden[layer], starts[layer])
                work = torch.promote_types(q.dtype, cache_dtype)
                if k_buf is None:
                    k_buf = torch.empty(len(group), 1, lm.kv_heads, N + Q, lm.head_dim, dtype=work, device=device)
                k_buf[i, :, :, :N] = pairs[layer][0]
                k_buf[i, :, :, N:] = k.to(device)
                q_bufs.append(q.to(device=device, dtype=work))
            q_all = torch.stack(q_bufs)  # [n, 1, H, Q, D]
            if mode == "embeddings":  # no causal mask among the prompt's tokens: one query per row sees every key
                q_all = q_all.reshape(len(group), 1, lm.heads * Q, 1, lm.head_dim)
            pooled = ops.pooled_attention(q_all, k_buf, 1.0 / math.sqrt(lm.head_dim), backend=self.backend)
            out[group[0]:group[-1] + 1] = pooled[:, :, P:N].to(out.device)

    def guidance_attention(self, local_question: str | None = None, global_question: str | None = None,
                           mode: str | None = None) -> torch.Tensor:
        """Pooled guidance attention of the visual tokens, float32 [L, 1, V]: mid layers from the mixed prompt
        (local + "; " + global), deep layers from the global one, zeros in shallow layers (weight 0 there).
        `mode`: "embeddings" or "propagated"; default `guidance_mode()`."""
        with torch.inference_mode():
            m = self.model
            pairs, container = cache_layers(m, self._lm, equal=True, what="pseudo_forward")
            held_positions(m, self.kind, pairs, "pseudo_forward")
            local_question = DEFAULT_LOCAL if local_question is None else local_question
            global_question = DEFAULT_GLOBAL if global_question is None else global_question
            mode = self.guidance_mode() if mode is None else mode
            if mode not in GUIDANCE_MODES[1:]:
                raise ValueError(f"mode: expected 'embeddings' or 'propagated', got {mode!r}")
            L, P = m.num_layers, m.visual_start_idx
            s, e = m.short_term_threshold, m.long_term_threshold
            device = pairs[-1][0].device
            embed_device = self._embedding_device(device)
            attn = torch.zeros(L, 1, pairs[0][0].shape[2] - P, dtype=torch.float32, device=device)
            starts = self._next_starts()
            self._pool(range(s, e), self._tokens(local_question + "; " + global_question, embed_device), pairs,
                       container, starts, mode, attn)
            self._pool(range(e, L), self._tokens(global_question, embed_device), pairs, container, starts, mode,
                       attn)
            return attn

    def pseudo_forward(self, local_question: str | None = None, global_question: str | None = None) -> None:
        """The released guidance pass and what follows it: nothing when the cache is not longer than kv_size;
        else pooled guidance attention, the selection, and the instance's apply_kv_cache_pruning_strict."""
        with torch.inference_mode():
            m = self.model
            # a cache of the prefix alone is no error here: under kv_size, nothing follows (as in the released code)
            pairs, _ = cache_layers(m, self._lm, equal=True, what="pseudo_forward", visual=False)
            if pairs[0][0].shape[2] <= m.kv_size:
                self.stats["guidance_skipped"] += 1
                return
            attn = self.guidance_attention(local_question, global_question)
            self.stats["guidance_passes"] += 1
            keep = self.select(attn, m.kv_size)
            m.apply_kv_cache_pruning_strict(keep)

    def _embedding_device(self, fallback: torch.device) -> torch.device:
        embed = getattr(self.model, "get_input_embeddings", None)
        weight = getattr(embed(), "weight", None) if callable(embed) else None
        return weight.device if isinstance(weight, torch.Tensor) else fallback

    def _next_starts(self) -> list[torch.Tensor | int]:
        """Where each layer's next token goes: the last position + 1 (LLaVA-OV) or the largest over the three
        axes + 1 (Qwen2.5-VL); 0 for a layer without positions (the released `_get_next_*_per_layer`)."""
        starts = []
        for pos in self.model._position_ids_cache:
            if not isinstance(pos, torch.Tensor) or pos.numel() == 0:
                starts.append(0)
            elif self.kind == LLAVA_OV:
                starts.append(pos.reshape(-1)[-1].to(torch.int64) + 1)
            else:
                starts.append(pos.max().to(torch.int64) + 1)
        return starts

"""Stand-ins of the released HERMES classes, `ReleasedLLaVAOV` and `ReleasedQwenVL`: the state they keep on the
model object and their compression step in plain per-layer PyTorch (docs/integrations.md#checked).

The selection (`prune_kv_cache_by_attention`), the shrink (`_shrink_positions_and_rerotate_keys`) and the guidance
pass (`pseudo_forward`, both its manual path and its eager `output_attentions=True` path), with the released
numerics where they matter (attention pooled in the attention's dtype, fp16 softmax on the Qwen manual path, rotary
deltas through cos/sin tables in the cache dtype).
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .dynamic_cache import layer_pairs, with_layers
from .language_model import rope_tables, rotate_half

# our own wording of a local and a global guidance prompt (the released texts are the instance's business)
LOCAL_PROMPT = "Describe what is on screen right now: the objects, the actions and where things are."
GLOBAL_PROMPT = "Sum up the whole video so far: who appears, what happens, and how the story changes."


class _ReleasedStandIn:
    """The state and compression step the released classes keep on the model object (docs/integrations.md).

    kv_cache: list of (keys, values) [1, Hkv, L_l, D] per layer; _position_ids_cache: per layer; visual_start_idx:
    the prefix length; kv_size: the budget; short_term_threshold / long_term_threshold: the first mid and the first
    deep layer; streaming: lazy (True) or eager (False) re-indexing; language_model; processor.tokenizer.
    """

    kind = ""
    default_max_positions = 32768

    def __init__(self, language_model: nn.Module, tokenizer, kv_size: int, *, streaming: bool = True,
                 shallow_ratio: float = 0.1, deep_ratio: float = 0.3, hooks: bool = True):
        self.language_model = language_model
        self.processor = SimpleNamespace(tokenizer=tokenizer)
        self.kv_size = kv_size
        self.streaming = streaming
        self.num_layers = language_model.config.num_hidden_layers
        self.short_term_threshold = int(self.num_layers * shallow_ratio)
        self.long_term_threshold = int(self.num_layers * (1 - deep_ratio))
        self.kv_cache = None
        self.visual_start_idx = 0
        self._position_ids_cache = [None] * self.num_layers
        self._layer_position_ids = {}
        self.conv_history = []
        self.boundary_margins: list[float] = []  # per selection: smallest relative score gap at a top-k boundary
        self.reindexes: list[bool] = []        # per shrink: whether positions were re-indexed
        if hooks:  # per-layer positions injected into each decoder layer's call, as the released classes do
            for index, layer in enumerate(self._decoder_layers()):
                layer.register_forward_pre_hook(self._hook(index), with_kwargs=True)

    # -- plumbing ---------------------------------------------------------------------------------------------

    def _hook(self, index):
        def hook(module, args, kwargs):
            if index in self._layer_position_ids:
                kwargs["position_ids"] = self._layer_position_ids[index]
            return args, kwargs
        return hook

    def _decoder_layers(self):
        lm = self.language_model
        return lm.model.layers if hasattr(lm, "model") else lm.layers

    def _rotary(self):
        lm = self.language_model
        return lm.model.rotary_emb if hasattr(lm, "model") else lm.rotary_emb

    @property
    def device(self) -> torch.device:
        return self.get_input_embeddings().weight.device

    def get_input_embeddings(self) -> nn.Module:
        lm = self.language_model
        return lm.model.embed_tokens if hasattr(lm, "model") else lm.embed_tokens

    def _lengths(self) -> list[int]:
        return [k.shape[2] for k, _ in layer_pairs(self.kv_cache)]

    @staticmethod
    def allocate_budget_by_depth(total_budget: int, num_layers: int) -> list[int]:
        share = [total_budget // num_layers] * num_layers
        share[-1] += total_budget - sum(share)
        return share

    def _sanitize_keep_indices(self, idx: torch.Tensor, seq_len: int) -> torch.Tensor:
        idx = torch.as_tensor(idx, dtype=torch.long).to(self.device)
        idx = idx[(idx >= 0) & (idx < seq_len)]
        if idx.numel() == 0:
            return torch.zeros(1, dtype=torch.long, device=self.device)
        return torch.unique(idx, sorted=True)

    # -- state: the prefix and the chunks ---------------------------------------------------------------------

    def start(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], container=list) -> None:
        """The system prompt's cache: per-layer [1, Hkv, P, D] in `container` (list, or a class taking the list
        of pairs: LegacyDynamicCache, LayeredDynamicCache); positions 0..P-1 (encode_init_prompt)."""
        self.kv_cache = container([(k, v) for k, v in zip(keys, values)])
        self.visual_start_idx = keys[0].shape[2]
        self._position_ids_cache = [self._fresh_positions(k.shape[2], k.device) for k in keys]

    def encode_chunk(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], grid=None) -> None:
        """Append one chunk's per-layer keys/values [1, Hkv, q, D] and their positions (encode_video_chunk)."""
        starts = self._next_starts()
        q = keys[0].shape[2]
        pairs = layer_pairs(self.kv_cache)  # appended in the cache's own container, as a forward does
        self.kv_cache = with_layers(self.kv_cache, [
            (torch.cat([k0, k], 2).contiguous(), torch.cat([v0, v], 2).contiguous())
            for (k0, v0), k, v in zip(pairs, keys, values)])
        for layer, start in enumerate(starts):
            new = self._chunk_positions(start, q, grid, keys[0].device)
            old = self._position_ids_cache[layer]
            self._position_ids_cache[layer] = new if old is None else torch.cat([old, new], dim=-1)

    # -- the selection ----------------------------------------------------------------------------------------

    def _schedule(self, layer: int) -> tuple[str, float, float]:
        raise NotImplementedError

    def prune_kv_cache_by_attention(self, attn_weights_local, attn_weights_global, attn_weights_mixed,
                                    num_keep: int = 3000) -> list[list[int]]:
        P = self.visual_start_idx
        L = len(attn_weights_local)
        budgets = self.allocate_budget_by_depth(num_keep * L, L)
        raw, plans = [], []
        for layer in range(L):
            role, alpha, k = self._schedule(layer)
            weights = {"short": attn_weights_local, "long": attn_weights_global, "mid": attn_weights_mixed}[role]
            w = weights[layer]
            q = w.shape[2]
            pooled = w[0].mean(dim=0)[:, P:w.shape[3] - q].mean(dim=0)  # heads, then queries; the visual keys
            V = pooled.shape[0]
            j = torch.arange(V, device=pooled.device, dtype=torch.float32)
            recency = torch.exp(-k * (V - 1 - j) / max(V - 1, 1))
            a = (pooled - pooled.min()) / (pooled.max() - pooled.min() + 1e-6)
            r = (recency - recency.min()) / (recency.max() - recency.min() + 1e-6)
            raw.append(a * (1 - alpha) + r * alpha)
            budget = max(0, budgets[layer] - 1) if role == "long" else budgets[layer]
            plans.append((role, min(budget, V)))
        smoothed = [s.clone() for s in raw]
        for layer in range(L - 2, -1, -1):  # deepest first; the weight follows the current layer's type
            lam = {"long": 0.4, "mid": 0.3, "short": 0.1}[plans[layer][0]]
            deeper = smoothed[layer + 1]
            if deeper.shape[0] != smoothed[layer].shape[0]:
                deeper = F.interpolate(deeper.view(1, 1, -1), size=smoothed[layer].shape[0], mode="linear",
                                       align_corners=False).view(-1)
            smoothed[layer] = (1 - lam) * smoothed[layer] + lam * deeper
        margins = []
        for score, (_, count) in zip(smoothed, plans):
            if 0 < count < score.numel():
                ranked = score.detach().sort(descending=True).values
                margins.append(float((ranked[count - 1] - ranked[count]) / ranked[count - 1].abs().clamp_min(1e-30)))
        self.boundary_margins.append(min(margins, default=float("inf")))
        keep = []
        for score, (_, count) in zip(smoothed, plans):
            top = torch.topk(score, count, sorted=False).indices + P
            keep.append(torch.cat([torch.arange(P, device=score.device), top.sort().values]).tolist())
        return keep

    # -- the shrink -------------------------------------------------------------------------------------------

    def _max_positions(self) -> int:
        return getattr(self.language_model.config, "max_position_embeddings", None) or self.default_max_positions

    def _shrink_positions_and_rerotate_keys(self, keep_indices_per_layer) -> None:
        lengths = self._lengths()
        for layer, N in enumerate(lengths):
            pos = self._position_ids_cache[layer]
            if pos is None or pos.shape[-1] != N or pos.numel() != N * (1 if pos.dim() == 1 else 3):
                self._position_ids_cache[layer] = self._fresh_positions(N, self.device)
        top = 0
        for pos in self._position_ids_cache:
            if pos.numel():
                top = max(top, self._largest(pos))
        compact = top > self._max_positions() - 1024 if self.streaming else True
        self.reindexes.append(bool(compact))
        old_positions = [p.clone() for p in self._position_ids_cache]
        shrunk = []
        for layer, (k, v) in enumerate(self.kv_cache):
            N = k.shape[2]
            idx = self._sanitize_keep_indices(keep_indices_per_layer[layer], N)
            k_kept, v_kept = k.index_select(2, idx), v.index_select(2, idx)
            old = old_positions[layer][..., idx]
            new = self._compacted(old, idx) if compact else old
            if compact:
                k_kept = self._rotate(k_kept, old, new)
            pos_layer = new
            if layer >= self.long_term_threshold:
                dropped = torch.ones(N, dtype=torch.bool, device=k.device)
                dropped[idx] = False
                dropped = dropped.nonzero().flatten()
                if dropped.numel():
                    target = self._summary_position(new, idx, compact)
                    old_dropped = old_positions[layer][..., dropped]
                    to_target = target.expand_as(old_dropped) if old_dropped.dim() == 1 else target.expand(
                        3, old_dropped.shape[1])
                    k_sum = self._rotate(k.index_select(2, dropped), old_dropped, to_target).mean(2, keepdim=True)
                    v_sum = v.index_select(2, dropped).mean(2, keepdim=True)
                    k_kept, v_kept = torch.cat([k_kept, k_sum], 2), torch.cat([v_kept, v_sum], 2)
                    pos_layer = torch.cat([new, target.view(-1) if new.dim() == 1 else target.expand(3, 1)], dim=-1)
            shrunk.append((k_kept.contiguous(), v_kept.contiguous()))
            self._position_ids_cache[layer] = pos_layer.clone()
        self.kv_cache = shrunk

    def _rotate(self, x: torch.Tensor, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """Rotate cached keys x [1, Hkv, n, D] from positions old to new through cos/sin tables in x's dtype. The
        tables are at scale 1 whatever the rotary module's `attention_scaling`: a delta is a rotation, and the keys
        carry the scale once already (from the forward that cached them)."""
        inv_freq = self._rotary().inv_freq
        section = getattr(self, "_mrope_section", None)
        cos_o, sin_o = rope_tables(old, inv_freq, x.dtype, section)
        cos_n, sin_n = rope_tables(new, inv_freq, x.dtype, section)
        cos_d = cos_n * cos_o + sin_n * sin_o  # cos(new - old)
        sin_d = sin_n * cos_o - cos_n * sin_o  # sin(new - old)
        return x * cos_d + rotate_half(x) * sin_d

    def apply_kv_cache_pruning_strict(self, keep_indices_all_layers) -> None:
        if self.kv_cache is None or not keep_indices_all_layers or len(keep_indices_all_layers[0]) == 0:
            return
        self._shrink_positions_and_rerotate_keys(keep_indices_all_layers)

    # -- the guidance pass ------------------------------------------------------------------------------------

    def predict_next_question(self) -> tuple[str, str]:
        return LOCAL_PROMPT, GLOBAL_PROMPT

    def _ids(self, text: str) -> torch.Tensor:
        return torch.as_tensor([self.processor.tokenizer(text).input_ids], device=self.device, dtype=torch.int)

    def _compute_attention_scores_manually(self, input_ids: torch.Tensor, past_key_values) -> list[torch.Tensor]:
        """Every layer's prompt queries and keys from the input embeddings (nothing propagates between layers),
        attention over the cache and the prompt with no mask among the prompt's tokens."""
        starts = self._next_starts()
        embedded = self.get_input_embeddings()(input_ids)
        config = self.language_model.config
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        head_dim = config.hidden_size // heads
        q_len = input_ids.shape[1]
        inv_freq, scaling = self._rotary().inv_freq, self._rotary().attention_scaling
        out = []
        for layer, block in enumerate(self._decoder_layers()):
            past_k, past_v = past_key_values[layer]
            h = block.input_layernorm(embedded)
            q = block.self_attn.q_proj(h).view(1, q_len, heads, head_dim).transpose(1, 2)
            k = block.self_attn.k_proj(h).view(1, q_len, kv_heads, head_dim).transpose(1, 2)
            v = block.self_attn.v_proj(h).view(1, q_len, kv_heads, head_dim).transpose(1, 2)
            pos = int(starts[layer]) + torch.arange(q_len, device=q.device)
            cos, sin = rope_tables(pos, inv_freq, q.dtype, scaling=scaling)  # as the model's rotary module
            q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
            k, v = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
            k = k.repeat_interleave(heads // kv_heads, dim=1)
            v = v.repeat_interleave(heads // kv_heads, dim=1)
            logits = q.float() @ k.float().transpose(-1, -2) / head_dim ** 0.5
            out.append(self._softmax(logits).to(q.dtype))
        return out

    def _softmax(self, logits: torch.Tensor) -> torch.Tensor:
        return F.softmax(logits, dim=-1, dtype=torch.float32)

    def _eager_attentions(self, input_ids: torch.Tensor) -> list[torch.Tensor]:
        """The eager path: the language model over the cache with output_attentions=True (propagated, causal),
        each layer at its own positions through the hooks."""
        starts = self._next_starts()
        q_len = input_ids.shape[1]
        self._layer_position_ids.clear()
        for layer, start in enumerate(starts):
            self._layer_position_ids[layer] = self._text_positions(int(start), q_len)
        out = self.language_model(input_ids=input_ids, use_cache=False, past_key_values=self.kv_cache,
                                  output_attentions=True, position_ids=self._text_positions(int(starts[0]), q_len))
        self._layer_position_ids.clear()
        return list(out.attentions)

    def pseudo_forward(self, local_question: str | None = None, global_question: str | None = None) -> None:
        local_question = "What is happening in the video?" if local_question is None else local_question
        global_question = "What is the main topic of the video?" if global_question is None else global_question
        manual = getattr(self.language_model.config, "_attn_implementation", None) in ("flash_attention_2", "sdpa")
        weights = []
        for text in (local_question, global_question, local_question + "; " + global_question):
            ids = self._ids(text)
            weights.append(self._compute_attention_scores_manually(ids, self.kv_cache) if manual
                           else self._eager_attentions(ids))
        length = self.kv_cache[0][0].shape[2]
        keep = self.prune_kv_cache_by_attention(*weights, num_keep=self.kv_size)
        if length > self.kv_size:
            self.apply_kv_cache_pruning_strict(keep)

    def predict_and_compress(self) -> None:
        local_question, global_question = self.predict_next_question()
        self.pseudo_forward(local_question, global_question)

    # -- per model kind ---------------------------------------------------------------------------------------

    def _fresh_positions(self, n: int, device) -> torch.Tensor:
        raise NotImplementedError

    def _next_starts(self) -> list[int]:
        raise NotImplementedError

    def _chunk_positions(self, start: int, q: int, grid, device) -> torch.Tensor:
        raise NotImplementedError

    def _text_positions(self, start: int, q: int) -> torch.Tensor:
        raise NotImplementedError

    def _largest(self, pos: torch.Tensor) -> float:
        raise NotImplementedError

    def _compacted(self, old: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _summary_position(self, new: torch.Tensor, idx: torch.Tensor, compact: bool) -> torch.Tensor:
        raise NotImplementedError


class ReleasedLLaVAOV(_ReleasedStandIn):
    """LLaVA-OneVision: 1D int64 positions; ω = 1 - 0.9·p and k = 20 - 19.5·p in mid layers."""

    kind = "llava_ov"
    default_max_positions = 32768

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.token_activity_cache = [None] * self.num_layers

    def _schedule(self, layer):
        s, e = self.short_term_threshold, self.long_term_threshold
        if layer < s:
            return "short", 1.0, 20.0
        if layer >= e:
            return "long", 0.0, 0.0
        p = (layer - s) / (e - s)
        return "mid", 1.0 - 0.9 * p, 20 - 19.5 * p

    def _fresh_positions(self, n, device):
        return torch.arange(n, device=device, dtype=torch.long)

    def _next_starts(self):
        return [int(p[-1]) + 1 if p is not None and p.numel() else 0 for p in self._position_ids_cache]

    def _chunk_positions(self, start, q, grid, device):
        return torch.arange(start, start + q, device=device, dtype=torch.long)

    def _text_positions(self, start, q):
        return torch.arange(start, start + q, device=self.device, dtype=torch.long).view(1, q)

    def _largest(self, pos):
        return int(pos[-1])  # the last entry of the layer's positions

    def _compacted(self, old, idx):
        return torch.arange(idx.numel(), device=old.device, dtype=torch.long)  # the kept tokens, numbered in order

    def _summary_position(self, new, idx, compact):
        value = idx.numel() if compact else int(new[-1]) + 1
        return torch.tensor([value], device=new.device, dtype=torch.long)


class ReleasedQwenVL(_ReleasedStandIn):
    """Qwen2.5-VL: float32 [3, L] M-RoPE positions (t, h, w); ω = 0.75 - 0.6·p and k = 20 - 12·p in mid layers;
    the Qwen manual guidance path takes its softmax in fp16."""

    kind = "qwen2_5_vl"
    default_max_positions = 128000
    softmax_dtype = torch.float16  # the released Qwen manual path; float32 makes its pooled attention exact

    def __init__(self, *args, mrope_section: Sequence[int] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        scaling = getattr(self.language_model.config, "rope_scaling", None) or {}
        self._mrope_section = list(mrope_section or scaling.get("mrope_section") or (16, 24, 24))

    def _schedule(self, layer):
        s, e = self.short_term_threshold, self.long_term_threshold
        if layer < s:
            return "short", 1.0, 20.0
        if layer >= e:
            return "long", 0.0, 0.0
        p = (layer - s) / (e - s)
        return "mid", 0.75 - 0.6 * p, 20 - 12 * p

    def _softmax(self, logits):
        return F.softmax(logits, dim=-1, dtype=self.softmax_dtype)

    def _fresh_positions(self, n, device):
        return torch.arange(n, device=device, dtype=torch.float32).expand(3, n).clone()

    def _next_starts(self):
        return [int(p.max()) + 1 if p is not None and p.numel() else 0 for p in self._position_ids_cache]

    def _chunk_positions(self, start, q, grid, device, time_step: int = 2):
        """A video chunk's (t, h, w) from its grid (frames, rows, cols): t = start + step·frame, h = start + row,
        w = start + col; a text run (grid None) sits at start.. on all axes."""
        if grid is None:
            return torch.arange(start, start + q, device=device, dtype=torch.float32).expand(3, q).clone()
        frames, rows, cols = grid
        if frames * rows * cols != q:
            raise ValueError(f"grid {grid} does not cover {q} tokens")
        f = torch.arange(frames, device=device).repeat_interleave(rows * cols)
        r = torch.arange(rows, device=device).repeat_interleave(cols).repeat(frames)
        c = torch.arange(cols, device=device).repeat(frames * rows)
        return (torch.stack([f * time_step, r, c]) + start).to(torch.float32)

    def _text_positions(self, start, q):
        return torch.arange(start, start + q, device=self.device, dtype=torch.float32).view(1, 1, q).expand(
            3, 1, q).clone()

    def _largest(self, pos):
        return float(pos.max())

    def _compacted(self, old, idx):
        P = self.visual_start_idx
        new = old.clone()
        video = idx >= P
        if video.any():
            for axis in range(3):  # each axis's distinct values among the kept video tokens, ranked, after P
                values = old[axis, video]
                ranks = torch.unique(values, sorted=True, return_inverse=True)[1]
                new[axis, video] = (ranks + P).to(new.dtype)
        return new

    def _summary_position(self, new, idx, compact):
        return (new.max() + 1).view(1, 1).expand(3, 1).to(new.dtype).reshape(3, 1)

"""The released HERMES classes' selection and shrink, run by this library's ops (docs/integrations.md#what-it-changes).

- `prune_kv_cache_by_attention(local, global, mixed, num_keep)` — the selection. Same contract: per-layer absolute
  keep indices (the prefix, then the kept visual tokens in cache order), here as int64 tensors (`KeepIndices`). The
  pooled attention of every layer goes through `hermes_scores` and `select_keep` once for all layers.
- `_shrink_positions_and_rerotate_keys(keep_indices)` — the shrink. Same kept tokens, positions, summary token and
  re-index rule; every layer is compacted in place by `compact` (no copy of the cache) and handed back as the first
  `length` slots of its own tensors, in the instance's own container.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..policies.hermes import ops
from .caches import IncompatibleInstance, write_layers
from .checks import cache_layers, check_position_values, held_positions
from .schedule import LLAVA_OV, QWEN2_5_VL


class KeepIndices(list):
    """What the accelerated selection returns: a list of per-layer int64 keep indices (absolute: the prefix, then
    the kept visual tokens ascending), as the released selection's lists, plus `relative`, the int64
    [L, 1, n] `select_keep` result they came from, so the accelerated shrink needs no conversion."""

    def __init__(self, per_layer: Sequence[torch.Tensor], relative: torch.Tensor, budget: int, prefix_len: int):
        super().__init__(per_layer)
        self.relative, self.budget, self.prefix_len = relative, budget, prefix_len
        self._made = torch.cat(list(per_layer))  # a copy: an entry replaced or written in place differs from it

    def untouched(self) -> bool:
        """True while the entries hold what the selection made (one device compare): a caller may replace an entry
        or write into one before the shrink, which then keeps what it is handed."""
        now = torch.cat(list(self))
        return now.shape == self._made.shape and bool(torch.equal(now, self._made))


class CompressionStep:
    """The selection and the shrink of `Accelerated` (handle.py), which mixes them in; they read the handle's
    `model`, `kind`, `backend`, `group`, `contiguous`, `schedule`, `stats`, `_lm`, `config()` and `_freq()`."""

    # -- the selection ------------------------------------------------------------------------------------------

    def select(self, attn: torch.Tensor, budget: int) -> KeepIndices:
        """Keep indices from pooled visual attention float32 [L, 1, V] at `budget` (as `guidance_attention` gives
        it): `hermes_scores` and `select_keep` once for all layers, in the released selection's format. Under a
        `group`, attn is this rank's share (its heads) and `hermes_scores` averages it over the ranks."""
        m = self.model
        P = m.visual_start_idx
        allocate = getattr(m, "allocate_budget_by_depth", None)
        if callable(allocate):
            budgets = list(allocate(budget * m.num_layers, m.num_layers))
            if any(b != budget for b in budgets):
                raise IncompatibleInstance(f"allocate_budget_by_depth gives per-layer budgets {budgets}; the adapter "
                                           f"runs the released uniform allocation ({budget} per layer) only")
        cfg = self.config(budget, P)
        scores = ops.hermes_scores(attn, cfg, backend=self.backend, group=self.group)
        keep = ops.select_keep(scores, cfg, backend=self.backend)
        V = attn.shape[-1]
        prefix = torch.arange(P, device=keep.device, dtype=torch.int64)
        per_layer = [torch.cat([prefix, keep[layer, 0, :min(b, V)] + P])
                     for layer, b in enumerate(cfg.layer_budget_list)]
        self.stats["selections"] += 1
        return KeepIndices(per_layer, keep, budget, P)

    def prune_kv_cache_by_attention(self, attn_weights_local, attn_weights_global, attn_weights_mixed,
                                    num_keep: int = 3000) -> KeepIndices:
        """The released selection's contract: per-layer attention [1, H, q, L + q] of the local, global and mixed
        prompts in; per-layer absolute keep indices out. Only the prompt each layer reads is pooled (mid: mixed,
        deep: global; the shallow layers' attention has weight 0)."""
        with torch.inference_mode():
            m = self.model
            L, P = m.num_layers, m.visual_start_idx
            s, e = m.short_term_threshold, m.long_term_threshold
            lists = {"attn_weights_local": attn_weights_local, "attn_weights_global": attn_weights_global,
                     "attn_weights_mixed": attn_weights_mixed}
            for name, weights in lists.items():
                if not isinstance(weights, Sequence) or len(weights) != L:
                    raise IncompatibleInstance(f"prune_kv_cache_by_attention: {name}: expected {L} per-layer "
                                               f"attention tensors [1, H, q, L + q], got {type(weights).__name__}")
            if not isinstance(num_keep, int) or num_keep < 2:
                raise IncompatibleInstance(f"prune_kv_cache_by_attention: num_keep={num_keep!r}, expected an int "
                                           f">= 2")
            chosen = [attn_weights_local[i] if i < s else attn_weights_global[i] if i >= e else attn_weights_mixed[i]
                      for i in range(L)]
            spans = set()
            for index, w in enumerate(chosen):
                if not isinstance(w, torch.Tensor) or w.dim() != 4 or w.shape[0] < 1 or w.shape[3] - w.shape[2] <= P:
                    shape = tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
                    raise IncompatibleInstance(f"prune_kv_cache_by_attention: layer {index}: attention {shape}, "
                                               f"expected [1, H, q, L + q] with L > visual_start_idx={P}")
                spans.add(w.shape[3] - w.shape[2] - P)
            if len(spans) > 1:
                raise IncompatibleInstance(f"prune_kv_cache_by_attention: the layers see {sorted(spans)} visual "
                                           f"tokens: the released code interpolates scores between layers of unequal "
                                           f"length (docs/hermes.md §5 item 5), the adapter needs one length")
            V = spans.pop()
            device = chosen[-1].device
            attn = torch.zeros(L, 1, V, dtype=torch.float32, device=device)
            for layer in range(s, L):
                w = chosen[layer]
                q = w.shape[2]
                # heads first, then the prompt's queries, as the released code pools (in fp32 here)
                pooled = w[0].mean(dim=0, dtype=torch.float32)[:, P:w.shape[3] - q].mean(dim=0)
                attn[layer, 0] = pooled.to(device)
            return self.select(attn, num_keep)

    # -- the shrink ---------------------------------------------------------------------------------------------

    def _relative_keep(self, keep_lists, pairs) -> tuple[list[torch.Tensor], int]:
        """Per-layer int64 [1, 1, min(b_l, V)] visual keep (relative, -1 padded in deep layers) and the budget b,
        from any per-layer keep indices the released shrink accepts: sanitised as it does (in range, unique,
        sorted), then required to be the prefix plus b (deep: b - 1) visual tokens, as its selection gives."""
        m = self.model
        P, L, e = m.visual_start_idx, m.num_layers, m.long_term_threshold
        if isinstance(keep_lists, KeepIndices) and keep_lists.untouched() and keep_lists.prefix_len == P \
                and keep_lists.relative.shape[0] == L \
                and all(min(keep_lists.budget, k.shape[2] - P) == keep_lists.relative.shape[-1] for k, _ in pairs):
            rel = keep_lists.relative
            return [rel[layer:layer + 1] for layer in range(L)], keep_lists.budget
        if not isinstance(keep_lists, Sequence) or len(keep_lists) != L:
            raise IncompatibleInstance(f"_shrink_positions_and_rerotate_keys: expected {L} per-layer keep index "
                                       f"lists, got {type(keep_lists).__name__}")
        visual, counts = [], []
        for layer, ((k, _), idx) in enumerate(zip(pairs, keep_lists)):
            N = k.shape[2]
            idx = torch.as_tensor(idx, dtype=torch.int64).to(k.device).flatten()
            idx = idx[(idx >= 0) & (idx < N)]
            idx = torch.unique(idx, sorted=True) if idx.numel() else torch.zeros(1, dtype=torch.int64,
                                                                                   device=k.device)
            if idx.numel() < P or not torch.equal(idx[:P], torch.arange(P, device=k.device)):
                raise IncompatibleInstance(f"_shrink_positions_and_rerotate_keys: layer {layer} keeps "
                                           f"{idx.numel()} indices that do not start with the whole prefix "
                                           f"0..{P - 1}; the adapter shrinks what the released selection returns")
            visual.append(idx[P:] - P)
            counts.append(idx.numel() - P)
        spans = [k.shape[2] - P for k, _ in pairs]
        candidates = sorted({c + d for c in counts for d in (0, 1, 2) if c + d >= 2})
        for b in candidates:
            if all(c == min(b - 1 if layer >= e else b, V) for layer, (c, V) in enumerate(zip(counts, spans))):
                break
        else:
            raise IncompatibleInstance(f"_shrink_positions_and_rerotate_keys: the layers keep {counts} visual tokens "
                                       f"of {spans}; the adapter shrinks to one budget b (deep layers from "
                                       f"{e} on: b - 1), as the released selection keeps")
        rel = []
        for (k, _), vis, V in zip(pairs, visual, spans):
            row = torch.full((1, 1, min(b, V)), -1, dtype=torch.int64, device=k.device)
            row[0, 0, :vis.numel()] = vis
            rel.append(row)
        return rel, b

    def _shrink_positions_and_rerotate_keys(self, keep_indices_per_layer) -> None:
        """The released shrink's contract, per layer in place: keep the given tokens, re-index their positions
        when the released rule says so, rotate their keys by the position delta, fold a deep layer's pruned tokens
        into one summary token after the last kept one."""
        with torch.inference_mode():
            self._shrink(keep_indices_per_layer)

    def _shrink(self, keep_indices_per_layer) -> None:
        m, what = self.model, "_shrink_positions_and_rerotate_keys"
        pairs, container = cache_layers(m, self._lm, equal=False, what=what)
        held = held_positions(m, self.kind, pairs, what)
        rel, budget = self._relative_keep(keep_indices_per_layer, pairs)
        P = m.visual_start_idx
        qwen = self.kind == QWEN2_5_VL
        positions = []
        for (k, _), pos in zip(pairs, held):
            N = k.shape[2]
            if pos is None:  # the released shrink starts such a layer afresh at 0..N-1
                fresh = torch.arange(N, device=k.device)
                pos = fresh.to(torch.float32).expand(3, N).clone() if qwen else fresh
            positions.append(pos)
        check_position_values(positions, self.kind, P, what)
        flag = self._decide_reindex(positions)
        cfg = self.config(budget, P)
        section = tuple(m._mrope_section) if qwen else None
        new_pairs, new_positions = [], []
        for layer, ((k, v), pos, keep) in enumerate(zip(pairs, positions, rel)):
            N = k.shape[2]
            work = pos.to(device=k.device, dtype=torch.int64, copy=True)
            work = work.view(1, 1, 3, N) if qwen else work.view(1, 1, N)
            length, _ = ops.compact(k.unsqueeze(0), v.unsqueeze(0), work, keep.to(k.device), cfg,
                                    self._freq(k.device), section, backend=self.backend,
                                    layers=range(layer, layer + 1), reindexed=flag.to(k.device))
            k_new, v_new = k[:, :, :length], v[:, :, :length]
            if self.contiguous:
                k_new, v_new = k_new.contiguous(), v_new.contiguous()
            new_pairs.append((k_new, v_new))
            kept = work[0, 0, ..., :length]
            new_positions.append(kept.to(device=pos.device, dtype=pos.dtype).clone())
        m.kv_cache = write_layers(m.kv_cache, container, new_pairs)
        cache = m._position_ids_cache
        for layer, pos in enumerate(new_positions):
            cache[layer] = pos
        self.stats["shrinks"] += 1

    def _decide_reindex(self, positions: list[torch.Tensor]) -> torch.Tensor:
        """The released rule as a 0-dim bool: always when not streaming; else once the largest position exceeds
        max_position_embeddings - margin, LLaVA-OV reading each layer's last entry, Qwen2.5-VL its maximum."""
        device = positions[0].device
        if not self.model.streaming:
            return torch.ones((), dtype=torch.bool, device=device)
        tops = [(p[-1] if self.kind == LLAVA_OV else p.max()).to(device=device, dtype=torch.float64)
                for p in positions if p.numel()]
        top = torch.stack(tops).max() if tops else torch.zeros((), dtype=torch.float64, device=device)
        return top > self._lm.max_positions - self.schedule.margin

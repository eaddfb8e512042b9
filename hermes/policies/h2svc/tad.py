"""The head profiler's attention (docs/h2svc.md §2): eager attention of the language model over blocks of query rows,
each block reduced at once to the TAD partial sums of its layer, so no [H, S, S] map is ever held.

`profiling_attention` registers `profile_attention_forward` as PROFILE_ATTENTION for the duration of a call; a
block has as many rows as fit BLOCK_BYTES of float32 probabilities (or `query_block`). `TADSums` holds the running
sums per (layer, query head), from which `hermes_kernels.policies.h2svc.reference` gives S(h) and the map. The
rearranged sums and why they equal the reference's: docs/cli.md#profiling-heads-for-h2svc.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator, Sequence

import torch
from transformers import AttentionInterface

from hermes.attention import attention_name

PROFILE_ATTENTION = "h2svc-profile"
BLOCK_BYTES = 256 * 2**20  # float32 probabilities of one query block, [H, block, S], when query_block is None



@dataclasses.dataclass
class Queries:
    """What the running forward's query tokens are. Frame tokens sit at key indices [P, P + n·T_f).

    visual_start:     P, key index of the first frame token.
    num_frames:       n, frames among the keys.
    tokens_per_frame: T_f.
    frames:           int64 [T] frame index of each query (a video chunk), or None (text queries of T2V).
    """

    visual_start: int
    num_frames: int
    tokens_per_frame: int
    frames: torch.Tensor | None


class TADSums:
    """Running TAD partial sums of one clip, per layer and query head, float64 [H] on the layer's device.

    `queries` describes the running forward (None: the prefix, which adds nothing). `query_block` rows of queries
    are taken at a time (None: as many as fit BLOCK_BYTES of float32 probabilities).
    """

    def __init__(self, num_layers: int, query_block: int | None = None, decoder_layers: Sequence[int] | None = None):
        """decoder_layers: the decoder index of each of the num_layers profiled layers (a hybrid model's
        full-attention layers); default 0 .. num_layers - 1."""
        layers = range(num_layers) if decoder_layers is None else decoder_layers
        if len(layers) != num_layers:
            raise ValueError(f"decoder_layers: expected {num_layers} indices, got {len(layers)}")
        self.index = {decoder: i for i, decoder in enumerate(layers)}
        self.v2v: list[torch.Tensor | None] = [None] * num_layers
        self.t2v: list[torch.Tensor | None] = [None] * num_layers
        self.queries: Queries | None = None
        self.query_block = query_block

    def block_rows(self, num_heads: int, num_keys: int) -> int:
        if self.query_block is not None:
            return self.query_block
        return max(1, BLOCK_BYTES // (4 * num_heads * num_keys))

    def add(self, layer: int, probs: torch.Tensor, rows: slice) -> None:
        """Fold one block of probabilities float32 [H, t, N] (queries `rows` of the forward) of decoder layer
        `layer` into the sums."""
        queries = self.queries
        if queries is None:
            return
        layer = self.index[layer]
        P, n, T_f = queries.visual_start, queries.num_frames, queries.tokens_per_frame
        mass = probs[..., P:P + n * T_f].unflatten(-1, (n, T_f)).sum(dim=-1, dtype=torch.float64)  # A [H, t, n]
        frame = torch.arange(n, device=probs.device)
        if queries.frames is not None:
            i = queries.frames[rows].to(probs.device)
            weight, sums = (i[:, None] - frame).clamp_min(0).to(torch.float64), self.v2v  # [t, n]: max(i − j, 0)
        else:
            weight, sums = (n - 1 - frame).to(torch.float64), self.t2v  # [n]: n − 1 − j
        partial = (mass * weight).sum(dim=(1, 2))
        sums[layer] = partial if sums[layer] is None else sums[layer] + partial

    def take(self, which: str) -> torch.Tensor:
        """The sums of "v2v" or "t2v" as float64 [L, H] on the CPU, and reset them."""
        sums = getattr(self, which)
        if any(s is None for s in sums):
            raise RuntimeError(f"TADSums.take: no {which} queries reached every layer")
        out = torch.stack([s.cpu() for s in sums])
        setattr(self, which, [None] * len(sums))
        return out


def profile_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                              *, h2svc_sums: TADSums | None = None, h2svc_blocks: torch.Tensor | None = None,
                              sliding_window: int | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention-interface entry (PROFILE_ATTENTION): the eager attention of one layer, query
    [1, H, T, D] after RoPE, key/value [1, Hkv, N, D] (the cache plus the T incoming tokens), and, for a layer the
    caches hold (`h2svc_sums.index`), its streamed reduction into `h2svc_sums` (passed through the model's forward
    kwargs). Returns (output [1, T, H, D], None).

    Not in transformers' AttentionMaskInterface, so the model passes attention_mask=None; the queries are the last
    T of the N keys, and query row r sees keys <= N − T + r (bottom-right causal). A sliding-window layer
    (`sliding_window` W, Gemma 4) also sees no key W or more tokens back, and a query sees the keys after it in its
    own vision block (`h2svc_blocks`, int64 [T] over the incoming tokens, -1 for text): the mask transformers
    builds for it. Eval only: no dropout.
    """
    if not isinstance(h2svc_sums, TADSums):
        raise RuntimeError(f"{PROFILE_ATTENTION} attention runs only inside profile_heads (h2svc_sums missing)")
    batch, num_heads, count, dim = query.shape
    num_kv_heads, total = key.shape[1], key.shape[2]
    if batch != 1:
        raise RuntimeError(f"{PROFILE_ATTENTION} attention profiles one clip at a time, got a batch of {batch}")
    group = num_heads // num_kv_heads
    scaling = dim ** -0.5 if scaling is None else scaling
    # GQA by broadcasting: query heads kv·g … kv·g + g − 1 share KV head kv (repeat_kv's order), no key copies
    grouped = query.view(1, num_kv_heads, group, count, dim)
    keys_t = key[:, :, None].transpose(-1, -2)
    values = value[:, :, None]
    out = torch.empty_like(grouped)
    block = h2svc_sums.block_rows(num_heads, total)
    key_index = torch.arange(total, device=query.device)
    profiled = module.layer_idx in h2svc_sums.index
    for start in range(0, count, block):
        rows = slice(start, min(start + block, count))
        scores = torch.matmul(grouped[:, :, :, rows], keys_t) * scaling  # [1, Hkv, g, t, N]
        query_index = torch.arange(rows.start, rows.stop, device=query.device)[:, None] + (total - count)
        visible = key_index <= query_index
        if sliding_window is not None:
            if h2svc_blocks is not None:
                blocks = torch.cat([h2svc_blocks.new_full((total - count,), -1), h2svc_blocks]).to(query.device)
                own = blocks[rows.start + total - count:rows.stop + total - count, None]
                visible |= (blocks[None, :] == own) & (own >= 0)
            visible &= key_index > query_index - sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
        out[:, :, :, rows] = torch.matmul(probs.to(query.dtype), values)
        if profiled:
            h2svc_sums.add(module.layer_idx, probs.view(num_heads, rows.stop - rows.start, total), rows)
    return out.view(1, num_heads, count, dim).transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def profiling_attention(model: torch.nn.Module) -> Iterator[None]:
    """Run the language model's attention through `profile_attention_forward` inside the block; the model's own
    attention implementation is restored afterwards (also after an error)."""
    AttentionInterface.register(PROFILE_ATTENTION, profile_attention_forward)
    before = attention_name(model.config.get_text_config())
    model.set_attn_implementation({"text_config": PROFILE_ATTENTION})
    try:
        yield
    finally:
        model.set_attn_implementation({"text_config": before})

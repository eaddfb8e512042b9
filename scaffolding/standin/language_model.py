"""The language model and tokenizer a stand-in instance holds (scaffolding/standin/released.py), so that it runs without
transformers: a tiny random decoder (`TinyLanguageModel`: the few attributes the released code reads, a causal
forward with `output_attentions` / `output_hidden_states`; `TinyCausalLM` nests it as LLaVA-OV's language model
does), its rotary tables (`rope_tables`, `rotate_half`), and a deterministic tokenizer (`TinyTokenizer`).
"""
from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Sequence

import torch
from torch import nn

from .dynamic_cache import layer_pairs, with_layers


class TinyTokenizer:
    """Deterministic ids: one token per `chars_per_token` characters of the text; `tokenizer(text).input_ids`."""

    def __init__(self, vocab_size: int = 97, chars_per_token: int = 5):
        self.vocab_size, self.chars_per_token = vocab_size, chars_per_token

    def __call__(self, text: str) -> SimpleNamespace:
        n = self.chars_per_token
        pieces = [text[i:i + n] for i in range(0, len(text), n)] or [""]
        ids = [(sum(ord(c) * (j + 1) for j, c in enumerate(p)) + 7) % self.vocab_size for p in pieces]
        return SimpleNamespace(input_ids=ids)


class RMSNorm(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * self.weight


class Rotary(nn.Module):
    """The rotary module's readable part: `inv_freq` [D/2] and `attention_scaling`, the factor a transformers rotary
    module multiplies its cos and sin tables by (1 for the default rotary; YaRN and LongRoPE set another), so that
    queries and keys both carry it."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim),
                             persistent=False)
        self.attention_scaling = 1.0


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype,
                mrope_section: Sequence[int] | None = None, scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [n, D] of positions [n] (1D) or [3, n] (M-RoPE, sections over each half of the channels), computed
    in fp32, times the rotary module's `scaling` (`Rotary.attention_scaling`), stored in `dtype`, as a model's rotary
    module hands them out."""
    freq = inv_freq.to(device=positions.device, dtype=torch.float32)
    if mrope_section is None:
        angle = positions.to(torch.float32)[:, None] * freq
    else:
        axis = torch.repeat_interleave(torch.arange(3, device=positions.device),
                                       torch.tensor(list(mrope_section), device=positions.device))
        angle = positions.to(torch.float32).T[:, axis] * freq  # [n, D/2], each pair on its own axis
    angle = torch.cat([angle, angle], dim=-1)
    return (angle.cos() * scaling).to(dtype), (angle.sin() * scaling).to(dtype)


class TinyAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, projections=None):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        q, k, v, o = projections or (nn.Linear(hidden, heads * head_dim), nn.Linear(hidden, kv_heads * head_dim),
                                     nn.Linear(hidden, kv_heads * head_dim), nn.Linear(heads * head_dim, hidden))
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = q, k, v, o


class _Zero(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(x)


class TinyDecoderLayer(nn.Module):
    """One decoder layer: RMSNorm, attention over (past + own tokens, causal among its own), MLP."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, shared: "TinyDecoderLayer | None",
                 mlp: bool = True):
        super().__init__()
        if shared is None:
            self.input_layernorm, self.post_attention_layernorm = RMSNorm(hidden), RMSNorm(hidden)
            self.self_attn = TinyAttention(hidden, heads, kv_heads, head_dim)
            self.mlp = nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.SiLU(), nn.Linear(2 * hidden, hidden)) if mlp \
                else _Zero()
        else:  # one set of weights for many layers (large shapes in the benchmark); the layer objects differ
            self.input_layernorm = shared.input_layernorm
            self.post_attention_layernorm = shared.post_attention_layernorm
            a = shared.self_attn
            self.self_attn = TinyAttention(hidden, heads, kv_heads, head_dim, (a.q_proj, a.k_proj, a.v_proj, a.o_proj))
            self.mlp = shared.mlp

    def forward(self, hidden: torch.Tensor, position_ids: torch.Tensor, past=None, inv_freq=None,
                output_attentions: bool = False, scaling: float = 1.0):
        a = self.self_attn
        B, Q, _ = hidden.shape
        h = self.input_layernorm(hidden)
        q = a.q_proj(h).view(B, Q, a.heads, a.head_dim).transpose(1, 2)
        k = a.k_proj(h).view(B, Q, a.kv_heads, a.head_dim).transpose(1, 2)
        v = a.v_proj(h).view(B, Q, a.kv_heads, a.head_dim).transpose(1, 2)
        pos = position_ids[0, 0] if position_ids.dim() == 3 else position_ids[0]  # text tokens: equal t/h/w
        cos, sin = rope_tables(pos, inv_freq, q.dtype, scaling=scaling)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        if past is not None:
            k = torch.cat([past[0].to(k.dtype), k], dim=2)
            v = torch.cat([past[1].to(v.dtype), v], dim=2)
        N = k.shape[2]
        group = a.heads // a.kv_heads
        logits = q.float() @ k.repeat_interleave(group, dim=1).float().transpose(-1, -2) / math.sqrt(a.head_dim)
        hidden_keys = torch.arange(N, device=q.device)[None, :] > (N - Q + torch.arange(Q, device=q.device))[:, None]
        probs = logits.masked_fill(hidden_keys, float("-inf")).softmax(dim=-1)
        out = (probs.to(v.dtype) @ v.repeat_interleave(group, dim=1)).transpose(1, 2).reshape(B, Q, -1)
        hidden = hidden + a.o_proj(out)
        hidden = hidden + self.mlp(self.post_attention_layernorm(hidden))
        return hidden, (probs if output_attentions else None)


class TinyLanguageModel(nn.Module):
    """A random decoder with the attributes the released code reads: `config` (num_hidden_layers,
    num_attention_heads, num_key_value_heads, hidden_size, max_position_embeddings, _attn_implementation),
    `layers` (each with input_layernorm, self_attn.q_proj / k_proj / v_proj), `rotary_emb` (inv_freq),
    `embed_tokens`; `forward(input_ids, past_key_values, position_ids, output_attentions, output_hidden_states)`.

    Like a transformers decoder it appends to a DynamicCache-like `past_key_values` even with use_cache=False;
    a list of pairs stays as it was. `causal_lm=True` nests it as `.model` (LLaVA-OV's language model is a
    causal LM whose decoder sits at `.model`; Qwen2.5-VL's is the decoder itself).
    """

    def __init__(self, num_layers: int = 4, heads: int = 4, kv_heads: int = 2, head_dim: int = 16, hidden: int = 32,
                 vocab: int = 97, max_positions: int = 32768, attn_implementation: str = "sdpa",
                 theta: float = 1e4, mrope_section: Sequence[int] | None = None, share_weights: bool = False,
                 mlp: bool = True, seed: int = 0, dtype: torch.dtype = torch.float32):
        super().__init__()
        gen_state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        try:
            self.embed_tokens = nn.Embedding(vocab, hidden)
            first = TinyDecoderLayer(hidden, heads, kv_heads, head_dim, None, mlp)
            self.layers = nn.ModuleList([first] + [
                TinyDecoderLayer(hidden, heads, kv_heads, head_dim, first if share_weights else None, mlp)
                for _ in range(num_layers - 1)])
            self.norm = RMSNorm(hidden)
        finally:
            torch.random.set_rng_state(gen_state)
        self.rotary_emb = Rotary(head_dim, theta)
        rope_scaling = None if mrope_section is None else {"mrope_section": list(mrope_section)}
        self.config = SimpleNamespace(num_hidden_layers=num_layers, num_attention_heads=heads,
                                      num_key_value_heads=kv_heads, hidden_size=hidden,
                                      head_dim=head_dim if head_dim * heads != hidden else None,
                                      max_position_embeddings=max_positions, _attn_implementation=attn_implementation,
                                      rope_scaling=rope_scaling)
        self.to(dtype)

    def forward(self, input_ids=None, inputs_embeds=None, past_key_values=None, use_cache=False, position_ids=None,
                output_attentions=False, output_hidden_states=False, **unused):
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        past = layer_pairs(past_key_values) if past_key_values is not None else [None] * len(self.layers)
        states, attentions = [hidden], []
        for index, layer in enumerate(self.layers):
            hidden, probs = layer(hidden, position_ids=position_ids, past=past[index],
                                  inv_freq=self.rotary_emb.inv_freq, output_attentions=output_attentions,
                                  scaling=self.rotary_emb.attention_scaling)
            states.append(hidden)
            attentions.append(probs)
        if past_key_values is not None and not isinstance(past_key_values, (list, tuple)):
            _append_like_transformers(past_key_values, input_ids.shape[-1] if input_ids is not None
                                      else hidden.shape[1])
        return SimpleNamespace(last_hidden_state=self.norm(hidden), hidden_states=tuple(states),
                               attentions=tuple(attentions) if output_attentions else None)


def _append_like_transformers(cache, n: int) -> None:
    """What a transformers attention layer does to a DynamicCache it is handed: appends the new tokens' keys."""
    grown = [(torch.cat([k, k[:, :, -1:].expand(-1, -1, n, -1)], 2), torch.cat([v, v[:, :, -1:].expand(-1, -1, n, -1)],
                                                                              2)) for k, v in layer_pairs(cache)]
    with_layers(cache, grown)


class TinyCausalLM(nn.Module):
    """LLaVA-OV's language model layout: the decoder at `.model`, the config on both."""

    def __init__(self, **kwargs):
        super().__init__()
        self.model = TinyLanguageModel(**kwargs)
        self.config = self.model.config

    def forward(self, **kwargs):
        return self.model(**kwargs)


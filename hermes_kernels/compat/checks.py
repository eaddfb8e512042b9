"""What `accelerate` checks before it replaces anything, and what each replaced method checks before it changes the
cache or the positions (docs/integrations.md#one-call). A problem raises IncompatibleInstance naming it.

Nothing here imports transformers or the `hermes` glue: containers, the language model and its rotary module are
read by duck typing. `instance_problems` lists everything an instance lacks at once; `cache_layers`,
`held_positions` and `check_position_values` check the state one call finds.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import torch

from ..engine.dtypes import CACHE_DTYPES
from .caches import IncompatibleInstance, read_layers
from .schedule import LLAVA_OV, METHODS, QWEN2_5_VL, ReleasedSchedule


@dataclasses.dataclass
class LMParts:
    """What the adapter reads of the language model."""

    module: Any
    layers: list
    heads: int
    kv_heads: int
    head_dim: int
    max_positions: int
    rotary: Any
    inv_freq: torch.Tensor


def instance_problems(model: Any, kind: str, parts: Sequence[str], schedule: ReleasedSchedule) -> tuple[list[str], Any]:
    """Everything the instance lacks for `parts`, and the language model pieces when they are all there."""
    problems = []

    def need(name: str, check: Callable[[Any], bool] | None = None, what: str = "") -> Any:
        if not hasattr(model, name):
            problems.append(f"missing attribute {name!r}" + (f" ({what})" if what else ""))
            return None
        value = getattr(model, name)
        if check is not None and not check(value):
            problems.append(f"{name}: expected {what}, got {value!r:.80}")
            return None
        return value

    def is_int(x):
        return isinstance(x, int) and not isinstance(x, bool)

    num_layers = need("num_layers", lambda x: is_int(x) and x >= 1, "an int >= 1: decoder layers")
    need("kv_size", lambda x: is_int(x) and x >= 2, "an int >= 2: the budget (deep layers give one slot to the "
         "summary token)")
    need("visual_start_idx", lambda x: is_int(x) and x >= 0, "an int >= 0: the prefix length")
    shallow = need("short_term_threshold", is_int, "an int: the first mid layer")
    deep = need("long_term_threshold", is_int, "an int: the first deep layer")
    need("streaming", lambda x: isinstance(x, (bool, int)), "a bool: lazy (True) or eager (False) re-indexing")
    positions = need("_position_ids_cache", lambda x: isinstance(x, (list, tuple)),
                     "a list with one position tensor (or None) per layer")
    if num_layers is not None and shallow is not None and deep is not None and not 0 <= shallow <= deep <= num_layers:
        problems.append(f"short_term_threshold={shallow}, long_term_threshold={deep}: expected "
                        f"0 <= short <= long <= num_layers={num_layers}")
    if num_layers is not None and positions is not None and len(positions) != num_layers:
        problems.append(f"_position_ids_cache: holds {len(positions)} entries for num_layers={num_layers}")
    for part in parts:
        method = METHODS[part]
        if not callable(getattr(model, method, None)):
            problems.append(f"missing method {method!r} (the {part} this call replaces)")
    if "guidance" in parts:
        if not callable(getattr(model, "apply_kv_cache_pruning_strict", None)):
            problems.append("missing method 'apply_kv_cache_pruning_strict' (the guidance pass hands its keep "
                            "indices to it)")
        tokenizer = getattr(getattr(model, "processor", None), "tokenizer", None)
        if not callable(tokenizer):
            problems.append("missing 'processor.tokenizer' (a callable whose result has .input_ids): the guidance "
                            "prompts are tokenized with it")
        if not callable(getattr(model, "get_input_embeddings", None)):
            problems.append("missing method 'get_input_embeddings' (the released guidance embeds its prompts)")
    if kind == QWEN2_5_VL:
        section = need("_mrope_section", lambda x: isinstance(x, Sequence) and len(x) == 3
                       and all(is_int(s) and s >= 0 for s in x), "three M-RoPE pair counts (t, h, w)")
    lm = need("language_model", None, "the decoder the caches belong to")
    if lm is None:
        return problems, None
    config = getattr(lm, "config", None)
    if config is None:
        problems.append("language_model.config: missing")
        return problems, None
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    hidden = getattr(config, "hidden_size", None)
    if not (is_int(heads) and is_int(kv_heads) and heads >= 1 and kv_heads >= 1 and heads % kv_heads == 0):
        problems.append(f"language_model.config: num_attention_heads={heads!r}, num_key_value_heads={kv_heads!r}: "
                        f"expected ints with heads % kv_heads == 0")
        return problems, None
    head_dim = getattr(config, "head_dim", None) or (hidden // heads if is_int(hidden) else None)
    if not is_int(head_dim) or head_dim % 2:
        problems.append(f"language_model.config: head dim {head_dim!r} (hidden_size // num_attention_heads): "
                        f"expected an even int")
        return problems, None
    layers = None
    for owner in (lm, getattr(lm, "model", None)):
        if owner is not None and getattr(owner, "layers", None) is not None:
            layers = list(owner.layers)
            break
    if layers is None:
        problems.append("language_model: no decoder layers at .layers or .model.layers")
    elif num_layers is not None and len(layers) != num_layers:
        problems.append(f"language_model: {len(layers)} decoder layers for num_layers={num_layers}")
    elif "guidance" in parts:
        for index, layer in enumerate(layers):
            attn = getattr(layer, "self_attn", None)
            if not all(callable(getattr(x, n, None)) for x, n in ((layer, "input_layernorm"), (attn, "q_proj"),
                                                                  (attn, "k_proj"))):
                problems.append(f"language_model layer {index}: needs input_layernorm, self_attn.q_proj and "
                                f"self_attn.k_proj (the guidance computes its queries and keys with them)")
                break
    rotary = None
    for candidate in (getattr(lm, "rotary_emb", None), getattr(getattr(lm, "model", None), "rotary_emb", None),
                      getattr(getattr(layers[0], "self_attn", None), "rotary_emb", None) if layers else None):
        if isinstance(getattr(candidate, "inv_freq", None), torch.Tensor):
            rotary = candidate
            break
    if rotary is None:
        problems.append("language_model: no rotary module with an inv_freq tensor at .rotary_emb, "
                        ".model.rotary_emb or layers[0].self_attn.rotary_emb")
        return problems, None
    inv_freq = rotary.inv_freq.detach().to(torch.float32).flatten()
    if inv_freq.numel() != head_dim // 2:
        problems.append(f"language_model rotary inv_freq: {inv_freq.numel()} frequencies for head dim {head_dim}")
    if kind == QWEN2_5_VL and section is not None and sum(section) != head_dim // 2:
        problems.append(f"_mrope_section {list(section)}: sums to {sum(section)}, expected head_dim / 2 = "
                        f"{head_dim // 2}")
    max_positions = getattr(config, "max_position_embeddings", None) or schedule.default_max_positions
    return problems, LMParts(lm, layers or [], heads, kv_heads, head_dim, int(max_positions), rotary, inv_freq)


def cache_layers(model: Any, lm: LMParts, equal: bool, what: str,
                 visual: bool = True) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], str]:
    """The per-layer (keys, values) of the cache, checked: [1, Hkv, L_l, D] pairs of one floating dtype, the
    model's KV heads and head dim, with `visual` every layer longer than the prefix; with `equal`, one length for
    all."""
    pairs, container = read_layers(getattr(model, "kv_cache", None))
    problems = []
    if len(pairs) != model.num_layers:
        problems.append(f"kv_cache holds {len(pairs)} layers, num_layers is {model.num_layers}")
    for index, (k, v) in enumerate(pairs):
        if k.dim() != 4 or k.shape != v.shape or k.shape[0] != 1:
            problems.append(f"layer {index}: keys {tuple(k.shape)} and values {tuple(v.shape)}, expected one "
                            f"shape [1, Hkv, L, D] (one stream)")
        elif k.dtype not in CACHE_DTYPES or v.dtype != k.dtype or v.device != k.device:
            problems.append(f"layer {index}: keys {k.dtype} on {k.device}, values {v.dtype} on {v.device}; "
                            f"expected one dtype of {[str(d) for d in CACHE_DTYPES]} on one device")
        elif (k.shape[1], k.shape[3]) != (lm.kv_heads, lm.head_dim):
            problems.append(f"layer {index}: [1, Hkv, L, D] = {tuple(k.shape)}, expected Hkv={lm.kv_heads} and "
                            f"D={lm.head_dim} (language_model.config)")
        elif visual and k.shape[2] <= model.visual_start_idx:
            problems.append(f"layer {index}: {k.shape[2]} tokens hold nothing after the prefix "
                            f"(visual_start_idx={model.visual_start_idx})")
        elif any(st == 0 and size > 1 for st, size in zip(k.stride() + v.stride(), k.shape + v.shape)):
            problems.append(f"layer {index}: keys or values are broadcast views (a stride of 0); the shrink "
                            f"writes them in place")
        if problems:
            break
    if not problems and equal and len({k.shape[2] for k, _ in pairs}) > 1:
        lengths = [k.shape[2] for k, _ in pairs]
        problems.append(f"the layers hold different lengths {lengths}: the released selection interpolates "
                        f"scores between layers of unequal length (docs/hermes.md §5 item 5), the adapter "
                        f"needs one length; call restore() to run the released code here")
    if not problems and len({k.dtype for k, _ in pairs}) > 1:
        problems.append(f"the layers hold different dtypes {sorted({str(k.dtype) for k, _ in pairs})}")
    if problems:
        raise IncompatibleInstance(f"{what}: {type(model).__name__}.kv_cache: " + "; ".join(problems))
    return pairs, container


def held_positions(model: Any, kind: str, pairs, what: str) -> list[torch.Tensor | None]:
    """Each layer's positions as the instance holds them, shape-checked (None where the released code would
    start afresh: missing, or not as long as the layer)."""
    out = []
    for index, ((k, _), pos) in enumerate(zip(pairs, model._position_ids_cache)):
        if pos is None:
            out.append(None)
            continue
        if not isinstance(pos, torch.Tensor):
            raise IncompatibleInstance(f"{what}: _position_ids_cache[{index}]: expected a tensor or None, got "
                                       f"{type(pos).__name__}")
        if kind == LLAVA_OV:
            if pos.dim() != 1 or pos.dtype.is_floating_point or pos.dtype == torch.bool:
                raise IncompatibleInstance(f"{what}: _position_ids_cache[{index}]: expected int64 [L] (LLaVA-OV "
                                           f"1D positions), got {pos.dtype} {tuple(pos.shape)}")
            out.append(pos if pos.numel() == k.shape[2] else None)
        else:
            if pos.dim() != 2 or pos.shape[0] != 3 or pos.dtype == torch.bool:
                raise IncompatibleInstance(f"{what}: _position_ids_cache[{index}]: expected float32 [3, L] "
                                           f"(Qwen2.5-VL t, h, w), got {pos.dtype} {tuple(pos.shape)}")
            out.append(pos if pos.shape[1] == k.shape[2] else None)
    return out



def check_position_values(positions: list[torch.Tensor], kind: str, prefix_len: int, what: str) -> None:
    """The checks of the shrink's positions that need their values, with one host read for all layers: LLaVA-OV
    0..P-1 on the prefix then strictly increasing; Qwen2.5-VL integral."""
    qwen, P = kind == QWEN2_5_VL, prefix_len
    verdicts = []
    for pos in positions:
        if qwen:
            verdicts.append((torch.isfinite(pos) & (pos == pos.round())).all())
        else:
            steps_ok = (pos[1:] > pos[:-1]).all() if pos.numel() > 1 else torch.ones((), dtype=torch.bool,
                                                                                      device=pos.device)
            verdicts.append(steps_ok & (pos[:P] == torch.arange(P, device=pos.device)).all())
    verdict = torch.stack([v.to(positions[0].device) for v in verdicts])
    if not bool(verdict.all()):
        bad = (~verdict).nonzero().flatten().tolist()
        why = ("integral t/h/w values (the released code stores them as floats)" if qwen else
               "0..P-1 on the prefix, then strictly increasing in cache order (as the released class appends "
               "them; its re-index numbers kept tokens by cache order, the adapter by position rank)")
        raise IncompatibleInstance(f"{what}: _position_ids_cache of layer(s) {bad}: expected {why}")

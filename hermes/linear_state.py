"""The fixed-size state of a hybrid model's linear-attention layers (Qwen3.5's Gated DeltaNet) inside a stream cache:
`LinearLayout` (which decoder layer is which, and each linear layer's state shapes, read from the model) and
`LinearStates` (two copies of every state, so a forward context commits or leaves nothing, and the last commit can
be undone). The rules, and why: docs/qwen3_5.md#hybrid-cache.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

FULL = "full_attention"
LINEAR = "linear_attention"
SLIDING = "sliding_attention"  # held by hermes.window
LAYER_KINDS = (FULL, LINEAR, SLIDING)


def layer_kinds(config) -> tuple[str, ...]:
    """The kind of every decoder layer of a model config (its text config's `layer_types`; all "full_attention"
    without one). ValueError naming `layer_types` for a kind the caches do not hold (e.g. "chunked_attention"),
    raised from the config alone, before any weight loads."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    kinds = getattr(text, "layer_types", None)
    kinds = tuple(kinds) if kinds else (FULL,) * text.num_hidden_layers
    if unknown := sorted(set(kinds) - set(LAYER_KINDS)):
        raise ValueError(f"layer_types: {getattr(config, 'model_type', 'the model')} has layers of kind "
                         f"{', '.join(map(repr, unknown))}, which the stream caches do not hold (supported: "
                         f"{', '.join(map(repr, LAYER_KINDS))})")
    if FULL not in kinds:
        raise ValueError("layer_types: the model has no full-attention layer, so there is no KV cache to compress")
    return kinds


@dataclasses.dataclass(frozen=True)
class LinearLayout:
    """Which decoder layer is which, and the state of each linear-attention layer.

    kinds:      per decoder layer, "full_attention" or "linear_attention".
    conv:       per linear layer, in depth order: (channels C, kernel K) of its convolution state [B, C, K].
    recurrent:  per linear layer: (heads Hv, key dim Dk, value dim Dv) of its recurrent state [B, Hv, Dk, Dv] fp32.
    dtypes:     per linear layer, the dtype of its convolution state (the layer's weights').
    devices:    per linear layer, where its states live (the layer's device).
    """

    kinds: tuple[str, ...]
    conv: tuple[tuple[int, int], ...] = ()
    recurrent: tuple[tuple[int, int, int], ...] = ()
    dtypes: tuple[torch.dtype, ...] = ()
    devices: tuple[torch.device, ...] = ()

    def __post_init__(self):
        count = self.kinds.count(LINEAR)
        if any(len(field) != count for field in (self.conv, self.recurrent, self.dtypes, self.devices)):
            raise ValueError(f"linear: expected the state of each of the {count} linear-attention layers")

    @classmethod
    def of(cls, language_model: torch.nn.Module, kinds: Sequence[str]) -> "LinearLayout":
        """Read the state shapes from the decoder stack's linear-attention modules (`linear_attn`: conv_dim,
        conv_kernel_size, num_v_heads, head_k_dim, head_v_dim)."""
        kinds = tuple(kinds)
        linear = [language_model.layers[i].linear_attn for i, kind in enumerate(kinds) if kind == LINEAR]
        return cls(kinds=kinds, conv=tuple((m.conv_dim, m.conv_kernel_size) for m in linear),
                   recurrent=tuple((m.num_v_heads, m.head_k_dim, m.head_v_dim) for m in linear),
                   dtypes=tuple(m.conv1d.weight.dtype for m in linear),
                   devices=tuple(m.conv1d.weight.device for m in linear))

    @property
    def full_layers(self) -> tuple[int, ...]:
        """Decoder indices of the full-attention layers, in depth order (cache layer i is decoder layer
        full_layers[i])."""
        return tuple(i for i, kind in enumerate(self.kinds) if kind == FULL)

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """Decoder indices of the linear-attention layers, in depth order."""
        return tuple(i for i, kind in enumerate(self.kinds) if kind == LINEAR)


@dataclasses.dataclass
class _Live:
    """One linear layer's state inside the running forward context: `conv`, `recurrent` are the tensors its
    forwards read and write; `fresh` while they hold no state yet (the model then starts from zeros); `done` once a
    forward has stored its recurrent state (the layer's last call)."""

    conv: torch.Tensor
    recurrent: torch.Tensor
    fresh: bool
    done: bool = False


# The calls of one layer in one forward, in the order their data imposes: reads of the states (any number, in any
# order), the convolution's write (it reads the convolution input), the recurrent state's write (it reads the
# convolution's output). A full-attention layer's one `update` counts as its last write.
READ, CONV, RECURRENT = 1, 2, 3


class LinearStates:
    """The linear-attention layers' states of B streams, two copies each: the committed state (what the stream
    holds) and a working copy.

    A storing forward context works on the working copy (the committed state copied in at its first touch of a
    layer) and commits at a successful end by swapping the two, so the committed state before it stays in the
    other copy: `undo()` puts it back until the next storing context. A read-only context works on clones and
    drops them. A context that raises commits nothing. The model's layers see transformers' interface:
    `get_conv_state`, `update_conv_state`, `get_recurrent_state`, `update_recurrent_state` (decoder indices).

    A forward run outside any context (the cache used as a plain transformers cache) is a storing context of its
    own. It opens at its first call of any layer, whichever method that is, and commits once the last decoder
    layer has written its last state (`arrive`, `leave`). A call that cannot belong to the open forward (a layer
    earlier than one already reached, or a layer called again after a write the order above puts later) starts a
    new one: the forward that left it open failed, and what it wrote is dropped.
    """

    def __init__(self, layout: LinearLayout, batch_size: int, allocate):
        """layout: the model's `LinearLayout`; allocate: `(shape, dtype, device) -> tensor`, the owning cache's
        `allocate` (so its `buffers()`, `nbytes()` and `data_ptrs()` count the states)."""
        self.slot_of = {layer: i for i, layer in enumerate(layout.linear_layers)}
        self.last_layer = len(layout.kinds) - 1
        self.conv = [allocate((2, batch_size, *shape), dtype, device)
                     for shape, dtype, device in zip(layout.conv, layout.dtypes, layout.devices)]
        self.recurrent = [allocate((2, batch_size, *shape), torch.float32, device)
                          for shape, device in zip(layout.recurrent, layout.devices)]
        self.reset()

    def reset(self) -> None:
        """No state (the next storing context starts from zeros, as a fresh model does); nothing to undo."""
        self.committed = 0
        self.has_state = False
        self.epoch = 0
        self._undo: bool | None = None  # has_state before the last commit, while that commit can be undone
        self._mode: str | None = None
        self._implicit = False  # the running context is one forward outside forward_context
        self._reached: dict[int, int] = {}  # in an implicit context: decoder layer -> the latest phase it reached
        self._live: dict[int, _Live] = {}

    # ---- forward contexts ---------------------------------------------------------------------------------
    def begin(self, store: bool) -> None:
        """A forward context starts: `store` (its forwards carry the stream on) or read-only. A context-free
        forward that a failure left open is dropped first."""
        if self._mode is not None:
            self.end(False)
        self._mode = "store" if store else "read"

    def arrive(self, layer: int, phase: int) -> None:
        """Decoder layer `layer` is called in `phase` (READ, CONV or RECURRENT; a full-attention layer's `update`
        is RECURRENT). Inside a context nothing happens; outside one, the call opens a context-free forward, or
        carries on the open one, or (a call the open one cannot make) drops it and opens a new one."""
        if self._mode is not None and not self._implicit:
            return
        if self._implicit and self._starts_anew(layer, phase):
            self.end(False)
        if self._mode is None:
            self.begin(store=True)
            self._implicit = True
        self._reached[layer] = max(phase, self._reached.get(layer, 0))

    def _starts_anew(self, layer: int, phase: int) -> bool:
        """Whether a call of `layer` in `phase` cannot belong to the open context-free forward: a later layer was
        reached already, or this layer wrote what comes after this call (or wrote it already)."""
        reached = self._reached.get(layer, 0)
        return any(other > layer for other in self._reached) or phase < reached or (phase == reached != READ)

    def leave(self, layer: int) -> None:
        """Decoder layer `layer` wrote its last state of a forward: the last decoder layer ends a context-free
        forward, which commits."""
        if self._implicit and layer == self.last_layer:
            self.end(True)

    def end(self, success: bool) -> None:
        """The context ends: a successful storing context that ran the layers commits (the working copy becomes
        the committed state, the previous one kept for `undo`); anything else is dropped."""
        mode, live = self._mode, self._live
        self._mode, self._live, self._implicit, self._reached = None, {}, False, {}
        if mode != "store" or not live:
            return
        if not success or len(live) != len(self.slot_of) or not all(state.done for state in live.values()):
            self._undo = None  # the working copy was written: the state before the last commit is gone
            if success:
                raise RuntimeError("linear states: a storing forward did not run every linear-attention layer")
            return
        self._undo = self.has_state
        self.committed, self.has_state = 1 - self.committed, True
        self.epoch += 1

    @property
    def can_undo(self) -> bool:
        """The last commit can still be undone (no storing context began since)."""
        return self._undo is not None

    def undo(self) -> None:
        """Put back the committed state from before the last commit (RuntimeError when it is gone)."""
        if self._undo is None:
            raise RuntimeError("linear states: nothing to undo")
        self.committed, self.has_state = 1 - self.committed, self._undo
        self._undo = None
        self.epoch -= 1

    def forget_undo(self) -> None:
        """The last commit can no longer be undone (an in-place step moved the keys past it)."""
        self._undo = None

    def _open(self, layer: int) -> _Live:
        """The layer's state in the running context, made at its first touch: the working copy (storing) or a
        clone (read-only), holding the committed state."""
        if self._mode is None:
            raise RuntimeError(f"linear states: layer {layer} ran outside a forward context")
        live = self._live.get(layer)
        if live is None:
            slot = self.slot_of[layer]
            conv, recurrent = self.conv[slot], self.recurrent[slot]
            if self._mode == "store":  # the working copy, which holds the state the last commit replaced
                work_conv, work_rec = conv[1 - self.committed], recurrent[1 - self.committed]
                if self.has_state:
                    work_conv.copy_(conv[self.committed])
                    work_rec.copy_(recurrent[self.committed])
            else:
                work_conv, work_rec = conv[self.committed].clone(), recurrent[self.committed].clone()
            live = self._live[layer] = _Live(work_conv, work_rec, fresh=not self.has_state)
        return live

    # ---- what the model's linear-attention layers call ------------------------------------------------------
    def get_conv_state(self, layer: int) -> torch.Tensor | None:
        self.arrive(layer, READ)
        live = self._open(layer)
        return None if live.fresh else live.conv

    def get_recurrent_state(self, layer: int) -> torch.Tensor | None:
        self.arrive(layer, READ)
        live = self._open(layer)
        return None if live.fresh else live.recurrent

    def update_conv_state(self, conv_states: torch.Tensor, layer: int, conv_kernel_size: int | None = None
                          ) -> torch.Tensor:
        """Keep the last K columns of [state, conv_states [B, C, T]] and return what the convolution reads: the
        previous K columns and the T new ones (just the new ones, left-padded to K, without a state), as
        transformers' `LinearAttentionLayer` does."""
        self.arrive(layer, CONV)
        live = self._open(layer)
        kernel = live.conv.shape[-1]
        if conv_kernel_size is not None and conv_kernel_size != kernel:
            raise ValueError(f"conv_kernel_size: layer {layer} keeps {kernel} columns, got {conv_kernel_size}")
        if live.fresh:
            full = conv_states
            if full.shape[-1] < kernel:
                full = torch.nn.functional.pad(full, (kernel - full.shape[-1], 0))
        else:
            full = torch.cat([live.conv, conv_states], dim=-1)
        live.conv.copy_(full[..., -kernel:])
        return full

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer: int) -> torch.Tensor:
        """Store the layer's new recurrent state [B, Hv, Dk, Dv] (its last call in a forward)."""
        self.arrive(layer, RECURRENT)
        live = self._open(layer)
        live.recurrent.copy_(recurrent_states)
        live.fresh, live.done = False, True
        self.leave(layer)
        return live.recurrent

    def contents(self) -> dict[str, torch.Tensor]:
        """The committed states, views with the stream axis first, by decoder layer i: "linear layer {i} conv
        state" [B, C, K] and "linear layer {i} recurrent state" fp32 [B, Hv, Dk, Dv]; empty while there is none."""
        if not self.has_state:
            return {}
        out = {}
        for layer, slot in self.slot_of.items():
            out[f"linear layer {layer} conv state"] = self.conv[slot][self.committed]
            out[f"linear layer {layer} recurrent state"] = self.recurrent[slot][self.committed]
        return out

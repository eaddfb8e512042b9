"""`hermes.linear_state` on its own: the layer kinds read from a config (defaults and refusals, from the config alone)
the layout's own checks, and `LinearStates` alone (commit, undo, read-only and failed contexts, a forward outside
any context) on synthetic states. The states' behaviour inside a stream is tested on Qwen3.5
(tests/hermes/models/test_qwen3_5_stream.py, the shared stream checks)."""
import types

import pytest
import torch
from transformers import Qwen2Config

from hermes.linear_state import FULL, LINEAR, RECURRENT, LinearLayout, LinearStates, layer_kinds
from scaffolding.models import tiny_qwen3_5


def test_a_config_without_layer_types_is_all_full_attention():
    config = Qwen2Config(num_hidden_layers=3, hidden_size=16, num_attention_heads=2, num_key_value_heads=1)
    config.layer_types = None
    assert layer_kinds(config) == (FULL,) * 3
    assert layer_kinds(types.SimpleNamespace(num_hidden_layers=2)) == (FULL,) * 2  # a text config, no layer_types


def test_the_text_config_of_a_vlm_says_which_layer_is_which():
    model = tiny_qwen3_5()
    kinds = layer_kinds(model.config)
    assert kinds == (LINEAR, FULL, FULL, LINEAR, FULL, LINEAR)
    layout = LinearLayout.of(model.model.language_model, kinds)
    assert layout.full_layers == (1, 2, 4) and layout.linear_layers == (0, 3, 5)
    gdn = model.model.language_model.layers[0].linear_attn
    assert layout.conv == ((gdn.conv_dim, gdn.conv_kernel_size),) * 3
    assert layout.recurrent == ((gdn.num_v_heads, gdn.head_k_dim, gdn.head_v_dim),) * 3


@pytest.mark.parametrize("kinds,match", [
    (["full_attention", "sliding_attention", "chunked_attention", "mamba"], r"'chunked_attention', 'mamba'"),
    (["linear_attention", "linear_attention"], "no full-attention layer"),
])
def test_kinds_the_caches_do_not_hold_are_refused_naming_them(kinds, match):
    config = Qwen2Config(num_hidden_layers=len(kinds), hidden_size=16, num_attention_heads=2, num_key_value_heads=1)
    config.layer_types = kinds
    with pytest.raises(ValueError, match=f"layer_types: .*{match}"):
        layer_kinds(config)


def test_a_layout_needs_the_state_of_every_linear_layer():
    kinds = (LINEAR, FULL, LINEAR)
    one = dict(conv=((8, 4),), recurrent=((2, 4, 4),), dtypes=(torch.float32,), devices=(torch.device("cpu"),))
    with pytest.raises(ValueError, match="linear: expected the state of each of the 2 linear-attention layers"):
        LinearLayout(kinds=kinds, **one)
    two = {name: value * 2 for name, value in one.items()}
    assert LinearLayout(kinds=kinds, **two).linear_layers == (0, 2)


# ---- LinearStates on its own: two linear layers (decoder 0 and 2) around a full one, 6 channels, kernel 4 ---------
CPU = torch.device("cpu")
LAYOUT = LinearLayout(kinds=(LINEAR, FULL, LINEAR), conv=((6, 4),) * 2, recurrent=((2, 2, 2),) * 2,
                      dtypes=(torch.float32,) * 2, devices=(CPU,) * 2)


def new_states(batch: int = 1) -> LinearStates:
    return LinearStates(LAYOUT, batch, lambda shape, dtype, device: torch.full(shape, -7.0, dtype=dtype,
                                                                               device=device))


def run_layers(states: LinearStates, value: float, tokens: int = 5, layers=(0, 2)) -> list:
    """What transformers' linear-attention layer does with the cache, per layer: read both states, hand in the
    convolution input [B, C, T] (getting back what the convolution reads), store the new recurrent state."""
    seen = []
    for layer in layers:
        # clones: the tensors read are the working copy, which the update then writes in place
        seen.append(tuple(None if t is None else t.clone()
                          for t in (states.get_conv_state(layer), states.get_recurrent_state(layer))))
        seen.append(states.update_conv_state(torch.full((1, 6, tokens), value), layer, conv_kernel_size=4))
        states.update_recurrent_state(torch.full((1, 2, 2, 2), value), layer)
    return seen


def committed(states: LinearStates) -> float | None:
    """The one value every committed state holds (None without a state)."""
    views = list(states.contents().values())
    if not views:
        return None
    values = torch.cat([view.flatten() for view in views]).unique()
    assert len(values) == 1, values
    return float(values[0])


def test_a_fresh_state_starts_from_zeros_and_pads_a_short_input():
    """No state (after reset): the layers read None, and an input shorter than the kernel comes back left-padded
    with zeros to K columns, which are what the state keeps (the buffers' poison never shows)."""
    states = new_states()
    states.begin(store=True)
    seen = run_layers(states, 2.0, tokens=2)
    assert seen[0] == (None, None)
    assert torch.equal(seen[1], torch.tensor([0.0, 0.0, 2.0, 2.0]).expand(1, 6, 4))
    states.end(True)
    conv = states.contents()["linear layer 0 conv state"]
    assert torch.equal(conv, torch.tensor([0.0, 0.0, 2.0, 2.0]).expand(1, 6, 4))


def test_a_commit_swaps_the_copies_and_one_undo_puts_the_last_back():
    states = new_states()
    assert committed(states) is None and not states.can_undo
    for value in (1.0, 2.0):
        states.begin(store=True)
        seen = run_layers(states, value)
        states.end(True)
    assert committed(states) == 2.0 and states.epoch == 2 and states.can_undo
    assert torch.equal(seen[0][0], torch.ones(1, 6, 4))  # the second context read the first one's state
    assert torch.equal(seen[1][..., :4], torch.ones(1, 6, 4)) and seen[1].shape[-1] == 4 + 5
    states.undo()
    assert committed(states) == 1.0 and states.epoch == 1 and not states.can_undo
    with pytest.raises(RuntimeError, match="nothing to undo"):
        states.undo()
    states.begin(store=True)
    run_layers(states, 3.0)
    states.end(True)
    states.undo()
    assert committed(states) == 1.0 and not states.can_undo


def test_the_first_commit_can_be_undone_back_to_no_state():
    states = new_states()
    states.begin(store=True)
    run_layers(states, 1.0)
    states.end(True)
    states.undo()
    assert committed(states) is None and states.epoch == 0


@pytest.mark.parametrize("how", ["raises", "one layer only", "a layer without its recurrent state"])
def test_a_storing_context_that_fails_commits_nothing_and_ends_the_undo(how):
    states = new_states()
    for value in (1.0, 2.0):
        states.begin(store=True)
        run_layers(states, value)
        states.end(True)
    states.begin(store=True)
    if how == "raises":
        run_layers(states, 3.0)
        states.end(False)
    else:
        if how == "one layer only":
            run_layers(states, 3.0, layers=(0,))
        else:
            states.get_conv_state(2)
            states.update_conv_state(torch.full((1, 6, 5), 3.0), 2)
            run_layers(states, 3.0, layers=(0,))
        with pytest.raises(RuntimeError, match="did not run every linear-attention layer"):
            states.end(True)
    assert committed(states) == 2.0 and states.epoch == 2
    assert not states.can_undo  # the working copy, which held the state before 2.0, was written


def test_a_read_only_context_moves_nothing():
    states = new_states()
    states.begin(store=True)
    run_layers(states, 1.0)
    states.end(True)
    for success in (True, False):
        states.begin(store=False)
        seen = run_layers(states, 5.0)
        assert torch.equal(seen[0][0], torch.ones(1, 6, 4))
        states.end(success)
        assert committed(states) == 1.0 and states.epoch == 1 and states.can_undo


def run_layer_in_order(states: LinearStates, layer: int, value: float, order: str) -> None:
    """One linear layer's calls in one forward, its two reads in `order` ("conv first" or "recurrent first": which
    one transformers makes first changed between releases), then its two writes in the order their data imposes."""
    reads = [states.get_conv_state, states.get_recurrent_state]
    for read in reads if order == "conv first" else reads[::-1]:
        read(layer)
    states.update_conv_state(torch.full((1, 6, 5), value), layer, conv_kernel_size=4)
    states.update_recurrent_state(torch.full((1, 2, 2, 2), value), layer)


def run_forward(states: LinearStates, value: float, order: str, layers=(0, 1, 2)) -> None:
    """A forward outside any context over `layers` of LAYOUT (linear, full, linear): the full layer's one call is
    the cache's `update`, which brackets its write with `arrive` / `leave`."""
    for layer in layers:
        if layer == 1:
            states.arrive(1, RECURRENT)
            states.leave(1)
        else:
            run_layer_in_order(states, layer, value, order)


@pytest.mark.parametrize("order", ["conv first", "recurrent first"])
def test_a_forward_outside_any_context_opens_at_any_first_call_and_commits_at_its_end(order):
    """A forward run outside any context is a storing context of its own, opened by its first call of a layer
    whichever method that is, and committed once the last decoder layer wrote its recurrent state."""
    states = new_states()
    run_forward(states, 4.0, order, layers=(0, 1))
    assert committed(states) is None  # the last layer has not run
    run_forward(states, 4.0, order, layers=(2,))
    assert committed(states) == 4.0 and states.epoch == 1 and states.can_undo
    run_forward(states, 6.0, order)
    assert committed(states) == 6.0 and states.epoch == 2
    states.undo()
    assert committed(states) == 4.0
    states.reset()
    assert committed(states) is None and states.epoch == 0 and not states.can_undo
    run_forward(states, 8.0, order)
    assert committed(states) == 8.0


@pytest.mark.parametrize("order", ["conv first", "recurrent first"])
@pytest.mark.parametrize("failed_after", ["a read of layer 0", "the convolution of layer 0", "layer 0",
                                          "the full layer"])
def test_a_forward_that_failed_is_dropped_by_the_next_one(order, failed_after):
    """A forward outside any context that failed midway leaves its context open; the next forward's first call
    cannot belong to it (an earlier layer, or a layer called again after its write), so it drops what the failed
    one wrote and starts again from the committed state, whichever read it makes first."""
    states = new_states()
    run_forward(states, 4.0, order)
    if failed_after == "a read of layer 0":
        states.get_recurrent_state(0)
    elif failed_after == "the convolution of layer 0":
        states.get_conv_state(0)
        states.update_conv_state(torch.full((1, 6, 5), 6.0), 0, conv_kernel_size=4)
    else:
        run_forward(states, 6.0, order, layers=(0,) if failed_after == "layer 0" else (0, 1))
    first = (states.get_conv_state if order == "conv first" else states.get_recurrent_state)(0)
    assert torch.equal(first, torch.full_like(first, 4.0))  # the committed state, not the failed forward's
    run_forward(states, 7.0, order)
    assert committed(states) == 7.0 and states.epoch == 2
    states.undo()
    assert committed(states) == 4.0


def test_a_context_drops_a_forward_that_failed_outside_one():
    """A forward context that begins while a failed context-free forward is open drops it: what it wrote is not
    committed, and the last commit can no longer be undone (the failed forward wrote its copy)."""
    states = new_states()
    run_forward(states, 4.0, "conv first")
    run_forward(states, 6.0, "conv first", layers=(0,))
    states.begin(store=False)
    assert torch.equal(states.get_conv_state(0), torch.full((1, 6, 4), 4.0))
    states.end(True)
    assert committed(states) == 4.0 and not states.can_undo


def test_forget_undo_and_a_kernel_mismatch():
    states = new_states()
    states.begin(store=True)
    run_layers(states, 1.0)
    states.end(True)
    states.forget_undo()
    assert not states.can_undo
    states.begin(store=True)
    with pytest.raises(ValueError, match="conv_kernel_size: layer 0 keeps 4 columns, got 3"):
        states.update_conv_state(torch.zeros(1, 6, 5), 0, conv_kernel_size=3)


def test_two_copies_and_forwards_of_one_context_follow_each_other():
    """Each state is held twice ([2, B, ...]: committed and working); inside one storing context (a question and
    its decode steps) each forward reads the state the one before stored, and only the context's end commits, not
    the end of a forward of it."""
    states = new_states(batch=3)
    assert [tuple(t.shape) for t in states.conv + states.recurrent] == [(2, 3, 6, 4)] * 2 + [(2, 3, 2, 2, 2)] * 2
    states = new_states()
    states.begin(store=True)
    run_layers(states, 1.0)  # the last layer's write inside a context is not a context-free forward's end
    assert committed(states) is None
    seen = run_layers(states, 2.0)
    assert torch.equal(seen[0][1], torch.ones(1, 2, 2, 2))
    states.end(True)
    assert committed(states) == 2.0 and states.epoch == 1

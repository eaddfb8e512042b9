"""The contracts the in-place HERMES kernels rely on, enforced before anything is written (docs/gpu.md#contracts):
keep ascending, distinct and in range (read where it is free: CPU tensors, or CUDA with HERMES_KERNELS_DEBUG=1),
caches whose elements do not overlap, and outputs that share no memory with inputs (strides only, no sync). Every
refusal names the argument and leaves every tensor as it was, on every backend."""
import types

import pytest
import torch

import hermes_kernels as hk
from hermes_kernels.engine.checks import DEBUG_ENV, read_contents
from hermes_kernels.policies.hermes import reference as ref
from hermes_kernels.policies.hermes import scoring, select
from tests.hermes_kernels.policies.hermes.test_compaction import F32, Case, make_cache, make_config
from tests.utils import DEVICE, TORCH_OPS, distinct_attention, inv_freq_for, same_bytes

BACKENDS = ["torch", TORCH_OPS, "triton", "reference"]
CASE = Case("qwen2_5_vl", 4, 2, 2, 16, 2, 12, 6, F32, (2, 3, 3), "eager", True, "contiguous")


@pytest.fixture
def debug_contents(monkeypatch):
    """Contents checks on every device: on CUDA this is what the flag is for; on the CPU they run anyway."""
    monkeypatch.setenv(DEBUG_ENV, "1")


def setup(seed: int = 5):
    cfg = make_config(CASE)[0]
    g = torch.Generator().manual_seed(seed)
    keys, values, positions, _ = make_cache(CASE, g)
    keep = ref.select_keep(ref.hermes_scores(distinct_attention(CASE.L, CASE.B, CASE.V, g), cfg), cfg).to(DEVICE)
    return cfg, keys, values, positions, keep, inv_freq_for(CASE.D, device=DEVICE)


def compact(backend, *args):
    if backend == "reference":
        return ref.compact(*args)
    return hk.compact(*args, backend=backend)


def refused(backend, error: str, keys, values, positions, keep, cfg, inv_freq, watched=()) -> None:
    """compact raises ValueError matching `error`, and keys, values, positions, keep (and `watched`) keep their
    bytes."""
    tensors = (keys, values, positions, keep, *watched)
    before = [t.clone() for t in tensors]
    with pytest.raises(ValueError, match=error):
        compact(backend, keys, values, positions, keep, cfg, inv_freq, CASE.section)
    for old, new in zip(before, tensors):
        assert same_bytes(old, new), "a refused call wrote"


def with_entry(keep: torch.Tensor, layer: int, column: int, value) -> torch.Tensor:
    keep = keep.clone()
    keep[layer, 1, column] = value
    return keep


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.usefixtures("debug_contents")
@pytest.mark.parametrize("bad", ["repeated", "descending", "past V", "negative", "-1 kept", "padding"])
def test_keep_out_of_contract_is_refused_without_writing(bad, backend):
    cfg, keys, values, positions, keep, inv_freq = setup()
    deep = CASE.L - 1  # keeps n - 1 with summary on: its last column is padding
    n = keep.shape[-1]
    keep = {"repeated": with_entry(keep, 0, 2, keep[0, 1, 1]),
            "descending": with_entry(with_entry(keep, 0, 1, keep[0, 1, 2]), 0, 2, keep[0, 1, 1]),
            "past V": with_entry(keep, 0, n - 1, CASE.V),
            "negative": with_entry(keep, 0, 0, -2),
            "-1 kept": with_entry(keep, 0, 0, -1),
            "padding": with_entry(keep, deep, n - 1, CASE.V - 1)}[bad]
    error = "strictly increasing" if bad in ("repeated", "descending") else r"column \d+ holds"
    refused(backend, f"^keep: row .*{error}", keys, values, positions, keep, cfg, inv_freq)


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_overlapping_or_aliased_caches_are_refused_without_writing(backend):
    cfg, keys, values, positions, keep, inv_freq = setup()
    one_stream = keys[:, :1]
    expanded = one_stream.expand_as(keys)  # a broadcast cache: two streams' programs would write one row
    refused(backend, r"^keys: elements overlap", expanded, values, positions, keep, cfg, inv_freq, (one_stream,))
    rows = values.flatten()[:values[..., :1, :].numel()]
    overlapping = rows.as_strided(values.shape, values.stride()[:3] + (0, 1))  # every token one row
    refused(backend, r"^values: elements overlap", keys, overlapping, positions, keep, cfg, inv_freq, (values,))
    refused(backend, r"^values: shares memory with keys", keys, keys, positions, keep, cfg, inv_freq)
    # positions written in place over the keys' memory (an int64 view of them)
    as_positions = keys.flatten()[:2 * positions.numel()].view(torch.int64).view(positions.shape)
    refused(backend, r"^positions: shares memory with keys", keys, values, as_positions, keep, cfg, inv_freq)
    # keep read while positions are rewritten: a view into them
    inside = torch.zeros(positions.numel() + keep.numel(), dtype=torch.int64, device=DEVICE)
    inside[-keep.numel():] = keep.flatten()
    shared_positions = inside[:positions.numel()].view(positions.shape).copy_(positions)
    shared_keep = inside[positions.numel() - 1:-1].view(keep.shape)
    refused(backend, r"^keep: shares memory with positions", keys, values, shared_positions, shared_keep, cfg,
            inv_freq)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_stacks_sharing_memory_are_refused_without_writing(backend):
    cfg, keys, values, positions, keep, inv_freq = setup()
    attn = distinct_attention(CASE.L, CASE.B, CASE.V, torch.Generator().manual_seed(3), device=DEVICE)
    stacks = [(range(0, 2), keys[:2], values[:2], positions[:2], inv_freq),
              (range(2, 4), keys[1:3], values[2:], positions[2:], inv_freq)]  # layer 1's keys in both stacks
    before = [t.clone() for t in (keys, values, positions, attn)]
    with pytest.raises(ValueError, match=r"^stacks\[1\]: keys: shares memory with stacks\[0\]'s keys"):
        hk.compress_stacks(stacks, attn, cfg, CASE.section, backend=backend)
    for old, new in zip(before, (keys, values, positions, attn)):
        assert same_bytes(old, new)


@pytest.mark.parametrize("impl", [scoring.hermes_scores_torch, scoring.hermes_scores_triton], ids=["torch", "triton"])
def test_a_scores_output_over_its_attention_is_refused(impl):
    cfg = make_config(CASE)[0]
    attn = distinct_attention(CASE.L, CASE.B, CASE.V, torch.Generator().manual_seed(4), device=DEVICE)
    before = attn.clone()
    with pytest.raises(ValueError, match="^out: shares memory with attn"):
        impl(attn, cfg, out=attn)
    with pytest.raises(ValueError, match="^out: elements overlap"):
        impl(attn, cfg, out=torch.zeros(CASE.V, device=DEVICE).expand_as(attn))
    assert same_bytes(before, attn)


@pytest.mark.parametrize("impl", [select.select_keep_torch, select.select_keep_triton], ids=["torch", "triton"])
def test_a_destination_map_over_its_scores_is_refused(impl):
    cfg = make_config(CASE)[0]
    scores = distinct_attention(CASE.L, CASE.B, CASE.V, torch.Generator().manual_seed(6), device=DEVICE)
    before = scores.clone()
    with pytest.raises(ValueError, match="^dest_out: shares memory with scores"):
        impl(scores, cfg, with_destination=True, dest_out=scores.view(torch.int32))
    assert same_bytes(before, scores)


def test_contents_are_read_on_cpu_and_elsewhere_only_with_the_debug_flag(monkeypatch):
    """On a GPU a contents check is a host sync: off unless HERMES_KERNELS_DEBUG=1 (a meta tensor, like a CUDA
    one, is not on the CPU; it has no values, so it is never read)."""
    cpu, elsewhere = torch.zeros(2), types.SimpleNamespace(device=torch.device("cuda", 0))  # what is read of it
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    assert read_contents(None, cpu) and not read_contents(None, elsewhere)
    assert read_contents(True, elsewhere) and not read_contents(False, cpu)
    monkeypatch.setenv(DEBUG_ENV, "1")
    assert read_contents(None, elsewhere) and not read_contents(None, torch.zeros(2, device="meta"))
    monkeypatch.setenv(DEBUG_ENV, "0")
    assert not read_contents(None, elsewhere)

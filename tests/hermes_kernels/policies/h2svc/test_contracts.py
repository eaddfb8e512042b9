"""The memory contract of the in-place H2SVC step (docs/gpu.md#contracts): the tensors it rewrites (keys, values,
positions, slot_frames and an episodic block's features) must not overlap themselves or share memory with each
other or with inv_freq. Checked by strides alone, so on CUDA too; every refusal names the argument and leaves the
block as it was, on every backend and in the reference."""
import pytest

import hermes_kernels as hk
from hermes_kernels.policies.h2svc import reference as ref
from hermes_kernels.policies.h2svc.config import EPISODIC
from tests.hermes_kernels.policies.h2svc.test_step import F32, Case, config, make_block, step_args
from tests.utils import TORCH_OPS, same_bytes

BACKENDS = ["torch", TORCH_OPS, "triton", "reference"]


def aliased(block, args, kwargs, bad: str):
    """The step's arguments with one contract broken, and the tensors that must stay as they were."""
    keys, values, positions, slot_frames, cfg, cls, inv_freq, section = args
    features = kwargs["features"]
    watched = block.tensors()
    if bad == "keys expanded":  # a broadcast block: two streams' programs would write one row
        one_stream = keys[:, :1]
        keys, watched = one_stream.expand_as(keys), [*watched, one_stream]
    elif bad == "values are keys":
        values = keys
    elif bad == "slot_frames in positions":  # an int64 view of the positions' memory
        slot_frames = positions.flatten()[:slot_frames.numel()].view(slot_frames.shape)
    elif bad == "features expanded":  # every home slot one feature row
        features = features[:, :, :1].expand_as(features)
    elif bad == "inv_freq in keys":  # read while the keys are rotated in place
        inv_freq = keys.flatten()[:inv_freq.numel()]
    return (keys, values, positions, slot_frames, cfg, cls, inv_freq, section), {**kwargs, "features": features}, \
        watched


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("bad, error", [("keys expanded", "keys: elements overlap"),
                                        ("values are keys", "values: shares memory with keys"),
                                        ("slot_frames in positions", "slot_frames: shares memory with positions"),
                                        ("features expanded", "features: elements overlap"),
                                        ("inv_freq in keys", "keys: shares memory with inv_freq")])
def test_overlapping_or_aliased_blocks_are_refused_without_writing(bad, error, backend):
    cfg = config()
    case = Case(EPISODIC, 4, 2, "1d", True, F32, "contiguous")
    block = make_block(cfg, case, seed=7)
    args, kwargs, watched = aliased(block, *step_args(cfg, case, block), bad)
    before = [t.clone() for t in watched]
    with pytest.raises(ValueError, match=f"^{error}"):
        if backend == "reference":
            ref.h2svc_step(*args, **kwargs)
        else:
            hk.h2svc_step(*args, **kwargs, backend=backend)
    for old, new in zip(before, watched):
        assert same_bytes(old, new), "a refused step wrote"

"""The one launch point (hermes_kernels/engine/launch.py): a launch runs on its tensors' device, refuses tensors on two
devices, and sets FMA contraction explicitly. The CUDA calls are mocked: no GPU is needed (docs/gpu.md)."""
import types

import pytest
import torch

from hermes_kernels.engine import launch as launch_module
from hermes_kernels.engine.launch import launch, launch_count, recording


class _CurrentDevice:
    """A stand-in for `torch.cuda.device`: entering makes a device current, leaving restores the previous one."""

    current = [torch.device("cuda", 0)]

    def __init__(self, device):
        self.device = torch.device(device)

    def __enter__(self):
        self.current.append(self.device)

    def __exit__(self, *exc):
        self.current.pop()


class _Kernel:
    """A kernel stand-in: `kernel[grid](*args, **meta)` records the grid, its arguments and the device current
    while it runs."""

    arg_names = ["k_ptr", "v_ptr", "n", "out_ptr"]

    def __init__(self):
        self.calls = []
        self.fn = types.SimpleNamespace(__name__="_fake_kernel")

    def __getitem__(self, grid):
        def run(*args, **meta):
            self.calls.append((grid, args, meta, _CurrentDevice.current[-1]))
        return run


def _on(device: str):
    """A CUDA-typed argument: what Triton reads of a tensor (a device and a data pointer), without memory."""
    return types.SimpleNamespace(device=torch.device(device), data_ptr=lambda: 0)


@pytest.fixture
def mocked_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device", _CurrentDevice)
    monkeypatch.setattr(_CurrentDevice, "current", [torch.device("cuda", 0)])
    return _CurrentDevice


def test_a_launch_runs_on_its_tensors_device_not_the_current_one(mocked_cuda):
    kernel = _Kernel()
    before = launch_count()
    launch(kernel, (3, 1), _on("cuda:1"), _on("cuda:1"), 7, _on("cuda:1"), BLOCK=16)
    assert launch_count() == before + 1
    [(grid, args, meta, current)] = kernel.calls
    assert current == torch.device("cuda", 1), "the kernel ran with another device current than its tensors'"
    assert mocked_cuda.current == [torch.device("cuda", 0)], "the caller's current device was not restored"
    assert grid == (3, 1) and args[2] == 7
    assert meta == {"BLOCK": 16, "enable_fp_fusion": launch_module.FP_FUSION}


def test_a_launch_on_cpu_tensors_makes_no_cuda_call(monkeypatch):
    def no_cuda(device):
        raise AssertionError(f"torch.cuda.device({device}) called for CPU tensors")

    monkeypatch.setattr(torch.cuda, "device", no_cuda)
    kernel = _Kernel()
    launch(kernel, (1,), torch.zeros(2), torch.zeros(2), 1, torch.zeros(2))
    assert len(kernel.calls) == 1


def test_tensors_on_two_devices_are_refused_by_name_before_anything_runs(mocked_cuda):
    kernel = _Kernel()
    before = launch_count()
    with pytest.raises(ValueError, match=r"^out_ptr: on cuda:1 but k_ptr is on cuda:0; _fake_kernel"):
        launch(kernel, (1,), _on("cuda:0"), _on("cuda:0"), 4, _on("cuda:1"))
    with pytest.raises(ValueError, match=r"^v_ptr: on cpu but k_ptr is on cuda:0"):
        launch(kernel, (1,), _on("cuda:0"), torch.zeros(1), 4, _on("cuda:0"))
    with pytest.raises(ValueError, match=r"^scratch: on cuda:2 but k_ptr is on cuda:0"):
        launch(kernel, (1,), _on("cuda:0"), _on("cuda:0"), 4, _on("cuda:0"), scratch=_on("cuda:2"))
    with recording() as launches:
        with pytest.raises(ValueError, match="out_ptr: on cuda:1"):
            launch(kernel, (1,), _on("cuda:0"), _on("cuda:0"), 4, _on("cuda:1"))
    assert kernel.calls == [] and launches == [] and launch_count() == before


def test_a_recorded_launch_names_the_device_it_would_run_on(mocked_cuda):
    kernel = _Kernel()
    with recording() as launches:
        launch(kernel, (2,), _on("cuda:3"), _on("cuda:3"), 5, _on("cuda:3"), BLOCK=8)
        launch(kernel, (2,), torch.empty(1, device="meta"), torch.empty(1, device="meta"), 5, None)
    assert kernel.calls == []
    assert [item.device for item in launches] == [torch.device("cuda", 3), None]
    assert launches[0].meta == {"BLOCK": 8, "enable_fp_fusion": launch_module.FP_FUSION}


# The multi-device paths, with the CPU and the meta device as the two devices (no GPU here): every launch of a
# cache split over devices carries the tensors of one device only, so on CUDA the guard above runs each on its own
# device and stream. Recorded, not run: the meta stack holds no data.

def _tensor_devices(item) -> set[torch.device]:
    return {a.device for a in (*item.args, *item.meta.values()) if isinstance(a, torch.Tensor)}


def test_a_cache_split_over_two_devices_launches_each_stack_on_its_own():
    """compress_stacks: selection on attn's device, then each stack's three compaction launches on its device,
    keep rows, flag, budgets, axis map and inv_freq moved there (a launcher that forgets one is refused)."""
    import hermes_kernels as hk

    L, B, Hkv, P, V, D = 4, 2, 2, 3, 30, 16
    N = P + V
    cfg = hk.HermesConfig.qwen2_5_vl(L, 12, P, reindex="eager")
    stacks = []
    for layers, device in ((range(0, 1), "cpu"), (range(1, 4), "meta")):
        keys = torch.zeros(len(layers), B, Hkv, N, D, device=device)
        positions = torch.arange(N, device=device).repeat(len(layers), B, 3, 1)
        stacks.append((layers, keys, torch.zeros_like(keys), positions, torch.ones(D // 2)))  # inv_freq on the CPU
    attn = torch.rand(L, B, V)
    with recording() as launches:
        hk.compress_stacks(stacks, attn, cfg, [2, 3, 3], backend="triton")
    names = [item.kernel.fn.__name__ for item in launches]
    assert names == ["_hermes_scores_kernel", "_select_keep_kernel"] + ["_rank_kernel", "_plan_kernel",
                                                                         "_move_kernel"] * 2
    devices = [_tensor_devices(item) for item in launches]
    assert devices == [{torch.device("cpu")}] * 5 + [{torch.device("meta")}] * 3


def test_an_h2svc_block_launches_on_its_own_device_wherever_inv_freq_is():
    """h2svc_step of an episodic block (features, STCE, move) on one device, its rotary frequencies on another
    (a model whose rotary module sits on the first GPU): every launch carries the block's device only."""
    import hermes_kernels as hk
    from hermes_kernels.policies.h2svc.config import EPISODIC
    from hermes_kernels.engine.geometry import ModelGeometry
    from hermes_kernels.policies.h2svc.gpu_case import H2SVCCase

    cfg = hk.H2SVCConfig.llava_ov(num_layers=2, num_kv_heads=2, prefix_len=3)
    geometry = ModelGeometry(num_layers=2, num_heads=2, num_kv_heads=2, head_dim=16, max_positions=4096,
                             rope_theta=1e4)
    case = H2SVCCase(label="two devices", geometry=geometry, dtype=torch.float16, cfg=cfg, chunk_frames=2,
                     reindexing=True)
    block = case.block(EPISODIC)
    with recording() as launches:
        hk.h2svc_step(block.keys, block.values, block.positions, block.slot_frames, cfg, EPISODIC, torch.ones(8),
                      clock=case.clock(EPISODIC), features=block.features, backend="triton")
    assert [item.kernel.fn.__name__ for item in launches] == ["_frame_features_kernel", "_stce_kernel",
                                                              "_frame_move_kernel"]
    assert all(_tensor_devices(item) == {torch.device("meta")} for item in launches)

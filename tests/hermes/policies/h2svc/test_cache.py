"""H2SVCCache without a model (docs/h2svc.md §4–5): the layout of the class blocks (per class and device, rows of a
layer contiguous, capacity formula), the frame-window mask against a brute-force reading of §3, what forwards
may do in which state, and argument checks that leave the buffers as they were."""
import pytest
import torch

import hermes_kernels as hk

from hermes_kernels.policies.h2svc.config import EPISODIC, INSTANT, SHORT, H2SVCConfig
from hermes.policies.h2svc.attention import frame_window_mask
from hermes.policies.h2svc.cache import H2SVCCache
from hermes_kernels.rope import RotaryLayout
from tests.hermes.policies.h2svc.checks import h2svc_step_fails
from tests.utils import DEVICE
from tests.utils import INTERLEAVED, inv_freq_for, same_bytes

MAP = [[INSTANT, EPISODIC, SHORT], [SHORT, SHORT, EPISODIC], [EPISODIC, INSTANT, EPISODIC], [SHORT, EPISODIC, SHORT]]
P, T_F, D = 3, 4, 8


def make_cache(layer_devices=None, stack_bounds=(), batch_size=2, **overrides):
    cfg = H2SVCConfig(num_layers=4, num_kv_heads=3, prefix_len=P, tokens_per_frame=T_F, head_map=MAP,
                      instant_frames=2, short_frames=3, episodic_frames=4, max_positions=512, margin=64, **overrides)
    return H2SVCCache(cfg, batch_size=batch_size, num_heads=6, head_dim=D, chunk_frames=2, room=5,
                      dtype=torch.float32, inv_freq=inv_freq_for(D), layer_devices=layer_devices,
                      stack_bounds=stack_bounds)


def test_blocks_per_class_and_device_with_contiguous_layer_rows():
    """Layers 0-1 on cpu, 2-3 on meta: one block per class and device; a block's rows are the class's rows of its
    layers in (layer, head) order, so each layer's class heads are one slice; shapes follow the capacity
    formula P + (W_c + F_max)·T_f + room."""
    cache = make_cache(layer_devices=["cpu", "cpu", "meta", "meta"])
    cfg = cache.cfg
    layout = [(b.device.type, b.cls, b.layers, b.rows) for b in cache.blocks]
    assert layout == [("cpu", INSTANT, range(0, 2), range(0, 1)), ("cpu", SHORT, range(0, 2), range(0, 3)),
                      ("cpu", EPISODIC, range(0, 2), range(0, 2)), ("meta", INSTANT, range(2, 4), range(1, 2)),
                      ("meta", SHORT, range(2, 4), range(3, 5)), ("meta", EPISODIC, range(2, 4), range(2, 5))]
    for block in cache.blocks:
        W = cfg.window(block.cls)
        capacity = P + (W + 2) * T_F + 5
        n = len(block.rows)
        assert block.keys.shape == block.values.shape == (n, 2, capacity, D)
        assert block.positions.shape == (n, 2, capacity) and block.slot_frames.shape == (n, 2, W)
        assert (block.features is None) == (block.cls != EPISODIC)
        if block.features is not None:
            assert block.features.shape == (n, 2, W, D) and block.features.dtype == torch.float32


def test_layer_parts_slice_or_gather_a_layers_heads():
    """Every layer's class part: its rows of the block are the class's rows of that layer, its KV heads are
    `heads_of`, its query heads their GQA groups (a slice when contiguous, an index tensor otherwise)."""
    cache = make_cache(stack_bounds=[2])
    cfg = cache.cfg
    for layer in range(4):
        for part in cache.layer_parts(layer):
            rows = cfg.layer_rows(part.cls, layer)
            assert range(part.block.rows.start + part.rows.start, part.block.rows.start + part.rows.stop) == rows
            heads = cfg.heads_of(part.cls, layer)
            kv = part.kv_heads if isinstance(part.kv_heads, torch.Tensor) else torch.arange(3)[part.kv_heads]
            assert kv.tolist() == heads
            query = part.query_heads if isinstance(part.query_heads, torch.Tensor) else \
                torch.arange(6)[part.query_heads]
            assert query.tolist() == [2 * h + j for h in heads for j in range(2)]
    # layer 1: SHORT heads 0, 1 are a slice; layer 2: EPISODIC heads 0 and 2 are gathered by index
    assert cache.layer_parts(1)[0].kv_heads == slice(0, 2)
    assert cache.layer_parts(2)[1].query_heads.tolist() == [0, 1, 4, 5]


def test_frame_window_mask_is_the_window_rule():
    """Held frames in ring order (slot 0 holds the newest), a 3-frame chunk: query frame i sees the prefix and
    frames i − W + 1 … i, the chunk causally by token."""
    held = torch.tensor([11, 9, 10])  # frames 9, 10, 11 in slots 1, 2, 0
    first, F, W = 12, 3, 3
    mask = frame_window_mask(held, P, T_F, first, F, W)[0, 0]
    key_frames = [None] * P + [f for f in held.tolist() for _ in range(T_F)] + \
        [first + i for i in range(F) for _ in range(T_F)]
    N = len(key_frames)
    assert mask.shape == (F * T_F, N)
    for t in range(F * T_F):
        frame, slot = first + t // T_F, P + 3 * T_F + t
        for k in range(N):
            visible = key_frames[k] is None or (frame - W < key_frames[k] <= frame and k <= slot)
            assert bool(mask[t, k]) == visible, (t, k)


def feed(cache, count, g, **context):
    with cache.forward_context(**context):
        for layer in range(cache.num_layers):
            k = torch.randn(cache.batch_size, 3, count, D, generator=g)
            cache.update(k, torch.randn_like(k), layer)


def test_forwards_in_order_and_failed_calls_leave_the_buffers():
    """The first forward is the P-token prefix; a chunk needs the prefix and no text after the video, and its frames
    await step() before any other forward; only text can be truncated; bad step arguments raise before any
    write."""
    g = torch.Generator().manual_seed(0)
    cache = make_cache()
    with pytest.raises(ValueError, match="prefix"):
        feed(cache, P + 1, g)
    with pytest.raises(ValueError, match="prefix must be stored"):
        feed(cache, T_F, g, rel_positions=torch.arange(T_F), frames=1, extent=T_F - 1)
    # the prefix goes whole at 0 .. P-1: given offsets, or keeping only part of it, is refused before a write
    before = [t.clone() for block in cache.blocks for t in block.buffers()]
    for context in (dict(rel_positions=torch.arange(P)), dict(keep=P - 1)):
        with pytest.raises(ValueError, match="the prefix is stored whole"):
            feed(cache, P, g, **context)
        assert cache.length == 0
        assert all(same_bytes(t, u) for t, u in zip((t for b in cache.blocks for t in b.buffers()), before))
    feed(cache, P, g)
    assert (cache.length, cache.next_position) == (P, P)
    with pytest.raises(ValueError, match="frames: expected"):
        feed(cache, 3 * T_F, g, frames=3, extent=3 * T_F - 1)
    with pytest.raises(ValueError, match="no chunk awaits"):
        cache.step()
    feed(cache, 2 * T_F, g, frames=2, extent=2 * T_F - 1)
    assert cache.length == P + 2 * T_F and cache.class_length(INSTANT) == P + 2 * T_F
    with pytest.raises(RuntimeError, match="await"):
        feed(cache, 2, g)
    before = [t.clone() for block in cache.blocks for t in block.buffers()]
    with pytest.raises(ValueError, match="backend"):
        cache.step(backend="cuda")
    assert all(same_bytes(t, u) for t, u in zip((t for b in cache.blocks for t in b.buffers()), before))
    result = cache.step()
    assert (result.first_frame, result.num_frames, bool(result.reindexed)) == (0, 2, False)
    assert cache.held == {"instant": 2, "short": 2, "episodic": 2} and cache.next_position == P + 2 * T_F
    feed(cache, 3, g)  # a question
    assert cache.length == P + 2 * T_F + 3 and cache.room() == min(
        P + (W + 2) * T_F + 5 - (P + 2 * T_F + 3) for W in (2, 3, 4))
    with pytest.raises(ValueError, match="text after the video"):
        cache.truncate(P + 2 * T_F - 1)
    cache.truncate(P + 2 * T_F)
    with pytest.raises(ValueError, match="do not fit"):
        feed(cache, cache.room() + 1, g)


def test_text_fills_the_fullest_class_exactly_to_its_capacity():
    """After a chunk, text may take exactly the room left in the fullest class (room 0 afterwards); one token more
    is refused before writing."""
    g = torch.Generator().manual_seed(4)
    cache = make_cache()
    feed(cache, P, g)
    feed(cache, 2 * T_F, g, frames=2, extent=2 * T_F - 1)
    cache.step()
    room = cache.room()
    feed(cache, room - 1, g)
    feed(cache, 1, g)
    assert cache.room() == 0
    before = [t.clone() for block in cache.blocks for t in block.buffers()]
    with pytest.raises(ValueError, match="do not fit"):
        feed(cache, 1, g)
    assert all(same_bytes(t, u) for t, u in zip((t for b in cache.blocks for t in b.buffers()), before))


def test_a_failed_step_leaves_the_cache_refusing_forwards_and_steps(monkeypatch):
    """An exception inside the step after its first class block was rewritten leaves the cache `undefined`: the
    cache itself (not only the stream in front of it) refuses the next forward's first `update` and the next step
    until reset(), which empties it in the same buffers."""
    g = torch.Generator().manual_seed(3)
    cache = make_cache()
    feed(cache, P, g)
    feed(cache, 2 * T_F, g, frames=2, extent=2 * T_F - 1)
    cache.step()
    feed(cache, 2 * T_F, g, frames=2, extent=2 * T_F - 1)
    with h2svc_step_fails(monkeypatch), pytest.raises(torch.OutOfMemoryError, match="injected"):
        cache.step()
    assert cache.undefined
    with pytest.raises(RuntimeError, match="undefined; call reset"):
        feed(cache, 3, g)
    with pytest.raises(RuntimeError, match="undefined; call reset"):
        cache.step()
    ptrs = cache.data_ptrs()
    cache.reset()
    assert not cache.undefined and cache.length == 0 and cache.data_ptrs() == ptrs
    feed(cache, P, g)
    feed(cache, 2 * T_F, g, frames=2, extent=2 * T_F - 1)
    assert cache.step().num_frames == 2


def test_bad_construction_arguments():
    cfg = make_cache().cfg
    args = dict(batch_size=1, num_heads=6, head_dim=D, chunk_frames=2, room=5, dtype=torch.float32,
                inv_freq=inv_freq_for(D))
    for change, error, match in (({"num_heads": 4}, ValueError, "num_heads"), ({"chunk_frames": 0}, ValueError,
                                 "chunk_frames"), ({"room": 0}, ValueError, "room"), ({"head_dim": 7}, ValueError,
                                 "head_dim"), ({"dtype": torch.int32}, TypeError, "dtype"),
                                 ({"layer_devices": ["cpu"]}, ValueError, "layer_devices")):
        with pytest.raises(error, match=match):
            H2SVCCache(cfg, **{**args, **change})
    with pytest.raises(TypeError, match="cfg"):
        H2SVCCache(None, **args)


def drive(device: str, dtype: torch.dtype, section, backend: str, check_syncs: bool) -> list[torch.Tensor]:
    """A cache on `device` driven the way a model drives it: the prefix, three 2-frame chunks (each layer's update
    then its per-class attention, then the step: FIFO windows cut through the chunks, STCE evicts, eager
    re-indexing rotates every retained key) and a read-only question. Inputs are drawn on the device first; with
    `check_syncs` the whole run is under torch's CUDA sync debug mode "error". `section`: the cache's
    rotary (None: 1D). Returns the attention outputs."""
    from types import SimpleNamespace

    torch.manual_seed(0)
    cfg = H2SVCConfig(num_layers=4, num_kv_heads=3, prefix_len=P, tokens_per_frame=T_F, head_map=MAP,
                      instant_frames=1, short_frames=2, episodic_frames=3, max_positions=512, margin=64,
                      reindex="eager")
    cache = H2SVCCache(cfg, batch_size=2, num_heads=6, head_dim=D, chunk_frames=2, room=5, dtype=dtype,
                       inv_freq=inv_freq_for(D, device=device), rotary=section)
    mrope = section is not None
    module = SimpleNamespace(num_key_value_groups=2, is_causal=True, training=False)
    rel = torch.arange(2 * T_F, device=device)
    rel = torch.stack([rel // T_F, rel % 2, rel % T_F // 2]) if mrope else rel
    plan = [(P, {})] + [(2 * T_F, dict(rel_positions=rel, frames=2, extent=int(rel.max())))] * 3 + \
        [(3, dict(read_only=True))]
    inputs = [[[torch.randn(2, heads, count, D, device=device, dtype=dtype) for heads in (3, 3, 6)]
               for _ in range(4)] for count, _ in plan]
    outputs = []
    if check_syncs:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        for (count, context), layers in zip(plan, inputs):
            with cache.forward_context(**context):
                for layer, (k, v, q) in enumerate(layers):
                    key, value = cache.update(k, v, layer)
                    outputs.append(cache.attend(module, layer, q, key, value, None, scaling=D ** -0.5)[0])
            if "frames" in context:
                cache.step(backend=backend)
    finally:
        if check_syncs:
            torch.cuda.set_sync_debug_mode("default")
    assert cache.held == {"instant": 1, "short": 2, "episodic": 3} and cache.stats()["reindexes"] == 3
    return outputs


# the driven caches' rotary layouts (D = 8): 1D, contiguous M-RoPE sections, interleaved ones (Qwen3-VL)
ROPES = {"1d": None, "mrope": [1, 1, 2], "interleaved": INTERLEAVED[8]}


@pytest.mark.parametrize("rope", list(ROPES))
def test_a_driven_cache_gives_finite_attention(rope):
    """The driver of the CUDA check below, on CPU: every attention output of every forward is finite."""
    assert all(bool(torch.isfinite(out).all()) for out in drive("cpu", torch.float32, ROPES[rope], "torch", False))


@pytest.mark.parametrize("rope", list(ROPES))
def test_every_rotation_reads_the_caches_one_layout(rope, monkeypatch):
    """The cache keeps `rotary` as one RotaryLayout (1D included) and hands exactly that object to every
    rotation: the incoming queries and keys (attention, update) and the step of every class block."""
    import hermes.policies.h2svc.attention as attention_module
    import hermes.policies.h2svc.cache as cache_module
    seen = []

    def spy(real, index):
        def wrapped(*args, **kwargs):
            seen.append(args[index])
            return real(*args, **kwargs)
        return wrapped
    monkeypatch.setattr(attention_module, "apply_rotary_delta", spy(attention_module.apply_rotary_delta, 3))
    monkeypatch.setattr(cache_module, "apply_rotary_delta", spy(cache_module.apply_rotary_delta, 3))
    monkeypatch.setattr(hk, "h2svc_step", spy(hk.h2svc_step, 7))
    drive("cpu", torch.float32, ROPES[rope], "torch", False)
    layout = RotaryLayout.of(ROPES[rope], D // 2)
    assert seen and all(s == layout for s in seen), {getattr(s, "kind", s) for s in seen}
    assert sum(isinstance(s, RotaryLayout) for s in seen) == len(seen)


@pytest.mark.skipif(DEVICE != "cuda", reason="host synchronisation is a CUDA matter: CPU tensors never wait")
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("rope", list(ROPES))
def test_no_host_sync_on_cuda(rope, backend):
    """Forwards (positions, rotation, class masks, per-class sdpa) and steps of a CUDA cache never wait for the
    device: sync debug mode "error" after a warm-up run that compiles the kernels (for bench/gpu_check.sh)."""
    drive(DEVICE, torch.float16, ROPES[rope], backend, check_syncs=False)
    outputs = drive(DEVICE, torch.float16, ROPES[rope], backend, check_syncs=True)
    assert all(bool(torch.isfinite(out).all()) for out in outputs)

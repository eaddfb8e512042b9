"""The 512 s memory table (`bench/stream_memory.py`): its cache formulas against real caches and caches built on the
meta device, the linear-attention state against what transformers allocates, and the Qwen3.5 numbers against
transformers' default config (docs/benchmarks.md#memory-of-a-512-s-stream)."""
from __future__ import annotations

import pytest
import torch
from transformers import (Qwen2_5_VLConfig, Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5TextConfig, Qwen3VLConfig)
from transformers.cache_utils import LinearAttentionLayer

from hermes_kernels import RotaryLayout
from hermes_kernels.engine.geometry import ModelGeometry

from bench import stream_memory
from bench.shapes import LINEAR_STATES, SHAPES, SMOKE_SHAPES, LinearStateShape, ModelShape

# a partial-rotary (R 16 of D 32), interleaved M-RoPE shape like Qwen3.5's full-attention part, at a tiny size
TINY_PARTIAL = ModelShape("tiny-partial", ModelGeometry(num_layers=3, num_heads=6, num_kv_heads=3, head_dim=32,
                                                        max_positions=4096, rope_theta=1e4,
                                                        rotary=RotaryLayout.interleaved((3, 3, 2))),
                          "qwen3_vl", h2svc_windows=(1, 2, 5))
TINY_SHAPES = [*SMOKE_SHAPES.values(), TINY_PARTIAL]


def storage_bytes(cache) -> int:
    """Bytes of the storages behind every buffer of a real cache (not its own count)."""
    return sum(t.untyped_storage().nbytes() for t in cache.buffers())


@pytest.mark.parametrize("shape", TINY_SHAPES, ids=lambda s: s.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch_size", [1, 3])
def test_cache_formulas_equal_real_allocations(shape: ModelShape, dtype, batch_size):
    """Both formulas give the bytes a cache built on the CPU holds (its nbytes() and the storages behind its
    buffers), for 1D RoPE, M-RoPE sections, interleaved and partial rotary, odd sizes and a batch of streams."""
    sizes = dict(tokens_per_frame=7, chunk_frames=3, room=5, dtype=dtype, prefix_len=4, batch_size=batch_size)
    hermes = stream_memory.build_cache("hermes", shape, budget=23, device="cpu", **sizes)
    h2svc = stream_memory.build_cache("h2svc", shape, device="cpu", **sizes)
    expected_hermes = stream_memory.hermes_nbytes(shape, budget=23, **sizes)
    expected_h2svc = stream_memory.h2svc_nbytes(shape, **sizes)
    assert hermes.nbytes() == storage_bytes(hermes) == expected_hermes
    assert h2svc.nbytes() == storage_bytes(h2svc) == expected_h2svc
    assert (hermes.capacity, h2svc.capacity) == (4 + 23 + 3 * 7 + 5, 4 + (shape.h2svc_config().window(2) + 3) * 7 + 5)


@pytest.mark.parametrize("name", stream_memory.MODELS)
def test_table_counts_what_the_caches_allocate_at_the_real_shapes(name):
    """At every shape of the table the allocated columns are the nbytes() of the caches the policies would build,
    constructed on the meta device (nothing allocated)."""
    shape = SHAPES[name]
    args = dict(tokens_per_frame=stream_memory.frame_tokens(name),
                chunk_frames=stream_memory.memory_frames(name, stream_memory.CHUNK_VIDEO_FRAMES, 1.0))
    sizes = stream_memory.stream_bytes(name)
    assert stream_memory.build_cache("hermes", shape, **args).nbytes() == sizes["hermes_allocated"]
    assert stream_memory.build_cache("h2svc", shape, **args).nbytes() == sizes["h2svc_allocated"]


def test_qwen2_5_vl_7b_and_llava_ov_7b_by_hand():
    """512 s at 1 fps: LLaVA-OV keeps 512 frames, Qwen2.5-VL 256 grid steps (chunk: 16 frames, Qwen 8 steps); bf16
    K+V of 112 heads of D 128, 196 tokens a frame, P 14. HERMES allocates per layer C = 14 + 6000 + chunk + 512 slots
    of K, V, positions (3 axes for M-RoPE) and fp32 guidance scores; H2SVC per row of class c (11 / 45 / 56 rows,
    windows 4 / 16 / 64) 14 + (W_c + chunk)·196 + 512 slots of K, V, positions, W_c slot frames, and episodic
    features fp32 [W_e, D]."""
    kv, heads = 2 * 128 * 2, 28 * 4
    rows, windows = (11, 45, 56), (4, 16, 64)
    for name, frames, chunk, axes in (("llava-ov-7b", 512, 16, 1), ("qwen2.5-vl-7b", 256, 8, 3)):
        sizes = stream_memory.stream_bytes(name, 512, 1.0)
        assert sizes["frames"] == frames and sizes["linear"] == 0
        assert sizes["full"] == heads * (14 + frames * 196) * kv
        assert sizes["hermes"] == heads * (14 + 6000) * kv
        assert sizes["h2svc"] == sum(r * (14 + w * 196) for r, w in zip(rows, windows)) * kv
        assert sizes["hermes_allocated"] == 28 * (14 + 6000 + chunk * 196 + 512) * (4 * kv + axes * 8 + 4)
        assert sizes["h2svc_allocated"] == sum(r * ((14 + (w + chunk) * 196 + 512) * (kv + axes * 8) + w * 8)
                                               for r, w in zip(rows, windows)) + 56 * 64 * 128 * 4
        assert stream_memory.totals(sizes) == {"full": sizes["full"], "hermes": sizes["hermes_allocated"],
                                               "h2svc": sizes["h2svc_allocated"]}
    assert stream_memory.stream_bytes("llava-ov-7b", 512, 0.5)["frames"] == 256
    assert stream_memory.stream_bytes("qwen2.5-vl-7b", 512, 0.5)["frames"] == 128


def test_qwen3_5_by_hand():
    """Qwen3.5: 8 full-attention layers x 4 KV heads of D 256 hold tokens, 256 steps of 196 visual + 12 text tokens
    at 1 fps; 24 linear layers each keep a conv state bf16 [8192, 4] (8192 = 2·16·128 + 32·128) and a recurrent
    state fp32 [32, 128, 128], twice in our caches, once in transformers' uncompressed one."""
    kv, T_f = 2 * 256 * 2, 196 + 12
    sizes = stream_memory.stream_bytes("qwen3.5", 512, 1.0)
    linear = 24 * (8192 * 4 * 2 + 32 * 128 * 128 * 4)
    assert stream_memory.frame_tokens("qwen3.5") == T_f and sizes["frames"] == 256
    assert sizes["full"] == 8 * 4 * (14 + 256 * T_f) * kv
    assert sizes["hermes_allocated"] == 8 * (14 + 6000 + 8 * T_f + 512) * (4 * kv + 3 * 8 + 4)
    assert sizes["linear"] == linear
    assert stream_memory.totals(sizes) == {"full": sizes["full"] + linear,
                                           "hermes": sizes["hermes_allocated"] + 2 * linear,
                                           "h2svc": sizes["h2svc_allocated"] + 2 * linear}


def test_qwen3_5_shapes_are_the_default_config():
    """The registry's Qwen3.5 numbers are transformers' default Qwen3_5 config: the full-attention layers (counted
    from layer_types), their heads and head dim, the linear layers' state, and the merged-token side (patch x merge)
    of every Qwen vision tower the table sizes frames with."""
    text = Qwen3_5TextConfig()
    geometry = SHAPES["qwen3.5"].geometry
    assert geometry.num_layers == text.layer_types.count("full_attention")
    assert (geometry.num_heads, geometry.num_kv_heads, geometry.head_dim) == \
        (text.num_attention_heads, text.num_key_value_heads, text.head_dim)
    assert LINEAR_STATES["qwen3.5"] == LinearStateShape.from_config(text)
    for name, config in (("qwen2.5-vl-7b", Qwen2_5_VLConfig), ("qwen3-vl-8b", Qwen3VLConfig),
                         ("qwen3.5", Qwen3_5Config)):
        vision = config().vision_config
        assert stream_memory.FRAME_PIXELS[name][1] == vision.patch_size * vision.spatial_merge_size
        assert stream_memory.frame_tokens(name) == 196 + stream_memory.TEXT_PER_STEP.get(name, 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_linear_state_equals_what_transformers_allocates(dtype):
    """A tiny random Qwen3.5 text model (odd head counts and widths, GQA-style 2 key / 4 value heads) after a
    7-token prefill of 3 streams and again after 5 more tokens: every linear layer's conv and recurrent state, as
    transformers' LinearAttentionLayer holds them, add up to batch x `LinearStateShape.nbytes` (the conv state in
    the model dtype, the recurrent state float32), flat in the sequence length."""
    config = Qwen3_5TextConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=5,
                               layer_types=["linear_attention", "full_attention", "linear_attention",
                                            "linear_attention", "full_attention"],
                               num_attention_heads=2, num_key_value_heads=1, head_dim=16, linear_num_key_heads=2,
                               linear_num_value_heads=4, linear_key_head_dim=6, linear_value_head_dim=10,
                               linear_conv_kernel_dim=3)
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(config).to(dtype).eval()
    state = LinearStateShape.from_config(config)
    assert state.num_layers == 3 and state.conv_dim == 2 * 2 * 6 + 4 * 10
    ids = torch.randint(0, 64, (3, 12))
    with torch.no_grad():
        cache = model(ids[:, :7], use_cache=True).past_key_values
        lengths = []
        for step in (7, 12):
            if step == 12:
                model(ids[:, 7:], cache=cache, use_cache=True)
            layers = [layer for layer in cache.layers if isinstance(layer, LinearAttentionLayer)]
            assert len(layers) == state.num_layers
            for layer in layers:
                conv, recurrent = layer.conv_states[0], layer.recurrent_states[0]
                assert conv.shape == (3, state.conv_dim, state.conv_kernel) and conv.dtype == dtype
                assert recurrent.shape == (3, 4, 6, 10) and recurrent.dtype == torch.float32
            lengths.append(sum(layer.conv_states[0].nbytes + layer.recurrent_states[0].nbytes for layer in layers))
    assert lengths == [3 * state.nbytes(dtype)] * 2


def test_report_rows():
    """One row per model and fps, Qwen3.5 with its 8 of 32 layers, and the line composing its saving with ours."""
    text = stream_memory.report()
    for name in stream_memory.MODELS:
        assert sum(line.strip().startswith(name + " ") for line in text.splitlines()) == len(stream_memory.FPS)
    assert " 8/32 " in text and "qwen3.5 against qwen2.5-vl-7b" in text and "76.2 GB" in text


def test_build_cache_refuses_an_unknown_policy():
    with pytest.raises(ValueError, match="policy"):
        stream_memory.build_cache("dense", SHAPES["qwen3.5"], tokens_per_frame=208, chunk_frames=8)


def test_window_rows_are_the_rings_a_stream_allocates():
    """The window formula gives the bytes of the rings a Gemma 4 stream allocates (W - 1 + max(chunk, room) slots per
    sliding layer that computes its keys; the KV-shared ones hold none), read from the model's config alone."""
    from hermes.stream import HermesStream
    from scaffolding.models import tiny_gemma4
    from scaffolding.tokenizer import tiny_tokenizer
    model = tiny_gemma4()
    window = stream_memory.WindowShape.from_config(model.config.text_config)
    assert (window.layers, window.kv_heads, window.head_dim, window.window) == (3, 2, 16, 24)
    for chunk_tokens, room in ((40, 16), (12, 30)):
        stream = HermesStream(model, tiny_tokenizer(digits=True, gemma=True), batch_size=2, chunk_tokens=chunk_tokens,
                              room=room, budget=100)
        rings = sum(t.untyped_storage().nbytes() for t in (*stream.cache.windows.keys, *stream.cache.windows.values))
        assert rings == 2 * window.nbytes(23 + max(chunk_tokens, room), torch.float32)


def test_gemma4_numbers_by_hand():
    """transformers 5.25's default Gemma4TextConfig: 25 sliding layers of 4 KV heads of 256 with a 512-token window,
    5 full-attention layers of 4 KV heads of 512; 512 s at 1 fps, 64 + 9 tokens a frame: bf16 K+V."""
    assert stream_memory.WINDOWS["gemma4"] == stream_memory.WindowShape(layers=25, kv_heads=4, head_dim=256,
                                                                         window=512)
    sizes = stream_memory.stream_bytes("gemma4", 512, 1.0)
    assert stream_memory.frame_tokens("gemma4") == 73
    assert sizes["full"] == 5 * 4 * (14 + 512 * 73) * 2 * 512 * 2
    assert sizes["window"] == 25 * 4 * 511 * 2 * 256 * 2
    assert sizes["window_allocated"] == 25 * 4 * (511 + 16 * 73) * 2 * 256 * 2

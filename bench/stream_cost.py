"""Per-chunk CPU cost of HermesStream on the tiny random models (issue 4's report), one thread.

python -m bench.stream_cost time   # per chunk: vision + LM prefill alone vs + guidance + compression (fastest of 40)
python -m bench.stream_cost mem    # peak tensor bytes: our guidance pass vs eager output_attentions passes

The split is measured by wrapping the stream's own stages (encoder, guidance pass, compression) with timers.
"""
import statistics
import sys
import time

import torch

import hermes.stream as hs
from bench.tiny_models import llava_pixels, qwen_pixels, tiny_llava_ov, tiny_qwen2_5_vl, tiny_tokenizer
from hermes.attention import attention_implementation



def chunker(name, g, frames):
    if name == "llava_ov":
        return lambda: {"video": llava_pixels(1, frames, g)}
    return lambda: dict(zip(("video", "grid_thw"), qwen_pixels(1, frames, g)))


def build(name, budget, frames, room=200, **kw):
    model = tiny_llava_ov() if name == "llava_ov" else tiny_qwen2_5_vl()
    extra = {} if name == "llava_ov" else {"frame_size": (16, 16)}
    return hs.HermesStream(model, tiny_tokenizer(), budget=budget, chunk_frames=frames, room=room, **extra, **kw)


def time_split(name, budget, frames, steps=40):
    g = torch.Generator().manual_seed(0)
    stream = build(name, budget, frames)
    spent = {"encode": 0.0, "guidance": 0.0, "compress": 0.0}
    run_guidance, compress, encode = hs.run_guidance, stream.cache.compress, stream.family.encode_video

    def timed(key, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            spent[key] += time.perf_counter() - t
            return out
        return wrapper

    hs.run_guidance = timed("guidance", run_guidance)
    stream.cache.compress = timed("compress", compress)
    stream.family.encode_video = timed("encode", encode)
    plan_ids = stream.plan.token_ids
    object.__setattr__(stream.plan, "token_ids", timed("guidance", plan_ids))
    chunk = chunker(name, g, frames)
    while stream.append_video(**chunk()) is None:
        pass
    rows = []
    for _ in range(steps):
        spent.update(encode=0.0, guidance=0.0, compress=0.0)
        c = chunk()
        t = time.perf_counter()
        stream.append_video(**c)
        total = time.perf_counter() - t
        rest = total - spent["encode"] - spent["guidance"] - spent["compress"]
        rows.append((spent["encode"], rest, spent["guidance"], spent["compress"], total))
    hs.run_guidance = run_guidance
    # the runner is shared (load ~5 on 2 cores): the fastest of 40 chunks is the cost, the median the noise
    med = [min(r[i] for r in rows) * 1e3 for i in range(5)]
    noisy = statistics.median(r[4] for r in rows) * 1e3
    T = stream.chunk_tokens
    print(f"{name:10s} budget {budget:4d} chunk {T:3d} tok cache {stream.cache.length:4d}->{stream.cache.length + T:4d}"
          f" | vision {med[0]:5.2f}  LM prefill {med[1]:5.2f}  guidance {med[2]:5.2f}  compress {med[3]:5.2f}"
          f" | total {med[4]:6.2f} ms; prefill alone (vision+LM) {med[0] + med[1]:5.2f} ms, "
          f"x{med[4] / (med[0] + med[1]):.2f} with guidance+compress (median total {noisy:.1f})")


def peak_bytes(fn):
    """Peak bytes of tensors allocated while fn() runs (CPU; from the profiler's allocation timeline)."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        fn()
    current = peak = 0
    for _, action, _, size in prof._memory_profile().timeline:
        if action == Action.CREATE:
            current += size
        elif action == Action.DESTROY:
            current -= size
        peak = max(peak, current)
    return peak


def memory(name="llava_ov", budget=3000, frames=16):
    """Guidance pass vs an eager output_attentions pass over the same cache (prefix + budget + chunk)."""
    from transformers import DynamicCache
    g = torch.Generator().manual_seed(0)
    stream = build(name, budget, frames, room=400, summary=True)
    chunk = chunker(name, g, frames)
    while stream.cache.length + stream.chunk_tokens <= stream.cfg.prefix_len + budget + stream.chunk_tokens:
        if stream.append_video(**chunk()) is not None:
            break
    c = chunk()
    embeds = stream.family.encode_video(stream.model, None, c.pop("video"), 1, **c)
    with torch.no_grad(), stream.cache.forward_context(embeds.rel_positions):
        stream.language_model(inputs_embeds=embeds.embeds, cache=stream.cache, use_cache=True,
                              position_ids=stream.cache.default_position_ids(embeds.embeds.shape[1]))
    N = stream.cache.length
    ids = stream.plan.token_ids(stream.tokenizer, stream.last_convs)
    with torch.no_grad():
        ours = peak_bytes(lambda: hs.run_guidance(stream.language_model, stream.cache, stream.plan, ids))
        eager = {}
        for index, kind in enumerate(stream.plan.kinds):
            cache = DynamicCache()
            for layer in range(stream.cfg.num_layers):
                cache.update(stream.cache.layer_keys(layer).clone(), stream.cache.layer_values(layer).clone(), layer)
            prompt = torch.tensor([ids[0][index]])
            pos = N + torch.arange(prompt.shape[1])[None]
            if stream.cache.mrope:
                pos = pos.expand(3, -1, -1)
            with attention_implementation(stream.model, "eager"):
                eager[kind] = peak_bytes(lambda: stream.language_model(
                    input_ids=prompt, position_ids=pos, cache=cache, use_cache=True, output_attentions=True))
    cfg = stream.model.config.text_config
    print(f"{name:9s} cache {N} tokens (L={cfg.num_hidden_layers}, H={cfg.num_attention_heads}, "
          f"Hkv={cfg.num_key_value_heads}), prompts {[len(p) for p in ids[0]]} tokens: "
          f"hermes guidance (both prompts, one forward) peak {ours / 2**20:.2f} MiB; eager output_attentions "
          + ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in eager.items())
          + f" (sum {sum(eager.values()) / 2**20:.2f} MiB)")


if __name__ == "__main__":
    torch.set_num_threads(1)
    if sys.argv[1:] == ["time"]:
        for name, frames in (("llava_ov", 2), ("qwen2_5_vl", 4)):
            for budget in (200, 1000):
                time_split(name, budget, frames)
    elif sys.argv[1:] == ["mem"]:
        for name in ("llava_ov", "qwen2_5_vl"):
            memory(name)
    else:
        sys.exit("usage: python -m bench.stream_cost time|mem")

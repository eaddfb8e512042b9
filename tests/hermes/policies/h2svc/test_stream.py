"""H2SVC through the models (docs/h2svc.md §3–5): `HermesStream(policy="h2svc")` on tiny random LLaVA-OneVision (1D
RoPE) and Qwen2.5-VL (M-RoPE), the class-block cache, the per-class attention and the step, against references
that never go through H2SVC:
- windows larger than the video: one plain full-sequence forward (logits, and `generate`'s tokens);
- instant / short windows smaller than the video, no episodic eviction: a full-sequence forward whose heads get
  explicit frame-window masks written in the test (`tests.hermes.policies.h2svc.checks.window_masks`);
- episodic eviction: `hermes_kernels.policies.h2svc.reference` STCE over the values the model produced (the cache's
  own value means), and every kept key equal to the model's RoPE of its pre-RoPE key at the cache's (re-indexed)
  position;
- 64+ chunks: the same storage, bytes per class as the capacity formula, positions bounded by lazy re-indexing.
The step runs on both backends ("triton": the interpreter on CPU; a few small runs).
"""
import pytest
import torch

from scaffolding.census import live_tensors
from scaffolding.models import tiny_llava_ov
from hermes_kernels.policies.h2svc.config import CLASS_NAMES, EPISODIC, INSTANT, SHORT
from hermes_kernels.policies.h2svc import reference as ref
from tests.hermes.policies.h2svc.checks import (INTERLEAVED_MAP, chunk, h2svc_stream, masked_reference_logits,
                                                retention_masks, window_masks)
from tests.hermes.streams import CASES, QUESTION, reference_greedy, reference_logits, reference_sequence, rope_at
from tests.utils import assert_close_verbose

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(params=list(CASES))
def case(request):
    return CASES[request.param]


def runs(*items: tuple[str, str, str]) -> list:
    """pytest params (case, backend, variant) from (family, backend, variant) names: the torch backend for every
    family, and a few small Triton-interpreter runs."""
    return [pytest.param(CASES[f], b, v, id=f"{f}-{b}-{v}") for f, b, v in items]


@pytest.mark.parametrize("backend", ["torch"])
def test_windows_wider_than_the_video_equal_one_full_forward(case, backend):
    """Every class holds every frame: streaming logits equal one full forward over prefix + chunks + question,
    `ask` gives the full-sequence greedy answer, and the cache keeps only the video afterwards."""
    g = torch.Generator().manual_seed(1)
    model = case.build()
    chunks = [chunk(case, 2, g, frames=2) for _ in range(3)]
    embeds, positions, _ = reference_sequence(case, model, chunks, batch=2)
    expected = reference_logits(model, embeds, positions)
    stream = h2svc_stream(case, model, frames=2, batch_size=2, backend=backend, instant_frames=6, short_frames=6,
                          episodic_frames=6)
    for clip in chunks:
        result = stream.append_video(**clip)
        assert not bool(result.reindexed)
    assert stream.stats()["held"] == {name: 6 for name in CLASS_NAMES}
    length = stream.cache.length
    assert_close_verbose(stream.next_token_logits(QUESTION), expected, name="last-token logits")
    answers = stream.ask(QUESTION, max_new_tokens=6)
    assert answers == stream.tokenizer.batch_decode(reference_greedy(model, embeds, positions, 6, case.mrope),
                                                    skip_special_tokens=True)
    assert stream.cache.length == length
    assert_close_verbose(stream.next_token_logits(QUESTION), expected, name="logits after ask")


NARROW = runs(("llava_ov", "torch", "mixed"), ("qwen2_5_vl", "torch", "mixed"), ("llava_ov", "triton", "mixed"),
              # four KV heads a layer, classes not contiguous: query heads gathered by index (LLaVA-OV's Qwen2 decoder
              # takes an explicit head dim; Qwen2.5-VL's ties it to hidden / heads, so its tiny model has 2 KV heads)
              ("llava_ov", "torch", "interleaved"))


@pytest.mark.parametrize("case,backend,head_map", NARROW)
def test_frame_windows_equal_a_full_forward_with_window_masks(case, backend, head_map):
    """Instant (2 frames) and short (3 frames) heads forget, episodic heads hold everything: after 3-frame chunks
    (so windows cut through a chunk and through the held frames, whose FIFO slots are a ring by then) the
    streaming logits equal one full forward whose heads are masked to their frame windows."""
    g = torch.Generator().manual_seed(2)
    model = tiny_llava_ov(num_heads=8, num_kv_heads=4) if head_map == "interleaved" else case.build()
    frames, count = 3, 4
    chunks = [chunk(case, 2, g, frames) for _ in range(count)]
    embeds, positions, question = reference_sequence(case, model, chunks, batch=2)
    kwargs = {"head_map": INTERLEAVED_MAP} if head_map == "interleaved" else {}
    stream = h2svc_stream(case, model, frames, batch_size=2, backend=backend, instant_frames=2, short_frames=3,
                          episodic_frames=frames * count, **kwargs)
    for clip in chunks:
        stream.append_video(**clip)
    assert stream.stats()["held"] == {"instant": 2, "short": 3, "episodic": frames * count}
    assert stream.stats()["reindexes"] == 0
    masks = window_masks(stream.cfg, frames * count, question.shape[1])
    expected = masked_reference_logits(model, embeds, positions, masks)
    assert_close_verbose(stream.next_token_logits(QUESTION), expected, name="last-token logits")
    # the test's masks do matter: without them (plain causal) the logits are different
    assert not torch.allclose(expected, reference_logits(model, embeds, positions), atol=1e-3)


def test_full_episodic_memory_equals_a_full_forward_with_retention_masks(case):
    """Episodic heads hold N_e = 3 frames and evict (STCE) from the second chunk on: every chunk's prefill lets an
    episodic head see the frames it holds plus the chunk itself (causally) — not a frame window — so the streamed
    question logits equal one full forward masked to what each head held at each chunk (instant and short heads to
    their windows)."""
    g = torch.Generator().manual_seed(4)
    model = case.build()
    frames, count = 2, 4
    chunks = [chunk(case, 1, g, frames) for _ in range(count)]
    embeds, positions, question = reference_sequence(case, model, chunks, batch=1)
    stream = h2svc_stream(case, model, frames, instant_frames=2, short_frames=3, episodic_frames=3)
    cfg = stream.cfg

    def held_now() -> dict[int, list[set[int]]]:
        return {layer: [set(row.tolist()) - {-1} for row in stream.cache.class_slot_frames(EPISODIC, layer)[0]]
                for layer in range(cfg.num_layers) if cfg.heads_of(EPISODIC, layer)}

    held = [{layer: [set() for _ in cfg.heads_of(EPISODIC, layer)] for layer in range(cfg.num_layers)}]
    for clip in chunks:
        stream.append_video(**clip)
        held.append(held_now())
    assert stream.stats()["held"]["episodic"] == 3 and stream.stats()["reindexes"] == 0
    assert any(len(before[layer][0]) == 3 for before in held[:-1] for layer in before if before[layer]), \
        "a chunk after a full episodic memory"
    masks = retention_masks(cfg, frames, held, question.shape[1])
    expected = masked_reference_logits(model, embeds, positions, masks)
    assert_close_verbose(stream.next_token_logits(QUESTION), expected, name="last-token logits")
    # the retention matters: with every frame visible to episodic heads the logits are different
    assert not torch.allclose(expected, masked_reference_logits(model, embeds, positions, window_masks(
        cfg, frames * count, question.shape[1])), atol=1e-3)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_eager_reindex_with_the_widest_class_empty(case, backend):
    """A head map without episodic heads (the class with the widest window, N_e = 8): `held` reports 0 frames for
    it, and eager re-indexing right-aligns every row to R = P + the largest count of a class that has heads (the
    short window), not the empty class's window."""
    g = torch.Generator().manual_seed(5)
    model = case.build()
    frames = 2
    stream = h2svc_stream(case, model, frames, head_map=[[INSTANT, SHORT]] * 4, reindex="eager", backend=backend,
                          instant_frames=2, short_frames=3, episodic_frames=8)
    cache, cfg = stream.cache, stream.cfg
    P, T_f = cfg.prefix_len, cfg.tokens_per_frame
    for _ in range(3):
        result = stream.append_video(**chunk(case, 1, g, frames))
        assert bool(result.reindexed) and result.held["episodic"] == 0
    assert stream.stats()["held"] == {"instant": 2, "short": 3, "episodic": 0}
    assert cache.next_position == P + 3 * T_f
    for cls in (INSTANT, SHORT):
        for layer in range(cfg.num_layers):
            visual = cache.class_positions(cls, layer)[..., P:]
            newest = visual.flatten(-2 if case.mrope else -1).amax(-1)
            assert bool((newest == cache.next_position - 1).all()), (CLASS_NAMES[cls], layer)


def recorded(model):
    """Forward hooks recording the pre-RoPE keys and the values of every layer ([B, Hkv, T, D] per forward)."""
    layers = model.model.language_model.layers
    seen = {"k": [[] for _ in layers], "v": [[] for _ in layers]}

    def hook(kind, layer):
        def record(module, args, output):
            attention = layers[layer].self_attn
            b, t, _ = output.shape
            seen[kind][layer].append(output.view(b, t, -1, attention.head_dim).transpose(1, 2).detach().clone())
        return record

    handles = [getattr(layers[l].self_attn, f"{kind}_proj").register_forward_hook(hook(kind, l))
               for l in range(len(layers)) for kind in ("k", "v")]
    return seen, handles


EVICTION = runs(("llava_ov", "torch", "eager"), ("llava_ov", "torch", "lazy"), ("qwen2_5_vl", "torch", "eager"),
                ("qwen2_5_vl", "torch", "lazy"), ("qwen2_5_vl", "triton", "eager"))


@pytest.mark.parametrize("case,backend,reindex", EVICTION)
def test_episodic_eviction_follows_the_reference_and_keys_follow_rope(case, backend, reindex):
    """Episodic heads keep N_e = 3 of 12 frames: each row's kept frames equal
    `hermes_kernels.policies.h2svc.reference.stce_trace` run frame by frame over the frame means of the values the model
    wrote (tie-free: every eviction's margin is checked), the cache's features are those means, and every kept token's
    key equals the model's RoPE of its pre-RoPE key at the position the cache holds for it (right-aligned after eager
    re-indexing: the newest retained token of every row sits at R - 1, R the next position)."""
    g = torch.Generator().manual_seed(3)
    model = case.build()
    frames, count, capacity = 2, 6, 3
    seen, handles = recorded(model)
    try:
        stream = h2svc_stream(case, model, frames, batch_size=2, backend=backend, reindex=reindex,
                              instant_frames=2, short_frames=3, episodic_frames=capacity)
        for _ in range(count):
            result = stream.append_video(**chunk(case, 2, g, frames))
            assert bool(result.reindexed) == (reindex == "eager")
    finally:
        for handle in handles:
            handle.remove()
    cfg, cache = stream.cfg, stream.cache
    P, T_f, n = cfg.prefix_len, cfg.tokens_per_frame, frames * count
    for layer in range(cfg.num_layers):
        prefix_keys = seen["k"][layer][0]
        keys = torch.cat(seen["k"][layer][1:], dim=2)            # [B, Hkv, n·T_f, D] pre-RoPE, in stream order
        values = torch.cat(seen["v"][layer][1:], dim=2)
        means = ref.frame_features(values, T_f)                    # [B, Hkv, n, D]
        for cls in range(len(CLASS_NAMES)):
            heads = cfg.heads_of(cls, layer)
            if not heads:
                continue
            slot_frames = cache.class_slot_frames(cls, layer)      # [B, n_c, W]
            if cls == EPISODIC:
                W = cfg.window(cls)
                arriving = means[:, heads].transpose(0, 1)         # [n_c, B, n, D], all frames as arrivals
                trace = ref.stce_trace(torch.zeros(len(heads), 2, W, means.shape[-1]),
                                       torch.full((len(heads), 2, W), -1), arriving, 0, W)
                assert bool((trace.margin[trace.evicted >= 0] > 1e-3).all()), "near-tie: pick another seed"
                assert torch.equal(slot_frames.sort(dim=-1).values, trace.keep.transpose(0, 1))
                held_means = means[:, heads].gather(2, slot_frames[..., None].expand(-1, -1, -1, means.shape[-1]))
                assert_close_verbose(cache.class_features(layer), held_means, name=f"features of layer {layer}")
            else:
                newest = torch.arange(n - cfg.window(cls), n).expand(2, len(heads), -1)
                assert torch.equal(slot_frames.sort(dim=-1).values, newest)
            # keys: prefix, then each home slot's frame, at the cache's positions
            positions = cache.class_positions(cls, layer)            # [B, n_c, (3,) N_c]
            cached = cache.class_keys(cls, layer)
            for b in range(2):
                for j, head in enumerate(heads):
                    tokens = (slot_frames[b, j, :, None] * T_f + torch.arange(T_f)).flatten()
                    source = torch.cat([prefix_keys[b, head], keys[b, head, tokens]])
                    expected = rope_at(model, source[None], positions[b, j], case.mrope)[0]
                    assert_close_verbose(cached[b, j], expected, name=f"keys of {CLASS_NAMES[cls]} layer {layer} "
                                         f"head {head} stream {b}")
            if reindex == "eager":  # §4: R = P + the largest retained visual token count over all heads
                held = stream.stats()["held"]
                assert cache.next_position == P + max(held[CLASS_NAMES[c]] for c in cache.classes) * T_f
                visual = positions[..., P:]
                assert bool((visual.flatten(-2 if case.mrope else -1).amax(-1) == cache.next_position - 1).all())


@pytest.mark.parametrize("backend", ["torch"])
def test_64_chunks_same_storage_bytes_per_class_and_bounded_positions(case, backend):
    """70 chunks through a model with max_position_embeddings 512: the buffers never move, bytes per class are
    the capacity formula computed here, lazy re-indexing keeps every position below 512 (several re-indexes,
    each right-aligning all rows to end at P + the largest retained token count), and no tensor survives a step
    (the live-tensor census after step 16 equals the one after step 70)."""
    g = torch.Generator().manual_seed(5)
    model = case.build(max_positions=512)
    frames, windows = 2, (1, 3, 5)
    stream = h2svc_stream(case, model, frames, backend=backend, instant_frames=windows[0], short_frames=windows[1],
                          episodic_frames=windows[2], margin=160)
    cfg, cache = stream.cfg, stream.cache
    P, T_f, D = cfg.prefix_len, cfg.tokens_per_frame, 16
    A = 3 if case.mrope else 1
    for index, name in enumerate(CLASS_NAMES):
        rows = sum(1 for row in cfg.head_classes.flatten().tolist() if row == index)
        capacity = P + (windows[index] + frames) * T_f + 160
        expected = rows * capacity * D * 4 * 2 + rows * capacity * A * 8 + rows * windows[index] * 8
        expected += rows * windows[index] * D * 4 if index == EPISODIC else 0
        assert stream.stats()["bytes_per_class"][name] == expected, name
    ptrs, nbytes = cache.data_ptrs(), stream.stats()["bytes_allocated"]
    census = {}
    for step in range(70):
        result = stream.append_video(**chunk(case, 1, g, frames))
        stats = stream.stats()
        assert stats["positions"][1] < 512, f"step {step}: positions {stats['positions']}"
        assert stats["held"] == {name: min(w, frames * (step + 1)) for name, w in zip(CLASS_NAMES, windows)}
        if bool(result.reindexed):
            assert result.next_position == P + windows[EPISODIC] * T_f
            assert stats["positions"][1] == result.next_position - 1
        assert cache.data_ptrs() == ptrs and stats["bytes_allocated"] == nbytes
        if step in (15, 69):
            census[step] = live_tensors()
    assert stats["steps"] == 70 and stats["reindexes"] >= 2
    assert census[69] == census[15], f"live tensors (count, bytes) grew over 54 steps: {census}"
    assert stream.ask(QUESTION, max_new_tokens=3)  # the stream still answers after the re-indexes

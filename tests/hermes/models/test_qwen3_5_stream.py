"""Streams on the tiny hybrid Qwen3.5 (layers linear, full, full, linear, full, linear) against references that never
go through the engine (docs/qwen3_5.md#hybrid-cache): nothing evicted, the cache is the model's own `DynamicCache`
(full-layer keys, values, positions; linear conv and recurrent states) and the logits one forward's; HERMES with
eviction equals a naive per-layer docs/hermes.md §2 over the full-attention layers, fed the stream's guidance
attention; guidance, `ask`, `truncate` / `crop` and a forward outside any context keep the linear-state rules; a
fault in a middle linear layer changes nothing; the MoE twin streams under both policies.
"""
from contextlib import nullcontext

import pytest
import torch
from transformers import DynamicCache
from transformers.models.qwen3_5 import modeling_qwen3_5

from hermes.policies.hermes import policy as hermes_policy
from hermes.stream import HermesStream
from scaffolding.models import tiny_qwen3_5, tiny_qwen3_5_moe
from scaffolding.tokenizer import tiny_tokenizer
from tests.hermes.models.qwen3_vl_reference import (chunked_forward, full_inputs, own_forward, question_text,
                                                    rope_index)
from tests.hermes.models.test_qwen3_vl import chunks_at
from tests.hermes.policies.h2svc.checks import MIXED_MAP
from tests.hermes.stream.policies import POLICIES, assert_same_stream
from tests.hermes.streams import QUESTION, layer_parts
from tests.utils import TOL, assert_close_verbose, same_bytes

pytestmark = pytest.mark.usefixtures("single_thread")

FRAME = (8, 8)      # 2 x 2 merged tokens: a temporal step is 16 tokens with its timestamp, a 4-frame chunk 32
FULL = (1, 2, 4)    # decoder indices of the tiny model's full-attention layers (cache layers 0, 1, 2)
LINEAR = (0, 3, 5)  # ... and of its linear-attention layers
H2SVC_ALL = dict(policy="h2svc", head_map=MIXED_MAP[1:], instant_frames=8, short_frames=8, episodic_frames=8)


def tokenizer():
    return tiny_tokenizer(digits=True)


def stream_of(model, policy: str = "hermes", **kwargs) -> HermesStream:
    args = dict(budget=400) if policy == "hermes" else dict(H2SVC_ALL)
    args.update(kwargs)
    return HermesStream(model, tokenizer(), chunk_frames=4, frame_size=FRAME, room=64, **args)


def video(count: int, g: torch.Generator, batch: int = 1) -> list[dict]:
    """`count` chunks of 4 frames of 8 x 8 at advancing timestamps (7.5 s, 9.5 s, 11.5 s, ...)."""
    return chunks_at(count, g, batch=batch, size=FRAME)


def linear_states(stream) -> dict[str, torch.Tensor]:
    return {name: view.clone() for name, view in stream.cache.linear_contents().items()}


def assert_same_linear(a: dict, b: dict, what: str) -> None:
    assert list(a) == list(b) and a, what
    for name in a:
        assert torch.equal(a[name], b[name]), f"{what}: {name}"


def contents(stream) -> dict[str, torch.Tensor]:
    return {name: view.clone() for name, view in stream.cache.contents().items()}


def assert_same_contents(a: dict, b: dict, what: str) -> None:
    assert list(a) == list(b), what
    for name in a:
        assert same_bytes(a[name], b[name]), f"{what}: {name}"


# ---- 1. nothing evicted: the model's own forward and DynamicCache ------------------------------------------------
def error_bound(got: torch.Tensor, own: torch.Tensor, exact: torch.Tensor, name: str) -> None:
    """got (streamed, fp32) is off the float64 model's `exact` by at most twice what the fp32 model's own forward
    `own` is off (plus fp32 rounding of the values' size: a state the reference gets exactly still rounds)."""
    assert got.shape == exact.shape, f"{name}: {tuple(got.shape)} vs {tuple(exact.shape)}"
    error = (got.double() - exact).abs().max().item()
    own_error = (own.double() - exact).abs().max().item()
    floor = 4 * torch.finfo(torch.float32).eps * exact.abs().max().item()
    assert error <= 2 * own_error + floor, \
        f"{name}: off by {error:.3g}, the model's own fp32 forward by {own_error:.3g}"


def assert_hybrid_cache(stream, own_cache, exact_cache, positions: torch.Tensor) -> None:
    """The stream's cache against the model's own DynamicCaches (fp32 `own_cache`, float64 `exact_cache`) of the tiny
    hybrid decoder (full layers FULL, linear LINEAR): every full layer's keys and values (each H2SVC class's KV heads)
    within `error_bound`, its positions [B, N] or [B, 3, N] exactly; every linear layer's conv and recurrent state
    within `error_bound`."""
    held = stream.cache.contents()
    for layer, decoder in enumerate(FULL):
        own, ref = own_cache.layers[decoder], exact_cache.layers[decoder]
        for heads, name in layer_parts(stream, layer):
            for kind in ("keys", "values"):
                error_bound(held[f"{name} {kind}"], getattr(own, kind)[:, heads], getattr(ref, kind)[:, heads],
                            f"{name} {kind}")
            got = held[f"{name} positions"]
            expected = positions if isinstance(heads, slice) else positions[:, None].expand_as(got)
            assert torch.equal(got, expected), name
    linear = stream.cache.linear_contents()
    assert len(linear) == 2 * len(LINEAR)
    for decoder in LINEAR:
        own, ref = own_cache.layers[decoder], exact_cache.layers[decoder]
        error_bound(linear[f"linear layer {decoder} conv state"], own.conv_states[0], ref.conv_states[0],
                    f"conv state of layer {decoder}")
        error_bound(linear[f"linear layer {decoder} recurrent state"], own.recurrent_states[0],
                    ref.recurrent_states[0], f"recurrent state of layer {decoder}")


@pytest.mark.parametrize("policy", ["hermes", "h2svc"])
def test_a_budget_above_the_video_is_the_models_own_forward_and_cache(policy):
    """Two streams, three chunks at advancing timestamps, nothing evicted (HERMES: budget above the stream, H2SVC:
    windows of every frame): the cache equals the model's own `DynamicCache` after its own forwards over the prefix
    and each chunk (the stream's boundaries): every full-attention layer's keys, values (per KV head, its class's rows
    for H2SVC) and positions (get_rope_index), every linear-attention layer's conv and recurrent state; the next-token
    logits equal the model's own forward of the question on top of it. Errors within twice the fp32 model's own off
    the float64 model's, both fed alike (transformers' chunked linear attention sums in the order the forwards cut
    it; that the cut changes nothing but rounding is tests/hermes/models/test_qwen3_5.py's)."""
    g = torch.Generator().manual_seed(1)
    model, exact, tok = tiny_qwen3_5(), tiny_qwen3_5(dtype=torch.float64), tokenizer()
    chunks = video(3, g, batch=2)
    own_cache, exact_cache = DynamicCache(config=model.config), DynamicCache(config=exact.config)
    prefix_video = chunked_forward(model, tok, chunks, 2, own_cache)
    chunked_forward(exact, tok, [dict(chunk, video=chunk["video"].double()) for chunk in chunks], 2, exact_cache)
    positions = rope_index(model, prefix_video).permute(1, 0, 2)  # [B, 3, S]

    stream = stream_of(model, policy, batch_size=2)
    for chunk in chunks:
        stream.append_video(**chunk)
    cache = stream.cache
    assert cache.length == positions.shape[-1] and stream.stats()["reindexes"] == 0
    assert_hybrid_cache(stream, own_cache, exact_cache, positions)
    whole = full_inputs(model, tok, chunks, 2, question_text(QUESTION))
    question = {"input_ids": whole["input_ids"][:, cache.length:],
                "position_ids": rope_index(model, whole)[:, :, cache.length:]}
    own_logits = own_forward(model, question, cache=own_cache, logits_to_keep=1).logits[:, -1]
    exact_logits = own_forward(exact, question, cache=exact_cache, logits_to_keep=1).logits[:, -1]
    error_bound(stream.next_token_logits(QUESTION), own_logits, exact_logits, f"{policy} last-token logits")


# ---- 2. HERMES with eviction: a naive per-layer implementation of docs/hermes.md §2 -----------------------------
class NaiveHermes:
    """HERMES over the full-attention layers only, one Python list of tokens per (layer, stream), each token a
    (key [Hkv, D], value [Hkv, D], position [3]) in float64, written from docs/hermes.md §2: roles split by
    fraction of the full-attention depth (§2.1–2.2), recency / attention blend (§2.3), smoothing from the deepest
    full layer up (§2.4), top-b per layer in cache order (§2.5), the deep layers' summary (§2.6), re-indexing per
    axis (§2.7). Rotations are the model's own RoPE (its rotary module and `apply_rotary_pos_emb`) at the delta.
    The constants are the stream's config fields (ω0, γ, k0, k_end, λ, ratios, budget): the per-layer vectors the
    config derives from them are not read."""

    def __init__(self, model, cfg, prefix: dict, layers: int):
        self.rotary = model.model.language_model.rotary_emb
        self.cfg, self.L, self.P = cfg, layers, cfg.prefix_len
        self.tokens = [[[(prefix[f"layer {l} keys"][b, :, j].double(), prefix[f"layer {l} values"][b, :, j].double(),
                          prefix[f"layer {l} positions"][b, :, j]) for j in range(self.P)]
                        for b in range(prefix[f"layer {l} keys"].shape[0])] for l in range(layers)]
        s, e = int(cfg.shallow_ratio * layers), int((1 - cfg.deep_ratio) * layers)
        self.role, self.omega, self.forget, self.lam = [], [], [], []
        for l in range(layers):
            if l < s:
                role, omega, forget, lam = "shallow", 1.0, cfg.k0, cfg.lambda_shallow
            elif l >= e:
                role, omega, forget, lam = "deep", 0.0, 0.0, cfg.lambda_deep
            else:
                p = (l - s) / (e - s)
                role, omega, forget = "mid", cfg.omega0 - cfg.gamma * p, cfg.k0 - (cfg.k0 - cfg.k_end) * p
                lam = cfg.lambda_mid
            for name, value in zip(("role", "omega", "forget", "lam"), (role, omega, forget, lam)):
                getattr(self, name).append(value)

    def rotate(self, key: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """key [Hkv, D] turned by the model's RoPE at `delta` [3] (rotary channels only, as the model turns them)."""
        cos, sin = self.rotary(key, delta.view(3, 1, 1))
        turned, _ = modeling_qwen3_5.apply_rotary_pos_emb(key[None, :, None], key[None, :, None], cos, sin)
        return turned[0, :, 0]

    def append(self, held: dict, start: int, rel: torch.Tensor) -> None:
        """The chunk's tokens (slots [start, N) of the cache's contents at the step) after every list; the lists
        must still be what the cache holds below `start`, and the chunk's positions continue each (layer, stream)
        from its largest position + 1 (§2.7)."""
        self.check(held, start, "before the step")
        for l in range(self.L):
            for b, tokens in enumerate(self.tokens[l]):
                first = max(int(pos.max()) for _, _, pos in tokens) + 1
                expected = first + rel
                got = held[f"layer {l} positions"][b, :, start:]
                assert torch.equal(got, expected), f"chunk positions of layer {l}, stream {b}"
                for j in range(start, held[f"layer {l} keys"].shape[2]):
                    tokens.append((held[f"layer {l} keys"][b, :, j].double(),
                                   held[f"layer {l} values"][b, :, j].double(), got[:, j - start]))

    def step(self, attn: torch.Tensor) -> list:
        """One compression step with the pooled guidance attention attn [L, B, V]; returns the kept indices."""
        cfg, P = self.cfg, self.P
        B = len(self.tokens[0])
        V = len(self.tokens[0][0]) - P
        raw = [[None] * B for _ in range(self.L)]
        for l in range(self.L):
            for b in range(B):
                a = attn[l, b, :V].double()
                j = torch.arange(V, dtype=torch.float64)
                r = torch.exp(-self.forget[l] * (V - 1 - j) / max(V - 1, 1))
                A = (a - a.min()) / (a.max() - a.min() + cfg.eps)
                R = (r - r.min()) / (r.max() - r.min() + cfg.eps)
                raw[l][b] = (1 - self.omega[l]) * A + self.omega[l] * R
        smooth = [list(row) for row in raw]
        for l in range(self.L - 2, -1, -1):
            for b in range(B):
                deeper = smooth[l + 1][b] if cfg.cascade else raw[l + 1][b]
                smooth[l][b] = (1 - self.lam[l]) * raw[l][b] + self.lam[l] * deeper
        highest = max(int(pos.max()) for layer in self.tokens for tokens in layer for _, _, pos in tokens)
        reindex = cfg.reindex == "eager" or highest > cfg.max_positions - cfg.margin
        kept_all = []
        for l in range(self.L):
            deep = self.role[l] == "deep"
            budget = cfg.budget - 1 if deep and cfg.summary else cfg.budget
            kept_all.append([])
            for b in range(B):
                tokens = self.tokens[l][b]
                order = sorted(range(V), key=lambda i: -float(smooth[l][b][i]))  # stable: ties to the lower index
                kept = sorted(order[:min(budget, V)])
                pruned = [i for i in range(V) if i not in kept]
                old = [tokens[P + i][2] for i in kept]
                if reindex:  # each axis ranked on its own among the kept tokens' distinct coordinates
                    distinct = [sorted({int(pos[axis]) for pos in old}) for axis in range(3)]
                    new = [torch.tensor([P + distinct[axis].index(int(pos[axis])) for axis in range(3)]) for pos in old]
                else:
                    new = old
                out = tokens[:P] + [(self.rotate(tokens[P + i][0], n - o), tokens[P + i][1], n)
                                    for i, o, n in zip(kept, old, new)]
                if deep and cfg.summary and pruned:
                    target = max([int(tokens[j][2].max()) for j in range(P)] + [int(n.max()) for n in new]) + 1
                    t = torch.full((3,), target)
                    key = torch.stack([self.rotate(tokens[P + i][0], t - tokens[P + i][2]) for i in pruned]).mean(0)
                    value = torch.stack([tokens[P + i][1] for i in pruned]).mean(0)
                    out.append((key, value, t))
                self.tokens[l][b] = out
                kept_all[-1].append(kept)
        return kept_all

    def check(self, held: dict, end: int | None = None, what: str = "after the step") -> None:
        """The cache's contents (slots below `end`, default all) equal the lists: keys and values up to fp32's
        tolerance, positions exactly."""
        for l in range(self.L):
            for b, tokens in enumerate(self.tokens[l]):
                n = len(tokens) if end is None else end
                assert held[f"layer {l} keys"].shape[2] >= n and len(tokens) == n, f"{what}: length of layer {l}"
                for index, kind in enumerate(("keys", "values")):
                    expected = torch.stack([token[index] for token in tokens], dim=1)
                    assert_close_verbose(held[f"layer {l} {kind}"][b, :, :n], expected, *TOL[torch.float32],
                                         name=f"{what}: layer {l} {kind}, stream {b}")
                expected = torch.stack([token[2] for token in tokens], dim=1)
                assert torch.equal(held[f"layer {l} positions"][b, :, :n], expected), \
                    f"{what}: layer {l} positions, stream {b}"


@pytest.mark.parametrize("reindex", ["lazy", "eager"])
def test_eviction_equals_a_naive_per_layer_hermes(reindex, monkeypatch):
    """Two streams, budget 40, five chunks (four compressing steps): at every step the cache holds what the naive
    per-layer implementation holds after the same step, fed the pooled guidance attention the stream computed and
    the chunk's tokens as the stream stored them: keys, values and positions of each full-attention layer (the
    deep layer's summary included, eager re-indexing per axis); the step never touches the linear states, and the
    first linear layer (before any full layer) holds what a stream that never compresses holds."""
    g = torch.Generator().manual_seed(2)
    model, tok = tiny_qwen3_5(), tokenizer()
    stream = stream_of(model, batch_size=2, budget=40, reindex=reindex)
    never = stream_of(model, batch_size=2, budget=400)
    naive = NaiveHermes(model, stream.cfg, contents(stream), len(FULL))
    assert naive.role == ["mid", "mid", "deep"]
    steps, compress = [], stream.cache.compress

    def recording(attn, **kwargs):
        before = contents(stream)
        result = compress(attn, **kwargs)
        steps.append((before, attn.clone(), result))
        assert_same_linear(linear_states(stream), {k: v for k, v in before.items() if k.startswith("linear")},
                           "the compression step changed the linear states")
        return result

    monkeypatch.setattr(stream.cache, "compress", recording)
    for index, chunk in enumerate(video(5, g, batch=2)):
        start = stream.cache.length
        rel = stream.family.encode_video(model, tok, batch_size=2, **chunk).rel_positions
        result = stream.append_video(**chunk)
        never.append_video(**chunk)
        assert (result is None) == (index == 0)
        if result is None:
            naive.append(contents(stream), start, rel)
            naive.check(contents(stream))
            continue
        before, attn, _ = steps[-1]
        naive.append(before, start, rel)
        kept = naive.step(attn)
        assert [[row[row >= 0].tolist() for row in layer] for layer in result.keep] == kept, "kept tokens"
        naive.check(contents(stream))
        ours, theirs = linear_states(stream), linear_states(never)
        assert same_bytes(ours["linear layer 0 conv state"], theirs["linear layer 0 conv state"])
        assert same_bytes(ours["linear layer 0 recurrent state"], theirs["linear layer 0 recurrent state"])
        if index == 1:  # no chunk has yet seen a compressed cache: every linear state is the uncompressed stream's
            assert_same_linear(ours, theirs, "after the first step")
    assert len(steps) == 4 and stream.stats()["reindexes"] == (4 if reindex == "eager" else 0)


# ---- 3. guidance reads the linear states, never writes them -----------------------------------------------------
@pytest.mark.parametrize("budget", [400, 40], ids=["no-eviction", "eviction"])
def test_guidance_is_read_only_for_the_linear_states(budget, monkeypatch):
    """Stream A asks for `guidance_scores()` after every chunk, stream B never does (two streams each, four
    chunks): each pass (A's own, and every step's guidance inside `append_video`) leaves the linear states bit for
    bit as they were, and A and B hold the same bytes after every chunk, with eviction too (each step's guidance is
    then the same read-only pass in both)."""
    g = torch.Generator().manual_seed(3)
    model = tiny_qwen3_5()
    a, b = stream_of(model, budget=budget, batch_size=2), stream_of(model, budget=budget, batch_size=2)
    passes, run = [], hermes_policy.run_guidance

    def watched(language_model, cache, *args, **kwargs):
        before = {name: view.clone() for name, view in cache.linear_contents().items()}
        out = run(language_model, cache, *args, **kwargs)
        assert_same_linear({name: view.clone() for name, view in cache.linear_contents().items()}, before,
                           "a step's guidance pass")
        passes.append(cache)
        return out

    monkeypatch.setattr(hermes_policy, "run_guidance", watched)
    for index, chunk in enumerate(video(4, g, batch=2)):
        results = [stream.append_video(**chunk) for stream in (a, b)]
        assert [result is None for result in results] == [budget == 400 or index == 0] * 2
        before = linear_states(a)
        scores = a.guidance_scores()
        assert torch.count_nonzero(scores) > 0
        assert_same_linear(linear_states(a), before, "guidance_scores()")
        assert a.stats() == b.stats()
        assert_same_contents(contents(a), contents(b), "a stream with guidance passes vs one without")
    assert len(passes) == (4 if budget == 400 else 4 + 2 * 3)


# ---- 4. ask, truncate / crop, a forward outside any context -----------------------------------------------------
@pytest.mark.parametrize("policy", ["hermes", "h2svc"])
def test_ask_truncate_and_a_plain_forward_keep_the_linear_rule(policy):
    """The linear states cannot be cropped: `truncate` to anything but the current length or the length before the
    last stored text raises ValueError naming `length`, changing nothing (crop too); back to before the last chunk
    (HERMES, nothing evicted) undoes its linear commit exactly and the chunk stored again gives the same bytes
    (H2SVC's step moved the keys: refused); `ask` leaves every state bit for bit, and the chunk then cannot be
    undone; a forward run straight on the cache (no forward context) commits its linear states and truncating
    back undoes it exactly."""
    g = torch.Generator().manual_seed(4)
    model, tok = tiny_qwen3_5(), tokenizer()
    stream = stream_of(model, policy)
    cache = stream.cache
    chunks = video(2, g)
    stream.append_video(**chunks[0])
    first, start = contents(stream), cache.length
    stream.append_video(**chunks[1])
    held, length = contents(stream), cache.length
    logits = stream.next_token_logits(QUESTION)
    P = len(stream.prefix_ids)
    for bad in sorted({0, P, start - 1, start + 1, length - 1}):
        with pytest.raises(ValueError, match="length"):
            cache.truncate(bad)
        assert_same_contents(contents(stream), held, f"a refused truncate({bad})")
    with pytest.raises(ValueError, match="length"):
        cache.crop(-1)
    cache.truncate(length)
    assert_same_contents(contents(stream), held, "truncate to the length")
    if policy == "hermes":
        cache.truncate(start)
        assert_same_contents(contents(stream), first, "truncate back before the chunk")
        stream.append_video(**chunks[1])
        assert_same_contents(contents(stream), held, "the chunk stored again")
    else:
        with pytest.raises(ValueError, match="length"):
            cache.truncate(start)
    stream.ask(QUESTION, max_new_tokens=4)
    assert_same_contents(contents(stream), held, "ask")
    with pytest.raises(ValueError, match="length"):
        cache.truncate(start)
    ids = torch.tensor([tok(question_text(QUESTION), add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        stream.language_model(input_ids=ids, cache=cache, use_cache=True)
    assert cache.length == length + ids.shape[1]
    moved = linear_states(stream)
    assert all(not torch.equal(moved[name], held[name]) for name in moved), "the plain forward committed nothing"
    cache.truncate(length)
    assert_same_contents(contents(stream), held, "truncate back after a plain forward")
    assert torch.equal(stream.next_token_logits(QUESTION), logits)


# ---- 5. a fault in a middle linear-attention layer ----------------------------------------------------------------
EVICTING = {"hermes": dict(budget=40), "h2svc": dict(instant_frames=1, short_frames=2, episodic_frames=3)}


@pytest.mark.parametrize("policy,call,after,error", [
    ("hermes", "append_video", 0, torch.OutOfMemoryError),   # the chunk's prefill
    ("hermes", "append_video", 1, KeyboardInterrupt),        # the step's guidance pass (its first prompt)
    ("hermes", "ask", 0, KeyboardInterrupt),                 # the question's prefill
    ("hermes", "ask", 2, torch.OutOfMemoryError),            # the second decode step
    ("hermes", "forward_context", 0, torch.OutOfMemoryError),  # text stored through the cache's own context
    ("hermes", "plain forward", 0, KeyboardInterrupt),        # text run straight on the cache (no context)
    ("h2svc", "append_video", 0, KeyboardInterrupt),
    ("h2svc", "ask", 1, torch.OutOfMemoryError),
])
def test_a_fault_in_a_middle_linear_layer_changes_nothing(policy, call, after, error):
    """Decoder layer 3 (a linear-attention layer between full ones) raises on its (after + 1)-th run inside
    `append_video` (a compressing / stepping chunk), `ask`, or a text forward through the cache in a forward context
    or in none (no `atomic()` to put anything back): every valid slot and linear state keeps its bytes,
    the counters, stats and history are as before, and the stream then takes two more chunks exactly as a stream
    that never failed."""
    g = torch.Generator().manual_seed(5)
    model = tiny_qwen3_5()
    faulty, clean = (stream_of(model, policy, **EVICTING[policy]) for _ in range(2))
    chunks = video(5, g)
    for chunk in chunks[:2]:
        for stream in (faulty, clean):
            stream.append_video(**chunk)
    before, host = contents(faulty), (faulty.cache.counters, faulty.stats(), list(faulty.last_convs))
    runs = [0]

    def raiser(module, args):
        runs[0] += 1
        if runs[0] > after:
            raise error("injected into decoder layer 3")

    hook = model.model.language_model.layers[3].register_forward_pre_hook(raiser)
    try:
        with pytest.raises(error, match="injected"):
            if call == "ask":
                faulty.ask(QUESTION, max_new_tokens=4)
            elif call == "append_video":
                faulty.append_video(**chunks[2])
            else:  # no atomic() around it: the linear states' own context must drop what the layers wrote
                ids = torch.tensor([faulty.prefix_ids[:5]])
                with torch.no_grad(), (faulty.cache.forward_context() if call == "forward_context" else nullcontext()):
                    faulty.language_model(input_ids=ids, cache=faulty.cache, use_cache=True)
    finally:
        hook.remove()
    assert runs[0] == after + 1
    assert_same_contents(contents(faulty), before, f"a fault in {call}")
    assert (faulty.cache.counters, faulty.stats(), list(faulty.last_convs)) == host
    for chunk in chunks[2:4]:
        for stream in (faulty, clean):
            stream.append_video(**chunk)
    assert_same_stream(POLICIES[policy], faulty, clean)


# ---- 6. the MoE twin ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["hermes", "h2svc"])
def test_the_moe_twin_streams_and_answers(policy):
    """Qwen3.5-MoE (sparse MLPs, the same hybrid layer types): three chunks with the policy's step evicting, an
    answer, and the three linear-attention layers' states held, finite, in transformers' shapes."""
    g = torch.Generator().manual_seed(6)
    model = tiny_qwen3_5_moe()
    stream = stream_of(model, policy, **EVICTING[policy])
    results = [stream.append_video(**chunk) for chunk in video(3, g)]
    assert [result is None for result in results] == ([True, False, False] if policy == "hermes" else [False] * 3)
    answer = stream.ask(QUESTION, max_new_tokens=4)
    assert isinstance(answer, str) and stream.last_convs[0].startswith(QUESTION)
    linear = stream.cache.linear_contents()
    assert sorted(linear) == sorted(f"linear layer {i} {kind} state" for i in LINEAR for kind in ("conv", "recurrent"))
    for i in LINEAR:
        attn = model.model.language_model.layers[i].linear_attn
        conv, recurrent = linear[f"linear layer {i} conv state"], linear[f"linear layer {i} recurrent state"]
        assert conv.shape == (1, attn.conv_dim, attn.conv_kernel_size)
        assert recurrent.shape == (1, attn.num_v_heads, attn.head_k_dim, attn.head_v_dim)
        assert recurrent.dtype == torch.float32
        assert all(bool(t.isfinite().all()) and torch.count_nonzero(t) > 0 for t in (conv, recurrent))

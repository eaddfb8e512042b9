"""The streaming front: feed video chunk by chunk, ask questions, memory stays flat (DESIGN.md §1, §3–4).

    stream = HermesStream(model, processor, budget=6000)       # LLaVA-OneVision or Qwen2.5-VL
    stream = HermesStream(model, processor, policy="h2svc", head_map="map.json")   # or H2SVC (H2SVC.md)
    stream.append_video(chunk)                                 # prefill; past the budget: guidance + compress_step
    print(stream.ask("What is the person holding?", max_new_tokens=32))
    print(stream.stats())                                      # length, positions, steps, bytes
    stream.reset()                                             # a new video, same buffers

After every chunk whose visual tokens exceed the budget the stream scores the cache with the guidance prompts
(`hermes.guidance`) and runs one in-place compression step (`HermesCache.compress`), so the cache holds
prefix + budget tokens between chunks. By default (`fused_guidance=True`) the prompts ride behind the chunk in
its own prefill forward: one forward per chunk, the chunk stored exactly as a plain prefill stores it, the
prompts read-only (DESIGN.md §4). `fused_guidance=False` runs the prefill and then a separate guidance pass.
Questions go through `model.generate` with the cache; afterwards the cache is truncated back, so question and
answer never stay in the video memory, and the last question and answer fill the guidance prompts of the next
steps (appendix B). Streams in lockstep may ask questions of different token lengths: the batch is
left-padded and the padding hidden from every query, so each stream gets the answer it would get alone.

Failures. `append_video`, `ask`, `next_token_logits` and `guidance_scores` are all-or-nothing: any exception
(bad input, a vision-tower or layer failure, an out-of-memory, a KeyboardInterrupt) raised before the
in-place compaction of the cache starts leaves the stream exactly as it was (length, positions, history,
step counters, `last_step`), and the next call works as if the failed one never happened. Bad input to the
compaction is caught by its validation before any write. A failure during the compaction's writes themselves
(a device error, an interrupt between row moves) cannot be undone: the cache is then `undefined`, every call
raises RuntimeError, and `reset()` starts a new video in the same buffers.

Threads. Different streams on one model may be driven from different threads at once (the attention function
finds its cache through a per-thread hand-off, `hermes.cache.claim_update`); one stream is not meant to be
driven from two threads at once.

Policies. Everything HERMES-specific sits in `HermesPolicy` (the preset, the cache, what runs after a chunk's
prefill); the front (encoding, room checks, atomicity, questions) talks to the cache only through the
`StreamCache` methods. H2SVC is the second entry of `POLICIES` (`hermes.h2svc.policy.H2SVCPolicy`, its
`H2SVCCache`: a step after every chunk, no guidance pass); `append_video`, `ask`, `next_token_logits`, `reset`
and `stats` behave the same under both, failure semantics included.
"""
from __future__ import annotations

from typing import Iterator, Protocol, Sequence

import torch

import hermes_kernels as hk
from hermes.attention import patch_model
from hermes.cache import HermesCache, prefill
from hermes.config import HermesConfig
from hermes.guidance import GuidancePlan, guidance_length, run_guidance
from hermes.h2svc.policy import H2SVCChunkResult, H2SVCPolicy
from hermes.models import VideoChunk, family_of
from hermes.reference import CompressResult


class StreamCache(Protocol):
    """What the front needs from a policy's cache (`HermesCache`, `H2SVCCache`; both `hermes.cache.StreamCacheBase`):
    a transformers `Cache` that takes forwards described by `forward_context`, says how many more tokens fit
    (`room`), undoes failed calls (`atomic`) and reports `stats`."""

    length: int
    capacity: int
    mrope: bool
    undefined: bool

    def forward_context(self, rel_positions=None, *, read_only: bool = False,
                        left_padding: torch.Tensor | None = None): ...

    def default_position_ids(self, count: int, start: int | None = None) -> torch.Tensor: ...

    def room(self) -> int: ...

    def atomic(self) -> Iterator: ...

    def truncate(self, length: int) -> None: ...

    def reset(self) -> None: ...

    def stats(self) -> dict: ...


class HermesPolicy:
    """HERMES behind the front (DESIGN.md §2): the family preset, a `HermesCache` sized prefix + budget + chunk +
    room, and what follows a chunk's prefill: guidance + one compression step once the budget is exceeded.

    Args (HermesStream keyword arguments):
        budget:         visual tokens kept per layer (|M|).
        reindex:        "lazy" (streaming, default) or "eager" re-indexing of positions (§2.7).
        config:         a full `HermesConfig` instead of the family preset (prefix_len and num_layers must match).
        fused_guidance: True (default): guidance prompts in the chunk's own prefill forward (§4); False: a
                        separate guidance pass after the prefill.
        overrides:      further preset fields (e.g. margin=..., summary=False).
    """

    def __init__(self, stream: "HermesStream", *, budget: int = 6000, reindex: str = "lazy",
                 config: HermesConfig | None = None, fused_guidance: bool = True, **overrides):
        if not isinstance(fused_guidance, bool):
            raise TypeError(f"fused_guidance: expected a bool, got {fused_guidance!r}")
        language_model, prefix_len = stream.language_model, len(stream.prefix_ids)
        text_config = stream.model.config.get_text_config()
        num_layers = len(language_model.layers)
        if config is None:
            config = stream.family.preset(num_layers, budget, prefix_len, text_config.max_position_embeddings,
                                          reindex=reindex, **overrides)
        elif overrides or not isinstance(config, HermesConfig):
            raise TypeError("config: pass a HermesConfig alone, or budget/reindex/overrides for the preset")
        if config.num_layers != num_layers or config.prefix_len != prefix_len:
            raise ValueError(f"config: expected num_layers={num_layers} and prefix_len={prefix_len} "
                             f"(the prefix tokens), got {config.num_layers} and {config.prefix_len}")
        inv_freq, mrope_section = stream.family.rotary(stream.model)
        attention = language_model.layers[0].self_attn
        self.cfg = config
        self.fused_guidance = fused_guidance
        self.cache = HermesCache(
            config, batch_size=stream.batch_size, num_kv_heads=text_config.num_key_value_heads,
            head_dim=attention.head_dim, capacity=config.prefix_len + config.budget + stream.chunk_tokens + stream.room,
            dtype=attention.k_proj.weight.dtype, inv_freq=inv_freq, mrope_section=mrope_section,
            layer_devices=[layer.self_attn.k_proj.weight.device for layer in language_model.layers])
        self.plan = GuidancePlan.from_config(config)
        self._prompt_ids: tuple[tuple, list] | None = None  # (last_convs, their prompts' token ids)

    def prompt_ids(self, stream: "HermesStream") -> list[list[list[int]]]:
        """`plan.token_ids` for the streams' last conversations, tokenized again only when those change (every
        compressing chunk needs them; tokenizing both prompts cost ~0.2 ms a chunk on the tiny models)."""
        key = tuple(stream.last_convs)
        if self._prompt_ids is None or self._prompt_ids[0] != key:
            self._prompt_ids = key, self.plan.token_ids(stream.tokenizer, stream.last_convs)
        return self._prompt_ids[1]

    def append_chunk(self, stream: "HermesStream", chunk: VideoChunk) -> CompressResult | None:
        """Prefill `chunk`; past the budget score and compress (the step's result), else None. Raises ValueError
        before any forward when the chunk and its guidance prompts do not fit the cache."""
        cache, cfg = self.cache, self.cfg
        count = chunk.embeds.shape[1]
        compress = cache.length + count - cfg.prefix_len > cfg.budget
        ids = self.prompt_ids(stream) if compress else None
        needed = cache.length + count + (guidance_length(ids) if compress else 0)
        if needed > cache.capacity:
            raise ValueError(f"room: the chunk ({count} tokens) and the guidance prompts need {needed} slots, "
                             f"the cache has {cache.capacity}; raise room or chunk_tokens")
        if compress and self.fused_guidance and self.plan.kinds:
            attn = run_guidance(stream.language_model, cache, self.plan, ids, stream.backend, chunk=chunk)
        else:
            prefill(stream.language_model, cache, chunk)
            if not compress:
                return None
            attn = run_guidance(stream.language_model, cache, self.plan, ids, stream.backend)
        return cache.compress(attn, backend=stream.backend)

    def guidance_scores(self, stream: "HermesStream", layers: Sequence[int] | None) -> torch.Tensor:
        """Pooled guidance attention [L, B, V] of a read-only pass over the cache as it is (a copy)."""
        plan = self.plan if layers is None else GuidancePlan.from_config(self.cfg, layers)
        ids = plan.token_ids(stream.tokenizer, stream.last_convs)
        stream.check_room(guidance_length(ids))
        return run_guidance(stream.language_model, self.cache, plan, ids, stream.backend).clone()


POLICIES = {"hermes": HermesPolicy, "h2svc": H2SVCPolicy}


class HermesStream:
    """A KV-cache policy (HERMES by default) over a loaded LLaVA-OneVision or Qwen2.5-VL model, for `batch_size`
    streams in lockstep.

    Args:
        model:        a loaded `LlavaOnevisionForConditionalGeneration` or `Qwen2_5_VLForConditionalGeneration`;
                      its language model's attention is switched to "hermes" (`hermes.attention`).
        processor:    the model's processor (its tokenizer and video processor are used) or a tokenizer.
        policy:       the cache policy, a key of `POLICIES`: "hermes" (DESIGN.md) or "h2svc" (H2SVC.md).
        batch_size:   streams advanced in lockstep (each chunk brings one clip per stream).
        chunk_frames: frames per chunk; with `frame_size` (Qwen2.5-VL) it sizes the chunk room of the cache;
                      `chunk_tokens` sets that room directly.
        room:         slots past the kept tokens and a chunk, for guidance prompts and a question with its answer.
        frame_size:   (height, width) of the processed frames (Qwen2.5-VL: sizes the chunks and H2SVC's frames).
        system_prompt: text of the system turn in the prefix (default: the family's).
        backend:      "auto" | "triton" | "torch": hermes_kernels backend of the policy's kernels (HERMES: the
                      guidance pooled attention and the compression step; H2SVC: the class-block step).
        policy_args:  the policy's own arguments; HERMES: budget (default 6000), reindex, config, fused_guidance
                      and preset overrides (see `HermesPolicy`); H2SVC: head_map, tokens_per_frame, reindex and
                      window / ratio overrides (see `H2SVCPolicy`).
    """

    def __init__(self, model: torch.nn.Module, processor=None, *, policy: str = "hermes", batch_size: int = 1,
                 chunk_frames: int = 16, chunk_tokens: int | None = None, frame_size: tuple[int, int] | None = None,
                 room: int = 512, system_prompt: str | None = None, backend: str = "auto", **policy_args):
        self.family = family_of(model)
        self.tokenizer = getattr(processor, "tokenizer", processor)
        if self.tokenizer is None or not callable(self.tokenizer):
            raise TypeError("processor: expected the model's processor or a tokenizer (guidance prompts and "
                            f"questions are tokenized), got {type(processor).__name__}")
        for name, value in (("batch_size", batch_size), ("chunk_frames", chunk_frames), ("room", room)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if backend not in hk.BACKENDS:
            raise ValueError(f"backend: expected one of {hk.BACKENDS}, got {backend!r}")
        if policy not in POLICIES:
            raise ValueError(f"policy: expected one of {sorted(POLICIES)}, got {policy!r}")
        self.model = model
        self.processor = processor
        self.backend = backend
        self.batch_size = batch_size
        self.room = room
        self.frame_size = frame_size
        self.language_model = self.family.language_model(model)
        self.prefix_ids = self._encode(self.family.prefix_text(system_prompt))
        if chunk_tokens is None:
            chunk_tokens = self.family.tokens_per_chunk(model, chunk_frames, frame_size)
        if not isinstance(chunk_tokens, int) or chunk_tokens < 1:
            raise ValueError(f"chunk_tokens: expected a positive int, got {chunk_tokens!r}")
        self.chunk_tokens = chunk_tokens
        self.last_convs: list[str | None] = [None] * batch_size
        self.last_step: CompressResult | H2SVCChunkResult | None = None
        self.policy = POLICIES[policy](self, **policy_args)
        self.cfg = self.policy.cfg
        self.cache: StreamCache = self.policy.cache
        patch_model(model)
        self.reset()

    # ---- public API ---------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Start a new video: empty cache (same buffers), no history, the prefix prefilled again. Also the way out
        of an `undefined` cache."""
        self.cache.reset()
        self.last_convs = [None] * self.batch_size
        self.last_step = None
        ids = torch.tensor([self.prefix_ids] * self.batch_size, device=self._device())
        with torch.no_grad(), self.cache.forward_context():
            self.language_model(input_ids=ids, position_ids=self.cache.default_position_ids(ids.shape[1]),
                                cache=self.cache, use_cache=True)

    def append_video(self, video, **kwargs) -> CompressResult | H2SVCChunkResult | None:
        """Append one chunk (one clip per stream) and run the policy's step: HERMES compresses when the budget is
        exceeded, H2SVC steps every class block after every chunk.

        video: model-ready pixel values (LLaVA-OV [B, F, C, S, S]; Qwen2.5-VL flattened patches with
        `grid_thw=`) or raw frames for the processor's video processor. Qwen2.5-VL also takes
        `seconds_per_grid=`. Returns the step's result (HERMES `CompressResult`, H2SVC `H2SVCChunkResult`), or
        None when no step ran. All or nothing: see the module docstring.
        """
        self._check_usable()
        with torch.no_grad():
            chunk = self.family.encode_video(self.model, self.processor, video, self.batch_size, **kwargs)
            count = chunk.embeds.shape[1]
            if count > self.chunk_tokens:
                raise ValueError(f"video: the chunk has {count} visual tokens, the cache was sized for chunks of "
                                 f"at most chunk_tokens={self.chunk_tokens}")
            with self.cache.atomic():
                result = self.policy.append_chunk(self, chunk)
        if result is not None:
            self.last_step = result
        return result

    def ask(self, question: str | Sequence[str], max_new_tokens: int = 64, **generate_kwargs) -> str | list[str]:
        """Answer from the cache through `model.generate`; the cache keeps only the video afterwards.

        question: one string for every stream, or one per stream (any token lengths). Returns a string
        (batch_size 1) or one string per stream. Greedy unless generate_kwargs say otherwise.
        """
        self._check_usable()
        questions, ids, pads = self._question_ids(question)
        answer_ids = self._generate(ids, pads, max_new_tokens, **generate_kwargs)
        answers = self.tokenizer.batch_decode(answer_ids, skip_special_tokens=True)
        self.last_convs = [f"{q} {a.strip()}" for q, a in zip(questions, answers)]
        return answers[0] if self.batch_size == 1 else answers

    def next_token_logits(self, question: str | Sequence[str]) -> torch.Tensor:
        """Logits [B, vocab] of the first answer token, from one read-only forward (nothing is stored):
        for multiple-choice scoring and checks. Questions may differ in token length."""
        self._check_usable()
        _, ids, pads = self._question_ids(question)
        self.check_room(ids.shape[1])
        with torch.no_grad(), self.cache.atomic(), \
                self.cache.forward_context(self._padded_offsets(ids, pads), read_only=True, left_padding=pads):
            out = self.model(input_ids=ids, position_ids=self.cache.default_position_ids(ids.shape[1]),
                             cache=self.cache, use_cache=True, logits_to_keep=1, **self.family.text_kwargs(ids))
        return out.logits[:, -1]

    def guidance_scores(self, layers: Sequence[int] | None = None) -> torch.Tensor:
        """Pooled guidance attention float32 [L, B, V] over the current cache (read-only), for `layers`
        (default: the layers the policy reads). A copy; the cache is unchanged. HERMES only."""
        if not hasattr(self.policy, "guidance_scores"):
            raise ValueError(f"guidance_scores: the {type(self.policy).__name__} runs no guidance pass")
        self._check_usable()
        with torch.no_grad(), self.cache.atomic():
            return self.policy.guidance_scores(self, layers)

    def stats(self) -> dict:
        """length, capacity, positions (smallest, largest), steps, compactions, bytes_allocated."""
        return self.cache.stats()

    def check_room(self, count: int) -> None:
        """ValueError unless `count` more tokens fit past the cache's length."""
        if count > self.cache.room():
            raise ValueError(f"room: {count} more tokens do not fit (length {self.cache.length}, capacity "
                             f"{self.cache.capacity}); raise room")

    # ---- helpers ----------------------------------------------------------------------------------------
    def _device(self) -> torch.device:
        return self.language_model.embed_tokens.weight.device

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _check_usable(self) -> None:
        if self.cache.undefined:
            raise RuntimeError("stream: a failure inside a compression step left the cache undefined (its video "
                               "memory is lost); call reset()")
        if self.cache.length < len(self.prefix_ids):
            raise RuntimeError("stream: the prefix is missing from the cache (an interrupted reset()); call reset()")

    def _question_ids(self, question) -> tuple[list[str], torch.Tensor, torch.Tensor | None]:
        """(questions, ids [B, T] left-padded to the longest, padding per stream int64 [B] or None if none)."""
        if isinstance(question, str):
            questions = [question] * self.batch_size
        elif isinstance(question, (list, tuple)) and len(question) == self.batch_size and \
                all(isinstance(q, str) for q in question):
            questions = list(question)
        else:
            raise TypeError(f"question: expected a string or {self.batch_size} strings, got {question!r}")
        ids = [self._encode(self.family.question_text(q)) for q in questions]
        count = max(len(i) for i in ids)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        device = self._device()
        padded = torch.tensor([[pad] * (count - len(i)) + i for i in ids], device=device)
        if all(len(i) == count for i in ids):
            return questions, padded, None
        return questions, padded, torch.tensor([count - len(i) for i in ids], device=device)

    def _padded_offsets(self, ids: torch.Tensor, pads: torch.Tensor | None) -> torch.Tensor | None:
        """Position offsets [B, T] ([B, 3, T] M-RoPE) of a left-padded question: each stream's tokens count from
        0 at its first real token (padding sits at 0 too, hidden); None when nothing is padded."""
        if pads is None:
            return None
        rel = (torch.arange(ids.shape[1], device=ids.device) - pads[:, None]).clamp(min=0)
        return rel[:, None, :].expand(-1, 3, -1) if self.cache.mrope else rel

    def _generate(self, ids: torch.Tensor, pads: torch.Tensor | None, max_new_tokens: int,
                  **generate_kwargs) -> torch.Tensor:
        """Generated token ids [B, <= max_new_tokens]; the cache is truncated back afterwards."""
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected a positive int, got {max_new_tokens!r}")
        for name in ("num_beams", "num_return_sequences"):
            if generate_kwargs.get(name, 1) != 1:
                raise ValueError(f"{name}: the streams are fixed in lockstep; only 1 is supported")
        self.check_room(ids.shape[1] + max_new_tokens)
        length = self.cache.length
        total = length + ids.shape[1]
        # generate gets only the question ids; the mask covering the cached slots tells it so, and the
        # positions are the defaults the attention function rotates from (padding is hidden by the cache)
        generate_kwargs.setdefault("do_sample", False)
        generate_kwargs.setdefault("pad_token_id", self.tokenizer.pad_token_id or self.tokenizer.eos_token_id)
        if self.tokenizer.eos_token_id is not None:
            generate_kwargs.setdefault("eos_token_id", self.tokenizer.eos_token_id)
        with torch.no_grad(), self.cache.atomic():
            with self.cache.forward_context(self._padded_offsets(ids, pads), left_padding=pads):
                out = self.model.generate(
                    input_ids=ids, attention_mask=torch.ones(ids.shape[0], total, dtype=torch.long,
                                                             device=ids.device),
                    position_ids=self.cache.default_position_ids(total, start=0), cache=self.cache,
                    max_new_tokens=max_new_tokens, **self.family.text_kwargs(ids), **generate_kwargs)
            self.cache.truncate(length)
        return out[:, ids.shape[1]:]

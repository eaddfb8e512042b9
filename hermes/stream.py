"""The streaming front: feed video chunk by chunk, ask questions, memory stays flat (DESIGN.md §1, §3).

    stream = HermesStream(model, processor, budget=6000)       # LLaVA-OneVision or Qwen2.5-VL
    stream.append_video(chunk)                                 # after each chunk: guidance + compress_step
    print(stream.ask("What is the person holding?", max_new_tokens=32))
    print(stream.stats())                                      # length, positions, steps, bytes
    stream.reset()                                             # a new video, same buffers

After every chunk whose visual tokens exceed the budget the stream runs the guidance pass
(`hermes.guidance`) and one in-place compression step (`HermesCache.compress`), so the cache holds
prefix + budget tokens between chunks. Questions go through `model.generate` with the cache; afterwards the
cache is truncated back, so question and answer never stay in the video memory, and the last question and
answer fill the guidance prompts of the next steps (appendix B).
"""
from __future__ import annotations

from typing import Sequence

import torch

import hermes_kernels as hk
from hermes.attention import patch_model
from hermes.cache import HermesCache
from hermes.config import HermesConfig
from hermes.guidance import GuidancePlan, guidance_length, run_guidance
from hermes.models import family_of
from hermes.reference import CompressResult


class HermesStream:
    """HERMES over a loaded LLaVA-OneVision or Qwen2.5-VL model, for `batch_size` streams in lockstep.

    Args:
        model:        a loaded `LlavaOnevisionForConditionalGeneration` or `Qwen2_5_VLForConditionalGeneration`;
                      its language model's attention is switched to "hermes" (`hermes.attention`).
        processor:    the model's processor (its tokenizer and video processor are used) or a tokenizer.
        budget:       visual tokens kept per layer (|M|).
        batch_size:   streams advanced in lockstep (each chunk brings one clip per stream).
        chunk_frames: frames per chunk; with `frame_size` (Qwen2.5-VL) it sizes the chunk room of the cache;
                      `chunk_tokens` sets that room directly.
        room:         slots past prefix + budget + chunk for guidance prompts and a question with its answer.
        reindex:      "lazy" (streaming, default) or "eager" re-indexing of positions (§2.7).
        config:       a full `HermesConfig` instead of the family preset (prefix_len and num_layers must match).
        system_prompt: text of the system turn in the prefix (default: the family's).
        backend:      "auto" | "triton" | "torch": hermes_kernels backend of the guidance pooled attention
                      and the compression step.
        overrides:    further preset fields (e.g. margin=..., summary=False).
    """

    def __init__(self, model: torch.nn.Module, processor=None, *, budget: int = 6000, batch_size: int = 1,
                 chunk_frames: int = 16, chunk_tokens: int | None = None, frame_size: tuple[int, int] | None = None,
                 room: int = 512, reindex: str = "lazy", config: HermesConfig | None = None,
                 system_prompt: str | None = None, backend: str = "auto", **overrides):
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
        self.model = model
        self.processor = processor
        self.backend = backend
        self.batch_size = batch_size
        self.language_model = self.family.language_model(model)
        self.prefix_ids = self._encode(self.family.prefix_text(system_prompt))
        text_config = model.config.get_text_config()
        num_layers = len(self.language_model.layers)
        if config is None:
            config = self.family.preset(num_layers, budget, len(self.prefix_ids),
                                        text_config.max_position_embeddings, reindex=reindex, **overrides)
        elif overrides or not isinstance(config, HermesConfig):
            raise TypeError("config: pass a HermesConfig alone, or budget/reindex/overrides for the preset")
        if config.num_layers != num_layers or config.prefix_len != len(self.prefix_ids):
            raise ValueError(f"config: expected num_layers={num_layers} and prefix_len={len(self.prefix_ids)} "
                             f"(the prefix tokens), got {config.num_layers} and {config.prefix_len}")
        self.cfg = config
        if chunk_tokens is None:
            chunk_tokens = self.family.tokens_per_chunk(model, chunk_frames, frame_size)
        if not isinstance(chunk_tokens, int) or chunk_tokens < 1:
            raise ValueError(f"chunk_tokens: expected a positive int, got {chunk_tokens!r}")
        self.chunk_tokens = chunk_tokens
        inv_freq, mrope_section = self.family.rotary(model)
        attention = self.language_model.layers[0].self_attn
        self.cache = HermesCache(
            config, batch_size=batch_size, num_kv_heads=text_config.num_key_value_heads,
            head_dim=attention.head_dim, capacity=config.prefix_len + config.budget + chunk_tokens + room,
            dtype=attention.k_proj.weight.dtype, inv_freq=inv_freq, mrope_section=mrope_section,
            layer_devices=[layer.self_attn.k_proj.weight.device for layer in self.language_model.layers])
        self.plan = GuidancePlan.from_config(config)
        self.last_convs: list[str | None] = [None] * batch_size
        self.last_step: CompressResult | None = None
        patch_model(model)
        self.reset()

    # ---- public API ---------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Start a new video: empty cache (same buffers), no history, the prefix prefilled again."""
        self.cache.reset()
        self.last_convs = [None] * self.batch_size
        self.last_step = None
        ids = torch.tensor([self.prefix_ids] * self.batch_size, device=self.cache.guidance_attn.device)
        with torch.no_grad(), self.cache.forward_context():
            self.language_model(input_ids=ids, position_ids=self.cache.default_position_ids(ids.shape[1]),
                                cache=self.cache, use_cache=True)

    def append_video(self, video, **kwargs) -> CompressResult | None:
        """Append one chunk (one clip per stream) and compress when the budget is exceeded.

        video: model-ready pixel values (LLaVA-OV [B, F, C, S, S]; Qwen2.5-VL flattened patches with
        `grid_thw=`) or raw frames for the processor's video processor. Qwen2.5-VL also takes
        `seconds_per_grid=`. Returns the step's `CompressResult`, or None when no step ran. Bad input raises
        before the cache changes.
        """
        with torch.no_grad():
            chunk = self.family.encode_video(self.model, self.processor, video, self.batch_size, **kwargs)
            count = chunk.embeds.shape[1]
            if count > self.chunk_tokens:
                raise ValueError(f"video: the chunk has {count} visual tokens, the cache was sized for chunks of "
                                 f"at most chunk_tokens={self.chunk_tokens}")
            compress = self.cache.length + count - self.cfg.prefix_len > self.cfg.budget
            guidance_ids = self.plan.token_ids(self.tokenizer, self.last_convs) if compress else None
            needed = self.cache.length + count + (guidance_length(guidance_ids) if compress else 0)
            if needed > self.cache.capacity:
                raise ValueError(f"room: the chunk ({count} tokens) and the guidance prompts need {needed} slots, "
                                 f"the cache has {self.cache.capacity}; raise room or chunk_tokens")
            with self.cache.forward_context(chunk.rel_positions):
                self.language_model(inputs_embeds=chunk.embeds, position_ids=self.cache.default_position_ids(count),
                                    cache=self.cache, use_cache=True)
            if not compress:
                return None
            attn = run_guidance(self.language_model, self.cache, self.plan, guidance_ids, self.backend)
            self.last_step = self.cache.compress(attn, backend=self.backend)
            return self.last_step

    def ask(self, question: str | Sequence[str], max_new_tokens: int = 64, **generate_kwargs) -> str | list[str]:
        """Answer from the cache through `model.generate`; the cache keeps only the video afterwards.

        question: one string for every stream, or one per stream (tokenizing to the same length). Returns a
        string (batch_size 1) or one string per stream. Greedy unless generate_kwargs say otherwise.
        """
        ids = self._question_ids(question)
        answer_ids = self._generate(ids, max_new_tokens, **generate_kwargs)
        answers = self.tokenizer.batch_decode(answer_ids, skip_special_tokens=True)
        questions = [question] * self.batch_size if isinstance(question, str) else list(question)
        self.last_convs = [f"{q} {a.strip()}" for q, a in zip(questions, answers)]
        return answers[0] if self.batch_size == 1 else answers

    def next_token_logits(self, question: str | Sequence[str]) -> torch.Tensor:
        """Logits [B, vocab] of the first answer token, from one read-only forward (nothing is stored):
        for multiple-choice scoring and checks."""
        ids = self._question_ids(question)
        self._check_room(ids.shape[1])
        with torch.no_grad(), self.cache.forward_context(read_only=True):
            out = self.model(input_ids=ids, position_ids=self.cache.default_position_ids(ids.shape[1]),
                             cache=self.cache, use_cache=True, logits_to_keep=1, **self.family.text_kwargs(ids))
        return out.logits[:, -1]

    def guidance_scores(self, layers: Sequence[int] | None = None) -> torch.Tensor:
        """Pooled guidance attention float32 [L, B, V] over the current cache (read-only), for `layers`
        (default: the layers the policy reads). A copy; the cache is unchanged."""
        plan = self.plan if layers is None else GuidancePlan.from_config(self.cfg, layers)
        ids = plan.token_ids(self.tokenizer, self.last_convs)
        self._check_room(guidance_length(ids))
        with torch.no_grad():
            return run_guidance(self.language_model, self.cache, plan, ids, self.backend).clone()

    def stats(self) -> dict:
        """length, capacity, positions (smallest, largest), steps, compactions, bytes_allocated."""
        return self.cache.stats()

    # ---- helpers ----------------------------------------------------------------------------------------
    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _question_ids(self, question) -> torch.Tensor:
        if isinstance(question, str):
            questions = [question] * self.batch_size
        elif isinstance(question, (list, tuple)) and len(question) == self.batch_size and \
                all(isinstance(q, str) for q in question):
            questions = list(question)
        else:
            raise TypeError(f"question: expected a string or {self.batch_size} strings, got {question!r}")
        ids = [self._encode(self.family.question_text(q)) for q in questions]
        if any(len(i) != len(ids[0]) for i in ids):
            raise ValueError(f"question: streams in lockstep need questions of one token length, got "
                             f"{[len(i) for i in ids]}")
        return torch.tensor(ids, device=self.cache.guidance_attn.device)

    def _check_room(self, count: int) -> None:
        if self.cache.length + count > self.cache.capacity:
            raise ValueError(f"room: {count} more tokens do not fit (length {self.cache.length}, capacity "
                             f"{self.cache.capacity}); raise room")

    def _generate(self, ids: torch.Tensor, max_new_tokens: int, **generate_kwargs) -> torch.Tensor:
        """Generated token ids [B, <= max_new_tokens]; the cache is truncated back afterwards."""
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected a positive int, got {max_new_tokens!r}")
        for name in ("num_beams", "num_return_sequences"):
            if generate_kwargs.get(name, 1) != 1:
                raise ValueError(f"{name}: the streams are fixed in lockstep; only 1 is supported")
        self._check_room(ids.shape[1] + max_new_tokens)
        length = self.cache.length
        total = length + ids.shape[1]
        # generate gets only the question ids; the mask covering the cached slots tells it so, and the
        # positions are the defaults the attention function rotates from
        generate_kwargs.setdefault("do_sample", False)
        generate_kwargs.setdefault("pad_token_id", self.tokenizer.pad_token_id or self.tokenizer.eos_token_id)
        if self.tokenizer.eos_token_id is not None:
            generate_kwargs.setdefault("eos_token_id", self.tokenizer.eos_token_id)
        try:
            with torch.no_grad():
                out = self.model.generate(
                    input_ids=ids, attention_mask=torch.ones(ids.shape[0], total, dtype=torch.long,
                                                             device=ids.device),
                    position_ids=self.cache.default_position_ids(total, start=0), cache=self.cache,
                    max_new_tokens=max_new_tokens, **self.family.text_kwargs(ids), **generate_kwargs)
        finally:
            self.cache.truncate(length)
        return out[:, ids.shape[1]:]

"""The streaming front: feed video chunk by chunk, ask questions, memory stays flat (docs/stream.md).

`HermesStream(model, processor, policy="hermes" | "h2svc", ...)` is one class for every policy: it builds the
`StreamSetup` the policy is constructed from (docs/policies.md#setup), encodes chunks (`append_video`), checks room,
makes every call all-or-nothing, asks questions (`ask`, `next_token_logits`), serves streams on several threads
and resets; the policy holds the config, the cache and what follows a chunk's prefill. Usage: docs/stream.md#hermes;
what fails how: docs/stream.md#both-policies; under tensor parallelism: docs/multi-gpu.md.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch

from hermes.attention import patch_model
from hermes.cache import StreamCacheBase
from hermes.parallel import RankGuard
from hermes.policy import StreamPolicy, StreamSetup, get_policy
from hermes_kernels.engine.checks import check_positive_int
from hermes_kernels.engine.dispatch import check_backend


class HermesStream:
    """A KV-cache policy (HERMES by default) over a loaded model of a registered family (`hermes.models.FAMILIES`:
    LLaVA-OneVision, Qwen2.5-VL, Qwen3-VL, Qwen3.5 and Qwen3.5-MoE; docs/families.md), for `batch_size` streams in
    lockstep.

    Args:
        model:        a loaded model of a registered family (e.g. `LlavaOnevisionForConditionalGeneration`,
                      `Qwen3VLForConditionalGeneration`, `Qwen3_5ForConditionalGeneration`);
                      its language model's attention is switched to "hermes" (`hermes.attention`).
        processor:    the model's processor (its tokenizer and video processor are used) or a tokenizer.
        policy:       the cache policy by its registered name (`hermes.policy.policy_names()`): "hermes"
                      (docs/hermes.md) or "h2svc" (docs/h2svc.md).
        batch_size:   streams advanced in lockstep (each chunk brings one clip per stream).
        chunk_frames: frames per chunk; with `frame_size` (Qwen-VL) it sizes the chunk room of the cache;
                      `chunk_tokens` sets that room directly.
        room:         slots past the kept tokens and a chunk, for guidance prompts and a question with its answer.
        frame_size:   (height, width) of the processed frames (Qwen-VL: sizes the chunks and H2SVC's frames).
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
        # everything the policy is built from, checked and complete before it exists (docs/policies.md#setup)
        self.setup = StreamSetup.build(model, processor, batch_size=batch_size, chunk_frames=chunk_frames,
                                       chunk_tokens=chunk_tokens, frame_size=frame_size, room=room,
                                       system_prompt=system_prompt, backend=backend)
        self.policy: StreamPolicy = get_policy(policy)(self.setup, **policy_args)
        self.cfg = self.policy.cfg
        self.cache: StreamCacheBase = self.policy.cache
        self.last_convs: list[str | None] = [None] * batch_size
        self.last_step: Any = None
        self._ranks = RankGuard(self.setup.shard)  # tensor parallelism: refuse calls once ranks may be out of step
        patch_model(model)
        self.reset()

    # ---- what the stream was built with (its `StreamSetup`) ---------------------------------------------------
    model = property(lambda self: self.setup.model)
    processor = property(lambda self: self.setup.processor)
    tokenizer = property(lambda self: self.setup.tokenizer)
    family = property(lambda self: self.setup.family)
    language_model = property(lambda self: self.setup.language_model)
    batch_size = property(lambda self: self.setup.batch_size)
    chunk_tokens = property(lambda self: self.setup.chunk_tokens)
    room = property(lambda self: self.setup.room)
    frame_size = property(lambda self: self.setup.frame_size)
    prefix_ids = property(lambda self: self.setup.prefix_ids)

    @property
    def backend(self) -> str:
        """The backend of the policy's kernels; settable between calls (the stream and its policy then hold a
        setup with the new backend)."""
        return self.setup.backend

    @backend.setter
    def backend(self, backend: str) -> None:
        check_backend(backend)
        self.setup = self.policy.setup = dataclasses.replace(self.setup, backend=backend)

    # ---- public API ---------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Start a new video: empty cache (same buffers), no history, the prefix prefilled again. Also the way out
        of an `undefined` cache."""
        self._ranks.check()
        self.cache.reset()
        self.last_convs = [None] * self.batch_size
        self.last_step = None
        ids = torch.tensor([self.prefix_ids] * self.batch_size, device=self._device())
        with torch.no_grad(), self._ranks.call(), self.cache.forward_context():
            self.language_model(input_ids=ids, position_ids=self.cache.default_position_ids(ids.shape[1]),
                                cache=self.cache, use_cache=True)

    def append_video(self, video, **kwargs) -> Any:
        """Append one chunk (one clip per stream) and run the policy's step: HERMES compresses when the budget is
        exceeded, H2SVC steps every class block after every chunk.

        video: model-ready pixel values (LLaVA-OV [B, F, C, S, S]; Qwen-VL flattened patches with
        `grid_thw=`) or raw frames for the processor's video processor. Qwen2.5-VL also takes
        `seconds_per_grid=`, Qwen3-VL `timestamps=` (seconds of each temporal step). Returns the step's result
        (HERMES `CompressResult`, H2SVC `H2SVCChunkResult`), or None when no step ran. All or nothing
        (docs/stream.md#both-policies).
        """
        self._check_usable()
        with torch.no_grad(), self._ranks.call():
            chunk = self.family.encode_video(self.model, self.processor, video, self.batch_size, **kwargs)
            count = chunk.embeds.shape[1]
            if count > self.chunk_tokens:
                raise ValueError(f"video: the chunk has {count} visual tokens, the cache was sized for chunks of "
                                 f"at most chunk_tokens={self.chunk_tokens}")
            with self.cache.atomic():
                result = self.policy.append_chunk(chunk, tuple(self.last_convs))
        if result is not None:
            self.last_step = result
        return result

    def ask(self, question: str | Sequence[str], max_new_tokens: int = 64, **generate_kwargs) -> str | list[str]:
        """Answer from the cache through `model.generate`; the cache keeps only the video afterwards.

        question: one string for every stream, or one per stream (any token lengths). Returns a string
        (batch_size 1) or one string per stream. Greedy unless generate_kwargs say otherwise (under tensor
        parallelism always greedy: do_sample=True is refused).
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
        with torch.no_grad(), self._ranks.call(), self.cache.atomic(), \
                self.cache.forward_context(self._padded_offsets(ids, pads), read_only=True, left_padding=pads):
            out = self.model(input_ids=ids, position_ids=self.cache.default_position_ids(ids.shape[1]),
                             cache=self.cache, use_cache=True, logits_to_keep=1, **self.family.text_kwargs(ids))
        return out.logits[:, -1]

    def guidance_scores(self, layers: Sequence[int] | None = None) -> torch.Tensor:
        """Pooled guidance attention float32 [L, B, V] over the current cache (read-only), for `layers`
        (default: the layers the policy reads). A copy; the cache is unchanged. HERMES only."""
        self._check_usable()
        with torch.no_grad(), self._ranks.call(), self.cache.atomic():
            return self.policy.guidance_scores(layers, tuple(self.last_convs))

    def stats(self) -> dict:
        """length, capacity, positions (smallest, largest), steps, reindexes, bytes_allocated."""
        return self.cache.stats()

    def check_room(self, count: int) -> None:
        """ValueError unless `count` more tokens fit past the cache's length."""
        self.cache.check_room(count)

    # ---- helpers ----------------------------------------------------------------------------------------
    def _device(self) -> torch.device:
        return self.language_model.embed_tokens.weight.device

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _pad_id(self) -> int | None:
        """The token that pads a ragged question batch and `generate`'s output: the tokenizer's pad token (id 0
        included), else its end-of-sequence token."""
        pad = self.tokenizer.pad_token_id
        return self.tokenizer.eos_token_id if pad is None else pad

    def _check_usable(self) -> None:
        self._ranks.check()
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
        pad = self._pad_id()
        device = self._device()
        padded = torch.tensor([[pad] * (count - len(i)) + i for i in ids], device=device)
        if all(len(i) == count for i in ids):
            return questions, padded, None
        if self.cache.linear_states is not None or self.cache.windows is not None:
            raise ValueError(f"question: the questions tokenize to {sorted({len(i) for i in ids})} tokens; on a "
                             "model with linear-attention layers (their states) or sliding-window layers (their "
                             "windows count tokens) the padding of a ragged batch would pass through, so every "
                             "stream's question must have the same token length (docs/qwen3_5.md#hybrid-cache, "
                             "docs/gemma4.md#limits)")
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
        check_positive_int("max_new_tokens", max_new_tokens)
        for name in ("num_beams", "num_return_sequences"):
            if generate_kwargs.get(name, 1) != 1:
                raise ValueError(f"{name}: the streams are fixed in lockstep; only 1 is supported")
        if self.setup.shard is not None and generate_kwargs.get("do_sample"):
            raise ValueError("do_sample: under tensor parallelism every rank must pick the same tokens; sampling is "
                             "not supported, answers are greedy")
        self.check_room(ids.shape[1] + max_new_tokens)
        length = self.cache.length
        total = length + ids.shape[1]
        # generate gets only the question ids; the mask covering the cached slots tells it so, and the
        # positions are the defaults the attention function rotates from (padding is hidden by the cache)
        generate_kwargs.setdefault("do_sample", False)
        generate_kwargs.setdefault("pad_token_id", self._pad_id())
        if self.tokenizer.eos_token_id is not None:
            generate_kwargs.setdefault("eos_token_id", self.tokenizer.eos_token_id)
        with torch.no_grad(), self._ranks.call(), self.cache.atomic():
            with self.cache.forward_context(self._padded_offsets(ids, pads), left_padding=pads):
                out = self.model.generate(
                    input_ids=ids, attention_mask=torch.ones(ids.shape[0], total, dtype=torch.long,
                                                             device=ids.device),
                    position_ids=self.cache.default_position_ids(total, start=0), cache=self.cache,
                    max_new_tokens=max_new_tokens, **self.family.text_kwargs(ids), **generate_kwargs)
            self.cache.truncate(length)
        return out[:, ids.shape[1]:]

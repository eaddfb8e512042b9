"""`lmms-eval --model hermes`: lmms-eval's model interface over `HermesStream` (docs/evaluation.md).

Each request's video is decoded by `hermes.video`, prepared by the family (`prepare_frames`) and appended chunk by
chunk to a stream; the task's prompt is then asked from the cache. Requests about one video share one streaming
pass; videos of equal shape share lockstep batches of streams (--batch_size); a multi-round request streams up
to each question and goes on. A video that cannot be read skips its requests (empty answers, one error line).
"""
from __future__ import annotations

import collections
import contextlib
import itertools

import torch
from loguru import logger

from lmms_eval.api.instance import GenerationResult, Instance
from lmms_eval.api.model import lmms

from hermes import commands
from hermes.eval.feed import UnreadableVideo, VideoFeed, merge_inputs, sampled_shape
from hermes.eval.requests import Question, VideoJob, cut_answer, group_by_video, lockstep_batches, rounds
from hermes.eval.settings import check_checkpoint_settings, parse_model_args

# lmms-eval 0.7.3's video multiple-choice tasks scored by loglikelihood over option texts (several tokens each),
# and the generation variants of the same benchmarks, which this model serves
MULTI_TOKEN_TASKS = ("egoschema_mcppl", "egoschema_subset_mcppl", "perceptiontest_val_mcppl",
                     "perceptiontest_test_mcppl", "worldqa_mc_ppl")
GENERATION_TASKS = ("egoschema", "egoschema_subset", "perceptiontest_val_mc", "perceptiontest_test_mc", "worldqa_mc",
                    "videomme", "mlvu_dev", "longvideobench_val_v", "mvbench", "ovobench")


class RaggedBatch(Exception):
    """Videos of one lockstep batch gave different chunks (their shapes were measured alike): the batch is streamed
    again one video at a time."""


class HermesModel(lmms):
    """A local checkpoint streamed with HERMES or H2SVC. Model arguments: `hermes.eval.settings.EvalSettings`
    (every one checked, and the checkpoint's config, tokenizer and head map read, before the weights load).

    `counts[request_type]` says what the last runs did: videos streamed, questions asked, skipped (unreadable
    videos' questions); each call also logs it as one line.
    """

    is_simple = True

    def __init__(self, **model_args):
        super().__init__()
        self.settings = parse_model_args(**model_args)
        _, _, processor = check_checkpoint_settings(self.settings)
        s = self.settings
        self.loaded = commands.load_model(s.pretrained, s.device, s.dtype, processor=processor)
        self.model, self.processor, self.family = self.loaded.model, self.loaded.processor, self.loaded.family
        self.tokenizer = getattr(self.processor, "tokenizer", self.processor)
        self.batch_size = s.batch_size
        self.counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self._stream = None
        self._stream_key = None

    @property
    def device(self) -> torch.device:
        return self.loaded.device

    # ---- lmms-eval's interface --------------------------------------------------------------------------------
    def generate_until(self, requests: list[Instance]) -> list[str]:
        """Answers, one per request: each video streamed once, its questions asked greedily from the cache with the
        task's max_new_tokens and cut at its `until` strings."""
        items = []
        for index, request in enumerate(requests):
            context, gen_kwargs, doc_to_visual, doc_id, task, split = request.args
            label = f"{task}/{doc_id}"
            path = self._video_of(doc_to_visual(self.task_dict[task][split][doc_id]), label)
            until = gen_kwargs.get("until") or ()
            max_new_tokens = gen_kwargs.get("max_new_tokens") or self.settings.max_new_tokens
            items.append((path, Question(index, context, label, max_new_tokens=int(max_new_tokens),
                                         until=(until,) if isinstance(until, str) else tuple(until))))
        return self._answer_jobs(group_by_video(items), len(requests), "generate_until", "")

    def loglikelihood(self, requests: list[Instance]) -> list[GenerationResult]:
        """(negative log-likelihood, is greedy) of each request's continuation as the first token of the answer,
        from the stream's next-token logits, each pair inside a GenerationResult (the comment below says why). The
        value is a loss, as lmms-eval's own models return it and as its multiple_choice scoring reads it (the
        choice of smallest value wins). Every continuation must be one token (after its leading whitespace: the
        answer starts the chat's assistant turn); other tasks are refused before anything streams."""
        items = []
        for index, request in enumerate(requests):
            if len(request.args) != 6:
                raise ValueError(f"loglikelihood: task {request.task_name} asks for a continuation without its "
                                 "video (acc_mutual_info); --model hermes scores continuations after a video only")
            context, continuation, doc_to_visual, doc_id, task, split = request.args
            label = f"{task}/{doc_id}"
            ids = self.tokenizer(continuation.lstrip(), add_special_tokens=False)["input_ids"]
            if len(ids) != 1:
                raise ValueError(
                    f"loglikelihood: task {task} scores a continuation of {len(ids)} tokens ({continuation!r}, "
                    f"{label}); --model hermes scores one-token continuations only, from the stream's next-token "
                    f"logits. Tasks that need several tokens: {', '.join(MULTI_TOKEN_TASKS)}; run their generation "
                    f"variants instead ({', '.join(GENERATION_TASKS)})")
            path = self._video_of(doc_to_visual(self.task_dict[task][split][doc_id]), label)
            items.append((path, Question(index, context, label, token=ids[0])))
        scores = self._answer_jobs(group_by_video(items), len(requests), "loglikelihood", (float("inf"), False))
        # lmms-eval 0.7.3 stores every result through unwrap_generation_output, which turns a (float, bool) pair
        # into its string and so breaks multiple_choice tasks for every model; a GenerationResult is unwrapped as
        # it is (docs/evaluation.md#loglikelihood)
        return [GenerationResult(text=score) for score in scores]

    def generate_until_multi_round(self, requests: list[Instance]) -> list[list[str]]:
        """One list of answers per request: its video streamed up to each round's time, the round's question
        asked, and on to the next round. Requests run one at a time (their times differ, so they cannot share
        lockstep chunks)."""
        counts = self.counts["generate_until_multi_round"] = collections.Counter()
        answers = [self._multi_round(request, counts) for request in requests]
        self._log("generate_until_multi_round", counts)
        return answers

    # ---- streams ------------------------------------------------------------------------------------------------
    def _stream_for(self, batch_size: int, frame_size, request_type: str):
        """A stream in its reset state for `batch_size` videos of `frame_size` (the last one's buffers when it
        fits: one stream's memory is held at a time)."""
        from hermes.stream import HermesStream

        s = self.settings
        kwargs = s.stream_kwargs(request_type)
        key = (batch_size, frame_size, tuple(sorted(kwargs.items())))
        if key == self._stream_key:
            self._stream.reset()
            return self._stream
        self._stream = self._stream_key = None
        self._stream = HermesStream(self.model, self.processor, batch_size=batch_size, chunk_frames=s.chunk_frames,
                                    frame_size=frame_size, room=s.room, backend=s.backend, **kwargs)
        self._stream_key = key
        return self._stream

    def _append(self, feeds: list[VideoFeed], request_type: str, stream=None, end: float | None = None):
        """Append the feeds' chunks up to `end` seconds, one clip per stream in lockstep; the stream is taken at the
        first chunk when None. Returns the stream (None when no frame came)."""
        s = self.settings
        for clips in itertools.zip_longest(*(feed.chunks(end) for feed in feeds)):
            if None in clips or len({len(times) for _, times in clips}) > 1:
                raise RaggedBatch(f"video: the videos of a lockstep batch ended apart ({feeds[0].path}, ...)")
            inputs = [self.family.prepare_frames(self.processor, frames, s.fps, start=times[0])
                      for frames, times in clips]
            if stream is None:
                stream = self._stream_for(len(feeds), self.family.frame_size(self.model, inputs[0]), request_type)
            stream.append_video(**merge_inputs(inputs))
        return stream

    # ---- offline requests: generate_until and loglikelihood -------------------------------------------------
    def _answer_jobs(self, jobs: list[VideoJob], count: int, request_type: str, skipped_answer) -> list:
        self._check_room([q for job in jobs for q in job.questions])
        answers = [skipped_answer] * count
        counts = self.counts[request_type] = collections.Counter()
        batches = lockstep_batches(jobs, self.batch_size, lambda path: sampled_shape(path, self.settings.fps),
                                   lambda job, err: self._skip(job, err, counts), errors=(UnreadableVideo,))
        for batch in batches:
            self._answer_batch(batch, answers, request_type, counts)
        self._log(request_type, counts)
        return answers

    def _answer_batch(self, batch: list[VideoJob], answers: list, request_type: str, counts) -> None:
        """Stream the batch's videos in lockstep, then ask every question; a video that fails to decode (or videos
        that end apart) send the batch's videos through one at a time, so only an unreadable video's own questions
        are skipped."""
        try:
            with contextlib.ExitStack() as files:
                feeds = [files.enter_context(VideoFeed(self.settings.fps, self.settings.chunk_frames))
                         for _ in batch]
                for feed, job in zip(feeds, batch):
                    feed.open(job.path)
                stream = self._append(feeds, request_type)
                if stream is None:
                    raise UnreadableVideo(f"video: {batch[0].path}: no frame was sampled")
        except (UnreadableVideo, RaggedBatch) as err:
            if len(batch) == 1:
                self._skip(batch[0], err, counts)
            else:
                for job in batch:
                    self._answer_batch([job], answers, request_type, counts)
            return
        counts["videos"] += len(batch)
        for length, picked in rounds([job.questions for job in batch]):
            filler = next(q for q in picked if q is not None).text
            texts = [filler if q is None else q.text for q in picked]
            asked = texts[0] if len(texts) == 1 else texts
            if length is None:
                logits = stream.next_token_logits(asked).float()
                logprobs = torch.log_softmax(logits, dim=-1)
                for row, q in enumerate(picked):
                    if q is not None:
                        answers[q.index] = (-logprobs[row, q.token].item(), bool(logits[row].argmax() == q.token))
            else:
                outs = stream.ask(asked, max_new_tokens=length)
                outs = [outs] if isinstance(outs, str) else outs
                for out, q in zip(outs, picked):
                    if q is not None:
                        answers[q.index] = cut_answer(out, q.until)
            counts["questions"] += sum(q is not None for q in picked)

    # ---- streaming requests: generate_until_multi_round ---------------------------------------------------
    def _multi_round(self, request: Instance, counts) -> list[str]:
        """The answers of one multi-round request (lmms-eval's protocol: round 0 from the request, the next rounds
        from the task's doc_to_text(doc, previous_output, round_idx, previous_round_info) until it says stop)."""
        context, gen_kwargs, doc_to_visual, doc_to_text, doc_id, task, split = request.args
        doc, label = self.task_dict[task][split][doc_id], f"{task}/{doc_id}"
        max_new_tokens = int(gen_kwargs.get("max_new_tokens") or self.settings.max_new_tokens)
        until = gen_kwargs.get("until") or ()
        until = (until,) if isinstance(until, str) else tuple(until)
        visuals, answers, info, stream, failed = doc_to_visual(doc), [], None, None, None
        with VideoFeed(self.settings.fps, self.settings.chunk_frames) as feed:
            while True:
                if failed is None:
                    try:
                        for path, end in self._round_visuals(visuals, label):
                            feed.open(path)
                            stream = self._append([feed], "generate_until_multi_round", stream, end)
                    except UnreadableVideo as err:
                        failed = err
                        self._skip(VideoJob(feed.path or "?", [Question(0, context, label)]), err, counts,
                                   "all its rounds")
                if failed is None:
                    if stream is None:
                        raise ValueError(f"{label}: round {len(answers)} asks before any video frame; --model hermes "
                                         "needs the video to start before the first question")
                    answers.append(cut_answer(stream.ask(context, max_new_tokens=max_new_tokens), until))
                    counts["questions"] += 1
                else:
                    answers.append("")
                visuals, context, terminal, previous, info = doc_to_text(
                    doc, previous_output=list(answers), round_idx=len(answers), previous_round_info=info)
                if terminal:
                    break
                if previous is not None:
                    answers = list(previous)
        counts["videos"] += stream is not None
        return answers

    @staticmethod
    def _round_visuals(visuals, label: str) -> list[tuple[str, float | None]]:
        """A round's visuals as (path, end seconds or None for the file's end): a path streams that file (or the
        longer clip of the same video) to its end, a (path, seconds) pair streams it up to that time."""
        out = []
        for item in visuals or ():
            if isinstance(item, str):
                out.append((item, None))
            elif isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str) and \
                    isinstance(item[1], (int, float)) and not isinstance(item[1], bool):
                out.append((item[0], float(item[1])))
            else:
                raise ValueError(f"{label}: --model hermes streams video files; a round's visuals are paths or "
                                 f"(path, seconds) pairs, got {type(item).__name__}")
        return out

    # ---- helpers --------------------------------------------------------------------------------------------
    @staticmethod
    def _video_of(visuals, label: str) -> str:
        if not (isinstance(visuals, (list, tuple)) and len(visuals) == 1 and isinstance(visuals[0], str)):
            kinds = [type(v).__name__ for v in visuals] if isinstance(visuals, (list, tuple)) else visuals
            raise ValueError(f"{label}: --model hermes streams one video file per request; doc_to_visual gave "
                             f"{kinds}")
        return visuals[0]

    def _check_room(self, questions: list[Question]) -> None:
        """ValueError naming `room` before anything streams when a prompt and its answer cannot fit the cache."""
        room = self.settings.room
        for q in questions:
            need = len(self.tokenizer(self.family.question_text(q.text), add_special_tokens=False)["input_ids"]) + \
                (q.max_new_tokens or 0)
            if need > room:
                raise ValueError(f"room: {q.label}'s prompt and answer need {need} cache slots, more than room={room}; "
                                 f"pass room={need} (or more) in --model_args")

    def _skip(self, job: VideoJob, err: Exception, counts, what: str | None = None) -> None:
        counts["skipped"] += len(job.questions)
        what = what or f"{len(job.questions)} question(s)"
        logger.error(f"hermes: skipped {job.questions[0].label} ({what} answered as empty): {err}")

    @staticmethod
    def _log(request_type: str, counts) -> None:
        logger.info(f"hermes: {request_type}: {counts['videos']} video(s) streamed for {counts['questions']} "
                    f"question(s); {counts['skipped']} skipped (unreadable video)")

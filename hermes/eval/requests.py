"""lmms-eval requests regrouped for streams: one job per video holding every question asked about it, jobs in
lockstep batches of equal-shape videos, and the rounds in which a batch's streams are asked (docs/evaluation.md).

Nothing here loads a model or imports lmms-eval: the adapter (`hermes.eval.model`) turns lmms-eval's `Instance`
arguments into `Question`s and `VideoJob`s, and these functions decide the order.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Iterator, Sequence


@dataclasses.dataclass
class Question:
    """One request about a video.

    index:          the request's position in lmms-eval's list (where its answer goes).
    text:           the prompt (the task's context), asked after the video as the family's chat turn.
    label:          "task/doc_id", for messages.
    max_new_tokens: generation length (generate_until); None for a scored request.
    until:          strings an answer is cut at (generate_until).
    token:          the continuation's token id (loglikelihood); None for a generated request.
    """

    index: int
    text: str
    label: str
    max_new_tokens: int | None = None
    until: tuple[str, ...] = ()
    token: int | None = None


@dataclasses.dataclass
class VideoJob:
    """A video file and every question asked about it: the video is streamed once, each question asked from the
    same cache (asking leaves the stream's video memory as it was)."""

    path: str
    questions: list[Question]


def group_by_video(items: Sequence[tuple[str, Question]]) -> list[VideoJob]:
    """(path, question) pairs as one job per path, in the order each path first appears; questions in their order."""
    jobs: dict[str, VideoJob] = {}
    for path, question in items:
        jobs.setdefault(path, VideoJob(path, [])).questions.append(question)
    return list(jobs.values())


def lockstep_batches(jobs: Sequence[VideoJob], batch_size: int, shape_of: Callable[[str], tuple],
                     on_error: Callable[[VideoJob, Exception], None], errors: tuple = ()) -> list[list[VideoJob]]:
    """Jobs in batches for streams advanced in lockstep: with batch_size 1 one job each, in order; otherwise jobs of
    equal `shape_of(path)` (sampled frames and frame size: they give equal chunks), at most batch_size a batch, in
    order of their shape and then of the jobs. A job whose shape raises one of `errors` goes to `on_error`."""
    if batch_size == 1:
        return [[job] for job in jobs]
    shaped = []
    for order, job in enumerate(jobs):
        try:
            shaped.append((shape_of(job.path), order, job))
        except errors as err:
            on_error(job, err)
    shaped.sort(key=lambda item: item[:2])
    batches: list[list[VideoJob]] = []
    for index, (shape, _, job) in enumerate(shaped):
        if index and shape == shaped[index - 1][0] and len(batches[-1]) < batch_size:
            batches[-1].append(job)
        else:
            batches.append([job])
    return batches


def rounds(per_stream: Sequence[Sequence[Question]]) -> Iterator[tuple[int | None, list[Question | None]]]:
    """(max_new_tokens, one question or None per stream): every question of every stream exactly once, questions of
    one generation length together (one `ask` generates one length for the batch) and each stream's in its order.
    None marks a stream with no question left in that round (the caller asks it a filler and drops the answer)."""
    lengths = sorted({q.max_new_tokens for questions in per_stream for q in questions}, key=lambda n: n or 0)
    for length in lengths:
        queues = [[q for q in questions if q.max_new_tokens == length] for questions in per_stream]
        for r in range(max(len(queue) for queue in queues)):
            yield length, [queue[r] if r < len(queue) else None for queue in queues]


def cut_answer(answer: str, until: Sequence[str]) -> str:
    """The answer up to the first of the `until` strings, stripped (lmms-eval's stop sequences, applied after
    generation)."""
    for stop in until:
        if stop:
            answer = answer.split(stop)[0]
    return answer.strip()

"""The order the plugin serves requests in (hermes.eval.requests) and its video feed (hermes.eval.feed), without a
model: grouping by video, lockstep batches, question rounds, answers cut at stop strings, chunks up to a time
across prefix clips, and the lockstep merge of prepared chunks."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from hermes.eval.feed import UnreadableVideo, VideoFeed, merge_inputs, sampled_shape
from hermes.eval.requests import Question, VideoJob, cut_answer, group_by_video, lockstep_batches, rounds
from hermes.video import VideoReader
from tests.hermes.eval.tasks import write_videos
from tests.hermes.video_files import frame_index


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    return write_videos(tmp_path_factory.mktemp("videos"))


def q(index, length=3):
    return Question(index, f"q{index}", f"t/{index}", max_new_tokens=length)


def test_questions_group_by_video_in_first_seen_order():
    jobs = group_by_video([("b", q(0)), ("a", q(1)), ("b", q(2)), ("c", q(3)), ("a", q(4))])
    assert [(job.path, [x.index for x in job.questions]) for job in jobs] == [("b", [0, 2]), ("a", [1, 4]),
                                                                             ("c", [3])]


def test_lockstep_batches_join_equal_shapes_up_to_the_batch_size():
    """batch 1 keeps the jobs' order and never measures a shape; batch 2 groups equal shapes (at most 2 a batch),
    ordered by shape then by job; a job whose shape cannot be measured goes to on_error and nowhere else."""
    shapes = {"a": (10, 4, 4), "b": (10, 4, 4), "c": (6, 4, 4), "d": (10, 4, 4), "e": (6, 4, 4), "bad": None}
    jobs = [VideoJob(path, [q(i)]) for i, path in enumerate(["a", "bad", "c", "b", "d", "e"])]

    def shape_of(path):
        if shapes[path] is None:
            raise UnreadableVideo(f"video: cannot read {path}")
        return shapes[path]
    failed = []
    assert lockstep_batches(jobs, 1, None, failed.append) == [[job] for job in jobs]
    batches = lockstep_batches(jobs, 2, shape_of, lambda job, err: failed.append((job.path, str(err))),
                               errors=(UnreadableVideo,))
    assert [[job.path for job in batch] for batch in batches] == [["c", "e"], ["a", "b"], ["d"]]
    assert failed == [("bad", "video: cannot read bad")]
    assert [[job.path for job in batch] for batch in lockstep_batches(jobs[:1] + jobs[2:], 3, shape_of, None)] == \
        [["c", "e"], ["a", "b", "d"]]


def test_rounds_ask_every_question_once_grouped_by_answer_length():
    """Each stream's questions in their order, shorter answer lengths first, None where a stream has none left;
    scored questions (length None) form their own rounds."""
    per_stream = [[q(0), q(1, 5), q(2)], [q(3)], [q(4, 5), q(5, 5), q(6, 5)]]
    got = [(length, [None if x is None else x.index for x in picked]) for length, picked in rounds(per_stream)]
    assert got == [(3, [0, 3, None]), (3, [2, None, None]), (5, [1, None, 4]), (5, [None, None, 5]),
                   (5, [None, None, 6])]
    scored = [[Question(0, "x", "t/0", token=4)], [Question(1, "y", "t/1", token=5)]]
    assert [(length, [x.index for x in picked]) for length, picked in rounds(scored)] == [(None, [0, 1])]


def test_answers_are_cut_at_the_first_stop_string_and_stripped():
    assert cut_answer(" A. cup ? and more\nB", ("?", "\n")) == "A. cup"
    assert cut_answer(" B\n", ()) == "B"
    assert cut_answer("red", ("", "?")) == "red"


# ---- the feed ---------------------------------------------------------------------------------------------------
def sources(chunks):
    """(frame index drawn in each frame, times) of each chunk."""
    return [([frame_index(f) for f in frames], times) for frames, times in chunks]


def test_chunks_stop_at_each_time_and_go_on_from_there(videos):
    """a at 1 fps (4 fps file: sample k is frame 4k): chunks of 4 up to 2.5 s (3 samples), then up to 9 s from
    3 s on, then the rest; nothing is handed out twice."""
    with VideoFeed(1, 4) as feed:
        feed.open(videos["a"])
        assert sources(feed.chunks(2.5)) == [([0, 4, 8], [0.0, 1.0, 2.0])]
        assert sources(feed.chunks(9)) == [([12, 16, 20, 24], [3.0, 4.0, 5.0, 6.0]), ([28, 32, 36], [7.0, 8.0, 9.0])]
        assert sources(feed.chunks(9)) == [] and sources(feed.chunks()) == []
        assert feed.streamed_to == 9.0


def test_a_longer_clip_of_the_same_video_continues_after_the_last_frame(videos):
    """OVO-Bench-style prefix clips: a_3 (0..3 s), then a_7 (0..7 s), then a: each hands out only the samples past
    the last one, so the three together give a's samples once, in order."""
    with VideoFeed(1, 4) as feed:
        got = []
        for name in ("a_3", "a_7", "a", "a"):
            feed.open(videos[name])
            got += sources(feed.chunks())
    assert [times for _, times in got] == [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0], [8.0, 9.0]]
    assert [i for frames, _ in got for i in frames] == list(range(0, 40, 4))


def test_unreadable_files_raise_one_line_naming_the_file(videos, tmp_path):
    for path, words in ((videos["bad"], "video: cannot read"), (str(tmp_path / "none.mp4"), "video: no such file")):
        with pytest.raises(UnreadableVideo, match=f"^{words}") as info, VideoFeed(1, 4) as feed:
            feed.open(path)
        assert "\n" not in str(info.value) and path in str(info.value)
        with pytest.raises(UnreadableVideo, match=f"^{words}"):
            sampled_shape(path, 1)


def test_sampled_shape_counts_what_the_reader_samples(videos):
    for name, fps in (("a", 1), ("b", 1), ("c", 2), ("a_7", 0.5)):
        with VideoReader(videos[name]) as reader:
            chunks = list(reader.chunks(fps, 1))
        assert sampled_shape(videos[name], fps) == (len(chunks), *chunks[0].frames.shape[1:3])
    assert sampled_shape(videos["a"], 1) == sampled_shape(videos["b"], 1) != sampled_shape(videos["c"], 1)


def test_merge_joins_pixel_values_and_refuses_unequal_chunks():
    one = {"video": torch.zeros(6, 8), "grid_thw": torch.tensor([[1, 2, 3]]), "seconds_per_grid": 2.0}
    two = {"video": torch.ones(6, 8), "grid_thw": torch.tensor([[1, 2, 3]]), "seconds_per_grid": 2.0}
    merged = merge_inputs([one, two])
    assert torch.equal(merged["video"], torch.cat([one["video"], two["video"]]))
    assert torch.equal(merged["grid_thw"], one["grid_thw"]) and merged["seconds_per_grid"] == 2.0
    assert merge_inputs([one]) is one
    with pytest.raises(ValueError, match="^grid_thw: the streams of a lockstep batch need equal chunks"):
        merge_inputs([one, {**two, "grid_thw": torch.tensor([[2, 2, 3]])}])
    with pytest.raises(ValueError, match="^timestamps: "):
        merge_inputs([{"video": np.zeros((1, 2)), "timestamps": [0.5]},
                      {"video": np.zeros((1, 2)), "timestamps": [1.5]}])

"""Dropping text after the video under every policy: `truncate` (what `ask` does after answering) and transformers'
`crop` (keep `n` slots, or drop `-n`), which must be the same operation with transformers' arithmetic. A hybrid
model's linear-attention states cannot be cropped: only the current length and the length before the last stored
text are accepted (docs/qwen3_5.md#hybrid-cache)."""
import pytest
import torch

from tests.hermes.streams import QUESTION

pytestmark = pytest.mark.usefixtures("single_thread")


def store_text(stream, count: int) -> None:
    """Store `count` question tokens after the video, as `ask` stores its question before generating."""
    ids = torch.tensor([stream._encode(QUESTION)[:count]] * stream.batch_size, device=stream._device())
    with torch.no_grad(), stream.cache.forward_context():
        stream.model(input_ids=ids, position_ids=stream.cache.default_position_ids(count), cache=stream.cache,
                     use_cache=True, **stream.family.text_kwargs(ids))


def outcome(cache, call):
    """The cache's length after `call(cache)`, or the exception type it raised."""
    try:
        call(cache)
    except ValueError:
        return ValueError
    return cache.length


def video_and_text(policy, case, model, text: int):
    """A stream holding two chunks of video (the same ones every time) and `text` question tokens."""
    g = torch.Generator().manual_seed(4)
    stream = policy.stream(case, model)
    for _ in range(2):
        stream.append_video(**case.chunk(1, g))
    store_text(stream, text)
    return stream


def test_crop_is_truncate_with_transformers_arithmetic(case, policy):
    """crop(n) keeps min(n, length) slots and crop(-n) drops n, exactly as truncate to that length does (same
    length, or the same refusal), for lengths inside the text, at the video's end, at 0 and past the end."""
    model = case.build()
    text = 4
    length = video_and_text(policy, case, model, text).cache.length
    video = length - text
    for amount in (-1, -text, 0, 1, text - 1, text, video, video + 2, length, length + 5):
        target = length + amount if amount < 0 else min(amount, length)
        cropped = outcome(video_and_text(policy, case, model, text).cache, lambda c: c.crop(amount))
        truncated = outcome(video_and_text(policy, case, model, text).cache, lambda c: c.truncate(target))
        assert cropped == truncated, f"crop({amount}) gave {cropped}, truncate({target}) {truncated}"
    assert outcome(video_and_text(policy, case, model, text).cache, lambda c: c.crop(-1)) == \
        (ValueError if case.linear else length - 1)
    assert outcome(video_and_text(policy, case, model, text).cache, lambda c: c.crop(-text)) == video
    assert outcome(video_and_text(policy, case, model, text).cache, lambda c: c.crop(length + 5)) == length


@pytest.mark.parametrize("length", [2.0, True, None, "3"])
def test_truncate_refuses_a_length_that_is_not_an_int(case, policy, length):
    g = torch.Generator().manual_seed(5)
    stream = policy.stream(case, case.build())
    stream.append_video(**case.chunk(1, g))
    store_text(stream, 2)
    before = stream.cache.length
    with pytest.raises(ValueError, match="length"):
        stream.cache.truncate(length)
    assert stream.cache.length == before


def test_truncate_to_the_current_length_changes_nothing(case, policy):
    g = torch.Generator().manual_seed(6)
    stream = policy.stream(case, case.build())
    stream.append_video(**case.chunk(1, g))
    store_text(stream, 3)
    length = stream.cache.length
    stream.cache.truncate(length)
    assert stream.cache.length == length

"""A compression step on the tiny hybrid Qwen3.5 stays committed (docs/qwen3_5.md#hybrid-cache): the step moves the
keys in place, so the linear-attention states' commit of the chunk it compressed can no longer be undone (the cache
forgets that undo at the step). A later failure and a later truncate must leave the stream at the step, never roll
the linear states back to before its chunk while the keys stay compressed.

(Beside tests/hermes/models/test_qwen3_5_stream.py, whose helpers it uses.)
"""
import pytest
import torch

from scaffolding.models import tiny_qwen3_5
from tests.hermes.models.test_qwen3_5_stream import assert_same_contents, contents, stream_of, video
from tests.hermes.streams import QUESTION

pytestmark = pytest.mark.usefixtures("single_thread")


def test_a_failed_chunk_after_a_step_keeps_the_step_committed():
    """HERMES (budget 40): the second chunk compresses. The third chunk then fails in decoder layer 0, before it
    touches any key or state (so nothing in the failure itself drops the linear states' undo): the cache holds
    exactly what the step left (every full layer's keys, values and positions, every linear state, the counters);
    truncating back to the length before the stepped chunk, which would roll the linear states back past the step
    under keys it compressed, is refused naming `length` and changes nothing; the stream takes the failed chunk again
    as a stream that never failed; and `ask` then leaves every byte."""
    g = torch.Generator().manual_seed(7)
    model = tiny_qwen3_5()
    faulty, clean = stream_of(model, budget=40), stream_of(model, budget=40)
    chunks = video(3, g)
    for stream in (faulty, clean):
        assert stream.append_video(**chunks[0]) is None
    start = faulty.cache.length
    for stream in (faulty, clean):
        assert stream.append_video(**chunks[1]) is not None, "the second chunk ran no step"
    stepped, length, counters = contents(faulty), faulty.cache.length, faulty.cache.counters
    assert start < length, "truncate(start) must be a length the keys could go back to"

    def raiser(module, args):
        raise KeyboardInterrupt("injected into decoder layer 0")

    hook = model.model.language_model.layers[0].register_forward_pre_hook(raiser)
    try:
        with pytest.raises(KeyboardInterrupt, match="injected"):
            faulty.append_video(**chunks[2])
    finally:
        hook.remove()
    assert faulty.cache.counters == counters
    assert_same_contents(contents(faulty), stepped, "a failed chunk after the step")
    with pytest.raises(ValueError, match=rf"^length: the linear-attention layers' states cannot be cropped; this cache "
                                         rf"can go back to {length} only, got {start} "):
        faulty.cache.truncate(start)
    assert_same_contents(contents(faulty), stepped, "a refused truncate back past the step")
    results = [stream.append_video(**chunks[2]) for stream in (faulty, clean)]
    assert results[0] is not None and torch.equal(results[0].keep, results[1].keep)
    assert_same_contents(contents(faulty), contents(clean), "the failed chunk taken again")
    held = contents(faulty)
    faulty.ask(QUESTION, max_new_tokens=4)
    assert_same_contents(contents(faulty), held, "ask after the steps")

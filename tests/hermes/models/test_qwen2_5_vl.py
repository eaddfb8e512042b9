"""HermesStream on a tiny random Qwen2.5-VL (M-RoPE): the shared integration checks of
the family's positions (built by us, not by `get_rope_index`)."""
import pytest
import torch

from scaffolding.models import tiny_qwen2_5_vl
from scaffolding.pixels import qwen_pixels
from scaffolding.tokenizer import tiny_tokenizer
from hermes.models.qwen2_5_vl import video_rel_positions
from hermes.stream import HermesStream
from tests.hermes.streams import QUESTION, QWEN_FRAMES

pytestmark = pytest.mark.usefixtures("single_thread")



@pytest.mark.parametrize("grid,interval,start", [((2, 8, 8), 2.0, 15), ((3, 4, 6), 0.5, 7), ((1, 2, 2), 4.0, 0)])
def test_video_positions_match_transformers_layout(grid, interval, start):
    """Our (t, h, w) offsets + start equal transformers' own vision position ids for one video at `start`."""
    model = tiny_qwen2_5_vl()
    expected = model.model.get_vision_position_ids(start, torch.tensor(grid), 1, 2, interval)
    assert torch.equal(start + video_rel_positions(grid, 2, interval), expected)


def test_text_after_video_continues_past_the_largest_position():
    """Chunks and questions start at the largest position so far + 1 on all axes (not get_rope_index's
    placement below the video's temporal positions), and mm_token_type_ids reach every full-model forward."""
    g = torch.Generator().manual_seed(0)
    model = tiny_qwen2_5_vl()
    stream = HermesStream(model, tiny_tokenizer(), budget=400, chunk_frames=QWEN_FRAMES, frame_size=(16, 16),
                          room=160)
    P = stream.cfg.prefix_len
    video, grid = qwen_pixels(1, QWEN_FRAMES, g)
    stream.append_video(video, grid_thw=grid, seconds_per_grid=3.0)
    positions = stream.cache.layer_positions(0)[0]
    rel = video_rel_positions((2, 8, 8), 2, 2 * 3.0)
    assert torch.equal(positions[:, P:], P + rel)
    assert int(positions[0].max()) == P + 6 > int(positions[1:].max())   # time runs past the grid rows
    length = stream.cache.length
    seen, question = [], []
    hooks = [model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw.get("mm_token_type_ids")),
                                             with_kwargs=True),
             model.register_forward_hook(lambda *a: question.append(stream.cache.layer_positions(0)[0, :, length:]))]
    try:
        stream.ask(QUESTION, max_new_tokens=3)
    finally:
        for hook in hooks:
            hook.remove()
    assert seen and all(t is not None and not t.any() for t in seen)
    asked = question[0]  # after the question's prefill: its tokens sit at max + 1 + i on every axis
    assert torch.equal(asked, (P + 7 + torch.arange(asked.shape[1])).expand(3, -1))
    video, grid = qwen_pixels(1, QWEN_FRAMES, g)
    stream.append_video(video, grid_thw=grid)
    positions = stream.cache.layer_positions(0)[0]
    assert torch.equal(positions[:, -32:], P + 7 + video_rel_positions((2, 8, 8), 2, 2.0))

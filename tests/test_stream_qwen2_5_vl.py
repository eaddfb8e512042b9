"""HermesStream on a tiny random Qwen2.5-VL (M-RoPE): the shared integration checks of
`tests/stream_checks.py` plus the family's positions (built by us, not by `get_rope_index`)."""
import pytest
import torch

from bench.tiny_models import qwen_pixels, tiny_qwen2_5_vl, tiny_tokenizer
from hermes.models.qwen2_5_vl import video_rel_positions
from hermes.stream import HermesStream
from tests.stream_checks import *  # noqa: F401,F403 (the shared checks are collected here)
from tests.stream_checks import QUESTION, Case

FRAMES = 4
SECONDS_PER_GRID = 4.0  # t advances 8 per temporal step: time, not the grid, drives the positions


def _chunk(batch, g):
    video, grid = qwen_pixels(batch, FRAMES, g)
    return {"video": video, "grid_thw": grid, "seconds_per_grid": SECONDS_PER_GRID}


def _encode(model, chunk):
    grid = chunk["grid_thw"]
    embeds = torch.stack(model.model.get_video_features(chunk["video"], grid).pooler_output)
    vision = model.config.vision_config
    interval = vision.tokens_per_second * chunk["seconds_per_grid"]
    return embeds, video_rel_positions(grid[0].tolist(), vision.spatial_merge_size, interval)


def _bad_chunks(batch, g):
    video, grid = qwen_pixels(batch, FRAMES, g)
    return {
        "missing grid": {"video": video},
        "grid does not match rows": {"video": video, "grid_thw": torch.tensor([2, 4, 4])},
        "odd grid": {"video": video[: batch * 2 * 3 * 8], "grid_thw": torch.tensor([2, 3, 8])},
        "streams with different grids": {"video": video, "grid_thw": torch.tensor([[2, 8, 8], [1, 16, 8]])},
        "wrong patch size": {"video": video[:, :12], "grid_thw": grid},
        "non-finite": {"video": video.clone().fill_(float("inf")), "grid_thw": grid},
        "bad seconds_per_grid": {"video": video, "grid_thw": grid, "seconds_per_grid": 0.0},
    }


@pytest.fixture
def case():
    return Case(name="qwen2_5_vl", build=tiny_qwen2_5_vl, frames=FRAMES, chunk=_chunk, encode=_encode,
                stream_kwargs={"frame_size": (16, 16)}, bad_chunks=_bad_chunks, mrope=True)


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
    stream = HermesStream(model, tiny_tokenizer(), budget=400, chunk_frames=FRAMES, frame_size=(16, 16), room=160)
    P = stream.cfg.prefix_len
    video, grid = qwen_pixels(1, FRAMES, g)
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
    video, grid = qwen_pixels(1, FRAMES, g)
    stream.append_video(video, grid_thw=grid)
    positions = stream.cache.layer_positions(0)[0]
    assert torch.equal(positions[:, -32:], P + 7 + video_rel_positions((2, 8, 8), 2, 2.0))

"""The families' edges (docs/families.md): Qwen3-VL's temporal padding at a temporal patch other than 2, the ends of
its timestamps' range, Qwen2.5-VL's temporal positions where the product of step and interval is not an integer
(against transformers' own), and the (height, width) order of `frame_size` on frames that are not square."""
import numpy as np
import pytest
import torch
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

from hermes.models import family_of
from hermes.models.processing import Processor
from hermes.models.qwen2_5_vl import video_rel_positions
from hermes.models.qwen3_vl import TIMESTAMP_DIGITS, step_times, timestamp_text
from scaffolding.models import tiny_qwen2_5_vl, tiny_qwen3_vl
from scaffolding.pixels import qwen_pixels
from scaffolding.processors import tiny_image_processor, tiny_video_processor_config
from scaffolding.tokenizer import tiny_tokenizer

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.mark.parametrize("count", [1, 4, 5, 7])
def test_qwen3_vl_step_times_pad_to_a_temporal_patch_of_three(count):
    """step_times at temporal_patch_size 3 over clips whose length is no multiple of it: the last frame repeated
    to fill the last step, each step the mean of its first and last frame, as Qwen3VLProcessor computes them."""
    fps, start = 2.0, 11.5
    indices = [round((start + i / fps) * 24) for i in range(count)]
    want = Qwen3VLProcessor._calculate_timestamps(None, indices, 24, 3)
    got = step_times(count, fps, start, 3)
    assert len(got) == -(-count // 3) and got == pytest.approx(want)


@pytest.mark.parametrize("count", [4, 5])
def test_qwen3_vl_prepared_clip_of_odd_length_at_temporal_patch_three(count):
    """prepare_frames with a video processor of temporal patch 3: the clip padded with its last frame to whole
    steps, one timestamp per temporal step of the grid."""
    family = family_of(tiny_qwen3_vl(num_layers=1))
    config = dict(tiny_video_processor_config("qwen3_vl"), temporal_patch_size=3)
    twin = family.pil_video_processor(tiny_image_processor("qwen3_vl"), config)
    processor = Processor(tokenizer=tiny_tokenizer(), video_processor=twin)
    clip = np.random.default_rng(count).integers(0, 256, (count, 12, 20, 3), dtype=np.uint8)
    inputs = family.prepare_frames(processor, clip, fps=1.0, start=3.0)
    steps = -(-count // 3)
    assert inputs["grid_thw"].tolist()[0][0] == steps == len(inputs["timestamps"])
    assert inputs["timestamps"] == pytest.approx(step_times(count, 1.0, 3.0, 3))
    last = twin(videos=[np.concatenate([clip, clip[-1:].repeat(3 * steps - count, axis=0)])],
                cap_pixels_per_frame=True)
    assert torch.equal(inputs["video"], last["pixel_values_videos"])  # the padding is the last frame repeated


def test_qwen3_vl_timestamps_at_the_ends_of_their_range():
    """Seconds that round to the top of the range (10^5 s with one decimal) are refused, not printed with a sixth
    digit; a negative time is refused even where it rounds to 0.0 (no "-0000.0"); -0.0 is 0."""
    top = 10 ** TIMESTAMP_DIGITS
    assert timestamp_text(top - 0.06) == f"<{top - 0.1:.1f} seconds>"
    for bad in (top - 0.04, top - 0.05 + 1e-9, -0.04, -1e-9):
        with pytest.raises(ValueError, match="timestamps: expected seconds in"):
            timestamp_text(bad)
    assert timestamp_text(-0.0) == timestamp_text(0.0) == "<00000.0 seconds>"
    assert timestamp_text(0.04) == "<00000.0 seconds>"


@pytest.mark.parametrize("interval", [0.5, 1.5, 2.5])
def test_qwen2_5_vl_positions_at_half_step_intervals(interval):
    """Temporal offsets step * interval truncated as transformers does (1.5 -> 1, not rounded to 2), at grid (4, 2, 2)
    and (5, 4, 6)."""
    model = tiny_qwen2_5_vl(num_layers=1)
    for grid in ((4, 2, 2), (5, 4, 6)):
        expected = model.model.get_vision_position_ids(0, torch.tensor(grid), 1, 2, interval)
        assert torch.equal(video_rel_positions(grid, 2, interval), expected)


@pytest.mark.parametrize("tokens_per_second,seconds", [(2, 0.25), (2, 0.75), (25, 10 / 3), (25, 5 / 3), (25, 0.4)])
def test_qwen2_5_vl_chunk_positions_equal_get_rope_index(tokens_per_second, seconds):
    """A chunk's temporal positions equal get_rope_index's over the same grid with second_per_grid_ts as the processor
    passes it (a float32 tensor): the interval tokens_per_second x seconds is taken in float32, so that products such
    as 3 x 25 x (10/3) truncate as transformers' do (249, not 250)."""
    model = tiny_qwen2_5_vl(num_layers=1)
    model.config.vision_config.tokens_per_second = tokens_per_second
    family = family_of(model)
    video, grid = qwen_pixels(1, 24, torch.Generator().manual_seed(0), 4, 4)
    chunk = family.encode_video(model, None, video, 1, grid_thw=grid, seconds_per_grid=seconds)
    count = chunk.embeds.shape[1]
    ids = torch.full((1, count), model.config.video_token_id)
    expected, _ = model.model.get_rope_index(ids, torch.full((1, count), 2, dtype=torch.int32), video_grid_thw=grid,
                                             second_per_grid_ts=torch.tensor([seconds]))
    assert torch.equal(chunk.rel_positions, expected[:, 0]) and chunk.extent == int(expected.max())


@pytest.mark.parametrize("model_type,build", [("qwen2_5_vl", tiny_qwen2_5_vl), ("qwen3_vl", tiny_qwen3_vl)])
def test_frame_size_is_height_then_width_on_frames_that_are_not_square(model_type, build):
    """frame_size on a 48 x 64 clip (height x width): the processed frames' (height, width) = (12, 16), the size
    kept_size announces for the same frames, not (16, 12)."""
    model = build(num_layers=1)
    family = family_of(model)
    twin = family.pil_video_processor(tiny_image_processor(model_type), tiny_video_processor_config(model_type))
    processor = Processor(tokenizer=tiny_tokenizer(), video_processor=twin)
    clip = np.random.default_rng(0).integers(0, 256, (2, 48, 64, 3), dtype=np.uint8)
    inputs = family.prepare_frames(processor, clip, fps=1.0)
    assert family.frame_size(model, inputs) == tuple(family.kept_size(processor, 48, 64)) == (12, 16)

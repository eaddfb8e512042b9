"""HermesStream on a tiny random LLaVA-OneVision (Qwen2 decoder, 1D RoPE): the shared integration checks of
the family's token layout."""
import pytest
import torch

from scaffolding.models import tiny_llava_ov
from scaffolding.pixels import llava_pixels
from hermes.models import family_of
from hermes.models.llava_ov import LlavaOneVision

pytestmark = pytest.mark.usefixtures("single_thread")



def test_chunk_tokens_per_frame_without_newline():
    """(image_size / patch / 2)^2 tokens per frame, frames in order, and no image_newline token per chunk."""
    model = tiny_llava_ov()
    g = torch.Generator().manual_seed(0)
    video = llava_pixels(2, 3, g)
    chunk = LlavaOneVision().encode_video(model, None, video, 2)
    assert chunk.rel_positions is None
    assert chunk.embeds.shape == (2, 3 * 16, 64)
    full = model.model.get_video_features(video, vision_feature_layer=-1,
                                          vision_feature_select_strategy="full").pooler_output
    assert torch.equal(chunk.embeds, full[:, :-1])
    newline = model.model.image_newline.to(chunk.embeds.dtype)
    assert not torch.isclose(chunk.embeds, newline).all(-1).any()


def test_frames_go_through_the_processor():
    """Raw frames (not a tensor) are handed to processor.video_processor; its pixel values are encoded."""
    model = tiny_llava_ov()
    g = torch.Generator().manual_seed(0)
    pixels = llava_pixels(1, 2, g)
    seen = []

    class Processor:
        def video_processor(self, videos, return_tensors):
            seen.append((videos, return_tensors))
            return {"pixel_values_videos": pixels}

    frames = [[[0]]]  # stands for PIL images / arrays
    chunk = LlavaOneVision().encode_video(model, Processor(), frames, 1)
    assert seen == [(frames, "pt")]
    assert torch.equal(chunk.embeds, LlavaOneVision().encode_video(model, None, pixels, 1).embeds)


def test_unsupported_model_type():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    with pytest.raises(ValueError, match="model type 'qwen2' is not supported"):
        family_of(model)

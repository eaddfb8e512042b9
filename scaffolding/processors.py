"""The image and video processor settings of a tiny checkpoint (scaffolding/checkpoint.py), sized to the tiny
models' vision towers (docs/testing.md#scaffolding)."""
from __future__ import annotations

from transformers import LlavaOnevisionImageProcessorPil, Qwen2VLImageProcessorPil
from transformers.image_utils import IMAGENET_STANDARD_MEAN, IMAGENET_STANDARD_STD, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

# Tiny Qwen2.5-VL frames: smart_resize to multiples of patch 2 x merge 2 with 64..256 pixels (a 48 x 64 frame
# becomes 12 x 16: a 6 x 8 patch grid, 3 x 4 merged tokens per temporal step).
TINY_QWEN_PIXELS = (8 * 8, 16 * 16)
# Tiny Qwen3-VL clips: (shortest_edge, longest_edge) pixels of a clip and max_video_tokens; with the per-frame cap
# a frame gets at most 12 patches of 4 x 4 pixels, 192 pixels, for chunks of up to 85 frames (48 x 64 -> 12 x 16, as
# for the tiny Qwen2.5-VL)
TINY_QWEN3_PIXELS = (8 * 8, 128 * 128, 12)


def tiny_video_processor_config(model_type: str) -> dict:
    """The video processor settings of a tiny checkpoint, as transformers' video processor saves them
    (video_preprocessor_config.json): LLaVA-OV frames resized to the 16 x 16 tower; Qwen2.5-VL patch 2, merge
    2, temporal patch 2 and TINY_QWEN_PIXELS, with the CLIP means and stds both processors default to; Qwen3-VL
    (and Qwen3.5, which uses its processor) patch 2, merge 2, temporal patch 2 and TINY_QWEN3_PIXELS, with its
    processor's 0.5 means and stds."""
    common = dict(resample=3, rescale_factor=1 / 255, image_mean=OPENAI_CLIP_MEAN, image_std=OPENAI_CLIP_STD,
                  do_resize=True, do_rescale=True, do_normalize=True, do_convert_rgb=True, do_sample_frames=False)
    if model_type == "llava_onevision":
        return dict(video_processor_type="LlavaOnevisionVideoProcessor", size={"height": 16, "width": 16}, **common)
    if model_type == "qwen2_5_vl":
        return dict(video_processor_type="Qwen2VLVideoProcessor", patch_size=2, temporal_patch_size=2, merge_size=2,
                    size={"shortest_edge": TINY_QWEN_PIXELS[0], "longest_edge": TINY_QWEN_PIXELS[1]}, **common)
    if model_type in ("qwen3_vl", "qwen3_5", "qwen3_5_moe"):  # Qwen3.5 uses Qwen3-VL's video processor
        common.update(image_mean=IMAGENET_STANDARD_MEAN, image_std=IMAGENET_STANDARD_STD)
        return dict(video_processor_type="Qwen3VLVideoProcessor", patch_size=2, temporal_patch_size=2, merge_size=2,
                    size={"shortest_edge": TINY_QWEN3_PIXELS[0], "longest_edge": TINY_QWEN3_PIXELS[1]},
                    max_video_tokens=TINY_QWEN3_PIXELS[2], **common)
    raise ValueError(f"model_type: expected llava_onevision, qwen2_5_vl, qwen3_vl, qwen3_5 or qwen3_5_moe, got "
                     f"{model_type!r}")


def tiny_image_processor(model_type: str):
    """The PIL image processor of a tiny checkpoint (saved as LlavaOnevisionImageProcessor /
    Qwen2VLImageProcessor, the classes the released checkpoints name; Qwen3-VL's is Qwen2-VL's, patch 16 there)."""
    video = tiny_video_processor_config(model_type)
    if model_type == "llava_onevision":
        return LlavaOnevisionImageProcessorPil(size=video["size"], image_grid_pinpoints=[[16, 16], [16, 32], [32, 16]])
    return Qwen2VLImageProcessorPil(size=video["size"], patch_size=2, temporal_patch_size=2, merge_size=2,
                                    image_mean=video["image_mean"], image_std=video["image_std"])

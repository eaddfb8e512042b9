"""The image and video processor settings of a tiny checkpoint (scaffolding/checkpoint.py), sized to the tiny
models' vision towers (docs/testing.md#scaffolding)."""
from __future__ import annotations

from transformers import (Gemma4ImageProcessorPil, LlavaOnevisionImageProcessorPil, MiniCPMV4_6ImageProcessorPil,
                          Qwen2VLImageProcessorPil)
from transformers.image_utils import IMAGENET_STANDARD_MEAN, IMAGENET_STANDARD_STD, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

# Tiny Qwen2.5-VL frames: smart_resize to multiples of patch 2 x merge 2 with 64..256 pixels (a 48 x 64 frame
# becomes 12 x 16: a 6 x 8 patch grid, 3 x 4 merged tokens per temporal step).
TINY_QWEN_PIXELS = (8 * 8, 16 * 16)
# Tiny Qwen3-VL clips: (shortest_edge, longest_edge) pixels of a clip and max_video_tokens; with the per-frame cap
# a frame gets at most 12 patches of 4 x 4 pixels, 192 pixels, for chunks of up to 85 frames (48 x 64 -> 12 x 16, as
# for the tiny Qwen2.5-VL)
TINY_QWEN3_PIXELS = (8 * 8, 128 * 128, 12)
# Tiny MiniCPM-V 4.6 frames: scale_resolution 32 at patch 2, sides multiples of 8 (the mergers fold 4 x 4 patches): any
# frame of aspect ratio 4 : 3 (e.g. 48 x 64) becomes 24 x 32, 12 x 16 patches, 3 x 4 tokens
TINY_MINICPM_RESOLUTION = 32
# Tiny Gemma 4 frames (patch_size, max_soft_tokens, pooling_kernel_size): resized, aspect kept, to sides that are
# multiples of 4 within 70 x 2² patches of 2 x 2 pixels (a 48 x 64 frame becomes 28 x 36: 14 x 18 patches, 63 soft
# tokens); 70 is the smallest max_soft_tokens Gemma4VideoProcessor takes
TINY_GEMMA4_PATCHES = (2, 70, 2)


def tiny_video_processor_config(model_type: str) -> dict:
    """The video processor settings of a tiny checkpoint, as transformers' video processor saves them
    (video_preprocessor_config.json): LLaVA-OV frames resized to the 16 x 16 tower; Qwen2.5-VL patch 2, merge
    2, temporal patch 2 and TINY_QWEN_PIXELS, with the CLIP means and stds both processors default to (LLaVA-OV-1.5,
    which takes Qwen2-VL's video processor, the same at temporal patch 1); Qwen3-VL
    (and Qwen3.5, which uses its processor) patch 2, merge 2, temporal patch 2 and TINY_QWEN3_PIXELS, with its
    processor's 0.5 means and stds."""
    common = dict(resample=3, rescale_factor=1 / 255, image_mean=OPENAI_CLIP_MEAN, image_std=OPENAI_CLIP_STD,
                  do_resize=True, do_rescale=True, do_normalize=True, do_convert_rgb=True, do_sample_frames=False)
    if model_type == "llava_onevision":
        return dict(video_processor_type="LlavaOnevisionVideoProcessor", size={"height": 16, "width": 16}, **common)
    if model_type in ("qwen2_5_vl", "llava_onevision1_5"):  # LLaVA-OV-1.5's tower: one frame per patch row
        return dict(video_processor_type="Qwen2VLVideoProcessor", patch_size=2, merge_size=2,
                    temporal_patch_size=1 if model_type == "llava_onevision1_5" else 2,
                    size={"shortest_edge": TINY_QWEN_PIXELS[0], "longest_edge": TINY_QWEN_PIXELS[1]}, **common)
    if model_type in ("qwen3_vl", "qwen3_5", "qwen3_5_moe"):  # Qwen3.5 uses Qwen3-VL's video processor
        common.update(image_mean=IMAGENET_STANDARD_MEAN, image_std=IMAGENET_STANDARD_STD)
        return dict(video_processor_type="Qwen3VLVideoProcessor", patch_size=2, temporal_patch_size=2, merge_size=2,
                    size={"shortest_edge": TINY_QWEN3_PIXELS[0], "longest_edge": TINY_QWEN3_PIXELS[1]},
                    max_video_tokens=TINY_QWEN3_PIXELS[2], **common)
    if model_type == "minicpmv4_6":  # its processor's IMAGENET 0.5 means and stds; no slices (docs/families.md)
        common.update(image_mean=IMAGENET_STANDARD_MEAN, image_std=IMAGENET_STANDARD_STD)
        return dict(video_processor_type="MiniCPMV4_6VideoProcessor", scale_resolution=TINY_MINICPM_RESOLUTION,
                    patch_size=2, slice_mode=False, downsample_mode="16x", use_image_id=True, **common)
    if model_type == "gemma4":  # its processor's means 0 and stds 1 (pixels stay in [0, 1])
        common.update(image_mean=[0.0, 0.0, 0.0], image_std=[1.0, 1.0, 1.0])
        patch, soft, kernel = TINY_GEMMA4_PATCHES
        return dict(video_processor_type="Gemma4VideoProcessor", patch_size=patch, max_soft_tokens=soft,
                    pooling_kernel_size=kernel, **common)
    raise ValueError(f"model_type: expected llava_onevision, llava_onevision1_5, qwen2_5_vl, qwen3_vl, qwen3_5, "
                     f"qwen3_5_moe, minicpmv4_6 or gemma4, got {model_type!r}")


def tiny_image_processor(model_type: str):
    """The PIL image processor of a tiny checkpoint (saved as LlavaOnevisionImageProcessor /
    Qwen2VLImageProcessor, the classes the released checkpoints name; Qwen3-VL's is Qwen2-VL's, patch 16 there)."""
    video = tiny_video_processor_config(model_type)
    if model_type == "gemma4":
        patch, soft, kernel = TINY_GEMMA4_PATCHES
        return Gemma4ImageProcessorPil(patch_size=patch, max_soft_tokens=soft, pooling_kernel_size=kernel)
    if model_type == "minicpmv4_6":
        return MiniCPMV4_6ImageProcessorPil(scale_resolution=TINY_MINICPM_RESOLUTION, patch_size=2, slice_mode=False,
                                            image_mean=video["image_mean"], image_std=video["image_std"])
    if model_type == "llava_onevision":
        return LlavaOnevisionImageProcessorPil(size=video["size"], image_grid_pinpoints=[[16, 16], [16, 32], [32, 16]])
    return Qwen2VLImageProcessorPil(size=video["size"], patch_size=2, temporal_patch_size=video["temporal_patch_size"],
                                    merge_size=2, image_mean=video["image_mean"], image_std=video["image_std"])

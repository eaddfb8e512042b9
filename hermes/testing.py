"""What the tests and the benchmarks share: tiny random-weight LLaVA-OneVision, Qwen2.5-VL and Qwen3-VL models built
from configs, a word-level tokenizer, saved tiny checkpoints, pixel inputs, and a census of live tensors.

Nothing is downloaded. The models keep the real architectures (Qwen2 / Qwen2.5-VL / Qwen3-VL decoders with GQA,
SigLIP / Qwen vision towers, Qwen3-VL's DeepStack mergers) at toy sizes so a forward takes milliseconds on CPU.
Weights are drawn with a larger initializer range than the default 0.02 so attention is far from uniform and
guidance scores are well separated (selection then does not hinge on rounding).
"""
from __future__ import annotations

import gc
import json
import os
import re
import warnings

import torch
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import (LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration, LlavaOnevisionImageProcessorPil,
                          PreTrainedTokenizerFast, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration,
                          Qwen2VLImageProcessorPil, Qwen3VLConfig, Qwen3VLForConditionalGeneration)
from transformers.image_utils import IMAGENET_STANDARD_MEAN, IMAGENET_STANDARD_STD, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

from hermes.policies.hermes.guidance import guidance_prompts
from hermes.models.llava_ov import LlavaOneVision
from hermes.models.qwen2_5_vl import Qwen2_5_VL
from hermes.models.qwen3_vl import Qwen3_VL, timestamp_text

SPECIAL = ["<unk>", "<pad>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
           "<image>", "<video>", "<|image_pad|>", "<|video_pad|>"]
EXTRA_WORDS = "what is the person holding doing where a red cup ball man woman yes no".split()
_WORD = r"\w+|[^\w\s]|\n"
_DIGIT_WORD = r"\d|[^\W\d]+|[^\w\s]|\n"  # every digit a word of its own, as Qwen's tokenizers split numbers


def _vocabulary(digits: bool) -> list[str]:
    texts = list(guidance_prompts().values()) + list(guidance_prompts("x").values())
    texts += [LlavaOneVision().prefix_text(None), LlavaOneVision().question_text("x"),
              Qwen2_5_VL().prefix_text(None), Qwen2_5_VL().question_text("x")]
    if digits:
        texts += [Qwen3_VL().prefix_text(None), Qwen3_VL().question_text("x"), timestamp_text(0.0), "0123456789"]
    words = set(EXTRA_WORDS)
    for text in texts:
        for special in SPECIAL:
            text = text.replace(special, " ")
        words.update(re.findall(_DIGIT_WORD if digits else _WORD, text))
    return SPECIAL + sorted(words)


def tiny_tokenizer(digits: bool = False) -> PreTrainedTokenizerFast:
    """Word-level tokenizer over the prompts' words; chat markers are special tokens; eos = <|im_end|>.
    digits=True (the tiny Qwen3-VL's): every digit is a token of its own and the words of Qwen3-VL's timestamps are
    in the vocabulary, so every timestamp has the token count it has with Qwen's tokenizers relative to its
    digits (the default vocabulary, and with it the other tiny models' weights, stays as it was)."""
    vocab = {word: index for index, word in enumerate(_vocabulary(digits))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"[ \t]+"), behavior="removed"),
        pre_tokenizers.Split(Regex(_DIGIT_WORD if digits else _WORD), behavior="isolated")])
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>",
                                   eos_token="<|im_end|>", additional_special_tokens=SPECIAL[2:])


def _text_config(vocab_size: int, num_layers: int, max_positions: int, num_heads: int = 4, num_kv_heads: int = 2,
                 **extra) -> dict:
    return dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, max_position_embeddings=max_positions,
                initializer_range=0.2, bos_token_id=None, eos_token_id=None, pad_token_id=None, **extra)


def tiny_llava_ov(seed: int = 0, num_layers: int = 4, max_positions: int = 4096, image_size: int = 16,
                  patch_size: int = 2, dtype: torch.dtype = torch.float32, num_heads: int = 4,
                  num_kv_heads: int = 2) -> LlavaOnevisionForConditionalGeneration:
    """LLaVA-OV with a 1-layer SigLIP tower: (image_size / patch_size / 2)^2 tokens per frame (16 by default).
    Head dim 16 whatever the head counts (Qwen2 decoders take an explicit head_dim), e.g. num_heads=8,
    num_kv_heads=4 for layers with more KV heads than two."""
    tok = tiny_tokenizer()
    torch.manual_seed(seed)
    heads = {} if (num_heads, num_kv_heads) == (4, 2) else dict(num_heads=num_heads, num_kv_heads=num_kv_heads,
                                                                 head_dim=16)
    config = LlavaOnevisionConfig(
        vision_config=dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
                           num_hidden_layers=1, num_attention_heads=2, image_size=image_size, patch_size=patch_size),
        text_config=dict(model_type="qwen2", **_text_config(len(tok), num_layers, max_positions, **heads)),
        image_token_index=tok.convert_tokens_to_ids("<image>"), video_token_index=tok.convert_tokens_to_ids("<video>"),
        vision_feature_layer=-1, vision_feature_select_strategy="full")
    return LlavaOnevisionForConditionalGeneration(config).to(dtype).eval()


def tiny_qwen2_5_vl(seed: int = 0, num_layers: int = 4, max_positions: int = 4096,
                    dtype: torch.dtype = torch.float32) -> Qwen2_5_VLForConditionalGeneration:
    """Qwen2.5-VL with a 1-block vision tower (patch 2, merge 2, temporal patch 2); head dim 16 with
    mrope_section [2, 3, 3]. A 16 x 16 frame pair gives 4 x 4 merged tokens."""
    tok = tiny_tokenizer()
    torch.manual_seed(seed)
    config = Qwen2_5_VLConfig(
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=2, spatial_merge_size=2, temporal_patch_size=2, window_size=8,
                           fullatt_block_indexes=[0], in_channels=3, tokens_per_second=2),
        text_config=_text_config(len(tok), num_layers, max_positions,
                                 rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                      mrope_section=[2, 3, 3])),
        image_token_id=tok.convert_tokens_to_ids("<|image_pad|>"),
        video_token_id=tok.convert_tokens_to_ids("<|video_pad|>"),
        vision_start_token_id=tok.convert_tokens_to_ids("<|vision_start|>"))
    return Qwen2_5_VLForConditionalGeneration(config).to(dtype).eval()


def tiny_qwen3_vl(seed: int = 0, num_layers: int = 4, max_positions: int = 4096,
                  dtype: torch.dtype = torch.float32) -> Qwen3VLForConditionalGeneration:
    """Qwen3-VL with a 2-block vision tower (patch 2, merge 2, temporal patch 2) whose blocks 0 and 1 feed DeepStack
    (added after decoder layers 0 and 1); head dim 16 with interleaved mrope_section [4, 2, 2] (pairs 1, 4 turn with
    h, 2, 5 with w, the rest with t, like the released [24, 20, 20]). Its tokenizer is tiny_tokenizer(digits=True).
    A 16 x 16 frame pair gives 4 x 4 merged tokens. The tower is drawn at the text's initializer range too, so the
    DeepStack features are not negligible next to the hidden states."""
    tok = tiny_tokenizer(digits=True)
    torch.manual_seed(seed)
    config = Qwen3VLConfig(
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=2, spatial_merge_size=2, temporal_patch_size=2, in_channels=3,
                           num_position_embeddings=16, deepstack_visual_indexes=[0, 1], initializer_range=0.2),
        text_config=_text_config(len(tok), num_layers, max_positions, head_dim=16,
                                 rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[4, 2, 2],
                                                      mrope_interleaved=True)),
        image_token_id=tok.convert_tokens_to_ids("<|image_pad|>"),
        video_token_id=tok.convert_tokens_to_ids("<|video_pad|>"),
        vision_start_token_id=tok.convert_tokens_to_ids("<|vision_start|>"),
        vision_end_token_id=tok.convert_tokens_to_ids("<|vision_end|>"))
    return Qwen3VLForConditionalGeneration(config).to(dtype).eval()


def llava_pixels(batch: int, frames: int, generator: torch.Generator, image_size: int = 16,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Random pixel values [B, F, 3, S, S] for `tiny_llava_ov`."""
    return torch.randn(batch, frames, 3, image_size, image_size, generator=generator).to(dtype)


def qwen_pixels(batch: int, frames: int, generator: torch.Generator, height: int = 16, width: int = 16,
                dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Random flattened patches [B * t * h * w, 3 * 2 * 2 * 2] and grid_thw [B, 3] for `tiny_qwen2_5_vl` and
    `tiny_qwen3_vl`."""
    grid = torch.tensor([frames // 2, height // 2, width // 2])
    rows = batch * int(grid.prod())
    return torch.randn(rows, 3 * 2 * 2 * 2, generator=generator).to(dtype), grid.expand(batch, 3).clone()


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
    patch 2, merge 2, temporal patch 2 and TINY_QWEN3_PIXELS, with its processor's 0.5 means and stds."""
    common = dict(resample=3, rescale_factor=1 / 255, image_mean=OPENAI_CLIP_MEAN, image_std=OPENAI_CLIP_STD,
                  do_resize=True, do_rescale=True, do_normalize=True, do_convert_rgb=True, do_sample_frames=False)
    if model_type == "llava_onevision":
        return dict(video_processor_type="LlavaOnevisionVideoProcessor", size={"height": 16, "width": 16}, **common)
    if model_type == "qwen2_5_vl":
        return dict(video_processor_type="Qwen2VLVideoProcessor", patch_size=2, temporal_patch_size=2, merge_size=2,
                    size={"shortest_edge": TINY_QWEN_PIXELS[0], "longest_edge": TINY_QWEN_PIXELS[1]}, **common)
    if model_type == "qwen3_vl":
        common.update(image_mean=IMAGENET_STANDARD_MEAN, image_std=IMAGENET_STANDARD_STD)
        return dict(video_processor_type="Qwen3VLVideoProcessor", patch_size=2, temporal_patch_size=2, merge_size=2,
                    size={"shortest_edge": TINY_QWEN3_PIXELS[0], "longest_edge": TINY_QWEN3_PIXELS[1]},
                    max_video_tokens=TINY_QWEN3_PIXELS[2], **common)
    raise ValueError(f"model_type: expected llava_onevision, qwen2_5_vl or qwen3_vl, got {model_type!r}")


def tiny_image_processor(model_type: str):
    """The PIL image processor of a tiny checkpoint (saved as LlavaOnevisionImageProcessor /
    Qwen2VLImageProcessor, the classes the released checkpoints name; Qwen3-VL's is Qwen2-VL's, patch 16 there)."""
    video = tiny_video_processor_config(model_type)
    if model_type == "llava_onevision":
        return LlavaOnevisionImageProcessorPil(size=video["size"], image_grid_pinpoints=[[16, 16], [16, 32], [32, 16]])
    return Qwen2VLImageProcessorPil(size=video["size"], patch_size=2, temporal_patch_size=2, merge_size=2,
                                    image_mean=video["image_mean"], image_std=video["image_std"])


def save_tiny_checkpoint(folder: str | os.PathLike, model_type: str, seed: int = 0) -> str:
    """Save a tiny model with its tokenizer and processor configs into `folder`, loadable with from_pretrained
    (AutoConfig, AutoModelForImageTextToText, AutoTokenizer, AutoImageProcessor, and AutoProcessor where
    torchvision imports). Returns the folder.

    Written: the model (config.json, weights), the tokenizer, preprocessor_config.json (image processor),
    video_preprocessor_config.json and processor_config.json. The last two are written as JSON because
    transformers' video processors (and the processors holding one) cannot be built without torchvision.
    """
    folder = os.fspath(folder)
    build = {"llava_onevision": tiny_llava_ov, "qwen2_5_vl": tiny_qwen2_5_vl, "qwen3_vl": tiny_qwen3_vl}
    if model_type not in build:
        raise ValueError(f"model_type: expected one of {sorted(build)}, got {model_type!r}")
    build[model_type](seed=seed).save_pretrained(folder)
    tiny_tokenizer(digits=model_type == "qwen3_vl").save_pretrained(folder)
    tiny_image_processor(model_type).save_pretrained(folder)
    if model_type == "llava_onevision":
        processor = {"processor_class": "LlavaOnevisionProcessor", "num_image_tokens": 64,
                     "vision_feature_select_strategy": "full", "vision_aspect_ratio": "anyres_max_9"}
    else:
        processor = {"processor_class": "Qwen2_5_VLProcessor" if model_type == "qwen2_5_vl" else "Qwen3VLProcessor"}
    for name, content in (("video_preprocessor_config.json", tiny_video_processor_config(model_type)),
                          ("processor_config.json", processor)):
        with open(os.path.join(folder, name), "w") as f:
            json.dump(content, f, indent=2)
    return folder


def live_tensors() -> tuple[int, int]:
    """(count, bytes of distinct storages) of every tensor alive in the process, after a full collection:
    the CPU allocator keeps no statistics, so this census is how a per-step leak shows."""
    gc.collect()
    with warnings.catch_warnings():  # isinstance() pokes deprecated torch.distributed aliases
        warnings.simplefilter("ignore", FutureWarning)
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return len(tensors), sum(storages.values())

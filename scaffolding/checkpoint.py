"""Save a tiny random checkpoint folder that `from_pretrained` and the `hermes` / `hermes-profile` commands load
(docs/testing.md#scaffolding). From a checkout, for a dry run of the commands without downloading a model:

    python -m scaffolding.checkpoint tiny-qwen2_5_vl --model-type qwen2_5_vl
    hermes --model tiny-qwen2_5_vl --video clip.mp4 --question "what is the person holding ?" --budget 32

The answers are word salad (random weights); the run exercises loading, decoding, streaming and compression.
"""
from __future__ import annotations

import argparse
import json
import os

from scaffolding.models import (tiny_gemma4, tiny_llava_ov, tiny_llava_ov1_5, tiny_minicpmv4_6, tiny_qwen2_5_vl,
                                tiny_qwen3_5, tiny_qwen3_5_moe, tiny_qwen3_vl)
from scaffolding.processors import tiny_image_processor, tiny_video_processor_config
from scaffolding.tokenizer import tiny_minicpm_tokenizer, tiny_tokenizer

BUILDERS = {"llava_onevision": tiny_llava_ov, "llava_onevision1_5": tiny_llava_ov1_5, "qwen2_5_vl": tiny_qwen2_5_vl,
            "qwen3_vl": tiny_qwen3_vl, "qwen3_5": tiny_qwen3_5, "qwen3_5_moe": tiny_qwen3_5_moe,
            "minicpmv4_6": tiny_minicpmv4_6, "gemma4": tiny_gemma4,
            "gemma4_moe": lambda seed=0: tiny_gemma4(seed=seed, moe=True)}
# checkpoints that are a variant of another model type (the same config class, tokenizer and processors): Gemma 4's
# MoE decoder is `enable_moe_block` in a gemma4 config, not a model type of its own
VARIANT_OF = {"gemma4_moe": "gemma4"}
# model types whose tiny tokenizer splits digits: their chunks carry text timestamps
DIGIT_TOKENIZERS = ("qwen3_vl", "qwen3_5", "qwen3_5_moe", "gemma4")


def save_tiny_checkpoint(folder: str | os.PathLike, model_type: str, seed: int = 0) -> str:
    """Save a tiny model with its tokenizer and processor configs into `folder`, loadable with from_pretrained
    (AutoConfig, AutoModelForImageTextToText, AutoTokenizer, AutoImageProcessor, and AutoProcessor where
    torchvision imports). `model_type`: a key of BUILDERS (a transformers model type, or "gemma4_moe": a gemma4
    checkpoint whose decoder has the MoE block). Returns the folder.

    Written: the model (config.json, weights), the tokenizer, preprocessor_config.json (image processor),
    video_preprocessor_config.json and processor_config.json. The last two are written as JSON because
    transformers' video processors (and the processors holding one) cannot be built without torchvision.
    """
    folder = os.fspath(folder)
    if model_type not in BUILDERS:
        raise ValueError(f"model_type: expected one of {sorted(BUILDERS)}, got {model_type!r}")
    BUILDERS[model_type](seed=seed).save_pretrained(folder)
    model_type = VARIANT_OF.get(model_type, model_type)
    tokenizer = tiny_minicpm_tokenizer() if model_type == "minicpmv4_6" else \
        tiny_tokenizer(digits=model_type in DIGIT_TOKENIZERS, gemma=model_type == "gemma4")
    tokenizer.save_pretrained(folder)
    tiny_image_processor(model_type).save_pretrained(folder)
    if model_type == "llava_onevision":
        processor = {"processor_class": "LlavaOnevisionProcessor", "num_image_tokens": 64,
                     "vision_feature_select_strategy": "full", "vision_aspect_ratio": "anyres_max_9"}
    else:
        # Qwen3.5's checkpoints name Qwen3-VL's processor (transformers has no Qwen3.5 processor); LLaVA-OV-1.5's
        # is the one transformers maps it to, EXAONE 4.5's
        classes = {"qwen2_5_vl": "Qwen2_5_VLProcessor", "llava_onevision1_5": "Exaone4_5_Processor",
                   "minicpmv4_6": "MiniCPMV4_6Processor", "gemma4": "Gemma4Processor"}
        processor = {"processor_class": classes.get(model_type, "Qwen3VLProcessor")}
    for name, content in (("video_preprocessor_config.json", tiny_video_processor_config(model_type)),
                          ("processor_config.json", processor)):
        with open(os.path.join(folder, name), "w") as f:
            json.dump(content, f, indent=2)
    return folder


def main(argv: list[str] | None = None) -> str:
    """`python -m scaffolding.checkpoint OUT --model-type TYPE [--seed N]`; refuses a folder that holds files
    before anything is written. Returns the folder."""
    p = argparse.ArgumentParser(prog="python -m scaffolding.checkpoint",
                                description="Save a tiny random-weight checkpoint (a dry run of the hermes command).")
    p.add_argument("out", metavar="OUT", help="folder to write (created; must be empty if it exists)")
    p.add_argument("--model-type", required=True, choices=sorted(BUILDERS))
    p.add_argument("--seed", type=int, default=0, help="weight seed (default 0, the tests' models)")
    args = p.parse_args(argv)
    if os.path.isdir(args.out) and os.listdir(args.out):
        p.error(f"OUT: {args.out} exists and is not empty")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        p.error(f"OUT: {args.out} exists and is not a folder")
    folder = save_tiny_checkpoint(args.out, args.model_type, seed=args.seed)
    print(f"saved a tiny {args.model_type} checkpoint to {folder}")
    return folder


if __name__ == "__main__":
    main()

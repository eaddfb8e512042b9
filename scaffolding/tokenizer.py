"""The word-level tokenizer of the tiny models (docs/testing.md#scaffolding): a vocabulary of the words in the
families' chat templates and the HERMES guidance prompts, so every prompt the stream builds tokenizes without
unknowns. The vocabulary fixes the tiny models' embedding sizes, and with them their seeded weights: tests compare
against fixed behaviour, so a change here changes every tiny model.
"""
from __future__ import annotations

import re

from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from hermes.models.llava_ov import LlavaOneVision
from hermes.models.qwen2_5_vl import Qwen2_5_VL
from hermes.models.qwen3_vl import Qwen3_VL, timestamp_text
from hermes.policies.hermes.guidance import guidance_prompts

SPECIAL = ["<unk>", "<pad>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
           "<image>", "<video>", "<|image_pad|>", "<|video_pad|>"]
# Gemma 4's turn markers, begin / end of image, its video and image soft tokens, its bos (the chat template's first
# token) and its audio markers: appended after SPECIAL, in the gemma vocabulary only (the other tiny models'
# vocabularies, and with them their weights, stay as they were)
GEMMA_SPECIAL = ["<|turn>", "<turn|>", "<|image>", "<image|>", "<|video|>", "<|image|>", "<bos>", "<|audio>",
                 "<audio|>", "<|audio|>"]
# the names Gemma 4's tokenizer_config.json gives its markers (Gemma4Processor reads the image and audio ones off the
# tokenizer, and refuses every input while boa_token or eoa_token is missing)
GEMMA_NAMED = dict(bos_token="<bos>", boi_token="<|image>", eoi_token="<image|>", image_token="<|image|>",
                   boa_token="<|audio>", eoa_token="<audio|>", audio_token="<|audio|>", sot_token="<|turn>",
                   eot_token="<turn|>")
EXTRA_WORDS = "what is the person holding doing where a red cup ball man woman yes no".split()
_WORD = r"\w+|[^\w\s]|\n"
_DIGIT_WORD = r"\d|[^\W\d]+|[^\w\s]|\n"  # every digit a word of its own, as Qwen's tokenizers split numbers


def _vocabulary(digits: bool, gemma: bool = False) -> list[str]:
    texts = list(guidance_prompts().values()) + list(guidance_prompts("x").values())
    texts += [LlavaOneVision().prefix_text(None), LlavaOneVision().question_text("x"),
              Qwen2_5_VL().prefix_text(None), Qwen2_5_VL().question_text("x")]
    if digits:
        texts += [Qwen3_VL().prefix_text(None), Qwen3_VL().question_text("x"), timestamp_text(0.0), "0123456789"]
    if gemma:
        from hermes.models.gemma4 import Gemma4, frame_text
        texts += [Gemma4().prefix_text(None), Gemma4().question_text("x"), "model user system", frame_text(0.0)]
    specials = SPECIAL + (GEMMA_SPECIAL if gemma else [])
    words = set(EXTRA_WORDS)
    for text in texts:
        for special in specials:
            text = text.replace(special, " ")
        words.update(re.findall(_DIGIT_WORD if digits else _WORD, text))
    return specials + sorted(words)


def tiny_tokenizer(digits: bool = False, gemma: bool = False) -> PreTrainedTokenizerFast:
    """Word-level tokenizer over the prompts' words; chat markers are special tokens; eos = <|im_end|>.
    digits=True (the tiny Qwen3-VL's): every digit is a token of its own and the words of Qwen3-VL's timestamps are
    in the vocabulary, so every timestamp has the token count it has with Qwen's tokenizers relative to its
    digits (the default vocabulary, and with it the other tiny models' weights, stays as it was). gemma=True (the
    tiny Gemma 4's): GEMMA_SPECIAL and the words of Gemma 4's chat text too, the markers named as GEMMA_NAMED, eos
    <turn|>."""
    vocab = {word: index for index, word in enumerate(_vocabulary(digits, gemma))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"[ \t]+"), behavior="removed"),
        pre_tokenizers.Split(Regex(_DIGIT_WORD if digits else _WORD), behavior="isolated")])
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>",
                                   eos_token="<turn|>" if gemma else "<|im_end|>",
                                   additional_special_tokens=SPECIAL[2:] + (GEMMA_SPECIAL if gemma else []),
                                   **(GEMMA_NAMED if gemma else {}))


# MiniCPM-V 4.6's markers, by the names its processor reads them (tokenizer.image_start_token, ...); "<image>",
# "<|image_pad|>" and "<|video_pad|>" are in SPECIAL already, the others are appended after the digits vocabulary
MINICPM_MARKERS = {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>", "image_start_token": "<image>",
                   "image_end_token": "</image>", "slice_start_token": "<slice>", "slice_end_token": "</slice>",
                   "image_id_start_token": "<image_id>", "image_id_end_token": "</image_id>"}


def tiny_minicpm_tokenizer() -> PreTrainedTokenizerFast:
    """tiny_tokenizer(digits=True) (its ids unchanged) with MiniCPM-V 4.6's markers as special tokens, named as
    MiniCPMV4_6Processor reads them (`image_token`, `video_token`, `image_start_token`, ... and their `_id`s); they
    survive save_pretrained / AutoTokenizer.from_pretrained."""
    tok = tiny_tokenizer(digits=True)
    added = [marker for marker in MINICPM_MARKERS.values() if marker not in tok.get_vocab()]
    tok.add_special_tokens({"extra_special_tokens": added}, replace_extra_special_tokens=False)
    return PreTrainedTokenizerFast(tokenizer_object=tok.backend_tokenizer, unk_token="<unk>", pad_token="<pad>",
                                   eos_token=tok.eos_token, extra_special_tokens=tok.extra_special_tokens,
                                   **MINICPM_MARKERS)

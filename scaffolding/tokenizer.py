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

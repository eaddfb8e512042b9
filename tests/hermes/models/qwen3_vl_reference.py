"""The reference side of the Qwen3-VL tests: a whole stream laid out as Qwen3VLProcessor lays out one video, for
the model's own forward (`Qwen3VLForConditionalGeneration`: its get_rope_index positions and its DeepStack),
written here from transformers' processor and docs/qwen3_vl.md, not from `hermes.models.qwen3_vl`."""
from __future__ import annotations

import torch

from hermes.attention import attention_implementation

PREFIX = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"


def question_text(question: str) -> str:
    return f"{question}<|im_end|>\n<|im_start|>assistant\n"


def step_text(seconds: float, visual_tokens: int) -> str:
    """One temporal step as Qwen3VLProcessor.replace_video_token writes it, the seconds zero-padded to 5 digits."""
    return f"<{seconds:07.1f} seconds><|vision_start|>" + "<|video_pad|>" * visual_tokens + "<|vision_end|>"


def full_inputs(model, tokenizer, chunks: list[dict], batch: int, tail: str = "") -> dict:
    """Keyword arguments of the model's forward over prefix + every chunk + `tail` text for `batch` streams:
    input_ids [B, S], mm_token_type_ids (2 at the video pads), pixel_values_videos (stream-major, then chunk order:
    the order of the pads) and video_grid_thw (one row per chunk and stream). chunks: append_video keyword
    arguments (video, grid_thw, timestamps)."""
    merge = model.config.vision_config.spatial_merge_size
    text = PREFIX
    for chunk in chunks:
        _, h, w = (int(x) for x in torch.as_tensor(chunk["grid_thw"]).reshape(-1, 3)[0])
        text += "".join(step_text(seconds, h * w // merge ** 2) for seconds in chunk["timestamps"])
    ids = torch.tensor([tokenizer(text + tail, add_special_tokens=False)["input_ids"]] * batch)
    rows = [chunk["video"].shape[0] // batch for chunk in chunks]
    pixels = torch.cat([chunk["video"][b * n:(b + 1) * n] for b in range(batch) for chunk, n in zip(chunks, rows)])
    grids = torch.cat([torch.as_tensor(chunk["grid_thw"]).reshape(-1, 3)[:1] for _ in range(batch)
                       for chunk in chunks])
    return {"input_ids": ids, "mm_token_type_ids": 2 * (ids == model.config.video_token_id).int(),
            "pixel_values_videos": pixels, "video_grid_thw": grids}


def own_forward(model, inputs: dict, attention: str = "sdpa", **kwargs):
    """The model's own forward (no cache, no engine) under transformers' `attention`."""
    with attention_implementation(model, attention), torch.no_grad():
        return model(**inputs, **kwargs)


def rope_index(model, inputs: dict) -> torch.Tensor:
    """int64 [3, B, S]: the model's own positions of the sequence (get_rope_index splits the grid per step)."""
    return model.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                      video_grid_thw=inputs["video_grid_thw"].clone())[0]


def chunked_forward(model, tokenizer, chunks: list[dict], batch: int, cache) -> dict:
    """The model's own forwards into `cache` with the stream's boundaries: the prefix alone, then one forward per
    chunk (its tokens, its pixels, its slice of the whole sequence's get_rope_index positions). A hybrid model's
    chunked linear attention then sums in the stream's order. Returns the whole sequence's `full_inputs`."""
    whole = full_inputs(model, tokenizer, chunks, batch)
    positions = rope_index(model, whole)
    start = len(tokenizer(PREFIX, add_special_tokens=False)["input_ids"])
    own_forward(model, {"input_ids": whole["input_ids"][:, :start], "position_ids": positions[:, :, :start]},
                cache=cache, use_cache=True)
    for count in range(1, len(chunks) + 1):
        end = full_inputs(model, tokenizer, chunks[:count], batch)["input_ids"].shape[1]
        alone = full_inputs(model, tokenizer, chunks[count - 1:count], batch)
        own_forward(model, {"input_ids": whole["input_ids"][:, start:end],
                            "mm_token_type_ids": whole["mm_token_type_ids"][:, start:end],
                            "pixel_values_videos": alone["pixel_values_videos"],
                            "video_grid_thw": alone["video_grid_thw"], "position_ids": positions[:, :, start:end]},
                    cache=cache, use_cache=True)
        start = end
    assert start == whole["input_ids"].shape[1]
    return whole

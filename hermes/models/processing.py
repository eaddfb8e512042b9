"""A checkpoint's processor for streaming: its tokenizer and its video processor, or a torchvision-free twin.

transformers' video processors (LLaVA-OneVision, Qwen2-VL / Qwen2.5-VL, Qwen3-VL) run on torchvision, and without it
even `AutoProcessor.from_pretrained` fails for these checkpoints. `load_processor` therefore returns the real
processor when torchvision imports (the GPU path) and otherwise a `Processor` holding the tokenizer and the
family's `PilVideoProcessor`: the same steps as the video processor (convert to RGB, resize, rescale,
normalise, then the family's layout), with the video processor's settings read from the checkpoint the way
transformers resolves them (processor_config.json's "video_processor", else video_preprocessor_config.json,
else preprocessor_config.json), each step done by the checkpoint's PIL image processor.

Both return the same tensors in the same layout. Pixel values differ only where the two libraries resample
differently (torchvision's and PIL's antialiased bicubic round differently) and in float rounding.
"""
from __future__ import annotations

import dataclasses
import os

import numpy as np
import torch
from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer
from transformers.image_utils import ChannelDimension, SizeDict
from transformers.utils import is_torchvision_available
from transformers.video_processing_utils import BaseVideoProcessor


@dataclasses.dataclass
class Processor:
    """The parts of a checkpoint's processor a stream uses (the shape of transformers' processors)."""

    tokenizer: object
    video_processor: object


class PilVideoProcessor:
    """Base of the torchvision-free twins: per-frame RGB conversion, resize, rescale and normalisation with the
    checkpoint's PIL image processor, under the video processor's settings.

    Subclasses set `defaults` (the transformers video processor class's own defaults, for keys a checkpoint's
    config leaves out), `model_input_names` and `layout()` (the family's output tensors), and may override
    `standardize()`, `resize_kwargs()` and `resize()` (Qwen3-VL sizes a clip's frames together).
    """

    defaults: dict = {}
    model_input_names: tuple[str, ...] = ()
    # call arguments of the video processor the twin takes only switched off (the behaviour it implements)
    off_flags: tuple[str, ...] = ("do_sample_frames",)
    # call arguments the twin takes with any value: they reach `resize()` for that call
    options: tuple[str, ...] = ()

    def __init__(self, image_processor, config: dict | None = None):
        if getattr(image_processor, "backend", None) != "pil":
            raise TypeError(f"image_processor: expected a PIL-backend image processor, got "
                            f"{type(image_processor).__name__}")
        settings = dict(self.defaults)
        settings.update({key: value for key, value in (config or {}).items() if key in self.defaults})
        settings = self.standardize(settings)
        if settings.get("do_center_crop"):
            raise ValueError("video processor: do_center_crop is not supported without torchvision; install "
                             "torchvision to use the checkpoint's own video processor")
        self.image_processor = image_processor
        for key, value in settings.items():
            setattr(self, key, value)
        self.size = SizeDict(**self.size)

    @staticmethod
    def standardize(settings: dict) -> dict:
        """Settings in the form the video processor's __init__ leaves them (hook for legacy keys)."""
        return settings

    def resize_kwargs(self) -> dict:
        """Extra arguments of the image processor's resize (besides image, size and resample)."""
        return {}

    def resize(self, image: np.ndarray, num_frames: int, **options) -> np.ndarray:
        """One frame [C, H, W] of a clip of `num_frames` resized by the image processor under `size`; `options`:
        this call's `options` arguments."""
        return self.image_processor.resize(image, self.size, resample=self.resample, **self.resize_kwargs())

    def frames(self, video: np.ndarray, **options) -> np.ndarray:
        """float32 [F, C, H', W'] from uint8 [F, H, W, C] frames (or a list of [H, W, C] frames)."""
        processor = self.image_processor
        out = []
        for frame in video:
            image = processor.process_image(np.asarray(frame), do_convert_rgb=self.do_convert_rgb,
                                            input_data_format=ChannelDimension.LAST)
            if self.do_resize:
                image = self.resize(image, len(video), **options)
            if self.do_rescale:
                image = processor.rescale(image, self.rescale_factor)
            if self.do_normalize:
                image = processor.normalize(image, self.image_mean, self.image_std)
            out.append(np.asarray(image, dtype=np.float32))
        return np.stack(out)

    def layout(self, frames: np.ndarray) -> dict:
        """The family's model inputs for one clip of processed frames float32 [F, C, H, W]."""
        raise NotImplementedError

    def __call__(self, videos, return_tensors: str | None = "pt", **kwargs) -> dict:
        """Like the video processor's call on a list of clips (each uint8 [F, H, W, C]): a dict of torch tensors
        with the video processor's keys. Of its keyword arguments only `off_flags` (only false) and `options` are
        taken."""
        if return_tensors != "pt":
            raise ValueError(f"return_tensors: only 'pt' is supported, got {return_tensors!r}")
        options = {key: kwargs.pop(key) for key in self.options if key in kwargs}
        for key, value in kwargs.items():
            if key not in self.off_flags:
                raise TypeError(f"{type(self).__name__}: unsupported argument {key!r}")
            if value:
                raise ValueError(f"{key}: only False is supported without torchvision")
        if isinstance(videos, np.ndarray) and videos.ndim == 4:
            videos = [videos]
        outputs = [self.layout(self.frames(video, **options)) for video in videos]
        return {key: torch.cat([torch.as_tensor(np.asarray(out[key])) for out in outputs])
                for key in self.model_input_names}


def size_of(video_processor) -> SizeDict:
    """A video processor's `size` setting as a SizeDict (transformers' processors may keep a dict, the twins keep
    a SizeDict)."""
    return SizeDict(**dict(video_processor.size))


def load_processor(path: str | os.PathLike, family, **options):
    """The checkpoint's processor: `AutoProcessor` when torchvision imports, else `Processor` with the tokenizer
    (`AutoTokenizer`) and the family's `PilVideoProcessor` over the PIL image processor (`AutoImageProcessor`).
    `options` go to every from_pretrained (the commands pass `hermes.commands.LOCAL_ONLY`)."""
    if is_torchvision_available():
        return AutoProcessor.from_pretrained(path, **options)
    local = {key: options[key] for key in ("local_files_only",) if key in options}  # all it takes of them
    config, _ = BaseVideoProcessor.get_video_processor_dict(os.fspath(path), **local)
    return Processor(tokenizer=AutoTokenizer.from_pretrained(path, **options),
                     video_processor=family.pil_video_processor(AutoImageProcessor.from_pretrained(path, **options),
                                                                config))


__all__ = ["Processor", "PilVideoProcessor", "load_processor", "size_of"]

"""A checkpoint's processor for streaming: its tokenizer and its video processor, or the family's torchvision-free
twin of it where torchvision does not import (docs/families.md#processors)."""
from __future__ import annotations

import dataclasses
import os

from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer
from transformers.utils import is_torchvision_available
from transformers.video_processing_utils import BaseVideoProcessor


@dataclasses.dataclass
class Processor:
    """The parts of a checkpoint's processor a stream uses (the shape of transformers' processors)."""

    tokenizer: object
    video_processor: object


def load_processor(path: str | os.PathLike, family, **options):
    """The checkpoint's processor: `AutoProcessor` when torchvision imports, else `Processor` with the tokenizer
    (`AutoTokenizer`) and the family's `PilVideoProcessor` over the PIL image processor (`AutoImageProcessor`), the
    video processor's settings read as transformers resolves them. `options` go to every from_pretrained (the
    commands pass `hermes.commands.LOCAL_ONLY`)."""
    if is_torchvision_available():
        return AutoProcessor.from_pretrained(path, **options)
    local = {key: options[key] for key in ("local_files_only",) if key in options}  # all it takes of them
    config, _ = BaseVideoProcessor.get_video_processor_dict(os.fspath(path), **local)
    return Processor(tokenizer=AutoTokenizer.from_pretrained(path, **options),
                     video_processor=family.pil_video_processor(AutoImageProcessor.from_pretrained(path, **options),
                                                                config))


__all__ = ["Processor", "load_processor"]

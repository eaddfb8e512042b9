"""What every model family builds on: the family interface, the chunk it encodes, the pixel and frame-time checks and
the base of its torchvision-free video processor twin.

A family file imports this module (never the package, whose `__init__` is the registry that imports the families):
it implements the abstract methods of `ModelFamily` and sets its class attributes; the base owns the rest. The
contract, with shapes, and the layout of each family: docs/families.md.
"""
from __future__ import annotations

import abc
import dataclasses
import math
from typing import Callable, ClassVar, Sequence

import numpy as np
import torch
from transformers.image_utils import ChannelDimension, SizeDict

from hermes_kernels.rope import RotaryLayout


@dataclasses.dataclass
class VideoChunk:
    """One encoded chunk for B streams.

    embeds:        [B, T, hidden] language-model input embeddings (the model's dtype and device).
    rel_positions: int64 [3, T] M-RoPE offsets (t, h, w) from the chunk's start position, or None for 1D
                   RoPE (0, 1, ..., T-1).
    frames:        H2SVC frames in the chunk (the unit of memory, docs/h2svc.md §1); the T tokens are `frames` runs
                   of T / frames tokens.
    extent:        the largest offset of `rel_positions` over axes and tokens (T - 1 for 1D RoPE), a host int: the
                   chunk's next position is start + extent + 1, known without reading a device tensor.
    extra:         count -> extra keyword arguments of the language model's forward (see `lm_kwargs`), or None.
    blocks:        int64 [T], or None: the vision block of each token (>= 0; the tokens of one image or frame share
                   one) or -1 (text), for decoders whose sliding-window layers let a block's tokens attend to each
                   other both ways (Gemma 4, docs/gemma4.md#masks); None: every token attends causally.
    """

    embeds: torch.Tensor
    rel_positions: torch.Tensor | None
    frames: int
    extent: int
    extra: Callable[[int], dict] | None = None
    blocks: torch.Tensor | None = None

    def lm_kwargs(self, count: int | None = None) -> dict:
        """Keyword arguments the language model's forward over this chunk needs besides embeddings and positions,
        for a forward of `count` tokens (default T) whose first T are the chunk's and the rest text (HERMES's fused
        guidance prompts); {} without `extra`. Every forward that carries a chunk passes them, so the chunk's hidden
        states are the model's own (Qwen3-VL's DeepStack, docs/qwen3_vl.md#differences)."""
        if self.extra is None:
            return {}
        return self.extra(self.embeds.shape[1] if count is None else count)


def size_of(video_processor) -> SizeDict:
    """A video processor's `size` setting as a SizeDict (transformers' processors may keep a dict, the twins keep
    a SizeDict)."""
    return SizeDict(**dict(video_processor.size))


class PilVideoProcessor:
    """Base of the torchvision-free twins of transformers' video processors (docs/families.md#processors):
    per-frame RGB conversion, resize, rescale and normalisation with the checkpoint's PIL image processor, under
    the video processor's settings.

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


class ModelFamily(abc.ABC):
    """A supported model family: how a chunk of video becomes language-model input, and the text around it.

    A family sets `name`, `preset_name` and `pil_processor` and implements the abstract methods; the defaults
    below fit a ChatML model whose decoder is `model.model.language_model` (docs/families.md#contract).
    """

    name: ClassVar[str]  # in error messages: "Qwen2.5-VL"
    preset_name: ClassVar[str]  # the family's preset in every policy's config (`HermesConfig.preset`, ...)
    pil_processor: ClassVar[type[PilVideoProcessor]]  # the torchvision-free twin of its video processor
    system_prompt: ClassVar[str] = "You are a helpful assistant."
    # ChatML text right before the first chunk and right before the question (the video's markers)
    before_video: ClassVar[str] = ""
    after_video: ClassVar[str] = ""
    # rules for DistributedConfig(tp_plan=...) where transformers' plan for the family leaves the attention whole:
    # keys as from_pretrained's model names its modules ("model.language_model.layers.*.self_attn.q_proj"), merged
    # over transformers' plan; None where transformers' plan splits every attention's heads
    # (docs/multi-gpu.md#families)
    tp_plan: ClassVar[dict[str, str] | None] = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if missing := [attr for attr in ("name", "preset_name", "pil_processor") if not hasattr(cls, attr)]:
            raise TypeError(f"{cls.__name__}: a model family sets {missing} (docs/families.md#contract)")

    # ---- what a family implements ----------------------------------------------------------------------------
    @abc.abstractmethod
    def rotary(self, model: torch.nn.Module) -> tuple[torch.Tensor, RotaryLayout | None]:
        """(inv_freq [D/2] taken from the model's rotary module — never recomputed, docs/hermes.md §2.8 — and the
        axis of each frequency pair: a `RotaryLayout` for M-RoPE, None for 1D RoPE)."""

    @abc.abstractmethod
    def tokens_per_frame(self, model: torch.nn.Module, frame_size: tuple[int, int] | None = None,
                         tokenizer=None) -> int:
        """Tokens of one H2SVC frame (`VideoChunk.frames`); ValueError naming frame_size when it depends on a frame
        size that is not given. `tokenizer`: the stream's, for families whose frames carry text."""

    @abc.abstractmethod
    def encode_video(self, model, processor, video, batch_size: int, **kwargs) -> VideoChunk:
        """Validate and encode one chunk for `batch_size` streams: model-ready pixel values, or raw frames for
        `processor.video_processor`; `kwargs` are the family's own `append_video` arguments (unknown ones:
        `reject_unexpected`). Raises before the vision tower runs when an input is wrong."""

    @abc.abstractmethod
    def prepare_frames(self, processor, frames, fps: float, start: float = 0.0,
                       times: Sequence[float] | None = None) -> dict:
        """`append_video` keyword arguments for one clip: frames uint8 [F, H, W, 3] RGB sampled at `fps` frames per
        second, the first at `start` seconds of the video, through `processor.video_processor` (the real one or
        the twin). `times`: the frames' own seconds of video (F of them, increasing; `check_times`), for a clip
        whose frames are not evenly spaced (a live session dropped some, docs/live.md#gaps); when given, the
        family times the clip from them instead of from fps and start, as far as its positions can say it."""

    @abc.abstractmethod
    def memory_frames(self, inputs: dict) -> int:
        """H2SVC frames (`VideoChunk.frames`) in one chunk's `prepare_frames` output."""

    # ---- what the base provides ------------------------------------------------------------------------------
    def kept_size(self, processor, height: int, width: int) -> tuple[int, int] | None:
        """(height, width) `prepare_frames` resizes a height x width frame to (the largest, where it depends on
        the chunk), or None when frames go through whole: how far the video reader may shrink frames while
        decoding them (`hermes.video.VideoReader.output_size`, docs/security.md#video)."""
        return None

    def language_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """The decoder stack the cache and attention patch apply to."""
        return model.model.language_model

    def step_frames(self, model: torch.nn.Module) -> int:
        """Video frames one H2SVC frame covers (1; Qwen: the temporal patch)."""
        return 1

    def tokens_per_chunk(self, model: torch.nn.Module, frames: int, frame_size: tuple[int, int] | None,
                         tokenizer=None) -> int:
        """Tokens a chunk of `frames` video frames yields (sizes the cache): a last H2SVC frame that is short of
        `step_frames` video frames still takes a whole frame's tokens."""
        return -(-frames // self.step_frames(model)) * self.tokens_per_frame(model, frame_size, tokenizer)

    def frame_size(self, model: torch.nn.Module, inputs: dict) -> tuple[int, int] | None:
        """(height, width) of the processed frames in `inputs` where the token count depends on it, else None."""
        return None

    def pil_video_processor(self, image_processor, config: dict) -> PilVideoProcessor:
        """The family's `pil_processor` over the checkpoint's PIL image processor, with the video processor's
        settings `config` (`hermes.models.processing.load_processor`)."""
        return self.pil_processor(image_processor, config)

    def prefix_text(self, system_prompt: str | None) -> str:
        """Chat-format text in front of the video (the never-evicted prefix); None: the family's system prompt."""
        prompt = self.system_prompt if system_prompt is None else system_prompt
        return f"<|im_start|>system\n{prompt}<|im_end|>\n<|im_start|>user\n{self.before_video}"

    def question_text(self, question: str) -> str:
        """Chat-format text after the video, ending where the answer starts."""
        return f"{self.after_video}{question}<|im_end|>\n<|im_start|>assistant\n"

    def text_kwargs(self, input_ids: torch.Tensor) -> dict:
        """Extra keyword arguments a text-only forward/generate of the full model needs."""
        return {}

    def timestamp_tokenizer(self, processor):
        """The tokenizer a family whose frames carry text timestamps writes them with: `processor.tokenizer`, or
        `processor` itself; TypeError naming processor when there is none."""
        tokenizer = getattr(processor, "tokenizer", processor)
        if tokenizer is None or not callable(tokenizer):
            raise TypeError(f"processor: {self.name} chunks carry text timestamps; pass the model's processor or "
                            f"tokenizer, got {type(processor).__name__}")
        return tokenizer

    def reject_unexpected(self, kwargs: dict) -> None:
        """TypeError naming `append_video`'s arguments this family does not take (encode_video's leftovers)."""
        if kwargs:
            raise TypeError(f"append_video: unexpected arguments for {self.name}: {sorted(kwargs)}")


def seconds_of(values, count: int, name: str, what: str) -> list[float]:
    """`values` (a sequence or a tensor of numbers) as `count` floats, else a ValueError naming `name`: "expected the
    seconds of each of the {count} {what}"."""
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    try:
        seconds = [float(t) for t in values]
    except (TypeError, ValueError):
        seconds = None
    if seconds is None or isinstance(values, str) or len(seconds) != count:
        raise ValueError(f"{name}: expected the seconds of each of the {count} {what}, got {values!r}")
    return seconds


def check_times(times: Sequence[float] | None, count: int) -> list[float] | None:
    """`prepare_frames`' `times` as floats (None stays None): `count` finite seconds, strictly increasing, else a
    ValueError naming `times`."""
    if times is None:
        return None
    seconds = seconds_of(times, count, "times", "frames")
    if not all(math.isfinite(t) for t in seconds):
        raise ValueError(f"times: expected finite seconds, got {seconds}")
    if any(b <= a for a, b in zip(seconds, seconds[1:])):
        raise ValueError(f"times: expected increasing seconds, got {seconds}")
    return seconds


def check_pixels(name: str, video, expected: str) -> torch.Tensor:
    """A floating tensor of model-ready pixel values, else TypeError naming the argument (ValueError when an entry is
    not finite). `expected`: the shape the family wants, for the message."""
    if not isinstance(video, torch.Tensor) or not video.is_floating_point():
        raise TypeError(f"{name}: expected floating pixel values {expected} (or raw frames with a processor), "
                        f"got {type(video).__name__}")
    if not bool(torch.isfinite(video).all()):
        raise ValueError(f"{name}: pixel values contain non-finite entries")
    return video

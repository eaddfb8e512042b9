"""End-to-end streaming step on tiny random models (LLaVA-OneVision, and Qwen3-VL with its timestamps and DeepStack):
our caches against the straightforward way, which is what the released code does.

One step = encode a chunk of frames, prefill it, run the guidance pass, compress to the budget. The same chunks go
through `HermesStream` (HERMES), `HermesStream(policy="h2svc")` and `BaselineStream` (a `DynamicCache`, eager
`output_attentions` passes, the reference step); `run_family` says what each does. The baseline's numbers are for
timing, not for answers. docs/benchmarks.md#after-the-table.
"""
from __future__ import annotations

import dataclasses
import time
import warnings

import torch

from .stages import Unavailable
from .timing import Timing, summarise


@dataclasses.dataclass(frozen=True)
class E2ESetting:
    """Tiny model and stream geometry: `frames` video frames of image_size x image_size pixels per chunk
    (LLaVA-OV: (image_size/patch_size/2)^2 tokens a frame; Qwen3-VL: (image_size/4)^2 visual tokens and 12 of
    text a temporal step of 2 frames)."""

    num_layers: int
    image_size: int
    frames: int
    budget: int
    warm_chunks: int      # chunks streamed before timing (the cache fills and the first steps run)
    timed_chunks: int
    h2svc_windows: tuple[int, int]   # (W_s, W_w) frames; N_e: the frames that hold `budget` tokens


FULL = E2ESetting(num_layers=8, image_size=32, frames=8, budget=1024, warm_chunks=3, timed_chunks=6,
                  h2svc_windows=(2, 4))
QUICK = E2ESetting(num_layers=4, image_size=16, frames=4, budget=96, warm_chunks=2, timed_chunks=2,
                   h2svc_windows=(1, 2))
FAMILIES = ("llava_ov", "qwen3_vl")


@dataclasses.dataclass(frozen=True)
class E2EResult:
    family: str
    setting: E2ESetting
    h2svc_windows: tuple[int, int, int]     # (W_s, W_w, N_e) frames
    chunk_tokens: int
    hermes: Timing
    baseline: Timing
    h2svc: Timing
    cache_bytes: dict       # policy -> bytes_allocated of its cache (stats())
    h2svc_class_bytes: dict  # class name -> bytes of H2SVC's class blocks

    @property
    def ratio(self) -> float:
        """Baseline per-chunk median over ours: how many times faster a streaming step is with our cache."""
        return self.baseline.median / self.hermes.median


class BaselineStream:
    """The straightforward streaming step over a tiny model, one stream: what the released code does, written
    plainly. A `DynamicCache`, eager attention, three extra forwards (local, global, mixed prompts) with
    `output_attentions=True` whose [L][B, H, Q, N] probabilities are pooled per layer, then the reference
    `compress_step` (`hermes_kernels.policies.hermes.reference`) on K/V stacked from the cache and written back.
    One 1D position sequence serves all layers (max over layers + 1 for new tokens; Qwen3-VL's M-RoPE offsets are
    not applied): its numbers are for timing, not for answers."""

    def __init__(self, model, tokenizer, budget: int):
        from transformers import DynamicCache

        from hermes.policies.hermes.guidance import guidance_prompts
        from hermes_kernels.policies.hermes import reference
        from hermes.models import family_of
        from hermes_kernels import HermesConfig

        self.family = family_of(model)
        self.model = model
        self.tokenizer = tokenizer
        self.compress_step = reference.compress_step
        model.set_attn_implementation("eager")      # output_attentions needs the materialised probabilities
        self.lm = self.family.language_model(model)
        prefix = tokenizer(self.family.prefix_text(None), add_special_tokens=False)["input_ids"]
        self.prompt_ids = {kind: torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
                           for kind, text in guidance_prompts().items()}
        num_layers = len(self.lm.layers)
        self.cfg = HermesConfig.preset(self.family.preset_name, num_layers, budget, len(prefix),
                                       max_positions=model.config.get_text_config().max_position_embeddings)
        self.inv_freq, _ = self.family.rotary(model)
        self.prompt_of_layer = [("local", "mixed", "global")[r] for r in self.cfg.role.tolist()]
        self.cache = DynamicCache(config=self.lm.config)
        self.positions = torch.arange(len(prefix)).expand(num_layers, 1, -1)
        with torch.no_grad():
            self.lm(input_ids=torch.tensor([prefix]), position_ids=self.positions[0], cache=self.cache, use_cache=True)

    def _forward(self, count: int, **inputs):
        start = int(self.positions.max()) + 1
        position_ids = torch.arange(start, start + count)[None]
        return self.lm(position_ids=position_ids, cache=self.cache, use_cache=True, **inputs), position_ids

    def append_video(self, **chunk) -> None:
        """chunk: `append_video` keyword arguments of one stream. Prefill, and guidance + reference compression
        past the budget."""
        with torch.no_grad():
            encoded = self.family.encode_video(self.model, self.tokenizer, batch_size=1, **chunk)
            embeds = encoded.embeds
            _, position_ids = self._forward(embeds.shape[1], inputs_embeds=embeds, **encoded.lm_kwargs())
            self.positions = torch.cat([self.positions, position_ids.expand(self.cfg.num_layers, 1, -1)], dim=-1)
            length = self.positions.shape[-1]
            P = self.cfg.prefix_len
            if length - P <= self.cfg.budget:
                return
            pooled = {}
            for kind, ids in self.prompt_ids.items():
                out, _ = self._forward(ids.shape[1], input_ids=ids, output_attentions=True)
                self.cache.crop(-ids.shape[1])          # the guidance tokens must not stay in the cache
                pooled[kind] = [a.float().mean(dim=(1, 2))[:, P:length] for a in out.attentions]
            attn = torch.stack([pooled[kind][layer] for layer, kind in enumerate(self.prompt_of_layer)])
            keys = torch.stack([layer.keys for layer in self.cache.layers])
            values = torch.stack([layer.values for layer in self.cache.layers])
            positions = self.positions.clone()
            result = self.compress_step(keys, values, positions, attn, self.cfg, self.inv_freq)
            for layer, cached in enumerate(self.cache.layers):
                cached.keys = keys[layer, :, :, :result.length].clone()
                cached.values = values[layer, :, :, :result.length].clone()
            self.positions = positions[..., :result.length].clone()


def _time_stream(append, chunks: list[dict], warm: int) -> Timing:
    """Stream `chunks` (append_video keyword arguments) through `append`; the per-chunk wall times after the
    first `warm` chunks."""
    samples = []
    for index, chunk in enumerate(chunks):
        t0 = time.perf_counter()
        append(**chunk)
        if index >= warm:
            samples.append((time.perf_counter() - t0) * 1e3)
    return summarise(samples)


def _family(name: str, setting: E2ESetting, gen: torch.Generator) -> tuple:
    """(model builder, tokenizer, the chunks' append_video keyword arguments, extra stream arguments) of a family."""
    from scaffolding.models import tiny_llava_ov, tiny_qwen3_vl
    from scaffolding.pixels import llava_pixels, qwen_pixels
    from scaffolding.tokenizer import tiny_tokenizer
    from hermes.models.qwen3_vl import step_times

    count, size = setting.warm_chunks + setting.timed_chunks, setting.image_size
    if name == "llava_ov":
        chunks = [{"video": llava_pixels(1, setting.frames, gen, image_size=size)} for _ in range(count)]
        return (lambda: tiny_llava_ov(seed=0, num_layers=setting.num_layers, image_size=size)), tiny_tokenizer(), \
            chunks, {}
    chunks = []
    for index in range(count):  # 1 fps: chunk i starts at i * frames seconds
        video, grid = qwen_pixels(1, setting.frames, gen, size, size)
        chunks.append({"video": video, "grid_thw": grid,
                       "timestamps": step_times(setting.frames, 1.0, float(index * setting.frames), 2)})
    return (lambda: tiny_qwen3_vl(seed=0, num_layers=setting.num_layers)), tiny_tokenizer(digits=True), chunks, \
        {"frame_size": (size, size)}


def run_family(device: torch.device, family: str, quick: bool = False) -> E2EResult:
    """Time one streaming step per chunk of `family` (CPU; tiny model), three ways on the same chunks.

    ours: `HermesStream.append_video` (preallocated cache, guidance pooled inside the attention function in one
    read-only forward, `hermes_kernels.compress_step` in place); the baseline: `BaselineStream`; H2SVC:
    `HermesStream(policy="h2svc")` (prefill with per-class attention and frame-window masks, then
    `hermes_kernels.h2svc_step` on every class block, no guidance pass), with the default (unprofiled, depth-order)
    head map and an episodic memory of budget / tokens-per-frame frames. All three models are built from the same
    seed; the vision tower (and Qwen3-VL's DeepStack features, passed to every chunk's forward) is shared work."""
    if device.type != "cpu":
        raise Unavailable("the end-to-end step runs on CPU (tiny model); use tests/ for model checks on CUDA")
    from hermes.stream import HermesStream
    setting = QUICK if quick else FULL
    model, tokenizer, chunks, stream_args = _family(family, setting, torch.Generator().manual_seed(0))
    baseline = BaselineStream(model(), tokenizer, setting.budget)
    baseline_timing = _time_stream(baseline.append_video, chunks, setting.warm_chunks)
    ours = HermesStream(model(), tokenizer, budget=setting.budget, chunk_frames=setting.frames, **stream_args)
    hermes_timing = _time_stream(ours.append_video, chunks, setting.warm_chunks)
    frame_tokens = ours.family.tokens_per_frame(ours.model, stream_args.get("frame_size"), tokenizer=tokenizer)
    windows = (*setting.h2svc_windows, max(1, setting.budget // frame_tokens))
    with warnings.catch_warnings():  # the default map is unprofiled, and says so; the report names it
        warnings.simplefilter("ignore", UserWarning)
        h2svc = HermesStream(model(), tokenizer, policy="h2svc", chunk_frames=setting.frames, **stream_args,
                             **dict(zip(("instant_frames", "short_frames", "episodic_frames"), windows)))
    h2svc_timing = _time_stream(h2svc.append_video, chunks, setting.warm_chunks)
    return E2EResult(family=family, setting=setting, h2svc_windows=windows, chunk_tokens=ours.chunk_tokens,
                     hermes=hermes_timing, baseline=baseline_timing, h2svc=h2svc_timing,
                     cache_bytes={"hermes": ours.stats()["bytes_allocated"], "h2svc": h2svc.stats()["bytes_allocated"]},
                     h2svc_class_bytes=h2svc.stats()["bytes_per_class"])


def run(device: torch.device, quick: bool = False) -> list[E2EResult]:
    """`run_family` for every family in FAMILIES."""
    return [run_family(device, family, quick) for family in FAMILIES]


def report(results: list[E2EResult]) -> str:
    return "\n".join(_report(result) for result in results)


def _report(result: E2EResult) -> str:
    s = result.setting
    model = {"llava_ov": "LLaVA-OV", "qwen3_vl": "Qwen3-VL (timestamps, DeepStack)"}[result.family]
    lines = [f"end-to-end streaming step, tiny {model} ({s.num_layers} layers, hidden 64, CPU): "
             f"{s.frames}-frame chunks of {result.chunk_tokens} tokens, budget {s.budget}, "
             f"median over {s.timed_chunks} chunks after {s.warm_chunks} warm-up chunks"]
    w_s, w_w, n_e = result.h2svc_windows
    for name, t, cache in (("ours (HermesStream)", result.hermes, result.cache_bytes["hermes"]),
                           ("baseline (3 x output_attentions + reference)", result.baseline, None),
                           (f"H2SVC (policy='h2svc', {w_s}/{w_w}/{n_e} frames)", result.h2svc,
                            result.cache_bytes["h2svc"])):
        size = "" if cache is None else f"  cache {cache / 2 ** 20:.2f} MiB"
        lines.append(f"  {name:<46} {t.median:9.2f} ms  (p20 {t.p20:.2f}, p80 {t.p80:.2f}){size}")
    lines.append(f"  baseline / ours: {result.ratio:.2f}x; H2SVC / HERMES per chunk: "
                 f"{result.h2svc.median / result.hermes.median:.2f}x")
    classes = ", ".join(f"{name} {size / 2 ** 20:.2f}" for name, size in result.h2svc_class_bytes.items())
    lines.append(f"  H2SVC cache MiB per class (default unprofiled map; K, V, positions, slot frames, features): "
                 f"{classes}; HERMES: K, V, positions and guidance scores at budget {s.budget}")
    return "\n".join(lines)

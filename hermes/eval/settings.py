"""The `--model_args` of `lmms-eval --model hermes`: parsed and checked before any weights load.

`parse_model_args` checks every value on its own; `check_checkpoint_settings` reads the checkpoint's config.json,
tokenizer and head map (no weights) and checks the budget and the head map against them. Every problem is one
line naming the argument; all of them are raised together as one ValueError. Defaults and the paper's settings:
docs/evaluation.md.
"""
from __future__ import annotations

import dataclasses
import os

from hermes.cli import policy_kwargs
from hermes.registry import check_policy_name, get_policy
from hermes.video import as_fraction
from hermes_kernels.engine.checks import REINDEX_MODES, check_positive_int
from hermes_kernels.engine.dispatch import check_backend

REINDEX_CHOICES = ("auto", *REINDEX_MODES)  # auto: eager for offline requests, lazy for multi-round ones
REINDEXING = ("hermes", "h2svc")  # the policies that take a re-indexing mode; another keeps its own defaults
DEFAULT_BUDGET = 6000


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    """What one `lmms-eval --model hermes` run streams with (docs/evaluation.md#model-args).

    pretrained:     local checkpoint folder (llava_onevision, qwen2_5_vl or qwen3_vl).
    policy:         "hermes", "h2svc" or another registered name (docs/policies.md#registry), built with its own
                    defaults.
    budget:         HERMES: visual tokens kept per layer; None under H2SVC.
    head_map:       H2SVC: a head map file from hermes-profile, or None (the unprofiled default map, warned).
    reindex:        "auto" (eager for generate_until / loglikelihood, lazy for generate_until_multi_round),
                    "lazy" or "eager"; passed to the policies of REINDEXING only.
    fps:            frames sampled per second of video, by timestamp.
    chunk_frames:   sampled frames per appended chunk.
    device, dtype:  None / "auto" resolve as the `hermes` command resolves them.
    backend:        hermes_kernels backend of the policy's kernels.
    max_new_tokens: answer length when a task gives none.
    room:           cache slots past the kept tokens and a chunk (a question with its answer, guidance prompts).
    batch_size:     videos streamed in lockstep (lmms-eval's --batch_size).
    """

    pretrained: str
    policy: str = "hermes"
    budget: int | None = DEFAULT_BUDGET
    head_map: str | None = None
    reindex: str = "auto"
    fps: float = 1.0
    chunk_frames: int = 16
    device: str | None = None
    dtype: str = "auto"
    backend: str = "auto"
    max_new_tokens: int = 64
    room: int = 512
    batch_size: int = 1

    def reindex_for(self, request_type: str) -> str:
        """The re-indexing mode of a stream serving `request_type` requests."""
        if self.reindex != "auto":
            return self.reindex
        return "lazy" if request_type == "generate_until_multi_round" else "eager"

    def stream_kwargs(self, request_type: str) -> dict:
        """HermesStream's policy keyword arguments (the `hermes` command's mapping, plus the re-indexing mode for
        the policies that take one)."""
        kwargs = policy_kwargs(self.policy, self.budget, self.head_map)
        return {**kwargs, "reindex": self.reindex_for(request_type)} if self.policy in REINDEXING else kwargs


def parse_model_args(pretrained=None, policy="hermes", budget=None, head_map=None, reindex="auto", fps=1.0,
                     chunk_frames=16, device=None, dtype="auto", backend="auto", max_new_tokens=64, room=512,
                     batch_size=1, max_batch_size=None, **unknown) -> EvalSettings:
    """EvalSettings from lmms-eval's model arguments (values as `--model_args` parses them, plus the batch_size,
    max_batch_size and device lmms-eval adds). ValueError with one line per bad argument, naming it."""
    errors: list[str] = []

    def check(name: str, test):
        try:
            return test()
        except (ValueError, TypeError, OSError) as err:
            message = str(err)
            errors.append(message if message.startswith(f"{name}:") else f"{name}: {message}")
            return None

    for name in sorted(unknown):
        errors.append(f"{name}: not an argument of --model hermes; expected one of {sorted(_ARGUMENTS)}")
    if pretrained is None:
        errors.append("pretrained: required: a local checkpoint folder (pretrained=PATH)")
    elif not isinstance(pretrained, str) or not os.path.isdir(pretrained):
        errors.append(f"pretrained: no such folder: {pretrained} (expected a local checkpoint folder)")
    known = check("policy", lambda: check_policy_name(policy)) is not None  # no policy module imported
    if known and policy != "hermes" and budget is not None:
        errors.append(f"budget: only policy=hermes takes a budget; policy={policy} takes none")
    elif policy == "hermes":
        budget = check("budget", lambda: check_positive_int("budget", DEFAULT_BUDGET if budget is None else budget))
    if head_map is not None and known and policy != "h2svc":
        errors.append("head_map: only policy=h2svc takes a head map")
    elif head_map is not None and known:
        check("head_map", lambda: policy_kwargs(policy, DEFAULT_BUDGET, os.fspath(head_map)))
    if reindex not in REINDEX_CHOICES:
        errors.append(f"reindex: expected one of {REINDEX_CHOICES}, got {reindex!r}")
    elif known and reindex != "auto" and policy not in REINDEXING:
        errors.append(f"reindex: only policy=hermes and policy=h2svc take a re-indexing mode; policy={policy} "
                      f"takes none (leave reindex=auto)")
    fps = check("fps", lambda: float(as_fraction(fps, "fps")))
    for name, value in (("chunk_frames", chunk_frames), ("max_new_tokens", max_new_tokens), ("room", room)):
        check(name, lambda: check_positive_int(name, value))
    batch_size = check("batch_size", lambda: _batch_size(batch_size))
    if max_batch_size is not None:
        errors.append("max_batch_size: only used with --batch_size auto, which --model hermes does not take")
    check("backend", lambda: check_backend(backend))
    device = check("device", lambda: _device(device))
    check("dtype", lambda: _dtype(dtype))
    if errors:
        raise ValueError("\n".join(errors))
    return EvalSettings(pretrained=os.fspath(pretrained), policy=policy, budget=budget if policy == "hermes" else None,
                        head_map=None if head_map is None else os.fspath(head_map), reindex=reindex, fps=fps,
                        chunk_frames=chunk_frames, device=device, dtype=dtype, backend=backend,
                        max_new_tokens=max_new_tokens, room=room, batch_size=batch_size)


_ARGUMENTS = ("pretrained", "policy", "budget", "head_map", "reindex", "fps", "chunk_frames", "device", "dtype",
              "backend", "max_new_tokens", "room")


def _batch_size(value) -> int:
    """lmms-eval passes --batch_size as given (a string) or its default 1; "auto" has no meaning here."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    return check_positive_int("batch_size", value)


def _device(value) -> str | None:
    from hermes.commands import resolve_device

    return None if value is None else str(resolve_device(value))


def _dtype(value) -> str:
    from hermes.commands import DTYPE_NAMES

    if value != "auto" and value not in DTYPE_NAMES:
        raise ValueError(f"dtype: expected auto or one of {sorted(DTYPE_NAMES)}, got {value!r}")
    return value


def check_checkpoint_settings(settings: EvalSettings):
    """(config, family, processor) of the checkpoint, read without its weights, and the policy's class (an installed
    package's is imported here, before the weights); ValueError naming the argument when its model type is not
    supported, its positions cannot hold the budget, the head map was profiled on another model, or batch_size asks
    for lockstep batches a model with linear-attention or sliding-window layers cannot pad questions for; ImportError
    naming the package when the policy's cannot be imported."""
    from hermes.commands import check_checkpoint
    from hermes.linear_state import LINEAR, SLIDING, layer_kinds
    from hermes.models.processing import load_processor
    from hermes.window import cache_layers
    from hermes.policies.h2svc.head_map import check_head_map, load_head_map
    from hermes_kernels import HermesConfig

    try:
        config, family = check_checkpoint(settings.pretrained)
    except (OSError, ValueError) as err:
        raise ValueError(f"pretrained: {settings.pretrained}: {err}") from err
    kinds = set(layer_kinds(config))
    if settings.batch_size > 1 and kinds & {LINEAR, SLIDING}:
        # a lockstep batch pads its streams' questions to one length, which these layers would take in
        raise ValueError(f"batch_size: {family.name}'s {'linear-attention' if LINEAR in kinds else 'sliding-window'} "
                         f"layers take no padded question batch (docs/qwen3_5.md#hybrid-cache, "
                         f"docs/gemma4.md#limits); pass batch_size 1, got {settings.batch_size}")
    processor = load_processor(settings.pretrained, family)
    get_policy(settings.policy)
    text = config.get_text_config()
    if settings.policy == "hermes":
        tokenizer = getattr(processor, "tokenizer", processor)
        prefix_len = len(tokenizer(family.prefix_text(None), add_special_tokens=False)["input_ids"])
        try:
            HermesConfig.preset(family.preset_name, len(cache_layers(config)), settings.budget, prefix_len,
                                max_positions=text.max_position_embeddings)
        except ValueError as err:
            raise ValueError(f"budget: {settings.budget} does not fit {settings.pretrained}: {err}") from err
    elif settings.head_map is not None:
        try:
            check_head_map(load_head_map(settings.head_map), config, f"head map {settings.head_map}")
        except ValueError as err:
            raise ValueError(f"head_map: {err}") from err
    return config, family, processor

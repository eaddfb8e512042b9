"""What both command-line tools share (`hermes`, `hermes-profile`): one parser scaffold (`command_parser`), the error
contract (`run_command`: one line on stderr; exit status 2 for a `UsageError`, 1 for an input that cannot be read or
any other failure, 130 on Ctrl-C), loading a local checkpoint (docs/cli.md) and the checks of a run over several
processes under torchrun (`check_tp`, `tp_device`, `check_tp_model`: docs/multi-gpu.md#launch).

Checkpoints are a trust boundary: `check_checkpoint`, `load_processor` and `load_model` are the one place a
checkpoint is read, from local files only and never running code shipped with it (`LOCAL_ONLY`);
docs/security.md#checkpoints.

Importing this module imports neither torch nor transformers (each function imports what it needs), so a command's
--help and its refusals of a bad setting or a missing file answer before anything heavy loads (`run_main`).
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import importlib.util
import os
import pickle
import sys
import textwrap
import types
import warnings
from typing import TYPE_CHECKING, Callable, Sequence

from hermes import require_transformers

if TYPE_CHECKING:
    import torch

DTYPE_NAMES = ("float32", "bfloat16", "float16")  # --dtype's names: torch's dtypes of those names
# keyword arguments of every from_pretrained on a checkpoint: nothing from the network, no code of the checkpoint's
LOCAL_ONLY = types.MappingProxyType({"local_files_only": True, "trust_remote_code": False})


class UsageError(ValueError):
    """A setting that cannot work with these inputs (the command exits with status 2)."""


def check_positive_int(name: str, value, allow_none: bool = False) -> int | None:
    """`hermes_kernels.engine.checks.check_positive_int` for the commands' checks, which run before the kernel library
    (and torch with it) is imported: a positive int (None too when `allow_none`), returned; ValueError naming `name`
    otherwise."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    return value


def usage(check: Callable[[], object]):
    """`check()`, its ValueError raised again as a UsageError (same message)."""
    try:
        return check()
    except UsageError:
        raise
    except ValueError as err:
        raise UsageError(str(err)) from err


@dataclasses.dataclass
class LoadedModel:
    """A checkpoint ready to stream: the model (eval mode, on `device`), its processor and its family."""

    model: torch.nn.Module
    processor: object
    family: object
    path: str
    device: torch.device


def checkpoint_folder(path: str | os.PathLike) -> str:
    """`path` as a local checkpoint folder, checked before transformers sees it: FileNotFoundError for anything
    that is not a local folder (a Hugging Face Hub name is never resolved, so nothing reaches the network),
    ValueError for a folder without config.json."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model: no such folder: {path} (expected a local checkpoint folder; names on the "
                                f"Hugging Face Hub are not downloaded: download it first, then pass its folder)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"model: {path} has no config.json; expected a checkpoint saved with save_pretrained")
    return path


def check_checkpoint(path: str | os.PathLike) -> tuple[object, object]:
    """(config, family) of a local checkpoint folder, from its config.json alone (no weights): FileNotFoundError
    or ValueError when it cannot be read (`checkpoint_folder`), UsageError for a model type no family supports or
    a decoder layer kind the caches do not hold (`layer_types`, e.g. sliding window)."""
    from transformers import AutoConfig

    from hermes.linear_state import layer_kinds
    from hermes.models import family_of_type

    config = AutoConfig.from_pretrained(checkpoint_folder(path), **LOCAL_ONLY)
    family = usage(lambda: family_of_type(config.model_type))
    usage(lambda: layer_kinds(config))
    return config, family


def load_processor(path: str | os.PathLike, family):
    """The processor of a local checkpoint folder (`hermes.models.processing.load_processor`), read under
    `LOCAL_ONLY`."""
    from hermes.models import processing

    return processing.load_processor(checkpoint_folder(path), family, **LOCAL_ONLY)


def weights_options(path: str) -> dict:
    """`from_pretrained` keyword arguments for the weights of a checkpoint folder: `LOCAL_ONLY`, and
    use_safetensors=True when the folder has a .safetensors file (a pickled .bin beside it is then never read;
    without one, transformers reads a .bin with torch's weights-only unpickler)."""
    return {**LOCAL_ONLY, **({"use_safetensors": True} if glob.glob(os.path.join(glob.escape(path), "*.safetensors"))
                             else {})}


def resolve_device(device: str | torch.device | None) -> torch.device:
    """torch.device from a name; None picks cuda when available, else cpu. ValueError for a device that is
    not there."""
    import torch

    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"device: expected e.g. cpu, cuda or cuda:1, got {device!r}") from err
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: cuda was asked for but torch sees no CUDA device (torch.cuda.is_available() "
                         "is False); use --device cpu")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device: expected cpu or cuda, got {device}")
    return device


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """"auto" is bfloat16 on CUDA and float32 on CPU; otherwise a name from DTYPE_NAMES or the torch.dtype of one."""
    import torch

    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    dtypes = {name: getattr(torch, name) for name in DTYPE_NAMES}
    if isinstance(dtype, torch.dtype) and dtype in dtypes.values():
        return dtype
    if isinstance(dtype, str) and dtype in dtypes:
        return dtypes[dtype]
    raise ValueError(f"dtype: expected auto or one of {sorted(DTYPE_NAMES)}, got {dtype!r}")


def check_tp(tp: int | None, command: str = "hermes") -> int:
    """The tensor-parallel degree of this run (1 without `tp`), checked against the processes torchrun started
    (RANK, LOCAL_RANK, WORLD_SIZE) before anything loads: `tp` N > 1 needs N processes of one process group, and
    several processes need `tp` equal to their count. UsageError naming tp."""
    if tp is not None and (not isinstance(tp, int) or isinstance(tp, bool) or tp < 1):
        raise UsageError(f"tp: expected an int >= 1, got {tp!r}")
    tp = tp or 1
    launched = all(name in os.environ for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    world = int(os.environ["WORLD_SIZE"]) if launched else 1
    if tp > 1 and not launched:
        raise UsageError(f"tp: --tp {tp} needs {tp} processes in one process group: launch with torchrun "
                         f"--nproc-per-node {tp} -m {command} --tp {tp} ...")
    if world != tp:
        raise UsageError(f"tp: torchrun started {world} processes and --tp is {tp}; they must be equal")
    if tp > 1 and importlib.util.find_spec("accelerate") is None:
        raise UsageError("tp: transformers' tensor parallelism needs the accelerate package (pip install "
                         "'hermes-kernels[model]')")
    return tp


def tp_device(device: str | torch.device | None) -> torch.device:
    """This rank's device under tensor parallelism: transformers places every rank's shards on cuda:LOCAL_RANK when
    torch sees CUDA, else on the CPU. `device` may name the same type only (no index). ValueError otherwise."""
    import torch

    local = int(os.environ["LOCAL_RANK"])
    if not torch.cuda.is_available():
        target = torch.device("cpu")
    elif local < torch.cuda.device_count():
        target = torch.device("cuda", local)
    else:
        raise ValueError(f"device: rank with LOCAL_RANK={local} has no GPU (torch sees "
                         f"{torch.cuda.device_count()}); start at most that many processes per node")
    if device is not None:
        asked = resolve_device(device)
        if asked.type != target.type or asked.index is not None:
            where = "cuda:LOCAL_RANK" if target.type == "cuda" else "cpu"
            raise ValueError(f"device: under --tp every rank runs on {where} (where transformers puts its shards); got "
                             f"--device {device}")
    return target


def check_tp_model(config, family, tp: int) -> None:
    """A checkpoint's config.json against `tp` > 1, before any weights load: tp must divide its query and KV heads.
    UsageError."""
    text = config.get_text_config()
    for what, count in (("KV", text.num_key_value_heads), ("query", text.num_attention_heads)):
        if count % tp:
            raise UsageError(f"tp: the model's {count} {what} heads per layer do not split evenly over --tp {tp}; "
                             f"pick a tp that divides {count}")


def load_model(path: str | os.PathLike, device: str | torch.device | None = None,
               dtype: str | torch.dtype = "auto", processor=None, tp: int | None = None) -> LoadedModel:
    """Load a local checkpoint folder: its family from config.json's model_type (checked before any weights
    load), the model with `AutoModelForImageTextToText` (`weights_options`), the processor with `load_processor`
    (or the one given). `tp` N > 1 (under torchrun, N processes): `DistributedConfig(tp_size=N)` with the family's
    `tp_plan` where it has one (Qwen3-VL, Gemma 4), every rank holding its share of the heads on `tp_device`
    (docs/multi-gpu.md#launch)."""
    from transformers import AutoModelForImageTextToText

    path = os.fspath(path)
    config, family = check_checkpoint(path)
    tp = tp or 1
    if tp > 1:
        check_tp(tp)
        check_tp_model(config, family, tp)
    device = usage(lambda: resolve_device(device) if tp == 1 else tp_device(device))
    dtype = usage(lambda: resolve_dtype(dtype, device))
    parallel = {}
    if tp > 1:
        from transformers import DistributedConfig
        plan = None if family.tp_plan is None else dict(family.tp_plan)  # transformers' plan, ours merged over it
        parallel = {"distributed_config": DistributedConfig(tp_size=tp, tp_plan=plan)}
    try:
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype, **parallel, **weights_options(path))
    except pickle.UnpicklingError as err:  # torch's advice would be to unpickle in full: not a way out here
        raise ValueError(f"model: the pickled weights in {path} hold objects other than tensors, which are never "
                         f"unpickled (torch's weights-only unpickler refused them); save the weights as "
                         f"safetensors") from err
    model = (model if tp > 1 else model.to(device)).eval()  # tensor parallelism placed every shard already
    processor = load_processor(path, family) if processor is None else processor
    return LoadedModel(model=model, processor=processor, family=family, path=path, device=device)


def run_command(body: Callable[[], None], show_traceback: bool = False, rank: int = 0) -> int:
    """Run a command's `body` under the commands' error contract and return the exit status: 0 when it returns;
    a `UsageError` printed as one line `error: ...` on stderr and 2; another error a user can fix (ValueError,
    OSError, ImportError, out of memory) as one line and 1; any other exception as one internal-error line and 1;
    130 on Ctrl-C. Warnings print as one line `warning: ...` on stderr. With show_traceback the exception
    propagates instead (--traceback). `rank` > 0 (a rank of a run under torchrun other than the first): no
    warnings, no usage errors (every rank finds them alike; rank 0 prints them), other errors prefixed `rank N:`."""
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _one_line_warning if rank == 0 else _no_warning
            body()
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # noqa: BLE001 (the command's contract: one line, no traceback)
        if show_traceback:
            raise
        message = " ".join(str(err).split()) or type(err).__name__
        torch = sys.modules.get("torch")  # out of memory needs torch imported: a refusal before that is never one
        out_of_memory = () if torch is None else (torch.OutOfMemoryError,)
        if not isinstance(err, (ValueError, OSError, ImportError, *out_of_memory)):
            message = f"internal error ({type(err).__name__}: {message}); rerun with --traceback for details"
        if rank == 0 or not isinstance(err, UsageError):
            print(f"error: {'' if rank == 0 else f'rank {rank}: '}{message}", file=sys.stderr)
        return 2 if isinstance(err, UsageError) else 1
    return 0


def _no_warning(*args, **kwargs) -> None:
    """`warnings.showwarning` of ranks other than the first: rank 0 shows every warning once."""


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """`warnings.showwarning` of the commands: the message alone on one line (no source line under it)."""
    print(f"warning: {' '.join(str(message).split())}", file=sys.stderr if file is None else file)


def command_parser(prog: str, description: str, epilog: Sequence[str], model_help: str) -> argparse.ArgumentParser:
    """The parser scaffold of both commands: `prog`'s own text (`description`, `epilog` paragraphs: an "Example:"
    paragraph is kept as written, the others wrapped) and the options every command takes — --model, --device,
    --dtype, --threads, --quiet, --traceback; each command adds its own."""
    def wrap(text: str) -> str:
        return text if text.startswith("Example:") else textwrap.fill(text, width=100)

    p = argparse.ArgumentParser(prog=prog, description=wrap(description), epilog="\n\n".join(map(wrap, epilog)),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, metavar="PATH", help=model_help)
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    p.add_argument("--dtype", choices=("auto", *DTYPE_NAMES), default="auto",
                   help="model dtype (default auto: bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads of torch (default: torch's choice; 1 avoids OpenMP spin-waits on a busy machine)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--traceback", action="store_true", help="show the full traceback of an error")
    return p


def run_main(args: argparse.Namespace, body: Callable[[], None], rank: int = 0,
             check: Callable[[], None] | None = None) -> int:
    """Run a command for parsed `args` under the error contract (`run_command`, with this process's `rank` under
    torchrun): --threads checked; `check()`, the command's checks that import neither torch nor transformers (its
    settings and files: a refusal answers at once); then transformers imported (or one line saying what to install),
    its load-time notices silenced (and its progress bars with --quiet or on a rank other than the first), --threads
    applied; then `body()`."""
    def command() -> None:
        threads = usage(lambda: check_positive_int("threads", args.threads, allow_none=True))
        if check is not None:
            check()
        require_transformers()
        import torch
        from transformers.utils import logging as transformers_logging

        transformers_logging.set_verbosity_error()  # load-time notices would bury the progress bars and the output
        if args.quiet or rank:
            transformers_logging.disable_progress_bar()
        if threads is not None:
            torch.set_num_threads(threads)
        body()

    return run_command(command, args.traceback, rank)

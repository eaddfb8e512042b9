"""hermes.commands at its edges, in-process: the tensor-parallel checks against the variables torchrun sets, each
rank's device (CUDA stood in for by patching torch.cuda's answers), device and dtype names, what `load_model` hands
to transformers with and without --tp (a recording stand-in for `from_pretrained`), `run_main`'s settings, and the
commands' positive-int check against the kernel library's. Whole runs: test_cli.py, test_commands.py and the
tensor-parallel tests."""
import argparse
import pickle

import pytest
import torch

from hermes import commands
from hermes_kernels.engine import checks
from hermes.commands import UsageError, check_tp, load_model, resolve_device, resolve_dtype, run_command, run_main, \
    tp_device

TORCHRUN = ("RANK", "LOCAL_RANK", "WORLD_SIZE")


@pytest.fixture
def alone(monkeypatch):
    for name in TORCHRUN:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def launched(monkeypatch, world: int, local: int = 0):
    monkeypatch.setenv("RANK", str(local))
    monkeypatch.setenv("LOCAL_RANK", str(local))
    monkeypatch.setenv("WORLD_SIZE", str(world))


def cuda(monkeypatch, count: int):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "2"])
def test_check_tp_refuses_what_is_no_degree(alone, bad):
    with pytest.raises(UsageError, match=rf"^tp: expected an int >= 1, got {bad!r}$"):
        check_tp(bad)


def test_check_tp_against_torchrun(alone):
    assert check_tp(None) == 1 and check_tp(1) == 1
    with pytest.raises(UsageError, match=r"^tp: --tp 2 needs 2 processes in one process group: launch with torchrun "
                                         r"--nproc-per-node 2 -m hermes-profile --tp 2 \.\.\.$"):
        check_tp(2, "hermes-profile")
    alone.setenv("RANK", "0")
    alone.setenv("WORLD_SIZE", "2")  # no LOCAL_RANK: not torchrun's three
    assert check_tp(None) == 1
    launched(alone, 2)
    with pytest.raises(UsageError, match=r"^tp: torchrun started 2 processes and --tp is 1; they must be equal$"):
        check_tp(None)
    with pytest.raises(UsageError, match=r"^tp: torchrun started 2 processes and --tp is 4; they must be equal$"):
        check_tp(4)
    assert check_tp(2) == 2
    alone.setattr(commands.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UsageError, match=r"^tp: transformers' tensor parallelism needs the accelerate package"):
        check_tp(2)
    launched(alone, 1)
    assert check_tp(1) == 1  # one process under torchrun, no accelerate needed


def test_each_rank_s_device(alone):
    launched(alone, 2, local=1)
    cuda(alone, 0)
    assert tp_device(None) == torch.device("cpu") and tp_device("cpu") == torch.device("cpu")
    for bad in ("cpu:0", torch.device("cpu", 1)):
        with pytest.raises(ValueError, match=r"^device: under --tp every rank runs on cpu \(where transformers puts "
                                             r"its shards\); got --device cpu:"):
            tp_device(bad)
    cuda(alone, 2)
    assert tp_device(None) == torch.device("cuda", 1) and tp_device("cuda") == torch.device("cuda", 1)
    for bad in ("cuda:1", "cpu"):
        with pytest.raises(ValueError, match=rf"^device: under --tp every rank runs on cuda:LOCAL_RANK \(where "
                                             rf"transformers puts its shards\); got --device {bad}$"):
            tp_device(bad)
    launched(alone, 3, local=2)
    with pytest.raises(ValueError, match=r"^device: rank with LOCAL_RANK=2 has no GPU \(torch sees 2\); start at "
                                         r"most that many processes per node$"):
        tp_device(None)


def test_device_names(monkeypatch):
    cuda(monkeypatch, 0)
    assert resolve_device(None) == torch.device("cpu") and resolve_device(torch.device("cpu")) == torch.device("cpu")
    with pytest.raises(ValueError, match=r"^device: expected e\.g\. cpu, cuda or cuda:1, got 'gpu'$"):
        resolve_device("gpu")
    with pytest.raises(ValueError, match=r"^device: cuda was asked for but torch sees no CUDA device"):
        resolve_device("cuda:0")
    with pytest.raises(ValueError, match=r"^device: expected cpu or cuda, got meta$"):
        resolve_device("meta")
    cuda(monkeypatch, 1)
    assert resolve_device(None) == torch.device("cuda") and resolve_device("cuda:0") == torch.device("cuda", 0)


def test_dtype_names():
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert resolve_dtype("auto", cpu) == torch.float32 and resolve_dtype("auto", gpu) == torch.bfloat16
    assert resolve_dtype("float16", cpu) == torch.float16 and resolve_dtype(torch.bfloat16, cpu) == torch.bfloat16
    for bad in ("fp16", torch.int8, torch.float64):
        with pytest.raises(ValueError, match=r"^dtype: expected auto or one of \['bfloat16', 'float16', 'float32'\], "
                                             rf"got {bad!r}$".replace("(", r"\(").replace(")", r"\)")):
            resolve_dtype(bad, cpu)


class Loaded:
    """A stand-in for a loaded model: records where it is moved."""

    def __init__(self):
        self.moved = []

    def to(self, device):
        self.moved.append(device)
        return self

    def eval(self):
        return self


@pytest.fixture
def from_pretrained(monkeypatch):
    import transformers
    calls = []

    def record(path, **kwargs):
        calls.append((path, kwargs))
        return Loaded()
    monkeypatch.setattr(transformers.AutoModelForImageTextToText, "from_pretrained", record)
    return calls


def test_load_model_hands_transformers_the_dtype_and_local_only(tiny_checkpoints, from_pretrained, alone):
    path = tiny_checkpoints["qwen2_5_vl"]
    loaded = load_model(path, device="cpu", dtype="bfloat16", processor="the processor")
    (where, kwargs), = from_pretrained
    assert where == path and kwargs == {"dtype": torch.bfloat16, **commands.weights_options(path)}
    assert kwargs["local_files_only"] is True and kwargs["trust_remote_code"] is False
    assert loaded.model.moved == [torch.device("cpu")] and loaded.processor == "the processor"
    assert loaded.device == torch.device("cpu") and loaded.path == path and loaded.family.name == "Qwen2.5-VL"


def test_load_model_under_tp_shards_with_the_family_s_plan(tiny_checkpoints, from_pretrained, alone):
    """--tp 2 under torchrun's variables: DistributedConfig(tp_size=2) with the family's own plan (Qwen3-VL's,
    none for the others), the model left where transformers placed its shards."""
    path = tiny_checkpoints["llava_onevision"]
    with pytest.raises(UsageError, match=r"^tp: --tp 2 needs 2 processes .* -m hermes --tp 2 \.\.\.$"):
        load_model(path, tp=2)
    assert from_pretrained == []
    launched(alone, 2)
    loaded = load_model(path, tp=2, processor="p")
    (_, kwargs), = from_pretrained
    config = kwargs.pop("distributed_config")
    assert config.tp_size == 2 and config.tp_plan is None
    assert kwargs == {"dtype": torch.float32, **commands.weights_options(path)}
    assert loaded.model.moved == [] and loaded.device == torch.device("cpu")


def test_load_model_names_pickled_weights_it_will_not_unpickle(tiny_checkpoints, monkeypatch, alone):
    import transformers

    def refuse(path, **kwargs):
        raise pickle.UnpicklingError("Weights only load failed")
    monkeypatch.setattr(transformers.AutoModelForImageTextToText, "from_pretrained", refuse)
    path = tiny_checkpoints["llava_onevision"]
    with pytest.raises(ValueError, match=rf"^model: the pickled weights in {path} hold objects other than tensors"):
        load_model(path, device="cpu")


def test_run_main_applies_the_cpu_setting_and_silences_transformers(monkeypatch, capsys):
    """(Named without the word the mutation selections deselect for thread tests.)"""
    from transformers.utils import logging as transformers_logging
    threads = torch.get_num_threads()
    seen = []
    args = argparse.Namespace(threads=1, quiet=False, traceback=False)
    try:
        transformers_logging.enable_progress_bar()
        assert run_main(args, lambda: seen.append(torch.get_num_threads())) == 0
        assert seen == [1] and transformers_logging.get_verbosity() == transformers_logging.ERROR
        assert transformers_logging.is_progress_bar_enabled()
        assert run_main(argparse.Namespace(threads=None, quiet=False, traceback=False), lambda: None, rank=1) == 0
        assert not transformers_logging.is_progress_bar_enabled()
        transformers_logging.enable_progress_bar()
        assert run_main(argparse.Namespace(threads=None, quiet=True, traceback=False), lambda: None) == 0
        assert not transformers_logging.is_progress_bar_enabled()
        assert run_main(argparse.Namespace(threads=0, quiet=False, traceback=False), lambda: seen.append(0)) == 2
        assert seen == [1] and capsys.readouterr().err == "error: threads: expected a positive int, got 0\n"
        assert run_main(argparse.Namespace(threads=None, quiet=False, traceback=False),
                        lambda: (_ for _ in ()).throw(OSError("disk")), rank=2) == 1
        assert capsys.readouterr().err == "error: rank 2: disk\n"
        with pytest.raises(RuntimeError, match="shown"):
            run_main(argparse.Namespace(threads=None, quiet=False, traceback=True),
                     lambda: (_ for _ in ()).throw(RuntimeError("shown")))
    finally:
        torch.set_num_threads(threads)
        transformers_logging.enable_progress_bar()
        transformers_logging.set_verbosity_warning()


def test_run_command_on_other_ranks(capsys):
    """A rank other than the first: no usage error printed (rank 0 prints it), other errors prefixed with the rank,
    no warnings; an error with no message is named by its type."""
    import warnings

    def usage_error():
        raise UsageError("tp: wrong")
    assert run_command(usage_error, rank=1) == 2 and capsys.readouterr().err == ""
    assert run_command(lambda: (_ for _ in ()).throw(OSError("disk")), rank=3) == 1
    assert capsys.readouterr().err == "error: rank 3: disk\n"
    assert run_command(lambda: warnings.warn("careful", UserWarning), rank=1) == 0
    assert capsys.readouterr().err == ""
    assert run_command(lambda: warnings.warn("careful\n  now", UserWarning)) == 0
    assert capsys.readouterr().err == "warning: careful now\n"
    assert run_command(lambda: (_ for _ in ()).throw(ValueError())) == 1
    assert capsys.readouterr().err == "error: ValueError\n"


def test_load_model_under_tp_on_cuda_ranks(tiny_checkpoints, from_pretrained, alone):
    """CUDA stood in (two GPUs), rank 1 of 2: the rank's device is cuda:1 and the default dtype bfloat16; --device
    cpu is refused there before anything loads. Without --tp, a device name that is no device is refused."""
    path = tiny_checkpoints["llava_onevision"]
    launched(alone, 2, local=1)
    cuda(alone, 2)
    loaded = load_model(path, tp=2, processor="p")
    assert loaded.device == torch.device("cuda", 1) and from_pretrained[0][1]["dtype"] == torch.bfloat16
    with pytest.raises(UsageError, match=r"^device: under --tp every rank runs on cuda:LOCAL_RANK"):
        load_model(path, tp=2, device="cpu", processor="p")
    with pytest.raises(UsageError, match=r"^device: expected cpu or cuda, got meta$"):
        load_model(path, device="meta", processor="p")
    assert len(from_pretrained) == 1


def test_load_model_under_tp_passes_qwen3_vl_s_own_plan(tmp_path, from_pretrained, alone):
    from hermes.models.qwen3_vl import Qwen3_VL
    from scaffolding.checkpoint import save_tiny_checkpoint
    path = save_tiny_checkpoint(tmp_path / "qwen3_vl", "qwen3_vl")
    launched(alone, 2)
    load_model(path, tp=2, processor="p")
    config = from_pretrained[0][1]["distributed_config"]
    assert config.tp_size == 2 and config.tp_plan == dict(Qwen3_VL.tp_plan) and config.tp_plan is not Qwen3_VL.tp_plan


def test_heads_that_do_not_split_over_tp_are_named():
    from types import SimpleNamespace

    from hermes.commands import check_tp_model

    def config(kv, query):
        text = SimpleNamespace(num_key_value_heads=kv, num_attention_heads=query)
        return SimpleNamespace(get_text_config=lambda: text)
    check_tp_model(config(4, 8), None, 4)
    with pytest.raises(UsageError, match=r"^tp: the model's 2 KV heads per layer do not split evenly over --tp 4; "
                                         r"pick a tp that divides 2$"):
        check_tp_model(config(2, 8), None, 4)
    with pytest.raises(UsageError, match=r"^tp: the model's 6 query heads per layer do not split evenly over --tp 4; "
                                         r"pick a tp that divides 6$"):
        check_tp_model(config(4, 6), None, 4)


def test_a_layer_kind_the_caches_do_not_hold_is_refused_from_the_config(tmp_path):
    from hermes.commands import check_checkpoint
    from scaffolding.models import tiny_qwen3_5
    config = tiny_qwen3_5().config
    config.text_config.layer_types = ["chunked_attention", *config.text_config.layer_types[1:]]
    config.save_pretrained(tmp_path)
    with pytest.raises(UsageError, match=r"^layer_types: qwen3_5 has layers of kind 'chunked_attention'"):
        check_checkpoint(tmp_path)


def test_the_common_options_parse_and_warnings_go_to_the_file_given():
    import io

    from hermes.commands import _one_line_warning, command_parser
    args = command_parser("p", "d", [], "m").parse_args(["--model", "m", "--threads", "2"])
    assert args.threads == 2 and args.device is None
    out = io.StringIO()
    _one_line_warning("two\n  lines", UserWarning, "file.py", 1, file=out)
    assert out.getvalue() == "warning: two lines\n"


def test_load_model_without_tp_loads_in_each_process_of_a_launch(tiny_checkpoints, from_pretrained, alone):
    """Without --tp a launcher's variables (e.g. a data-parallel evaluation, one model per process) are not a
    tensor-parallel run: each process loads the whole model on its device."""
    launched(alone, 2, local=1)
    loaded = load_model(tiny_checkpoints["llava_onevision"], device="cpu", processor="p")
    assert loaded.model.moved == [torch.device("cpu")] and "distributed_config" not in from_pretrained[0][1]


@pytest.mark.parametrize("allow_none", [False, True])
@pytest.mark.parametrize("value", [1, 7, 0, -3, 2.0, True, None, "3"])
def test_the_commands_positive_int_check_answers_as_the_kernel_library_s(value, allow_none):
    """`hermes.commands.check_positive_int` runs before the kernel library is imported (tests/hermes/test_imports.py):
    the same value returned or the same error as `hermes_kernels.engine.checks.check_positive_int`."""
    outcomes = []
    for check in (commands.check_positive_int, checks.check_positive_int):
        try:
            outcomes.append(check("n", value, allow_none))
        except ValueError as err:
            outcomes.append(str(err))
    assert outcomes[0] == outcomes[1]

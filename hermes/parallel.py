"""Tensor parallelism in the glue (docs/multi-gpu.md): a model loaded under `torchrun` with transformers'
`from_pretrained(..., distributed_config=DistributedConfig(tp_size=N))` holds on each rank an equal, contiguous
share of every layer's query and KV heads. `head_shard` reads this rank's share off the model (`HeadShard`, or
None for a model in one process); the stream sizes its caches from it, HERMES averages its pooled attention over
the share's group once per step, H2SVC takes this rank's columns of its head map. `RankGuard` keeps a stream from
calling into the model again once a failure may have left the ranks at different collectives; `refusing_ranks` lets
the ranks agree on a check whose verdict can differ between them.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from hermes_kernels.engine.geometry import ModelGeometry


@dataclasses.dataclass(frozen=True)
class HeadShard:
    """This rank's share of the heads of a tensor-parallel model.

    group:        the `torch.distributed` process group of the ranks that share the heads; index: this rank's place
                  in it; count: N, its size.
    num_heads, num_kv_heads: the whole model's H and Hkv per layer. This rank holds query heads
                  [index·H/N, (index+1)·H/N) and KV heads `kv_heads` = [index·Hkv/N, (index+1)·Hkv/N).
    """

    group: object
    index: int
    count: int
    num_heads: int
    num_kv_heads: int

    @property
    def kv_heads(self) -> range:
        """The global KV heads (of every layer) this rank holds."""
        share = self.num_kv_heads // self.count
        return range(self.index * share, (self.index + 1) * share)

    def local(self, geometry: ModelGeometry) -> ModelGeometry:
        """The whole model's geometry with this rank's head counts (what its caches hold)."""
        return dataclasses.replace(geometry, num_heads=geometry.num_heads // self.count,
                                   num_kv_heads=geometry.num_kv_heads // self.count)


def head_shard(model: torch.nn.Module, family, language_model: torch.nn.Module) -> HeadShard | None:
    """This rank's `HeadShard` of a model loaded with `DistributedConfig(tp_size=N)`, N > 1; None for a model in one
    process. ValueError naming `model` for tensor parallelism the stream cannot run: attention left whole on every
    rank (e.g. Qwen3-VL loaded without its family's `tp_plan`: the message says how to load it), heads split
    unevenly, or other parallelism (FSDP, pipeline) beside it."""
    tp_size = getattr(model, "tp_size", None) or 1
    attention = next(layer.self_attn for layer in language_model.layers if hasattr(layer, "self_attn"))
    weight = attention.k_proj.weight
    if tp_size == 1 and not isinstance(weight, DTensor):
        return None
    if not isinstance(weight, DTensor):
        raise ValueError(f"model: {family.name} under tensor parallelism (tp_size={tp_size}) holds every attention "
                         f"head on every rank: {whole_heads_remedy(family, tp_size)}")
    config = getattr(model.config, "distributed_config", None)
    others = {name: getattr(config, name, 1) or 1 for name in ("pp_size", "fsdp_size", "dp_replicate_size")}
    if any(size > 1 for size in others.values()):
        raise ValueError(f"model: the stream runs tensor parallelism alone (tp_size={tp_size}), got {others}")
    mesh = weight.device_mesh
    if mesh.ndim != 1 or tuple(weight.placements) != (Shard(0),):
        raise ValueError(f"model: expected the KV projections sharded by rows over one mesh dimension, got "
                         f"{tuple(weight.placements)} over {mesh}")
    text = model.config.get_text_config()
    count = mesh.size()
    # query heads from o_proj's columns (row-parallel): q_proj may carry more than the queries (Qwen3.5's gate)
    local = {"query": attention.o_proj.weight.to_local().shape[1] // attention.head_dim,
             "KV": weight.to_local().shape[0] // attention.head_dim}
    # the module's own KV heads (a model's layers may differ: Gemma 4's full layers have their own count)
    whole = {"query": text.num_attention_heads, "KV": text.num_attention_heads // attention.num_key_value_groups}
    uneven = [kind for kind in local if local[kind] * count != whole[kind]]
    if uneven:
        raise ValueError(f"model: {' and '.join(f'{whole[k]} {k} heads' for k in uneven)} do not split evenly over "
                         f"{count} ranks (this rank holds {', '.join(f'{local[k]} {k}' for k in uneven)}); tp_size "
                         f"must divide the KV heads")
    return HeadShard(group=mesh.get_group(), index=mesh.get_local_rank(), count=count,
                     num_heads=text.num_attention_heads, num_kv_heads=whole["KV"])


def whole_heads_remedy(family, tp_size: int | str) -> str:
    """How to load `family`'s model so that its attention heads are split: with the family's `tp_plan` where it has
    one, else not under tensor parallelism."""
    if family.tp_plan is None:
        return "transformers' tensor-parallel plan for it does not split the heads; run it in one process or split " \
               "its layers over GPUs with device_map"
    cls = type(family)
    return (f"transformers' plan for it does not split the heads; load it with DistributedConfig(tp_size={tp_size}, "
            f"tp_plan={cls.__name__}.tp_plan) ({cls.__module__}), as hermes.commands.load_model(..., tp={tp_size}) "
            f"does")


def refusing_ranks(group, refused: bool, device: torch.device | str = "cpu") -> list[int]:
    """The ranks of `group` whose check refused: one all-reduce (sum) of an int32 flag per rank, on `device` (the
    group's backend must reach it: gloo the CPU, NCCL a GPU). Every rank calls it, refused or not."""
    flags = torch.zeros(group.size(), dtype=torch.int32, device=device)
    flags[dist.get_rank(group)] = int(refused)
    dist.all_reduce(flags, op=dist.ReduceOp.SUM, group=group)
    return flags.nonzero().flatten().tolist()


class RankGuard:
    """Whether the ranks of a tensor-parallel stream are still in step (docs/multi-gpu.md#failures).

    Every rank makes the same calls into the model, so the same collectives in the same order. Input that a check
    refuses (ValueError, TypeError) is refused alike on every rank, since the checks read what every rank holds
    alike, and the stream stays usable. Any other failure inside a call (a fault in one rank's layer, the process
    group's error on the others, an interrupt) may leave the ranks at different collectives: a rank that called
    into the model again would pair its collectives with another call's, so the stream refuses every later call.
    Without a shard (one process) it never refuses.
    """

    def __init__(self, shard: HeadShard | None):
        self.shard = shard
        self.failure: str | None = None

    def check(self) -> None:
        """RuntimeError once a failure may have left the ranks out of step."""
        if self.failure is not None:
            raise RuntimeError(f"stream: a failure inside a call under tensor parallelism ({self.failure}) may have "
                               f"left the ranks at different collectives; end every rank's process and start again")

    @contextlib.contextmanager
    def call(self) -> Iterator[None]:
        """A call into the model: a failure other than refused input marks the ranks out of step."""
        try:
            yield
        except (ValueError, TypeError):
            raise
        except BaseException as error:
            if self.shard is not None:
                self.failure = f"{type(error).__name__}: {' '.join(str(error).split())[:200]}"
            raise

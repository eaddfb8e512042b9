"""Several ranks of one test on this machine, started as transformers' own tensor-parallel tests start them:
`torch.multiprocessing.spawn`, the rank environment set, a gloo process group whose timeout bounds every collective
so a silent rank fails the others instead of hanging them (docs/multi-gpu.md#tested).

    run_ranks(body, 2, *args)      # body(rank, world, *args) in each of 2 processes; a rank's exception fails the test

`body` must be a module-level function of an importable module (spawn imports it again in every process). Starting
processes dominates the cost, so a test module groups its checks into one spawned run per rank count.
"""
from __future__ import annotations

import datetime
import gc
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

GROUP_TIMEOUT_S = 60  # a collective that waits longer for a peer raises on every rank still in it


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(body, world: int, *args, timeout_s: int = GROUP_TIMEOUT_S) -> None:
    """Run body(rank, world, *args) in `world` spawned processes joined by a gloo group; an exception in any rank
    is raised here (`torch.multiprocessing.ProcessRaisedException`, with that rank's traceback)."""
    mp.spawn(_rank_main, args=(world, free_port(), timeout_s, body, args), nprocs=world, join=True)


def _rank_main(rank: int, world: int, port: int, timeout_s: int, body, args) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)  # the ranks share two cores
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
    try:
        body(rank, world, *args)
    finally:
        # objects that hold the group in a reference cycle (an instance accelerated with group=) are freed while
        # it is alive: freed at interpreter exit instead, gloo's destructor aborted the process now and then
        gc.collect()
        dist.destroy_process_group()

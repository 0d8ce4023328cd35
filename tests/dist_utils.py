"""Run a function on N local ranks (gloo on CPU, NCCL on GPUs: ``recpipe.testing.launch``),
collecting return values; a one-rank group in the test's own process; a free port."""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from recpipe.testing.launch import rank_backend_device


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def one_rank() -> Iterator[torch.device]:
    """A one-rank gloo group in this process, on one CPU thread as the subprocesses here
    (``OMP_NUM_THREADS=1``: several test workers share the cores; thread pools that wait for
    each other's descheduled threads train 20x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield torch.device("cpu")
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(threads)


def _worker(rank: int, world: int, port: int, fn: Callable, args: tuple, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    backend, device = rank_backend_device(rank, world)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        queue.put((rank, fn(rank, world, device, *args), None))
    except BaseException:  # report, don't hang the parent
        queue.put((rank, None, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, fn: Callable, *args: Any) -> list[Any]:
    """``[fn(rank, world, device, *args) for rank in range(world)]``, one process per rank."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors = []
    for _ in procs:
        rank, value, err = queue.get(timeout=600)
        results[rank] = value
        if err:
            errors.append(f"rank {rank}:\n{err}")
    for p in procs:
        p.join(timeout=60)
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world)]

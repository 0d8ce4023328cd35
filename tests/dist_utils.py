"""Run a function on N local ranks (gloo on CPU, NCCL on GPUs: ``recpipe.testing.launch``),
collecting return values; a one-rank group in the test's own process; a free port for other
programs.

The rank processes stay up between tests (one pool per test process and world size): a spawned
process spends ~6 s of CPU importing torch and torchrec, most of a multi-rank test's time. Each
call still gets a fresh process group and the caller's environment; a call that fails, hangs or
loses a rank closes the pool, and the next call spawns a new one.

Each call's rendezvous is a TCPStore that the parent opens on port 0 (the kernel picks a free port
as it binds) and the ranks join as clients: no port is picked first and bound later, so another
test worker cannot take it in between (``EADDRINUSE`` under ``pytest -n 4``)."""

from __future__ import annotations

import atexit
import os
import queue
import random
import socket
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.constants import default_pg_timeout

from recpipe.testing.launch import rank_backend_device


#: the OS's randomness: a test that seeds ``random`` must not give every worker the same ports
_draw = random.SystemRandom()


def free_port() -> int:
    """A port free now, for a program that binds it itself (torchrun's rendezvous, an example's
    ``MASTER_PORT``). Drawn below the kernel's ephemeral range (Linux: 32768-60999 by default),
    from which every ``bind(0)`` and outgoing connection of the other test workers takes its
    port, so that only another such draw can take it before the program binds it."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(100):
        port = _draw.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # in use: draw again
            return port
    raise RuntimeError(f"no free port below {low} in 100 draws")


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


def _run_task(rank: int, world: int, port: int, env: dict[str, str], fn: Callable,
              args: tuple) -> Any:
    """``fn(rank, world, device, *args)`` in a fresh process group on the parent's store at
    ``port``, with the caller's environment (and its ``OMP_NUM_THREADS``) for the call's
    duration."""
    saved, threads = dict(os.environ), torch.get_num_threads()
    os.environ.clear()
    os.environ.update(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if "OMP_NUM_THREADS" in env:
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    backend, device = rank_backend_device(rank, world)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # the parent's store, with the timeout that init_process_group's own rendezvous would give it
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=default_pg_timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world)
    try:
        return fn(rank, world, device, *args)
    finally:
        dist.destroy_process_group()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        os.environ.clear()
        os.environ.update(saved)
        torch.set_num_threads(threads)


def _serve(rank: int, world: int, tasks: Any, results: Any) -> None:
    """A pool's rank process: runs tasks until it gets ``None`` or its parent is gone."""
    parent = mp.parent_process()
    while True:
        try:
            task = tasks.get(timeout=1)
        except queue.Empty:
            if parent is not None and not parent.is_alive():
                return
            continue
        if task is None:
            return
        try:
            results.put((rank, _run_task(rank, world, *task), None))
        except BaseException:  # report, don't hang the parent
            results.put((rank, None, traceback.format_exc()))


class _RankPool:
    """``world`` spawned processes serving :func:`run_ranks` calls."""

    def __init__(self, world: int) -> None:
        ctx = mp.get_context("spawn")
        self.world = world
        self.tasks = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        self.procs = [ctx.Process(target=_serve, args=(r, world, self.tasks[r], self.results))
                      for r in range(world)]
        for p in self.procs:
            p.start()

    def run(self, fn: Callable, args: tuple, timeout: float) -> tuple[dict[int, Any], list[str]]:
        # the call's rendezvous, bound before any rank needs it; it lives until this returns
        store = dist.TCPStore("127.0.0.1", 0, self.world, is_master=True, wait_for_workers=False)
        task = (store.port, dict(os.environ), fn, args)
        for q in self.tasks:
            q.put(task)
        results: dict[int, Any] = {}
        errors = []
        deadline = time.monotonic() + timeout
        while len(results) < self.world:
            try:
                rank, value, err = self.results.get(timeout=1)
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"ranks {dead} died" if dead else f"no result in {timeout} s")
                continue
            results[rank] = value
            if err:
                errors.append(f"rank {rank}:\n{err}")
        return results, errors

    def close(self) -> None:
        for q in self.tasks:
            q.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


_pools: dict[int, _RankPool] = {}


@atexit.register  # before multiprocessing's own exit handler, which joins live children
def close_pools() -> None:
    """End every pool's processes (conftest: at the end of the session)."""
    while _pools:
        _pools.popitem()[1].close()


def run_ranks(world: int, fn: Callable, *args: Any, timeout: float = 600) -> list[Any]:
    """``[fn(rank, world, device, *args) for rank in range(world)]``, one process per rank
    (``fn`` and ``args`` picklable: module-level functions)."""
    pool = _pools.pop(world, None) or _RankPool(world)
    try:
        results, errors = pool.run(fn, args, timeout)
    except BaseException:
        pool.close()
        raise
    if errors:
        pool.close()  # whatever state the failure left stays out of the next test
        raise RuntimeError("\n".join(errors))
    _pools[world] = pool
    return [results[r] for r in range(world)]

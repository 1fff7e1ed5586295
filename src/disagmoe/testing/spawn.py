"""Run a function on N local ranks (torch.multiprocessing, loopback rendezvous).

`run_ranks(fn, world_size, *args)` returns each rank's return value (picklable),
raising if any rank failed. Tests use it to pack several checks into one spawn. The
ranks' process group is gloo; with `device="cuda"` (GPU tests) each rank binds its own
accelerator and the group is the device module's (`cpu:gloo,cuda:nccl`).
"""

from __future__ import annotations

import io
import os
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from queue import Empty
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..device import bind_device, default_backend, free_port, init_kwargs, resolve_device


def _entry(
    rank: int,
    world: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple,
    queue: Any,
    device_name: str = "cpu",
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        GLOO_SOCKET_IFNAME="lo",
    )
    torch.set_num_threads(1)
    try:
        device = resolve_device(device_name)
        bind_device(device)
        dist.init_process_group(
            default_backend(device),
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=120),
            **init_kwargs(device),
        )
        result = fn(*args)
        buf = io.BytesIO()
        torch.save(result, buf)  # tensors by value: the rank may exit before the parent reads
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 300,
    may_vanish: set[int] | None = None,
    device: str = "cpu",
) -> list[Any]:
    """Run `fn(*args)` on `world_size` ranks on `device` (`parallel.device` values); return
    each rank's result.

    Ranks in `may_vanish` may exit without reporting (their result is None): tests of
    a dead peer use it.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_entry, args=(r, world_size, port, fn, args, queue, device), daemon=False
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    vanish = may_vanish or set()
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world_size and not errors:
            gone = {r for r, p in enumerate(procs) if not p.is_alive() and r not in results}
            if gone and gone <= vanish and len(results) + len(gone) == world_size and queue.empty():
                break
            if time.monotonic() > deadline:
                errors.append(f"timed out after {timeout_s} s; reported: {sorted(results)}")
                break
            try:
                rank, status, value = queue.get(timeout=0.2)
            except Empty:
                continue
            if status == "ok":
                results[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                errors.append(f"rank {rank}:\n{value}")
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 1)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results.get(r) for r in range(world_size)]

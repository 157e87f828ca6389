"""Run a function on N gloo ranks in spawned processes and collect each rank's return value."""

from __future__ import annotations

import os
import traceback

import torch.multiprocessing as mp

from bebop_megatron.parallel import free_port


def _worker(fn, rank, world_size, port, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), CUDA_VISIBLE_DEVICES="")
    import warnings

    warnings.filterwarnings("ignore")
    try:
        result = fn(rank, world_size, *args)
        queue.put((rank, "ok", result))
    except BaseException:  # report every failure to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        from bebop_megatron.parallel import destroy_distributed

        destroy_distributed()


def run_distributed(fn, world_size: int, *args, timeout: float = 600.0) -> list:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors = []
    try:
        for _ in range(world_size):
            rank, status, value = queue.get(timeout=timeout)
            if status == "error":
                errors.append(f"rank {rank}:\n{value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("distributed worker failed:\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]

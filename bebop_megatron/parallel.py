"""Process-group setup: torch.distributed + megatron-core parallel_state, on GPU or CPU."""

from __future__ import annotations

import os
import pickle
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from bebop_megatron.platform import Platform, detect_platform, enable_cpu_compat


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def initialize_distributed(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    seed: int = 1234,
    force_cpu: bool = False,
    timeout_s: int = 600,
    expert_model_parallel_size: int = 1,
) -> Platform:
    """Initialise torch.distributed (env:// from torchrun, or a single local process) and
    megatron-core's model-parallel groups, then seed the model-parallel RNG tracker."""
    from megatron.core import parallel_state, tensor_parallel

    platform = detect_platform(force_cpu=force_cpu)
    if not platform.is_cuda:
        enable_cpu_compat()
    else:
        torch.cuda.set_device(platform.device)
    if not dist.is_initialized():
        if "WORLD_SIZE" not in os.environ:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(free_port()))
            os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"] = "0", "1", "0"
        dist.init_process_group(backend=platform.backend, timeout=timedelta(seconds=timeout_s))
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tensor_model_parallel_size,
            pipeline_model_parallel_size=pipeline_model_parallel_size,
            expert_model_parallel_size=expert_model_parallel_size,
        )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return platform


def destroy_distributed() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def is_logging_rank() -> bool:
    """The last global rank (last pipeline stage, where losses live) logs, as in Megatron-LM."""
    return not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1


# Imported once by the forkserver that local workers fork from (see run_local_workers).
_WORKER_PRELOAD = ["torch", "torch.distributed", "megatron.core", "megatron.core.models.gpt", "bebop_megatron.model"]


def _local_worker(fn, rank, world_size, port, args, queue, environ=None):
    if environ is not None:  # a forkserver child inherits the server's environment, not the caller's
        os.environ.clear()
        os.environ.update(environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    import traceback
    import warnings

    warnings.filterwarnings("ignore")
    try:
        # Results cross as plain pickled bytes: torch.multiprocessing would otherwise send tensors as
        # shared-memory handles that vanish when this worker exits before the parent has read them
        # (FileNotFoundError in multiprocessing's resource_sharer, a flaky race).
        queue.put((rank, "ok", pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:  # report every failure to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        destroy_distributed()


def worker_start_method() -> str:
    """``forkserver`` on CPU machines; ``spawn`` where CUDA is available. A process forked after CUDA
    was initialised cannot use CUDA ("Cannot re-initialize CUDA in forked subprocess"), and importing
    the preloaded modules (megatron-core) may initialise it in the forkserver itself: seen on an H200
    with tools/gpu_check.py. Spawn's ~6 s of imports per rank is small next to GPU work."""
    return "spawn" if torch.cuda.is_available() else "forkserver"


def run_local_workers(fn, world_size: int, *args, timeout: float = 3600.0) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local processes (env:// on a free
    loopback port, as torchrun would set up) and return each rank's result; raises with every
    failing rank's traceback. Used by ``bebop convert`` for TP/PP layouts and by the tests.

    Workers come from a forkserver that has imported torch and megatron-core once: each call then
    forks in well under a second instead of paying ~6 s of imports per rank, as spawn would. The
    server is single-threaded, so forking it is safe; each worker gets the caller's environment.
    On a machine with CUDA, workers are spawned instead (see ``worker_start_method``)."""
    import queue as queue_mod

    import torch.multiprocessing as mp

    method = worker_start_method()
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(_WORKER_PRELOAD)
    q = ctx.Queue()
    port = free_port()
    env = dict(os.environ)
    procs = [ctx.Process(target=_local_worker, args=(fn, r, world_size, port, args, q, env))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors = {}, []
    try:
        deadline = time.monotonic() + timeout
        while len(results) < world_size:
            try:
                rank, status, value = q.get(timeout=1.0)
            except queue_mod.Empty:
                if any(p.exitcode is not None and r not in results for r, p in enumerate(procs)):
                    try:  # a result written just before its worker exited may still be in the pipe
                        rank, status, value = q.get(timeout=5.0)
                    except queue_mod.Empty:
                        rank = None
                else:
                    rank = None
            if rank is None:
                # a worker that died without reporting (killed, or failed to start: for example a
                # script without an ``if __name__ == "__main__":`` guard) must not leave us waiting
                dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode is not None and r not in results]
                if dead:
                    raise RuntimeError("local worker(s) exited without a result: " + ", ".join(
                        f"rank {r} (exit code {c})" for r, c in dead) + "; a script that starts workers needs an "
                        "`if __name__ == \"__main__\":` guard (forkserver re-imports the main module)") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"local workers timed out after {timeout}s") from None
                continue
            if status == "error":
                errors.append(f"rank {rank}:\n{value}")
            else:
                value = pickle.loads(value)  # our own child's result (see _local_worker)
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("local worker failed:\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]

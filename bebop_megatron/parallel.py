"""Process-group setup: torch.distributed + megatron-core parallel_state, on GPU or CPU."""

from __future__ import annotations

import os
import socket
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

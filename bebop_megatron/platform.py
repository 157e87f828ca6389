"""Device / backend selection and the CPU compatibility layer for megatron-core.

Production runs use CUDA + NCCL and never touch the compatibility layer. On machines
without CUDA (CI, laptops) megatron-core 0.16.1 still hard-codes CUDA in a few places
that our code paths reach:

* ``torch.cuda.current_device()`` used as a ``device=`` argument (buffers in tensor-parallel
  mappings, p2p shape exchange, RoPE ``inv_freq``, MTP loss tracker, attention masks);
* ``torch.cuda.synchronize()`` in p2p communication and parallel_state;
* the CUDA RNG tracker (``torch.cuda.get_rng_state`` / ``manual_seed`` / ``_set_cuda_rng_state``);
* ``torch.zeros/tensor(..., device="cuda")`` in the pipeline schedules, the optimizer wrappers,
  gradient clipping, the grad buffers and the checkpoint exchange (``_LITERAL_CUDA_MODULES``);
* ``torch.cuda.nvtx`` ranges;
* ``clip_grad_by_total_norm_fp32`` asserting ``torch.cuda.FloatTensor`` grads;
* ``weight.data.cuda()`` when syncing the MTP stage's embedding copy across pipeline stages.

``enable_cpu_compat()`` redirects exactly those to the CPU: ``current_device()`` returns the
CPU device, synchronize/nvtx are no-ops, the RNG tracker forks the CPU generator (so
dropout/initialisation stay reproducible and model-parallel seeds still differ per TP rank),
``Tensor.cuda()`` returns the tensor itself, and those modules see a ``torch`` whose factory functions map ``device="cuda"`` to
CPU. It is a no-op (returns False) when CUDA is available, so GPU paths never depend on it.
"""

from __future__ import annotations

import os
import types
from dataclasses import dataclass

import torch

_COMPAT_ENABLED = False


@dataclass(frozen=True)
class Platform:
    """What this process runs on."""

    device: torch.device
    backend: str  # torch.distributed backend

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"


def detect_platform(force_cpu: bool = False) -> Platform:
    """cuda + nccl when a GPU is visible (and not forced off), else cpu + gloo."""
    if not force_cpu and torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        return Platform(torch.device("cuda", local_rank % torch.cuda.device_count()), "nccl")
    return Platform(torch.device("cpu"), "gloo")


class _CpuTorchProxy(types.ModuleType):
    """A stand-in for the ``torch`` module inside megatron modules that pass ``device="cuda"``
    literally. Factory functions get their ``device`` mapped to CPU; everything else is torch."""

    _FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange", "randn", "rand")

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str):
        attr = getattr(torch, name)
        if name in self._FACTORIES:

            def factory(*args, **kwargs):
                dev = kwargs.get("device")
                if dev is not None and torch.device(dev).type == "cuda":
                    kwargs["device"] = "cpu"
                kwargs.pop("pin_memory", None)
                return attr(*args, **kwargs)

            return factory
        return attr


# megatron-core modules that write device="cuda" / 'cuda' literally on paths we use.
_LITERAL_CUDA_MODULES = (
    "megatron.core.utils",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.dist_checkpointing.exchange_utils",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
)


def enable_cpu_compat() -> bool:
    """Install the CPU compatibility layer (idempotent). Returns True if it is active."""
    global _COMPAT_ENABLED
    if torch.cuda.is_available():
        return False
    if _COMPAT_ENABLED:
        return True

    cpu = torch.device("cpu")
    torch.cuda.current_device = lambda: cpu  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()  # type: ignore[assignment]
    torch.cuda.manual_seed = lambda seed: torch.manual_seed(seed)  # type: ignore[assignment]
    torch.cuda.nvtx.range_push = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.nvtx.range_pop = lambda *a, **k: None  # type: ignore[assignment]
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[assignment]

    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)

    import importlib

    proxy = _CpuTorchProxy()
    for name in _LITERAL_CUDA_MODULES:
        importlib.import_module(name).torch = proxy
    # clip_grad_by_total_norm_fp32 asserts grads are torch.cuda.FloatTensor; same maths on CPU.
    from megatron.core.optimizer import optimizer as moptimizer

    moptimizer.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_cpu
    # MoE router: megatron-core 0.16.1 tests ``te_general_gemm is not None`` but binds the name only
    # when Transformer Engine imports; unbound, the router's torch matmul path is taken.
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    _COMPAT_ENABLED = True
    return True


def _clip_grad_by_total_norm_cpu(parameters, max_norm, total_norm, use_decoupled_grad: bool = False):
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr) for p in parameters if getattr(p, attr, None) is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        for g in grads:
            g.detach().mul_(clip_coeff)


"""Tensor-parallel layout of megatron-core parameters: full (TP=1) tensor <-> this rank's shard.

megatron-core tags each TP-split parameter with ``tensor_model_parallel=True`` and its
``partition_dim`` (0 for column-parallel weights, the vocab-parallel embedding and the output
layer; 1 for row-parallel weights). The one exception to "contiguous chunk along
partition_dim" is the gated MLP's ``linear_fc1`` ([gate; up] stacked): each rank holds
[gate_r; up_r], so gate and up are chunked separately. ``linear_qkv`` is already laid out per
query group ([q.., k, v] per group; with an attention output gate [q.., gate.., k, v]), so a
contiguous chunk is a whole set of groups. Gated DeltaNet's ``in_proj`` ([q, k, v, z, β, α]) and
``conv1d`` ([q, k, v]) generalise the fc1 case: parameters tagged with ``tp_sections`` (full
section sizes, see ``model/qwen3_5.py``) are chunked section by section.
"""

from __future__ import annotations

import re
from typing import Iterable

import torch
import torch.distributed as dist
from torch import Tensor


_FC1 = re.compile(r"linear_fc1\.(weight|bias)\d*$")  # \d*: Transformer Engine's grouped experts (weight<e>)


def _is_gated_fc1(name: str, gated: bool) -> bool:
    return gated and _FC1.search(name) is not None


def _sections(name: str, local: Tensor, gated: bool):
    """Full-size sections that are TP-split separately (None: one contiguous split)."""
    secs = getattr(local, "tp_sections", None)
    if secs is not None:
        return list(secs)
    if _is_gated_fc1(name, gated):
        return 2  # [gate; up], equal halves
    return None


def _split_sections(t: Tensor, secs, dim: int) -> list[Tensor]:
    return list(torch.chunk(t, secs, dim)) if isinstance(secs, int) else list(torch.split(t, secs, dim))


def shard_tensor(name: str, full: Tensor, local: Tensor, tp_rank: int, tp_size: int, gated: bool) -> Tensor:
    """This rank's shard of ``full`` for a parameter shaped like ``local``."""
    if not getattr(local, "tensor_model_parallel", False) or tp_size == 1:
        if full.shape != local.shape:
            raise ValueError(f"{name}: full shape {tuple(full.shape)} != local {tuple(local.shape)}")
        return full
    dim = local.partition_dim
    secs = _sections(name, local, gated)
    if secs is not None:
        parts = _split_sections(full, secs, dim)
        if any(p.shape[dim] % tp_size for p in parts):
            raise ValueError(f"{name}: sections {[p.shape[dim] for p in parts]} not divisible by TP {tp_size}")
        shard = torch.cat([torch.chunk(p, tp_size, dim)[tp_rank] for p in parts], dim)
    else:
        if full.shape[dim] % tp_size:
            raise ValueError(f"{name}: dim {dim} of size {full.shape[dim]} not divisible by TP {tp_size}")
        shard = torch.chunk(full, tp_size, dim=dim)[tp_rank]
    if shard.shape != local.shape:
        raise ValueError(f"{name}: shard shape {tuple(shard.shape)} != local {tuple(local.shape)}")
    return shard


def gather_tensor(name: str, local: Tensor, tp_group, gated: bool) -> Tensor:
    """Inverse of :func:`shard_tensor` (collective over ``tp_group``)."""
    tp_size = dist.get_world_size(tp_group) if tp_group is not None and dist.is_initialized() else 1
    if not getattr(local, "tensor_model_parallel", False) or tp_size == 1:
        return local.detach().clone()
    dim = local.partition_dim
    parts = [torch.empty_like(local) for _ in range(tp_size)]
    dist.all_gather(parts, local.detach().contiguous(), group=tp_group)
    secs = _sections(name, local, gated)
    if secs is not None:
        local_secs = secs if isinstance(secs, int) else [n // tp_size for n in secs]
        split = [_split_sections(p, local_secs, dim) for p in parts]
        return torch.cat([torch.cat([sp[i] for sp in split], dim) for i in range(len(split[0]))], dim)
    return torch.cat(parts, dim=dim)


def load_full_state_dict(model, full: dict[str, Tensor], names: Iterable[str] | None = None) -> None:
    """Copy TP=1 tensors into this rank's (sharded) parameters, for the given names (default: all)."""
    from megatron.core import parallel_state

    rank = parallel_state.get_tensor_model_parallel_rank()
    size = parallel_state.get_tensor_model_parallel_world_size()
    gated = model.config.gated_linear_unit
    params = dict(model.named_parameters())
    for name in names if names is not None else params:
        if name not in full:
            raise KeyError(f"missing tensor {name!r} in the full state dict")
        with torch.no_grad():
            params[name].copy_(shard_tensor(name, full[name], params[name], rank, size, gated))


def gather_full(model, tensors: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
    """TP=1 view of this stage's parameters (or of same-shaped tensors, e.g. their grads)."""
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    gated = model.config.gated_linear_unit
    out = {}
    for name, p in model.named_parameters():
        t = p if tensors is None else tensors[name]
        if tensors is not None:  # carry the TP attributes of the parameter
            t = _with_tp_attrs(t, p)
        out[name] = gather_tensor(name, t, group, gated)
    return out


def _with_tp_attrs(t: Tensor, p: Tensor) -> Tensor:
    t = t.detach()
    for attr in ("tensor_model_parallel", "partition_dim", "partition_stride", "tp_sections"):
        if hasattr(p, attr):
            setattr(t, attr, getattr(p, attr))
    return t


def ensure_tp_attributes(model) -> None:
    """Tag TP-split parameters with ``tensor_model_parallel`` / ``partition_dim``.

    megatron-core sets these inside its weight-initialisation helpers, so a model built with
    ``perform_initialization=False`` (weights loaded right after) lacks them on the CPU path.
    """
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    def tag(p, dim):
        if p is not None and not hasattr(p, "partition_dim"):
            set_tensor_model_parallel_attributes(p, True, dim, 1)

    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
            tag(module.weight, 0)
            if isinstance(module, ColumnParallelLinear):
                tag(getattr(module, "bias", None), 0)
        elif isinstance(module, RowParallelLinear):
            tag(module.weight, 1)

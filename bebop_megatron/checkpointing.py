"""Megatron ``torch_dist`` distributed checkpoints with atomic publication and resume.

Layout under ``<dir>/checkpoints``::

    iter_0000100/          # a megatron-core dist checkpoint (reshardable across TP/PP)
    latest                 # text file: name of the newest complete checkpoint

A checkpoint is written to ``iter_N.tmp`` and renamed only once every rank has finished, and
``latest`` is replaced atomically after that, so a run killed at any point leaves either the
previous or the new checkpoint, never a half-written one marked as latest.

Model weights use megatron-core's sharded state dict (reshardable: save at TP1/PP1, load at any
TP/PP). Optimizer state is stored per (PP, TP) rank as a ``ShardedObject`` (replicated over DP):
megatron's own optimizer sharded state keeps ``common_step``/``param_groups`` in the rank-0 common
state, which breaks when a pipeline stage has no trainable parameters (the frozen trunk stages of
MTP training). Resuming the optimizer therefore needs the same TP/PP; ``load_optimizer=False``
restarts it (as Megatron-LM's ``--no-load-optim``).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

LATEST = "latest"


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def sharded_metadata() -> dict:
    from megatron.core import parallel_state

    return {"dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}


def _unwrap(model):
    return getattr(model, "module", model)


def model_sharded_state_dict(model):
    return _unwrap(model).sharded_state_dict(metadata=sharded_metadata())


def _parallel_layout() -> dict:
    from megatron.core import parallel_state as ps

    return {"tp": ps.get_tensor_model_parallel_world_size(), "pp": ps.get_pipeline_model_parallel_world_size()}


def _optimizer_object(optimizer, data=None):
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    lay = _parallel_layout()
    return ShardedObject(
        "optimizer.per_rank_state",
        optimizer.state_dict() if data is None else data,
        (lay["pp"], lay["tp"]),
        (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()),
        replica_id=ps.get_data_parallel_rank(with_context_parallel=True),
    )


def latest_checkpoint(root: str | Path) -> Optional[Path]:
    """The newest complete checkpoint under ``root/checkpoints`` (or ``root`` itself if it is one)."""
    root = Path(root)
    if (root / "metadata.json").exists():
        return root
    marker = root / "checkpoints" / LATEST
    if not marker.exists():
        return None
    path = root / "checkpoints" / marker.read_text().strip()
    return path if path.is_dir() else None


def save_checkpoint(root: str | Path, step: int, model, optimizer=None, extra: Optional[dict] = None) -> Path:
    """Save model (+ optimizer) sharded state and ``extra`` (step, data position, config...)."""
    from megatron.core import dist_checkpointing

    ckpt_root = Path(root) / "checkpoints"
    final = ckpt_root / f"iter_{step:07d}"
    tmp = ckpt_root / f"iter_{step:07d}.tmp"
    if _rank0():
        ckpt_root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    _barrier()
    state: dict[str, Any] = {"model": model_sharded_state_dict(model)}
    if optimizer is not None:
        state["optimizer"] = _optimizer_object(optimizer)
    state["extra"] = dict(extra or {}, step=step, parallel=json.dumps(_parallel_layout()),
                          has_optimizer=optimizer is not None)
    dist_checkpointing.save(state, str(tmp))
    _barrier()
    if _rank0():
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        marker_tmp = ckpt_root / (LATEST + ".tmp")
        marker_tmp.write_text(final.name)
        os.replace(marker_tmp, ckpt_root / LATEST)
    _barrier()
    return final


class CheckpointMismatch(RuntimeError):
    """The checkpoint cannot be resumed as asked (e.g. optimizer state under another TP/PP)."""


def load_checkpoint(path: str | Path, model, optimizer=None, strict: bool = True) -> dict:
    """Load the model at any TP/PP (and the optimizer at the saved TP/PP); returns ``extra``."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    if not (path / "metadata.json").exists():
        raise FileNotFoundError(f"{path} is not a megatron dist checkpoint (no metadata.json)")
    sharded: dict[str, Any] = {"model": model_sharded_state_dict(model)}
    if optimizer is not None:
        common = dist_checkpointing.load_common_state_dict(str(path)).get("extra", {})
        saved = json.loads(common.get("parallel", "null") or "null")
        if not common.get("has_optimizer", False):
            raise CheckpointMismatch(f"{path} holds no optimizer state; load it as weights only")
        if saved != _parallel_layout():
            raise CheckpointMismatch(
                f"{path}: optimizer state was saved at TP/PP {saved} but this run is {_parallel_layout()}; "
                "model weights reshard, optimizer state does not: resume with the saved layout, or start "
                "from the weights only (train.load=<checkpoint>, fresh output_dir)")
        sharded["optimizer"] = _optimizer_object(optimizer, data={})
    state = dist_checkpointing.load(sharded, str(path))
    _unwrap(model).load_state_dict(state["model"], strict=strict)
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    extra = state.get("extra", {})
    return {k: (v.item() if isinstance(v, torch.Tensor) and v.numel() == 1 else v) for k, v in extra.items()}


def checkpoint_config(path: str | Path) -> dict:
    """The run config stored in a checkpoint's common state."""
    from megatron.core import dist_checkpointing

    extra = dist_checkpointing.load_common_state_dict(str(path)).get("extra", {})
    if "config" not in extra:
        raise CheckpointMismatch(f"{path} records no config")
    return json.loads(extra["config"])


def load_model_weights(path: str | Path, model, fresh: Optional[Callable[[str], bool]] = None,
                       missing_ok: Optional[Callable[[str], bool]] = None) -> list[str]:
    """Model weights only (e.g. start MTP training from a trunk checkpoint).

    Parameters that ``fresh`` selects by name keep their initialisation (a benchmark's heads,
    initialised per seed); so do those the checkpoint does not hold where ``missing_ok`` allows
    it (a trunk saved with fewer MTP heads than this model has, or none, as Megatron-LM finetunes
    from a checkpoint without MTP layers). Any other tensor the checkpoint lacks is an error.
    Returns the names that kept their initialisation."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    path = Path(path)
    if not (path / "metadata.json").exists():
        raise FileNotFoundError(f"{path} is not a megatron dist checkpoint (no metadata.json)")
    meta = {k.split("/shard_")[0]: v for k, v in load_sharded_metadata(str(path)).items()}  # objects: shard suffix
    sharded = model_sharded_state_dict(model)
    # a saved tensor of another global shape (an MTP layer of another width, model.mtp_ffn_hidden_size):
    # where ``missing_ok`` allows it the whole layer starts fresh, as for one the checkpoint lacks
    reshaped, fresh_layers = [], set()
    for name, sh in sharded.items():
        old, new = getattr(meta.get(getattr(sh, "key", name)), "global_shape", None), getattr(sh, "global_shape", None)
        if old is not None and new is not None and tuple(old) != tuple(new):
            if missing_ok is not None and missing_ok(name) and name.startswith("mtp.layers."):
                fresh_layers.add(".".join(name.split(".")[:3]) + ".")
            else:
                reshaped.append(f"{name} {tuple(old)} there, {tuple(new)} here")
    if reshaped:
        raise CheckpointMismatch(f"{path} holds tensors of other shapes ({'; '.join(reshaped[:3])}): it was saved "
                                 "from a different model config")
    keep, skipped, missing = {}, [], []
    for name, sh in sharded.items():
        if (fresh is not None and fresh(name)) or any(name.startswith(p) for p in fresh_layers):
            skipped.append(name)
        elif getattr(sh, "key", name) not in meta:
            (skipped if missing_ok is not None and missing_ok(name) else missing).append(name)
        else:
            keep[name] = sh
    if missing:
        raise CheckpointMismatch(f"{path} holds no {', '.join(missing[:6])}"
                                 + (f" (+{len(missing) - 6} more)" if len(missing) > 6 else "")
                                 + ": it was saved from a different model config")
    state = dist_checkpointing.load({"model": keep}, str(path))
    _unwrap(model).load_state_dict(state["model"], strict=False)
    return skipped

"""Megatron ``torch_dist`` distributed checkpoints with atomic publication and resume.

Layout under ``<dir>/checkpoints``::

    iter_0000100/          # a megatron-core dist checkpoint (reshardable across TP/PP)
    latest                 # text file: name of the newest complete checkpoint

A checkpoint is written to ``iter_N.tmp`` and renamed only once every rank has finished, and
``latest`` is replaced atomically after that, so a run killed at any point leaves either the
previous or the new checkpoint, never a half-written one marked as latest.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Optional

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
        state["optimizer"] = optimizer.sharded_state_dict(state["model"])
    state["extra"] = dict(extra or {}, step=step)
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


def load_checkpoint(path: str | Path, model, optimizer=None, strict: bool = True) -> dict:
    """Load into ``model`` (and ``optimizer``) at any TP/PP; returns the ``extra`` dict."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    if not (path / "metadata.json").exists():
        raise FileNotFoundError(f"{path} is not a megatron dist checkpoint (no metadata.json)")
    sharded: dict[str, Any] = {"model": model_sharded_state_dict(model)}
    if optimizer is not None:
        sharded["optimizer"] = optimizer.sharded_state_dict(sharded["model"], is_loading=True)
    state = dist_checkpointing.load(sharded, str(path))
    _unwrap(model).load_state_dict(state["model"], strict=strict)
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    extra = state.get("extra", {})
    return {k: (v.item() if isinstance(v, torch.Tensor) and v.numel() == 1 else v) for k, v in extra.items()}


def load_model_weights(path: str | Path, model) -> dict:
    """Model weights only (e.g. start MTP training from a trunk checkpoint)."""
    return load_checkpoint(path, model, optimizer=None, strict=False)

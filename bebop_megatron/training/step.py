"""One training iteration through megatron-core's pipeline schedules (PP=1 or PP>1 alike)."""

from __future__ import annotations

from functools import partial
from typing import Iterator

import torch

from bebop_megatron.data import Batch


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Megatron's 3-tuple convention: (summed loss, token count, reduced values for logging)."""
    mask = loss_mask.reshape(-1).float()
    total = torch.sum(output_tensor.float().reshape(-1) * mask)
    num_tokens = mask.sum().to(torch.int)
    return total, num_tokens, {"lm loss": torch.stack([total.detach(), mask.sum()])}


def forward_step(data_iterator: Iterator[Batch], model):
    batch = next(data_iterator)
    device = next(model.parameters()).device
    b = {k: getattr(batch, k).to(device) for k in ("tokens", "labels", "loss_mask", "position_ids")}
    output = model(b["tokens"], b["position_ids"], None, labels=b["labels"], loss_mask=b["loss_mask"])
    return output, partial(loss_func, b["loss_mask"])


def run_schedule(forward_step_func, model_chunks, microbatches: list, seq_length: int, forward_only: bool) -> list:
    """megatron-core's forward/backward schedule for this PP layout over the given micro-batches;
    returns the last stage's loss-function outputs (empty elsewhere)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    return get_forward_backward_func()(
        forward_step_func=forward_step_func,
        data_iterator=iter(microbatches),
        model=model_chunks,
        num_microbatches=len(microbatches),
        seq_length=seq_length,
        micro_batch_size=microbatches[0].tokens.shape[0],
        forward_only=forward_only,
    )


def train_iteration(model_chunks, optimizer, microbatches: list[Batch], seq_length: int, forward_only: bool = False):
    """Forward/backward over the micro-batches, then one optimizer step.

    Returns (lm_loss_sum, lm_token_count, grad_norm, update_successful); the loss numbers are
    only meaningful on the last pipeline stage.
    """
    for chunk in model_chunks:
        if hasattr(chunk, "zero_grad_buffer"):
            chunk.zero_grad_buffer()
    if optimizer is not None:
        optimizer.zero_grad()
    losses = run_schedule(forward_step, model_chunks, microbatches, seq_length, forward_only)
    grad_norm, ok = None, True
    if not forward_only and optimizer is not None:
        ok, grad_norm, _ = optimizer.step()
    loss_sum = sum(float(x["lm loss"][0]) for x in losses) if losses else 0.0
    tokens = sum(float(x["lm loss"][1]) for x in losses) if losses else 0.0
    return loss_sum, tokens, grad_norm, ok

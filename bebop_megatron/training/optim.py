"""The optimizer stack every trainer uses: megatron-core DDP, optimizer and LR schedule."""

from __future__ import annotations

from typing import Optional

import torch

from bebop_megatron.config import Config


def build_optimizer(cfg: Config, model, lr: float, steps: int, warmup_steps: Optional[int] = None,
                    decay_style: str = "cosine"):
    """megatron-core DDP + Adam (megatron's optimizer wrapper: grad clipping, bf16 master weights)
    + an LR schedule, over the parameters that require grad. Returns (ddp_model, optimizer,
    scheduler). Shared by ``train-mtp``, ``rl`` and the GPU check so that all three step the
    same way."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    t = cfg.train
    bf16 = cfg.model.params_dtype == "bfloat16"
    ddp = DistributedDataParallel(
        model.config,
        DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                      use_distributed_optimizer=False),
        model,
    )
    model.config.finalize_model_grads_func = finalize_model_grads
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=lr, min_lr=min(t.min_lr, lr), weight_decay=t.weight_decay,
                        adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2, clip_grad=t.clip_grad,
                        bf16=bf16, params_dtype=getattr(torch, cfg.model.params_dtype)),
        [ddp],
    )
    warmup = t.warmup_steps if warmup_steps is None else warmup_steps
    sched = OptimizerParamScheduler(
        opt, init_lr=0.0 if warmup else lr, max_lr=lr, min_lr=min(t.min_lr, lr),
        lr_warmup_steps=min(warmup, max(steps - 1, 0)), lr_decay_steps=max(steps, 1), lr_decay_style=decay_style, start_wd=t.weight_decay, end_wd=t.weight_decay,
        wd_incr_steps=max(steps, 1), wd_incr_style="constant",
    )
    return ddp, opt, sched

"""``bebop train-mtp``: train the MTP heads of a (frozen-trunk) model with a chosen objective.

Phases:
  1. optional trunk warm-up (``train.trunk_warmup_steps`` > 0, only for a model with no
     checkpoint to start from, e.g. the tiny CPU default): the trunk trains with next-token CE,
     the MTP heads stay at their initialisation (their acceptance is still logged);
     saved under ``<output_dir>/trunk``;
  2. MTP training: trunk, embedding and output layer frozen; only ``mtp.*`` parameters get
     gradients, from ``mtp.warmup_loss`` for the first ``mtp.warmup_steps`` steps (if set) and
     then from ``mtp.loss`` (e2e_tv, the Bebop recipe). The objective is a function of the step,
     so a resume on either side of the switch continues exactly (one optimizer and LR schedule
     span both stages). With ``mtp.rollout_share`` > 0 a share of its tokens are the trunk's own
     answers to the RL prompts, sampled once before the phase (training/rollout_data.py).

Checkpoints are megatron ``torch_dist`` dist checkpoints (model, optimizer, LR schedule, step,
consumed samples); a rerun with the same ``output_dir`` resumes from the latest one.
Metrics (acceptance α_k, Π α, expected accepted drafts, target entropy, losses, grad norm,
LR) go to TensorBoard under ``<output_dir>/tensorboard`` and to the console.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from bebop_megatron.checkpointing import (CheckpointMismatch, checkpoint_config, latest_checkpoint, load_checkpoint,
                                          load_model_weights, save_checkpoint)
from bebop_megatron.config import Config
from bebop_megatron.data import (build_dataset, eos_id, load_documents, load_tokenizer, microbatches_for_step,
                                 mix_documents)
from bebop_megatron.model import build_model
from bebop_megatron.parallel import initialize_distributed, is_logging_rank
from bebop_megatron.platform import Platform
from bebop_megatron.training.optim import build_optimizer
from bebop_megatron.training.rollout_data import check_rollout_settings, rollout_documents
from bebop_megatron.training.step import train_iteration

log = logging.getLogger("bebop.train_mtp")


@dataclass
class PhaseResult:
    checkpoint: Optional[Path]
    first_metrics: dict
    last_metrics: dict
    steps: int  # the step reached
    steps_run: int  # steps executed by this invocation
    start_step: int
    exited_early: bool = False
    model: Optional[torch.nn.Module] = field(default=None, repr=False)  # the trained (unwrapped) model


def _set_trainable(model, phase: str) -> None:
    """trunk phase: everything but the MTP heads; mtp phase: only the MTP heads."""
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("mtp.") == (phase == "mtp"))


class _Logger:
    """TensorBoard + console on the logging rank; no-ops elsewhere."""

    def __init__(self, root: Path, phase: str, enabled: bool):
        self.enabled, self.phase, self.writer = enabled, phase, None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            self.dir = root / "tensorboard"
            self.writer = SummaryWriter(str(self.dir))

    def scalars(self, step: int, metrics: dict) -> None:
        if self.writer is not None:
            for k, v in metrics.items():
                self.writer.add_scalar(f"{self.phase}/{k}", v, step)
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


# model fields a resume may change: how the same weights are run or initialised, not their shapes
_RUNTIME_MODEL_FIELDS = {"transformer_impl", "fp8", "fp8_recipe", "fp8_margin", "fp8_amax_history_len",
                         "fp8_amax_compute_algo", "fp8_mtp", "params_dtype", "init_method_std",
                         "moe_grouped_gemm", "moe_token_dispatcher_type", "moe_aux_loss_coeff"}


def _check_same_model(cfg: Config, ckpt: Path) -> None:
    """A resume continues the run in ``output_dir``: refuse a checkpoint of another model (say the
    3-head default of before against today's recurrent head), which would load a subset of its
    tensors, or fail deep in the optimizer, instead of saying so."""
    def norm(m: dict) -> dict:  # an MTP width equal to the trunk's (or never saved) is the default: None
        m = dict(m)
        if m.get("mtp_ffn_hidden_size") in (None, m.get("ffn_hidden_size")):
            m["mtp_ffn_hidden_size"] = None
        return m

    saved = norm(checkpoint_config(ckpt).get("model", {}))
    now = norm(cfg.to_dict()["model"])
    diff = sorted(k for k in now if k not in _RUNTIME_MODEL_FIELDS and k in saved and saved[k] != now[k])
    if diff:
        shown = ", ".join(f"{k}: {saved[k]!r} there, {now[k]!r} here" for k in diff[:4])
        raise CheckpointMismatch(f"{ckpt} was written by a run of another model ({shown}); a rerun resumes the "
                                 f"run in train.output_dir: give a fresh output_dir, or remove it (make clean)")


def run_phase(cfg: Config, platform: Platform, phase: str, root: Path, steps: int, lr: float,
              init_from: Optional[Path], fresh_heads: bool = False) -> PhaseResult:
    """One phase (``trunk`` SFT or ``mtp`` head training) from ``init_from`` or its own resume
    point. The MTP phase takes the heads from ``init_from`` where it holds them (it may hold none,
    or fewer than ``model.mtp_num_layers``: those start fresh); ``fresh_heads`` starts them all
    from this run's initialisation (a benchmark's per-seed heads on one shared trunk)."""
    from megatron.core import parallel_state

    model = build_model(cfg, platform)
    _set_trainable(model, phase)
    model.mtp_kl_weight = 0.0
    ddp, opt, sched = build_optimizer(cfg, model, lr, steps)

    step, consumed = 0, 0
    resume_from = latest_checkpoint(root) if cfg.train.resume else None
    if resume_from is not None:
        _check_same_model(cfg, resume_from)
        extra = load_checkpoint(resume_from, ddp, opt)
        step, consumed = int(extra["step"]), int(extra["consumed_samples"])
        if "scheduler" in extra:
            sched.load_state_dict(json.loads(extra["scheduler"]))
        if is_logging_rank():
            log.info("[%s] resumed from %s at step %d", phase, resume_from, step)
    elif init_from is not None:
        is_head = (lambda name: name.startswith("mtp.")) if phase == "mtp" else None
        kept = load_model_weights(init_from, ddp, fresh=is_head if fresh_heads else None, missing_ok=is_head)
        if is_logging_rank():
            log.info("[%s] initialised weights from %s%s", phase, init_from,
                     f" ({len(kept)} MTP tensors start fresh)" if kept else "")

    docs = load_documents(cfg, cfg.model.vocab_size)
    if phase == "mtp" and cfg.mtp.rollout_share > 0:
        # a share of the tokens: the (frozen) trunk's own answers to the RL prompts (training/rollout_data.py)
        share = cfg.mtp.rollout_share
        budget = round(share * sum(len(d) for d in docs))
        rollouts = rollout_documents(cfg, model, budget, root / "rollout_data.json",
                                     trunk=None if resume_from is not None else init_from,
                                     resuming=resume_from is not None)
        docs = mix_documents(docs, rollouts, share, eos_id(load_tokenizer(cfg.data.tokenizer)))
    data = build_dataset(cfg, cfg.model.vocab_size, docs)
    p = cfg.parallel
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    dp_group = parallel_state.get_data_parallel_group()
    logger = _Logger(root, phase, is_logging_rank())
    progress = None
    if is_logging_rank() and cfg.train.progress:
        from tqdm import tqdm

        progress = tqdm(total=steps, initial=step, desc=f"{phase}", unit="step", dynamic_ncols=True)

    first, last = {}, {}
    save_every = cfg.train.save_interval or steps
    ckpt = resume_from
    start_step = step
    exit_at = start_step + cfg.train.exit_interval if cfg.train.exit_interval > 0 else None
    t0 = time.time()
    while step < steps and (exit_at is None or step < exit_at):
        if phase == "mtp":
            loss_type = cfg.mtp.loss_at(step)
            if loss_type != model.mtp_loss_type and is_logging_rank():
                log.info("[mtp] step %d: objective %s", step + 1, loss_type)
            model.mtp_loss_type = loss_type
        if cfg.mtp.kl_warmup_steps > 0 and model.mtp_loss_type in ("tv", "e2e_tv"):
            model.mtp_kl_weight = max(0.0, 1.0 - step / cfg.mtp.kl_warmup_steps)
        mbs = list(microbatches_for_step(data, consumed, p.global_batch_size, p.micro_batch_size, dp_rank, dp_size))
        loss_sum, ntok, grad_norm, ok = train_iteration([ddp], opt, mbs, cfg.data.seq_length)
        sched.step(increment=1)
        step += 1
        consumed += p.global_batch_size
        if step % cfg.train.log_interval == 0 or step == steps or step == 1:
            metrics = {}
            if parallel_state.is_pipeline_last_stage():
                metrics = model.mtp_metrics.reduce(dp_group)
                lm = torch.tensor([loss_sum, ntok], dtype=torch.float64)
                if dp_size > 1:
                    dist.all_reduce(lm, group=dp_group)
                metrics["lm_loss"] = float(lm[0] / max(lm[1], 1))
            metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else 0.0
            metrics["lr"] = opt.param_groups[0]["lr"]
            if phase == "mtp":
                metrics["mtp/objective_is_main"] = float(model.mtp_loss_type == cfg.mtp.loss)
            metrics["steps_per_s"] = 1.0 / max((time.time() - t0) / cfg.train.log_interval, 1e-9)
            t0 = time.time()
            if is_logging_rank():
                logger.scalars(step, metrics)
                if not first:
                    first = dict(metrics)
                last = dict(metrics)
                obj = f" [{model.mtp_loss_type}]" if phase == "mtp" else ""
                msg = (f"[{phase}{obj}] step {step}/{steps} lm_loss {metrics.get('lm_loss', float('nan')):.4f} "
                       f"mtp_loss {metrics.get('mtp/loss', float('nan')):.4f} "
                       f"accept {metrics.get('mtp/accept_rate', float('nan')):.3f} "
                       f"E[acc] {metrics.get('mtp/expected_accepted', float('nan')):.3f} "
                       f"H(p) {metrics.get('mtp/target_entropy', float('nan')):.3f}")
                if progress is not None:
                    progress.write(msg)
                else:
                    log.info(msg)
        if progress is not None:
            progress.update(1)
        if step % save_every == 0 or step == steps or step == exit_at:
            ckpt = save_checkpoint(
                root, step, ddp, opt,
                extra={"consumed_samples": consumed, "phase": phase,
                       "scheduler": json.dumps(sched.state_dict()), "config": json.dumps(cfg.to_dict())},
            )
    if progress is not None:
        progress.close()
    logger.close()
    return PhaseResult(ckpt, first, last, step, step - start_step, start_step, step < steps, model)


def train_mtp(cfg: Config) -> dict:
    """Run the whole ``train-mtp`` job; returns a summary (also written to summary.json)."""
    p = cfg.parallel
    platform = initialize_distributed(p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                                      seed=cfg.train.seed, force_cpu=p.force_cpu,
                                      expert_model_parallel_size=p.expert_model_parallel_size)
    cfg.validate(world_size=dist.get_world_size())
    check_rollout_settings(cfg)
    out = Path(cfg.train.output_dir)
    if is_logging_rank():
        out.mkdir(parents=True, exist_ok=True)
        # the run's first config; every checkpoint also records the config it was written with
        if not (out / "config.json").exists():
            (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))

    init_from = Path(cfg.train.load) if cfg.train.load else None
    if init_from is not None and latest_checkpoint(init_from) is None:
        raise FileNotFoundError(f"train.load={init_from} holds no checkpoint")
    if init_from is not None:
        init_from = latest_checkpoint(init_from)
    summary: dict = {"output_dir": str(out)}
    resuming_mtp = cfg.train.resume and latest_checkpoint(out / "mtp") is not None
    if cfg.train.trunk_warmup_steps > 0 and init_from is None and not resuming_mtp:
        res = run_phase(cfg, platform, "trunk", out / "trunk", cfg.train.trunk_warmup_steps, cfg.train.trunk_lr, None)
        init_from = res.checkpoint
        summary["trunk"] = _phase_summary(res)
        if res.exited_early:
            summary["exited_early"] = True
            return _finish(out, summary)
    res = run_phase(cfg, platform, "mtp", out / "mtp", cfg.train.steps, cfg.train.lr, init_from)
    summary["mtp"] = _phase_summary(res)
    summary["exited_early"] = res.exited_early
    return _finish(out, summary)


def _phase_summary(res: PhaseResult) -> dict:
    return {"checkpoint": str(res.checkpoint), "first": res.first_metrics, "last": res.last_metrics,
            "step": res.steps, "start_step": res.start_step, "steps_run": res.steps_run}


def _finish(out: Path, summary: dict) -> dict:
    summary["tensorboard"] = [str(out / "trunk" / "tensorboard"), str(out / "mtp" / "tensorboard")]
    if is_logging_rank():
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary

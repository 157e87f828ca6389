"""``bebop rl``: asynchronous GRPO on megatron-core with speculative rollouts.

One training step ``i`` (policy version ``i`` -> ``i + 1``):
  1. take the rollout batch of step ``i`` (submitted earlier: in ``async`` mode up to
     ``rl.max_staleness`` versions before, so generation overlaps the previous steps' training;
     in ``sync`` mode only after the previous weight sync);
  2. group-normalised advantages, dynamic-sampling / overlong / Entrocraft keep masks;
  3. forward/backward through megatron-core's pipeline schedule with the GRPO loss (PPO clip with
     clip-higher, token-mean over the whole batch, TIS against the rollout log-probs, optional k3
     KL to a frozen reference) and the MTP strategy's loss; one optimizer step;
  4. weight sync to every rollout server in buckets (pause -> push -> continue; requests caught
     by the pause are re-sent and run entirely under the new version);
  5. metrics to the console, TensorBoard and ``metrics.jsonl``; a checkpoint every
     ``rl.save_interval`` steps (model, optimizer, LR schedule, step, OCC state, RNG).

Rank 0 owns the rollout manager (servers, bridge, rewards) and the logs; every rank trains.
A rerun with the same ``rl.output_dir`` resumes from the latest checkpoint: step ``i`` always
uses the same prompts, so no step is repeated or skipped.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from functools import partial
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from bebop_megatron.checkpointing import latest_checkpoint, load_checkpoint, load_model_weights, save_checkpoint
from bebop_megatron.config import Config, ConfigError, MTPStrategy
from bebop_megatron.data import load_tokenizer
from bebop_megatron.model import build_model
from bebop_megatron.parallel import initialize_distributed
from bebop_megatron.rl.batch import PreparedBatch, prepare_batch
from bebop_megatron.rl.entropy import EntrocraftConfig, EntrocraftController
from bebop_megatron.rl.grpo import policy_loss, tis_weights
from bebop_megatron.rl.metrics import MetricsLogger, read_metrics, rollout_metrics, task_reward_series
from bebop_megatron.rl.policy_forward import RLForward
from bebop_megatron.rl.types import RLMicroBatch, RolloutBatch

log = logging.getLogger("bebop.rl")


# --------------------------------------------------------------------------- helpers


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _device():
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() and \
        dist.get_backend() == "nccl" else torch.device("cpu")


def _broadcast_object(obj, src: int = 0):
    box = [obj]
    dist.broadcast_object_list(box, src=src, device=_device())
    return box[0]


def resolve_init(path: str) -> Path:
    """A train-mtp output dir (its ``mtp`` phase), a run folder or a checkpoint folder."""
    p = Path(path)
    for cand in (p / "mtp", p):
        ck = latest_checkpoint(cand)
        if ck is not None:
            return ck
    raise FileNotFoundError(f"rl.init={path} holds no checkpoint (expected a `bebop train-mtp` output dir "
                            f"or a checkpoint folder)")


def set_trainable(model, strategy: MTPStrategy | str) -> None:
    """The policy (trunk, embedding, output layer) always trains; the MTP heads only for the
    strategies that update them."""
    mtp_trains = MTPStrategy.parse(strategy).trains_mtp
    for name, p in model.named_parameters():
        p.requires_grad_(mtp_trains if name.startswith("mtp.") else True)


def policy_buckets_on_rank0(model, cfg: Config, bucket_bytes: int) -> Optional[list[dict]]:
    """The policy's HF-named weights as buckets on global rank 0 (None elsewhere).

    DP replica 0 gathers its TP shards (a TP collective); with PP > 1 each stage's TP-rank-0
    sends its stage's buckets to rank 0 (all stages are held there at once: fine for the model
    sizes a single process serves; very large models should sync from each stage directly).
    """
    from megatron.core import parallel_state as ps

    from bebop_megatron.convert.hf_megatron import iter_hf_buckets
    from bebop_megatron.convert.layout import Shapes

    mine: list[dict] = []
    if ps.get_data_parallel_rank() == 0:
        shapes = Shapes.from_config(cfg, ps.get_tensor_model_parallel_world_size(), "deepseek")
        for b in iter_hf_buckets(model, shapes, bucket_bytes):
            if ps.get_tensor_model_parallel_rank() == 0:
                mine.append({k: v.detach().cpu() for k, v in b.items()})
    if ps.get_pipeline_model_parallel_world_size() == 1:
        return mine if _rank() == 0 else None
    gathered = [None] * ps.get_pipeline_model_parallel_world_size() if _rank() == 0 else None
    if ps.get_data_parallel_rank() == 0 and ps.get_tensor_model_parallel_rank() == 0:
        dist.gather_object(mine, gathered, dst=0, group=ps.get_pipeline_model_parallel_group())
    if _rank() != 0:
        return None
    return [b for stage in gathered for b in stage]


# --------------------------------------------------------------------------- schedule


def _forward_step(hook, loss_fn, data_iterator, model):
    """One micro-batch through ``model`` with ``hook`` (an :class:`RLForward`, or a partial of one)
    bound to it as the model's ``postprocess_fn``."""
    mb: RLMicroBatch = next(data_iterator)
    device = next(model.parameters()).device
    mb = mb.to(device)
    out = model(mb.tokens, mb.position_ids, None, labels=mb.labels, loss_mask=mb.loss_mask,
                postprocess_fn=partial(hook, batch=mb))
    return out, partial(loss_fn, mb)


def _collect_loss(mb: RLMicroBatch, output):
    """Forward-only: per-token log-probs and entropies (and OCC's depth-1 MTP log-probs), no loss."""
    out = {"logp": output[..., 0].detach(), "entropy": output[..., 1].detach()}
    if output.shape[-1] > 2:
        out["mtp_logp"] = output[..., 2].detach()
    return output.sum() * 0.0, out


def _grpo_loss(r, scale: float, mb: RLMicroBatch, output):
    """GRPO/PPO token loss of one micro-batch, scaled so that the schedule's averaging over micro-batches
    and DDP's over DP ranks give the token-mean over the whole PPO mini-batch.

    Decoupled objective (AReaL): the ratio is taken against the proximal policy ``old_logp`` (the policy
    at the start of this update, from a forward-only pass; None: one on-policy mini-batch, where it
    equals this pass's detached log-probs) and the truncated IS weight min(π_prox / π_behaviour, cap)
    corrects for the rollout engine's behaviour policy (stale async samples, engine numerics)."""
    logp, ent = output[..., 0], output[..., 1]
    mask = mb.loss_mask
    old = mb.old_logp if mb.old_logp is not None else logp.detach()
    isw = tis_weights(old, mb.rollout_logp, r.tis_cap) * mask if r.tis_cap > 0 else None
    out = policy_loss(logp, old, mb.advantages, mask, r.clip_low, r.clip_high, is_weights=isw,
                      ref_logp=mb.ref_logp, kl_coef=r.kl_coef)
    ntok = mask.sum()
    loss = out.loss * ntok.clamp(min=1) * scale
    with torch.no_grad():
        stats = torch.stack([
            out.loss * ntok, ntok, out.clip_frac * ntok, out.approx_kl * ntok, out.kl_ref * ntok,
            (ent * mask).sum(), ((logp - mb.rollout_logp).abs() * mask).sum(),
            (isw * mask).sum() if isw is not None else ntok, out.ratio_mean * ntok,
        ]).double()
        extremes = torch.stack([out.ratio_max, -out.ratio_min]).double() if ntok > 0 else \
            torch.tensor([1.0, -1.0], dtype=torch.float64)
    return loss, {"rl": stats, "ratio_ext": extremes}


STAT_NAMES = ("pg_loss", "tokens", "clip_frac", "approx_kl", "kl_ref", "entropy", "logp_diff_rollout", "tis_weight",
              "ratio_mean")


def run_schedule(model_chunks, hook, microbatches: list[RLMicroBatch], seq_length: int, loss_fn,
                 forward_only: bool) -> list[dict]:
    from bebop_megatron.training.step import run_schedule as schedule

    return schedule(partial(_forward_step, hook, loss_fn), model_chunks, microbatches, seq_length, forward_only)


# --------------------------------------------------------------------------- trainer


class RLTrainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        r, p = cfg.rl, cfg.parallel
        self.platform = initialize_distributed(p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                                               seed=cfg.train.seed, force_cpu=p.force_cpu,
                                               expert_model_parallel_size=p.expert_model_parallel_size)
        cfg.validate(world_size=dist.get_world_size())
        from megatron.core import parallel_state as ps

        self.ps = ps
        self.out = Path(r.output_dir)
        self.is_rank0 = _rank() == 0
        if self.is_rank0:
            self.out.mkdir(parents=True, exist_ok=True)
        self.tok = load_tokenizer(cfg.data.tokenizer)
        self.gamma = cfg.model.mtp_num_layers
        # `none`: plain GRPO without MTP anywhere (the baseline), so no speculative rollouts either
        strategy = self.strategy = r.strategy
        self.speculative = r.speculative and strategy.speculates
        self.record_topk = r.growmtp_topk if strategy.records_topk else 0
        if strategy.needs_speculation and not r.speculative:
            raise ConfigError(f"rl.mtp_strategy={strategy} learns from the verifier: it needs rl.speculative=true")

        # ---- policy
        cfg.mtp.detach_trunk = strategy.detaches_trunk
        self.model = build_model(cfg, self.platform)
        set_trainable(self.model, strategy)
        self.hook = RLForward(strategy, r.temperature, r.online_mtp_loss,
                              r.occ_lambda, r.clip_low, r.clip_high)
        self.hook.occ_max = r.occ_max  # the policy's postprocess_fn (passed to each forward)
        from bebop_megatron.training.optim import build_optimizer

        self.ddp, self.opt, self.sched = build_optimizer(cfg, self.model, r.lr, max(r.steps, 1),
                                                             warmup_steps=r.warmup_steps, decay_style="constant")
        self.step, self.version = 0, 0
        self.resumed_from = latest_checkpoint(self.out)
        self.init_ckpt: Optional[Path] = resolve_init(r.init) if r.init else None
        self.summary: dict = {}
        if self.resumed_from is not None:
            self.load_state_dict(self._state_from_extra(load_checkpoint(self.resumed_from, self.ddp, self.opt)))
            self._log(f"resumed from {self.resumed_from} at step {self.step}")
        elif self.init_ckpt is not None:
            load_model_weights(self.init_ckpt, self.ddp)
            self._log(f"policy initialised from {self.init_ckpt}")
        else:
            self._log("warning: rl.init is not set: RL starts from a randomly initialised policy")
        self.ref = self._build_reference() if r.kl_coef > 0 else None
        self.ref_hook = RLForward(MTPStrategy.NONE, r.temperature) if self.ref is not None else None
        self.entrocraft = None
        if r.entropy_control == "entrocraft":
            self.entrocraft = EntrocraftController(EntrocraftConfig(
                r.entrocraft_low[0], r.entrocraft_low[1], r.entrocraft_high[0], r.entrocraft_high[1],
                r.entrocraft_anneal_steps))
        self.dp_size = ps.get_data_parallel_world_size()
        self.dp_rank = ps.get_data_parallel_rank()
        self.manager = None
        self.servers = []
        self.metric_logger: Optional[MetricsLogger] = None
        self.futures: dict[int, object] = {}
        self.last_buckets: Optional[list[dict]] = None

    # ------------------------------------------------------------------ setup
    def _log(self, msg: str) -> None:
        if self.is_rank0:
            log.info(msg)

    def _build_reference(self):
        """Frozen copy of the initial policy for the KL term."""
        ref = build_model(self.cfg, self.platform)
        src = self.init_ckpt
        if src is not None:
            load_model_weights(src, ref)
        else:
            ref.load_state_dict(self.model.state_dict(), strict=False)
        for p_ in ref.parameters():
            p_.requires_grad_(False)
        return ref.eval()

    def _rng_state(self) -> dict:
        return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}

    def start_rollouts(self) -> None:
        """Rank 0: export the current policy, start (or connect to) the rollout servers."""
        from bebop_megatron.rl.rollout import RolloutManager, build_prompts

        r = self.cfg.rl
        buckets = policy_buckets_on_rank0(self.model, self.cfg, r.sync_bucket_mb << 20)
        if not self.is_rank0:
            return
        self.train_prompts, self.eval_prompts = build_prompts(self.cfg, self.tok)
        self.per_task = len({p.task for p in self.train_prompts if p.task}) > 1  # report each family's reward
        urls = list(r.servers)
        if not urls:
            from bebop_megatron.convert.hf_megatron import write_hf_folder
            from bebop_megatron.convert.layout import Shapes
            from bebop_megatron.rollout.local_servers import start_local_servers

            init_dir = self.out / "rollout_init"
            write_hf_folder(buckets, self.cfg, Shapes.from_config(self.cfg, 1, "deepseek"), init_dir)
            from bebop_megatron.rollout.protocol import server_command

            command = lambda port: server_command(  # noqa: E731
                self.cfg, "bebop", model_path=str(init_dir), port=port, gamma=self.gamma if self.speculative else 0,
                context_length=self.cfg.data.seq_length + self.gamma + 2, max_running=r.server_max_running,
                weight_version=str(self.version), api_key=r.api_key)
            t0 = time.time()
            self.servers = start_local_servers(init_dir, r.num_local_servers, log_dir=self.out / "logs",
                                               threads=r.server_threads, api_key=r.api_key, command=command)
            urls = [s.url for s in self.servers]
            self._log(f"started {len(urls)} local rollout server(s) in {time.time() - t0:.1f}s: {urls}")
        self.manager = RolloutManager(urls, self.cfg, self.tok, self.train_prompts, api_key=r.api_key,
                                      record_topk=self.record_topk)
        from bebop_megatron.rl.weight_sync import WeightPusher

        self.pusher = WeightPusher(self.manager, self.cfg, self.out, expect_mtp=bool(self.gamma))
        if r.servers:  # remote servers hold whatever they were started with: push the policy
            self.pusher.push(buckets, self.version)
        self.last_buckets = buckets

    # ------------------------------------------------------------------ rollouts
    def _submit_ahead(self) -> None:
        """Rank 0: keep the batches this mode allows in flight."""
        r = self.cfg.rl
        ahead = r.max_staleness if r.mode == "async" else 0
        for s in range(self.step, min(self.step + ahead, r.steps - 1) + 1):
            if s not in self.futures:
                self.futures[s] = self.manager.submit(s)

    def _sync_weights(self) -> float:
        t0 = time.time()
        r = self.cfg.rl
        buckets = policy_buckets_on_rank0(self.model, self.cfg, r.sync_bucket_mb << 20)
        if self.is_rank0:
            self.pusher.push(buckets, self.version)  # tensor | disk | distributed (rl/weight_sync.py)
            self.last_buckets = buckets
        return time.time() - t0

    # ------------------------------------------------------------------ one step
    def _local_range(self, n: int) -> tuple[int, int]:
        per = n // self.dp_size
        return self.dp_rank * per, (self.dp_rank + 1) * per

    def _forward_only(self, model, hook: RLForward, prep: PreparedBatch, lo: int, hi: int, keep=None,
                      mtp: bool = False):
        """(logp [N, S], entropy [N, S], depth-1 MTP logp [N, S] or None) of ``model`` with its
        ``hook`` for rows lo..hi on the last stage (zeros elsewhere)."""
        mbs = prep.microbatches(lo, hi, self.cfg.parallel.micro_batch_size, keep)
        was_training = model.training
        model.eval()
        with torch.no_grad():
            outs = run_schedule([model], partial(hook, collect_old_mtp=mtp), mbs, self.cfg.data.seq_length,
                                _collect_loss, forward_only=True)
        if was_training:
            model.train()
        N, S = prep.tokens.shape
        logp, ent = torch.zeros(N, S), torch.zeros(N, S)
        mtp_logp = torch.zeros(N, S) if mtp else None
        if self.ps.is_pipeline_last_stage() and outs:
            logp[lo:hi] = torch.cat([o["logp"].float().cpu() for o in outs])
            ent[lo:hi] = torch.cat([o["entropy"].float().cpu() for o in outs])
            if mtp:
                mtp_logp[lo:hi] = torch.cat([o["mtp_logp"].float().cpu() for o in outs])
        return logp, ent, mtp_logp

    def _global_entropy(self, ent: torch.Tensor, prep: PreparedBatch, lo: int, hi: int) -> float:
        """Token-mean policy entropy over the whole batch's response tokens (all ranks agree)."""
        contrib = self.ps.is_pipeline_last_stage() and self.ps.get_tensor_model_parallel_rank() == 0
        m = prep.loss_mask[lo:hi]
        v = torch.tensor([float((ent[lo:hi] * m).sum()), float(m.sum())] if contrib else [0.0, 0.0],
                         dtype=torch.float64, device=_device())
        dist.all_reduce(v)
        return float(v[0] / v[1].clamp(min=1))

    def train_step(self, samples) -> dict:
        """One PPO/GRPO update on a list of samples (identical on every rank). Returns metrics (rank 0).

        As slime and verl run PPO: the batch is split into ``rl.num_minibatches`` mini-batches, one
        optimizer step each, repeated for ``rl.ppo_epochs``; the old (proximal) log-probs come from a
        forward-only pass of the policy before the first step. With one mini-batch and one epoch the
        proximal policy *is* the current one, so that pass is skipped (same gradient, bit for bit).
        Each DP rank's rows [lo, hi) are cut into the mini-batches, so mini-batch j is the union of
        every rank's j-th slice (whole GRPO groups when the slice is a multiple of the group size)."""
        r, p = self.cfg.rl, self.cfg.parallel
        prep = prepare_batch(samples, r.group_size, self.cfg.data.seq_length, r.normalize_adv_std,
                             r.dynamic_sampling, r.overlong_filter, self.gamma, self.record_topk)
        N = len(samples)
        lo, hi = self._local_range(N)
        n_mb, epochs = max(r.num_minibatches, 1), max(r.ppo_epochs, 1)
        multi = n_mb * epochs > 1
        occ = self.strategy is MTPStrategy.OCC
        metrics: dict = {}
        extra_keep, old_logp, old_mtp, ref_logp = None, None, None, None
        if self.entrocraft is not None or multi:
            logp0, ent, old_mtp = self._forward_only(self.model, self.hook, prep, lo, hi, mtp=occ and multi)
            if multi:
                old_logp = logp0
            if self.entrocraft is not None:
                h = self._global_entropy(ent, prep, lo, hi)
                extra_keep, regime = self.entrocraft.keep(self.step, h, prep.rewards, r.group_size)
                low, high = self.entrocraft.band(self.step)
                metrics.update({"entrocraft/entropy_before": h, "entrocraft/low": low, "entrocraft/high": high,
                                "entrocraft/regime": {"low": -1, "band": 0, "high": 1}[regime]})
        if self.ref is not None:
            ref_logp, _, _ = self._forward_only(self.ref, self.ref_hook, prep, lo, hi)
        keep = prep.keep if extra_keep is None else prep.keep & extra_keep
        tok_rows = (prep.loss_mask * keep.unsqueeze(-1).to(prep.loss_mask.dtype)).sum(-1)  # [N]
        per_rank, m = N // self.dp_size, (N // self.dp_size) // n_mb

        self.hook.occ_begin_batch()
        self.model.train()
        stat_sum = torch.zeros(len(STAT_NAMES), dtype=torch.float64)
        ext = torch.tensor([-math.inf, -math.inf], dtype=torch.float64)
        grad_norms, oks = [], []
        for ep in range(epochs):
            for j in range(n_mb):
                a, b = lo + j * m, lo + (j + 1) * m
                # tokens of the global mini-batch j: every DP rank's j-th slice
                n_tok = float(sum(tok_rows[d * per_rank + j * m: d * per_rank + (j + 1) * m].sum()
                                  for d in range(self.dp_size)))
                mbs = prep.microbatches(a, b, p.micro_batch_size, extra_keep, old_logp, ref_logp, old_mtp)
                scale = len(mbs) * self.dp_size / max(n_tok, 1.0)
                self.hook.occ_moved = ep > 0 or j > 0
                self.ddp.zero_grad_buffer()
                self.opt.zero_grad()
                outs = run_schedule([self.ddp], self.hook, mbs, self.cfg.data.seq_length,
                                    partial(_grpo_loss, r, scale), forward_only=False)
                ok, grad_norm, _ = self.opt.step()
                oks.append(bool(ok))
                if grad_norm is not None:
                    grad_norms.append(float(grad_norm))
                for o in outs:
                    stat_sum += o["rl"].cpu()
                    ext = torch.maximum(ext, o["ratio_ext"].cpu())
        self.sched.step(increment=1)
        self.step += 1
        self.version = self.step

        # ---- metrics: reduce on the last stage, then hand to rank 0
        last = self.ps.is_pipeline_last_stage()
        stats, mtp_m, hook_m, occ_sums = None, {}, {}, None
        if last:
            if old_logp is not None:  # the proximal (pre-update) policy vs the engine: staleness + numerics
                mk = prep.loss_mask[lo:hi] * keep[lo:hi].unsqueeze(-1).to(prep.loss_mask.dtype)
                stat_sum = torch.cat([stat_sum, torch.tensor(
                    [float(((old_logp[lo:hi] - prep.rollout_logp[lo:hi]).abs() * mk).sum()), float(mk.sum())],
                    dtype=torch.float64)])
            else:
                stat_sum = torch.cat([stat_sum, torch.zeros(2, dtype=torch.float64)])
            v = stat_sum.to(_device())
            e = ext.to(_device())
            if self.dp_size > 1:
                dist.all_reduce(v, group=self.ps.get_data_parallel_group())
                dist.all_reduce(e, op=dist.ReduceOp.MAX, group=self.ps.get_data_parallel_group())
            v = v.cpu().tolist()
            stats = v[:len(STAT_NAMES)] + e.cpu().tolist() + v[len(STAT_NAMES):]
            if self.strategy is MTPStrategy.ONLINE:
                mtp_m = self.model.mtp_metrics.reduce(self.ps.get_data_parallel_group())
            hook_m = self.hook.pop_stats()
            occ_sums = torch.tensor(self.hook.occ_sums, dtype=torch.float64, device=_device())
            if occ and self.dp_size > 1:
                dist.all_reduce(occ_sums, group=self.ps.get_data_parallel_group())
            occ_sums = occ_sums.cpu().tolist()
        else:
            self.hook.pop_stats()
        stats, mtp_m, hook_m, occ_sums = _broadcast_object((stats, mtp_m, hook_m, occ_sums),
                                                           src=dist.get_world_size() - 1)
        if occ:
            sxy, sxx, n = occ_sums
            hook_m.pop("occ/coef_batch", None)
            if n >= 1 and sxx / n >= 1e-14:  # this batch's coefficient (all DP ranks' tokens)
                c = max(-self.hook.occ_max, min(self.hook.occ_max, r.occ_lambda * sxy / sxx))
                hook_m["occ/coef_batch"] = c
                prev = self.hook.occ_coef
                # fallback for the next batch's first mini-batch (before the policy has moved)
                self.hook.occ_coef = c if prev is None else r.occ_ema * prev + (1 - r.occ_ema) * c
            hook_m["occ/moved_tokens"] = n
        ntok = max(stats[1], 1.0)
        metrics.update({
            "loss/pg": stats[0] / ntok, "clip_frac": stats[2] / ntok, "approx_kl": stats[3] / ntok,
            "ratio_mean": stats[8] / ntok, "ratio_max": stats[9], "ratio_min": -stats[10],
            "loss/kl_ref": stats[4] / ntok, "policy/entropy": stats[5] / ntok,
            "policy/logp_diff_vs_rollout": stats[6] / ntok, "policy/tis_weight": stats[7] / ntok,
            "loss/tokens": stats[1],
            **({"policy/logp_diff_old_vs_rollout": stats[11] / stats[12]} if stats[12] > 0 else {}),
            "optim/grad_norm": float(np.mean(grad_norms)) if grad_norms else 0.0,
            "optim/steps": float(len(oks)), "optim/lr": self.opt.param_groups[0]["lr"],
            "optim/update_ok": float(all(oks)),
            "data/kept_samples": float(keep.float().mean()),
        })
        metrics.update({f"mtp_online/{k.split('/', 1)[-1]}": v for k, v in mtp_m.items()})
        metrics.update(hook_m)
        return metrics

    # ------------------------------------------------------------------ loop
    def run(self) -> dict:
        """rollout -> train_step -> weight sync -> log -> checkpoint, once per step, until ``rl.steps``
        (or ``rl.exit_interval`` steps in this invocation); held-out evaluation before and after."""
        r = self.cfg.rl
        self.start_rollouts()
        if self.is_rank0:
            self.metric_logger = MetricsLogger(self.out, r.steps, self.step)
            if "reward_before" not in self.summary:
                self._evaluate("before")
            if self.cfg.train.progress:
                self.metric_logger.show_progress(self.step)
        stop_at = min(r.steps, self.step + r.exit_interval) if r.exit_interval > 0 else r.steps
        try:
            while self.step < stop_at:
                t0 = time.time()
                batch = self.next_rollout_batch()
                t_wait, version = time.time() - t0, self.version
                metrics = self.train_step(batch.samples)
                t_train = time.time() - t0 - t_wait
                t_sync = self._sync_weights()
                if self.is_rank0:
                    if r.mode == "async":  # the next batches may start before this step's log is written
                        self._submit_ahead()
                    metrics.update(rollout_metrics(batch, version, self.gamma, per_task=self.per_task))
                    metrics.update({"time/rollout_wait": t_wait, "time/rollout_gen": batch.seconds,
                                    "time/train": t_train, "time/sync": t_sync, "time/step": time.time() - t0})
                    self.metric_logger.log(self.step, metrics, batch.prompt_indices)
                if self.step % max(r.save_interval, 1) == 0 or self.step == stop_at:
                    self.save()
        finally:
            if self.metric_logger is not None:
                self.metric_logger.close()
        self.summary["step"] = self.step
        self.summary["exited_early"] = self.step < r.steps
        if self.is_rank0 and self.step >= r.steps:
            self._evaluate("after")
            self.summary.update(self._final_report())
        self.close()
        if self.is_rank0:
            (self.out / "summary.json").write_text(json.dumps(self.summary, indent=2, default=float))
        return self.summary

    def next_rollout_batch(self) -> RolloutBatch:
        """This step's rollout batch (rank 0 waits for it, every rank receives it)."""
        batch = None
        if self.is_rank0:
            self._submit_ahead()
            batch = self.futures.pop(self.step).result()
        return _broadcast_object(batch, src=0)

    def _evaluate(self, when: str) -> None:
        """Held-out reward, exact answers and draft acceptance (same prompts and seeds each time)."""
        ev = self.manager.evaluate(self.eval_prompts)
        self.summary[f"reward_{when}"], self.summary[f"exact_{when}"] = ev["reward"], ev["exact"]
        self.summary.update({f"eval_{k}_{when}": v for k, v in ev.items() if k not in ("reward", "exact")})
        fams = ev.get("exact_by_task") or {}
        if when == "before":
            per = "".join(f", {t} {x:.3f}" for t, x in fams.items())
            self._log(f"held-out reward before RL: {ev['reward']:.3f}, exact answers {ev['exact']:.3f}{per} "
                      f"({len(self.eval_prompts)} prompts)")
        else:
            before = self.summary.get("eval_exact_by_task_before") or {}
            per = "".join(f", {t} {before.get(t, float('nan')):.3f} -> {x:.3f}" for t, x in fams.items())
            self._log(f"held-out reward after RL: {ev['reward']:.3f}, exact answers "
                      f"{self.summary['exact_before']:.3f} -> {ev['exact']:.3f}{per}; draft acceptance on the same "
                      f"prompts {self.summary.get('eval_accept_rate_before', float('nan')):.3f} -> "
                      f"{ev.get('accept_rate', float('nan')):.3f}")

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """Everything a resumed run needs beyond the model and optimizer: the step (which fixes the
        prompts of every later step), the LR schedule, OCC's coefficient, the RNGs and the summary."""
        return {"step": self.step, "scheduler": self.sched.state_dict(), "occ_coef": self.hook.occ_coef,
                "rng": self._rng_state(), "summary": self.summary}

    def load_state_dict(self, sd: dict) -> None:
        self.step = self.version = int(sd["step"])
        self.sched.load_state_dict(sd["scheduler"])
        if sd.get("occ_coef") is not None:
            self.hook.occ_coef = float(sd["occ_coef"])
        if sd.get("rng"):
            random.setstate(sd["rng"]["python"])
            np.random.set_state(sd["rng"]["numpy"])
            torch.set_rng_state(sd["rng"]["torch"])
        self.summary = dict(sd.get("summary", {}))

    def save(self) -> None:
        """A checkpoint: model + optimizer (sharded), and :meth:`state_dict` in its extra."""
        import pickle

        sd = self.state_dict()
        save_checkpoint(self.out, self.step, self.ddp, self.opt, extra={
            "step": sd["step"], "consumed_samples": self.step * self.cfg.rl.prompts_per_step * self.cfg.rl.group_size,
            "phase": "rl", "scheduler": json.dumps(sd["scheduler"]), "config": json.dumps(self.cfg.to_dict()),
            "occ_coef": sd["occ_coef"], "rng": pickle.dumps(sd["rng"]).hex(),
            "rl_state": json.dumps({"summary": sd["summary"]}, default=float)})

    @staticmethod
    def _state_from_extra(extra: dict) -> dict:
        """:meth:`state_dict` from a checkpoint's extra (our own checkpoints only: the RNG state is a
        pickle, see docs/reliability.md)."""
        import pickle

        blob = extra.get("rng")
        return {"step": int(extra["step"]), "scheduler": json.loads(extra["scheduler"]),
                "occ_coef": extra.get("occ_coef"), "rng": pickle.loads(bytes.fromhex(blob)) if blob else None,
                "summary": json.loads(extra.get("rl_state", "{}")).get("summary", {})}

    def _final_report(self) -> dict:
        from bebop_megatron.rl.report import acceptance_vs_entropy, plot_curves, speculation_benchmark, trend_fit

        out = {}
        rows = read_metrics(self.out)
        out.update(acceptance_vs_entropy(rows, self.out))
        out.update(plot_curves(rows, self.out))
        out["train_reward_trend"] = trend_fit([x["step"] for x in rows], [x["rollout/reward"] for x in rows])
        per_task = task_reward_series(rows)
        if per_task:  # the pooled trend carries the batches' task mix; each family's own trend does not
            out["train_reward_trend_by_task"] = {t: trend_fit(xs, ys) for t, (xs, ys) in per_task.items()}
        t_step = sum(x.get("time/step", 0.0) for x in rows)
        if t_step > 0:  # the share of the trainer's step time spent waiting for rollouts
            out["rollout_share_of_step_time"] = sum(x.get("time/rollout_wait", 0.0) for x in rows) / t_step
            out["rollout_gen_seconds_mean"] = float(np.mean([x.get("time/rollout_gen", 0.0) for x in rows]))
            out["step_seconds_mean"] = t_step / len(rows)
        tr = out["train_reward_trend"]
        if tr.get("slope") is not None:
            self._log(f"training reward trend: {tr['slope']:+.4f} ± {tr['se']:.4f} per step (n={tr['n']})")
        first = rows[0] if rows else {}
        lastn = rows[-max(1, len(rows) // 5):]
        out["train_reward_first_step"] = first.get("rollout/reward")
        out["train_reward_last_steps"] = float(np.mean([x["rollout/reward"] for x in lastn])) if lastn else None
        out["accept_rate_first_step"] = first.get("spec/accept_rate")
        # None without speculative rollouts (rl.speculative false, or no step verified drafts): not a 0 acceptance
        spec_rows = [x for x in lastn if x.get("spec/accept_rate") is not None]
        out["accept_rate_last_steps"] = float(np.mean([x["spec/accept_rate"] for x in spec_rows])) if spec_rows else None
        out["tokens_per_verify_last_steps"] = float(np.mean([x.get("spec/tokens_per_verify", 0) for x in spec_rows])) \
            if spec_rows else None
        if self.cfg.rl.bench_speculation and self.cfg.rl.bench_prompts > 0 and self.gamma and self.last_buckets:
            self._stop_servers()  # the benchmark gets the machine to itself
            out["speculation_benchmark"] = speculation_benchmark(self.cfg, self.last_buckets, self.eval_prompts,
                                                                 self.tok)
        return out

    def _stop_servers(self) -> None:
        if self.manager is not None:
            for f in self.futures.values():
                f.cancel()
            self.futures.clear()
            self.manager.close()
            self.manager = None
        for s in self.servers:
            s.stop()
        self.servers = []

    def close(self) -> None:
        self._stop_servers()
        if self.metric_logger is not None:
            self.metric_logger.close()


def rl_train(cfg: Config) -> dict:
    trainer = RLTrainer(cfg)
    try:
        return trainer.run()
    finally:
        trainer.close()

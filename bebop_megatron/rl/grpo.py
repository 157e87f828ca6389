"""GRPO objective pieces (pure tensor functions; the trainer wires them to megatron-core).

* group-normalised advantages (optionally mean-only, Dr.GRPO-style);
* PPO clipped surrogate with asymmetric clip-higher (DAPO), token-mean over the whole batch;
* truncated importance sampling (TIS) between the trainer's and the rollout engine's log-probs; with
  PPO mini-batches this is AReaL's decoupled objective: the clip is taken against the proximal policy
  (the old policy, recomputed by a forward-only pass before the update) and the truncated IS weight
  π_prox / π_behaviour corrects for the engine's (possibly stale) behaviour policy;
* optional KL to a reference policy (k3 estimator);
* DAPO dynamic sampling (drop groups whose rewards are all equal) and overlong filtering.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def group_advantages(rewards: Tensor, group_size: int, normalize_std: bool = True, eps: float = 1e-6) -> Tensor:
    """rewards [N] laid out group by group (N = groups * group_size) -> advantages [N]."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    r = rewards.double().view(-1, group_size)
    adv = r - r.mean(-1, keepdim=True)
    if normalize_std:
        adv = adv / (r.std(-1, unbiased=False, keepdim=True) + eps)
    return adv.view(-1).to(rewards.dtype if rewards.is_floating_point() else torch.float32)


def dynamic_sampling_keep(rewards: Tensor, group_size: int) -> Tensor:
    """[groups] bool: groups whose rewards are not all equal (they carry a learning signal)."""
    r = rewards.view(-1, group_size)
    return (r.max(-1).values - r.min(-1).values) > 0


def overlong_keep(truncated: Tensor) -> Tensor:
    """Overlong filtering: samples cut at max length get no loss (their reward is unreliable)."""
    return ~truncated.bool()


def tis_weights(train_logp: Tensor, rollout_logp: Tensor, cap: float = 2.0) -> Tensor:
    """Truncated importance weights min(π_train / π_rollout, cap), detached."""
    return torch.exp(train_logp.detach() - rollout_logp).clamp(max=cap)


def kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(π || π_ref): exp(r) - r - 1 with r = log π_ref - log π (>= 0)."""
    r = ref_logp - logp
    return torch.exp(r) - r - 1


@dataclass
class PolicyLossOutput:
    loss: Tensor
    clip_frac: Tensor
    approx_kl: Tensor
    kl_ref: Tensor
    ratio_mean: Tensor | None = None  # π/π_old over masked tokens (1 when nothing is masked in)
    ratio_max: Tensor | None = None
    ratio_min: Tensor | None = None


def policy_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, clip_low: float = 0.2, clip_high: float = 0.28,
    is_weights: Tensor | None = None, ref_logp: Tensor | None = None, kl_coef: float = 0.0,
) -> PolicyLossOutput:
    """Clipped surrogate, token-mean over all response tokens of the batch.

    logp/old_logp/mask: [B, T]; advantages: [B] (broadcast over tokens) or [B, T].
    """
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    mask = mask.to(logp.dtype)
    ratio = torch.exp(logp - old_logp)
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high))
    if is_weights is not None:
        pg = pg * is_weights
    ntok = mask.sum().clamp(min=1)
    loss = (pg * mask).sum() / ntok
    kl_ref = torch.zeros((), dtype=logp.dtype, device=logp.device)
    if ref_logp is not None and kl_coef > 0:
        kl_ref = (kl_k3(logp, ref_logp) * mask).sum() / ntok
        loss = loss + kl_coef * kl_ref
    with torch.no_grad():
        clipped = ((ratio < 1 - clip_low) & (adv < 0)) | ((ratio > 1 + clip_high) & (adv > 0))
        clip_frac = (clipped.to(mask.dtype) * mask).sum() / ntok
        approx_kl = (((ratio - 1) - (logp - old_logp)) * mask).sum() / ntok
        m = mask > 0
        one = torch.ones((), dtype=ratio.dtype, device=ratio.device)
        rd = ratio.detach()
        ratio_mean = (rd * mask).sum() / ntok if bool(m.any()) else one
        ratio_max = rd[m].max() if bool(m.any()) else one
        ratio_min = rd[m].min() if bool(m.any()) else one
    return PolicyLossOutput(loss, clip_frac, approx_kl, kl_ref.detach(), ratio_mean, ratio_max, ratio_min)

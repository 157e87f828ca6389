"""MTP objectives used inside the RL loop (the pre-RL objectives live in ``bebop_megatron.mtp``).

* GrowMTP: depth-coupled acceptance (DCA) loss on the verifier's recorded target distributions,
  kept as top-k probabilities plus one residual bin, with verify-gated masking;
* OCC (Optimal Coefficient Calibration): the coefficient that scales advantages in the MTP policy loss.
"""

from __future__ import annotations

import torch
from torch import Tensor


def topk_residual_alpha(draft_logits: Tensor, topk_ids: Tensor, topk_probs: Tensor) -> Tensor:
    """α = Σ_{v∈top-k} min(p_v, q_v) + min(p_rest, q_rest), with the target p known only on its
    top-k ids and one residual bin (p_rest = 1 - Σ top-k p). Differentiable in ``draft_logits``.

    draft_logits [N, V], topk_ids/topk_probs [N, k].
    """
    q = torch.softmax(draft_logits.float(), -1)
    q_top = q.gather(-1, topk_ids)
    p_top = topk_probs.float()
    p_rest = (1.0 - p_top.sum(-1)).clamp(min=0.0)
    q_rest = (1.0 - q_top.sum(-1)).clamp(min=0.0)
    return torch.minimum(p_top, q_top).sum(-1) + torch.minimum(p_rest, q_rest)


def dca_loss(alpha: Tensor, accept_len: Tensor, floor: float = 1e-6) -> Tensor:
    """GrowMTP depth-coupled acceptance loss, mean over positions.

    alpha [γ, N] per-depth acceptance at N verified positions; accept_len [N] drafts the verifier
    accepted there. Verify-gated masking: depths beyond the first rejection are left out, i.e. the
    sum runs over l = 1..L with L = min(accept_len + 1, γ):  -log Σ_{l≤L} Π_{k≤l} max(α_k, floor).
    """
    gamma = alpha.shape[0]
    cum = torch.cumprod(alpha.clamp(min=floor), dim=0)  # [γ, N]
    L = (accept_len.long() + 1).clamp(max=gamma)
    depth = torch.arange(1, gamma + 1, device=alpha.device).unsqueeze(-1)
    gated = torch.where(depth <= L.unsqueeze(0), cum, torch.zeros_like(cum))
    return -torch.log(gated.sum(0)).mean()


def occ_coefficient(logp_mtp: Tensor, logp_main: Tensor, logp_old_mtp: Tensor, mask: Tensor, lam: float = 1.0,
                    logp_old_main: Tensor | None = None) -> Tensor:
    """OCC's log-probability proxy (arXiv 2605.28184): c = λ · Σ Δ_mtp Δ_main / Σ Δ_mtp², the
    least-squares slope of the main head's log-prob change on the MTP head's, with Δ measured against
    the *old* policy (``logp_old_mtp`` for the MTP head, ``logp_old_main`` for the main head; the
    latter defaults to the former). Ratio of sums in float64, not a mean of per-token ratios; 0 when
    the policy has not moved (detached)."""
    old_main = logp_old_mtp if logp_old_main is None else logp_old_main
    m = mask.double()
    d_mtp = (logp_mtp.detach().double() - logp_old_mtp.double()) * m
    d_main = (logp_main.detach().double() - old_main.double()) * m
    sxx = (d_mtp * d_mtp).sum()
    if float(sxx) <= 1e-14 * float(m.sum().clamp(min=1)):
        return torch.zeros((), dtype=torch.float64)
    return lam * (d_mtp * d_main).sum() / sxx

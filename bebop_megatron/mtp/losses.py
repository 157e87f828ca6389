"""Vocab-parallel MTP objectives: ce, kl, tv and end-to-end tv (Bebop).

Notation (per token position t of a sequence, γ MTP depths k = 1..γ):
  * draft q_k(t)  = softmax of MTP depth k's logits at t (predicts token t+k+1);
  * target p_k(t) = softmax of the *main* head's logits at t+k (same token), detached;
  * α_k(t) = Σ_v min(p_k, q_k) = 1 - TV(p_k, q_k), the probability that rejection sampling
    accepts draft k given the earlier drafts were accepted.

Losses (averaged over valid positions):
  * ``ce``:     Megatron's MTP cross entropy on the shifted labels (token t+k+1 at depth k);
  * ``kl``:     (1/γ) Σ_k KL(p_k || q_k);
  * ``tv``:     (1/γ) Σ_k (1 - α_k);
  * ``e2e_tv``: 1 - (1/γ) Σ_j Π_{i≤j} α_i = 1 - E[accepted drafts]/γ; only at positions where
    all γ targets exist inside the same sequence.

Everything is computed on vocab shards ``[tokens, V/TP]``: softmax statistics (max, Σexp) and the
per-token sums (Σ min(p, q), Σ p·z, ...) are all-reduced over the tensor-parallel group, like
megatron-core's ``vocab_parallel_cross_entropy``; full-vocab logits are never gathered. The
α and KL kernels are autograd Functions with analytic backward so that each depth keeps only
q (fp32) plus a bool mask (tv) or one fp32 gradient buffer (kl) for backward.
Padded vocabulary entries (ids >= true vocab size) are masked out of both distributions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

# ----------------------------------------------------------------------------- helpers


def _tp_size(group) -> int:
    return dist.get_world_size(group) if group is not None and dist.is_initialized() else 1


def _all_reduce(t: Tensor, group, op=dist.ReduceOp.SUM) -> Tensor:
    if _tp_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def _upcast(t: Tensor) -> Tensor:
    """fp16/bf16 -> fp32 for the softmax maths; fp32/fp64 stay as they are."""
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def _pad_mask(local_vocab: int, vocab_start: int, true_vocab_size: Optional[int], device) -> Optional[Tensor]:
    """Bool [V/TP], True where the id is padding (>= true vocab size); None if no padding here."""
    if true_vocab_size is None or vocab_start + local_vocab <= true_vocab_size:
        return None
    ids = torch.arange(vocab_start, vocab_start + local_vocab, device=device)
    return ids >= true_vocab_size


def vocab_parallel_softmax(
    logits: Tensor, group=None, pad_mask: Optional[Tensor] = None
) -> tuple[Tensor, Tensor]:
    """Softmax over the full (sharded) vocabulary. Returns (probs_local >= fp32, log-sum-exp)."""
    z = _upcast(logits)
    if pad_mask is not None:
        z = z.masked_fill(pad_mask, float("-inf"))
    zmax = z.max(dim=-1).values
    _all_reduce(zmax, group, dist.ReduceOp.MAX)
    e = torch.exp(z - zmax.unsqueeze(-1))
    s = e.sum(dim=-1)
    _all_reduce(s, group)
    e.div_(s.unsqueeze(-1))
    return e, zmax + torch.log(s)


@torch.no_grad()
def vocab_parallel_entropy(probs: Tensor, logits: Tensor, lse: Tensor, group=None) -> Tensor:
    """H(p) = lse - Σ p·z per token (p = softmax(z)); zero-probability entries contribute 0."""
    pz = torch.where(probs > 0, probs * _upcast(logits), torch.zeros_like(probs)).sum(-1)
    _all_reduce(pz, group)
    return lse - pz


class _VocabParallelAlpha(torch.autograd.Function):
    """α = Σ_v min(p_v, q_v) with q = softmax(z) over the sharded vocab; grads only into z.

    dα/dz_u = q_u (m_u - Σ_v q_v m_v), m_v = 1[q_v < p_v]; Σ_v q_v m_v is one extra all-reduce
    in backward.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, target_probs: Tensor, group, pad_mask: Optional[Tensor]):
        q, _ = vocab_parallel_softmax(logits, group, pad_mask)
        alpha = torch.minimum(q, target_probs).sum(-1)
        _all_reduce(alpha, group)
        ctx.save_for_backward(q, q < target_probs)
        ctx.group = group
        ctx.dtype = logits.dtype
        return alpha

    @staticmethod
    def backward(ctx, grad_alpha: Tensor):
        q, below = ctx.saved_tensors
        qm = torch.where(below, q, torch.zeros_like(q))
        qm_sum = qm.sum(-1)
        _all_reduce(qm_sum, ctx.group)
        grad = qm.sub_(q * qm_sum.unsqueeze(-1))  # q*m - q*Σqm
        grad.mul_(grad_alpha.unsqueeze(-1))
        return grad.to(ctx.dtype), None, None, None


class _VocabParallelForwardKL(torch.autograd.Function):
    """KL(p || q) per token with q = softmax(z); dKL/dz = q - p (saved as the only buffer)."""

    @staticmethod
    def forward(ctx, logits: Tensor, target_probs: Tensor, group, pad_mask: Optional[Tensor]):
        q, lse = vocab_parallel_softmax(logits, group, pad_mask)
        p = target_probs
        pos = p > 0
        z = _upcast(logits)
        # Σ p log p - Σ p z + lse, skipping p == 0 (incl. padded ids where z may be -inf)
        plogp = torch.where(pos, p * torch.log(torch.where(pos, p, torch.ones_like(p))), torch.zeros_like(p))
        pz = torch.where(pos, p * z, torch.zeros_like(p))
        sums = torch.stack([plogp.sum(-1), pz.sum(-1)])
        _all_reduce(sums, group)
        kl = sums[0] - sums[1] + lse
        ctx.save_for_backward(q.sub_(p))
        ctx.dtype = logits.dtype
        return kl

    @staticmethod
    def backward(ctx, grad_kl: Tensor):
        (q_minus_p,) = ctx.saved_tensors
        return (q_minus_p * grad_kl.unsqueeze(-1)).to(ctx.dtype), None, None, None


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """-log softmax(z)[label] over the sharded vocab (as megatron-core's, with an explicit group
    and padding masked); dCE/dz = q - onehot(label)."""

    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor, group, pad_mask: Optional[Tensor], vocab_start: int):
        q, lse = vocab_parallel_softmax(logits, group, pad_mask)
        local = labels - vocab_start
        here = (local >= 0) & (local < logits.shape[-1])
        idx = torch.where(here, local, torch.zeros_like(local)).unsqueeze(-1)
        z_label = torch.where(here, _upcast(logits).gather(-1, idx).squeeze(-1), torch.zeros_like(lse))
        _all_reduce(z_label, group)
        ctx.save_for_backward(q.scatter_add_(-1, idx, -here.unsqueeze(-1).to(q.dtype)))
        ctx.dtype = logits.dtype
        return lse - z_label

    @staticmethod
    def backward(ctx, grad_ce: Tensor):
        (q_minus_onehot,) = ctx.saved_tensors
        return (q_minus_onehot * grad_ce.unsqueeze(-1)).to(ctx.dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits: Tensor, labels: Tensor, group=None, pad_mask=None, vocab_start: int = 0) -> Tensor:
    """Per-token cross entropy of ``labels`` (global ids) under softmax(logits) over the sharded vocab."""
    return _VocabParallelCrossEntropy.apply(logits, labels, group, pad_mask, vocab_start)


def vocab_parallel_alpha(logits: Tensor, target_probs: Tensor, group=None, pad_mask=None) -> Tensor:
    """Per-token acceptance α = Σ_v min(p, softmax(logits)); differentiable in ``logits``."""
    return _VocabParallelAlpha.apply(logits, target_probs.detach(), group, pad_mask)


def vocab_parallel_forward_kl(logits: Tensor, target_probs: Tensor, group=None, pad_mask=None) -> Tensor:
    """Per-token KL(p || softmax(logits)); differentiable in ``logits``."""
    return _VocabParallelForwardKL.apply(logits, target_probs.detach(), group, pad_mask)


# ------------------------------------------------------------------------ validity


def shifted_valid_mask(loss_mask: Tensor, segment_ids: Optional[Tensor], k: int) -> Tensor:
    """[b, s] bool: position t is a valid depth-k example iff t+k < s, loss_mask[t+k] (the
    token predicted at t+k counts, Megatron's MTP convention) and t, t+k are in one sequence."""
    b, s = loss_mask.shape
    valid = torch.zeros(b, s, dtype=torch.bool, device=loss_mask.device)
    if k >= s:
        return valid
    valid[:, : s - k] = loss_mask[:, k:].bool()
    if segment_ids is not None:
        valid[:, : s - k] &= segment_ids[:, : s - k] == segment_ids[:, k:]
    return valid


def segment_ids_from_position_ids(position_ids: Tensor) -> Tensor:
    """Packed sequences restart position ids at 0: a new segment begins at each 0 after t=0."""
    starts = position_ids == 0
    starts[:, 0] = True
    return starts.long().cumsum(-1)


# ------------------------------------------------------------------------- objective


@dataclass
class MTPLossOutput:
    loss: Tensor  # scalar, differentiable w.r.t. the MTP logits
    alpha: Tensor  # [γ] mean per-depth acceptance α_k over depth-k-valid positions (detached)
    cum_alpha: Tensor  # [γ] mean Π_{i≤k} α_i over positions valid for all γ depths (detached)
    target_entropy: Tensor  # scalar mean entropy of the main-head target (detached)
    num_tokens: Tensor  # number of positions the loss averages over
    extras: dict = field(default_factory=dict)


def mtp_objective(
    main_logits: Tensor,
    mtp_logits: Sequence[Tensor],
    loss_type: str,
    loss_mask: Tensor,
    labels: Optional[Tensor] = None,
    segment_ids: Optional[Tensor] = None,
    tp_group=None,
    vocab_start: int = 0,
    true_vocab_size: Optional[int] = None,
    kl_weight: float = 0.0,
) -> MTPLossOutput:
    """Compute the MTP loss and acceptance statistics.

    Args:
        main_logits: [s, b, V/TP] main-head logits (Megatron layout); used detached as target.
        mtp_logits: γ tensors [s, b, V/TP]; depth k (1-based) at t predicts token t+k+1.
        loss_type: ce | kl | tv | e2e_tv.
        loss_mask: [b, s] mask of the main-head labels.
        labels: [b, s] main-head labels (token t+1 at t); needed for ``ce``.
        segment_ids: [b, s] sequence ids for packed inputs (positions never pair across them).
        tp_group: tensor-parallel group the vocab is sharded over (None: unsharded).
        vocab_start: first vocab id of this rank's shard.
        true_vocab_size: ids >= this are padding and masked out of p and q.
        kl_weight: for tv/e2e_tv, mix in w·KL (warm-up: pure TV has small gradients from a random head).
    """
    gamma = len(mtp_logits)
    if gamma < 1:
        raise ValueError("mtp_objective needs at least one MTP depth")
    s, b, vl = main_logits.shape
    if loss_mask.shape != (b, s):
        raise ValueError(f"loss_mask shape {tuple(loss_mask.shape)} != (b, s) = {(b, s)}")
    device = main_logits.device
    pad_mask = _pad_mask(vl, vocab_start, true_vocab_size, device)

    valids = [shifted_valid_mask(loss_mask, segment_ids, k) for k in range(1, gamma + 1)]
    chain_valid = torch.stack(valids).all(0)  # [b, s]: all γ targets exist

    with torch.no_grad():
        main_z = main_logits.detach()
        target, lse = vocab_parallel_softmax(main_z, tp_group, pad_mask)  # [s, b, V/TP]
        entropy = vocab_parallel_entropy(target, main_z, lse, tp_group)  # [s, b]
        mask_sb = loss_mask.t().bool()
        target_entropy = (entropy * mask_sb).sum() / mask_sb.sum().clamp(min=1)

    def target_for(k: int) -> Tensor:
        # p_k(t) = p_main(t+k); rows past the end are zero (invalid anyway)
        tk = torch.zeros_like(target)
        tk[: s - k] = target[k:]
        return tk

    alphas: list[Tensor] = []  # each [s, b]
    per_depth_loss: list[Tensor] = []
    for k in range(1, gamma + 1):
        logits_k = mtp_logits[k - 1]
        valid_sb = valids[k - 1].t()
        denom = valid_sb.sum().clamp(min=1)
        if loss_type == "ce":
            if labels is None:
                raise ValueError("mtp loss 'ce' needs labels")
            with torch.no_grad():
                alphas.append(vocab_parallel_alpha(logits_k.detach(), target_for(k), tp_group, pad_mask))
            shifted = torch.zeros_like(labels)
            shifted[:, : s - k] = labels[:, k:]
            ce = vocab_parallel_cross_entropy(logits_k, shifted.t(), tp_group, pad_mask, vocab_start)
            per_depth_loss.append((ce * valid_sb).sum() / denom)
            continue
        p_k = target_for(k)
        if loss_type == "kl":
            kl = vocab_parallel_forward_kl(logits_k, p_k, tp_group, pad_mask)
            per_depth_loss.append((kl * valid_sb).sum() / denom)
            with torch.no_grad():
                alphas.append(vocab_parallel_alpha(logits_k.detach(), p_k, tp_group, pad_mask))
            continue
        if loss_type not in ("tv", "e2e_tv"):
            raise ValueError(f"unknown MTP loss {loss_type!r}")
        alpha_k = vocab_parallel_alpha(logits_k, p_k, tp_group, pad_mask)
        alphas.append(alpha_k)
        if loss_type == "tv":
            per_depth_loss.append(((1.0 - alpha_k) * valid_sb).sum() / denom)
        if kl_weight > 0:
            kl = vocab_parallel_forward_kl(logits_k, p_k, tp_group, pad_mask)
            per_depth_loss.append(kl_weight * (kl * valid_sb).sum() / denom)

    alpha_stack = torch.stack(alphas)  # [γ, s, b]
    cum = torch.cumprod(alpha_stack, dim=0)
    chain_sb = chain_valid.t()
    n_chain = chain_sb.sum().clamp(min=1)
    if loss_type == "e2e_tv":
        expected_accept = cum.sum(0) / gamma  # [s, b]
        loss = ((1.0 - expected_accept) * chain_sb).sum() / n_chain
        if per_depth_loss:  # KL warm-up terms
            loss = loss + torch.stack(per_depth_loss).sum() / gamma
        num_tokens = chain_sb.sum()
    else:
        loss = torch.stack(per_depth_loss).sum() / gamma
        num_tokens = valids[0].sum()

    with torch.no_grad():
        alpha_mean = torch.stack(
            [(alpha_stack[k].detach() * valids[k].t()).sum() / valids[k].sum().clamp(min=1) for k in range(gamma)]
        )
        cum_mean = (cum.detach() * chain_sb).sum(dim=(1, 2)) / n_chain
    return MTPLossOutput(loss, alpha_mean, cum_mean, target_entropy, num_tokens)

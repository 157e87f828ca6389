"""What the GRPO step computes on the last pipeline stage, as a ``BebopGPTModel.postprocess_hook``.

For one micro-batch the hook returns ``[b, s, 2]``: the policy's per-token log-probability of the
label (``-`` megatron's vocab-parallel CE, logits divided by the sampling temperature so that it
matches the rollout engine's log-probs) and the per-token entropy (no grad). The MTP strategy's
own loss, when it has one, enters autograd through ``MTPLossAutoScaler`` on that output, the way
megatron-core injects its MTP loss:

* ``online``  - the configured pre-RL objective (e.g. e2e_tv) on the rollout tokens, trunk detached;
* ``growmtp`` - the depth-coupled acceptance loss at the verify steps the rollout servers recorded,
  against the verifier's target distribution (top-k + residual), gated at the first rejection;
  trunk detached;
* ``occ``     - a clipped policy loss on the depth-1 MTP log-probs with advantages scaled by the
  online-calibrated coefficient; the trunk is *not* detached, so it changes both;
* ``frozen`` / ``none`` - no MTP computation at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from bebop_megatron.mtp.losses import _pad_mask, vocab_parallel_entropy, vocab_parallel_softmax
from bebop_megatron.rl.grpo import policy_loss
from bebop_megatron.rl.mtp_objectives import dca_loss, occ_coefficient, topk_residual_alpha


@dataclass
class RLMicroBatch:
    """One micro-batch of rollout samples, [b, s] tensors aligned to label positions."""

    tokens: Tensor
    labels: Tensor
    loss_mask: Tensor  # response tokens of kept samples
    position_ids: Tensor
    advantages: Tensor  # [b]
    rollout_logp: Tensor
    old_logp: Optional[Tensor] = None  # from a forward-only pass (None: this pass's detached log-probs)
    ref_logp: Optional[Tensor] = None
    rec_pos: Optional[Tensor] = None  # [b, R] GrowMTP verify positions (-1: none)
    rec_acc: Optional[Tensor] = None  # [b, R]
    rec_ids: Optional[Tensor] = None  # [b, R, γ, k]
    rec_probs: Optional[Tensor] = None  # [b, R, γ, k]

    def to(self, device) -> "RLMicroBatch":
        return RLMicroBatch(**{k: (v.to(device) if isinstance(v, Tensor) else v) for k, v in vars(self).items()})


class RLForward:
    def __init__(self, strategy: str, temperature: float = 1.0, online_loss: str = "e2e_tv",
                 occ_lambda: float = 1.0, clip_low: float = 0.2, clip_high: float = 0.28):
        self.strategy = strategy
        self.temperature = temperature
        self.online_loss = online_loss
        self.occ_lambda, self.clip_low, self.clip_high = occ_lambda, clip_low, clip_high
        self.batch: Optional[RLMicroBatch] = None  # set by the forward step before each call
        self.mtp_enabled = strategy in ("online", "growmtp", "occ")
        self.occ_coef: Optional[float] = None  # smoothed coefficient from earlier steps
        self.stats: dict[str, list[float]] = {}

    def _note(self, key: str, value: float) -> None:
        self.stats.setdefault(key, []).append(float(value))

    def pop_stats(self) -> dict[str, float]:
        out = {k: sum(v) / len(v) for k, v in self.stats.items() if v}
        self.stats = {}
        return out

    def __call__(self, model, hidden_states, input_ids, position_ids, labels, loss_mask, mtp_kwargs) -> Tensor:
        logits, _ = model.output_layer(hidden_states, weight=model._output_weight())  # [s, b, V/TP]
        if self.temperature != 1.0:
            logits = logits / self.temperature
        tp = model.pg_collection.tp
        pad = _pad_mask(logits.shape[-1], model.vocab_start(logits.shape[-1]), model.true_vocab_size, logits.device)
        with torch.no_grad():
            probs, lse = vocab_parallel_softmax(logits.detach(), tp, pad)
            entropy = vocab_parallel_entropy(probs, logits.detach(), lse, tp).transpose(0, 1)  # [b, s]
            del probs
        mtp_loss = None
        if self.mtp_enabled and model.training and self.batch is not None:
            mtp_hidden = model.run_mtp_block(hidden_states, input_ids, position_ids, **mtp_kwargs)
            if self.strategy == "online":
                mtp_loss = model.mtp_objective(logits, mtp_hidden, self.online_loss, labels, loss_mask,
                                               position_ids).loss
            elif self.strategy == "growmtp":
                mtp_loss = self._growmtp(model, mtp_hidden)
        # megatron's vocab-parallel CE edits the logits in place: everything reading them comes first
        logp = -model.compute_language_model_loss(labels, logits)  # [b, s]
        if self.strategy == "occ" and model.training and self.batch is not None:
            mtp_loss = self._occ(model, mtp_hidden, labels, logp)
        out = torch.stack([logp, entropy.to(logp.dtype)], dim=-1)
        if mtp_loss is not None:
            from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

            out = MTPLossAutoScaler.apply(out, model.config.mtp_loss_scaling_factor * mtp_loss)
        return out

    # ------------------------------------------------------------------ GrowMTP
    def _growmtp(self, model, mtp_hidden: list[Tensor]) -> Tensor:
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        b = self.batch
        zero = sum(h.sum() for h in mtp_hidden) * 0.0  # keeps every MTP parameter in the graph
        valid = b.rec_pos >= 0 if b.rec_pos is not None else None
        if valid is None or not bool(valid.any()):
            self._note("growmtp/positions", 0)
            return zero
        bi, ri = valid.nonzero(as_tuple=True)
        pos = b.rec_pos[bi, ri]
        weight = model.mtp_logits(mtp_hidden).weight
        alphas = []
        for k, h in enumerate(mtp_hidden):
            hk = h[pos, bi].unsqueeze(0)  # [1, N, h]
            lk, _ = model.output_layer(hk, weight=weight)
            lk = gather_from_tensor_model_parallel_region(lk)[0]  # [N, V]
            if model.true_vocab_size is not None:
                lk = lk[:, : model.true_vocab_size]
            if self.temperature != 1.0:
                lk = lk / self.temperature
            alphas.append(topk_residual_alpha(lk, b.rec_ids[bi, ri, k], b.rec_probs[bi, ri, k]))
        alpha = torch.stack(alphas)  # [γ, N]
        acc = b.rec_acc[bi, ri]
        self._note("growmtp/alpha", float(alpha.detach().mean()))
        self._note("growmtp/positions", int(pos.numel()))
        return dca_loss(alpha, acc) + zero

    # ------------------------------------------------------------------ OCC
    def _occ(self, model, mtp_hidden: list[Tensor], labels: Tensor, logp_main: Tensor) -> Tensor:
        """Depth 1 at position t-1 predicts the token the main head predicts at t: a clipped policy
        loss on those MTP log-probs against the rollout (behaviour) log-probs, advantages x c."""
        b = self.batch
        weight = model.mtp_logits(mtp_hidden).weight
        l1, _ = model.output_layer(mtp_hidden[0], weight=weight)  # [s, b, V/TP]
        if self.temperature != 1.0:
            l1 = l1 / self.temperature
        next_labels = torch.roll(labels, -1, dims=1)
        lp_mtp = -model.compute_language_model_loss(next_labels, l1)  # position t-1 -> label at t
        lp_mtp = torch.cat([torch.zeros_like(lp_mtp[:, :1]), lp_mtp[:, :-1]], dim=1)  # aligned to t
        mask = b.loss_mask.clone()
        mask[:, 0] = 0
        c_batch = occ_coefficient(lp_mtp, logp_main, b.rollout_logp, mask, self.occ_lambda)
        c = float(c_batch) if self.occ_coef is None else self.occ_coef
        self._note("occ/coef_batch", float(c_batch))
        self._note("occ/coef", c)
        out = policy_loss(lp_mtp, b.rollout_logp, b.advantages * c, mask, self.clip_low, self.clip_high)
        return out.loss

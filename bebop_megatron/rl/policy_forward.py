"""What the GRPO step computes on the last pipeline stage: the ``postprocess_fn`` of ``BebopGPTModel.forward``.

For one micro-batch the hook returns ``[b, s, 2]``: the policy's per-token log-probability of the
label (``-`` megatron's vocab-parallel CE, logits divided by the sampling temperature so that it
matches the rollout engine's log-probs) and the per-token entropy (no grad). The MTP strategy's
own loss, when it has one, enters autograd through ``MTPLossAutoScaler`` on that output, the way
megatron-core injects its MTP loss:

* ``online``  - the configured pre-RL objective (e.g. e2e_tv) on the rollout tokens, trunk detached;
  both p (main head) and q (MTP heads) at the sampling temperature, as the engine drafts and verifies;
* ``growmtp`` - the depth-coupled acceptance loss at the verify steps the rollout servers recorded,
  against the verifier's target distribution (top-k + residual), gated at the first rejection;
  trunk detached;
* ``occ``     - Optimal Coefficient Calibration (arXiv 2605.28184): a clipped policy loss on the
  depth-1 MTP log-probs (ratio against the MTP head's own old log-probs) with advantages scaled by
  c = λ Σ Δℓ_mtp Δℓ_main / Σ Δℓ_mtp², the least-squares slope of the main head's log-prob change on
  the MTP head's, both measured against the old policy of this update (forward-only pass) once the
  policy has moved (from the second PPO mini-batch on), accumulated over the current batch in
  float64; before that (first mini-batch) the previous batch's coefficient is used (λ at the start).
  The trunk is *not* detached, so it changes both;
* ``frozen`` / ``none`` - no MTP computation at all.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from bebop_megatron.config import MTPStrategy
from bebop_megatron.mtp.losses import _pad_mask, vocab_parallel_entropy, vocab_parallel_softmax
from bebop_megatron.rl.grpo import policy_loss
from bebop_megatron.rl.mtp_objectives import dca_loss, topk_residual_alpha
from bebop_megatron.rl.types import RLMicroBatch  # noqa: F401 (also importable from here)


class RLForward:
    def __init__(self, strategy: MTPStrategy | str, temperature: float = 1.0, online_loss: str = "e2e_tv",
                 occ_lambda: float = 1.0, clip_low: float = 0.2, clip_high: float = 0.28):
        self.strategy = MTPStrategy.parse(strategy)
        self.temperature = temperature
        self.online_loss = online_loss
        self.occ_lambda, self.clip_low, self.clip_high = occ_lambda, clip_low, clip_high
        self.mtp_enabled = self.strategy.trains_mtp
        self.occ_coef: Optional[float] = None  # coefficient of earlier batches (first mini-batch fallback)
        self.occ_max = 10.0
        self.occ_moved = False  # set by the trainer: the policy has moved since the old log-probs
        self.occ_sums = [0.0, 0.0, 0.0]  # Σ Δmtp·Δmain, Σ Δmtp², tokens over the current batch
        self.stats: dict[str, list[float]] = {}

    def _note(self, key: str, value: float) -> None:
        self.stats.setdefault(key, []).append(float(value))

    def occ_begin_batch(self) -> None:
        self.occ_sums = [0.0, 0.0, 0.0]
        self.occ_moved = False

    def occ_current(self) -> Optional[float]:
        """The current batch's coefficient, or None while the policy has not moved measurably."""
        sxy, sxx, n = self.occ_sums
        if n < 1 or sxx / n < 1e-14:
            return None
        return max(-self.occ_max, min(self.occ_max, self.occ_lambda * sxy / sxx))

    def pop_stats(self) -> dict[str, float]:
        out = {k: sum(v) / len(v) for k, v in self.stats.items() if v}
        self.stats = {}
        return out

    def __call__(self, model, hidden_states, input_ids, position_ids, labels, loss_mask, mtp_kwargs, *,
                 batch: Optional[RLMicroBatch] = None, collect_old_mtp: bool = False) -> Tensor:
        """``batch``: the micro-batch of this forward (the MTP strategy's loss needs it; None: no MTP
        loss); ``collect_old_mtp``: a forward-only pass that also returns the depth-1 MTP log-probs (OCC).
        Bind both with ``functools.partial`` and pass the result as ``model(..., postprocess_fn=...)``."""
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
        old_mtp = None
        if self.mtp_enabled and model.training and batch is not None:
            mtp_hidden = model.run_mtp_block(hidden_states, input_ids, position_ids, **mtp_kwargs)
            if self.strategy is MTPStrategy.ONLINE:
                mtp_loss = self._online(model, logits, mtp_hidden, labels, loss_mask, position_ids)
            elif self.strategy is MTPStrategy.GROWMTP:
                mtp_loss = self._growmtp(model, mtp_hidden, batch)
        elif self.strategy is MTPStrategy.OCC and collect_old_mtp and not model.training:
            with torch.no_grad():
                mtp_hidden = model.run_mtp_block(hidden_states, input_ids, position_ids, **mtp_kwargs)
                old_mtp = self._mtp_depth1_logp(model, mtp_hidden, labels)
        # megatron's vocab-parallel CE edits the logits in place: everything reading them comes first
        logp = -model.compute_language_model_loss(labels, logits)  # [b, s]
        if self.strategy is MTPStrategy.OCC and model.training and batch is not None:
            mtp_loss = self._occ(model, mtp_hidden, labels, logp, batch)
        chans = [logp, entropy.to(logp.dtype)] + ([old_mtp.to(logp.dtype)] if old_mtp is not None else [])
        out = torch.stack(chans, dim=-1)
        if mtp_loss is not None:
            from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

            out = MTPLossAutoScaler.apply(out, model.config.mtp_loss_scaling_factor * mtp_loss)
        return out

    # ------------------------------------------------------------------ GrowMTP
    def _growmtp(self, model, mtp_hidden: list[Tensor], b: RLMicroBatch) -> Tensor:
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

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

    # ------------------------------------------------------------------ online
    def _online(self, model, logits, mtp_hidden, labels, loss_mask, position_ids) -> Tensor:
        """The pre-RL objective on rollout tokens with q at the same temperature as p (the engine
        drafts from softmax(q_logits / T) and verifies against softmax(p_logits / T))."""
        from bebop_megatron.mtp.losses import mtp_objective, segment_ids_from_position_ids

        lazy, T = model.mtp_logits(mtp_hidden), self.temperature

        class _Tempered:
            def __len__(self):
                return len(lazy)

            def __getitem__(self, i):
                q = lazy[i]
                return q / T if T != 1.0 else q

        out = mtp_objective(logits, _Tempered(), self.online_loss, loss_mask, labels=labels,
                            segment_ids=segment_ids_from_position_ids(position_ids) if position_ids is not None else None,
                            tp_group=model.pg_collection.tp, vocab_start=model.vocab_start(logits.shape[-1]),
                            true_vocab_size=model.true_vocab_size, kl_weight=model.mtp_kl_weight)
        model.mtp_metrics.update(out)
        return out.loss

    # ------------------------------------------------------------------ OCC
    def _mtp_depth1_logp(self, model, mtp_hidden: list[Tensor], labels: Tensor) -> Tensor:
        """Depth-1 MTP log-prob of each label, aligned to the main head's label positions: depth 1 at
        position t-1 predicts the token the main head predicts at t (0 at t = 0)."""
        weight = model.mtp_logits(mtp_hidden).weight
        l1, _ = model.output_layer(mtp_hidden[0], weight=weight)  # [s, b, V/TP]
        if self.temperature != 1.0:
            l1 = l1 / self.temperature
        next_labels = torch.roll(labels, -1, dims=1)
        lp = -model.compute_language_model_loss(next_labels, l1)  # position t-1 -> label at t
        return torch.cat([torch.zeros_like(lp[:, :1]), lp[:, :-1]], dim=1)

    def _occ(self, model, mtp_hidden: list[Tensor], labels: Tensor, logp_main: Tensor, b: RLMicroBatch) -> Tensor:
        """OCC: clipped policy loss on the depth-1 MTP log-probs, advantages x the calibrated c."""
        lp_mtp = self._mtp_depth1_logp(model, mtp_hidden, labels)
        mask = b.loss_mask.clone()
        mask[:, 0] = 0
        if self.occ_moved and b.old_logp is not None and b.old_mtp_logp is not None:
            with torch.no_grad():
                m = mask.double()
                d_mtp = (lp_mtp.detach().double() - b.old_mtp_logp.double()) * m
                d_main = (logp_main.detach().double() - b.old_logp.double()) * m
                self.occ_sums[0] += float((d_mtp * d_main).sum())
                self.occ_sums[1] += float((d_mtp * d_mtp).sum())
                self.occ_sums[2] += float(m.sum())
        cur = self.occ_current()
        c = cur if cur is not None else (self.occ_coef if self.occ_coef is not None else self.occ_lambda)
        if cur is not None:
            self._note("occ/coef_batch", cur)
        self._note("occ/coef", c)
        old = b.old_mtp_logp if b.old_mtp_logp is not None else lp_mtp.detach()
        out = policy_loss(lp_mtp, old, b.advantages * c, mask, self.clip_low, self.clip_high)
        return out.loss

"""Rollout samples -> trainer tensors: advantages, keep masks and fixed-length micro-batches.

Sequence layout (one sample): ``full = prompt + response``; ``tokens = full`` and
``labels = full[1:]`` padded to ``seq_length`` (the last token stays in ``tokens``: megatron's MTP
layers read the tokens after each position from there); the loss covers the label positions that
hold response tokens, ``[len(prompt) - 1, len(full) - 1)``, where the rollout engine's log-probs
are placed too. GrowMTP verify records keep their absolute position ``t``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from bebop_megatron.rl.grpo import dynamic_sampling_keep, group_advantages, overlong_keep
from bebop_megatron.rl.types import RLMicroBatch, Sample


@dataclass(kw_only=True)
class PreparedBatch:
    rewards: Tensor  # [N]
    advantages: Tensor  # [N]
    keep: Tensor  # [N] bool, after dynamic sampling / overlong filtering
    tokens: Tensor  # [N, S]
    labels: Tensor
    loss_mask: Tensor  # response positions (before keep)
    position_ids: Tensor
    rollout_logp: Tensor
    rec: dict  # GrowMTP record tensors, or {}

    def microbatches(self, lo: int, hi: int, mbs: int, extra_keep: Tensor | None = None,
                     old_logp: Tensor | None = None, ref_logp: Tensor | None = None,
                     old_mtp_logp: Tensor | None = None) -> list[RLMicroBatch]:
        """Samples [lo, hi) (this DP rank's share) as micro-batches of ``mbs``."""
        keep = self.keep if extra_keep is None else self.keep & extra_keep
        mask = self.loss_mask * keep.unsqueeze(-1).to(self.loss_mask.dtype)
        out = []
        for a in range(lo, hi, mbs):
            sl = slice(a, min(a + mbs, hi))
            out.append(RLMicroBatch(
                tokens=self.tokens[sl], labels=self.labels[sl], loss_mask=mask[sl], position_ids=self.position_ids[sl],
                advantages=self.advantages[sl], rollout_logp=self.rollout_logp[sl],
                old_logp=None if old_logp is None else old_logp[sl],
                ref_logp=None if ref_logp is None else ref_logp[sl],
                old_mtp_logp=None if old_mtp_logp is None else old_mtp_logp[sl],
                **{k: v[sl] for k, v in self.rec.items()}))
        return out

    def num_loss_tokens(self, extra_keep: Tensor | None = None) -> int:
        keep = self.keep if extra_keep is None else self.keep & extra_keep
        return int((self.loss_mask * keep.unsqueeze(-1).to(self.loss_mask.dtype)).sum())


def prepare_batch(samples: list[Sample], group_size: int, seq_length: int, normalize_std: bool = True,
                  dynamic_sampling: bool = False, overlong_filter: bool = False, gamma: int = 0,
                  record_topk: int = 0) -> PreparedBatch:
    N, S = len(samples), seq_length
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    adv = group_advantages(rewards, group_size, normalize_std)
    keep = torch.ones(N, dtype=torch.bool)
    if dynamic_sampling:
        keep &= dynamic_sampling_keep(rewards, group_size).repeat_interleave(group_size)
    if overlong_filter:
        keep &= overlong_keep(torch.tensor([s.truncated for s in samples]))
    tokens = torch.zeros(N, S, dtype=torch.long)
    labels = torch.zeros(N, S, dtype=torch.long)
    mask = torch.zeros(N, S)
    rlogp = torch.zeros(N, S)
    for i, s in enumerate(samples):
        full = s.prompt_ids + s.response_ids
        if len(full) - 1 > S:
            raise ValueError(f"sample of {len(full)} tokens does not fit seq_length {S}")
        n = len(full) - 1
        tokens[i, : min(n + 1, S)] = torch.tensor(full[: min(n + 1, S)])
        labels[i, :n] = torch.tensor(full[1:])
        p = len(s.prompt_ids)
        mask[i, p - 1 : n] = 1.0
        if s.response_ids:
            rlogp[i, p - 1 : n] = torch.tensor(s.rollout_logprobs, dtype=torch.float32)
    pos = torch.arange(S).expand(N, S).contiguous()
    rec = {}
    if record_topk and gamma:
        R = max([len(s.spec_records) for s in samples] + [1])
        rec_pos = torch.full((N, R), -1, dtype=torch.long)
        rec_acc = torch.zeros(N, R, dtype=torch.long)
        rec_ids = torch.zeros(N, R, gamma, record_topk, dtype=torch.long)
        rec_probs = torch.zeros(N, R, gamma, record_topk)
        for i, s in enumerate(samples):
            n_tok = min(len(s.prompt_ids) + len(s.response_ids), S)
            for j, r in enumerate(s.spec_records):
                # the gated depths read tokens up to t + min(accepted + 1, γ): all must be in the sequence
                if not (0 <= r["pos"] and r["pos"] + min(r["accepted"] + 1, gamma) < n_tok):
                    continue
                ids, probs = torch.tensor(r["topk_ids"]), torch.tensor(r["topk_probs"], dtype=torch.float32)
                k = min(ids.shape[-1], record_topk)
                rec_pos[i, j], rec_acc[i, j] = r["pos"], r["accepted"]
                rec_ids[i, j, :, :k], rec_probs[i, j, :, :k] = ids[:gamma, :k], probs[:gamma, :k]
        rec = {"rec_pos": rec_pos, "rec_acc": rec_acc, "rec_ids": rec_ids, "rec_probs": rec_probs}
    return PreparedBatch(rewards=rewards, advantages=adv, keep=keep, tokens=tokens, labels=labels, loss_mask=mask,
                         position_ids=pos, rollout_logp=rlogp, rec=rec)

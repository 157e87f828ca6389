"""Accumulates MTP acceptance statistics across micro-batches and reduces them over DP."""

from __future__ import annotations

import torch
import torch.distributed as dist


class MTPMetrics:
    """Per-depth mean acceptance α_k, cumulative Π α_i, target entropy and the MTP loss.

    Each micro-batch contributes its means with equal weight (micro-batches have equal size),
    like Megatron's ``MTPLossLoggingHelper``.
    """

    def __init__(self, gamma: int):
        self.gamma = gamma
        self.reset()

    def reset(self) -> None:
        self._sums = torch.zeros(2 * self.gamma + 2, dtype=torch.float64)
        self._count = 0

    def update(self, out) -> None:
        vec = torch.cat([out.alpha.double().cpu(), out.cum_alpha.double().cpu(),
                         out.target_entropy.detach().double().reshape(1).cpu(),
                         out.loss.detach().double().reshape(1).cpu()])
        self._sums += vec
        self._count += 1

    def reduce(self, group=None) -> dict[str, float]:
        """Averages over micro-batches and the given (data-parallel) group, then resets."""
        sums = torch.cat([self._sums, torch.tensor([float(self._count)], dtype=torch.float64)])
        if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(sums, group=group)
        count = max(sums[-1].item(), 1.0)
        mean = sums[:-1] / count
        g = self.gamma
        result = {f"mtp/alpha_{k + 1}": mean[k].item() for k in range(g)}
        result.update({f"mtp/cum_alpha_{k + 1}": mean[g + k].item() for k in range(g)})
        result["mtp/expected_accepted"] = float(mean[g:2 * g].sum().item())
        result["mtp/accept_rate"] = result["mtp/expected_accepted"] / g
        result["mtp/tokens_per_verify"] = 1.0 + result["mtp/expected_accepted"]
        result["mtp/target_entropy"] = mean[2 * g].item()
        result["mtp/loss"] = mean[2 * g + 1].item()
        self.reset()
        return result

"""Entrocraft: keep the policy's token-mean entropy inside a linearly annealed band.

Above the band only samples whose reward beats their group's mean are trained on (they sharpen the policy, lowering
entropy); below it only those below their group's mean (pushing down confident mistakes raises
entropy); inside it, plain GRPO. The band's bounds move linearly from their start to their end
values over ``anneal_steps`` (reference: high 0.7 -> 0.5, low 0.6 -> 0.4).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor


@dataclass
class EntrocraftConfig:
    low_start: float = 0.6
    low_end: float = 0.4
    high_start: float = 0.7
    high_end: float = 0.5
    anneal_steps: int = 1000

    def __post_init__(self):
        if self.low_start > self.high_start or self.low_end > self.high_end:
            raise ValueError("Entrocraft band: low must not exceed high")


class EntrocraftController:
    def __init__(self, cfg: EntrocraftConfig):
        self.cfg = cfg

    def band(self, step: int) -> tuple[float, float]:
        c = self.cfg
        f = min(max(step / max(c.anneal_steps, 1), 0.0), 1.0)
        return c.low_start + f * (c.low_end - c.low_start), c.high_start + f * (c.high_end - c.high_start)

    def keep(self, step: int, entropy: float, values: Tensor, group_size: Optional[int] = None) -> tuple[Tensor, str]:
        """Per-sample keep mask and the regime (high | low | band).

        As the authors' code does, samples are selected by the sign of their reward relative to its
        GRPO group's mean (``values`` = rewards laid out group by group, with ``group_size``): above
        the band the better-than-group samples, below it the worse-than-group ones; samples equal to
        their group's mean carry no advantage and are dropped in both regimes. Without
        ``group_size`` ``values`` are taken as already group-relative (e.g. advantages)."""
        low, high = self.band(step)
        rel = values.double()
        if group_size is not None:
            g = rel.view(-1, group_size)
            rel = (g - g.mean(-1, keepdim=True)).view(-1)
        if entropy > high:
            return rel > 0, "high"
        if entropy < low:
            return rel < 0, "low"
        return torch.ones_like(values, dtype=torch.bool), "band"


def token_mean_entropy(logits: Tensor, mask: Tensor) -> Tensor:
    """Mean over masked tokens of H(softmax(logits)); logits [..., V], mask [...]."""
    logp = torch.log_softmax(logits.float(), -1)
    h = -(logp.exp() * logp).sum(-1)
    m = mask.to(h.dtype)
    return (h * m).sum() / m.sum().clamp(min=1)

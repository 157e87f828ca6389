"""The data that crosses the RL loop's boundaries, in one place.

* :class:`Prompt`        - one task: the text the policy sees and what the reward checks it against;
* :class:`Sample`        - one scored rollout of a prompt (rollout servers -> trainer);
* :class:`RolloutBatch`  - the samples of one training step, prompt-major (rollout manager -> trainer);
* :class:`RLMicroBatch`  - one micro-batch of trainer tensors (``rl/batch.py`` -> the forward step).

All are dataclasses with keyword-only fields: build them with named arguments. This module
imports no torch at module level (the rollout side uses it without a GPU stack).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from bebop_megatron.rollout.protocol import tokens_from_verify

if TYPE_CHECKING:
    from torch import Tensor


@dataclass(frozen=True, kw_only=True)
class Prompt:
    text: str
    answer: Any  # str (synthetic/math) or tests (code)
    task: str = ""  # its family (synthetic kind, or a JSONL "task"): rewards are also reported per family


@dataclass(kw_only=True)
class Sample:
    """One response to one prompt, as the rollout server produced and the reward scored it."""

    prompt_index: int
    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]  # one per response token, from the rollout engine
    reward: float
    truncated: bool  # cut at rl.max_new_tokens
    weight_version: int  # the policy version that generated it
    text: str = ""
    verify_ct: int = 0  # speculative verify steps
    accepted: int = 0
    proposed: int = 0
    accepted_per_depth: list[int] = field(default_factory=list)
    spec_records: list = field(default_factory=list)  # protocol.SpecRecord (item access like the old dicts)
    reached_per_depth: list[int] = field(default_factory=list)  # drafts at depth k that could be emitted
    # tokens emitted by verify steps; None where the server does not say (SGLang: every token after
    # the prefill's), see protocol.SpecStats
    verify_tokens: int | None = None
    plain_rounds: int = 0  # adaptive γ: rounds decoded plainly
    gamma_sum: int = 0  # Σ γ over the verify steps
    task: str = ""  # the prompt's family (Prompt.task)

    @property
    def emitted_by_verify(self) -> int:
        return tokens_from_verify(self.verify_tokens, len(self.response_ids), self.verify_ct)


def by_task(samples: list[Sample]) -> dict[str, list[Sample]]:
    """Samples grouped by their prompt's family (those without one are left out), families sorted."""
    out: dict[str, list[Sample]] = {}
    for s in samples:
        if s.task:
            out.setdefault(s.task, []).append(s)
    return dict(sorted(out.items()))


@dataclass(kw_only=True)
class RolloutBatch:
    step: int
    samples: list[Sample]  # prompt-major: group g holds samples [g*G, (g+1)*G)
    prompt_indices: list[int]
    seconds: float
    retries: int = 0

    @property
    def generated_tokens(self) -> int:
        return sum(len(s.response_ids) for s in self.samples)


@dataclass(kw_only=True)
class RLMicroBatch:
    """One micro-batch of rollout samples, [b, s] tensors aligned to label positions."""

    tokens: Tensor
    labels: Tensor
    loss_mask: Tensor  # response tokens of kept samples
    position_ids: Tensor
    advantages: Tensor  # [b]
    rollout_logp: Tensor
    old_logp: Optional[Tensor] = None  # from a forward-only pass (None: this pass's detached log-probs)
    old_mtp_logp: Optional[Tensor] = None  # OCC: depth-1 MTP log-probs of the old policy (aligned to labels)
    ref_logp: Optional[Tensor] = None
    rec_pos: Optional[Tensor] = None  # [b, R] GrowMTP verify positions (-1: none)
    rec_acc: Optional[Tensor] = None  # [b, R]
    rec_ids: Optional[Tensor] = None  # [b, R, γ, k]
    rec_probs: Optional[Tensor] = None  # [b, R, γ, k]

    def to(self, device) -> "RLMicroBatch":
        from torch import Tensor

        return RLMicroBatch(**{k: (v.to(device) if isinstance(v, Tensor) else v) for k, v in vars(self).items()})

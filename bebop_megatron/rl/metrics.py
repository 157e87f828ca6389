"""Per-step RL metrics: what a rollout batch says (reward, length, staleness, speculation), and
rank 0's sinks for them (TensorBoard, ``metrics.jsonl``, the console line).

``metrics.jsonl`` is the run's record: the end-of-run report (rl/report.py) and the tests read it,
and a resumed run truncates it to the checkpoint's step so redone steps are not counted twice.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

import numpy as np

from bebop_megatron.rl.types import RolloutBatch, by_task

TASK_REWARD = "rollout/reward/"  # + family: a task mixture's per-family training reward


def rollout_metrics(batch: RolloutBatch, step_version: int, gamma: int, per_task: bool = False) -> dict:
    """Reward, length, staleness and speculation statistics of one rollout batch.

    Acceptance has one definition (issue #11): accepted / drafts that could be emitted (the engine's
    "proposed"); tokens per verify = tokens emitted by verify steps (not the prefill's first token) /
    verify steps; ``spec/accept_depth_k`` is conditional on reaching depth k; ``spec/mean_gamma`` is
    the mean number of drafts per decode round (adaptive γ: plain rounds count as 0). ``per_task``
    (the run's prompts mix several families): also ``rollout/reward/<task>`` for each family in the batch."""
    ss = batch.samples
    rewards = [s.reward for s in ss]
    stale = [step_version - s.weight_version for s in ss]
    m = {"rollout/reward": float(np.mean(rewards)), "rollout/reward_std": float(np.std(rewards)),
         "rollout/response_len": float(np.mean([len(s.response_ids) for s in ss])),
         "rollout/truncated": float(np.mean([s.truncated for s in ss])),
         "rollout/tokens_per_s": batch.generated_tokens / max(batch.seconds, 1e-9),
         "rollout/staleness_mean": float(np.mean(stale)), "rollout/staleness_max": float(max(stale)),
         "rollout/retries": float(batch.retries)}
    if per_task:  # a task mixture: the batch's mix moves the pooled reward, a family's own reward less
        m.update({TASK_REWARD + t: float(np.mean([s.reward for s in g])) for t, g in by_task(ss).items()})
    verify = sum(s.verify_ct for s in ss)
    if verify:
        acc, prop = sum(s.accepted for s in ss), sum(s.proposed for s in ss)
        m["spec/accept_rate"] = acc / max(prop, 1)
        m["spec/tokens_per_verify"] = sum(s.emitted_by_verify for s in ss) / verify
        have_reached = all(len(s.reached_per_depth) >= gamma for s in ss if s.verify_ct)
        reached = verify
        for k in range(gamma):
            at_k = sum(s.accepted_per_depth[k] for s in ss if len(s.accepted_per_depth) > k)
            if have_reached:
                reached = sum(s.reached_per_depth[k] for s in ss if len(s.reached_per_depth) > k)
            m[f"spec/accept_depth_{k + 1}"] = at_k / max(reached, 1)
            reached = at_k
    rounds = verify + sum(s.plain_rounds for s in ss)
    if rounds and gamma:
        # servers that do not report γ (SGLang) ran every round at the full γ
        drafted = sum(s.gamma_sum if (s.gamma_sum or s.plain_rounds) else gamma * s.verify_ct for s in ss)
        m["spec/mean_gamma"] = drafted / rounds
    return m


def task_reward_series(rows: list[dict]) -> dict[str, tuple[list, list]]:
    """family -> (steps, training rewards) from metrics rows, for the steps that drew it; families sorted."""
    fams = sorted({k for r in rows for k in r if k.startswith(TASK_REWARD)})
    return {k.removeprefix(TASK_REWARD): ([r["step"] for r in rows if k in r], [r[k] for r in rows if k in r])
            for k in fams}


def console_line(step: int, total: int, m: dict) -> str:
    """The one line a person watches: reward, length, entropy, speculation, where the time went."""
    return (f"[rl] step {step}/{total} reward {m['rollout/reward']:.3f} "
            f"len {m['rollout/response_len']:.1f} H {m['policy/entropy']:.3f} "
            f"accept {m.get('spec/accept_rate', float('nan')):.3f} "
            f"tok/verify {m.get('spec/tokens_per_verify', float('nan')):.2f} "
            f"stale {m['rollout/staleness_mean']:.2f} "
            f"t(rollout wait/train/sync) {m['time/rollout_wait']:.1f}/{m['time/train']:.1f}/{m['time/sync']:.1f}s")


class MetricsLogger:
    """Rank 0's metric sinks: TensorBoard scalars, ``metrics.jsonl`` and a tqdm progress bar."""

    def __init__(self, out: Path, total_steps: int, start_step: int):
        from torch.utils.tensorboard import SummaryWriter

        self.path = metrics_path(out)
        self.total = total_steps
        self._truncate(start_step)
        self.writer: Optional[SummaryWriter] = SummaryWriter(str(out / "tensorboard"))
        self.bar = None

    def show_progress(self, step: int) -> None:
        """A progress bar from ``step`` (started after the pre-RL evaluation, which has its own line)."""
        from tqdm import tqdm

        self.bar = tqdm(total=self.total, initial=step, desc="rl", unit="step", dynamic_ncols=True)

    def _truncate(self, step: int) -> None:
        """After a resume, drop lines of steps the checkpoint does not contain (they are redone)."""
        if self.path.exists():
            keep = [ln for ln in self.path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= step]
            self.path.write_text("".join(ln + "\n" for ln in keep))

    def log(self, step: int, metrics: dict, prompt_indices: list[int]) -> None:
        for k, v in metrics.items():
            if isinstance(v, (int, float)) and math.isfinite(v):
                self.writer.add_scalar(k, v, step)
        self.writer.flush()
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, "prompt_indices": prompt_indices, **metrics}, default=float) + "\n")
        if self.bar is not None:
            self.bar.update(1)
            self.bar.write(console_line(step, self.total, metrics))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def metrics_path(out: Path) -> Path:
    return out / "metrics.jsonl"


def read_metrics(out: Path) -> list[dict]:
    """The rows of a run folder's metrics.jsonl (none yet: [])."""
    path = metrics_path(out)
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.exists() else []

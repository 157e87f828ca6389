"""Synthetic verifiable tasks that ship with the package (arithmetic, sorting, counting)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from bebop_megatron.data import synthetic_problem


@dataclass(frozen=True)
class SyntheticTask:
    prompt: str
    answer: str


def make_tasks(n: int, seed: int, kind: str = "mixed") -> list[SyntheticTask]:
    rng = random.Random(seed)
    return [SyntheticTask(*synthetic_problem(rng, kind)) for _ in range(n)]


def synthetic_reward(completion: str, answer: str) -> float:
    """1.0 when the text before the first ';' (the answer terminator) equals the answer."""
    return 1.0 if completion.split(";", 1)[0].strip() == answer.strip() else 0.0

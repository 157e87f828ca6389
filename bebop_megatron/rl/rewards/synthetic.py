"""Synthetic verifiable tasks that ship with the package (arithmetic, sorting, counting)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from difflib import SequenceMatcher

from bebop_megatron.data import synthetic_problem_of_kind


@dataclass(frozen=True)
class SyntheticTask:
    prompt: str
    answer: str
    kind: str = ""  # the family (arithmetic, sorting, counting, worked)


def make_tasks(n: int, seed: int, kind: str = "mixed") -> list[SyntheticTask]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        family, prompt, answer = synthetic_problem_of_kind(rng, kind)
        out.append(SyntheticTask(prompt, answer, family))
    return out


def synthetic_reward(completion: str, answer: str) -> float:
    """1.0 when the text before the first ';' (the answer terminator) equals the answer."""
    return 1.0 if completion.split(";", 1)[0].strip() == answer.strip() else 0.0


def synthetic_partial_reward(completion: str, answer: str) -> float:
    """Dense variant for small models: 1.0 for the exact answer, else half the character-level
    similarity of the answer (so a nearly sorted list beats a wrong one); exact match stays the
    only way to full reward."""
    pred, gold = completion.split(";", 1)[0].strip(), answer.strip()
    if pred == gold:
        return 1.0
    return 0.5 * SequenceMatcher(None, pred, gold).ratio()

"""The `worked` synthetic task: long, varied-length verifiable answers for rollout-bound RL jobs."""

from __future__ import annotations

import random

from bebop_megatron.data import CharTokenizer, synthetic_problem
from bebop_megatron.rl.rewards.synthetic import make_tasks, synthetic_reward


def test_worked_arithmetic_is_correct_long_and_varied():
    tok = CharTokenizer()
    rng = random.Random(0)
    lengths = []
    for _ in range(500):
        prompt, answer = synthetic_problem(rng, "worked")
        terms = [int(x) for x in prompt[len("add "):-1].split()]
        acc = terms[0]
        for step, t in zip(answer.split(","), terms[1:]):
            lhs, rhs = step.split("=")
            assert lhs == f"{acc}+{t}" and int(rhs) == acc + t
            acc += t
        lengths.append(len(tok.encode(answer)))
        tok.encode(prompt)  # in the alphabet
    lengths.sort()
    assert lengths[len(lengths) // 2] >= 48 and lengths[0] < 30 and lengths[-1] > 80  # long, with a tail
    t = make_tasks(3, 1, "worked")[0]
    assert synthetic_reward(t.answer + ";", t.answer) == 1.0
    assert "add" not in {synthetic_problem(random.Random(i), "mixed")[0][:3] for i in range(50)}  # opt-in only

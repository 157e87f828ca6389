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


def test_tasks_carry_their_family_and_metrics_report_each_family(tmp_path):
    """A task mixture's reward is reported per family (the batch's mix moves the pooled reward by
    ±0.1 from step to step); the family changes no problem: the same draws give the same prompts."""
    from bebop_megatron.rl.metrics import rollout_metrics
    from bebop_megatron.rl.rollout import by_task, load_prompts
    from bebop_megatron.rl.types import RolloutBatch, Sample

    tasks = make_tasks(40, 3, "counting,sorting")
    rng = random.Random(3)
    assert [(t.prompt, t.answer) for t in tasks] == [synthetic_problem(rng, "counting,sorting") for _ in range(40)]
    assert {t.kind for t in tasks} == {"counting", "sorting"}
    assert all(t.prompt.startswith("count " if t.kind == "counting" else "sort ") for t in tasks)

    def sample(task, reward):
        return Sample(prompt_index=0, prompt_ids=[1], response_ids=[2], rollout_logprobs=[0.0], reward=reward,
                      truncated=False, weight_version=0, task=task)

    ss = [sample("sorting", 1.0), sample("sorting", 0.0), sample("counting", 1.0), sample("", 0.0)]
    m = rollout_metrics(RolloutBatch(step=0, samples=ss, prompt_indices=[0], seconds=1.0), 0, gamma=0, per_task=True)
    assert m["rollout/reward/sorting"] == 0.5 and m["rollout/reward/counting"] == 1.0
    assert m["rollout/reward"] == 0.5 and list(by_task(ss)) == ["counting", "sorting"]
    # a batch that drew one family of a mixture still reports it; a run of one family reports none
    one = rollout_metrics(RolloutBatch(step=0, samples=ss[:2], prompt_indices=[0], seconds=1.0), 0, gamma=0, per_task=True)
    assert one["rollout/reward/sorting"] == 0.5 and "rollout/reward/counting" not in one
    assert not any(k.startswith("rollout/reward/") for k in rollout_metrics(
        RolloutBatch(step=0, samples=ss, prompt_indices=[0], seconds=1.0), 0, gamma=0))

    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "1+1=", "answer": "2", "task": "add"}\n{"prompt": "2+2=", "answer": "4"}\n')
    assert [p.task for p in load_prompts(f, "synthetic")] == ["add", ""]
    f.write_text('{"prompt": "1+1=", "answer": "2", "task": 3}\n')
    import pytest

    from bebop_megatron.data import DataError
    with pytest.raises(DataError, match="'task' must be a string"):
        load_prompts(f, "synthetic")

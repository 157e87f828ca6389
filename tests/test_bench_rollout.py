"""The rollout benchmark's summary (tools/bench_rollout.py): the tokens-per-verify bound of a run
that mixes γ (adaptive) is the mean over its rounds of each γ's bound; a fixed γ keeps its own."""
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_rollout", ROOT / "tools" / "bench_rollout.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop(spec.name, None)


def _run(hist: list[int]) -> dict:
    # α = 0.8 pooled over depths (80 of 100 reached drafts accepted)
    return {"tokens": 100, "wall_s": 1.0, "cpu_s": 1.0, "verify_ct": 10, "verify_tokens": 25, "accepted": 8,
            "proposed": 10, "reached": 100, "accepted_depth": 80, "per_depth_acc": [40, 30, 10],
            "per_depth_reach": [50, 35, 15], "gamma_hist": hist}


def test_bound_of_a_gamma_mix_is_the_rounds_mean(bench):
    b = bench.expected_tokens_per_step
    fixed = bench.summarise("mtp_rejection", 4, [_run([0, 0, 0, 7])], 3)
    assert fixed["alpha"] == pytest.approx(0.8) and fixed["bound"] == pytest.approx(b(0.8, 3))
    # 30 plain rounds (no bound), 10 at γ = 1, 10 at γ = 3: the old code took the bound of round(mean γ) = 2
    mix = bench.summarise("adaptive", 32, [_run([20, 5, 0, 5]), _run([10, 5, 0, 5])], 3)
    assert mix["bound"] == pytest.approx((b(0.8, 1) + b(0.8, 3)) / 2)
    assert mix["bound"] != pytest.approx(b(0.8, 2))
    assert mix["mean_gamma"] == pytest.approx((10 * 1 + 10 * 3) / 50)

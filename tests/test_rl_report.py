"""RL report pieces: reward trend with standard error, acceptance vs entropy at fixed response length,
PNG curves; Entrocraft's group-relative sample selection."""

from __future__ import annotations

import math

import numpy as np
import torch

from bebop_megatron.rl.entropy import EntrocraftConfig, EntrocraftController
from bebop_megatron.rl.report import acceptance_vs_entropy, partial_fit, plot_curves, trend_fit


def test_trend_fit_slope_and_standard_error():
    rng = np.random.default_rng(0)
    x = np.arange(50)
    y = 0.2 + 0.004 * x + rng.normal(0, 0.03, 50)
    f = trend_fit(list(x), list(y))
    xc = x - x.mean()
    se = math.sqrt(((y - y.mean() - f["slope"] * xc) ** 2).sum() / 48 / (xc ** 2).sum())
    assert math.isclose(f["slope"], np.polyfit(x, y, 1)[0], rel_tol=1e-9) and math.isclose(f["se"], se, rel_tol=1e-9)
    assert abs(f["slope"] - 0.004) < 3 * f["se"] and f["slope"] / f["se"] > 3


def test_partial_fit_separates_entropy_from_length():
    """Acceptance driven by length, with entropy correlated to length: the plain slope on entropy is
    large, the partial slope (at fixed length) is ~0."""
    rng = np.random.default_rng(1)
    length = rng.uniform(3, 8, 200)
    ent = 0.1 * length + rng.normal(0, 0.05, 200)
    acc = 0.9 - 0.05 * length + rng.normal(0, 0.01, 200)
    rows = [{"step": i, "policy/entropy": e, "spec/accept_rate": a, "rollout/response_len": ln}
            for i, (e, a, ln) in enumerate(zip(ent, acc, length))]
    part = partial_fit(list(acc), list(ent), list(length))
    assert abs(part["slope_entropy"]) < 3 * part["se_entropy"] + 1e-3
    assert math.isclose(part["slope_length"], -0.05, abs_tol=0.005)
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        out = acceptance_vs_entropy(rows, Path(d))
        assert out["acceptance_vs_entropy_fit"]["slope"] < -0.2  # the naive fit blames entropy
        assert out["acceptance_vs_entropy_partial"]["n"] == 200
        rows[0].update({"entrocraft/low": 0.4, "entrocraft/high": 0.6, "spec/tokens_per_verify": 2.5})
        png = plot_curves(rows, Path(d))["curves_plot"]
        assert Path(png).read_bytes()[:4] == b"\x89PNG"


def test_entrocraft_selects_by_reward_relative_to_group():
    ctl = EntrocraftController(EntrocraftConfig(0.4, 0.4, 0.6, 0.6, 1))
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])  # group 2: all equal -> no signal
    keep_high, regime = ctl.keep(0, 0.9, rewards, group_size=4)
    assert regime == "high" and keep_high.tolist() == [True, False, False, False] + [False] * 4
    keep_low, regime = ctl.keep(0, 0.1, rewards, group_size=4)
    assert regime == "low" and keep_low.tolist() == [False, True, True, True] + [False] * 4
    assert ctl.keep(0, 0.5, rewards, group_size=4)[0].all()

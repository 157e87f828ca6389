"""RL report pieces: reward trend with standard error, acceptance vs entropy at fixed response length,
PNG curves; Entrocraft's group-relative sample selection."""

from __future__ import annotations

import math

import numpy as np
import pytest
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


def test_speculation_benchmark_is_interleaved_medians_on_one_thread(monkeypatch):
    """The end-of-run rollout benchmark: >= 5 interleaved repetitions of plain and speculative
    decoding (in an order shuffled per repetition) on one torch thread (restored afterwards), medians
    and a median per-repetition ratio. It stops where the rollouts stop: a single-token stop as an id,
    a longer one as a stop string (it used to be dropped)."""
    from pathlib import Path

    from bebop_megatron.config import Config
    from bebop_megatron.data import CharTokenizer
    from bebop_megatron.rl.report import speculation_benchmark
    from bebop_megatron.rl.types import Prompt
    from bebop_megatron.rl.weight_sync import rollout_model_for

    cfg = Config.load(Path(__file__).resolve().parents[1] / "configs" / "tiny_cpu.yaml",
                      ["model.num_layers=2", "model.hidden_size=32", "model.ffn_hidden_size=64",
                       "rl.bench_prompts=4", "rl.max_new_tokens=6", 'rl.stop=[";", "=="]'])
    from bebop_megatron.rollout.engine import Engine

    seen = []
    generate = Engine.generate
    monkeypatch.setattr(Engine, "generate", lambda self, ps, params: seen.append(params) or generate(self, ps, params))
    torch.manual_seed(0)
    m = rollout_model_for(cfg)
    params = dict(m.named_parameters())
    bucket = {hf: params[n].detach().clone().normal_(0, 0.2) for n, hf in m.hf_state_dict_names().items()}
    threads = torch.get_num_threads()
    res = speculation_benchmark(cfg, [bucket], [Prompt(text=f"{i}+{i}=", answer=str(2 * i)) for i in range(6)],
                                CharTokenizer(), repeats=2, min_rep_seconds=0.05)
    assert torch.get_num_threads() == threads
    assert res["repeats"] == 5 and res["batch"] == 4 and res["speedup"] > 0
    assert res["no_spec"]["tokens_per_verify"] == 1.0 and res["mtp_spec"]["tokens_per_verify"] >= 1.0
    assert 0.0 <= res["mtp_spec"]["accept_rate"] <= 1.0
    assert res["speedup_adaptive"] > 0 and 0.0 <= res["adaptive"]["mean_gamma"] <= cfg.model.mtp_num_layers
    # interleaved in a shuffled order: every repetition runs each variant once, not always in one order
    assert all(sorted(o) == sorted(["no_spec", "mtp_spec", "adaptive"]) for o in res["orders"])
    assert len({tuple(o) for o in res["orders"]}) > 1
    # a repetition is several batches back to back (one short batch is too short to time), each with
    # other seeds; every variant runs the same ones
    nb = res["batches_per_rep"]
    assert nb >= 2, nb
    timed = seen[-3 * 5 * nb:]  # the timed batches: 5 repetitions x 3 variants x nb
    assert len({params[0].seed for params in timed}) == nb
    semi = CharTokenizer().encode(";")
    assert seen and all(p.stop == ["=="] and p.stop_token_ids == semi for params in seen for p in params)


def test_rollout_metrics_count_only_verify_tokens_and_report_mean_gamma():
    """With adaptive γ some tokens come from plain rounds: tokens per verify counts only the tokens of
    verify steps, and spec/mean_gamma averages γ over all decode rounds (plain rounds are γ = 0)."""
    from bebop_megatron.rl.metrics import rollout_metrics
    from bebop_megatron.rl.types import RolloutBatch, Sample

    def sample(n_tokens, **spec):
        return Sample(prompt_index=0, prompt_ids=[1], response_ids=list(range(n_tokens)),
                      rollout_logprobs=[0.0] * n_tokens, reward=1.0, truncated=False, weight_version=0, **spec)

    # bebop, adaptive: 1 (prefill) + 12 from 4 verify steps + 5 plain rounds = 18 tokens, Σγ = 12
    ada = sample(18, verify_ct=4, accepted=8, proposed=12, verify_tokens=12, plain_rounds=5, gamma_sum=12)
    # SGLang (no verify-token count): 1 + 9 tokens from 3 verify steps at the full γ = 3
    sgl = sample(10, verify_ct=3, accepted=6, proposed=9)
    m = rollout_metrics(RolloutBatch(step=0, samples=[ada, sgl], prompt_indices=[0], seconds=1.0), 0, gamma=3)
    assert m["spec/tokens_per_verify"] == (12 + 9) / 7
    assert m["spec/mean_gamma"] == (12 + 3 * 3) / (4 + 5 + 3)
    assert m["spec/accept_rate"] == 14 / 21


def test_final_report_without_speculation_has_no_acceptance(tmp_path):
    """A run without speculative rollouts (rl.speculative false) logs no spec/* metrics: its summary says
    no acceptance (None, so the CLI prints no line), not an acceptance of 0; with speculation the mean
    covers only the steps that verified drafts."""
    import json
    from pathlib import Path
    from types import SimpleNamespace

    from bebop_megatron.config import Config
    from bebop_megatron.rl.metrics import metrics_path
    from bebop_megatron.rl.trainer import RLTrainer

    cfg = Config.load(Path(__file__).resolve().parents[1] / "configs" / "tiny_cpu.yaml", ["rl.bench_speculation=false"])
    rows = [{"step": i, "rollout/reward": 0.1 * i, "rollout/entropy": 0.5, "rollout/response_len": 5.0,
             "time/step": 1.0, "time/rollout_wait": 0.2, "time/rollout_gen": 0.5} for i in range(1, 11)]
    path = metrics_path(tmp_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(json.dumps(r) for r in rows))
    stub = SimpleNamespace(cfg=cfg, out=tmp_path, _log=lambda *a: None, gamma=0, last_buckets=None)
    out = RLTrainer._final_report(stub)
    assert out["accept_rate_last_steps"] is None and out["tokens_per_verify_last_steps"] is None
    assert out["rollout_share_of_step_time"] == pytest.approx(0.2)

    # the last fifth (2 steps): one verified drafts, one did not (an adaptive run's all-plain step)
    rows[-1].update({"spec/accept_rate": 0.8, "spec/tokens_per_verify": 3.0})
    path.write_text("\n".join(json.dumps(r) for r in rows))
    out = RLTrainer._final_report(stub)
    assert out["accept_rate_last_steps"] == 0.8 and out["tokens_per_verify_last_steps"] == 3.0

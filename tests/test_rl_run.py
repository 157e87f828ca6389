"""`bebop rl` end to end on CPU: local rollout servers, sync and async modes, exit/resume and
kill/resume with no duplicated or skipped steps and the same data order."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from bebop_megatron.config import Config
from bebop_megatron.data import load_tokenizer
from bebop_megatron.rl.rollout import PromptSource, build_prompts
from tests.tiny_models import TINY_MODEL

ROOT = Path(__file__).resolve().parents[1]


def write_config(tmp: Path, **rl) -> Path:
    raw = {
        "model": {**TINY_MODEL, "vocab_size": 64, "make_vocab_size_divisible_by": 64,
                  "max_position_embeddings": 64, "tie_word_embeddings": True, "transformer_impl": "local"},
        "parallel": {"micro_batch_size": 8, "global_batch_size": 8},
        "data": {"seq_length": 40},
        "train": {"progress": False, "seed": 5},
        "rl": {"output_dir": str(tmp / "run"), "steps": 4, "lr": 1e-3, "prompts_per_step": 2, "group_size": 4,
               "max_new_tokens": 6, "stop": [";"], "task": "counting", "eval_prompts": 4, "save_interval": 2,
               "bench_speculation": False, **rl},
    }
    path = tmp / "rl.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def bebop_rl(config: Path, *overrides: str, timeout: float = 400) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "bebop_megatron.cli", "rl", "--config", str(config)]
    for o in overrides:
        cmd += ["--set", o]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def metrics(run: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.strip()]


def expected_prompts(config: Path, steps: int) -> list[list[int]]:
    cfg = Config.load(config)
    train, _ = build_prompts(cfg, load_tokenizer(cfg.data.tokenizer))
    src = PromptSource(train, cfg.train.seed)
    return [src.indices_for_step(s, cfg.rl.prompts_per_step) for s in range(steps)]


def test_sync_run_exit_and_resume(tmp_path):
    cfg = write_config(tmp_path, mode="sync", exit_interval=2)
    r1 = bebop_rl(cfg)
    assert r1.returncode == 0, r1.stderr[-3000:]
    assert "Stopped at step 2/4" in r1.stdout
    r2 = bebop_rl(cfg)
    assert r2.returncode == 0, r2.stderr[-3000:]
    assert "RL done: 4 steps" in r2.stdout, r2.stdout
    rows = metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["prompt_indices"] for r in rows] == expected_prompts(cfg, 4)
    assert all(r["rollout/staleness_max"] == 0 for r in rows)  # sync: always the current policy
    for r in rows:  # speculative rollouts with the configured γ report acceptance
        assert 0 <= r["spec/accept_rate"] <= 1 and r["spec/tokens_per_verify"] >= 1
        assert r["loss/tokens"] > 0 and r["optim/update_ok"] == 1.0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert "reward_before" in summary and "reward_after" in summary
    assert (tmp_path / "run" / "acceptance_vs_entropy.svg").exists()
    assert list((tmp_path / "run" / "tensorboard").glob("events.*"))


def test_async_run_respects_staleness_bound(tmp_path):
    cfg = write_config(tmp_path, mode="async", max_staleness=1, steps=4, mtp_strategy="online",
                       task="counting,sorting", eval_prompts=8)
    r = bebop_rl(cfg)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = metrics(tmp_path / "run")
    assert [x["step"] for x in rows] == [1, 2, 3, 4]
    assert max(x["rollout/staleness_max"] for x in rows) <= 1
    assert any(x["rollout/staleness_max"] == 1 for x in rows[1:])  # generation did overlap training
    assert all("mtp_online/loss" in x for x in rows)
    # a task mixture is also reported per family: held-out exact answers, the console, the trend
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    _, evals = build_prompts(Config.load(cfg), load_tokenizer("char"))
    fams = {p.task for p in evals}
    assert fams == {"counting", "sorting"}
    assert set(summary["eval_exact_by_task_before"]) == set(summary["eval_exact_by_task_after"]) == fams
    assert "per family: counting" in r.stdout
    steps_of = {f: [x["step"] for x in rows if f"rollout/reward/{f}" in x] for f in fams}
    assert all(any(f"rollout/reward/{f}" in x for f in fams) for x in rows)  # every step, whatever it drew
    assert set(summary["train_reward_trend_by_task"]) == fams
    assert all(summary["train_reward_trend_by_task"][f]["n"] == len(steps_of[f]) for f in fams)


def test_killed_trainer_resumes_without_duplicated_or_skipped_steps(tmp_path):
    cfg = write_config(tmp_path, mode="async", steps=6, save_interval=2)
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "bebop_megatron.cli", "rl", "--config", str(cfg)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.time() + 300
    try:
        while time.time() < deadline:
            if (run / "metrics.jsonl").exists() and any(r["step"] == 3 for r in metrics(run)):
                break
            assert proc.poll() is None, "the run ended before it could be killed"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)  # mid-step 4 (after step 3's log; checkpoint at step 2)
        proc.wait()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert max(r["step"] for r in metrics(run)) >= 3
    r = bebop_rl(cfg)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = metrics(run)
    assert [x["step"] for x in rows] == [1, 2, 3, 4, 5, 6]  # step 3 was redone once, nothing skipped
    assert [x["prompt_indices"] for x in rows] == expected_prompts(cfg, 6)
    assert "resumed from" in r.stderr


def expected_reward(hf_dir: Path, n: int = 256) -> float:
    """Mean probability, under the policy at temperature 1, of sampling exactly the right answer
    (answer + ';') on held-out counting prompts: the exact expected reward, without sampling noise."""
    import torch
    from transformers import AutoModelForCausalLM

    from bebop_megatron.data import CharTokenizer
    from bebop_megatron.rl.rewards.synthetic import make_tasks

    tok, model = CharTokenizer(), AutoModelForCausalLM.from_pretrained(str(hf_dir)).float().eval()
    total = 0.0
    with torch.no_grad():
        for t in make_tasks(n, 4242, "counting"):
            p, a = tok.encode(t.prompt), tok.encode(t.answer + ";")
            ids = torch.tensor([p + a])
            logp = torch.log_softmax(model(ids).logits[0, :-1].double(), -1)
            total += float(logp[torch.arange(len(p) - 1, len(p) + len(a) - 1), torch.tensor(a)].sum().exp())
    return total / n


def test_rl_improves_reward_on_synthetic_task(tmp_path):
    """SFT warm-up on the counting family (train-mtp's trunk phase), then GRPO: the policy's expected
    reward on held-out prompts rises."""
    from bebop_megatron.convert.hf_megatron import megatron_to_hf

    tiny = ROOT / "configs" / "tiny_cpu.yaml"
    sft = subprocess.run([sys.executable, "-m", "bebop_megatron.cli", "train-mtp", "--config", str(tiny),
                          "--set", f"train.output_dir={tmp_path / 'sft'}", "--set", "train.progress=false",
                          "--set", "data.synthetic_task=counting", "--set", "train.trunk_warmup_steps=300",
                          "--set", "train.steps=10", "--set", "mtp.warmup_steps=5",
                          "--set", "mtp.rollout_share=0"], cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert sft.returncode == 0, sft.stderr[-3000:]
    r = bebop_rl(tiny, f"rl.init={tmp_path / 'sft'}", f"rl.output_dir={tmp_path / 'rl'}", "train.progress=false",
                 "rl.task=counting", "rl.steps=24", "rl.lr=0.0005", "rl.save_interval=24", "rl.eval_prompts=16",
                 "rl.mtp_strategy=none", "rl.bench_speculation=false", "rl.num_minibatches=1", timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = metrics(tmp_path / "rl")
    assert sum(x["rollout/reward"] for x in rows[:8]) / 8 > 0.05  # the warm-up gives a non-zero start
    megatron_to_hf(tmp_path / "rl", tmp_path / "rl_hf")
    before = expected_reward(tmp_path / "rl" / "rollout_init")  # the policy the run started from
    after = expected_reward(tmp_path / "rl_hf")
    assert after > before + 0.015, (before, after, [round(x["rollout/reward"], 3) for x in rows])


def test_disk_weight_sync(tmp_path):
    """rl.weight_sync=disk (multi-node layouts): one HF folder per version, servers load it, old ones go."""
    cfg = write_config(tmp_path, mode="sync", steps=3, weight_sync="disk", save_interval=3)
    r = bebop_rl(cfg)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = metrics(tmp_path / "run")
    assert [x["step"] for x in rows] == [1, 2, 3]
    assert all(x["rollout/staleness_max"] == 0 for x in rows)  # the servers really switched versions
    kept = sorted(p.name for p in (tmp_path / "run" / "weights").iterdir())
    assert kept == ["v2", "v3"]

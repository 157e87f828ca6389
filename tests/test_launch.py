"""Launchers: the Slurm generator's layout and commands, torchrun.sh's dry run, and a 2-process
torchrun (gloo) run of `bebop rl` with TP=2."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bebop_megatron.config import Config, ConfigError
from tests.test_rl_run import metrics, write_config

ROOT = Path(__file__).resolve().parents[1]


def _slurm():
    spec = importlib.util.spec_from_file_location("launch_slurm", ROOT / "launch" / "slurm.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["launch_slurm"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_expand_nodelist():
    assert _slurm().expand_nodelist("gpu[01-03,07],cpu1") == ["gpu01", "gpu02", "gpu03", "gpu07", "cpu1"]


def test_slurm_dry_run_two_trainer_nodes_one_rollout_node(tmp_path):
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(f"base: {ROOT / 'configs' / 'qwen3_8b.yaml'}\n"
                        "launch: {trainer_nodes: 2, rollout_nodes: 1, rollout_tp: 2, partition: h100}\n"
                        "parallel: {micro_batch_size: 1}\n")
    out = subprocess.run([sys.executable, str(ROOT / "launch" / "slurm.py"), "--config", str(cfg_path), "--dry-run",
                          "--nodelist", "gpu[01-03]"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("[")]
    rollout = [ln for ln in lines if ln.startswith("[rollout@")]
    trainer = [ln for ln in lines if ln.startswith("[trainer@")]
    # 1 rollout node with 8 GPUs / rollout_tp 2 = 4 SGLang servers, with the config's MTP flags
    assert len(rollout) == 4 and all(ln.startswith("[rollout@gpu03]") for ln in rollout)
    assert "CUDA_VISIBLE_DEVICES=6,7" in rollout[3] and "--tp-size 2" in rollout[3] and "--port 30003" in rollout[3]
    assert all("--speculative-num-steps 3" in ln and "--speculative-num-draft-tokens 4" in ln and
               "--speculative-eagle-topk 1" in ln for ln in rollout)
    # 2 trainer nodes, one torchrun each, c10d rendezvous at the first node, all 8 GPUs per node
    assert [ln.split("]")[0] for ln in trainer] == ["[trainer@gpu01", "[trainer@gpu02"]
    for ln in trainer:
        assert "torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint gpu01:" in ln
        assert "rl.servers=[" + ",".join(f"http://gpu03:{30000 + i}" for i in range(4)) + "]" in ln
        assert "rl.weight_sync=disk" in ln
    script = out.stdout
    for needle in ("#SBATCH --nodes=3", "#SBATCH --gpus-per-node=8", "#SBATCH --partition=h100",
                   "#SBATCH --requeue", "scontrol show hostnames", "export MASTER_ADDR=${NODES[0]}",
                   "NCCL_", "until curl -sf"):
        assert needle in script, needle
    assert shutil.which("bash")
    # the generated script is valid bash
    f = tmp_path / "rl.sbatch"
    f.write_text(script.split("# commands, node by node:")[0])
    assert subprocess.run(["bash", "-n", str(f)]).returncode == 0


def test_slurm_rejects_layouts_that_do_not_fit():
    mod = _slurm()
    cfg = Config.load(ROOT / "configs" / "qwen3_8b_4x8.yaml")
    with pytest.raises(ConfigError, match="needs 4 nodes"):
        mod.plan(cfg, "c.yaml", [], ["a", "b", "c"])
    assert mod.main(["--config", str(ROOT / "configs" / "qwen3_8b_4x8.yaml"), "--dry-run",
                     "--set", "launch.rollout_tp=3"]) == 2


def test_shipped_sbatch_is_current(tmp_path):
    """launch/slurm/rl.sbatch is what the generator writes for configs/qwen3_8b_4x8.yaml."""
    out = tmp_path / "rl.sbatch"
    assert _slurm().main(["--config", "configs/qwen3_8b_4x8.yaml", "--output", str(out)]) == 0
    assert out.read_text() == (ROOT / "launch" / "slurm" / "rl.sbatch").read_text()


def test_torchrun_sh_dry_run():
    out = subprocess.run(["bash", str(ROOT / "launch" / "torchrun.sh"), "configs/qwen3_4b.yaml"], cwd=ROOT,
                         capture_output=True, text=True, env={**os.environ, "DRY_RUN": "1",
                                                              "PYTHON": sys.executable})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert sum(ln.startswith("rollout CUDA_VISIBLE_DEVICES=") for ln in lines) == 4
    trainer = [ln for ln in lines if ln.startswith("trainer ")]
    assert len(trainer) == 1 and "CUDA_VISIBLE_DEVICES=0,1,2,3 torchrun --nnodes 1 --nproc-per-node 4" in trainer[0]


def test_torchrun_two_process_rl_tp2(tmp_path):
    cfg = write_config(tmp_path, mode="async", steps=2, save_interval=2)
    torchrun = Path(sys.executable).with_name("torchrun")
    out = subprocess.run([str(torchrun), "--nproc-per-node", "2", "--master-port", str(_port()), "-m",
                          "bebop_megatron.cli", "rl", "--config", str(cfg),
                          "--set", "parallel.tensor_model_parallel_size=2", "--set", "parallel.force_cpu=true"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "RL done: 2 steps" in out.stdout
    rows = metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["loss/tokens"] > 0 for r in rows)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["step"] == 2


def _port() -> int:
    from bebop_megatron.parallel import free_port

    return free_port()


def test_gpu_check_cpu_smoke(tmp_path):
    """tools/gpu_check.py's code paths at toy sizes on CPU (the real run needs one GPU)."""
    out = tmp_path / "gpu_check.json"
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--cpu-smoke", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    res = json.loads(out.read_text())
    assert all(v["ok"] for v in res["losses"].values())
    assert res["train"]["bf16"]["tokens_per_s"] > 0 and res["train"]["bf16"]["mfu"] > 0
    assert set(res["rollout"]) == {"batch_1", "batch_4", "device_check"}
    dc = res["rollout"]["device_check"]  # the engine's caches live where the model is
    assert dc["cache_device"] == dc["engine_device"] == "cpu" and dc["greedy_spec_equals_plain_fraction"] == 1.0
    assert res["rollout"]["batch_4"]["mtp"]["tokens_per_verify"] >= 1
    assert res["e2e_tv_vs_ce"]["time_ratio_tv_over_ce"] > 0
    # without a GPU the real run refuses clearly
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py")], cwd=ROOT, capture_output=True,
                       text=True, timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 2 and "no CUDA device" in r.stderr

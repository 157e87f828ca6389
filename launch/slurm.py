#!/usr/bin/env python
"""Write (and optionally submit) a Slurm batch script for multi-node async RL.

    python launch/slurm.py --config configs/qwen3_8b_4x8.yaml --output launch/slurm/rl.sbatch
    python launch/slurm.py --config configs/qwen3_8b_4x8.yaml --dry-run --nodelist 'gpu[01-04]'
    python launch/slurm.py --config ... --submit          # sbatch the written file

Layout (from the config's ``launch`` section): the first ``trainer_nodes`` nodes of the allocation
run the Megatron trainer (``torchrun --nnodes N --rdzv-backend c10d``, TP/PP/DP over NCCL,
``MASTER_ADDR`` = the first node); the next ``rollout_nodes`` nodes run one rollout server per
``rollout_tp`` GPUs (SGLang with MTP speculation flags from the config, or ``bebop serve``); the
trainer's rollout bridge routes requests over all of them (least-loaded, with failover). The run
directory is fixed (``rl.output_dir``), so a requeued job resumes from the latest checkpoint.
``NCCL_*``, ``UCX_*`` and ``FI_*`` variables of the submitting shell are passed through.
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bebop_megatron.config import Config, ConfigError  # noqa: E402
from bebop_megatron.rollout.protocol import server_command  # noqa: E402

PASS_THROUGH = ("NCCL_", "UCX_", "FI_", "TORCH_NCCL_", "CUDA_DEVICE_MAX_CONNECTIONS")


@dataclass
class Launch:
    role: str  # rollout | trainer
    node: str  # a node name, or a shell expression resolved at run time
    command: list[str]
    env: dict

    def shell(self) -> str:
        env = " ".join(f"{k}={shlex.quote(str(v))}" for k, v in self.env.items())
        return (env + " " if env else "") + " ".join(_q(c) for c in self.command)


def _dq(s: str) -> str:
    """Embed in a double-quoted bash string (variables still expand)."""
    return s.replace("\\", "\\\\").replace('"', '\\"')


def _q(s: str) -> str:
    """Quote for bash but keep $VARS / $(...) expandable at run time."""
    return s if re.fullmatch(r"[\w./:=,@%+-]*(\$\{?\w+\}?[\w./:=,@%+-]*)*", s) else shlex.quote(s)


def expand_nodelist(spec: str) -> list[str]:
    """``gpu[01-03,07],cpu1`` -> [gpu01, gpu02, gpu03, gpu07, cpu1] (what ``scontrol show hostnames`` does)."""
    out = []
    for m in re.finditer(r"([^,\[]+)(?:\[([^\]]+)\])?", spec):
        prefix, ranges = m.group(1), m.group(2)
        if not ranges:
            out.append(prefix)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            hi = hi or lo
            for i in range(int(lo), int(hi) + 1):
                out.append(f"{prefix}{i:0{len(lo)}d}")
    return out


def rollout_command(cfg: Config, port: int) -> list[str]:
    ln = cfg.launch
    engine = "sglang" if ln.rollout_engine == "sglang" else "bebop"
    return server_command(cfg, engine, model_path="$ROLLOUT_MODEL", port=port, host="0.0.0.0", python="python",
                          dtype=None if engine == "sglang" else "bfloat16",
                          api_key="$BEBOP_API_KEY" if cfg.rl.api_key else None)


def plan(cfg: Config, config_path: str, overrides: list[str], nodes: list[str]) -> list[Launch]:
    """Every process the job starts, node by node."""
    ln = cfg.launch
    need = ln.trainer_nodes + ln.rollout_nodes
    if len(nodes) != need:
        raise ConfigError(f"the layout needs {need} nodes ({ln.trainer_nodes} trainer + {ln.rollout_nodes} "
                          f"rollout), the node list has {len(nodes)}")
    trainer, rollout = nodes[: ln.trainer_nodes], nodes[ln.trainer_nodes:]
    launches, urls = [], []
    if ln.rollout_nodes:
        per_node = ln.gpus_per_node // ln.rollout_tp
        for node in rollout:
            for i in range(per_node):
                gpus = ",".join(str(g) for g in range(i * ln.rollout_tp, (i + 1) * ln.rollout_tp))
                port = ln.rollout_port + i
                launches.append(Launch("rollout", node, rollout_command(cfg, port), {"CUDA_VISIBLE_DEVICES": gpus}))
                urls.append(f"http://{node}:{port}")
        trainer_gpus = ln.gpus_per_node
    else:  # servers on the last GPUs of the (single) trainer node
        first = ln.gpus_per_node - ln.rollout_gpus
        for i in range(ln.rollout_gpus // ln.rollout_tp):
            lo = first + i * ln.rollout_tp
            gpus = ",".join(str(g) for g in range(lo, lo + ln.rollout_tp))
            port = ln.rollout_port + i
            launches.append(Launch("rollout", trainer[0], rollout_command(cfg, port), {"CUDA_VISIBLE_DEVICES": gpus}))
            urls.append(f"http://127.0.0.1:{port}")
        trainer_gpus = first
    sets = list(overrides) + ["rl.servers=[" + ",".join(urls) + "]"]
    if ln.rollout_nodes or ln.rollout_engine == "sglang":
        # a shared file system: one write, every server reads. Also what a real SGLang needs on one
        # node: our safetensors tensor payloads are a `bebop serve` extension (SGLang's own tensor
        # route takes pickled CUDA-IPC handles, for co-located engines only)
        sets.append("rl.weight_sync=disk")
    train_cmd = ["torchrun", "--nnodes", str(ln.trainer_nodes), "--nproc-per-node", str(trainer_gpus),
                 "--rdzv-backend", "c10d", "--rdzv-endpoint", "$MASTER_ADDR:$MASTER_PORT", "--rdzv-id", "$JOB_ID",
                 "-m", "bebop_megatron.cli", "rl", "--config", config_path]
    for s in sets:
        train_cmd += ["--set", s]
    cfg.validate(world_size=ln.trainer_world_size)  # batch arithmetic against the real DP size
    env = {"CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in range(trainer_gpus))} if not ln.rollout_nodes else {}
    for node in trainer:
        launches.append(Launch("trainer", node, train_cmd, env))
    return launches


def sbatch_script(cfg: Config, config_path: str, overrides: list[str]) -> str:
    ln = cfg.launch
    n = ln.trainer_nodes + ln.rollout_nodes
    head = ["#!/bin/bash", f"#SBATCH --job-name={ln.job_name}", f"#SBATCH --nodes={n}",
            "#SBATCH --ntasks-per-node=1", f"#SBATCH --gpus-per-node={ln.gpus_per_node}",
            f"#SBATCH --time={ln.time}", "#SBATCH --exclusive", "#SBATCH --requeue",
            f"#SBATCH --output={ln.log_dir}/%x-%j.out"]
    if ln.partition:
        head.append(f"#SBATCH --partition={ln.partition}")
    if ln.account:
        head.append(f"#SBATCH --account={ln.account}")
    srun_extra = f" --container-image={shlex.quote(ln.container)} --container-mounts=$PWD:$PWD" if ln.container else ""
    nodes = [f"${{NODES[{i}]}}" for i in range(n)]  # resolved by bash at run time
    launches = plan(cfg, config_path, overrides, nodes)
    body = [
        "set -euo pipefail",
        f"# generated by launch/slurm.py from {config_path}; a requeued job resumes from {cfg.rl.output_dir}",
        "cd \"${SLURM_SUBMIT_DIR:-$PWD}\"",
        "JOB_ID=${SLURM_JOB_ID:-local}",
        f"LOG_DIR={ln.log_dir}/{ln.job_name}-$JOB_ID",
        "mkdir -p \"$LOG_DIR\"",
        "mapfile -t NODES < <(scontrol show hostnames \"$SLURM_JOB_NODELIST\")",
        "export MASTER_ADDR=${NODES[0]}",
        f"export MASTER_PORT={ln.master_port}",
        "export ROLLOUT_MODEL=${ROLLOUT_MODEL:?set ROLLOUT_MODEL to the HF folder the rollout servers start from}",
        "export PYTHONUNBUFFERED=1",
        "# srun --export=ALL passes NCCL_* / UCX_* / FI_* settings of the submitting shell to every task",
        "echo \"nodes: ${NODES[*]}; master $MASTER_ADDR:$MASTER_PORT\" | tee \"$LOG_DIR/layout.txt\"",
        "env | grep -E '^(" + "|".join(PASS_THROUGH) + ")' >> \"$LOG_DIR/layout.txt\" || true",
        "PIDS=()",
    ]
    urls = []
    for i, l in enumerate(x for x in launches if x.role == "rollout"):
        body.append(f"srun --nodes=1 --ntasks=1 --overlap -w \"{l.node}\"{srun_extra} --export=ALL bash -c "
                    f"\"{_dq(l.shell())}\" > \"$LOG_DIR/rollout-{i}.log\" 2>&1 &")
        body.append("PIDS+=($!)")
        port = l.command[l.command.index("--port") + 1]
        host = "127.0.0.1" if not ln.rollout_nodes else l.node
        urls.append(f"http://{host}:{port}")
    body += [f"for url in {' '.join(urls)}; do",
             "  until curl -sf \"$url/health\" > /dev/null; do sleep 10; done",
             "done", "echo \"rollout servers up\""]
    t = [x for x in launches if x.role == "trainer"][0]
    body.append(f"srun --nodes={ln.trainer_nodes} --ntasks-per-node=1 --overlap "
                f"-w \"$(IFS=,; echo \"${{NODES[*]:0:{ln.trainer_nodes}}}\")\"{srun_extra} --export=ALL bash -c "
                f"\"{_dq(t.shell())}\" 2>&1 | tee \"$LOG_DIR/trainer.log\"")
    body += ["STATUS=${PIPESTATUS[0]}", "kill \"${PIDS[@]}\" 2>/dev/null || true", "exit $STATUS"]
    return "\n".join(head + [""] + body) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--output", default="launch/slurm/rl.sbatch")
    p.add_argument("--dry-run", action="store_true", help="print the script and every command; write nothing")
    p.add_argument("--nodelist", default=None, help="with --dry-run: node names to resolve, e.g. 'gpu[01-03]'")
    p.add_argument("--submit", action="store_true", help="sbatch the written script")
    args = p.parse_args(argv)
    try:
        cfg = Config.load(args.config, args.overrides)
        script = sbatch_script(cfg, args.config, args.overrides)
        n = cfg.launch.trainer_nodes + cfg.launch.rollout_nodes
        nodes = expand_nodelist(args.nodelist) if args.nodelist else [f"node{i}" for i in range(n)]
        launches = plan(cfg, args.config, args.overrides, nodes)
    except ConfigError as e:
        print(f"launch/slurm.py: config error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(script)
        print("# commands, node by node:")
        for l in launches:
            print(f"[{l.role}@{l.node}] {l.shell().replace('$MASTER_ADDR', nodes[0])}")
        return 0
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(script)
    out.chmod(0o755)
    print(f"wrote {out} ({n} nodes: {cfg.launch.trainer_nodes} trainer, {cfg.launch.rollout_nodes} rollout)")
    if args.submit:
        return subprocess.call(["sbatch", str(out)])
    return 0


if __name__ == "__main__":
    sys.exit(main())

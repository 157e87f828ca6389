#!/usr/bin/env bash
# Single-node async RL: rollout servers on the last GPUs, the Megatron trainer (torchrun) on the rest.
#
#   ROLLOUT_MODEL=/models/qwen3-8b-bebop-hf launch/torchrun.sh configs/qwen3_8b.yaml [--set k=v ...]
#   DRY_RUN=1 launch/torchrun.sh configs/qwen3_8b.yaml      # print the commands only
#
# The layout comes from the config's `launch` section (gpus_per_node, rollout_gpus, rollout_tp,
# rollout_engine); launch/slurm.py computes it, this script runs it. On a CPU machine use
# `bebop rl --config configs/tiny_cpu.yaml` instead (local `bebop serve` processes, no GPU).
set -euo pipefail
CONFIG=${1:?usage: launch/torchrun.sh CONFIG [--set section.key=value ...]}
shift
HERE=$(cd "$(dirname "$0")" && pwd)
PYTHON=${PYTHON:-python}
LOG_DIR=${LOG_DIR:-logs/torchrun-$(date +%Y%m%d-%H%M%S)}
export MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
export MASTER_PORT=${MASTER_PORT:-29500}
export JOB_ID=${JOB_ID:-local}
export ROLLOUT_MODEL=${ROLLOUT_MODEL:-}
export PYTHONUNBUFFERED=1

# node-by-node commands from the same planner Slurm uses (one node here)
mapfile -t LINES < <("$PYTHON" "$HERE/slurm.py" --config "$CONFIG" "$@" --dry-run --nodelist localhost \
                     | sed -n 's/^\[\(rollout\|trainer\)@localhost\] /\1 /p')
if [[ ${#LINES[@]} -eq 0 ]]; then
  echo "torchrun.sh: the config's launch layout is not a single node (launch.rollout_nodes > 0?)" >&2
  exit 2
fi
if [[ -n "${DRY_RUN:-}" ]]; then
  printf '%s\n' "${LINES[@]}"
  exit 0
fi
: "${ROLLOUT_MODEL:?set ROLLOUT_MODEL to the HF folder the rollout servers start from}"
mkdir -p "$LOG_DIR"
PIDS=()
cleanup() { kill "${PIDS[@]}" 2>/dev/null || true; }
trap cleanup EXIT
i=0
for line in "${LINES[@]}"; do
  role=${line%% *}; cmd=${line#* }
  if [[ $role == rollout ]]; then
    bash -c "$cmd" > "$LOG_DIR/rollout-$i.log" 2>&1 &
    PIDS+=($!)
    port=$(sed -n 's/.*--port \([0-9]*\).*/\1/p' <<< "$cmd")
    until curl -sf "http://127.0.0.1:$port/health" > /dev/null; do
      kill -0 "${PIDS[-1]}" 2>/dev/null || { echo "rollout server $i died, see $LOG_DIR/rollout-$i.log" >&2; exit 1; }
      sleep 5
    done
    i=$((i + 1))
  fi
done
for line in "${LINES[@]}"; do
  role=${line%% *}; cmd=${line#* }
  [[ $role == trainer ]] && bash -c "$cmd" 2>&1 | tee "$LOG_DIR/trainer.log"
done

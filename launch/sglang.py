#!/usr/bin/env python
"""Start a real SGLang server with MTP speculative decoding for bebop rollouts.

    python launch/sglang.py --model-path /models/qwen3-4b-bebop --gamma 3 --tp 1 --port 30000
    python launch/sglang.py ... --dry-run        # print the command only

Flags follow SGLang's server args: ``--speculative-algorithm NEXTN`` (or EAGLE),
``--speculative-eagle-topk 1``, ``--speculative-num-steps γ``, ``--speculative-num-draft-tokens γ+1``,
and ``--speculative-use-rejection-sampling`` when the installed SGLang has it (newer releases;
older ones verify target-only). Both accept thresholds stay at their default 1.0: lower values are
lossy, and SGLang refuses them together with rejection sampling. After every weight sync the
rollout bridge checks that the draft (MTP) tensors were updated as well as the trunk.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bebop_megatron.rollout.protocol import server_command  # noqa: E402

REJECTION_FLAG = "--speculative-use-rejection-sampling"


def sglang_help() -> str:
    """The installed SGLang's launch_server --help text ('' when SGLang is absent)."""
    if importlib.util.find_spec("sglang") is None:
        return ""
    out = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--help"], capture_output=True,
                         text=True, timeout=300)
    return out.stdout + out.stderr


def build_command(model_path: str, gamma: int, port: int = 30000, host: str = "127.0.0.1", tp: int = 1,
                  algorithm: str = "NEXTN", help_text: str = "", mem_fraction: float | None = None,
                  api_key: str | None = None, extra: list[str] | None = None) -> list[str]:
    if gamma < 1:
        raise ValueError("gamma (speculative steps) must be >= 1")
    return server_command(None, "sglang", model_path=model_path, port=port, host=host, gamma=gamma, tp=tp,
                          algorithm=algorithm, rejection_flag=REJECTION_FLAG in help_text, mem_fraction=mem_fraction,
                          api_key=api_key, extra=list(extra or []))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", required=True)
    p.add_argument("--gamma", type=int, default=3)
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--algorithm", default="NEXTN")
    p.add_argument("--mem-fraction-static", type=float, default=None)
    p.add_argument("--api-key", default=os.environ.get("BEBOP_API_KEY"))
    p.add_argument("--dry-run", action="store_true")
    args, extra = p.parse_known_args(argv)
    help_text = sglang_help()
    if not help_text and not args.dry_run:
        print("launch/sglang.py: SGLang is not installed (pip install 'bebop_megatron[sglang]' on a GPU "
              "machine); the embedded engine (`bebop serve`) needs no GPU.", file=sys.stderr)
        return 2
    cmd = build_command(args.model_path, args.gamma, args.port, args.host, args.tp, args.algorithm, help_text,
                        args.mem_fraction_static, args.api_key, extra)
    if REJECTION_FLAG not in cmd:
        print(f"note: this SGLang has no {REJECTION_FLAG}; drafts are verified target-only "
              "(acceptance p(argmax q), which falls as entropy rises)", file=sys.stderr)
    print(" ".join(shlex.quote(c) for c in cmd), flush=True)
    if args.dry_run:
        return 0
    return subprocess.call(cmd)


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Load test of `bebop serve` on loopback: N concurrent clients for D seconds.

Starts its own server (tiny random model unless --model-path), reports requests, errors, p50/p99
latency, throughput, and the server's RSS over time (bounded memory = no growth trend).

    python tools/load_test.py --clients 64 --duration 60
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


async def client(url: str, stop_at: float, lat: list, errors: list, i: int) -> None:
    async with httpx.AsyncClient(timeout=120) as c:
        j = 0
        while time.time() < stop_at:
            body = {"input_ids": [5 + (i % 7), 6, 7 + (j % 5)], "sampling_params": {"max_new_tokens": 16,
                    "temperature": 1.0, "ignore_eos": True}}
            t0 = time.perf_counter()
            try:
                r = await c.post(url + "/generate", json=body)
                if r.status_code != 200 or len(r.json()["output_ids"]) != 16:
                    errors.append(f"{r.status_code}: {r.text[:200]}")
                else:
                    lat.append(time.perf_counter() - t0)
            except Exception as e:
                errors.append(repr(e))
            j += 1


async def run(url: str, clients: int, duration: float, pid: int) -> dict:
    lat, errors, rss = [], [], []
    stop_at = time.time() + duration
    proc = psutil.Process(pid)

    async def sample():
        while time.time() < stop_at:
            rss.append(proc.memory_info().rss)
            await asyncio.sleep(1.0)

    t0 = time.time()
    await asyncio.gather(sample(), *(client(url, stop_at, lat, errors, i) for i in range(clients)))
    wall = time.time() - t0
    lat.sort()
    pct = lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] if lat else float("nan")
    third = max(1, len(rss) // 3)
    return {"clients": clients, "seconds": round(wall, 1), "requests": len(lat) + len(errors), "errors": len(errors),
            "p50_ms": round(pct(0.50) * 1000, 1), "p99_ms": round(pct(0.99) * 1000, 1),
            "req_per_s": round(len(lat) / wall, 1), "tokens_per_s": round(16 * len(lat) / wall, 1),
            "rss_mib_first_third": round(statistics.mean(rss[:third]) / 2**20, 1) if rss else None,
            "rss_mib_last_third": round(statistics.mean(rss[-third:]) / 2**20, 1) if rss else None,
            "rss_mib_max": round(max(rss) / 2**20, 1) if rss else None, "first_errors": errors[:3]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--duration", type=float, default=60)
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from tests.server_utils import ServerProcess

    tmp = None
    path = args.model_path
    if path is None:
        from tests.tiny_models import make_hf_checkpoint

        tmp = tempfile.mkdtemp(prefix="bebop_load_")
        make_hf_checkpoint(tmp, "qwen3", "deepseek", num_mtp=2, scale=2.0)
        path = tmp
    server = ServerProcess(path, "--speculative-algorithm", "NEXTN", "--speculative-num-steps", "2",
                           "--max-running-requests", str(args.clients))
    try:
        res = asyncio.run(run(server.url, args.clients, args.duration, server.proc.pid))
        res["server_alive"] = server.alive()
    finally:
        server.stop()
    print(json.dumps(res, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return 0 if res["errors"] == 0 and res["server_alive"] else 1


if __name__ == "__main__":
    sys.exit(main())

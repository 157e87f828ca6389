#!/usr/bin/env python
"""Load test of `bebop serve` on loopback (127.0.0.1 only): streaming clients + hostile traffic.

For D seconds, at once:
  * N streaming clients (good requests): each loops over `/generate` with `stream: true`,
    16 new tokens, and checks that the stream ends with a final event carrying
    `finish_reason` (length, 16 tokens) before `data: [DONE]` (else: a truncated stream) and that
    the request was not harmed (finish_reason abort, wrong length, a 4xx/5xx);
  * H hostile senders: huge integers (2^64 seeds, 400-digit temperatures, top_k 2^63),
    5,000-digit numbers, 2,000-deep JSON, broken JSON, over-size bodies, denormal temperatures,
    bad top_k/top_p, odd weight-update paths, and clients that disconnect mid-request (streaming
    and not); every answer must be < 500;
  * a prober timing `GET /health` every 50 ms.

Hostile senders and the prober run in their own processes, so that the streaming clients' event loop
does not delay them (the figures measure the server, not this client).

It starts its own server (a tiny random Qwen3 + 2 MTP heads unless --model-path), and reports
counts, /health latency percentiles, throughput, the server's RSS over time and, at the end,
whether the requests of departed clients were aborted (no orphans left running).

    python tools/load_test.py --clients 64 --duration 60
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MAX_NEW = 16
OVERSIZE = b"{\"input_ids\":[" + b"1," * (9 << 20) + b"1]}"  # 18 MiB: beyond the 16 MiB limit


def make_tiny_checkpoint(path: Path, num_mtp: int = 2, seed: int = 0) -> None:
    """A tiny random Qwen3 in the Hugging Face layout plus DeepSeek-style MTP layers (self-contained)."""
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    h, L = 48, 2
    cfg = Qwen3Config(vocab_size=64, hidden_size=h, intermediate_size=2 * h, num_hidden_layers=L,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=h // 4, max_position_embeddings=512,
                      rope_theta=50000.0, tie_word_embeddings=False, rms_norm_eps=1e-6)
    model = Qwen3ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p)) if "norm" in name else p.normal_(0.0, 0.4)
    model.save_pretrained(str(path), safe_serialization=True)
    g = torch.Generator().manual_seed(seed + 1)
    layer = {k.split(".", 3)[3]: v for k, v in model.state_dict().items() if k.startswith("model.layers.0.")}
    rnd = lambda shape, norm: (1.0 + 0.1 * torch.randn(shape, generator=g)) if norm else 0.4 * torch.randn(shape, generator=g)  # noqa: E731
    tensors = {}
    for k in range(num_mtp):
        base = f"model.layers.{L + k}."
        for n in ("enorm", "hnorm", "shared_head.norm"):
            tensors[base + n + ".weight"] = rnd((h,), True)
        tensors[base + "eh_proj.weight"] = rnd((h, 2 * h), False)
        for n, v in layer.items():
            tensors[base + n] = rnd(tuple(v.shape), "norm" in n)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "mtp.safetensors"))
    raw = json.loads((path / "config.json").read_text())
    raw["num_nextn_predict_layers"] = num_mtp
    (path / "config.json").write_text(json.dumps(raw, indent=2))


# --------------------------------------------------------------------------- hostile bodies


def _deep(n: int) -> bytes:
    return b"[" * n + b"]" * n


def hostile_cases(tmpdir: Path) -> list[tuple[str, str, bytes]]:
    """(method, path, raw body) for requests that must all be answered < 500."""
    j = lambda o: json.dumps(o).encode()  # noqa: E731
    gen = lambda sp: j({"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4, **sp}})  # noqa: E731
    big = "9" * 5000
    cases = [
        ("POST", "/generate", gen({"seed": 2 ** 64})),
        ("POST", "/generate", gen({"sampling_seed": 2 ** 64 + 7})),
        ("POST", "/generate", b'{"text":"1+1=","sampling_params":{"seed":18446744073709551616}}'),
        ("POST", "/generate", b'{"input_ids":[5],"sampling_params":{"temperature":' + b"7" * 400 + b"}}"),
        ("POST", "/generate", b'{"input_ids":[5],"sampling_params":{"temperature":1' + b"0" * 400 + b".5}}"),
        ("POST", "/generate", gen({"top_k": 2 ** 63})),
        ("POST", "/generate", gen({"top_k": -(2 ** 70)})),
        ("POST", "/generate", gen({"max_new_tokens": 2 ** 64})),
        ("POST", "/generate", gen({"n": 2 ** 64})),
        ("POST", "/generate", gen({"top_p": 1e-400})),
        ("POST", "/generate", gen({"stop_token_ids": [2 ** 70]})),
        ("POST", "/generate", j({"input_ids": [2 ** 64]})),
        ("POST", "/generate", j({"input_ids": [[5, 6], [7]], "rid": ["a", "a"]})),
        ("POST", "/generate", b'{"input_ids":[5],"sampling_params":{"max_new_tokens":' + big.encode() + b"}}"),
        ("POST", "/generate", _deep(2000)),
        ("POST", "/generate", b'{"input_ids":' + _deep(3000) + b"}"),
        ("POST", "/generate", b'{"input_ids": [5, 6'),
        ("POST", "/generate", b"\xff\xfe\x00garbage"),
        ("POST", "/generate", j({"input_ids": [5], "sampling_params": {"temperature": float("nan")}})),
        ("POST", "/v1/completions", b'{"prompt":"1+1=","max_tokens":4,"seed":99999999999999999999}'),
        ("POST", "/v1/completions", b'{"prompt":[[5,6]],"max_tokens":' + big.encode() + b"}"),
        ("POST", "/v1/completions", _deep(2000)),
        ("POST", "/abort_request", _deep(2000)),
        ("POST", "/abort_request", b'{"rid":' + big.encode() + b"}"),
        ("POST", "/pause_generation", _deep(2000)),
        ("POST", "/pause_generation", b'{"mode":' + big.encode() + b"}"),
        ("POST", "/update_weights_from_disk", _deep(2000)),
        ("POST", "/update_weights_from_disk", j({"model_path": "x" * 5000})),
        ("POST", "/update_weights_from_disk", j({"model_path": str(tmpdir / "fifo_dir")})),
        ("POST", "/update_weights_from_disk", j({"model_path": str(tmpdir / "dangling_dir")})),
        ("POST", "/update_weights_from_disk", j({"model_path": str(tmpdir / "dir_dir")})),
        ("POST", "/update_weights_from_tensor", _deep(2000)),
        ("POST", "/update_weights_from_tensor", b'{"serialized_named_tensors":' + big.encode() + b"}"),
    ]
    return cases


def prepare_odd_dirs(tmpdir: Path) -> None:
    (tmpdir / "fifo_dir").mkdir(exist_ok=True)
    fifo = tmpdir / "fifo_dir" / "model.safetensors"
    if not fifo.exists():
        os.mkfifo(fifo)
    (tmpdir / "dangling_dir").mkdir(exist_ok=True)
    link = tmpdir / "dangling_dir" / "model.safetensors"
    if not link.is_symlink():
        link.symlink_to(tmpdir / "nowhere.safetensors")
    (tmpdir / "dir_dir" / "x.safetensors").mkdir(parents=True, exist_ok=True)


# --------------------------------------------------------------------------- clients


class Tally:
    def __init__(self):
        self.good = 0
        self.good_lat: list[float] = []
        self.truncated: list[str] = []
        self.harmed: list[str] = []
        self.hostile = 0
        self.hostile_4xx = 0
        self.server_errors: list[str] = []  # any 5xx
        self.disconnects = 0
        self.health: list[float] = []
        self.health_fail = 0


async def stream_client(url: str, headers: dict, stop_at: float, t: Tally, i: int) -> None:
    async with httpx.AsyncClient(timeout=120, headers=headers) as c:
        j = 0
        while time.time() < stop_at:
            body = {"input_ids": [5 + (i % 7), 6, 7 + (j % 5)], "stream": True,
                    "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 1.0, "ignore_eos": True}}
            t0 = time.perf_counter()
            try:
                async with c.stream("POST", url + "/generate", json=body) as r:
                    if r.status_code >= 500:
                        t.server_errors.append(f"stream {r.status_code}")
                    if r.status_code != 200:
                        t.harmed.append(f"status {r.status_code}: {(await r.aread())[:200]!r}")
                        continue
                    data = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
                if not data or data[-1] != "[DONE]" or len(data) < 2:
                    t.truncated.append(f"no [DONE] or no event: {data[-2:]}")
                    continue
                last = json.loads(data[-2])
                fr = (last.get("meta_info") or {}).get("finish_reason")
                if not fr:
                    t.truncated.append(f"last event without finish_reason: {data[-2][:200]}")
                elif fr.get("type") != "length" or len(last["output_ids"]) != MAX_NEW:
                    t.harmed.append(f"finish {fr} with {len(last['output_ids'])} tokens")
                else:
                    t.good += 1
                    t.good_lat.append(time.perf_counter() - t0)
            except Exception as e:  # noqa: BLE001
                t.harmed.append(repr(e))
            j += 1


async def hostile_client(url: str, headers: dict, stop_at: float, t: Tally, cases, seed: int) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=60, headers=headers) as c:
        while time.time() < stop_at:
            kind = rng.random()
            try:
                if kind < 0.015:  # a client that leaves mid-request (non-streaming)
                    t.disconnects += 1
                    try:
                        await c.post(url + "/generate", timeout=0.3, json={
                            "input_ids": [5, 6], "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}})
                    except httpx.TimeoutException:
                        pass
                    continue
                if kind < 0.03:  # a streaming client that leaves after its first event
                    t.disconnects += 1
                    async with c.stream("POST", url + "/generate", json={
                            "input_ids": [5, 6], "stream": True,
                            "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}) as r:
                        async for _ in r.aiter_lines():
                            break
                    continue
                if kind < 0.035:  # an over-size body (default limit 16 MiB)
                    raw = OVERSIZE
                    r = await c.post(url + "/generate", content=raw, headers={"content-type": "application/json"})
                elif kind < 0.06:  # a valid but odd request: denormal temperature = greedy
                    r = await c.post(url + "/generate", json={"input_ids": [5, 6, 7], "sampling_params": {
                        "max_new_tokens": 4, "temperature": 1e-320}})
                    t.hostile += 1
                    if r.status_code != 200 or len(r.json()["output_ids"]) not in range(1, 5):
                        t.harmed.append(f"tiny temperature: {r.status_code} {r.text[:200]}")
                    continue
                else:
                    method, path, raw = rng.choice(cases)
                    r = await c.request(method, url + path, content=raw, headers={"content-type": "application/json"})
                t.hostile += 1
                if r.status_code >= 500:
                    t.server_errors.append(f"{r.status_code} {r.text[:200]}")
                elif r.status_code >= 400:
                    t.hostile_4xx += 1
            except httpx.TimeoutException as e:
                t.server_errors.append(f"timeout: {e!r}")
            except Exception as e:  # noqa: BLE001
                t.server_errors.append(repr(e))


def _health_proc(url: str, stop_at: float, q) -> None:
    """GET /health every 50 ms from its own process (a busy client loop must not inflate the figure)."""
    lat, fail = [], 0
    with httpx.Client(timeout=30) as c:
        while time.time() < stop_at:
            t0 = time.perf_counter()
            try:
                if c.get(url + "/health").status_code != 200:
                    fail += 1
            except Exception:  # noqa: BLE001
                fail += 1
            lat.append(time.perf_counter() - t0)
            time.sleep(0.05)
    q.put(("health", lat, fail))


def _hostile_proc(url: str, headers: dict, stop_at: float, tmpdir: str, senders: int, seed: int, q) -> None:
    t = Tally()
    cases = hostile_cases(Path(tmpdir))

    async def go():
        await asyncio.gather(*(hostile_client(url, headers, stop_at, t, cases, seed + k) for k in range(senders)))

    asyncio.run(go())
    q.put(("hostile", t.hostile, t.hostile_4xx, t.disconnects, t.server_errors[:20], len(t.server_errors), t.harmed[:5],
           len(t.harmed)))


async def run(url: str, headers: dict, clients: int, hostile: int, duration: float, pid: int, tmpdir: Path,
              hostile_procs: int = 2) -> dict:
    import multiprocessing as mp

    t = Tally()
    rss = []
    stop_at = time.time() + duration
    proc = psutil.Process(pid)
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_health_proc, args=(url, stop_at, q), daemon=True)]
    per = [hostile // hostile_procs + (k < hostile % hostile_procs) for k in range(hostile_procs)]
    procs += [ctx.Process(target=_hostile_proc, args=(url, headers, stop_at, str(tmpdir), n, 1000 + 100 * k, q),
                          daemon=True) for k, n in enumerate(per) if n]
    for pr in procs:
        pr.start()

    async def sample():
        while time.time() < stop_at:
            rss.append(proc.memory_info().rss)
            await asyncio.sleep(1.0)

    t0 = time.time()
    await asyncio.gather(sample(), *(stream_client(url, headers, stop_at, t, i) for i in range(clients)))
    wall = time.time() - t0
    for _ in procs:
        msg = await asyncio.to_thread(q.get, True, 300)
        if msg[0] == "health":
            t.health, t.health_fail = msg[1], msg[2]
        else:
            t.hostile += msg[1]
            t.hostile_4xx += msg[2]
            t.disconnects += msg[3]
            t.server_errors += msg[4] + [""] * (msg[5] - len(msg[4]))
            t.harmed += msg[6] + [""] * (msg[7] - len(msg[6]))
    for pr in procs:
        pr.join(30)
    # departed clients must leave nothing running: poll until the engine is idle
    orphans, idle_after = None, None
    async with httpx.AsyncClient(timeout=30, headers=headers) as c:
        t1 = time.time()
        while time.time() - t1 < 15:
            st = (await c.get(url + "/get_server_info")).json()["internal_states"][0]
            orphans = st["num_running_reqs"] + st["num_waiting_reqs"]
            if orphans == 0:
                idle_after = round(time.time() - t1, 2)
                break
            await asyncio.sleep(0.1)
    pct = lambda xs, q: sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")  # noqa: E731
    third = max(1, len(rss) // 3)
    return {
        "clients": clients, "hostile_senders": hostile, "seconds": round(wall, 1),
        "good_streams": t.good, "truncated_streams": len(t.truncated), "good_harmed": len(t.harmed),
        "hostile_requests": t.hostile, "hostile_4xx": t.hostile_4xx, "disconnecting_clients": t.disconnects,
        "server_errors_5xx": len(t.server_errors),
        "stream_p50_ms": round(pct(t.good_lat, 0.5) * 1000, 1), "stream_p99_ms": round(pct(t.good_lat, 0.99) * 1000, 1),
        "tokens_per_s": round(MAX_NEW * t.good / wall, 1),
        "health_probes": len(t.health), "health_failures": t.health_fail,
        "health_p50_ms": round(pct(t.health, 0.5) * 1000, 1), "health_p99_ms": round(pct(t.health, 0.99) * 1000, 1),
        "health_max_ms": round(max(t.health) * 1000, 1) if t.health else None,
        "left_running_after_end": orphans, "idle_after_s": idle_after,
        "rss_mib_first_third": round(statistics.mean(rss[:third]) / 2**20, 1) if rss else None,
        "rss_mib_last_third": round(statistics.mean(rss[-third:]) / 2**20, 1) if rss else None,
        "rss_mib_max": round(max(rss) / 2**20, 1) if rss else None,
        "first_problems": (t.truncated[:2] + t.harmed[:2] + t.server_errors[:2]),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=64, help="streaming clients (good requests)")
    ap.add_argument("--hostile", type=int, default=8, help="concurrent hostile senders (in --hostile-procs processes)")
    ap.add_argument("--hostile-procs", type=int, default=2)
    ap.add_argument("--duration", type=float, default=60)
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from bebop_megatron.rollout.local_servers import LocalServer

    tmp = Path(tempfile.mkdtemp(prefix="bebop_load_"))
    path = args.model_path
    if path is None:
        path = tmp / "model"
        path.mkdir()
        make_tiny_checkpoint(path)
    prepare_odd_dirs(tmp)
    server = LocalServer(path, ["--speculative-algorithm", "NEXTN", "--speculative-num-steps", "2",
                                "--max-running-requests", str(max(8, args.clients))], log_dir=tmp, threads=1)
    try:
        server.wait_ready(timeout=180)
        res = asyncio.run(run(server.url, {}, args.clients, args.hostile, args.duration, server.proc.pid, tmp,
                              args.hostile_procs))
        res["server_alive"] = server.alive()
    finally:
        server.stop()
    print(json.dumps(res, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    ok = (res["server_errors_5xx"] == 0 and res["truncated_streams"] == 0 and res["good_harmed"] == 0
          and res["server_alive"] and res["left_running_after_end"] == 0)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

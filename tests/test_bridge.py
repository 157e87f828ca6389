"""Rollout bridge against real `bebop serve` processes: least-loaded routing, a server killed
mid-batch loses nothing, weight sync moves trunk + MTP on every server, metrics under every key."""

import asyncio
import time
import json
import subprocess
import importlib.util
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from bebop_megatron.rollout.bridge import RolloutBridge, RolloutError, parse_spec_metrics
from tests.server_utils import ServerProcess
from tests.tiny_models import make_hf_checkpoint

SPEC = ["--speculative-algorithm", "NEXTN", "--speculative-num-steps", "2", "--dtype", "float64"]
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ckpts(tiny_checkpoint):
    return tiny_checkpoint(num_mtp=2, seed=0), tiny_checkpoint(num_mtp=2, seed=9)


def test_parse_spec_metrics_every_spelling():
    base = {"completion_tokens": 30, "spec_verify_ct": 10}
    for a, p in [("spec_num_correct_drafts", "spec_num_proposed_drafts"), ("spec_accepted_drafts", "spec_proposed_drafts"),
                 ("spec_accept_token_num", "spec_draft_token_num")]:
        st = parse_spec_metrics({**base, a: 20, p: 30})
        assert (st.accepted, st.proposed, st.verify_ct) == (20, 30, 10)
        # tokens per verify: tokens emitted by verify steps (all but the prefill's) / verify steps
        assert abs(st.accept_rate - 2 / 3) < 1e-12 and st.tokens_per_verify == 2.9
    legacy = parse_spec_metrics({**base, "spec_accept_length": 3.0})
    assert legacy.accepted == 19 and legacy.proposed == 0
    assert parse_spec_metrics({"completion_tokens": 5}).verify_ct == 0


def test_routing_failover_and_weight_sync(ckpts):
    a, b = ckpts
    servers = [ServerProcess(a, *SPEC) for _ in range(2)]

    async def scenario():
        async with RolloutBridge([s.url for s in servers], health_interval=0.5) as bridge:
            payload = lambda i: {"input_ids": [5 + i % 7, 6, 7], "rid": f"r{i}",
                                 "sampling_params": {"max_new_tokens": 40, "temperature": 1.0, "seed": i,
                                                     "ignore_eos": True}}
            first = await bridge.generate_many([payload(i) for i in range(16)])
            served = [st.served for st in bridge.servers]
            assert all(n > 0 for n in served), served  # least-loaded routing used both
            # kill one server while a batch is in flight: every request still completes
            long = lambda i: {**payload(i), "sampling_params": {**payload(i)["sampling_params"], "max_new_tokens": 120}}
            task = asyncio.gather(*(bridge.generate(long(100 + i)) for i in range(24)))
            for _ in range(500):  # kill only once requests are in flight on that server
                if bridge.servers[0].inflight > 0:
                    break
                await asyncio.sleep(0.01)
            assert bridge.servers[0].inflight > 0
            servers[0].proc.kill()
            done = await task
            assert len(done) == 24 and all(len(o["output_ids"]) == 120 for o in done)
            assert bridge.stats.servers_dropped >= 1 and not bridge.servers[0].healthy
            # weight sync (trunk + MTP) while requests keep coming
            tensors = {}
            for f in sorted(b.glob("*.safetensors")):
                tensors.update(load_file(str(f)))
            names = sorted(tensors)
            buckets = [{n: tensors[n] for n in names[i:i + 10]} for i in range(0, len(names), 10)]
            gen_during = asyncio.gather(*(bridge.generate(payload(200 + i)) for i in range(6)))
            await asyncio.sleep(0.1)
            res = await bridge.update_weights_from_tensor(buckets, "v2")
            during = await gen_during
            assert res["servers"] == 1 and res["failed"] == []
            assert res["results"][servers[1].url]["num_mtp_tensors"] > 0
            after = await bridge.generate({"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 8,
                                                                                       "temperature": 0}})
            assert after["meta_info"]["weight_version"] == "v2"
            assert all(o["meta_info"]["weight_version"] in ("default", "v2") for o in during)
            assert bridge.stats.spec.verify_ct > 0 and bridge.stats.spec.proposed > 0
            # a 4xx is the caller's error: raised, not retried elsewhere
            with pytest.raises(RolloutError, match="rejected"):
                await bridge.generate({"input_ids": [1], "sampling_params": {"temperature": -1}})
            return first

    try:
        asyncio.run(scenario())
    finally:
        for s in servers:
            s.stop()


def test_all_servers_down_is_a_clear_error():
    async def scenario():
        async with RolloutBridge(["http://127.0.0.1:9"], max_attempts=1, down_grace_s=1.0) as bridge:
            t0 = time.time()
            with pytest.raises(RolloutError, match="no healthy rollout server"):
                await bridge.generate({"input_ids": [1]})
            assert time.time() - t0 >= 1.0  # it waited the grace period for a restart first

    asyncio.run(scenario())


def test_sglang_launcher_command():
    spec = importlib.util.spec_from_file_location("launch_sglang", ROOT / "launch" / "sglang.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    new = mod.build_command("/m", 3, help_text="... --speculative-use-rejection-sampling ...")
    old = mod.build_command("/m", 2, help_text="no such flag")
    for cmd, g in ((new, 3), (old, 2)):
        s = " ".join(cmd)
        assert f"--speculative-num-steps {g}" in s and f"--speculative-num-draft-tokens {g + 1}" in s
        assert "--speculative-eagle-topk 1" in s and "--speculative-algorithm NEXTN" in s
        assert "threshold" not in s
    assert "--speculative-use-rejection-sampling" in new and "--speculative-use-rejection-sampling" not in old
    with pytest.raises(ValueError, match="lossy"):
        mod.build_command("/m", 3, extra=["--speculative-accept-threshold-single", "0.5"])
    import subprocess

    out = subprocess.run([sys.executable, str(ROOT / "launch" / "sglang.py"), "--model-path", "/m", "--dry-run"],
                         capture_output=True, text=True)
    assert out.returncode == 0 and "sglang.launch_server" in out.stdout


def test_bench_rollout_smoke(tmp_path):
    """The benchmark script runs and reports every row (numbers are not asserted: not a timed test)."""
    make_hf_checkpoint(tmp_path / "hf", "qwen3", "deepseek", num_mtp=2)
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_rollout.py"), "--model-path", str(tmp_path / "hf"),
                          "--max-new-tokens", "6", "--batch", "1", "2", "--reps", "1", "--min-rep-seconds", "0.05",
                          "--variants", "plain", "mtp_rejection", "adaptive", "hf_generate", "--json", str(tmp_path / "r.json"),
                          "--draft-vocab", "16"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads((tmp_path / "r.json").read_text())
    variants = {r["variant"] for r in rows}
    assert {"plain", "mtp_rejection", "hf_generate", "mtp_rejection+dv16", "adaptive+dv16"} <= variants, variants
    assert next(r for r in rows if r["variant"] == "mtp_rejection+dv16")["draft_vocab"] == 16
    spec = next(r for r in rows if r["variant"] == "mtp_rejection")
    assert 1.0 <= spec["tokens_per_verify"] <= 3.0 and 0.0 <= spec["accept_rate"] <= 1.0
    # a repetition is batches_per_rep whole batches (ignore_eos: 6 tokens per row each), for every variant
    for r in rows:
        assert r["batches_per_rep"] >= 1 and r["tokens"] == r["batches_per_rep"] * r["batch"] * 6, r
        assert len(r["wall_s_reps"]) == r["reps"] == 1
        # one repetition: the paired ratio is that repetition's, the same as the ratio of the medians
        assert abs(r["speedup_vs_plain_paired"] - r["speedup_vs_plain"]) < 1e-9, r

"""Fault injection in the RL rollout path: a rollout server killed mid-batch loses no sample."""

from __future__ import annotations

import json
import time
import urllib.request

from bebop_megatron.config import Config
from bebop_megatron.data import CharTokenizer
from bebop_megatron.rl.rollout import RolloutManager
from bebop_megatron.rl.types import Prompt
from tests.server_utils import tiny_mtp_servers


def _running_reqs(url: str) -> int:
    """Requests the server is decoding now (SGLang's ``/v1/loads``)."""
    with urllib.request.urlopen(f"{url}/v1/loads", timeout=10) as r:
        return sum(x["num_running_reqs"] for x in json.load(r)["loads"])


def test_rollout_server_killed_mid_batch_loses_no_sample(tmp_path):
    servers = tiny_mtp_servers(tmp_path, 2, "--weight-version", "0")
    cfg = Config()
    cfg.rl.prompts_per_step, cfg.rl.group_size, cfg.rl.max_new_tokens = 8, 4, 48
    tok = CharTokenizer()
    prompts = [Prompt(text=f"{i}+{i}=", answer=str(2 * i)) for i in range(16)]
    mgr = RolloutManager([s.url for s in servers], cfg, tok, prompts)
    try:
        # wait until both servers are busy with this batch, then kill one of them
        fut = mgr.submit(0)
        deadline = time.time() + 60
        while time.time() < deadline and not all(s.inflight > 0 for s in mgr.bridge.servers):
            time.sleep(0.01)
        assert all(s.inflight > 0 for s in mgr.bridge.servers), "the batch never reached both servers"
        servers[0].kill()
        batch = fut.result(timeout=300)
        assert len(batch.samples) == 32  # exactly the expected number: nothing lost, nothing doubled
        assert sorted({s.prompt_index for s in batch.samples}) == sorted(set(batch.prompt_indices))
        for s in batch.samples:
            assert len(s.response_ids) == len(s.rollout_logprobs) >= 1
        assert batch.retries > 0 and mgr.bridge.stats.servers_dropped == 1
        # the next step runs on the survivor
        assert len(mgr.submit(1).result(timeout=300).samples) == 32
    finally:
        mgr.close()
        for s in servers:
            s.stop()


def test_weight_sync_while_generating_keeps_versions_atomic(tmp_path):
    """Samples generated across a sync each come entirely from one version (aborted requests are
    re-sent under the new weights)."""
    from safetensors.torch import load_file

    servers = tiny_mtp_servers(tmp_path, 1, "--weight-version", "0")
    cfg = Config()
    # 64 requests of up to 256 tokens: the batch lasts long enough for the sync to catch most of them
    # in flight; 16 requests of 64 tokens could all finish (0.24 s) before the sync reached the server
    cfg.rl.prompts_per_step, cfg.rl.group_size, cfg.rl.max_new_tokens = 16, 4, 256
    mgr = RolloutManager([s.url for s in servers], cfg, CharTokenizer(), [Prompt(text="1+1=", answer="2")] * 8)
    try:
        weights = {}
        for f in sorted((tmp_path / "hf").glob("*.safetensors")):
            weights.update(load_file(str(f)))
        fut = mgr.submit(0)
        # wait until the server itself is decoding this batch (the client's in-flight count only says
        # that requests were sent: a sync could reach the server first and hold them all, retrying none)
        deadline, running = time.time() + 60, 0
        while time.time() < deadline and (running := _running_reqs(servers[0].url)) < 8:
            time.sleep(0.005)
        assert running >= 8, "the batch never started decoding"
        res = mgr.sync_tensors([weights], 1, expect_mtp=True)
        assert res["servers"] == 1 and not res["failed"]
        batch = fut.result(timeout=300)
        assert len(batch.samples) == 64
        assert {s.weight_version for s in batch.samples} <= {0, 1}
        # a sample either finished before the pause (v0), or was aborted by the pause and re-sent
        # (a retry), or arrived during the pause and was held until it ended: both run under v1
        assert batch.retries >= 1  # the sync really caught requests in flight
        assert sum(s.weight_version == 1 for s in batch.samples) >= batch.retries
    finally:
        mgr.close()
        for s in servers:
            s.stop()

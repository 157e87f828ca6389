"""The RL rollout manager's requests: a step's samples go out in SGLang's batch form, and how they
are split over requests changes nothing in the samples."""

from __future__ import annotations

from bebop_megatron.config import Config
from bebop_megatron.data import CharTokenizer
from bebop_megatron.rl.rollout import MAX_REQUEST_BYTES, RolloutManager
from bebop_megatron.rl.types import Prompt
from tests.server_utils import offline_rollout_manager, tiny_mtp_servers


def test_samples_do_not_depend_on_how_a_step_is_split_into_requests(tmp_path):
    servers = tiny_mtp_servers(tmp_path, 1, "--dtype", "float64")
    cfg = Config()
    cfg.rl.prompts_per_step, cfg.rl.group_size, cfg.rl.max_new_tokens = 3, 4, 24
    cfg.rl.stop = [";"]
    tok = CharTokenizer()
    prompts = [Prompt(text=f"{i}+{i}=", answer=str(2 * i)) for i in range(6)]
    got, logps = {}, {}
    try:
        for per in (0, 1, 5):  # auto (one request for the step on one server), one per sample, uneven chunks
            cfg.rl.samples_per_request = per
            mgr = RolloutManager([s.url for s in servers], cfg, tok, prompts)
            try:
                assert [len(c) for c in mgr.split(_jobs(12), 4)] == {0: [12], 1: [1] * 12, 5: [5, 5, 2]}[per]
                batch = mgr.submit(0).result(timeout=300)
                assert mgr.bridge.stats.requests == {0: 1, 1: 12, 5: 3}[per]
            finally:
                mgr.close()
            got[per] = [(s.prompt_index, s.response_ids, s.verify_ct) for s in batch.samples]
            logps[per] = [lp for s in batch.samples for lp in s.rollout_logprobs]
            assert len(batch.samples) == 12 and sum(s.verify_ct for s in batch.samples) > 0  # speculated
        # the same samples in the same order: seeds are per sample, sampling is per request (log-probs
        # to float64 rounding: a batch's matmuls sum in another order)
        assert got[0] == got[1] == got[5]
        assert max(abs(a - b) for a, b in zip(logps[0] * 2, logps[1] + logps[5])) < 1e-9
    finally:
        for s in servers:
            s.stop()


class _Healthy:
    def __init__(self, n):
        self.n = n

    def healthy(self):
        return [None] * self.n


def _jobs(n, prompt_len=3):
    from bebop_megatron.rl.rollout import _Job

    return [_Job(i, list(range(1, prompt_len + 1)), Prompt(text="", answer=""), i) for i in range(n)]


def test_automatic_split_is_whole_groups_spread_over_healthy_servers():
    cfg = Config()
    m = offline_rollout_manager(cfg)
    for servers, n, group, want in [(1, 128, 8, [128]), (2, 128, 8, [64, 64]), (3, 128, 8, [40, 40, 48]),
                                    (5, 64, 8, [8, 16, 8, 16, 16]), (4, 12, 4, [4, 4, 4]), (1, 512, 1, [256, 256]),
                                    (1, 1000, 8, [248, 248, 248, 256]), (0, 16, 8, [16])]:
        m.bridge = _Healthy(servers)
        chunks = m.split(_jobs(n), group)
        assert [len(c) for c in chunks] == want, (servers, n, group)
        assert [j.seed for c in chunks for j in c] == list(range(n))  # in order, each once
    cfg.rl.samples_per_request = 3
    assert [len(c) for c in m.split(_jobs(8), 4)] == [3, 3, 2]
    # a body stays under MAX_REQUEST_BYTES (bebop serve refuses more than 16 MiB): long prompts split further
    cfg.rl.samples_per_request = 0
    m.bridge = _Healthy(1)
    chunks = m.split(_jobs(64, prompt_len=40_000), 8)
    assert len(chunks) > 1 and all(sum(8 * len(j.ids) for j in c) <= MAX_REQUEST_BYTES for c in chunks)


def test_a_weight_sync_re_sends_only_the_aborted_samples_of_a_batch():
    """A pause aborts what is still running; the finished samples of the same request are kept."""
    import asyncio
    import json

    import httpx

    from bebop_megatron.rollout.bridge import RolloutBridge

    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append([sp["sampling_seed"] for sp in body["sampling_params"]] if isinstance(body["sampling_params"], list)
                    else [body["sampling_params"]["sampling_seed"]])
        outs = []
        for seed in seen[-1]:
            aborted = len(seen) == 1 and seed % 2 == 1  # the first answer: odd seeds cut by a sync
            outs.append({"text": "x", "output_ids": [] if aborted else [7, 8],
                         "meta_info": {"finish_reason": {"type": "abort" if aborted else "length"},
                                       "weight_version": "0" if len(seen) == 1 else "1",
                                       "output_token_logprobs": [] if aborted else [[-0.5, 7], [-0.25, 8]]}})
        return httpx.Response(200, json=outs if isinstance(body["sampling_params"], list) else outs[0])

    cfg = Config()
    jobs = _jobs(6)

    async def run():
        bridge = RolloutBridge(["http://a:1"], transport=httpx.MockTransport(handler))
        m = offline_rollout_manager(cfg, bridge=bridge)
        try:
            samples = await m._generate(jobs)
        finally:
            await bridge.close()
        return samples, bridge.stats.retries

    samples, retries = asyncio.run(run())
    assert seen[0] == [j.seed for j in jobs] and seen[1] == [1, 3, 5]  # only the aborted ones again
    assert retries == 3
    assert [s.prompt_index for s in samples] == [0, 1, 2, 3, 4, 5]
    assert [s.weight_version for s in samples] == [0, 1, 0, 1, 0, 1]
    assert all(s.response_ids == [7, 8] and s.rollout_logprobs == [-0.5, -0.25] for s in samples)


def test_generations_use_a_connection_each():
    """httpcore 1.0's pool queues a burst on one idle keep-alive connection (encode/httpcore#1110):
    /generate must not keep connections alive; control calls do."""
    import asyncio

    from bebop_megatron.rollout.bridge import RolloutBridge

    async def limits():
        bridge = RolloutBridge(["http://a:1"])
        try:
            return (bridge.gen_client._transport._pool._max_keepalive_connections,
                    bridge.client._transport._pool._max_keepalive_connections)
        finally:
            await bridge.close()

    gen, control = asyncio.run(limits())
    assert gen == 0 and control > 0

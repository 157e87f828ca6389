"""The RL rollout manager's requests: a step's samples go out in SGLang's batch form, and how they
are split over requests changes nothing in the samples."""

from __future__ import annotations

from bebop_megatron.config import Config
from bebop_megatron.data import CharTokenizer
from bebop_megatron.rl.rollout import RolloutManager
from bebop_megatron.rl.types import Prompt
from bebop_megatron.rollout.local_servers import start_local_servers
from tests.tiny_models import make_hf_checkpoint


def test_samples_do_not_depend_on_how_a_step_is_split_into_requests(tmp_path):
    make_hf_checkpoint(tmp_path / "hf", "qwen3", "deepseek", num_mtp=2, vocab=64, hidden=64, layers=2)
    servers = start_local_servers(tmp_path / "hf", 1, ["--speculative-algorithm", "MTP", "--speculative-num-steps", "2",
                                                       "--dtype", "float64"], log_dir=tmp_path / "logs")
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
                assert mgr.samples_per_request(12, 4) == (12 if per == 0 else per)
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


def test_automatic_split_is_whole_groups_over_healthy_servers():
    cfg = Config()
    m = RolloutManager.__new__(RolloutManager)  # the split only: no servers, no loop
    m.cfg = cfg

    class _Bridge:
        def __init__(self, n):
            self.n = n

        def healthy(self):
            return [None] * self.n

    for servers, n, group, want in [(1, 128, 8, 128), (2, 128, 8, 64), (3, 128, 8, 48), (4, 12, 8, 8),
                                    (1, 512, 1, 256), (1, 1000, 8, 256), (0, 16, 8, 16), (1, 30, 100, 100)]:
        m.bridge = _Bridge(servers)
        assert m.samples_per_request(n, group) == want, (servers, n, group)
    cfg.rl.samples_per_request = 3
    assert m.samples_per_request(128, 8) == 3

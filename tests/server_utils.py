"""Start `bebop serve` as a real process on loopback and wait until it answers."""

from __future__ import annotations

import httpx

from bebop_megatron.rollout.local_servers import LocalServer


class ServerProcess(LocalServer):
    """A started, healthy server (logs next to the model) with request helpers.

    Requests go through one kept-alive ``httpx.Client`` (``self.client``, thread-safe): a fresh
    ``httpx.post`` builds an SSL context per call, about 50 ms of CPU on these machines, which made the
    2,200-request fuzz 8x slower than the server itself."""

    def __init__(self, model_path, *extra, api_key=None):
        super().__init__(model_path, extra, threads=None, api_key=api_key)
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(timeout=120)
        self.wait_ready(timeout=120)

    def post(self, path, json=None, **kw):
        return self.client.post(self.url + path, json=json, headers=self.headers, timeout=kw.pop("timeout", 120), **kw)

    def get(self, path, **kw):
        return self.client.get(self.url + path, headers=self.headers, timeout=kw.pop("timeout", 60), **kw)

    def stop(self) -> None:
        self.client.close()
        super().stop()


def tiny_mtp_servers(tmp_path, n: int, *extra: str) -> list[LocalServer]:
    """``n`` local `bebop serve` processes on a tiny random qwen3 checkpoint with two MTP heads (γ = 2),
    written under ``tmp_path / "hf"``: the rollout manager's tests."""
    from bebop_megatron.rollout.local_servers import start_local_servers
    from tests.tiny_models import make_hf_checkpoint

    make_hf_checkpoint(tmp_path / "hf", "qwen3", "deepseek", num_mtp=2, vocab=64, hidden=64, layers=2)
    return start_local_servers(tmp_path / "hf", n, ["--speculative-algorithm", "MTP", "--speculative-num-steps", "2",
                                                    *extra], log_dir=tmp_path / "logs")


def offline_rollout_manager(cfg, record_topk: int = 0, bridge=None):
    """A ``RolloutManager`` that builds requests and scores answers, without servers or its loop thread."""
    from bebop_megatron.data import CharTokenizer
    from bebop_megatron.rl.rollout import RolloutManager, reward_fn, split_stops

    m = RolloutManager.__new__(RolloutManager)
    m.cfg, m.tok, m.record_topk, m.bridge = cfg, CharTokenizer(), record_topk, bridge
    m.reward = reward_fn(cfg.rl.reward)
    m._stop_ids, m._stop_strs = split_stops(m.tok, cfg.rl.stop)
    return m

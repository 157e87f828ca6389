"""Rollout side of RL: prompts, scored samples, and the manager that drives the rollout servers.

The manager owns an asyncio loop in a background thread with a :class:`RolloutBridge` to one or
many SGLang-API servers (our embedded ``bebop serve`` by default, real SGLang when configured).
The trainer submits the batch of step ``i`` (a pure function of the seed and ``i``: resuming
replays the same prompts) and gets a ``concurrent.futures.Future``; generation, scoring and weight
syncs run on the loop while the trainer computes, which is what makes the loop asynchronous.
Every sample records the weight version that produced it and its speculative counters.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from bebop_megatron.data import DataError, iter_jsonl
from bebop_megatron.rl.types import Prompt, RolloutBatch, Sample, by_task  # noqa: F401 (also importable from here)
from bebop_megatron.rollout import protocol
from bebop_megatron.rollout.bridge import RolloutBridge, RolloutError

log = logging.getLogger("bebop.rl.rollout")


# ---------------------------------------------------------------------------- prompts


def load_prompts(path: str | Path, reward: str) -> list[Prompt]:
    """JSONL: ``{"prompt": str, "answer": str}`` (synthetic/math) or ``{"prompt": str, "tests": ...}`` (code)."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"prompt file not found: {path}")
    key = "tests" if reward == "code" else "answer"
    out = []
    for lineno, rec in iter_jsonl(path):
        if not isinstance(rec.get("prompt"), str) or key not in rec:
            raise DataError(f"{path}:{lineno}: needs a string 'prompt' and '{key}'")
        task = rec.get("task", "")
        if not isinstance(task, str):
            raise DataError(f"{path}:{lineno}: 'task' must be a string (the prompt's family)")
        out.append(Prompt(text=rec["prompt"], answer=rec[key], task=task))
    if not out:
        raise DataError(f"{path}: no prompts")
    return out


class PromptSource:
    """Training prompts in a seeded per-epoch order; step ``i`` takes positions [i*P, (i+1)*P)."""

    def __init__(self, prompts: list[Prompt], seed: int):
        self.prompts, self.seed = prompts, seed
        self._perm: tuple[int, list[int]] = (-1, [])  # (epoch, its order): one shuffle per epoch

    def _order(self, epoch: int) -> list[int]:
        if self._perm[0] != epoch:
            perm = list(range(len(self.prompts)))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(perm)
            self._perm = (epoch, perm)
        return self._perm[1]

    def indices_for_step(self, step: int, per_step: int) -> list[int]:
        out = []
        n = len(self.prompts)
        for pos in range(step * per_step, (step + 1) * per_step):
            epoch, i = divmod(pos, n)
            out.append(self._order(epoch)[i])
        return out


def build_prompts(cfg, tokenizer) -> tuple[list[Prompt], list[Prompt]]:
    """(training prompts, held-out evaluation prompts)."""
    r = cfg.rl
    if r.prompts_path:
        prompts = load_prompts(r.prompts_path, r.reward)
        n_eval = min(r.eval_prompts, len(prompts) // 5)
        train, evals = prompts[n_eval:], prompts[:n_eval]
    else:
        from bebop_megatron.rl.rewards.synthetic import make_tasks

        train = [Prompt(text=t.prompt, answer=t.answer, task=t.kind)
                 for t in make_tasks(4096, cfg.train.seed + 17, r.task)]
        evals = [Prompt(text=t.prompt, answer=t.answer, task=t.kind)
                 for t in make_tasks(r.eval_prompts, cfg.train.seed + 29, r.task)]
    longest = max(len(tokenizer.encode(p.text)) for p in train + evals)
    if longest + r.max_new_tokens + 1 > cfg.data.seq_length:
        raise DataError(f"the longest prompt ({longest} tokens) + rl.max_new_tokens ({r.max_new_tokens}) does "
                        f"not fit data.seq_length {cfg.data.seq_length}")
    return train, evals


def split_stops(tokenizer, stops: list[str]) -> tuple[list[int], list[str]]:
    """(stop_token_ids, stop strings): single-token stop strings become ids (cheaper for the server)."""
    ids, strs = [], []
    for s in stops:
        enc = list(tokenizer.encode(s))
        (ids.append(enc[0]) if len(enc) == 1 else strs.append(s))
    return ids, strs


def reward_fn(kind: str) -> Callable[[str, Any], float]:
    from bebop_megatron.rl.rewards import code_reward, math_reward, synthetic_partial_reward, synthetic_reward

    return {"synthetic": synthetic_reward, "synthetic_partial": synthetic_partial_reward, "math": math_reward,
            "code": code_reward}[kind]


# ---------------------------------------------------------------------------- manager

MAX_SAMPLES_PER_REQUEST = 256  # the automatic split's bound (bebop serve takes up to 1024 per request)
MAX_REQUEST_BYTES = 8 << 20  # a request's estimated body (bebop serve's default limit is 16 MiB)


def _request_bytes(job: "_Job") -> int:
    """A sample's share of a batch body: its token ids as JSON (at most 7 bytes each) and its
    sampling params."""
    return 8 * len(job.ids) + 256


@dataclass(frozen=True)
class _Job:
    """One sample to generate: its prompt and its seed."""

    prompt_index: int
    ids: list
    prompt: Prompt
    seed: int


class RolloutManager:
    """Thread-safe front of the bridge for the (synchronous) trainer."""

    def __init__(self, urls: list[str], cfg, tokenizer, prompts: list[Prompt], api_key: Optional[str] = None,
                 record_topk: int = 0):
        self.cfg, self.tok, self.prompts = cfg, tokenizer, prompts
        self.source = PromptSource(prompts, cfg.train.seed)
        self.reward = reward_fn(cfg.rl.reward)
        self.record_topk = record_topk
        self._stop_ids, self._stop_strs = split_stops(self.tok, cfg.rl.stop)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="bebop-rollout", daemon=True)
        self._thread.start()
        self.bridge: RolloutBridge = self._call(self._make_bridge(urls, api_key))

    async def _make_bridge(self, urls, api_key) -> RolloutBridge:
        b = RolloutBridge(urls, api_key=api_key, health_interval=2.0)
        b.start_health_checks()
        return b

    def _call(self, coro, timeout: Optional[float] = None):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    # --------------------------------------------------------------- generation
    def submit(self, step: int) -> Future:
        """Start generating (and scoring) the batch of training step ``step``."""
        idx = self.source.indices_for_step(step, self.cfg.rl.prompts_per_step)
        return asyncio.run_coroutine_threadsafe(self._batch(step, idx, self.prompts, train=True), self.loop)

    def evaluate(self, prompts: list[Prompt], seed: int = 0) -> dict:
        """Mean reward and exact-answer rate of one sample per held-out prompt at the training
        temperature."""
        if not prompts:
            return {"reward": float("nan"), "exact": float("nan")}
        batch = self._call(self._batch(-1 - seed, list(range(len(prompts))), prompts, train=False))
        ss = batch.samples
        n = len(ss)
        out = {"reward": sum(s.reward for s in ss) / n, "exact": sum(s.reward >= 1.0 for s in ss) / n,
               "response_len": sum(len(s.response_ids) for s in ss) / n}
        fams = by_task(ss)
        if len(fams) > 1:  # a mixture: say which family moved
            out["exact_by_task"] = {t: sum(s.reward >= 1.0 for s in g) / len(g) for t, g in fams.items()}
        verify = sum(s.verify_ct for s in ss)
        if verify:  # the draft heads on these prompts (same seeds before and after RL)
            out["accept_rate"] = sum(s.accepted for s in ss) / max(sum(s.proposed for s in ss), 1)
            out["tokens_per_verify"] = sum(s.emitted_by_verify for s in ss) / verify
        return out

    def _sampling(self, seed: int) -> dict:
        r = self.cfg.rl
        return protocol.sampling_params(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                                        seed=seed, stop=self._stop_strs, stop_token_ids=self._stop_ids)

    def _payload(self, jobs: list["_Job"]) -> dict:
        """One ``/generate`` body for ``jobs``: the single form for one, SGLang's batch form for more."""
        if len(jobs) == 1:
            return protocol.generate_request(jobs[0].ids, self._sampling(jobs[0].seed), return_logprob=True,
                                             spec_records_topk=self.record_topk)
        return protocol.generate_batch_request([j.ids for j in jobs], [self._sampling(j.seed) for j in jobs],
                                               return_logprob=True, spec_records_topk=self.record_topk)

    def split(self, jobs: list["_Job"], group: int) -> list[list["_Job"]]:
        """A batch's ``/generate`` requests, in order. ``rl.samples_per_request`` > 0: that many samples
        each. 0: whole groups of ``group``, spread as evenly as they go over the healthy servers, at most
        ``MAX_SAMPLES_PER_REQUEST`` each. Either way a request's body stays under
        ``MAX_REQUEST_BYTES`` (``bebop serve`` refuses bodies over 16 MiB: long prompts, repeated per sample)."""
        per = self.cfg.rl.samples_per_request
        if per > 0:
            chunks = [jobs[i:i + per] for i in range(0, len(jobs), per)]
        else:
            groups = [jobs[i:i + group] for i in range(0, len(jobs), group)]
            cap = max(1, MAX_SAMPLES_PER_REQUEST // group)  # groups per request
            k = min(len(groups), max(len(self.bridge.healthy()), 1, -(-len(groups) // cap)))
            chunks = [[j for g in groups[len(groups) * c // k: len(groups) * (c + 1) // k] for j in g]
                      for c in range(k)]
        out = []
        for chunk in chunks:
            cur, size = [], 0
            for job in chunk:
                b = _request_bytes(job)
                if cur and size + b > MAX_REQUEST_BYTES:
                    out.append(cur)
                    cur, size = [], 0
                cur.append(job)
                size += b
            if cur:
                out.append(cur)
        return out

    async def _batch(self, step: int, indices: list[int], prompts: list[Prompt], train: bool) -> RolloutBatch:
        t0 = time.time()
        r = self.cfg.rl
        G = r.group_size if train else 1
        retries0 = self.bridge.stats.retries
        jobs = []
        for j, pi in enumerate(indices):
            ids = list(self.tok.encode(prompts[pi].text))
            for g in range(G):
                seed = (self.cfg.train.seed * 7919 + step * 1_000_003 + j * G + g) % (2**31)
                jobs.append(_Job(pi, ids, prompts[pi], seed))
        chunks = await asyncio.gather(*(self._generate(c) for c in self.split(jobs, G)))
        return RolloutBatch(step=step, samples=[s for c in chunks for s in c], prompt_indices=indices,
                            seconds=time.time() - t0, retries=self.bridge.stats.retries - retries0)

    async def _generate(self, jobs: list["_Job"]) -> list[Sample]:
        """Generate and score ``jobs`` (one request). Sequences aborted by a weight sync are re-sent,
        alone, and run entirely under the new weights; the finished ones are kept."""
        outs: list[Optional[dict]] = [None] * len(jobs)
        todo = list(range(len(jobs)))
        while todo:
            out = await self.bridge.generate(self._payload([jobs[i] for i in todo]), keep_aborted=True)
            got = out if isinstance(out, list) else [out]
            if len(got) != len(todo):
                raise RolloutError(f"server returned {len(got)} results for {len(todo)} prompts")
            for i, o in zip(todo, got):
                outs[i] = o
            todo = [i for i in todo if protocol.is_aborted(outs[i])]
            if todo:
                await asyncio.sleep(0.01)
        # scored concurrently: the code reward's sandbox runs in the executor
        return list(await asyncio.gather(*(self._sample(job, o) for job, o in zip(jobs, outs))))

    async def _sample(self, job: "_Job", out: dict) -> Sample:
        meta = protocol.parse_meta(out.get("meta_info"))
        resp = [int(t) for t in out.get("output_ids", [])]
        if len(meta.output_logprobs) != len(resp):
            raise RolloutError(f"server returned {len(meta.output_logprobs)} log-probs for {len(resp)} tokens")
        text = self.tok.decode(resp)
        if self.cfg.rl.reward == "code":  # the sandbox blocks: keep the loop free
            reward = await asyncio.get_running_loop().run_in_executor(None, self.reward, text, job.prompt.answer)
        else:
            reward = self.reward(text, job.prompt.answer)
        reached = (out.get("meta_info") or {}).get("spec_reached_per_depth") or []
        return Sample(prompt_index=job.prompt_index, prompt_ids=job.ids, response_ids=resp,
                      rollout_logprobs=meta.output_logprobs, reward=float(reward), truncated=meta.truncated,
                      weight_version=meta.version_int(), text=text, verify_ct=meta.spec.verify_ct,
                      accepted=meta.spec.accepted, proposed=meta.spec.proposed,
                      accepted_per_depth=meta.accepted_per_depth, spec_records=meta.spec_records,
                      reached_per_depth=[int(x) for x in reached], verify_tokens=meta.spec.verify_tokens,
                      plain_rounds=meta.spec.plain_rounds, gamma_sum=meta.spec.gamma_sum, task=job.prompt.task)

    # --------------------------------------------------------------- weights
    def sync_tensors(self, buckets: Iterable[dict], version: int, expect_mtp: bool) -> dict:
        return self._call(self.bridge.update_weights_from_tensor(list(buckets), str(version), expect_mtp))

    def sync_disk(self, model_path: str, version: int, expect_mtp: bool) -> dict:
        return self._call(self.bridge.update_weights_from_disk(model_path, str(version), expect_mtp))

    def init_weight_group(self, make_sender, master_address: str, master_port: int, backend: str,
                          group_name: str) -> dict:
        return self._call(self.bridge.init_weights_update_group(make_sender, master_address, master_port,
                                                                group_name, backend))

    def sync_distributed(self, buckets: Iterable[dict], version: int, expect_mtp: bool) -> dict:
        return self._call(self.bridge.update_weights_from_distributed(list(buckets), str(version), expect_mtp))

    def close(self) -> None:
        try:
            self._call(self.bridge.close(), timeout=30)
        except Exception:
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)

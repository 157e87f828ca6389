"""Async client for one or many SGLang-API servers (``bebop serve`` or real SGLang), used by RL.

* Routing: each request goes to the healthy server with the fewest requests in flight.
* Failures: a connection error, timeout or 5xx marks the server down and the request is re-sent
  to another one (4xx is the caller's error and is raised). Nothing is lost: a request either
  returns a result or raises :class:`RolloutError` once no server is left. A background health
  check brings recovered servers back.
* Weight sync: pause every server (``abort``: in-flight requests come back aborted and are
  re-sent, to run entirely under the new weights), push all buckets, set the weight version on the
  last one, check the draft (MTP) tensors were updated too, continue. A server that fails midway
  is dropped from routing until it is re-synced, so no request is served by mixed weights.
* Speculative metrics are read under every key spelling SGLang has used.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import httpx

log = logging.getLogger("bebop.bridge")

# (accepted, proposed) key pairs, newest first: >= 0.5.12, 0.5.11, <= 0.5.10
SPEC_KEY_PAIRS = (
    ("spec_num_correct_drafts", "spec_num_proposed_drafts"),
    ("spec_accepted_drafts", "spec_proposed_drafts"),
    ("spec_accept_token_num", "spec_draft_token_num"),
)


class RolloutError(RuntimeError):
    """No server could serve the request (all down), or a server rejected it (4xx)."""


@dataclass
class SpecStats:
    verify_ct: int = 0
    accepted: int = 0
    proposed: int = 0
    completion_tokens: int = 0

    @property
    def accept_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_verify(self) -> float:
        return self.completion_tokens / self.verify_ct if self.verify_ct else 0.0

    def __add__(self, o: "SpecStats") -> "SpecStats":
        return SpecStats(self.verify_ct + o.verify_ct, self.accepted + o.accepted, self.proposed + o.proposed,
                         self.completion_tokens + o.completion_tokens)


def parse_spec_metrics(meta: dict) -> SpecStats:
    """Speculative counters from a ``meta_info`` of any SGLang version (missing keys: zeros).

    When only ``spec_verify_ct`` and ``spec_accept_length`` exist (older servers), accepted drafts
    are recovered as completion_tokens - verify_ct (each verify step emits one non-draft token).
    """
    verify = int(meta.get("spec_verify_ct") or 0)
    completion = int(meta.get("completion_tokens") or 0)
    accepted = proposed = None
    for a, p in SPEC_KEY_PAIRS:
        if a in meta and meta[a] is not None:
            accepted, proposed = int(meta[a]), int(meta.get(p) or 0)
            break
    if accepted is None:
        accepted = max(completion - verify, 0) if verify else 0
        proposed = 0
    return SpecStats(verify, accepted, proposed, completion)


@dataclass
class ServerState:
    url: str
    healthy: bool = True
    inflight: int = 0
    failures: int = 0
    missed_health: int = 0  # consecutive failed health checks
    served: int = 0
    weight_version: Optional[str] = None
    needs_sync: bool = False
    last_error: str = ""


@dataclass
class BridgeStats:
    requests: int = 0
    retries: int = 0
    servers_dropped: int = 0
    spec: SpecStats = field(default_factory=SpecStats)


class RolloutBridge:
    def __init__(self, urls: Iterable[str], api_key: Optional[str] = None, timeout: float = 600.0,
                 max_attempts: int = 4, health_interval: float = 5.0, down_grace_s: float = 60.0):
        self.servers = [ServerState(u.rstrip("/")) for u in urls]
        if not self.servers:
            raise ValueError("RolloutBridge needs at least one server URL")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # idle keep-alive connections expire well before the server's keep-alive timeout, so that a
        # request never goes out on a connection the server is closing
        self.client = httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(timeout, connect=5.0),
                                        limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256,
                                                            keepalive_expiry=2.0))
        self.down_grace_s = down_grace_s
        self.max_attempts = max_attempts
        self.health_interval = health_interval
        self.stats = BridgeStats()
        self._health_task: Optional[asyncio.Task] = None
        self.weight_version: Optional[str] = None
        self._sync_idle = asyncio.Event()
        self._sync_idle.set()

    async def __aenter__(self) -> "RolloutBridge":
        self.start_health_checks()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            try:
                await self._health_task
            except (asyncio.CancelledError, Exception):
                pass
        await self.client.aclose()

    # ---------------------------------------------------------------- routing
    def healthy(self) -> list[ServerState]:
        return [s for s in self.servers if s.healthy and not s.needs_sync]

    def _pick(self, exclude: set[str]) -> ServerState:
        cands = [s for s in self.healthy() if s.url not in exclude] or self.healthy()
        if not cands:
            raise RolloutError("no healthy rollout server left: " +
                               "; ".join(f"{s.url}: {s.last_error}" for s in self.servers))
        return min(cands, key=lambda s: (s.inflight, s.served))

    def _mark_down(self, s: ServerState, err: str) -> None:
        if s.healthy:
            self.stats.servers_dropped += 1
            log.warning("rollout server %s dropped: %s", s.url, err)
        s.healthy, s.last_error = False, err
        s.failures += 1

    async def generate(self, payload: dict) -> Any:
        """POST /generate with retries on other servers; returns SGLang's JSON."""
        tried: set[str] = set()
        last = ""
        failures = 0
        while failures < self.max_attempts + len(self.servers):
            try:
                s = self._pick(tried)
            except RolloutError:
                if not self._sync_idle.is_set():  # every server is mid weight-sync: wait for it
                    await self._sync_idle.wait()
                    continue
                if await self._wait_for_recovery():  # e.g. a restarted server
                    continue
                raise
            tried.add(s.url)
            s.inflight += 1
            try:
                r = await self.client.post(s.url + "/generate", json=payload)
            except (httpx.TransportError, httpx.TimeoutException) as e:
                last = f"{type(e).__name__}: {e}"
                self.stats.retries += 1
                failures += 1
                if not await self._alive(s):  # a dropped connection from a live server is retried
                    self._mark_down(s, last)
                else:
                    tried.discard(s.url)
                continue
            finally:
                s.inflight -= 1
            if r.status_code >= 500:
                last = f"HTTP {r.status_code}: {r.text[:200]}"
                self._mark_down(s, last)
                self.stats.retries += 1
                failures += 1
                continue
            if r.status_code >= 400:
                raise RolloutError(f"{s.url} rejected the request ({r.status_code}): {r.text[:500]}")
            s.served += 1
            out = r.json()
            outs = out if isinstance(out, list) else [out]
            if any(self._aborted(o) for o in outs):
                # aborted by a weight sync (or an operator): re-send, it then runs entirely under
                # the new weights, so no sample mixes weight versions
                self.stats.retries += 1
                tried.discard(s.url)
                await asyncio.sleep(0.01)
                continue
            self.stats.requests += 1
            for o in outs:
                self.stats.spec = self.stats.spec + parse_spec_metrics(o.get("meta_info", {}))
            return out
        raise RolloutError(f"request failed after {failures} attempt(s) on {sorted(tried)}: {last}")

    async def _alive(self, s: ServerState) -> bool:
        try:
            return (await self.client.get(s.url + "/health", timeout=5.0)).status_code == 200
        except httpx.HTTPError:
            return False

    async def _wait_for_recovery(self, routable: bool = True) -> bool:
        """No usable server: poll health for up to ``down_grace_s``; True once one is back
        (routable, or merely up when ``routable`` is False, e.g. to be re-synced)."""
        deadline = time.time() + self.down_grace_s
        while time.time() < deadline:
            await self.check_health()
            if self.healthy() if routable else any(s.healthy for s in self.servers):
                return True
            await asyncio.sleep(0.5)
        return False

    @staticmethod
    def _aborted(o: dict) -> bool:
        fr = (o.get("meta_info") or {}).get("finish_reason") or {}
        return isinstance(fr, dict) and fr.get("type") == "abort"

    async def generate_many(self, payloads: list[dict]) -> list[Any]:
        return await asyncio.gather(*(self.generate(p) for p in payloads))

    # ---------------------------------------------------------------- health
    async def check_health(self) -> None:
        async def one(s: ServerState):
            try:
                r = await self.client.get(s.url + "/health", timeout=10.0)
                ok = r.status_code == 200
            except httpx.HTTPError as e:
                ok, s.last_error = False, repr(e)
            s.missed_health = 0 if ok else s.missed_health + 1
            if ok and not s.healthy:
                log.info("rollout server %s is back%s", s.url, " (needs weight sync)" if self.weight_version else "")
                s.healthy = True
                s.needs_sync = self.weight_version is not None and s.weight_version != self.weight_version
            elif not ok and s.healthy and s.missed_health >= 2:  # one slow answer (a busy CPU) is not death
                self._mark_down(s, s.last_error or "health check failed")

        await asyncio.gather(*(one(s) for s in self.servers))

    def start_health_checks(self) -> None:
        async def loop():
            while True:
                await asyncio.sleep(self.health_interval)
                await self.check_health()

        if self._health_task is None:
            self._health_task = asyncio.get_running_loop().create_task(loop())

    async def server_info(self) -> list[dict]:
        out = []
        for s in self.healthy():
            r = await self.client.get(s.url + "/get_server_info")
            out.append(r.json())
        return out

    # ---------------------------------------------------------------- weights
    async def _post(self, s: ServerState, path: str, body: dict) -> dict:
        r = await self.client.post(s.url + path, json=body)
        if r.status_code != 200:
            raise RolloutError(f"{s.url}{path} failed ({r.status_code}): {r.text[:500]}")
        return r.json()

    async def update_weights_from_tensor(self, buckets: Iterable[dict], version: str,
                                         expect_mtp: bool = True) -> dict:
        """Push weight buckets ({HF name: tensor}) to every healthy server between a pause and a
        continue; the last bucket carries the new weight version."""
        from safetensors.torch import save

        payloads = [base64.b64encode(save({k: v.detach().contiguous().cpu() for k, v in b.items()})).decode()
                    for b in buckets]
        if not payloads:
            raise ValueError("no weight buckets to send")
        return await self._sync(lambda s: self._push(s, payloads, version, expect_mtp), version)

    async def update_weights_from_disk(self, model_path: str, version: str, expect_mtp: bool = True) -> dict:
        async def push(s: ServerState):
            res = await self._post(s, "/update_weights_from_disk", {"model_path": model_path,
                                                                    "weight_version": version})
            self._check_mtp(s, res, expect_mtp)
            return res

        return await self._sync(push, version)

    async def _push(self, s: ServerState, payloads: list[str], version: str, expect_mtp: bool) -> dict:
        mtp = 0
        for i, p in enumerate(payloads):
            last = i == len(payloads) - 1
            # non-final buckets are staged (applied with the last one: versions switch atomically);
            # servers without staging (SGLang) ignore the field and apply buckets as they come
            res = await self._post(s, "/update_weights_from_tensor", {
                "serialized_named_tensors": [p], "load_format": "safetensors", "flush_cache": last,
                "weight_version": version if last else None, "stage": not last,
                "stage_version": None if last else version})
            mtp += int(res.get("num_mtp_tensors", 0))
        res = {"num_mtp_tensors": mtp}
        self._check_mtp(s, res, expect_mtp)
        return res

    @staticmethod
    def _check_mtp(s: ServerState, res: dict, expect_mtp: bool) -> None:
        # the anchor bug: a weight sync that refreshed the trunk but never the MTP draft
        if expect_mtp and "num_mtp_tensors" in res and int(res["num_mtp_tensors"]) == 0:
            raise RolloutError(f"{s.url}: weight sync updated no MTP (draft) tensors")

    async def _sync(self, push, version: str) -> dict:
        targets = [s for s in self.servers if s.healthy]
        if not targets and await self._wait_for_recovery(routable=False):
            targets = [s for s in self.servers if s.healthy]
        if not targets:
            raise RolloutError("no healthy rollout server to sync")
        t0 = time.time()
        results, failed = {}, []
        self._sync_idle.clear()
        for s in targets:
            s.needs_sync = True  # out of routing until it holds the new version
        try:
            await asyncio.gather(*(self._pause(s) for s in targets), return_exceptions=True)
            await self._push_all(targets, push, version, results, failed)
        finally:
            self._sync_idle.set()
        if len(failed) == len(targets):
            raise RolloutError(f"weight sync to every server failed: {failed}")
        self.weight_version = version
        return {"version": version, "servers": len(targets) - len(failed), "failed": failed,
                "seconds": time.time() - t0, "results": results}

    async def _push_all(self, targets, push, version, results, failed) -> None:
        async def one(s: ServerState):
            try:
                results[s.url] = await push(s)
                s.weight_version, s.needs_sync = version, False
            except Exception as e:  # this server keeps its old weights, out of routing
                failed.append(s.url)
                s.last_error = f"weight sync failed: {e}"
                log.warning("weight sync to %s failed: %s", s.url, e)
            finally:
                try:
                    await self._post(s, "/continue_generation", {})
                except Exception:
                    pass

        await asyncio.gather(*(one(s) for s in targets))

    async def _pause(self, s: ServerState) -> None:
        # abort in-flight requests: generate() re-sends them to run under the new weights
        await self._post(s, "/pause_generation", {"mode": "abort"})

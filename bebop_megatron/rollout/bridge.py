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
* Weight transports: base64 safetensors buckets (``update_weights_from_tensor``, a ``bebop
  serve`` extension: SGLang's own tensor route takes pickled CUDA-IPC handles, co-located engines
  only), a shared folder (``update_weights_from_disk``), or a torch.distributed group
  (``init_weights_update_group`` once, then ``update_weights_from_distributed`` per bucket while
  the trainer's rank 0 broadcasts). The last two are what a real SGLang server accepts. A
  ``begin_weight_update``/``end_weight_update`` session wraps every push (SGLang 0.5.23 requires
  it for tensor/distributed updates; servers without the routes skip it).
* Draft check: a sync must change the draft (MTP) weights too (sglang#27718). ``bebop serve``
  reports ``num_mtp_tensors``; for SGLang the draft runners' ``/weights_checker`` checksums are
  compared before and after.
* Speculative metrics are read under every key spelling SGLang has used (``protocol``).
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

import httpx

from bebop_megatron.rollout import protocol
from bebop_megatron.rollout.protocol import SPEC_KEY_PAIRS, SpecStats, parse_spec_metrics  # noqa: F401 (re-exported)

log = logging.getLogger("bebop.bridge")


def _num_sequences(payload: dict) -> int:
    """Sequences in a ``/generate`` body: one, or the length of SGLang's batch form."""
    for key in ("input_ids", "text"):
        v = payload.get(key)
        if isinstance(v, list) and v and isinstance(v[0], (list, str)):
            return len(v)
    return 1


class RolloutError(RuntimeError):
    """No server could serve the request (all down), or a server rejected it (4xx)."""


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
                 max_attempts: int = 4, health_interval: float = 5.0, down_grace_s: float = 60.0,
                 transport: Optional[httpx.AsyncBaseTransport] = None):
        self.servers = [ServerState(u.rstrip("/")) for u in urls]
        if not self.servers:
            raise ValueError("RolloutBridge needs at least one server URL")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # control calls (health, weights): idle keep-alive connections expire well before the
        # server's keep-alive timeout, so that a request never goes out on a connection the server is closing
        self.client = httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(timeout, connect=5.0),
                                        limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256,
                                                            keepalive_expiry=2.0), transport=transport)
        # (``transport``, for tests, replaces both pools)
        # /generate: a connection per request. httpcore 1.0's pool hands one idle HTTP/1.1 connection
        # to every request queued in the same pass (encode/httpcore#1110, #1111), and those requests
        # then run one after another on it: a burst of 128 generations on a warm pool reached the
        # server up to 12 per connection, serially (2.0 s against 0.6 s on fresh connections;
        # docs/rollout_speed.md, stop 41). A generation lasts far longer than a connect.
        self.gen_client = httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(timeout, connect=5.0),
                                            limits=httpx.Limits(max_connections=1024, max_keepalive_connections=0),
                                            transport=transport)
        self.down_grace_s = down_grace_s
        self.max_attempts = max_attempts
        self.health_interval = health_interval
        self.stats = BridgeStats()
        self._health_task: Optional[asyncio.Task] = None
        self.weight_version: Optional[str] = None
        self._sync_idle = asyncio.Event()
        self._sync_idle.set()
        self._group: Optional[dict] = None  # the torch.distributed weight-update group, once created

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
        if self._group is not None:
            try:
                await self.destroy_weights_update_group()
            except Exception as e:  # noqa: BLE001
                log.warning("destroying the weight-update group failed: %s", e)
        await self.client.aclose()
        await self.gen_client.aclose()

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

    async def generate(self, payload: dict, keep_aborted: bool = False) -> Any:
        """POST /generate with retries on other servers; returns SGLang's JSON.

        An answer with an aborted sequence (a weight sync's pause) is re-sent whole, so that it runs
        entirely under the new weights; with ``keep_aborted`` it is returned as it is, and the caller
        re-sends only the aborted sequences of a batch (``RolloutManager``: a sync then costs the
        samples it cut, not the finished ones beside them)."""
        tried: set[str] = set()
        weight = _num_sequences(payload)  # routing counts sequences in flight, not requests
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
            s.inflight += weight
            try:
                r = await self.gen_client.post(s.url + "/generate", json=payload)
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
                s.inflight -= weight
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
            aborted = sum(self._aborted(o) for o in outs)
            if aborted and keep_aborted:
                self.stats.retries += aborted  # the caller re-sends them
            elif aborted:
                # aborted by a weight sync (or an operator): re-send, it then runs entirely under
                # the new weights, so no sample mixes weight versions
                self.stats.retries += aborted
                tried.discard(s.url)
                await asyncio.sleep(0.01)
                continue
            self.stats.requests += 1
            for o in outs:
                if not self._aborted(o):
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
        return protocol.is_aborted(o)

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
        out = r.json()
        if isinstance(out, dict) and out.get("success") is False:  # SGLang's failure shape
            raise RolloutError(f"{s.url}{path} failed: {out.get('message')}")
        return out

    async def _post_optional(self, s: ServerState, path: str, body: dict) -> Optional[dict]:
        """A route some servers lack (404/405: None); other failures raise."""
        r = await self.client.post(s.url + path, json=body)
        if r.status_code in (404, 405):
            return None
        if r.status_code != 200:
            raise RolloutError(f"{s.url}{path} failed ({r.status_code}): {r.text[:500]}")
        out = r.json()
        if isinstance(out, dict) and out.get("success") is False:
            raise RolloutError(f"{s.url}{path} failed: {out.get('message')}")
        return out

    async def update_weights_from_tensor(self, buckets: Iterable[dict], version: str,
                                         expect_mtp: bool = True) -> dict:
        """Push weight buckets ({HF name: tensor}) to every healthy server between a pause and a
        continue; the last bucket carries the new weight version. ``bebop serve`` only (base64
        safetensors); SGLang's tensor route takes pickled tensors from a co-located trainer."""
        from safetensors.torch import save

        payloads = [base64.b64encode(save({k: v.detach().contiguous().cpu() for k, v in b.items()})).decode()
                    for b in buckets]
        if not payloads:
            raise ValueError("no weight buckets to send")
        return await self._sync(lambda s: self._push(s, payloads, version, expect_mtp), version)

    async def update_weights_from_disk(self, model_path: str, version: str, expect_mtp: bool = True) -> dict:
        """Every server loads ``model_path`` (a folder they all see); works with SGLang."""
        async def push(s: ServerState):
            before = await self._draft_checksums(s) if expect_mtp else None
            res = await self._post(s, "/update_weights_from_disk",
                                   protocol.update_weights_from_disk_request(model_path, version))
            await self._check_mtp(s, res, expect_mtp, before)
            return res

        return await self._sync(push, version)

    async def _push(self, s: ServerState, payloads: list[str], version: str, expect_mtp: bool) -> dict:
        mtp = 0
        async with self._session(s):
            for i, p in enumerate(payloads):
                last = i == len(payloads) - 1
                # non-final buckets are staged (applied with the last one: versions switch atomically)
                res = await self._post(s, "/update_weights_from_tensor", protocol.update_weights_from_tensor_request(
                    p, version if last else None, flush_cache=last, stage_version=None if last else version))
                mtp += int(res.get("num_mtp_tensors", 0))
        res = {"num_mtp_tensors": mtp}
        await self._check_mtp(s, res, expect_mtp, None)
        return res

    # ---------------------------------------------------------------- distributed weights
    async def init_weights_update_group(self, make_sender: Callable[[int], Any], master_address: str,
                                        master_port: int, group_name: str = protocol.DEFAULT_GROUP,
                                        backend: str = "nccl") -> dict:
        """Create the torch.distributed group trainer-rank-0 + every healthy server (each server
        joins with its TP ranks at ``rank_offset``). ``make_sender(world_size)`` returns the
        trainer's end (``init()``, ``broadcast(bucket)``, ``destroy()``), whose ``init`` runs in a
        thread while the servers join."""
        targets = [s for s in self.servers if s.healthy]
        if not targets:
            raise RolloutError("no healthy rollout server to join the weight-update group")
        sizes = [await self._tp_size(s) for s in targets]
        world = 1 + sum(sizes)
        sender = make_sender(world)
        offsets = [1 + sum(sizes[:i]) for i in range(len(targets))]
        joins = [self._post(s, "/init_weights_update_group", protocol.init_weights_update_group_request(
            master_address, master_port, off, world, group_name, backend)) for s, off in zip(targets, offsets)]
        res = await asyncio.gather(asyncio.to_thread(sender.init), *joins, return_exceptions=True)
        errors = [repr(e) for e in res if isinstance(e, BaseException)]
        if errors:
            raise RolloutError(f"init_weights_update_group failed: {errors}")
        self._group = {"sender": sender, "servers": [s.url for s in targets], "name": group_name}
        return {"world_size": world, "servers": [s.url for s in targets], "rank_offsets": offsets}

    async def destroy_weights_update_group(self) -> None:
        g, self._group = getattr(self, "_group", None), None
        if g is None:
            return
        for s in self.servers:
            if s.url in g["servers"]:
                try:
                    await self._post(s, "/destroy_weights_update_group",
                                     protocol.destroy_weights_update_group_request(g["name"]))
                except Exception as e:  # noqa: BLE001 - a dead server has no group left to destroy
                    log.warning("destroy_weights_update_group on %s: %s", s.url, e)
        await asyncio.to_thread(g["sender"].destroy)

    async def update_weights_from_distributed(self, buckets: Iterable[dict], version: str,
                                              expect_mtp: bool = True) -> dict:
        """Push buckets through the weight-update group: for each bucket, every server gets its
        names/dtypes/shapes while the trainer's rank 0 broadcasts the tensors. A collective: it
        succeeds on every member or fails for all (the group must then be re-created)."""
        g = getattr(self, "_group", None)
        if g is None:
            raise RolloutError("no weight-update group: call init_weights_update_group first")
        buckets = [b for b in buckets if b]
        if not buckets:
            raise ValueError("no weight buckets to send")
        by_url = {s.url: s for s in self.servers}
        targets = [by_url[u] for u in g["servers"]]
        down = [s.url for s in targets if not s.healthy]
        if down:
            raise RolloutError(f"weight-update group member(s) down: {down}; re-create the group")
        sender = g["sender"]
        t0 = time.time()
        self._sync_idle.clear()
        for s in targets:
            s.needs_sync = True
        results: dict[str, dict] = {s.url: {"num_tensors": 0, "num_mtp_tensors": None} for s in targets}
        try:
            await asyncio.gather(*(self._pause(s) for s in targets), return_exceptions=True)
            before = {s.url: await self._draft_checksums(s) for s in targets} if expect_mtp else {}
            sessions = [self._session(s) for s in targets]
            for cm in sessions:
                await cm.__aenter__()
            try:
                for i, b in enumerate(buckets):
                    last = i == len(buckets) - 1
                    names, dtypes, shapes = protocol.tensor_meta(b.items())
                    body = protocol.update_weights_from_distributed_request(
                        names, dtypes, shapes, version if last else None, group_name=g["name"], flush_cache=last)
                    out = await asyncio.gather(asyncio.to_thread(sender.broadcast, b),
                                               *(self._post(s, "/update_weights_from_distributed", body)
                                                 for s in targets), return_exceptions=True)
                    errors = [repr(e) for e in out if isinstance(e, BaseException)]
                    if errors:
                        raise RolloutError(f"update_weights_from_distributed failed: {errors}")
                    for s, res in zip(targets, out[1:]):
                        r = results[s.url]
                        r["num_tensors"] += int(res.get("num_tensors", len(names)))
                        if "num_mtp_tensors" in res:
                            r["num_mtp_tensors"] = (r["num_mtp_tensors"] or 0) + int(res["num_mtp_tensors"])
            finally:
                for cm in sessions:
                    await cm.__aexit__(None, None, None)
            for s in targets:
                res = {k: v for k, v in results[s.url].items() if v is not None}
                await self._check_mtp(s, res, expect_mtp, before.get(s.url))
                s.weight_version, s.needs_sync = version, False
        except Exception as e:
            self._group = None  # a broken collective: the group must be re-created (under a new name)
            for s in targets:
                try:
                    await self.client.post(s.url + "/destroy_weights_update_group", timeout=10.0,
                                           json=protocol.destroy_weights_update_group_request(g["name"]))
                except httpx.HTTPError:
                    pass
            for s in targets:
                s.last_error = f"distributed weight sync failed: {e}"
            raise RolloutError(f"distributed weight sync failed: {e}") from e
        finally:
            self._sync_idle.set()
            for s in targets:
                try:
                    await self._post(s, "/continue_generation", {})
                except Exception:
                    pass
        self.weight_version = version
        return {"version": version, "servers": len(targets), "failed": [], "seconds": time.time() - t0,
                "results": results}

    async def _tp_size(self, s: ServerState) -> int:
        try:
            r = await self.client.get(s.url + "/get_server_info", timeout=30.0)
            info = r.json() if r.status_code == 200 else {}
        except (httpx.HTTPError, ValueError):
            info = {}
        return int(info.get("tp_size") or 1)

    # ---------------------------------------------------------------- draft check, sessions
    def _session(self, s: ServerState):
        bridge = self

        class _Session:  # begin_weight_update ... end_weight_update, where the server has them
            opened = False

            async def __aenter__(self):
                self.opened = await bridge._post_optional(s, "/begin_weight_update",
                                                          protocol.begin_weight_update_request()) is not None
                return self

            async def __aexit__(self, *exc):
                if self.opened:
                    await bridge._post_optional(s, "/end_weight_update", {})

        return _Session()

    async def _draft_checksums(self, s: ServerState) -> Optional[dict]:
        """The draft runners' checksums (SGLang's /weights_checker), None where unavailable."""
        try:
            r = await self.client.post(s.url + "/weights_checker", json=protocol.weights_checksum_request("draft"))
            if r.status_code != 200:
                return None
            return protocol.draft_checksums(r.json()) or None
        except (httpx.HTTPError, ValueError):
            return None

    async def _check_mtp(self, s: ServerState, res: dict, expect_mtp: bool, before: Optional[dict]) -> None:
        """The anchor bug: a weight sync that refreshed the trunk but never the MTP draft."""
        if not expect_mtp:
            return
        if "num_mtp_tensors" in res:  # bebop serve counts them
            if int(res["num_mtp_tensors"]) == 0:
                raise RolloutError(f"{s.url}: weight sync updated no MTP (draft) tensors")
            return
        if before:  # SGLang: the draft's checksums must have moved
            after = await self._draft_checksums(s)
            if after is not None and after == before:
                raise RolloutError(f"{s.url}: weight sync left the draft (MTP) weights unchanged "
                                   "(see sglang#27718)")
            return
        log.warning("%s: cannot verify that the draft (MTP) weights were updated (no num_mtp_tensors, "
                    "no /weights_checker)", s.url)

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
            raise RolloutError("weight sync to every server failed: " +
                               "; ".join(s.last_error for s in targets if s.url in failed))
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
        await self._post(s, "/pause_generation", protocol.pause_request("abort"))

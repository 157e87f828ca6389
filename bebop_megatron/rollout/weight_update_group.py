"""torch.distributed weight-update groups: SGLang's ``init_weights_update_group`` /
``update_weights_from_distributed`` / ``destroy_weights_update_group`` contract, both ends.

The trainer's rank 0 is rank 0 of a separate process group (its own TCP rendezvous at
``master_address:master_port``, keys prefixed with ``group_name``); each rollout server joins
with ``rank = rank_offset + tp_rank``. For every bucket the client POSTs ``{names, dtypes,
shapes}`` to each server and, at the same time, rank 0 broadcasts the tensors one by one in that
order; the receivers allocate empty tensors and join the broadcasts (SGLang's default
``load_format``). NCCL on GPUs, gloo on CPUs (tests).

:func:`init_custom_process_group` is the helper SGLang and OpenRLHF use to create a second
"world" next to (or without) the default process group; both ends must use the same rendezvous,
so the trainer uses it too.
"""


import logging
import threading
from datetime import timedelta
from typing import Optional

import torch

log = logging.getLogger("bebop.weight_update_group")


def init_custom_process_group(backend: str, init_method: str, world_size: int, rank: int, group_name: str,
                              timeout: Optional[timedelta] = None):
    """A process group of its own (not the default one), rendezvous at ``init_method``
    (``tcp://host:port``, rank 0 hosts the store), as SGLang's ``init_custom_process_group``."""
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        default_pg_timeout,
        rendezvous,
    )

    timeout = timeout or default_pg_timeout
    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                      backend_options=None, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def _dtype(name) -> torch.dtype:
    dt = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
        raise ValueError(f"unsupported dtype {name!r} (floating-point torch dtype names only)")
    return dt


class WeightUpdateGroups:
    """The receiving end, in ``bebop serve``: named groups, each joined as one rank."""

    def __init__(self, device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        self.groups: dict[str, object] = {}
        self._lock = threading.Lock()

    def init(self, body: dict, timeout: Optional[timedelta] = None) -> tuple[bool, str]:
        """Join a group (blocks until every member has joined). Returns (success, message)."""
        try:
            addr, port = body["master_address"], int(body["master_port"])
            rank_offset, world = int(body["rank_offset"]), int(body["world_size"])
        except (KeyError, TypeError, ValueError) as e:
            return False, f"init_weights_update_group needs master_address, master_port, rank_offset, world_size: {e}"
        name = body.get("group_name") or "weight_update_group"
        backend = body.get("backend") or "nccl"
        if backend not in ("nccl", "gloo"):
            return False, f"backend must be nccl or gloo, got {backend!r}"
        if backend == "nccl" and not torch.cuda.is_available():
            return False, "backend nccl needs CUDA; this server runs on CPU: use backend gloo"
        if not (1 <= rank_offset < world):
            return False, f"rank_offset {rank_offset} must be in [1, world_size={world}) (rank 0 is the trainer)"
        with self._lock:
            if name in self.groups:
                return False, f"group {name!r} already exists: destroy it first"
        try:
            pg = init_custom_process_group(backend, f"tcp://{addr}:{port}", world, rank_offset, name, timeout)
        except Exception as e:  # noqa: BLE001 - reported to the client
            log.warning("init_weights_update_group %s failed: %s", name, e)
            return False, f"Failed to initialize custom process group: {e}."
        with self._lock:
            self.groups[name] = (pg, torch.device("cuda") if backend == "nccl" else torch.device("cpu"))
        return True, "Succeeded to initialize custom process group."

    @staticmethod
    def parse_meta(body: dict) -> tuple[str, list[str], list[torch.dtype], list[list[int]]]:
        names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)
                and len(names) == len(dtypes) == len(shapes) and names):
            raise ValueError("names, dtypes and shapes must be non-empty lists of one length")
        if not all(isinstance(n, str) for n in names):
            raise ValueError("names must be strings")
        dts = [_dtype(d) for d in dtypes]
        shp = []
        for s in shapes:
            if not (isinstance(s, list) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in s)):
                raise ValueError(f"bad shape {s!r}")
            shp.append(list(s))
        return body.get("group_name") or "weight_update_group", names, dts, shp

    def receive(self, group_name: str, names: list[str], dtypes: list[torch.dtype],
                shapes: list[list[int]]) -> dict[str, torch.Tensor]:
        """Join rank 0's broadcasts, one per tensor in order; returns CPU tensors by name."""
        import torch.distributed as dist

        with self._lock:
            if group_name not in self.groups:
                raise KeyError(f"group {group_name!r} does not exist: call init_weights_update_group first")
            pg, dev = self.groups[group_name]
        out, handles = [], []
        for n, dt, s in zip(names, dtypes, shapes):
            t = torch.empty(s, dtype=dt, device=dev)
            handles.append(dist.broadcast(t, src=0, group=pg, async_op=True))
            out.append((n, t))
        for h in handles:
            h.wait()
        return {n: t.cpu() for n, t in out}

    def destroy(self, group_name: str) -> tuple[bool, str]:
        import torch.distributed as dist

        with self._lock:
            entry = self.groups.pop(group_name, None)
        if entry is None:
            return False, "The group to be destroyed does not exist."
        try:
            dist.destroy_process_group(entry[0])
        except Exception as e:  # noqa: BLE001
            return False, f"Failed to destroy custom process group: {e}."
        return True, "Succeeded to destroy custom process group."


class WeightUpdateSender:
    """The trainer's end (rank 0): create the group, broadcast buckets, destroy it."""

    def __init__(self, master_address: str, master_port: int, world_size: int,
                 group_name: str = "weight_update_group", backend: str = "gloo",
                 timeout: Optional[timedelta] = None):
        self.master_address, self.master_port = master_address, int(master_port)
        self.world_size, self.group_name, self.backend = int(world_size), group_name, backend
        self.timeout = timeout
        self.pg = None
        self.device = torch.device("cuda") if backend == "nccl" else torch.device("cpu")

    def init(self) -> None:
        """Blocks until every receiver has joined (call it while the servers' init requests run)."""
        self.pg = init_custom_process_group(self.backend, f"tcp://{self.master_address}:{self.master_port}",
                                            self.world_size, 0, self.group_name, self.timeout)

    def broadcast(self, bucket: dict[str, torch.Tensor]) -> None:
        """Broadcast a bucket's tensors in its iteration order (the order of the request's names)."""
        import torch.distributed as dist

        if self.pg is None:
            raise RuntimeError("weight-update group not initialised")
        handles, keep = [], []
        for t in bucket.values():
            t = t.detach().to(self.device).contiguous()
            keep.append(t)
            handles.append(dist.broadcast(t, src=0, group=self.pg, async_op=True))
        for h in handles:
            h.wait()

    def destroy(self) -> None:
        import torch.distributed as dist

        if self.pg is not None:
            try:
                dist.destroy_process_group(self.pg)
            finally:
                self.pg = None


def register_routes(app, server) -> None:
    """``bebop serve``'s three SGLang routes over :class:`WeightUpdateGroups`. Answers follow
    SGLang (``{success, message}``, 400 on failure); a successful update also reports
    ``num_tensors``/``num_mtp_tensors``/``weight_version`` like the other weight routes."""
    import asyncio

    from fastapi import Request as HTTPRequest
    from fastapi.responses import JSONResponse

    from bebop_megatron.rollout.server import BadRequest, _json_object

    device = next(server.engine.model.parameters()).device
    groups = WeightUpdateGroups(device)
    server.weight_update_groups = groups

    def answer(ok: bool, message: str, **extra):
        return JSONResponse({"success": ok, "message": message, **extra}, status_code=200 if ok else 400)

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: HTTPRequest):
        body = await _json_object(request)
        return answer(*(await asyncio.to_thread(groups.init, body)))

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: HTTPRequest):
        body = await _json_object(request)
        if body.get("load_format") not in (None, "direct"):
            return answer(False, f"load_format {body['load_format']!r} is not supported (one broadcast per tensor)")
        try:
            group, names, dtypes, shapes = groups.parse_meta(body)
        except ValueError as e:
            return answer(False, str(e))
        try:
            tensors = await asyncio.to_thread(groups.receive, group, names, dtypes, shapes)
        except KeyError as e:
            return answer(False, str(e.args[0]))
        except Exception as e:  # noqa: BLE001 - a broken group: the client re-initialises it
            return answer(False, f"Failed to receive weights: {e}")
        try:
            res = await asyncio.to_thread(server._apply_weights, tensors, body.get("weight_version"),
                                          body.get("flush_cache", True))
        except BadRequest as e:
            return answer(False, str(e))
        return answer(True, "Succeeded to update parameter online.", num_tensors=res["num_tensors"],
                      num_mtp_tensors=res["num_mtp_tensors"], weight_version=res["weight_version"])

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: HTTPRequest):
        body = await _json_object(request, allow_empty=True)
        return answer(*groups.destroy(body.get("group_name") or "weight_update_group"))

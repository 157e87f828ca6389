"""The local multi-process launcher hands results back as plain bytes, never shared-memory handles."""

import pickle

import torch

from bebop_megatron.parallel import _local_worker, run_local_workers


class _ListQueue(list):
    def put(self, item):
        self.append(item)


def _tensor_result(rank: int, world_size: int, n: int) -> dict:
    return {"rank": rank, "t": torch.arange(n, dtype=torch.float32) * (rank + 1)}


def test_worker_result_crosses_as_bytes():
    # A tensor put on a torch.multiprocessing queue travels as a shared-memory handle that dies with
    # the worker (the FileNotFoundError race); the worker must serialise it by value instead.
    q = _ListQueue()
    _local_worker(_tensor_result, 0, 1, 0, (5,), q)
    (rank, status, payload), = q
    assert (rank, status) == (0, "ok") and isinstance(payload, bytes)
    assert torch.equal(pickle.loads(payload)["t"], torch.arange(5, dtype=torch.float32))


def test_run_local_workers_returns_tensors_after_workers_exit():
    out = run_local_workers(_tensor_result, 2, 1000, timeout=300)
    assert [o["rank"] for o in out] == [0, 1]
    assert torch.equal(out[1]["t"], 2 * torch.arange(1000, dtype=torch.float32))


def _die(rank: int, world_size: int) -> None:
    if rank == 1:
        import os

        os._exit(3)  # dies without reporting, as a killed worker or one that fails to start would
    return None


def test_worker_that_dies_without_a_result_fails_fast():
    import time

    import pytest

    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1 \(exit code 3\)"):
        run_local_workers(_die, 2, timeout=600)
    assert time.monotonic() - t0 < 60  # not the 600 s timeout


def test_workers_are_spawned_where_cuda_is_available(monkeypatch):
    # A forkserver child of a CUDA-initialised server cannot use CUDA (seen on an H200); with CUDA
    # present the workers are spawned, and the spawn path runs end to end (here on CPU).
    import bebop_megatron.parallel as par

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert par.worker_start_method() == "forkserver"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert par.worker_start_method() == "spawn"
    monkeypatch.setattr(par, "worker_start_method", lambda: "spawn")
    out = run_local_workers(_tensor_result, 1, 3, timeout=300)
    assert torch.equal(out[0]["t"], torch.arange(3, dtype=torch.float32))

"""Tests run N gloo ranks through the package's own local launcher."""

from bebop_megatron.parallel import run_local_workers


def run_distributed(fn, world_size: int, *args, timeout: float = 600.0) -> list:
    try:
        return run_local_workers(fn, world_size, *args, timeout=timeout)
    except RuntimeError as e:
        raise AssertionError(str(e)) from None

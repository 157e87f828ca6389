"""Start and stop local ``bebop serve`` processes (the embedded rollout engine behind HTTP).

The RL trainer uses these when no server URLs are configured, like slime starts its SGLang
engines. Each server is a child process bound to 127.0.0.1 on a free port; on Linux it receives
SIGTERM when its parent dies (``PR_SET_PDEATHSIG``), so a killed trainer leaves no orphans.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import httpx

from bebop_megatron.parallel import free_port
from bebop_megatron.rollout.protocol import server_command


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class LocalServer:
    def __init__(self, model_path: str | Path, extra_args: Sequence[str] = (), log_dir: Optional[Path] = None,
                 threads: Optional[int] = 1, api_key: Optional[str] = None,
                 command: Optional[Callable[[int], list[str]]] = None):
        """``command(port)`` gives the full command line (``protocol.server_command``); by default
        ``bebop serve`` on ``model_path`` with ``extra_args``."""
        self.model_path = Path(model_path)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        # our own server gets the key through its environment (BEBOP_API_KEY), never on the command
        # line, which any local user can read in /proc/PID/cmdline
        self.cmd = command(self.port) if command is not None else server_command(
            None, "bebop", model_path=str(model_path), port=self.port, extra=extra_args)
        log_dir = Path(log_dir or self.model_path)
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"server-{self.port}.log"
        self._log = open(self.log_path, "w")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if api_key and command is None:
            env["BEBOP_API_KEY"] = api_key
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)  # torch's intra-op threads (None: torch's default)
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)

    def wait_ready(self, timeout: float = 180.0) -> None:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"rollout server exited early (code {self.proc.returncode}); "
                                   f"log {self.log_path}:\n{self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2, headers=headers).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"rollout server {self.url} did not come up in {timeout:.0f}s (log {self.log_path})")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """Hard kill (fault injection)."""
        if self.alive():
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.alive():
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def start_local_servers(model_path: str | Path, n: int, extra_args: Sequence[str] = (), log_dir=None,
                        threads: int = 1, api_key: Optional[str] = None,
                        command: Optional[Callable[[int], list[str]]] = None) -> list[LocalServer]:
    """Start ``n`` servers in parallel and wait until every one answers /health."""
    servers = [LocalServer(model_path, extra_args, log_dir, threads, api_key, command) for _ in range(n)]
    try:
        for s in servers:
            s.wait_ready()
    except Exception:
        for s in servers:
            s.stop()
        raise
    return servers

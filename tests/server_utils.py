"""Start `bebop serve` as a real process on loopback and wait until it answers."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from bebop_megatron.parallel import free_port

ROOT = Path(__file__).resolve().parents[1]


class ServerProcess:
    def __init__(self, model_path, *extra, api_key=None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "bebop_megatron.cli", "serve", "--model-path", str(model_path),
               "--port", str(self.port), *extra]
        if api_key:
            cmd += ["--api-key", api_key]
        self.log = open(Path(model_path) / f"server-{self.port}.log", "w")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{Path(self.log.name).read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError("server did not come up")

    def post(self, path, json=None, **kw):
        return httpx.post(self.url + path, json=json, headers=self.headers, timeout=kw.pop("timeout", 120), **kw)

    def get(self, path, **kw):
        return httpx.get(self.url + path, headers=self.headers, timeout=kw.pop("timeout", 60), **kw)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()

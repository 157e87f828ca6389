"""Run untrusted generated Python in a subprocess sandbox.

Layers (each one alone is not enough; together they contain the usual failure modes):

* an audit hook installed before the program runs (``sys.addaudithook`` cannot be removed):
  no sockets, no process creation (fork/exec/spawn/subprocess/os.system), no ctypes, no writes,
  deletes or renames outside the sandbox folder;
* resource limits: CPU seconds, address space, file size, core dumps off, number of processes;
  when started as root (and the interpreter is world-readable) the child drops to ``nobody`` so
  the process limit applies and the file system outside its own folder is not writable;
* its own session: on timeout or at the end the whole process group is killed;
* a fresh network namespace (``unshare -n``) where the machine allows it;
* a temporary working folder, a minimal environment, output to size-capped files.
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

_PREAMBLE = r'''
import sys, os
# load what solutions commonly import while the interpreter's files are certainly readable
import runpy, re, json, math, collections, itertools, functools, heapq, bisect, string, random, typing
import dataclasses, fractions, decimal, statistics, copy, operator, array, time, datetime
_drop = os.environ.pop("BEBOP_SANDBOX_DROP", "")
if _drop and os.getuid() == 0:  # after `unshare -n` (which needs root), before any user code
    _uid, _gid = (int(x) for x in _drop.split(":"))
    os.setgroups([])
    os.setgid(_gid)
    os.setuid(_uid)
_root = os.path.realpath(os.getcwd())
_blocked = ("socket.", "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
            "os.forkpty", "pty.", "ctypes.", "os.kill", "os.killpg", "signal.pthread_kill", "shutil.")
_fs = ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.symlink", "os.link",
       "os.truncate", "os.utime")
def _inside(p):
    try:
        return os.path.realpath(os.fsdecode(p)).startswith(_root + os.sep)
    except Exception:
        return False
def _hook(event, args):
    if event.startswith(_blocked) or event in ("import",) and args and str(args[0]).split(".")[0] in ("ctypes", "_ctypes"):
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "open" and args:
        path, mode = args[0], args[1] if len(args) > 1 else "r"
        flags = args[2] if len(args) > 2 else 0
        writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC))
        if writing and isinstance(path, (str, bytes, os.PathLike)) and not _inside(path):
            raise PermissionError(f"sandbox: writing {path!r} is not allowed")
    if event in _fs and args and isinstance(args[0], (str, bytes, os.PathLike)) and not _inside(args[0]):
        raise PermissionError(f"sandbox: {event} outside the sandbox is not allowed")
sys.addaudithook(_hook)
del _hook
import runpy
runpy.run_path("solution.py", run_name="__main__")
'''


@dataclass
class SandboxLimits:
    cpu_seconds: int = 2
    wall_seconds: float = 5.0
    memory_mb: int = 512
    output_bytes: int = 64 * 1024
    file_mb: int = 8
    max_processes: int = 16


@dataclass
class SandboxResult:
    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    truncated: bool
    seconds: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


@lru_cache(maxsize=1)
def _netns_prefix() -> tuple[str, ...]:
    """``unshare -n`` (or ``-rn`` without root) when the machine allows it, else nothing."""
    exe = shutil.which("unshare")
    if not exe:
        return ()
    for flags in (("-n",), ("-rn",)):
        try:
            if subprocess.run([exe, *flags, "true"], capture_output=True, timeout=10).returncode == 0:
                return (exe, *flags)
        except (OSError, subprocess.SubprocessError):
            pass
    return ()


@lru_cache(maxsize=1)
def _interpreter_world_readable() -> bool:
    """Dropping to ``nobody`` only works if it can still read the interpreter and its stdlib
    (not so for a Python under /root, e.g. pyenv); otherwise the audit hook alone guards."""
    import stat
    import sysconfig

    for top in {sysconfig.get_paths()["stdlib"], os.path.dirname(os.path.realpath(sys.executable))}:
        p = Path(top).resolve()
        for d in [p, *p.parents]:
            mode = d.stat().st_mode
            if not (mode & stat.S_IROTH and mode & stat.S_IXOTH):
                return False
    return True


def _limit(limits: SandboxLimits):
    def apply() -> None:
        os.setsid()
        mem = limits.memory_mb << 20
        resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_seconds, limits.cpu_seconds + 1))
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_mb << 20, limits.file_mb << 20))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_NPROC, (limits.max_processes, limits.max_processes))

    return apply


def run_python(code: str, stdin: str = "", limits: SandboxLimits | None = None) -> SandboxResult:
    """Run ``code`` as a script in the sandbox; returns exit code, capped output, timing."""
    limits = limits or SandboxLimits()
    work = Path(tempfile.mkdtemp(prefix="bebop_sandbox_"))
    drop_to = None
    if os.geteuid() == 0 and _interpreter_world_readable():
        drop_to = (65534, 65534)  # nobody / nogroup
        os.chown(work, *drop_to)
    try:
        (work / "solution.py").write_text(code)
        (work / "sandbox_main.py").write_text(_PREAMBLE)
        (work / "stdin.txt").write_text(stdin)
        out_f, err_f = work / "stdout.txt", work / "stderr.txt"
        env = {"PATH": "/usr/bin:/bin", "HOME": str(work), "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
        if drop_to is not None:
            env["BEBOP_SANDBOX_DROP"] = f"{drop_to[0]}:{drop_to[1]}"
        cmd = [*_netns_prefix(), sys.executable, "-I", "sandbox_main.py"]
        t0 = time.time()
        with open(work / "stdin.txt", "rb") as fin, open(out_f, "wb") as fout, open(err_f, "wb") as ferr:
            proc = subprocess.Popen(cmd, cwd=work, stdin=fin, stdout=fout, stderr=ferr, env=env,
                                    preexec_fn=_limit(limits), close_fds=True)
            timed_out = False
            try:
                proc.wait(timeout=limits.wall_seconds)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_group(proc)
        seconds = time.time() - t0
        out, t1 = _read_capped(out_f, limits.output_bytes)
        err, t2 = _read_capped(err_f, limits.output_bytes)
        rc = proc.returncode if proc.returncode is not None else -signal.SIGKILL
        return SandboxResult(rc, out, err, timed_out or rc == -signal.SIGXCPU, t1 or t2, seconds)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()


def _read_capped(path: Path, limit: int) -> tuple[str, bool]:
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    return data[:limit].decode("utf-8", "replace"), len(data) > limit

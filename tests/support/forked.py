"""Small multi-process test jobs whose processes are forked from one warm image instead of started as fresh
interpreters: ``import torch`` and its distributed modules cost 3-5 s of CPU per process here, which a test module
launching a few jobs of 2-4 processes paid for every process. The idea of worker.fork_server (whose ``become`` runs
each process as a fresh ``python`` would), without tmd: the launcher forks each process once and waits for it.

    with Launcher(["torch.distributed.fsdp"], env) as launcher:   # imports torch, the worker package and these once
        codes = launcher.run([{"argv": [python, "-m", "examples.x", ...], "env": {...}, "cwd": dir, "log": path},
                              ...])

:meth:`Launcher.run` forks every process of one job at once and returns their exit codes once all ended, in order (a
signal's as ``-N``, as subprocess reports it). A process's stdout and stderr go to its ``log`` file; ``argv`` is
``python [-u] script.py ARGS`` or ``python [-u] -m module ARGS``; ``env`` is its whole environment. As with a fork
server, the processes share the launcher's imported modules and PYTHONHASHSEED: what torch reads at import
(``OMP_NUM_THREADS``...) belongs to the launcher's environment ``env``.

Protocol (the launcher's stdin and stdout, JSON lines, from the test process only): ``{"procs": [request, ...]}``
is answered ``{"rc": [code, ...]}``; the launcher exits when its stdin closes.
"""
from __future__ import annotations

import importlib
import json
import multiprocessing
import os
import select
import signal
import socket
import subprocess
import sys
from typing import Mapping, Optional, Sequence

from worker import fork_server
from worker.exit import flush_stdio

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def torchrun_env() -> dict[str, str]:
    """The environment of a launcher for torchrun-style plain jobs (:func:`torchrun`): this process's, one thread
    per process (``OMP_NUM_THREADS``, read when torch is imported), gloo on the loopback interface unless set, this
    repository importable, and no ``TM_PLAIN``."""
    env = {k: v for k, v in os.environ.items() if k != "TM_PLAIN"}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return env


def torchrun(launcher: "Launcher", argv: list[str], world: int, log_dir: str) -> list[subprocess.CompletedProcess]:
    """Run ``argv`` (``python -m module ...``) on ``world`` ranks forked by ``launcher`` (started with
    :func:`torchrun_env`), each with torchrun's variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``MASTER_ADDR``, ``MASTER_PORT``: a free port); every rank's result, its log (``log_dir/rank<r>.log``, both
    streams) as stdout and stderr."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.makedirs(log_dir, exist_ok=True)
    procs = [{"argv": argv, "env": dict(torchrun_env(), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                                        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)),
              "cwd": REPO, "log": os.path.join(log_dir, f"rank{rank}.log")} for rank in range(world)]
    results = []
    for proc, code in zip(procs, launcher.run(procs)):
        with open(proc["log"], errors="replace") as f:
            log = f.read()
        results.append(subprocess.CompletedProcess(argv, code, log, log))
    return results


def forkserver(*modules: str) -> str:
    """The start method for ``torch.multiprocessing.start_processes`` whose processes are forked from
    multiprocessing's fork server once it imported torch, torch.distributed and ``modules`` (instead of "spawn":
    a fresh interpreter importing them for each process). The preload list counts when that server starts, on its
    first use in this process, and its processes get the environment this process had then."""
    multiprocessing.set_forkserver_preload(["torch", "torch.distributed", *modules])
    return "forkserver"


class Launcher:
    """The test's end: starts ``python -m tests.support.forked PRELOAD...`` with environment ``env`` (this
    process's when None). Raises RuntimeError from :meth:`run` if the launcher died."""

    def __init__(self, preload: Sequence[str] = (), env: Optional[Mapping[str, str]] = None) -> None:
        # a session of its own: its forked processes are in its process group, which close() can kill at once
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.support.forked", *preload], cwd=REPO,
                                     env=None if env is None else dict(env), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, start_new_session=True)

    def run(self, procs: list[dict], timeout_s: float = 300.0) -> list[int]:
        """Fork ``procs`` (requests as in the module docstring), wait for every one; their exit codes. After
        ``timeout_s`` seconds the launcher and every process it forked are killed (TimeoutError)."""
        self.proc.stdin.write(json.dumps({"procs": procs}) + "\n")
        self.proc.stdin.flush()
        if not select.select([self.proc.stdout], [], [], timeout_s)[0]:
            self.kill()
            raise TimeoutError(f"the job's processes did not end within {timeout_s} s: killed")
        reply = self.proc.stdout.readline()
        if not reply:
            raise RuntimeError(f"the test launcher exited with {self.proc.wait()}")
        return json.loads(reply)["rc"]

    def kill(self) -> None:
        """SIGKILL the launcher and every process it forked (its process group)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def close(self) -> None:
        """End the launcher (it exits once its stdin closes); processes still running after 30 s are killed."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.kill()

    def __enter__(self) -> "Launcher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def serve(preload: Sequence[str]) -> None:
    """The launcher: import torch, the worker package and ``preload``, then answer each request on stdin. Runs no
    torch operation itself: no thread pool may exist when a process is forked."""
    before = dict(os.environ)
    fork_server.preload()
    for name in preload:
        importlib.import_module(name)
    added_env = {k: v for k, v in os.environ.items() if k not in before}
    for line in sys.stdin:
        pids = []
        for request in json.loads(line)["procs"]:
            flush_stdio()
            pid = os.fork()
            if pid == 0:
                fork_server.become(request, added_env)  # never returns
            pids.append(pid)
        codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
        print(json.dumps({"rc": codes}), flush=True)


if __name__ == "__main__":
    serve(sys.argv[1:])
    flush_stdio()
    os._exit(0)  # skip the teardown of torch (as worker.fork_server does)

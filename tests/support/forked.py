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
import os
import select
import signal
import subprocess
import sys
from typing import Mapping, Optional, Sequence

from worker import fork_server
from worker.exit import flush_stdio

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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

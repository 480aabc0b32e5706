"""Local mode: tmd starts the job's rank processes itself, grouped into named nodes on this host.

Each process gets its identity by environment: ``TM_COORDINATOR`` (tmd's address), ``TM_NODE``, ``TM_LOCAL_RANK``,
``TM_STANDBY`` (1 on standby nodes), ``TM_RUN_DIR``; ``OMP_NUM_THREADS=1`` and ``TM_GLOO_HOST=127.0.0.1`` keep
ranks from oversubscribing the cores and gloo on loopback. Output of every process goes to
``<run_dir>/logs/<node>.<local_rank>.log`` and, with ``echo``, to tmd's stdout prefixed by ``[node/local_rank]``.
In SLURM mode srun starts the processes instead and this module is not used.
"""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading
from typing import Optional


@dataclasses.dataclass
class Proc:
    node: str
    local_rank: int
    popen: subprocess.Popen
    returncode: Optional[int] = None


class LocalLauncher:
    def __init__(self, command: list[str], run_dir: str, coordinator: str, ranks_per_node: int,
                 echo: bool = True, extra_env: Optional[dict[str, str]] = None,
                 namespaces: Optional[dict] = None, host_ip: Optional[str] = None) -> None:
        """``namespaces``: node -> tmd.netns.NodeNamespace for nodes whose processes run in a network namespace
        of their own (they advertise its address to gloo; the others advertise ``host_ip``, which the namespaces
        reach). They are deleted by :meth:`terminate_all`."""
        self.namespaces = namespaces or {}
        self.host_ip = host_ip
        self.command = command
        self.run_dir = run_dir
        self.coordinator = coordinator
        self.ranks_per_node = ranks_per_node
        self.echo = echo
        self.extra_env = extra_env or {}
        self.procs: list[Proc] = []
        self._print_lock = threading.Lock()
        os.makedirs(os.path.join(run_dir, "logs"), exist_ok=True)

    def start_node(self, node: str, standby: bool) -> None:
        """Start ``ranks_per_node`` processes for ``node``."""
        for local_rank in range(self.ranks_per_node):
            self._spawn(node, local_rank, standby)

    def base_env(self) -> dict[str, str]:
        """The environment a worker inherits before the TM_* variables (local mode: all ranks on loopback)."""
        return {**os.environ, "TM_GLOO_HOST": "127.0.0.1"}

    def argv(self, node: str, local_rank: int) -> list[str]:
        """The command line of one worker process."""
        return self.command

    def _spawn(self, node: str, local_rank: int, standby: bool) -> Proc:
        ns = self.namespaces.get(node)
        env = {
            **self.base_env(),
            **({"TM_GLOO_HOST": ns.node_ip if ns else self.host_ip} if self.host_ip else {}),
            "TM_COORDINATOR": self.coordinator,
            "TM_NODE": node,
            "TM_LOCAL_RANK": str(local_rank),
            "TM_STANDBY": "1" if standby else "0",
            "TM_RUN_DIR": self.run_dir,
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            **self.extra_env,
        }
        argv = self.argv(node, local_rank)
        popen = subprocess.Popen(ns.wrap(argv) if ns else argv, env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        proc = Proc(node, local_rank, popen)
        self.procs.append(proc)
        threading.Thread(target=self._pump, args=(proc,), daemon=True, name=f"log-{node}.{local_rank}").start()
        return proc

    def _pump(self, proc: Proc) -> None:
        path = os.path.join(self.run_dir, "logs", f"{proc.node}.{proc.local_rank}.log")
        with open(path, "ab") as log:
            for line in proc.popen.stdout:  # type: ignore[union-attr]
                log.write(line)
                log.flush()
                if self.echo:
                    with self._print_lock:
                        sys.stdout.write(f"[{proc.node}/{proc.local_rank}] {line.decode(errors='replace')}")
                        sys.stdout.flush()

    def poll(self) -> list[Proc]:
        """Processes that exited since the last call."""
        exited = []
        for proc in self.procs:
            if proc.returncode is None:
                rc = proc.popen.poll()
                if rc is not None:
                    proc.returncode = rc
                    exited.append(proc)
        return exited

    def running(self, node: Optional[str] = None) -> list[Proc]:
        return [p for p in self.procs if p.returncode is None and (node is None or p.node == node)]

    def pid_of(self, node: str, local_rank: int) -> Optional[int]:
        for proc in reversed(self.procs):
            if proc.node == node and proc.local_rank == local_rank:
                return proc.popen.pid
        return None

    def terminate_all(self, grace_s: float = 5.0) -> None:
        """SIGTERM every running process, then SIGKILL what is left after ``grace_s`` seconds."""
        for proc in self.running():
            proc.popen.terminate()
        for proc in self.procs:
            try:
                proc.popen.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait()
            proc.returncode = proc.popen.returncode
        for ns in self.namespaces.values():
            ns.close()

"""Local mode: tmd starts the job's rank processes itself, grouped into named nodes on this host.

Each process gets its identity by environment: ``TM_COORDINATOR`` (tmd's address), ``TM_NODE``, ``TM_LOCAL_RANK``,
``TM_STANDBY`` (1 on standby nodes), ``TM_RUN_DIR``; ``OMP_NUM_THREADS=1`` and ``TM_GLOO_HOST=127.0.0.1`` keep
ranks from oversubscribing the cores and gloo on loopback. Every process writes its output to
``<run_dir>/logs/<node>.<local_rank>.log`` itself (not through a pipe to tmd: its output, and so its training,
outlives a killed tmd); with ``echo`` tmd follows the file and prints each line prefixed by ``[node/local_rank]``.
In the plain case (a ``python`` command, no CPU sets, no namespaces) the processes are forked from a fork server
that imported torch once (worker/fork_server.py, :class:`ForkServer`) and re-parented to tmd, which is a child
subreaper; ``TM_FORK_SERVER=0`` starts each with ``subprocess.Popen`` instead.
Nodes may run pinned to CPU sets of their own (``tmd local --isolate-nodes``, tmd/cpusets.py), and in network
namespaces of their own (``tmd local --netns-node``/``--netns-all``, see tmd/netns.py):
their processes then advertise their namespace's address to gloo (``TM_GLOO_HOST``) instead.
A restarted tmd (``tmd resume``) adopts the processes it did not start (:meth:`LocalLauncher.adopt`).
In SLURM mode srun starts the processes instead and this module is not used.
"""
from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import threading
import time
import traceback
from typing import TYPE_CHECKING, Callable, Mapping, Optional, Union

import psutil

from tmd.protocol.layout import RunDir
from tmd.rundir import no_follow
from worker import fork_server
from worker.exit import flush_stdio

if TYPE_CHECKING:
    from tmd.cpusets import Isolation
    from tmd.netns import NodeNamespace


class _ByPid:
    """The part of Popen's interface the launcher uses, for a process known by its pid only."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: Optional[int] = None
        try:
            self._proc: Optional[psutil.Process] = psutil.Process(pid)
        except psutil.Error:
            self._proc = None

    def poll(self) -> Optional[int]:
        raise NotImplementedError

    def _gone(self) -> bool:
        """Whether the process is gone or a zombie (by psutil)."""
        try:
            return self._proc is None or self._proc.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True
        except psutil.Error:
            return False

    def terminate(self) -> None:
        if self._proc is not None:
            try:
                self._proc.terminate()
            except psutil.Error:
                pass

    def kill(self) -> None:
        if self._proc is not None:
            try:
                self._proc.kill()
            except psutil.Error:
                pass

    def wait(self, timeout: Optional[float] = None) -> Optional[int]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.05)  # nothing to block on with a timeout
        return self.returncode


class Adopted(_ByPid):
    """A process this tmd did not start (found by ``tmd resume``). Its exit code is unknown (a non-child cannot be
    waited for): ``poll()`` returns -1 once it is gone or a zombie, a marker only: the launcher reports the exit
    code of such a process as None."""

    def poll(self) -> Optional[int]:
        if self.returncode is None and self._gone():
            self.returncode = -1
        return self.returncode


class Forked(_ByPid):
    """A process the fork server started and that was re-parented to this tmd (a child subreaper): waited for
    like a child of its own, with its exit code (negative: the signal that ended it, as Popen gives it)."""

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # not re-parented here after all: its exit code cannot be known
                if self._gone():
                    self.returncode = -1
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode


class ForkServer:
    """tmd's end of worker/fork_server.py: a process that imported torch and the worker package once and forks
    the job's ranks from that image (see that module for the protocol and what a forked rank shares).

    ``python`` is the job command's interpreter as the command names it (looked up on ``env``'s PATH), ``env`` the environment the ranks share
    (:func:`worker.fork_server.common_env`). :meth:`spawn` returns None whenever the server cannot serve (it
    failed to import, died, or refused), and the launcher then starts that process itself."""

    READY_TIMEOUT_S = 120.0  # its imports (2-3 s here, more on a loaded host)
    REPLY_TIMEOUT_S = 30.0

    def __init__(self, python: str, env: dict[str, str], log_path: str) -> None:
        ours, theirs = socket.socketpair()
        self.proc: Union[subprocess.Popen, Forked]
        if self.can_fork(python, env):
            self.proc = self._fork(ours, theirs, env, log_path)
        else:
            with open(log_path, "ab", opener=no_follow) as log:
                self.proc = subprocess.Popen([python, "-m", "worker.fork_server", str(theirs.fileno())], env=env,
                                             pass_fds=(theirs.fileno(),), stdout=log, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL)
        theirs.close()
        self._sock = ours
        self._reader = ours.makefile("rb")
        self._lock = threading.Lock()
        self._ready = False
        self.broken: Optional[str] = None  # why it no longer serves

    @staticmethod
    def can_fork(python: str, env: Mapping[str, str]) -> bool:
        """Whether this process may become the server by a fork, with no import: it runs ``python`` (the job's
        interpreter) and holds the image already, with no other thread (:func:`worker.fork_server.holds_image`;
        a tmd forked from a warm process, tmctl.warm_start)."""
        exe = fork_server.interpreter([python], env)
        return (exe is not None and os.path.realpath(exe) == os.path.realpath(sys.executable)
                and fork_server.holds_image(env.get(fork_server.PRELOAD_ENV, "")))

    @staticmethod
    def _fork(ours: socket.socket, theirs: socket.socket, env: Mapping[str, str], log_path: str) -> "Forked":
        """Fork this process into the server: it serves ``theirs`` with ``env`` as its environment and
        ``log_path`` as its stdout and stderr, as ``python -m worker.fork_server`` would (its imports are done)."""
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                ours.close()
                fork_server.take_over(log_path, env)
                code = fork_server.serve(theirs.fileno())
            except BaseException:  # noqa: BLE001 - never return into tmd
                traceback.print_exc()
            finally:
                flush_stdio()
                os._exit(code)
        return Forked(pid)

    def _read(self, timeout_s: float) -> dict:
        self._sock.settimeout(timeout_s)
        line = self._reader.readline()
        if not line:
            raise EOFError("the fork server exited")
        reply = json.loads(line)
        if not isinstance(reply, dict):
            raise ValueError(f"malformed reply {line[:80]!r}")
        return reply

    def spawn(self, argv: list[str], env: dict[str, str], log_path: str) -> Optional[int]:
        """Fork one process running ``argv`` with ``env`` in this working directory, its output appended to
        ``log_path``. Returns its pid (a child of this process now), or None: start it some other way."""
        with self._lock:
            if self.broken:
                return None
            try:
                if not self._ready:
                    hello = self._read(self.READY_TIMEOUT_S)
                    if "ready" not in hello:
                        raise RuntimeError(hello.get("error", "no ready message"))
                    self._ready = True
                request = {"argv": argv, "env": env, "cwd": os.getcwd(), "log": log_path}
                self._sock.sendall(json.dumps(request).encode() + b"\n")
                reply = self._read(self.REPLY_TIMEOUT_S)
                pid = reply.get("pid")
                if not isinstance(pid, int) or pid <= 0:
                    print(f"[tmd] the fork server refused {argv[1:]}: {reply.get('error')}", flush=True)
                    return None
                return pid
            except (OSError, ValueError, RuntimeError, EOFError) as e:
                self.broken = f"{type(e).__name__}: {e}"
                print(f"[tmd] fork server unusable, starting processes directly: {self.broken}", flush=True)
                return None

    def close(self) -> None:
        """End the server (it exits when its socket closes)."""
        self.broken = self.broken or "closed"
        try:
            self._sock.close()
            self._reader.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@dataclasses.dataclass
class Proc:
    node: str
    local_rank: int
    popen: Union[subprocess.Popen, Adopted, Forked]
    returncode: Optional[int] = None  # its exit code once it exited (None: running, or adopted: unknown)
    exited: bool = False
    pump: Optional[threading.Thread] = None  # echoes its log file (with echo)


class LocalLauncher:
    FORK_SERVER = True  # whether plain python commands are forked from a fork server (not under srun)

    def __init__(self, command: list[str], run_dir: str, coordinator: str, ranks_per_node: int,
                 echo: bool = True, extra_env: Optional[dict[str, str]] = None,
                 namespaces: Optional[dict] = None, host_ip: Optional[str] = None,
                 new_namespace: Optional[Callable[[str], "NodeNamespace"]] = None,
                 isolation: Optional["Isolation"] = None, inherited: Optional[ForkServer] = None) -> None:
        """``isolation``: each node's processes pinned to its CPU set (``--isolate-nodes``, tmd.cpusets).
        ``inherited``: the fork server of the launcher this one follows (a relaunch from a checkpoint,
        :meth:`terminate_all` with ``close=False``), used instead of starting another (closed if this one forks
        none).
        ``namespaces``: node -> tmd.netns.NodeNamespace for nodes whose processes run in a network namespace
        of their own (they advertise its address to gloo; the others advertise ``host_ip``, which the namespaces
        reach). ``new_namespace(node)``: makes one for a node started without (``--netns-all``: standbys added
        by request). They are deleted by :meth:`terminate_all`."""
        self.namespaces = namespaces or {}
        self.isolation = isolation
        self.new_namespace = new_namespace
        self.host_ip = host_ip
        self.command = command
        self.run_dir = run_dir
        self.coordinator = coordinator
        self.ranks_per_node = ranks_per_node
        self.echo = echo
        self.extra_env = extra_env or {}
        self.procs: list[Proc] = []
        self._print_lock = threading.Lock()
        self._layout = RunDir(run_dir)
        os.makedirs(self._layout.logs_dir, mode=0o700, exist_ok=True)
        self.fork_server: Optional[ForkServer] = None
        shared = fork_server.common_env(self._env("", 0, False))
        if (self.FORK_SERVER and command and isolation is None and not self.namespaces and new_namespace is None
                and fork_server.eligible(command, shared) and fork_server.become_subreaper()):
            if inherited is not None and not inherited.broken and inherited.proc.poll() is None:
                self.fork_server = inherited  # a relaunch: the previous launcher's, warm already
            else:  # command[0] as the ranks' Popen would find it: on the environment's PATH
                self.fork_server = ForkServer(command[0], shared,
                                              os.path.join(self._layout.logs_dir, "fork-server.log"))
        elif inherited is not None:
            inherited.close()

    def start_node(self, node: str, standby: bool) -> None:
        """Start ``ranks_per_node`` processes for ``node`` (none without a command: ``tmd resume`` of a job
        whose tmd.json does not say it)."""
        if self.command and self.new_namespace is not None and node not in self.namespaces:
            self.namespaces[node] = self.new_namespace(node)
        for local_rank in range(self.ranks_per_node if self.command else 0):
            self._spawn(node, local_rank, standby)

    def base_env(self) -> dict[str, str]:
        """The environment a worker inherits before the TM_* variables (local mode: all ranks on loopback)."""
        return {**os.environ, "TM_GLOO_HOST": "127.0.0.1"}

    def argv(self, node: str, local_rank: int) -> list[str]:
        """The command line of one worker process."""
        return self.command

    def _env(self, node: str, local_rank: int, standby: bool) -> dict[str, str]:
        """The environment of one worker process."""
        ns = self.namespaces.get(node)
        gloo_host = ns.node_ip if ns else self.host_ip
        return {
            **self.base_env(),
            **({"TM_GLOO_HOST": gloo_host} if gloo_host else {}),
            "TM_COORDINATOR": self.coordinator,
            "TM_NODE": node,
            "TM_LOCAL_RANK": str(local_rank),
            "TM_STANDBY": "1" if standby else "0",
            "TM_RUN_DIR": self.run_dir,
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            **self.extra_env,
        }

    def _spawn(self, node: str, local_rank: int, standby: bool) -> Proc:
        ns = self.namespaces.get(node)
        env = self._env(node, local_rank, standby)
        argv = self.argv(node, local_rank)
        if self.isolation is not None:
            argv = self.isolation.wrap(node, standby, argv)
        path = self._log_path(node, local_rank)
        with open(path, "ab", opener=no_follow) as log:  # never through a symlink
            start = log.tell()
            pid = self.fork_server.spawn(argv, env, path) if self.fork_server is not None else None
            popen: Union[subprocess.Popen, Forked] = Forked(pid) if pid else subprocess.Popen(
                ns.wrap(argv) if ns else argv, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        return self._track(Proc(node, local_rank, popen), start)

    def adopt(self, node: str, local_rank: int, pid: int) -> Proc:
        """Track a running worker process this launcher did not start (a restarted tmd re-learns it)."""
        path = self._log_path(node, local_rank)
        return self._track(Proc(node, local_rank, Adopted(pid)), os.path.getsize(path) if os.path.exists(path) else 0)

    def _log_path(self, node: str, local_rank: int) -> str:
        return self._layout.log(node, local_rank)

    def _track(self, proc: Proc, log_offset: int) -> Proc:
        self.procs.append(proc)
        if self.echo:
            proc.pump = threading.Thread(target=self._pump, args=(proc, log_offset), daemon=True,
                                         name=f"log-{proc.node}.{proc.local_rank}")
            proc.pump.start()
        return proc

    def _pump(self, proc: Proc, offset: int) -> None:
        """Echo what the process appends to its log file (from ``offset``) until it exited."""
        with open(self._log_path(proc.node, proc.local_rank), "rb", opener=no_follow) as log:
            log.seek(offset)
            pending = b""
            while True:
                exited = proc.exited or proc.popen.poll() is not None
                chunk = log.read(1 << 16)
                if not chunk:
                    if exited:
                        break
                    time.sleep(0.05)  # another process writes the file: nothing to block on
                    continue
                *lines, pending = (pending + chunk).split(b"\n")
                with self._print_lock:
                    for line in lines:
                        sys.stdout.write(f"[{proc.node}/{proc.local_rank}] {line.decode(errors='replace')}\n")
                    sys.stdout.flush()
            if pending:
                with self._print_lock:
                    sys.stdout.write(f"[{proc.node}/{proc.local_rank}] {pending.decode(errors='replace')}\n")
                    sys.stdout.flush()

    def poll(self) -> list[Proc]:
        """Processes that exited since the last call (``returncode`` None for an adopted one: unknown)."""
        exited = []
        for proc in self.procs:
            if not proc.exited:
                rc = proc.popen.poll()
                if rc is not None:
                    proc.exited = True
                    proc.returncode = None if isinstance(proc.popen, Adopted) else rc
                    exited.append(proc)
        return exited

    def running(self, node: Optional[str] = None) -> list[Proc]:
        return [p for p in self.procs if not p.exited and (node is None or p.node == node)]

    def pid_of(self, node: str, local_rank: int) -> Optional[int]:
        for proc in reversed(self.procs):
            if proc.node == node and proc.local_rank == local_rank:
                return proc.popen.pid
        return None

    def terminate_all(self, grace_s: float = 5.0, close: bool = True) -> None:
        """SIGTERM every running process, then SIGKILL what is left after ``grace_s`` seconds; with ``close``
        also end the fork server and delete the nodes' network namespaces and CPU sets (not before a relaunch that
        reuses them: its launcher inherits the fork server)."""
        for proc in self.running():
            proc.popen.terminate()
        for proc in self.procs:
            try:
                proc.popen.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait()
            if not proc.exited:
                proc.exited = True
                proc.returncode = None if isinstance(proc.popen, Adopted) else proc.popen.returncode
        for proc in self.procs:  # echo the last lines (the pumps end at the end of their files)
            if proc.pump is not None:
                proc.pump.join(timeout=1.0)
        if not close:  # a relaunch follows: its launcher takes over the fork server, the namespaces, the CPU sets
            return
        if self.fork_server is not None:
            self.fork_server.close()
        for ns in self.namespaces.values():
            ns.close()
        if self.isolation is not None:
            self.isolation.close()

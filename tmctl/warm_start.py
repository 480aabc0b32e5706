"""Start many local jobs' tmd from one warm image: what a test suite or a benchmark that runs dozens of
``tmd local`` jobs on one host pays once instead of per job.

Why: a ``tmd local`` job's fork server imports torch, the worker package and torch._dynamo before the job's first
rank starts (worker.fork_server): 3-5 s of CPU here, on the critical path of every job, and the end-to-end suite
starts about 90 jobs. The *warm starter* is one process (``python -m tmctl.warm_start FD``) that made that image once
(:data:`worker.fork_server.IMAGE` and tmd's own modules) and forks each job's tmd from it. Such a tmd holds the image
and runs no thread yet when it makes its fork server, so it forks that server from itself, with no import
(:meth:`tmd.local.ForkServer.can_fork`); its ranks then start as they always do. What the job computes is the same
(the end-to-end tests compare final states bit for bit with jobs started either way).

:func:`start_tmd` is what callers use: ``start_tmd(tmd_command(...))`` returns the tmd process, forked warm when
:func:`enable` was called in this process and the command can be (``python -m tmd.cli ...`` with this interpreter,
the starter's environment: see :meth:`WarmStarter.start`), else a ``subprocess.Popen``. Either way tmd's output goes
to the ``log`` file given (stderr to the ``err`` file where one is given); see :func:`start_tmd` without one. Its
handle, :class:`WarmProcess`, has the part of Popen's interface callers use (``pid``, ``returncode``, ``poll``,
``wait``, ``send_signal``, ``terminate``, ``kill``).

A starter serves one environment (the starting process's, :data:`VOLATILE` aside). A job whose environment differs
only in ``TM_FORK_PRELOAD`` (modules its fork server imports once more, such as torchtitan's) gets a starter of its
own that imported those too, so its tmd forks a fork server that holds them as well: one starter per distinct value,
each started on first use. Any other difference starts that tmd cold.

Protocol (a private ``socketpair`` with the process that started the starter; JSON lines, nothing executed): the
starter writes ``{"ready": pid}`` once its imports are done; each request ``{"argv": [...], "env": {...}, "cwd":
str, "log": path}`` (``"err": path`` too for stderr apart) is answered ``{"pid": N}`` or ``{"error": "..."}``;
``{"exit": pid, "code": N}`` follows when that tmd ended (``N`` negative: the signal that ended it, as Popen gives
it). tmd is the starter's own child, so its exit code is waited for there. The starter exits when its socket closes
(the process that started it ended).
"""
from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from typing import Mapping, Optional, Sequence, Union

from tmd.rundir import no_follow
from worker import fork_server
from worker.exit import flush_stdio

# tmd's own modules, imported into the image beside the ranks' (tmd.cli itself is not: it runs as __main__)
TMD_MODULES = ("typer", "rich", "zmq", "psutil", "tmd.daemon", "tmd.local", "tmd.supervise", "tmd.tiers")
# variables that change while one process starts jobs and that neither tmd nor torch reads at import
VOLATILE = ("PYTEST_CURRENT_TEST",)
READY_TIMEOUT_S = 120.0  # the starter's imports (3-5 s here, more on a loaded host)
REPLY_TIMEOUT_S = 30.0


def _send(sock: socket.socket, message: dict) -> None:
    sock.sendall(json.dumps(message).encode() + b"\n")


def serve(fd: int) -> int:
    """The starter: import the image, then fork a tmd for each request on the inherited socket ``fd`` and report
    each one's exit, until the socket closes. Returns the exit code."""
    os.set_inheritable(fd, False)
    fork_server.set_process_name("tm-warm-start")
    sock = socket.socket(fileno=fd)
    before = dict(os.environ)
    try:
        fork_server.preload(os.environ.get(fork_server.PRELOAD_ENV, ""))
        for name in TMD_MODULES:
            importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 - the caller then starts every tmd itself
        _send(sock, {"error": f"preload failed: {type(e).__name__}: {e}"})
        return 1
    added_env = {k: v for k, v in os.environ.items() if k not in before}
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # only to wake the select below
    _send(sock, {"ready": os.getpid()})
    pending = b""
    while True:
        try:
            readable, _, _ = select.select([sock, wake_r], [], [])
        except InterruptedError:
            continue
        if wake_r in readable:
            os.read(wake_r, 4096)
        _report_exits(sock)
        if sock in readable:
            data = sock.recv(1 << 16)
            if not data:
                return 0
            *lines, pending = (pending + data).split(b"\n")
            for line in lines:
                _send(sock, _answer(line, added_env, (sock.fileno(), wake_r, wake_w)))


def _report_exits(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if not pid:
            return
        _send(sock, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _answer(line: bytes, added_env: Mapping[str, str], close: Sequence[int]) -> dict:
    try:
        request = json.loads(line)
        if not isinstance(request, dict) or {"argv", "env", "cwd", "log"} - request.keys():
            raise ValueError("malformed request")
        if fork_server.parse(request["argv"]) is None:
            raise ValueError("not a `python -m module` command")
        return {"pid": _fork(request, added_env, close)}
    except Exception as e:  # noqa: BLE001 - one refused request: the caller starts that tmd itself
        return {"error": f"{type(e).__name__}: {e}"}


def _fork(request: dict, added_env: Mapping[str, str], close: Sequence[int]) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in close:
            os.close(fd)
        fork_server.become(request, added_env, name="tmd")
    return pid


def _stable(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` without its :data:`VOLATILE` variables."""
    return {k: v for k, v in env.items() if k not in VOLATILE}


class WarmProcess:
    """A tmd the starter forked: the part of ``subprocess.Popen``'s interface callers use. Its exit code comes from
    the starter (tmd is its child), read by :meth:`poll` and :meth:`wait`."""

    def __init__(self, starter: "WarmStarter", pid: int) -> None:
        self.starter = starter
        self.pid = pid
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            self.starter.pump(0)
            self.returncode = self.starter.exits.get(self.pid)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        """The exit code once tmd ended; ``subprocess.TimeoutExpired`` after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"tmd (pid {self.pid})", timeout)
            self.starter.pump(left if left is not None else 1.0)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # never a recycled pid
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class WarmStarter:
    """This process's end of a warm starter (started on construction; raises RuntimeError when it cannot serve)."""

    def __init__(self, env: Optional[Mapping[str, str]] = None) -> None:
        self.env = dict(os.environ if env is None else env)
        ours, theirs = socket.socketpair()
        self.proc = subprocess.Popen([sys.executable, "-m", "tmctl.warm_start", str(theirs.fileno())],
                                     env=self.env, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        theirs.close()
        self._sock = ours
        self._pending = b""
        self._replies: list[dict] = []
        self.exits: dict[int, int] = {}
        hello = self._reply(READY_TIMEOUT_S)
        if "ready" not in hello:
            self.close()
            raise RuntimeError(f"the warm starter cannot serve: {hello.get('error')}")

    def start(self, argv: Sequence[str], log: Optional[str] = None,
              err: Optional[str] = None) -> Optional[WarmProcess]:
        """Fork a tmd running ``argv`` (``python -m tmd.cli ...``) with this process's environment and working
        directory, its output appended to ``log`` (None: discarded), its stderr to ``err`` where given. None when
        it cannot be forked warm: another interpreter, another command form, or an environment other than the
        starter's beyond :data:`VOLATILE` (torch and tmd read some variables at import); start it some other way
        then."""
        env = dict(os.environ)
        exe = fork_server.interpreter(argv, env)
        if (_stable(env) != _stable(self.env) or exe is None or os.path.realpath(exe) != os.path.realpath(sys.executable)
                or fork_server.parse(argv) is None or self.proc.poll() is not None):
            return None
        _send(self._sock, {"argv": list(argv), "env": env, "cwd": os.getcwd(), "log": log or os.devnull,
                           **({"err": err} if err else {})})
        reply = self._reply(REPLY_TIMEOUT_S)
        pid = reply.get("pid")
        return WarmProcess(self, pid) if isinstance(pid, int) and pid > 0 else None

    def pump(self, timeout_s: float) -> None:
        """Read what the starter sent within ``timeout_s`` seconds (0: what is there now): exits into
        :attr:`exits`, replies kept for :meth:`_reply`."""
        if select.select([self._sock], [], [], max(timeout_s, 0))[0]:
            data = self._sock.recv(1 << 16)
            if not data:
                raise RuntimeError("the warm starter exited")
            *lines, self._pending = (self._pending + data).split(b"\n")
            for line in lines:
                message = json.loads(line)
                if "exit" in message:
                    self.exits[int(message["exit"])] = int(message["code"])
                else:
                    self._replies.append(message)

    def _reply(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while not self._replies:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"the warm starter did not answer within {timeout_s} s")
            self.pump(left)
        return self._replies.pop(0)

    def close(self) -> None:
        """End the starter (it exits when its socket closes); the tmds it started run on."""
        self._sock.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


_starters: dict[str, WarmStarter] = {}  # TM_FORK_PRELOAD's value -> the starter that imported those modules too
_enabled: Optional[dict[str, str]] = None  # the environment of enable(), less TM_FORK_PRELOAD


def _base(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k != fork_server.PRELOAD_ENV}


def enable() -> None:
    """Start every later :func:`start_tmd` of this process warm where it can be: one starter per value of
    ``TM_FORK_PRELOAD`` in an environment otherwise this one's, each started by the first tmd that needs it (and
    ended when this process exits)."""
    global _enabled
    _enabled = _stable(_base(os.environ))


def _starter() -> Optional[WarmStarter]:
    """The starter for this process's environment now (started on first use), or None where enable() was not
    called or the environment differs from enable()'s in more than ``TM_FORK_PRELOAD``."""
    if _enabled is None or _stable(_base(os.environ)) != _enabled:
        return None
    preload = os.environ.get(fork_server.PRELOAD_ENV, "")
    if preload not in _starters:
        _starters[preload] = WarmStarter()
        atexit.register(_starters[preload].close)
    return _starters[preload]


def start_tmd(argv: Sequence[str], log: Optional[str] = None,
              err: Optional[str] = None) -> Union[subprocess.Popen, WarmProcess]:
    """Start tmd (``argv``: tmctl.localjob.tmd_command's): forked warm where :func:`enable` was called and
    :meth:`WarmStarter.start` can, else ``subprocess.Popen(argv)``. Its stdout and stderr are appended to ``log``,
    its stderr to ``err`` instead where given. Without ``log`` its stdout is discarded, and its stderr too when
    forked (a cold tmd's goes to this process's stderr)."""
    try:
        starter = _starter()
        proc = starter.start(argv, log, err) if starter is not None else None
        if proc is not None:
            return proc
    except (OSError, RuntimeError, ValueError) as e:
        print(f"[warm_start] starting tmd cold: {type(e).__name__}: {e}", file=sys.stderr)
    with contextlib.ExitStack() as files:  # as a forked tmd's: made 0600, never through a symlink
        out, error = (files.enter_context(open(path, "ab", opener=no_follow)) if path else None for path in (log, err))
        return subprocess.Popen(list(argv), stdout=out or subprocess.DEVNULL, stderr=error or out)


if __name__ == "__main__":
    code = serve(int(sys.argv[1]))
    flush_stdio()
    os._exit(code)  # the image's teardown is nothing to wait for

"""A fork server for local mode: import torch and the worker package once, then fork each rank from that image.

Why: ``import torch`` and this package cost 2-3 s of CPU per process here (``python -X importtime``: torch ~2 s,
``torch.distributed.tensor`` ~1 s more). A local job of 2 nodes x 2 ranks and one standby paid it five times over
on 2 cores before its first step. Forked from one warm image, a rank starts in milliseconds and shares the
image's pages copy-on-write. (The same idea as ``multiprocessing``'s ``forkserver`` start method, and Android's
zygote.)

Who uses it: :class:`tmd.local.LocalLauncher`, for a job command that a fresh interpreter would run the same way
(:func:`eligible`: ``python [-u] script.py ARGS`` or ``python [-u] -m module ARGS`` with the interpreter that runs
this server), when no CPU sets or network namespaces wrap the processes. Anything else, and ``TM_FORK_SERVER=0``,
starts each process with ``subprocess.Popen`` as before. ``TM_FORK_PRELOAD`` names more modules for the image,
those a job's ranks import anyway (:func:`preload`; for torchtitan, ``worker.integrations.torchtitan_image``).

Protocol (a private ``socketpair`` between tmd and this process, not a network socket; JSON lines, nothing
executed): this process writes ``{"ready": pid}`` once its imports are done, then answers each request
``{"argv": [...], "env": {...}, "cwd": str, "log": path}`` with ``{"pid": N}`` or ``{"error": "..."}``. The rank is
forked twice (the middle process exits at once), so that it is re-parented to tmd, which made itself a child
subreaper (``prctl(PR_SET_CHILD_SUBREAPER)``): tmd waits for its ranks and reads their exit codes as if it had
started them itself. The server exits when tmd closes its end.

What a forked rank shares with the server, unlike a fresh interpreter: the modules already imported (torch, this
package), ``PYTHONHASHSEED``'s hash secret, and its command line (``ps`` shows ``python -m worker.fork_server``
for every rank; the process name, ``ps -o comm``, is ``tm-<node>.<local_rank>``, and the server's
``tm-fork-server``). Its environment, working directory, ``sys.argv``, ``sys.path[0]``,
stdio and ``random``'s seed (Python reseeds it after a fork) are its own; the server refuses to fork when any
environment variable other than the rank's identity (:data:`IDENTITY`) differs from its own, because torch and
OpenMP read some of them at import. A server forked from a warm image (tmctl.warm_start) imported torch under that
image's environment, so each rank also sets torch's thread count from its own ``OMP_NUM_THREADS``
(:func:`apply_thread_count`).
"""
from __future__ import annotations

import ctypes
import importlib
import json
import os
import runpy
import shutil
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Mapping, NoReturn, Optional, Sequence

from tmd.rundir import no_follow
from worker.exit import flush_stdio

# The variables that differ between the ranks of one job (tmd.local sets them per process); no module reads them
# at import time, so a rank may set them after the fork.
IDENTITY = ("TM_NODE", "TM_LOCAL_RANK", "TM_STANDBY", "TM_GLOO_HOST")
# The job's address, key directory and run directory: tmd knows the first two only once its socket is bound, after
# it started this server (early, so that the imports overlap tmd's own start-up). Read when a rank starts, never at
# import, so a rank may set them after the fork too.
LATE = ("TM_COORDINATOR", "TM_KEYS", "TM_RUN_DIR",
        # and the checkpoint a relaunch loads (tmd.tiers): the relaunched ranks are forked from the same server
        "TM_RESUME_FROM", "TM_CHECKPOINT_RESTART")
DISABLE_ENV = "TM_FORK_SERVER"
# modules the server imports too, after its own (comma-separated): what the job's ranks import anyway, e.g.
# worker.integrations.torchtitan_image for torchtitan's Trainer; each must leave no thread running
PRELOAD_ENV = "TM_FORK_PRELOAD"
SERVER_NAME = "tm-fork-server"  # the server's process name (comm, as ps -o comm and psutil's name() show it)
PR_SET_NAME = 15  # linux/prctl.h
PR_SET_CHILD_SUBREAPER = 36


def prctl(option: int, arg) -> bool:
    """``prctl(option, arg)`` (Linux); False where it fails or is missing."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(option, arg, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def set_process_name(name: str) -> None:
    """Set this process's name (its ``comm``, at most 15 bytes) with ``prctl(PR_SET_NAME)``; a forked rank's
    command line stays the server's, so its name is what tells the ranks apart in ``ps`` and ``top``. Best
    effort: nothing happens where prctl is missing."""
    prctl(PR_SET_NAME, name.encode()[:15])


def become_subreaper() -> bool:
    """Make this process a child subreaper (``prctl(PR_SET_CHILD_SUBREAPER)``, Linux 3.4+): orphaned
    descendants are re-parented to it instead of to init, so it can wait for them. False where that fails."""
    return prctl(PR_SET_CHILD_SUBREAPER, 1)


def interpreter(argv: Sequence[str], env: Mapping[str, str]) -> Optional[str]:
    """The path of the program ``argv[0]`` names, looked up on ``env``'s PATH as ``subprocess`` would (not
    resolved: a virtual environment's ``python`` is a symlink that must stay one), or None when not found."""
    if not argv:
        return None
    return shutil.which(argv[0], path=env.get("PATH", os.defpath))


def parse(argv: Sequence[str]) -> Optional[tuple[str, str, list[str]]]:
    """``("script", path, args)`` or ``("module", name, args)`` for ``python [-u] script.py args`` or
    ``python [-u] -m name args``; None for any other interpreter option (``-c``, ``-X``, ``-O``...), which a fork
    could not reproduce."""
    rest = list(argv[1:])
    while rest and rest[0] == "-u":  # unbuffered: every rank gets PYTHONUNBUFFERED=1 anyway
        rest.pop(0)
    if not rest:
        return None
    if rest[0] == "-m":
        return ("module", rest[1], rest[2:]) if len(rest) > 1 and not rest[1].startswith("-") else None
    if rest[0].startswith("-"):
        return None
    return "script", rest[0], rest[1:]


def eligible(argv: Sequence[str], env: Mapping[str, str]) -> bool:
    """Whether a fork from this server would run ``argv`` as a fresh ``python`` process would: a Python
    interpreter (its name starts with ``python``) started as ``python [-u] script|-m module ...``, and fork
    servers not disabled (``TM_FORK_SERVER=0``)."""
    if env.get(DISABLE_ENV, "1") == "0" or not sys.platform.startswith("linux"):
        return False
    exe = interpreter(argv, env)
    return exe is not None and os.path.basename(os.path.realpath(exe)).startswith("python") \
        and parse(argv) is not None


def common_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` without the rank's identity variables and the job's :data:`LATE` ones: what every rank of the job,
    and the server, share."""
    return {k: v for k, v in env.items() if k not in IDENTITY and k not in LATE}


# What every rank imports, and so the image: torch, the mover Backend and the session, and torch._dynamo
# (DistributedDataParallel's constructor and torch.compile import it: ~1 s of CPU per rank here, paid by every rank
# at once on the job's first step unless the image has it)
IMAGE = ("torch", "torch.distributed", "worker.session", "torch._dynamo")


def extra_modules(extra: str = "") -> list[str]:
    """The module names of ``extra`` (``TM_FORK_PRELOAD``'s value: comma-separated)."""
    return list(filter(None, (part.strip() for part in extra.split(","))))


def holds_image(extra: str = "") -> bool:
    """Whether this process can serve as it is: it already imported every module of the image (:data:`IMAGE` and
    ``extra``'s; a process forked from a warm one, tmctl.warm_start) and runs no other thread, Python's or native
    (a fork would copy the locks a thread holds). Its fork then needs no import (:class:`tmd.local.ForkServer`)."""
    try:
        threads = len(os.listdir("/proc/self/task"))
    except OSError:
        return False
    modules = (*IMAGE, *extra_modules(extra))
    return threads == 1 and threading.active_count() == 1 and all(name in sys.modules for name in modules)


def preload(extra: str = "") -> None:
    """Import what every rank imports, then the modules named in ``extra`` (``TM_FORK_PRELOAD``'s value: module
    names, comma-separated). Runs no torch operation: no thread pool may exist at fork time. Raises what an import
    raises, and RuntimeError when a module of ``extra`` left a thread running (a fork would copy the locks it
    holds); the server then refuses to serve, and tmd starts every process itself."""
    for name in IMAGE:
        importlib.import_module(name)
    for name in extra_modules(extra):
        threads = threading.active_count()
        importlib.import_module(name)
        if threading.active_count() > threads:
            raise RuntimeError(f"{PRELOAD_ENV}: importing {name} started a thread, and a rank forked from it "
                               f"would copy the locks that thread holds")


def _exit_code(e: SystemExit) -> int:
    """The exit status a fresh interpreter gives ``raise SystemExit(code)``."""
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code & 0xFF
    print(e.code, file=sys.stderr)
    return 1


def take_over(log_path: str, env: Mapping[str, str], err_path: Optional[str] = None) -> None:
    """In a forked process: stdin from /dev/null, stdout appended to ``log_path`` and stderr to ``err_path``
    (None: ``log_path`` too; each made 0600, never through a symlink), and ``env`` as the whole environment."""
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for fd, path in ((1, log_path), (2, err_path or log_path)):
        log = no_follow(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.dup2(log, fd)
        os.close(log)
    os.environ.clear()
    os.environ.update(env)


def apply_thread_count(env: Mapping[str, str]) -> Optional[int]:
    """In a forked process: give torch the intra-op thread count that ``env`` would have given a fresh interpreter
    (``OMP_NUM_THREADS``, which torch reads once, at import: a fork keeps the image's count, and a different count
    can change the numerics of a matmul or a reduction). Returns the count set, or None where torch is not loaded
    or the variable is unset or not a positive integer (the count is left as the image had it)."""
    torch = sys.modules.get("torch")
    value = env.get("OMP_NUM_THREADS", "").strip()
    if torch is None or not value.isdigit() or int(value) < 1:
        return None
    if torch.get_num_threads() != int(value):
        torch.set_num_threads(int(value))
    return int(value)


def become(request: dict, added_env: Mapping[str, str], name: Optional[str] = None) -> NoReturn:
    """In the forked rank: take the request's stdio, environment, working directory and command line, run the
    script as ``__main__``, and end the process as a fresh interpreter ends it (non-daemon threads joined,
    ``atexit`` handlers run, streams flushed; the interpreter's teardown is skipped). ``name``: the process name
    (default ``tm-<node>.<local_rank>``). Also used by the tests' launcher of small jobs (tests/support/forked.py)
    and by tmctl.warm_start for tmd itself."""
    code = 1
    try:
        # what the imports set, as in a fresh process; stderr apart where the request names a file for it
        take_over(request["log"], {**added_env, **request["env"]}, request.get("err"))
        apply_thread_count(os.environ)
        set_process_name(name or f"tm-{os.environ.get('TM_NODE', '')}.{os.environ.get('TM_LOCAL_RANK', '')}")
        os.chdir(request["cwd"])
        kind, target, args = parse(request["argv"])  # type: ignore[misc]  (checked by tmd before the request)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            if kind == "script":
                sys.argv = [target, *args]
                sys.path[0] = os.path.dirname(os.path.realpath(target))
                runpy.run_path(target, run_name="__main__")
            else:
                sys.argv = ["-m", *args]  # run_module puts the module's file in argv[0]
                sys.path[0] = os.getcwd()
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = _exit_code(e)
        except BaseException:  # noqa: BLE001 - an uncaught exception: the hook prints it (worker.session's reports it)
            sys.excepthook(*sys.exc_info())
            code = 1
        threading._shutdown()  # type: ignore[attr-defined]  # as the interpreter does: join non-daemon threads
        import atexit

        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001 - never return into the server's loop
        traceback.print_exc()
    finally:
        flush_stdio()
        os._exit(code)


def spawn(request: dict, server_fd: int, added_env: Mapping[str, str]) -> int:
    """Fork the rank of ``request`` (twice: it is re-parented to tmd) and return its pid."""
    sys.stdout.flush()
    sys.stderr.flush()
    r, w = os.pipe()
    middle = os.fork()
    if middle == 0:  # the middle process: fork the rank, tell its pid, exit at once
        try:
            os.close(r)
            rank = os.fork()
            if rank == 0:
                os.close(w)
                os.close(server_fd)
                become(request, added_env)
            os.write(w, str(rank).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        pid = f.read()
    os.waitpid(middle, 0)
    if not pid:
        raise RuntimeError("the fork failed")
    return int(pid)


def serve(fd: int) -> int:
    """Serve tmd on the inherited socket ``fd`` until tmd closes it. Returns the exit code."""
    os.set_inheritable(fd, False)  # not into what the ranks execute
    set_process_name(SERVER_NAME)
    server = socket.socket(fileno=fd)
    before = dict(os.environ)
    inherited = all(name in sys.modules for name in IMAGE)  # forked from a process that holds it (tmd.local)
    started = time.perf_counter()
    try:
        preload(os.environ.get(PRELOAD_ENV, ""))
    except Exception as e:  # noqa: BLE001 - tmd then starts every process itself
        server.sendall(json.dumps({"error": f"preload failed: {type(e).__name__}: {e}"}).encode() + b"\n")
        return 1
    added_env = {k: v for k, v in os.environ.items() if k not in before}
    print(f"[fork-server] image {'inherited' if inherited else 'imported'} in {time.perf_counter() - started:.2f} s",
          file=sys.stderr, flush=True)
    if threading.active_count() > 1:  # a fork would copy locks that other threads hold
        print(f"[fork-server] warning: {threading.active_count()} threads after the imports", file=sys.stderr)
    reader = server.makefile("rb")
    server.sendall(json.dumps({"ready": os.getpid()}).encode() + b"\n")
    for line in reader:
        try:
            request = json.loads(line)
            if not isinstance(request, dict) or {"argv", "env", "cwd", "log"} - request.keys():
                raise ValueError("malformed request")
            if parse(request["argv"]) is None:
                raise ValueError("not a `python script.py` or `python -m module` command")
            theirs, ours = common_env(request["env"]), common_env(before)
            if theirs != ours:
                differ = sorted(k for k in theirs.keys() | ours.keys() if theirs.get(k) != ours.get(k))
                raise ValueError(f"the environment differs from the fork server's beyond the rank's identity: "
                                 f"{', '.join(differ[:5])}")
            reply = {"pid": spawn(request, fd, added_env)}
        except Exception as e:  # noqa: BLE001 - one refused request; tmd starts that process itself
            reply = {"error": f"{type(e).__name__}: {e}"}
        server.sendall(json.dumps(reply).encode() + b"\n")
    return 0


if __name__ == "__main__":
    # The interpreter's teardown of the imported torch costs 0.5-1.5 s here, and tmd waits for this process at the
    # end of every job: the server holds nothing to save but its stdio, so it ends the way its ranks do.
    code = serve(int(sys.argv[1]))
    flush_stdio()
    os._exit(code)

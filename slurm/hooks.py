"""TrainMover's SLURM node hooks: a fast health check (Prolog) and cleanup plus a notice to tmd (Epilog).

slurmd runs them as root with a bare environment (no PATH; SLURM_JOB_ID, SLURM_JOB_UID, SLURM_JOB_USER,
SLURMD_NODENAME, SLURM_JOB_NODELIST, ...), through the wrappers ``slurm/install-hooks.sh`` writes, which call this
file with an absolute interpreter path. Each hook finishes in well under 1 s: the prolog imports psutil (and
pynvml), the epilog only pyzmq, neither torch; as root they raise their priority a little (nice -5) so that a node
busy training does not stretch them.

    hooks.py prolog [--state-dir DIR] [--log FILE] [--min-free-mem-mb N] [--min-free-disk-mb N] [--max-load-per-cpu X]
                    [--budget-s S]
    hooks.py epilog [--state-dir DIR] [--log FILE] [--budget-s S]

prolog: memory available, free disk on / and the temp dir, 1-minute load per CPU, and every GPU through NVML where
NVML and GPUs exist (no pynvml, no driver or no GPU: the GPU check is skipped). Exit 1 when the node is unfit (SLURM
then drains it with reason "Prolog error"), else 0.
epilog: tells the job's tmd that this node left the job (a :class:`tmd.protocol.NodeNotice`, if the job has a
tmd.json), kills TrainMover worker processes of the job left on this node (by their environment), then waits for
tmd's acknowledgement (:class:`tmd.protocol.NodeNoticeAck`), resending the notice every RESEND_S until it comes or
the hook's budget is spent: a notice is never lost to a slow CURVE handshake, nor to a tmd that crashed with it
unread and is restarting in its process (tmd.supervise); tmd acts on it once. The report says whether it was
acknowledged. Exit 1 only when a leftover process survives SIGKILL (the node is unfit), else 0.

Everything in the state directory is read and written as the job's user (effective ids dropped, no root
privilege), never as root: the epilog's read of tmd.json and of the hook key it names, and the reports.
Both write a JSON report to ``<state>/jobs/<SLURM_JOB_ID>/hooks/<hook>.<node>.json`` (as the job's user; tmd
journals the prolog reports of its own and its standby jobs) and append one JSON line to ``--log``. ``<state>``
is ``--state-dir`` or ``~<job user>/.trainmover``. A failure of the hook itself (a bug, a missing module) is
logged and exits 0: it never drains a node.
"""
from __future__ import annotations

import argparse
import json
import os
import pwd
import signal
import sys
import tempfile
import time

T0 = time.monotonic()
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUDGET_S = 0.8  # the whole hook (--budget-s); a GPU query still running then counts as a failed GPU
REPORT_S = 0.1  # of BUDGET_S, kept for writing the report once the epilog stops waiting for tmd's acknowledgement
RESEND_S = 0.2  # the epilog resends its notice this often until tmd acknowledges it


def _protocol():
    """:mod:`tmd.protocol` of this checkout (hook kinds, the state dir's layout, NodeNotice), imported on first
    use: slurmd runs the hooks with no PATH, and the protocol imports only the standard library."""
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    from tmd import protocol

    return protocol


def _process_age_s() -> float:
    """Seconds since this process started (the wrapper's exec included; 10 ms resolution), from /proc."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime_s = float(f.read().split()[0])
        return max(0.0, uptime_s - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.monotonic() - T0


class _Timeout(Exception):
    pass


def _on_alarm(signum, frame):  # noqa: ARG001 - signal handler signature
    raise _Timeout()


# ----------------------------------------------------------------------------------------------------------------
# prolog checks: each returns (details, problems)
# ----------------------------------------------------------------------------------------------------------------
def check_memory(min_free_mb: float) -> tuple[dict, list[str]]:
    import psutil

    vm = psutil.virtual_memory()
    free_mb = vm.available / 2**20
    problems = [f"only {free_mb:.0f} MiB memory available (< {min_free_mb:.0f} MiB)"] if free_mb < min_free_mb else []
    return {"mem_available_mb": round(free_mb), "mem_total_mb": round(vm.total / 2**20)}, problems


def check_disk(paths: list[str], min_free_mb: float) -> tuple[dict, list[str]]:
    import psutil

    details, problems = {}, []
    for path in dict.fromkeys(paths):  # unique, in order
        try:
            free_mb = psutil.disk_usage(path).free / 2**20
        except OSError as e:
            problems.append(f"cannot stat {path}: {e.strerror}")
            continue
        details[path] = round(free_mb)
        if free_mb < min_free_mb:
            problems.append(f"only {free_mb:.0f} MiB free on {path} (< {min_free_mb:.0f} MiB)")
    return {"disk_free_mb": details}, problems


def check_load(max_per_cpu: float) -> tuple[dict, list[str]]:
    import psutil

    cpus = psutil.cpu_count() or 1
    load1 = os.getloadavg()[0]
    problems = [f"1-minute load {load1:.1f} on {cpus} CPUs (> {max_per_cpu:g} per CPU)"] if load1 > max_per_cpu * cpus else []
    return {"load1": round(load1, 2), "cpus": cpus}, problems


def check_gpus() -> tuple[dict, list[str]]:
    """Every GPU answers NVML queries (memory, temperature) and has no pending retired pages. No pynvml, no
    driver, or no GPU: skipped."""
    try:
        import pynvml
    except ImportError:
        return {"gpus": "skipped: no pynvml"}, []
    try:
        pynvml.nvmlInit()
    except Exception as e:  # noqa: BLE001 - NVMLError_LibraryNotFound, DriverNotLoaded, ...: no GPUs here
        return {"gpus": f"skipped: {type(e).__name__}"}, []
    problems, gpus = [], []
    try:
        count = pynvml.nvmlDeviceGetCount()
        for i in range(count):
            try:
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                mem = pynvml.nvmlDeviceGetMemoryInfo(h)
                temp = pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)
                gpus.append({"index": i, "mem_used_mb": round(mem.used / 2**20), "temp_c": temp})
                try:
                    if pynvml.nvmlDeviceGetRetiredPagesPendingStatus(h):
                        problems.append(f"GPU {i} has retired pages pending (needs a reset)")
                except pynvml.NVMLError:
                    pass  # not supported on this GPU
            except pynvml.NVMLError as e:
                problems.append(f"GPU {i} does not answer NVML: {e}")
    except _Timeout:
        problems.append("an NVML query did not return in time")
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass
    return {"gpus": gpus if count else "none"}, problems


# ----------------------------------------------------------------------------------------------------------------
# epilog
# ----------------------------------------------------------------------------------------------------------------
def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        raw = f.read()
    return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)


def kill_leftovers(job_id: str, node: str, uid: int | None) -> tuple[dict, list[str]]:
    """SIGKILL TrainMover worker processes (env TM_COORDINATOR) of SLURM job ``job_id`` on ``node`` (several
    nodes may share a host: SLURMD_NODENAME tells them apart). Reads /proc directly: no psutil import here."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        pid = int(entry)
        try:
            if uid is not None and os.stat(f"/proc/{pid}").st_uid != uid:
                continue
            env = _environ(pid)
        except OSError:
            continue  # gone, or not readable
        if env.get("SLURM_JOB_ID") == job_id and env.get("SLURMD_NODENAME", node) == node and "TM_COORDINATOR" in env:
            found.append(pid)
    for pid in found:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    deadline = time.monotonic() + 0.2
    alive = found
    while alive and time.monotonic() < deadline:
        time.sleep(0.01)  # a killed process vanishes from /proc once reaped; nothing to wait on for non-children
        alive = [pid for pid in alive if os.path.exists(f"/proc/{pid}") and _state(pid) != "Z"]
    problems = [f"processes {alive} of job {job_id} survive SIGKILL"] if alive else []
    return {"killed": [pid for pid in found if pid not in alive]}, problems


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "X"


class TmdNotice:
    """The epilog's NodeNotice to the tmd named by the job's tmd.json: :meth:`send` opens the connection (reading
    tmd.json and the hook key: call it as the job's user) and sends; :meth:`wait_ack` resends until tmd
    acknowledges; :meth:`close`. :attr:`outcome` says what happened, for the report."""

    def __init__(self, state_dir: str | None, job_id: str, node: str, detail: str) -> None:
        p = _protocol()
        self.notice = p.NodeNotice(node=node, job_id=job_id, hook=p.HookKind.EPILOG, detail=detail)
        self.state_dir, self.sock, self.ctx, self.address, self.sends, self.sent_at = state_dir, None, None, "", 0, 0.0
        self.outcome = "no state dir"

    def send(self) -> None:
        if self.state_dir is None:
            return
        p = _protocol()
        try:
            with open(p.layout.job_tmd_json(self.notice.job_id, root=self.state_dir)) as f:
                info = json.load(f)
            self.address, keys_dir = info["address"], info.get("keys")
        except (OSError, ValueError, KeyError, TypeError):
            self.outcome = "no tmd for this job"
            return
        import zmq
        from tmd.protocol.keys import JobKeys, KeysUnavailable

        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)  # the hook waits for the acknowledgement itself; nothing after close
        try:
            if keys_dir:  # the job's hook key (read as the job's user: tmd.json names it)
                JobKeys.load(keys_dir, parties=(p.Sender.HOOK,)).connect_as(self.sock, p.Sender.HOOK)
            self.sock.connect(self.address)
            self.sent_at = time.monotonic()
            self._send()
            self.outcome = f"notice sent to {self.address}, not acknowledged"
        except (zmq.ZMQError, KeysUnavailable, OSError) as e:  # OSError: tmd.rundir.UnsafePath among others
            self.outcome = f"notice to {self.address} failed: {e}"
            self.close()

    def _send(self) -> None:
        import zmq

        try:
            self.sock.send(_protocol().encode(self.notice), zmq.NOBLOCK)  # queued until connected
            self.sends += 1
        except zmq.Again:
            pass  # the queue is full: the copies before this one are on their way

    def wait_ack(self, deadline: float) -> None:
        """Wait until tmd acknowledges the notice or ``deadline`` (time.monotonic()), resending every RESEND_S.
        A frame that is not this notice's acknowledgement is ignored."""
        if self.sock is None:
            return
        p = _protocol()
        next_send = self.sent_at + RESEND_S
        while (now := time.monotonic()) < deadline:
            if self.sock.poll(max(1, int(1000 * (min(deadline, next_send) - now)))):
                try:
                    ack = p.decode(self.sock.recv())
                except p.ProtocolError:
                    continue
                n = self.notice
                if ack == p.NodeNoticeAck(node=n.node, job_id=n.job_id, hook=n.hook):
                    self.outcome = (f"notice acknowledged by {self.address} in {time.monotonic() - self.sent_at:.3f} s "
                                    f"({self.sends} sent)")
                    return
            elif time.monotonic() >= next_send:
                self._send()
                next_send += RESEND_S
        self.outcome = f"notice sent to {self.address} {self.sends} times, not acknowledged within the hook's budget"

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.ctx.term()
            self.sock = None


# ----------------------------------------------------------------------------------------------------------------
def _user_state_dir(args: argparse.Namespace, uid: int | None) -> str | None:
    """``--state-dir``, else the job user's (``~<user>/.trainmover``: the hooks run as root), else None."""
    if args.state_dir:
        return args.state_dir
    try:
        return _protocol().layout.state_dir(home=pwd.getpwuid(uid).pw_dir) if uid is not None else None
    except KeyError:
        return None


def _as_user(uid: int | None, gid: int | None, fn):
    """``fn()`` run with the job user's effective ids and no supplementary groups, and its value: root reads
    and writes nothing in a user's state directory as root, so no path the user controls (a symlink, a
    ``keys`` field in tmd.json) leads it to a file the user could not read or write. Raises PermissionError,
    without calling ``fn``, when the hook runs as root and the job's user is unknown."""
    if os.geteuid() == 0 and uid is None:
        raise PermissionError("the job's user is unknown (no SLURM_JOB_UID): its state directory is not touched")
    drop = os.geteuid() == 0 and uid != 0
    if drop:
        groups = os.getgroups()
        os.setgroups([])
        os.setegid(gid if gid is not None else uid)
        os.seteuid(uid)
    try:
        return fn()
    finally:
        if drop:
            os.seteuid(0)
            os.setegid(0)
            os.setgroups(groups)


def _write_report(state_dir: str | None, report: dict) -> None:
    if state_dir is None:
        return
    d = _protocol().layout.hook_report_dir(report["job_id"], root=state_dir)
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-")
    with os.fdopen(fd, "w") as f:
        json.dump(report, f)
    os.chmod(tmp, 0o644)
    os.replace(tmp, os.path.join(d, f"{report['hook']}.{report['node']}.json"))


def main(argv: list[str] | None = None) -> int:
    hooks = _protocol().HookKind
    ap = argparse.ArgumentParser(description="TrainMover SLURM prolog/epilog")
    ap.add_argument("hook", type=hooks, choices=list(hooks))
    ap.add_argument("--state-dir", help="TrainMover state dir (default ~<job user>/.trainmover)")
    ap.add_argument("--log", help="append one JSON line per run to this file")
    ap.add_argument("--min-free-mem-mb", type=float, default=256.0)
    ap.add_argument("--min-free-disk-mb", type=float, default=512.0)
    ap.add_argument("--max-load-per-cpu", type=float, default=8.0)
    ap.add_argument("--budget-s", type=float, default=BUDGET_S,
                    help="seconds the whole hook may take, interpreter start-up included (default %(default)s)")
    args = ap.parse_args(argv)
    if os.geteuid() == 0:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, -5)
        except OSError:
            pass
    env = os.environ
    job_id = env.get("SLURM_JOB_ID", "")
    node = env.get("SLURMD_NODENAME", "") or os.uname().nodename
    uid = int(env["SLURM_JOB_UID"]) if env.get("SLURM_JOB_UID", "").isdigit() else None
    gid = int(env["SLURM_JOB_GID"]) if env.get("SLURM_JOB_GID", "").isdigit() else None
    report: dict = {"hook": args.hook, "node": node, "job_id": job_id, "ts": time.time(), "ok": True,
                    "problems": [], "checks": {}}
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, max(0.05, args.budget_s - _process_age_s()))
    code = 0
    try:
        if args.hook == hooks.PROLOG:
            for details, problems in (check_memory(args.min_free_mem_mb),
                                      check_disk(["/", tempfile.gettempdir()], args.min_free_disk_mb),
                                      check_load(args.max_load_per_cpu), check_gpus()):
                report["checks"].update(details)
                report["problems"] += problems
        else:
            # The notice first: it is what tmd needs soonest; then the cleanup, then tmd's acknowledgement.
            _protocol()
            import zmq  # noqa: F401 - imported as root: the job's user may not read the interpreter's files
            import tmd.protocol.keys  # noqa: F401
            notice = TmdNotice(_user_state_dir(args, uid), job_id, node, "node left the job")
            try:
                if job_id:
                    try:  # as the job's user: tmd.json and the keys it names are the user's to choose
                        _as_user(uid, gid, notice.send)
                    except PermissionError as e:
                        notice.outcome = f"not sent: {e}"
                details, problems = kill_leftovers(job_id, node, uid) if job_id else ({}, [])
                report["checks"].update(details)
                report["problems"] += problems
                notice.wait_ack(time.monotonic() + args.budget_s - REPORT_S - _process_age_s())
            finally:
                notice.close()
                report["notice"] = notice.outcome if job_id else "no job"
        report["ok"] = not report["problems"]
        code = 0 if report["ok"] else 1
    except _Timeout:
        report["error"] = f"hook ran out of its {args.budget_s:g} s budget"
    except Exception as e:  # noqa: BLE001 - a broken hook must never drain a node
        report["error"] = f"{type(e).__name__}: {e}"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    report["duration_s"] = round(_process_age_s(), 3)  # wall time since the hook started, interpreter start-up included
    try:
        state_dir = _user_state_dir(args, uid)
        if job_id:
            _as_user(uid, gid, lambda: _write_report(state_dir, report))
    except Exception as e:  # noqa: BLE001 - the report is best effort
        report["report_error"] = f"{type(e).__name__}: {e}"
    if args.log:
        try:
            with open(args.log, "a") as f:
                f.write(json.dumps(report) + "\n")
        except OSError:
            pass
    if code:
        print(f"trainmover {args.hook} on {node}: node unfit: {'; '.join(report['problems'])}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())

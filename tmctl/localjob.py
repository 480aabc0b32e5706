"""A local job driven from Python: the one harness the end-to-end tests, the benchmarks and the demo share.

It starts ``tmd local`` on the demo workload (examples.train_gpt, or another script), finds tmd's address in the run
directory, drives it through tmctl's client (status, migrations), reads tmd's journal and every rank's final state
hash, and scrapes the job's ``/metrics``. :class:`Job` bundles these for one job; the functions below are its
parts, for callers that start tmd their own way. It ships with the project (``pip install .``), so that
``python -m benchmarks.migration`` and ``python -m examples.demo`` work outside a source checkout.
"""
from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time
from typing import Optional

from tmctl.client import Client, CoordinatorUnreachable, find_keys
from tmctl.warm_start import start_tmd
from tmd import protocol as p
from tmd.journal import read_events

POLL_S = 0.05  # seconds between looks at another process's state (a file, tmd's status): there is no event


def events(run_dir: str) -> list[dict]:
    """tmd's journal of ``run_dir`` (``events.jsonl``), oldest first."""
    return read_events(os.path.join(run_dir, "events.jsonl"))


def wait_until(predicate, timeout_s: float, what: str, poll_s: float = 0.1):
    """``predicate()``'s first truthy value, polled every ``poll_s`` s; AssertionError after ``timeout_s`` s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)  # polling another process's (or SLURM's) state: there is no event to wait on
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def tmd_command(run_dir: str, standbys: int, steps: int, tiny: bool, quiet: bool, script_args: tuple = (),
                tmd_args: tuple = (), nodes: int = 2, ranks_per_node: int = 2,
                script: str = "examples.train_gpt") -> list[str]:
    """``tmd local`` for ``nodes`` nodes x ``ranks_per_node`` ranks (2 x 2 by default) running ``script``
    (examples.train_gpt by default; ``script_args`` are appended to it, ``tmd_args`` to tmd's own options)."""
    cmd = [sys.executable, "-m", "tmd.cli", "local", "--nodes", str(nodes), "--ranks-per-node", str(ranks_per_node),
           "--standbys", str(standbys), "--run-dir", run_dir, *tmd_args]
    if quiet:
        cmd.append("--quiet")
    cmd += ["--", sys.executable, "-m", script, "--steps", str(steps), *script_args]
    return cmd + (["--tiny"] if tiny else [])


def end_job(proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """Terminate ``tmd`` if it still runs (a failed test: tmd terminates its processes on SIGTERM) and wait for it,
    at most ``timeout_s`` seconds (then ``subprocess.TimeoutExpired``)."""
    if proc.poll() is None:
        proc.terminate()
        proc.wait(timeout=timeout_s)


def final_hashes(run_dir: str, rng: bool = False) -> dict:
    """Every rank's final state sha256 {rank: hex}, from ``<run_dir>/final/rank*.json`` (written by
    examples.state_hash at the end of training); {} before any is written. ``rng``: {rank: (state hex, RNG hex)},
    the RNG hash being None where the script wrote none."""
    out: dict = {}
    for path in sorted(glob.glob(os.path.join(run_dir, "final", "rank*.json"))):
        with open(path) as f:
            d = json.load(f)
        out[d["rank"]] = (d["state_sha256"], d.get("rng_sha256")) if rng else d["state_sha256"]
    return out


def reference_hashes(run_dir: str, steps: int, script_args: tuple = (), nodes: int = 2, ranks_per_node: int = 2,
                     timeout_s: float = 300.0) -> dict[int, str]:
    """Run an uninterrupted job of ``steps`` steps (no standby, ``script_args`` for the demo workload) in
    ``run_dir`` and return every rank's final state sha256 {rank: hex}. Raises CalledProcessError on a non-zero
    exit, TimeoutExpired after ``timeout_s`` seconds."""
    run_tmd(tmd_command(run_dir, 0, steps, True, True, script_args, nodes=nodes, ranks_per_node=ranks_per_node),
            run_dir, timeout_s)
    return final_hashes(run_dir)


def run_tmd(cmd: list[str], run_dir: str, timeout_s: float = 300.0, check: bool = True,
            capture: bool = False) -> subprocess.CompletedProcess:
    """Run the tmd command ``cmd`` (:func:`tmd_command`'s, for the job in ``run_dir``) to its end, started as
    :func:`tmctl.warm_start.start_tmd` starts it, its output in :func:`tmd_log`. Returns its result; with
    ``capture``, tmd's stdout and stderr as text in it (stderr written apart, to ``<run_dir>.tmd.err``), as
    ``subprocess.run(cmd, capture_output=True, text=True)`` gives them (what this run appended). Raises
    CalledProcessError on a non-zero exit with ``check``, TimeoutExpired after ``timeout_s`` seconds (tmd is ended
    then)."""
    log, err = tmd_log(run_dir), (run_dir.rstrip("/") + ".tmd.err" if capture else None)
    before = {path: os.path.getsize(path) if os.path.exists(path) else 0 for path in (log, err) if path}
    proc = start_tmd(cmd, log, err)
    try:
        rc = proc.wait(timeout=timeout_s)
    finally:
        end_job(proc)
    if check and rc != 0:
        raise subprocess.CalledProcessError(rc, cmd)
    if not capture:
        return subprocess.CompletedProcess(cmd, rc)
    out, error = ("" if not os.path.exists(path) else _read_from(path, before[path]) for path in (log, err))
    return subprocess.CompletedProcess(cmd, rc, out, error)


def _read_from(path: str, offset: int) -> str:
    """What ``path`` holds past ``offset`` bytes, as text."""
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")


def pace_args(run_dir: str) -> tuple[str, str]:
    """``--pace-file <run_dir>.pace`` for a script that pads its steps (``--min-step-time-s``, examples.pacing),
    with that file made: the job is padded until :func:`end_padding`."""
    open(pace_file(run_dir), "w").close()
    return "--pace-file", pace_file(run_dir)


def end_padding(run_dir: str) -> None:
    """Let the job in ``run_dir`` train at its own speed from now on (each rank sees it at its next step; see
    :func:`pace_args`): call it once a test's faults and migrations are over and the rest of the job is only the
    steps its reference has. Nothing happens to a job that is not padded."""
    if os.path.exists(pace_file(run_dir)):
        os.unlink(pace_file(run_dir))


def pace_file(run_dir: str) -> str:
    """The pace file of the job in ``run_dir`` (:func:`pace_args`): ``<run_dir>.pace``."""
    return run_dir.rstrip("/") + ".pace"


def tmd_log(run_dir: str) -> str:
    """Where a tmd that :func:`tmctl.warm_start.start_tmd` forked warm writes its output: ``<run_dir>.tmd.log``."""
    return run_dir.rstrip("/") + ".tmd.log"


def wait_for_address(run_dir: str, proc: subprocess.Popen, timeout_s: float = 60.0) -> str:
    """tmd's address from ``<run_dir>/tmd.json``, once tmd wrote it. Raises RuntimeError if ``proc`` (tmd) exits
    first, TimeoutError after ``timeout_s`` seconds."""
    path = p.layout.RunDir(run_dir).tmd_json
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"tmd exited with {proc.returncode} before it was up")
        try:
            with open(path) as f:
                return json.load(f)["address"]
        except FileNotFoundError:
            pass
        except ValueError:  # caught half-written by a writer that does not rename into place: read it again
            pass
        time.sleep(POLL_S)  # another process writes it: nothing to wait on
    raise TimeoutError(f"tmd did not write {path} within {timeout_s} s")


def job_client(run_dir: str, proc: subprocess.Popen, timeout_s: float = 10.0) -> Client:
    """A tmctl client of the job in ``run_dir`` (waits for its tmd.json), authenticated with the job's keys."""
    return Client(wait_for_address(run_dir, proc), timeout_s=timeout_s, keys_dir=find_keys(run_dir, None))


def migrate_when_ready(client: Client, proc: subprocess.Popen, at_step: int, source: str | list[str],
                       target: str | list[str]) -> dict:
    """Wait until training reaches ``at_step`` and every standby is warm, request the migration, follow it.
    ``source`` and ``target`` are a node each, or lists of as many nodes (moved in one migration)."""
    sources = [source] if isinstance(source, str) else list(source)
    targets = [target] if isinstance(target, str) else list(target)
    while True:
        if proc.poll() is not None:
            raise RuntimeError("the job ended before the migration was requested")
        st = client.request(p.StatusRequest())
        warm = {n["name"] for n in st.nodes if n["warm"]}
        if st.step >= at_step and warm >= set(targets):
            break
        time.sleep(0.2)
    reply = client.request(p.MigrateRequest(sources=sources, targets=targets))
    if isinstance(reply, p.ErrorReply):
        raise RuntimeError(f"migration refused: {reply.message}")
    mid = reply.migration["id"]
    print(f"[job] migration {mid}: {','.join(sources)} -> {','.join(targets)} requested at step {st.step}", flush=True)
    seen = set()
    while True:
        m = client.request(p.MigrationRequest(migration_id=mid)).migration
        if m["state"] not in seen:
            seen.add(m["state"])
            print(f"[job] migration {mid}: {m['state']}" + (f" ({m['reason']})" if m["reason"] else ""), flush=True)
        if p.MigrationState(m["state"]).finished:
            break
        time.sleep(0.05)
    # downtime_s is known once the 5 steps after the switch step are done
    while m["state"] == p.MigrationState.COMMITTED and m["downtime_s"] is None and proc.poll() is None:
        time.sleep(0.2)
        try:
            m = client.request(p.MigrationRequest(migration_id=mid)).migration
        except CoordinatorUnreachable:
            break
    return m


def web_of(run_dir: str) -> tuple[str, str]:
    """The status page's address and the job's web token, from the run dir's tmd.json (``web``)."""
    with open(p.layout.RunDir(run_dir).tmd_json) as f:
        web = json.load(f)["web"]
    with open(web["token_file"]) as f:
        return web["url"], f.read().strip()


def scrape(run_dir: str) -> dict[tuple[str, tuple], float]:
    """Every sample of the job's ``/metrics`` (with its token): ``(name, sorted (label, value) pairs) -> value``.
    Raises urllib.error.URLError when tmd does not answer."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    url, token = web_of(run_dir)
    req = urllib.request.Request(url.rstrip("/") + "/metrics", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        body = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body) for s in family.samples}


def diagnose(run_dir: str, settle_s: float = 1.0, lines: int = 15, stack_lines: int = 80,
             last_events: int = 30) -> str:
    """What a failed end-to-end test prints about the job in ``run_dir``: the last ``last_events`` journal
    events; each rank process still running is asked for its threads' stacks (SIGUSR1, see
    worker.session.init; written to its log) and, after ``settle_s`` seconds, each log's last ``lines`` lines
    from before that and at most ``stack_lines`` lines of what came after (the stacks)."""
    try:
        journal = events(run_dir)
    except OSError as e:
        return f"no journal: {e}"
    logs = {path: os.path.getsize(path) for path in sorted(glob.glob(os.path.join(run_dir, "logs", "*.log")))}
    dumped = []
    for e in journal:
        if e["event"] == p.Event.WORKER_REGISTERED and _is_rank_of(e["pid"], run_dir):
            os.kill(e["pid"], signal.SIGUSR1)
            dumped.append(f"{e['node']}/{e['local_rank']}")
    if dumped:
        time.sleep(settle_s)  # faulthandler writes from the signal handler: no event to wait on
    out = ["last events:", *(json.dumps(e)[:300] for e in journal[-last_events:]),
           f"stacks asked of the processes still running: {', '.join(dumped) or 'none'}"]
    for path, size in logs.items():
        with open(path, "rb") as f:
            before = f.read(size).decode(errors="replace").splitlines()[-lines:]
            after = f.read().decode(errors="replace").splitlines()[:stack_lines]
        out += [f"--- {os.path.basename(path)}", *before, f"--- {os.path.basename(path)}, since the signal", *after]
    log = tmd_log(run_dir)
    if os.path.exists(log):  # a tmd forked warm (tmctl.warm_start) wrote its output there
        with open(log, "rb") as f:
            out += [f"--- {os.path.basename(log)}", *f.read().decode(errors="replace").splitlines()[-lines:]]
    return "\n".join(out)


def _is_rank_of(pid: int, run_dir: str) -> bool:
    """Whether ``pid`` still runs with ``TM_RUN_DIR`` set to ``run_dir`` (not a reused pid)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
    except OSError:
        return False
    return os.path.realpath(env.get(b"TM_RUN_DIR", b"").decode(errors="replace")) == os.path.realpath(run_dir)


class Job:
    """One ``tmd local`` job (:func:`tmd_command`: ``nodes`` x ``ranks_per_node`` ranks of ``script`` for ``steps``
    steps, tiny model, ``standbys`` standby nodes), started in ``run_dir`` on construction and followed through a
    tmctl client. Raises what :func:`wait_for_address` raises (tmd then is ended). Use it as a context manager, or
    call :meth:`finish` or :meth:`close`: either ends tmd if it still runs.

    A job whose ``script_args`` pad its steps (``--min-step-time-s``, examples.pacing) is padded only until
    :meth:`end_padding`: the Job passes ``--pace-file <run_dir>.pace`` to the script and makes that file."""

    def __init__(self, run_dir: str, standbys: int, steps: int, *script_args: str, tmd_args: tuple = (),
                 nodes: int = 2, ranks_per_node: int = 2, script: str = "examples.train_gpt", tiny: bool = True,
                 quiet: bool = True, stdout=subprocess.DEVNULL, client_timeout_s: float = 10.0) -> None:
        self.run_dir = run_dir
        self.client: Optional[Client] = None
        if "--min-step-time-s" in script_args and "--pace-file" not in script_args:
            script_args = (*script_args, *pace_args(run_dir))
        cmd = tmd_command(run_dir, standbys, steps, tiny, quiet, script_args, tmd_args, nodes=nodes,
                          ranks_per_node=ranks_per_node, script=script)
        self.proc = start_tmd(cmd, tmd_log(run_dir)) if stdout == subprocess.DEVNULL else subprocess.Popen(
            cmd, stdout=stdout)
        try:
            self.client = job_client(run_dir, self.proc, client_timeout_s)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> "Job":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def status(self) -> p.StatusReply:
        return self.client.request(p.StatusRequest())

    def events(self, name: Optional[str] = None) -> list[dict]:
        """The journal's events named ``name`` (every event: None), oldest first."""
        return [e for e in events(self.run_dir) if name is None or e["event"] == name]

    def wait_event(self, name: str, timeout_s: float = 120, poll_s: float = 0.1, **fields) -> dict:
        """The first journal event ``name`` whose ``fields`` have these values, once there is one (AssertionError
        after ``timeout_s`` s)."""
        return wait_until(lambda: next((e for e in self.events(name) if all(e.get(k) == v for k, v in fields.items())),
                                       None), timeout_s, f"event {name} {fields}", poll_s=poll_s)

    def pids(self, node: str) -> list[int]:
        """The pids of every rank process ``node`` registered (journal: ``worker_registered``)."""
        return [e["pid"] for e in self.events(p.Event.WORKER_REGISTERED) if e["node"] == node]

    def wait_training(self, min_step: int = 8, timeout_s: float = 120) -> p.StatusReply:
        """tmd's status once training reached ``min_step`` and a standby is warm."""
        def ready():
            st = self.status()
            return st.step >= min_step and any(n["warm"] for n in st.nodes) and st

        return wait_until(ready, timeout_s, "training and a warm standby")

    def migrate(self, source: str, target: str, timeout_s: float = 120) -> int:
        """Request a migration (in process: no tmctl start-up delay) as soon as tmd accepts it (the job trains,
        ``target`` is warm); returns its id. Raises AssertionError on another refusal, or after ``timeout_s`` s.
        It asks tmd's status (which journals nothing) until the job is past its recorded steps and ``target`` is
        warm, so that the journal does not fill with ``migrate_refused``."""
        def request():
            st = self.client.request(p.StatusRequest())
            record_steps = ((st.config or {}).get("replay") or {}).get("record_steps", 0)
            if st.step <= record_steps or not any(n["name"] == target and n["warm"] for n in st.nodes):
                return None
            reply = self.client.request(p.MigrateRequest(sources=[source], targets=[target]))
            if isinstance(reply, p.ErrorReply) and reply.code in (p.ErrorCode.NOT_READY, p.ErrorCode.BUSY_STANDBY):
                return None  # not training yet, or the standby is still starting
            assert isinstance(reply, p.MigrationReply), reply
            return reply.migration["id"]

        return wait_until(request, timeout_s, f"migration {source} -> {target} accepted", poll_s=POLL_S)

    def finished(self, migration_id: int, timeout_s: float = 60) -> dict:
        """The journal's ``migration_committed`` or ``migration_aborted`` event of ``migration_id``, once written."""
        def end():
            return next((e for e in events(self.run_dir) if e.get("migration_id") == migration_id and e["event"] in (
                p.Event.MIGRATION_COMMITTED, p.Event.MIGRATION_ABORTED)), None)

        return wait_until(end, timeout_s, f"the end of migration {migration_id}", poll_s=0.02)

    def tmctl(self, *args: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
        """``tmctl ARGS --run-dir RUN_DIR`` in a process of its own (text output captured)."""
        return subprocess.run([sys.executable, "-m", "tmctl.cli", *args, "--run-dir", self.run_dir],
                              capture_output=True, text=True, timeout=timeout_s)

    def final_hashes(self) -> dict[int, str]:
        return final_hashes(self.run_dir)

    def end_padding(self) -> None:
        """Let the job train at its own speed from now on (:func:`end_padding`)."""
        end_padding(self.run_dir)

    def finish(self, timeout_s: float = 240) -> int:
        """tmd's exit code once the job ended (at most ``timeout_s`` s, then TimeoutExpired); tmd is ended either
        way."""
        try:
            return self.proc.wait(timeout=timeout_s)
        finally:
            self.close()

    def close(self) -> None:
        """Close the client and end tmd if it still runs (:func:`end_job`)."""
        if self.client is not None:
            self.client.close()  # idempotent; a later request would open a new socket
        end_job(self.proc)

"""SLURM mode: tmd runs in a training job's batch script and uses SLURM for what local mode does by hand.

- Ranks: node-major over the job's node list (``scontrol show hostnames $SLURM_JOB_NODELIST``); every rank
  process is one ``srun --jobid=J --overlap --no-kill --nodes=1 --ntasks=1 --nodelist=NODE`` started by
  :class:`SrunLauncher`, so tmd sees each process exit exactly as in local mode (the same daemon code paths).
- Standbys: jobs in the standby reservation (``sbatch --reservation=standby slurm/standby.sbatch JOBID``) whose
  first script argument is this job's id. Once such a job runs, its nodes join the registry as standby nodes
  and tmd starts the standby workers into it (``srun --jobid=STANDBY_JOB --overlap``); they register and warm up.
  With ``--keep-standbys N`` tmd submits such jobs itself (tmd.standby_pool) and cancels them when the job ends.
  Every pick of a standby skips nodes that SLURM drains, and never picks one twice (Registry.warm_standbys).
- Drains: a node of the job that an admin drains (``scontrol update NodeName=X State=DRAIN Reason=...``) is
  migrated to a warm standby automatically; the event records the admin's reason. After any committed migration
  the left node goes back to SLURM: the job holding it shrinks (``scontrol update JobId=J NodeList=...``), or a
  standby job with no node left in use is cancelled; a batch host (tmd's, or a standby job's still in use) stays
  until its job ends. So a draining node becomes DRAINED without waiting for the training job to end.
- Failed nodes: a node whose processes failed (not one lost with its standby job's end) is drained
  (``scontrol update NodeName=X State=DRAIN Reason="trainmover: ..."``, which needs SLURM operator rights) and
  then handed back like a left node, so that the scheduler does not hand it out again until an admin resumes it.
- Restarts from a checkpoint (the checkpoint tier, tmd.tiers): inside the allocation, on the surviving nodes plus
  standby nodes (:meth:`SlurmCluster.rebuild_world`, then tmd.cli relaunches every process under a new daemon on
  the same address, :meth:`SlurmCluster.relaunch`); ``scontrol requeue`` only where too few usable nodes are left.
- Hooks: the prolog report (``slurm/hooks.py``) of each node of the job and of its standby jobs is journalled as
  soon as it is there (SLURM may list a job as RUNNING while its prologs still run: tmd looks again with each
  poll, for up to PROLOG_REPORT_WAIT_S); the epilog's :class:`tmd.protocol.NodeNotice` (acknowledged, journalled
  once however often the hook resends it) marks a standby node whose job ended as lost at once.
- ``$TM_STATE_DIR/jobs/<JOBID>/tmd.json`` (default ``~/.trainmover``) names tmd for ``tmctl --job JOBID``, the
  standby jobs and the epilog; tmd writes one for each of its standby jobs too.

Every SLURM client call has a timeout (``timeout_s``) and runs off tmd's loop, in the :class:`Poller` thread,
except the few quick ones at start-up. A failing or slow client is journalled (``slurm_error``) and retried on
the next poll; it never stops the job.
"""
from __future__ import annotations

import dataclasses
import json
import os
import queue
import subprocess
import sys
import threading
import time
from typing import Callable, Iterable, Optional

from tmd import protocol as p
from tmd.control import JobControl
from tmd.local import LocalLauncher, Proc
from tmd.migration import MigrationError
from tmd.protocol.vocab import ErrorCode, Event, ExitCode, HookKind, NodeRole, StrEnum
from tmd.rundir import private_dir, write_atomic
from tmd.standby_pool import PoolPolicy, StandbyPoolConfig, parse_job_id, sbatch_argv

DEFAULT_TIMEOUT_S = 5.0  # every SLURM client call
DEFAULT_POLL_S = 1.0  # node states and standby jobs
RESTART_BACKOFF_S = 2.0  # a standby node's workers are started at most this often
DRAIN_AFTER_POLLS = 2  # polls after a standby job's node failed before it is drained (its job may be ending)
DRAIN_ATTEMPTS = 3  # automatic migrations tried per draining node (an aborted one is retried)
PROLOG_REPORT_WAIT_S = 120.0  # how long tmd looks for a node's prolog report once its job runs (no hooks: none)
ANY_STANDBY = "any"  # a migrate target meaning: any warm standby node


class SlurmJobState(StrEnum):
    """The SLURM job states (squeue's ``%T``) tmd acts on; squeue may report others (COMPLETED, ...)."""

    PENDING = "PENDING"
    CONFIGURING = "CONFIGURING"
    REQUEUED = "REQUEUED"
    RESIZING = "RESIZING"
    SUSPENDED = "SUSPENDED"
    RUNNING = "RUNNING"
    COMPLETING = "COMPLETING"
    UNKNOWN = "UNKNOWN"  # not SLURM's: squeue did not answer (hold_standby keeps holding)


STARTING_STATES = (SlurmJobState.PENDING, SlurmJobState.CONFIGURING, SlurmJobState.REQUEUED, SlurmJobState.RESIZING,
                   SlurmJobState.SUSPENDED)
DRAIN = "drain"  # in sinfo's node state (draining, drained): an admin drains the node
UNUSABLE = (DRAIN, "down", "fail", "maint", "not_responding")  # sinfo node states a standby must not be in


class SlurmError(RuntimeError):
    """A SLURM client failed, timed out or is missing; the message is one line."""


def run_slurm(argv: list[str], timeout_s: float = DEFAULT_TIMEOUT_S, cwd: Optional[str] = None,
              env: Optional[dict[str, str]] = None) -> str:
    """Run a SLURM client (``squeue``, ``sinfo``, ``scontrol``, ``sbatch``...) in ``cwd`` with ``env`` (None:
    tmd's) and return its stdout. Raises :class:`SlurmError` when it is not installed, runs longer than
    ``timeout_s`` seconds, or exits non-zero."""
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL,
                           cwd=cwd, env=env)
    except FileNotFoundError:
        raise SlurmError(f"{argv[0]} not found: is this a SLURM node (slurm-client installed, on PATH)?") from None
    except subprocess.TimeoutExpired:
        raise SlurmError(f"{' '.join(argv[:3])} did not answer within {timeout_s:g} s") from None
    if r.returncode != 0:
        why = " ".join((r.stderr or r.stdout).split()) or f"exit code {r.returncode}"
        raise SlurmError(f"{' '.join(argv[:3])}: {why}")
    return r.stdout


def hostnames(nodelist: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> list[str]:
    """``n[1-2],n5`` -> ``['n1', 'n2', 'n5']`` in SLURM's order (``scontrol show hostnames``)."""
    return run_slurm(["scontrol", "show", "hostnames", nodelist], timeout_s).split()


def write_json_atomic(path: str, obj: dict) -> None:
    """Write ``obj`` to ``path`` in a directory only this user can change (made 0700 if missing), never
    through a symlink (tmd.rundir). Raises OSError (tmd.rundir.UnsafePath for another user's directory)."""
    write_atomic(os.path.join(private_dir(os.path.dirname(path), "state directory"), os.path.basename(path)),
                 json.dumps(obj).encode())


def hook_report(job_id: str, hook: HookKind, node: str) -> Optional[dict]:
    """The report slurm/hooks.py wrote for ``hook`` (prolog or epilog) on ``node`` of SLURM job ``job_id``, or
    None while there is none (or none that reads as a JSON object)."""
    try:
        with open(os.path.join(p.layout.hook_report_dir(job_id), f"{hook}.{node}.json")) as f:
            report = json.load(f)
    except (OSError, ValueError):
        return None
    return report if isinstance(report, dict) else None


# ----------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class StandbyJob:
    job_id: str
    state: str  # squeue's %T: PENDING, CONFIGURING, RUNNING, COMPLETING, ...
    nodes: list[str]
    reason: str  # why it is pending (squeue's %r)
    batch_host: str = ""  # where its batch script runs: SLURM cannot shrink a job off that node


@dataclasses.dataclass
class Snapshot:
    """One poll. ``nodes``: node -> (sinfo state such as ``allocated``, ``draining``, ``drained``, ``down*``;
    reason). ``standby_jobs`` is None when squeue failed (then nothing is concluded from it). ``errors``: one line
    per failed call; ``done``: results of actions (releases) since the last snapshot."""

    seq: int
    nodes: dict[str, tuple[str, str]]
    standby_jobs: Optional[dict[str, StandbyJob]]
    reservation_ok: Optional[bool]
    errors: list[str]
    done: list[dict]


@dataclasses.dataclass
class Rebuild:
    """A restart from a checkpoint inside the allocation (:meth:`SlurmCluster.rebuild_world`): ``world``, the node
    of each place in rank order; ``replaced``, the first rank of each lost place -> the standby node taking it;
    ``standbys``, the other standby nodes (started again as standbys; one that SLURM drains stays unusable);
    ``gone``, the job's failed and left nodes -> (role, reason)."""
    world: list[str]
    replaced: dict[int, str]
    standbys: list[str]
    gone: dict[str, tuple[str, str]]


class Poller(threading.Thread):
    """Polls SLURM every ``poll_s`` seconds, off tmd's loop: the states of the watched nodes (sinfo), this job's
    standby jobs in ``reservation`` (squeue) and whether the reservation exists (scontrol). Also runs queued
    actions (``scontrol update``, ``scancel``). The latest :class:`Snapshot` is :attr:`latest`."""

    def __init__(self, job_id: str, reservation: str, poll_s: float = DEFAULT_POLL_S,
                 timeout_s: float = DEFAULT_TIMEOUT_S, user: Optional[str] = None) -> None:
        super().__init__(daemon=True, name="tm-slurm-poller")
        self.job_id = job_id
        self.reservation = reservation
        self.poll_s = poll_s
        self.timeout_s = timeout_s
        self.user = user or os.environ.get("SLURM_JOB_USER") or os.environ.get("USER") or ""
        self.latest: Optional[Snapshot] = None
        self._watch: set[str] = set()
        self._lock = threading.Lock()
        self._actions: "queue.Queue[tuple[str, Callable[[], str]]]" = queue.Queue()
        self._halt = threading.Event()
        self._seq = 0

    def watch(self, nodes: list[str]) -> None:
        """Poll the states of these nodes too (thread safe)."""
        with self._lock:
            self._watch.update(nodes)

    def submit(self, name: str, action: Callable[[], str]) -> None:
        """Run ``action`` (a blocking SLURM call returning a one-line result) on the next poll; its outcome comes
        back in :attr:`Snapshot.done` as ``{"action": name, "ok": bool, "result" or "error": str}``."""
        self._actions.put((name, action))  # the poll loop wakes up for it within 50 ms

    def stop(self, timeout_s: float = 2.0) -> None:
        self._halt.set()
        if self.is_alive():
            self.join(timeout_s)

    def poll_once(self) -> Snapshot:
        """One poll (also usable without the thread)."""
        errors: list[str] = []
        done: list[dict] = []
        while True:
            try:
                name, action = self._actions.get_nowait()
            except queue.Empty:
                break
            try:
                done.append({"action": name, "ok": True, "result": action()})
            except Exception as e:  # noqa: BLE001 - SlurmError, or a bug: reported either way
                done.append({"action": name, "ok": False, "error": str(e) if isinstance(e, SlurmError)
                             else f"{type(e).__name__}: {e}"})
        with self._lock:
            watch = sorted(self._watch)
        nodes: dict[str, tuple[str, str]] = {}
        if watch:
            try:
                out = run_slurm(["sinfo", "--noheader", "--Node", f"--nodes={','.join(watch)}",
                                 "--format=%N|%T|%E"], self.timeout_s)
                for line in out.splitlines():
                    name, _, rest = line.partition("|")
                    state, _, reason = rest.partition("|")
                    nodes[name.strip()] = (state.strip(), "" if reason.strip() == "none" else reason.strip())
            except SlurmError as e:
                errors.append(str(e))
        reservation_ok: Optional[bool] = None
        try:
            run_slurm(["scontrol", "show", f"reservation={self.reservation}", "--oneliner"], self.timeout_s)
            reservation_ok = True
        except SlurmError as e:
            if "not found" in str(e):
                reservation_ok = False
            else:
                errors.append(str(e))
        jobs: Optional[dict[str, StandbyJob]] = None
        try:
            argv = ["squeue", "--noheader", f"--reservation={self.reservation}", "--format=%i|%T|%N|%r|%B|%o"]
            if self.user:
                argv.append(f"--user={self.user}")
            out = run_slurm(argv, self.timeout_s)
            jobs = {}
            for line in out.splitlines():
                parts = line.split("|", 5)
                if len(parts) != 6:
                    continue
                jid, state, nodelist, reason, batch_host, command = (x.strip() for x in parts)
                args = command.split()
                if len(args) < 2 or args[1] != self.job_id or jid == self.job_id:
                    continue  # not a standby job of this job
                node_names = hostnames(nodelist, self.timeout_s) if nodelist and state == SlurmJobState.RUNNING else []
                jobs[jid] = StandbyJob(jid, state, node_names, "" if reason == "None" else reason,
                                       "" if batch_host in ("n/a", "(null)") else batch_host)
        except SlurmError as e:
            errors.append(str(e))
            jobs = None
        self._seq += 1
        return Snapshot(self._seq, nodes, jobs, reservation_ok, errors, done)

    def run(self) -> None:
        while not self._halt.is_set():
            try:
                snap = self.poll_once()
            except Exception as e:  # noqa: BLE001 - a bug here must not silence SLURM for the rest of the job
                self._seq += 1
                snap = Snapshot(self._seq, {}, None, None, [f"poller: {type(e).__name__}: {e}"], [])
            self.latest = snap
            deadline = time.monotonic() + self.poll_s
            while time.monotonic() < deadline and not self._halt.is_set() and self._actions.empty():
                self._halt.wait(0.05)


# ----------------------------------------------------------------------------------------------------------------
class SrunLauncher(LocalLauncher):
    """Local mode's launcher, with every process started through ``srun`` into the SLURM job that holds its node
    (the training job, or a standby job for standby nodes). Environment: as in local mode (TM_COORDINATOR,
    TM_NODE, TM_LOCAL_RANK, TM_STANDBY, TM_RUN_DIR, OMP_NUM_THREADS=1), minus the SLURM_* variables of tmd's
    own job step (SLURM_CONF stays). A standby node is started at most every ``RESTART_BACKOFF_S`` seconds."""

    FORK_SERVER = False  # srun starts the processes

    def __init__(self, command: list[str], run_dir: str, coordinator: str, ranks_per_node: int,
                 echo: bool = True, extra_env: Optional[dict[str, str]] = None) -> None:
        super().__init__(command, run_dir, coordinator, ranks_per_node, echo, extra_env)
        self.node_job: dict[str, str] = {}
        self._last_start: dict[str, float] = {}
        self._due: dict[str, tuple[float, bool]] = {}  # node -> (monotonic time, standby)

    def assign(self, node: str, job_id: str) -> None:
        """Processes of ``node`` run in SLURM job ``job_id``."""
        self.node_job[node] = job_id

    def forget(self, node: str) -> None:
        """The node's job is gone: start nothing more there and stop what still runs."""
        self.node_job.pop(node, None)
        self._due.pop(node, None)
        for proc in self.running(node):
            proc.popen.terminate()

    def argv(self, node: str, local_rank: int) -> list[str]:
        """One worker, started into the job that holds ``node`` (its own or a standby job's allocation)."""
        return ["srun", f"--jobid={self.node_job[node]}", "--overlap", "--no-kill", "--nodes=1", "--ntasks=1",
                f"--nodelist={node}", "--kill-on-bad-exit=0", f"--job-name=tm-{node}.{local_rank}", "--export=ALL",
                "--quiet", *self.command]

    def start_node(self, node: str, standby: bool) -> None:
        if node not in self.node_job:
            return
        now = time.monotonic()
        last = self._last_start.get(node)
        if standby and last is not None and now - last < RESTART_BACKOFF_S:
            self._due[node] = (last + RESTART_BACKOFF_S, standby)
            return
        self._last_start[node] = now
        for local_rank in range(self.ranks_per_node):
            self._spawn(node, local_rank, standby)

    def base_env(self) -> dict[str, str]:
        """The batch step's SLURM_* variables would confuse srun inside another job: pass only SLURM_CONF."""
        return {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}

    def poll(self) -> list[Proc]:
        exited = super().poll()
        now = time.monotonic()
        for node, (due, standby) in list(self._due.items()):
            if now >= due:
                del self._due[node]
                if not self.running(node):
                    self.start_node(node, standby)
        return exited


# ----------------------------------------------------------------------------------------------------------------
class SlurmCluster:
    """tmd's SLURM side; the daemon calls :meth:`tick` from its loop (``daemon.cluster``), :meth:`resolve_target`
    for each migrate request, :meth:`on_notice` for the epilog's NodeNotice and :meth:`decorate` for status.
    It acts on the job through ``control`` (tmd.control.JobControl: the daemon). All blocking SLURM calls run
    in the :class:`Poller` thread; this object lives in tmd's thread."""

    def __init__(self, control: JobControl, launcher: SrunLauncher, job_id: str, nodes: list[str], batch_host: str,
                 reservation: str = "standby", poll_s: float = DEFAULT_POLL_S,
                 timeout_s: float = DEFAULT_TIMEOUT_S, command: Optional[list[str]] = None,
                 pool: Optional[StandbyPoolConfig] = None) -> None:
        """``pool``: the standby pool's options (tmd.standby_pool; None or ``keep`` 0: standbys come only from
        jobs submitted by hand)."""
        self.attach(control)
        self.launcher = launcher
        self.job_id = job_id
        self.job_nodes = list(nodes)  # the training job's allocation, as SLURM has it now
        self.batch_host = batch_host
        self.reservation = reservation
        self.command = command or []
        self.poller = Poller(job_id, reservation, poll_s, timeout_s)
        self.poller.watch(nodes)
        self.node_state: dict[str, tuple[str, str]] = {}
        self.standby_jobs: dict[str, StandbyJob] = {}  # as last seen
        self.adopted: dict[str, list[str]] = {}  # standby job -> its nodes in the registry
        self.ended: dict[str, str] = {}  # standby job that ran and ended -> why
        self._seq = 0
        self._said: dict[str, str] = {}  # key -> last journalled message (journal changes only)
        self._drain_tries: dict[str, int] = {}
        self._drain_migration: dict[str, int] = {}  # node -> migration id
        self._released: set[str] = set()
        self._releasing: dict[str, tuple[str, list[str], str]] = {}  # node -> (job, nodes it keeps, how)
        self._reservation_ok: Optional[bool] = None
        self.pool_config = pool or StandbyPoolConfig()
        self.pool = PoolPolicy(self.pool_config) if self.pool_config.keep > 0 else None
        self._pool_live: set[str] = set()  # standby jobs tmd submitted that squeue still lists
        self._lost_with_job: set[str] = set()  # nodes lost because their standby job ended: not drained
        self._draining: set[str] = set()  # failed nodes tmd asked SLURM to drain
        self._failed_seen: dict[str, int] = {}  # failed node of a standby job -> the poll at which tmd saw it
        self._drained: set[str] = set()  # those SLURM drains: handed back like left nodes
        self._cancelling: set[str] = set()  # standby jobs being cancelled (drained ones of the pool; empty ones)
        self._cancel_why: dict[str, str] = {}  # job -> why it is cancelled (default: its nodes are drained)
        self._prologs_due: dict[tuple[str, str], float] = {}  # (SLURM job, node) -> until when to look for its report
        self._notices: set[tuple[str, str, str]] = set()  # (hook, SLURM job, node) of the NodeNotices journalled
        self._rebuild: Optional[Rebuild] = None  # planned by rebuild_world, carried out by relaunch

    def attach(self, control: JobControl) -> None:
        """Act on the job through ``control`` (the daemon, or the resumed one after a crash: tmd.supervise): its
        journal and registry, whose standby picks then skip the nodes SLURM drains."""
        self.control, self.journal, self.registry = control, control.journal, control.registry
        self.registry.unusable = self._unusable

    # --- lifecycle ------------------------------------------------------------------------------------------------
    def requeue(self) -> Optional[str]:
        """``scontrol requeue`` this job (the checkpoint tier, tmd.tiers: the world cannot be rebuilt inside the
        allocation): SLURM ends this run of the batch script and queues it again with the same job id, whose
        ``tmd slurm --checkpoint-dir DIR`` goes on from the job's newest checkpoint there. Blocks up to the
        SLURM timeout (the job is ending anyway). Returns None, or why it failed (one line: e.g. a job that is
        not requeueable, ``sbatch --no-requeue``)."""
        try:
            run_slurm(["scontrol", "requeue", self.job_id], self.poller.timeout_s)
        except SlurmError as e:
            return str(e)
        return None

    def rebuild_world(self) -> tuple[Optional["Rebuild"], str]:
        """Plan a restart from a checkpoint inside the allocation (the checkpoint tier, tmd.tiers): the nodes every
        rank is relaunched on, in rank order (place i holds ranks ``i * ranks_per_node`` ...). Each surviving
        active node keeps its place; each place whose node is lost (failed, cut off, or holding no rank any more)
        is taken by a standby node of an adopted standby job (warm or not: every process restarts), in
        registration order. Nodes that SLURM drains or reports down are never used; failed nodes are not used
        again (tmd drains them: their processes died, hung or were cut off). Returns (the plan, "") or (None, why
        not: fewer usable standbys than lost places, one line); then the job is requeued instead."""
        reg = self.registry
        rpn = reg.ranks_per_node
        places = reg.world_size // rpn
        usable = {name for name in self.launcher.node_job if self._unusable(name) is None}
        holders = {node.ranks[0] // rpn: node.name for node in reg.nodes_in(NodeRole.ACTIVE)
                   if node.ranks and node.name in usable}
        lost = [i for i in range(places) if i not in holders]
        standby = (NodeRole.STANDBY, NodeRole.GUARDING, NodeRole.JOINING)  # every process restarts: standbys all
        spares = [n.name for n in reg.nodes_in(*standby) if n.name in usable]
        if len(spares) < len(lost):
            return None, (f"{len(lost)} of the job's {places} nodes are lost and {len(spares)} usable standby "
                          f"node{'' if len(spares) == 1 else 's'} can replace them")
        taken = dict(zip(lost, spares))
        world = [holders.get(i) or taken[i] for i in range(places)]
        rest = [n for n in reg.nodes.values() if n.name not in world and n.name in self.launcher.node_job]
        self._rebuild = Rebuild(world=world, replaced={i * rpn: taken[i] for i in lost},
                                standbys=[n.name for n in rest if n.role in standby],
                                gone={n.name: (n.role, n.reason) for n in rest if n.role not in standby})
        return self._rebuild, ""

    def relaunch(self, control: JobControl, launcher: "SrunLauncher") -> None:
        """Drive the daemon of the job relaunched from a checkpoint inside the allocation (:meth:`rebuild_world`
        planned it; tmd.cli makes ``control`` with the plan's world as its nodes and its other standbys as its
        standbys, so that its ``tmd_started`` names them): its launcher takes over which SLURM job holds each node,
        its failed and left nodes are known again (still drained and handed back), and every rank and standby
        process starts."""
        plan, self._rebuild = self._rebuild, None
        if plan is None:
            raise RuntimeError("relaunch without a rebuilt world (rebuild_world)")
        launcher.node_job.update(self.launcher.node_job)
        self.launcher = launcher
        self.attach(control)
        for name, (role, reason) in plan.gone.items():
            self.registry.restore(self.registry.add_node(name), role, [], reason)
        for name in plan.world:
            launcher.start_node(name, standby=False)
        for name in plan.standbys:
            launcher.start_node(name, standby=True)

    def start(self) -> None:
        """Write ``jobs/<JOBID>/tmd.json``, journal the prolog reports of the job's nodes, start polling."""
        self._write_link(self.job_id, standby_for=None)
        self._expect_prologs(self.job_id, self.job_nodes)
        self.poller.start()

    def close(self) -> None:
        """Stop polling (idempotent)."""
        self.poller.stop()

    def job_ended(self) -> None:
        """The training job is over (tmd's loop ends, the journal still open): stop polling and cancel the standby
        jobs tmd submitted that have not started (they would hold a node for nothing once they do). A running one
        ends by itself within its poll of the training job (tmd.slurm.hold_standby, 2 s): cancelling it here
        would run its epilog at the same moment as the training job's, which on a one-host test cluster pushes
        both over their time budget."""
        self.close()
        if self.pool is None:
            return
        snap = self.poller.latest  # a submission the loop has not seen yet
        if snap is not None and snap.seq != self._seq:
            for r in snap.done:
                if r["action"] == "sbatch" and r["ok"] and r["result"].split(";")[0].isdigit():
                    self._pool_live.add(r["result"].split(";")[0])
        live = sorted((j for j in self._pool_live if j not in self.standby_jobs
                       or self.standby_jobs[j].state in STARTING_STATES), key=int)
        if not live:
            return
        try:
            run_slurm(["scancel", *live], self.poller.timeout_s)
            self.journal.record(Event.STANDBY_JOBS_CANCELLED, slurm_jobs=live, reason=f"job {self.job_id} ended")
        except SlurmError as e:
            self.journal.record(Event.SLURM_ERROR, error=f"could not cancel standby jobs {','.join(live)}: {e}")

    def _write_link(self, job_id: str, standby_for: Optional[str]) -> None:
        c = self.control
        info = {"address": c.address, "pid": os.getpid(), "job": self.job_id, "run_dir": c.run_dir,
                "slurm_job": job_id, "standby_for": standby_for, "reservation": self.reservation,
                "ranks_per_node": self.registry.ranks_per_node, "command": self.command,
                "keys": c.keys.path if c.keys else None}
        path = p.layout.job_tmd_json(job_id)
        try:
            write_json_atomic(path, info)
        except OSError as e:
            self.journal.record(Event.SLURM_ERROR, error=f"cannot write {path}: {e}")

    def _expect_prologs(self, job_id: str, nodes: Iterable[str]) -> None:
        """SLURM job ``job_id`` runs on ``nodes``: journal each node's prolog report once it is there."""
        until = time.monotonic() + PROLOG_REPORT_WAIT_S
        for name in nodes:
            self._prologs_due.setdefault((job_id, name), until)
        self._journal_prologs()

    def _journal_prologs(self) -> None:
        """Journal each prolog report due (:meth:`_expect_prologs`) that is there now, once; stop looking for one
        after PROLOG_REPORT_WAIT_S (a cluster without TrainMover's hooks writes none)."""
        now = time.monotonic()
        for (jid, name), until in list(self._prologs_due.items()):
            r = hook_report(jid, HookKind.PROLOG, name)
            if r is not None:
                self.journal.record(Event.SLURM_HOOK, hook=HookKind.PROLOG, node=name, slurm_job=jid,
                                    ok=r.get("ok"), problems=r.get("problems"), duration_s=r.get("duration_s"))
            if r is not None or now > until:
                del self._prologs_due[(jid, name)]

    def _say(self, key: str, event: Event, **fields) -> None:
        """Journal ``event`` unless the same thing was said last time under ``key``."""
        text = json.dumps(fields, sort_keys=True, default=str)
        if self._said.get(key) != text:
            self._said[key] = text
            self.journal.record(event, **fields)

    # --- the loop -------------------------------------------------------------------------------------------------
    def tick(self, now_mono: float) -> None:  # noqa: ARG002 - the daemon's tick signature
        snap = self.poller.latest
        if snap is None or snap.seq == self._seq:
            return
        self._seq = snap.seq
        for e in snap.errors:
            self._say("error:" + e.split(":")[0], Event.SLURM_ERROR, error=e)
        for r in snap.done:
            self._on_action_done(r)
        if snap.reservation_ok is not None and snap.reservation_ok != self._reservation_ok:
            self._reservation_ok = snap.reservation_ok
            if not snap.reservation_ok:
                self.journal.record(Event.SLURM_ERROR, error=f"reservation '{self.reservation}' does not exist: "
                                    "this job gets no standbys until an admin creates it (see docs/slurm.md)")
        if snap.standby_jobs is not None:
            self._standby_jobs(snap.standby_jobs)
        for name, st in snap.nodes.items():
            if self.node_state.get(name) != st:
                self.node_state[name] = st
                node = self.registry.nodes.get(name)
                self.journal.record(Event.SLURM_NODE_STATE, node=name, state=st[0], reason=st[1],
                                    role=node.role if node else None)
        self._drains()
        self._drain_failed_nodes()
        self._release_left_nodes()
        self._refill()
        if self._prologs_due:
            self._journal_prologs()

    # --- standby jobs ---------------------------------------------------------------------------------------------
    def _standby_jobs(self, jobs: dict[str, StandbyJob]) -> None:
        for jid, sj in jobs.items():
            if sj.state == SlurmJobState.RUNNING and jid not in self.adopted:
                self._adopt(sj)
            elif sj.state != SlurmJobState.RUNNING and jid not in self.adopted:
                self._say("standby:" + jid, Event.STANDBY_JOB_WAITING, slurm_job=jid, state=sj.state,
                          reason=sj.reason or None)
        for jid in list(self.adopted):
            sj = jobs.get(jid)
            if sj is None or sj.state != SlurmJobState.RUNNING:
                self._standby_job_gone(jid, f"standby job {jid} {'ended' if sj is None else 'is ' + sj.state}")
        for jid in sorted(self._pool_live - jobs.keys()):
            self._pool_live.discard(jid)
            wait = self.pool.job_ended(jid, self.ended.get(jid, "it left the queue")) if self.pool else None
            if wait is not None:
                self.journal.record(Event.STANDBY_POOL_REFUSED, reason=self.pool.reason, retry_in_s=wait)
        self.standby_jobs = jobs

    def _adopt(self, sj: StandbyJob) -> None:
        added = []
        for name in sj.nodes:
            if name in self.registry.nodes:
                why = self._not_revivable(name)
                if why is not None:
                    self.journal.record(Event.STANDBY_NODE_REFUSED, node=name, slurm_job=sj.job_id, reason=why)
                    continue
                self._revive(name)
            else:
                self.registry.add_node(name)
            self.launcher.assign(name, sj.job_id)
            added.append(name)
        self.adopted[sj.job_id] = added
        if not added and sj.nodes and sj.job_id not in self._cancelling:  # it would hold its nodes for nothing
            self._cancelling.add(sj.job_id)
            self._cancel_why[sj.job_id] = "none of its nodes can be a standby of this job"
            timeout_s, jid = self.poller.timeout_s, sj.job_id
            self.poller.submit(f"cancel {jid}", lambda: run_slurm(["scancel", jid], timeout_s).strip())
        self.poller.watch(added)
        self._write_link(sj.job_id, standby_for=self.job_id)
        self.journal.record(Event.STANDBY_JOB_RUNNING, slurm_job=sj.job_id, nodes=added)
        self._expect_prologs(sj.job_id, sj.nodes)
        for name in added:
            self.launcher.start_node(name, standby=True)

    def _not_revivable(self, name: str) -> Optional[str]:
        """Why node ``name``, known to this job, cannot be a standby of a new standby job (None: it can, as a
        fresh standby). A node that left, or failed and is fit again (lost with its standby job's end; drained by
        tmd and resumed by an admin, since SLURM scheduled it), comes back once SLURM holds it for the new job:
        refusing it held a reservation node in an empty standby job and could starve the pool (the job then
        waited for a standby forever)."""
        node = self.registry.nodes[name]
        what = f"node '{name}' is already part of this job ({node.role})"
        if node.role not in (NodeRole.LEFT, NodeRole.FAILED):
            return what
        owner = self.launcher.node_job.get(name)
        if self.launcher.running(name) or (owner is not None and (owner == self.job_id or owner in self.adopted)):
            return f"{what}: its processes or its job are still there"
        if node.role == NodeRole.FAILED and name in self._draining and name not in self._drained:
            return f"{what}: tmd asked SLURM to drain it"
        return None

    def _revive(self, name: str) -> None:
        """Node ``name`` (left, or failed and fit again) becomes a fresh standby of this job."""
        self.registry.revive(self.registry.nodes[name])
        for known in (self._released, self._drained, self._draining, self._lost_with_job):
            known.discard(name)
        for per_node in (self._drain_tries, self._drain_migration, self._releasing, self._failed_seen):
            per_node.pop(name, None)
        self.journal.record(Event.STANDBY_NODE_REVIVED, node=name)

    def _standby_job_gone(self, jid: str, why: str) -> None:
        self.ended[jid] = why
        for name in self.adopted.pop(jid, []):
            self._node_lost(name, why)
        self.journal.record(Event.STANDBY_JOB_GONE, slurm_job=jid, reason=why)

    def _node_lost(self, name: str, why: str) -> None:
        node = self.registry.nodes.get(name)
        if node is not None and node.role == NodeRole.FAILED and name not in self._draining:
            # its processes died with its job (``scancel``: SLURM stops the steps first, so tmd saw them die before
            # it saw the job end): nothing says the node is unfit, and it is not drained (_drain_failed_nodes)
            self._lost_with_job.add(name)
        if node is None or node.role in (NodeRole.FAILED, NodeRole.LEFT):
            return
        self._lost_with_job.add(name)  # its job ended: nothing says the node is unfit
        m = self.control.current_migration
        if m is not None and name in m.targets:
            self.control.abort_migration(m, f"{why} during {m.state}")
        if node.role == NodeRole.GUARDING:  # its sandbox ends with the node: a standby lost like any other
            self.control.guards.release(node, why)
        if node.role == NodeRole.STANDBY:
            self.registry.fail_node(node, why)
            self.launcher.forget(name)
            self.journal.record(Event.STANDBY_LOST, node=name, reason=why)
        else:  # it holds ranks: its processes end with the job; the daemon sees them exit
            self.journal.record(Event.NODE_LOST, node=name, role=node.role, reason=why)

    def on_notice(self, msg: "p.NodeNotice") -> None:
        """The epilog on ``msg.node`` ran for SLURM job ``msg.job_id``: the node left that job. A copy of a notice
        already handled (the hook resends until tmd acknowledges) changes nothing."""
        key = (str(msg.hook), msg.job_id, msg.node)
        if key in self._notices:
            return
        self._notices.add(key)
        self.journal.record(Event.SLURM_HOOK, hook=msg.hook, node=msg.node, slurm_job=msg.job_id, detail=msg.detail)
        if msg.hook == HookKind.EPILOG and msg.job_id in self.adopted and msg.node in self.adopted[msg.job_id]:
            self._node_lost(msg.node, f"standby job {msg.job_id} ended (epilog on {msg.node})")

    # --- drains ---------------------------------------------------------------------------------------------------
    def _drains(self) -> None:
        for name, (state, reason) in self.node_state.items():
            node = self.registry.nodes.get(name)
            if node is None or node.role != NodeRole.ACTIVE or DRAIN not in state:
                continue
            mid = self._drain_migration.get(name)
            if mid is not None and not self.control.migration(mid).finished:
                continue
            why = f"node {name} is {state} (reason: {reason or 'none given'})"
            if self._drain_tries.get(name, 0) >= DRAIN_ATTEMPTS:
                self._say("drain:" + name, Event.DRAIN_MIGRATION_GAVE_UP, node=name, reason=why,
                          attempts=DRAIN_ATTEMPTS)
                continue
            target = self.pick_standby()
            if target is None:
                self._say("drain:" + name, Event.DRAIN_MIGRATION_WAITING, node=name, reason=why,
                          waiting_for=f"a warm standby ({self.describe_standbys()})")
                continue
            try:
                m = self.control.request_migration(name, target)
            except MigrationError as e:
                self._say("drain:" + name, Event.DRAIN_MIGRATION_WAITING, node=name, reason=why, waiting_for=str(e))
                continue
            self._drain_tries[name] = self._drain_tries.get(name, 0) + 1
            self._drain_migration[name] = m.id
            self._said.pop("drain:" + name, None)
            self.journal.record(Event.DRAIN_MIGRATION, node=name, target=target, migration_id=m.id, reason=why,
                                slurm_reason=reason)

    def _release_left_nodes(self) -> None:
        """Give a node whose ranks left, or a failed node tmd drained, back to SLURM, so that the drain completes:
        shrink the job that holds it (the training job, or a standby job the ranks had moved into), or cancel a
        standby job left with no node in use. Never the batch host (tmd runs there). One release at a time."""
        if self._releasing:
            return
        for name, node in self.registry.nodes.items():
            if not (node.role == NodeRole.LEFT or name in self._drained) or name in self._released or \
                    self.launcher.running(name):
                continue  # (a leaver's processes may still be exiting)
            owner = self.launcher.node_job.get(name)
            if name == self.batch_host or owner is None:
                self._released.add(name)
                if name == self.batch_host:
                    self.journal.record(Event.SLURM_NODE_KEPT, node=name, reason="it is the batch host (tmd runs "
                                        "there); SLURM gets it back when the job ends")
                continue
            holding = self.job_nodes if owner == self.job_id else self.adopted.get(owner, [])
            keep = [n for n in holding if n != name]
            if owner != self.job_id and all(self.registry.nodes[n].role in (NodeRole.LEFT, NodeRole.FAILED)
                                            for n in keep):
                argv, how = ["scancel", owner], "standby job cancelled"
            elif owner != self.job_id and name == getattr(self.standby_jobs.get(owner), "batch_host", name):
                self._released.add(name)
                self.journal.record(Event.SLURM_NODE_KEPT, node=name, reason=f"it is the batch host of standby job "
                                    f"{owner}, which other nodes of this job still use")
                continue
            else:
                argv, how = ["scontrol", "update", f"JobId={owner}", f"NodeList={','.join(keep)}"], "job shrunk"
            self._releasing[name] = (owner, keep, how)
            timeout_s, run_dir = self.poller.timeout_s, self.control.run_dir
            # scontrol writes slurm_job_<id>_resize.{sh,csh} into its working directory: the run dir, then.
            self.poller.submit(f"release {name}", lambda argv=argv: run_slurm(argv, timeout_s, run_dir).strip())
            return

    def _on_action_done(self, r: dict) -> None:
        kind, _, arg = r["action"].partition(" ")
        if kind == "sbatch":
            self._submitted(r)
        elif kind == "drain":
            if r["ok"]:
                self._drained.add(arg)
                self.journal.record(Event.SLURM_NODE_DRAINED, node=arg, reason=self._drain_reason(arg))
            else:  # not handed back either: SLURM gets it with the job's end, and its prolog checks it then
                self.journal.record(Event.SLURM_ERROR, error=f"could not drain failed node {arg}: {r['error']}")
        elif kind == "cancel":
            self.journal.record(Event.STANDBY_JOBS_CANCELLED, slurm_jobs=[arg],
                                reason=self._cancel_why.pop(arg, "its nodes are drained"))
            if not r["ok"]:
                self.journal.record(Event.SLURM_ERROR, error=f"could not cancel standby job {arg}: {r['error']}")
        else:
            self._release_done(arg, r)

    # --- failed nodes ---------------------------------------------------------------------------------------------
    def _drain_reason(self, name: str) -> str:
        why = " ".join(self.registry.nodes[name].reason.split())[:160] or "its processes failed"
        return f"trainmover: job {self.job_id}: {why}"

    def _drain_failed_nodes(self) -> None:
        """Ask SLURM to drain each node of the job that failed (its processes died, hung or were cut off; not one
        lost with its standby job's end), with the reason, then hand it back (:meth:`_release_left_nodes`), so
        that it becomes DRAINED and the scheduler gives it to nobody until an admin resumes it. A standby job's
        node is drained only once DRAIN_AFTER_POLLS polls after the failure still list its job: a ``scancel`` of
        the job kills its processes before squeue stops listing it, and that node is fit."""
        for name, node in self.registry.nodes.items():
            if node.role != NodeRole.FAILED or name in self._draining or name in self._lost_with_job or \
                    name not in self.launcher.node_job:
                continue
            if self.launcher.node_job[name] != self.job_id:  # a standby job's node: did its job end first?
                seen = self._failed_seen.setdefault(name, self._seq)
                if self._seq < seen + DRAIN_AFTER_POLLS:
                    continue  # a poll taken after the failure shows whether the job still runs (_node_lost)
            self._draining.add(name)
            argv = ["scontrol", "update", f"NodeName={name}", "State=DRAIN", f"Reason={self._drain_reason(name)}"]
            timeout_s = self.poller.timeout_s
            self.poller.submit(f"drain {name}", lambda argv=argv: run_slurm(argv, timeout_s).strip())

    # --- the standby pool (tmd.standby_pool) ----------------------------------------------------------------------
    def standbys_on_the_way(self) -> int:
        """Standby nodes warm or on their way: the job's standbys (warm or warming) that SLURM does not drain,
        plus one per standby job of this job that has not started."""
        nodes = sum(1 for names in self.adopted.values() for n in names
                    if self.registry.nodes[n].role == NodeRole.STANDBY and self._unusable(n) is None)
        return nodes + sum(1 for sj in self.standby_jobs.values() if sj.state in STARTING_STATES)

    def _refill(self) -> None:
        """Submit one standby job when the pool is short and its policy allows (one at a time)."""
        pool = self.pool
        if pool is None:
            return
        for jid, names in self.adopted.items():
            if jid not in pool.useful and any(self.registry.nodes[n].warm for n in names):
                pool.warm(jid)
        self._cancel_drained_standbys()
        have = self.standbys_on_the_way()
        if not pool.due(have, self._reservation_ok, self.reservation):
            if pool.reason and have < pool.config.keep:
                self._say("pool", Event.STANDBY_POOL_WAITING, reason=pool.reason, have=have, keep=pool.config.keep)
            return
        pool.submitting()
        argv = sbatch_argv(self.pool_config, self.reservation, self.job_id, self.control.run_dir)
        # the standby job holds its node with tmd's interpreter; SLURM_* of tmd's own job would confuse sbatch
        env = {**self.launcher.base_env(), "TM_PYTHON": sys.executable}
        timeout_s, cwd = self.poller.timeout_s, os.getcwd()
        self.poller.submit("sbatch", lambda: run_slurm(argv, timeout_s, cwd, env).strip())

    def _submitted(self, r: dict) -> None:
        pool = self.pool
        try:
            jid = parse_job_id(r["result"]) if r["ok"] else None
        except ValueError as e:
            r, jid = {"error": str(e)}, None
        if jid is None:
            wait = pool.refused(r["error"])
            self.journal.record(Event.STANDBY_POOL_REFUSED, reason=pool.reason, retry_in_s=wait)
            return
        pool.submitted(jid)
        self._pool_live.add(jid)
        self._said.pop("pool", None)
        self.journal.record(Event.STANDBY_JOB_SUBMITTED, slurm_job=jid, reservation=self.reservation,
                            keep=pool.config.keep, have=self.standbys_on_the_way())

    def _cancel_drained_standbys(self) -> None:
        """A standby job tmd submitted whose every node SLURM drains and none is in use is cancelled, so that the
        drain completes (the pool submits another)."""
        for jid, names in self.adopted.items():
            if jid in self._cancelling or jid not in self.pool.jobs or not names:
                continue
            if all(self.registry.nodes[n].role == NodeRole.STANDBY and DRAIN in self.node_state.get(n, ("", ""))[0]
                   for n in names):
                self._cancelling.add(jid)
                timeout_s = self.poller.timeout_s
                self.poller.submit(f"cancel {jid}", lambda jid=jid: run_slurm(["scancel", jid], timeout_s).strip())

    def status(self) -> dict:
        """StatusReply's ``slurm``: ``job``, ``reservation``, ``reservation_ok`` (None: not known yet),
        ``standbys`` (:meth:`describe_standbys`), ``drained`` (failed nodes tmd drained) and ``pool``: None
        without ``--keep-standbys``, else the policy's state (tmd.standby_pool.PoolPolicy.to_dict) with
        ``pending``, each standby job of this job that has not started and squeue's reason."""
        pool = None
        if self.pool is not None:
            pool = self.pool.to_dict(self.standbys_on_the_way())
            pool["pending"] = [{"slurm_job": jid, "state": sj.state, "reason": sj.reason or None}
                               for jid, sj in sorted(self.standby_jobs.items()) if sj.state in STARTING_STATES]
            if self._reservation_ok is False:
                pool["reason"] = f"reservation '{self.reservation}' does not exist"
        return {"job": self.job_id, "reservation": self.reservation, "reservation_ok": self._reservation_ok,
                "standbys": self.describe_standbys(), "drained": sorted(self._drained), "pool": pool}

    def _release_done(self, name: str, r: dict) -> None:
        owner, keep, how = self._releasing.pop(name)
        self._released.add(name)  # on failure too: do not retry; the node comes back to SLURM with its job's end
        if not r["ok"]:
            self.journal.record(Event.SLURM_ERROR, error=f"could not release {name} from job {owner}: {r['error']}")
            return
        self.launcher.node_job.pop(name, None)
        if owner == self.job_id:
            self.job_nodes[:] = keep
        elif owner in self.adopted:
            self.adopted[owner][:] = [n for n in self.adopted[owner] if n != name]
        self.journal.record(Event.SLURM_NODE_RELEASED, node=name, slurm_job=owner,
                            how=how)

    # --- targets --------------------------------------------------------------------------------------------------
    def _unusable(self, name: str) -> Optional[str]:
        """Why SLURM says standby ``name`` must not take ranks (draining, down, ...), or None."""
        state = self.node_state.get(name, ("", ""))[0]
        return f"SLURM has {name} {state}" if any(bad in state for bad in UNUSABLE) else None

    def pick_standby(self, job_id: Optional[str] = None, exclude: Iterable[str] = ()) -> Optional[str]:
        """A warm standby node (of standby job ``job_id`` if given) that SLURM does not drain and that is not in
        ``exclude`` (those already chosen), or None."""
        names = set(self.adopted.get(job_id, [])) if job_id else None
        for node in sorted(self.registry.warm_standbys(exclude), key=lambda n: n.name):
            if names is None or node.name in names:
                return node.name
        return None

    def resolve_targets(self, targets: list[str]) -> list[str]:
        """The standby nodes a migrate request's targets mean (:meth:`resolve_target` for each), never one node
        twice: ``any``, ``job:J`` and job ids pick among the warm standbys not named or picked before. Raises
        MigrationError ``busy_standby`` when it holds more ``any`` than there are warm standbys besides those it
        names, naming how many are warm, and as :meth:`resolve_target` does."""
        named = [t for t in targets if t in self.registry.nodes]
        wanted = targets.count(ANY_STANDBY)
        free = [n.name for n in self.registry.warm_standbys(named)]
        if wanted > len(free):
            raise MigrationError(ErrorCode.BUSY_STANDBY, f"the request needs {wanted} warm standbys ('{ANY_STANDBY}')"
                                 f" besides those it names, and {len(free)} {'is' if len(free) == 1 else 'are'} warm"
                                 f"{': ' + ', '.join(free) if free else ''} ({self.describe_standbys()})")
        chosen: list[str] = []
        for t in targets:
            chosen.append(self.resolve_target(t, exclude=named + chosen))
        return chosen

    def describe_standbys(self) -> str:
        """One line: each standby job of this job and its state."""
        parts = []
        for jid, sj in sorted(self.standby_jobs.items()):
            if sj.state == SlurmJobState.RUNNING:
                nodes = self.adopted.get(jid, [])
                warm = [n for n in nodes if self.registry.nodes[n].warm]
                parts.append(f"job {jid} running on {','.join(nodes) or '-'} ({len(warm)} warm)")
            else:
                parts.append(f"job {jid} {sj.state}" + (f" ({sj.reason})" if sj.reason else ""))
        if self._reservation_ok is False:
            parts.append(f"reservation '{self.reservation}' does not exist")
        return "; ".join(parts) or f"no standby job in reservation '{self.reservation}'"

    def resolve_target(self, target: str, exclude: Iterable[str] = ()) -> str:
        """The standby node a migrate request means: a node name as is; ``any`` -> a warm standby node; a standby
        job id -> a warm node of that job; never one in ``exclude``. Raises MigrationError ``busy_standby`` when
        that job has not started or has no warm node left, ``unknown_standby`` for a job id that is not a standby
        job of this job."""
        if target in self.registry.nodes:
            return target
        if target == ANY_STANDBY:
            name = self.pick_standby(exclude=exclude)
            if name is None:
                raise MigrationError(ErrorCode.BUSY_STANDBY, f"no warm standby yet: {self.describe_standbys()}")
            return name
        jid = target[4:] if target.startswith("job:") else target
        if jid.isdigit():
            sj = self.standby_jobs.get(jid)
            if sj is None and jid in self.ended:
                raise MigrationError(ErrorCode.UNKNOWN_STANDBY, f"unknown standby '{target}': {self.ended[jid]}")
            if sj is None:
                raise MigrationError(ErrorCode.UNKNOWN_STANDBY, f"unknown standby '{target}': job {jid} is not a "
                                     f"standby job of job {self.job_id} ({self.describe_standbys()})")
            if sj.state != SlurmJobState.RUNNING:
                raise MigrationError(ErrorCode.BUSY_STANDBY, f"standby job {jid} has not started: {sj.state}"
                                     + (f" ({sj.reason})" if sj.reason else ""))
            name = self.pick_standby(jid, exclude)
            if name is None:
                raise MigrationError(ErrorCode.BUSY_STANDBY, f"standby job {jid} is running but has no warm node "
                                     f"{'left' if exclude else 'yet'}")
            return name
        return target

    def decorate(self, nodes: list[dict]) -> None:
        """Add ``slurm_state``, ``slurm_reason`` and ``slurm_job`` to status's node dicts."""
        for n in nodes:
            st = self.node_state.get(n.get("name"), ("", ""))
            n["slurm_state"], n["slurm_reason"] = st[0] or None, st[1] or None
            n["slurm_job"] = self.launcher.node_job.get(n.get("name")) or (
                self.job_id if n.get("name") in self.job_nodes else None)


# ----------------------------------------------------------------------------------------------------------------
def hold_standby(job_id: str, poll_s: float = 2.0, timeout_s: float = DEFAULT_TIMEOUT_S,
                 echo: Callable[[str], None] = print) -> int:
    """The body of a standby job (``slurm/standby.sbatch JOBID``): hold this allocation while training job
    ``job_id`` is pending or running; tmd starts the standby workers into it. Returns the exit code: 0 when the
    training job ended, 2 for bad input (not in a SLURM job, no such job). Raises nothing."""
    me = os.environ.get("SLURM_JOB_ID")
    if not me:
        echo("error: tmd standby runs inside a SLURM job (sbatch --reservation=standby slurm/standby.sbatch JOBID)")
        return ExitCode.REFUSED
    if not job_id.isdigit():
        echo(f"error: '{job_id}' is not a SLURM job id")
        return ExitCode.REFUSED
    first = True
    while True:
        try:
            state = run_slurm(["squeue", "--noheader", f"--jobs={job_id}", "--format=%T"], timeout_s).strip()
        except SlurmError as e:
            if "Invalid job id" in str(e):
                if first:
                    echo(f"error: there is no SLURM job {job_id} to stand by for")
                    return ExitCode.REFUSED
                state = ""
            else:
                echo(f"warning: {e}")  # a slow controller: keep holding
                state = SlurmJobState.UNKNOWN
        if first:
            echo(f"standby job {me} on {os.environ.get('SLURM_JOB_NODELIST', '?')} holds its nodes for job {job_id}"
                 f" ({state or 'gone'}); its tmd starts the standby workers")
            first = False
        if state not in (SlurmJobState.UNKNOWN, SlurmJobState.RUNNING, SlurmJobState.COMPLETING, *STARTING_STATES):
            echo(f"job {job_id} is {state or 'gone'}: standby job {me} ends")
            return ExitCode.OK
        time.sleep(poll_s)  # polling another job's state: SLURM offers no event to wait on

"""Failure detection: which nodes of the job are lost, hung or unhealthy. Returns verdicts; acts on nothing.

:meth:`Detector.tick` looks at the registry (heartbeat times, the mover counters every heartbeat carries), the
processes the launcher saw exit and, for processes on tmd's host, their state and CPU use; it returns a list of
verdicts (:class:`Failure`, :class:`ProcessExited`, :class:`Unhealthy`, :class:`Healthy`, :class:`Slow`) that
the daemon applies (fail the node, journal, abort the migration...). The clocks and the process inspection are
injected, so the rules can be tried on synthetic heartbeats without processes.

Failure detection, cheapest signal first (the three thresholds are the job's :class:`tmd.config.DetectionConfig`,
where their defaults are defined):

- a rank process exits (local mode: the launcher's Popen poll each tick, ~50 ms), begins to exit (the kernel's
  ``PF_EXITING`` flag: a killed process is seen before the kernel has freed its memory, :func:`exiting`) or turns
  zombie/stopped (psutil, for processes on tmd's host: a SIGSTOPped node is seen within a tick);
- a node is silent for ``suspect_after_s`` (heartbeats come every 0.1 s) while a peer is blocked in a
  collective (its counters show a pending op older than ``blocked_after_s``): hung or cut off. Unless
  its processes run on tmd's host and use CPU (more than 0.05 s of CPU time since it was first seen silent):
  it is then only slow to heartbeat (:class:`Slow`), not failed. Nor while one of their threads waits for a CPU
  (runnable, or in an uninterruptible disk wait): on a starved host a computing rank can get less than 0.05 s of
  CPU in the grace, while a hung or cut-off rank sleeps;
- a node is silent for ``heartbeat_timeout_s`` whatever its peers do.

A process that exits with a positive code (not killed by a signal) may be a training script that raised: its
rank sent a ``RankFailed`` just before, which fails the job instead (tmd.faults). Its node's failure is therefore
held back ``exit_report_grace_s`` (0.5 s) so that report arrives first and no standby is spent on it.

Until all of a node's processes finished a first step (imports and lazy initialisation on a crowded machine
can starve the heartbeat thread) only the long timeout applies. A long step is not a failure: heartbeats come
from a separate thread and peers wait only at the collective. Nodes whose loss is a failure of the job are the
active ones and the standbys taking over a failed node's ranks; any node whose process is silent for
``heartbeat_timeout_s`` is :class:`Unhealthy` until every process of it heartbeats again.
"""
from __future__ import annotations

import dataclasses
import enum
import os
import socket
import time
from typing import Callable, Iterable, Optional, Protocol, Union

import psutil

from tmd.config import DetectionConfig
from tmd.health import finite
from tmd.protocol.vocab import FailureSignal, Health, NodeRole
from tmd.registry import Node, Registry, Worker

EXIT_REPORT_GRACE_S = 0.5  # a positive exit code's node failure waits this long for the rank's RankFailed
BUSY_CPU_S = 0.05  # CPU seconds a silent node must use (since first seen silent) to count as computing
BUSY_GRACE_S = 0.1  # a silent node not yet seen using CPU is given this long (seconds) before it counts as idle


class ProcessState(enum.Enum):
    """What :class:`ProcessInspector` may find wrong with a process (its value reads in failure reasons)."""

    DIED = "died"  # gone, zombie, dead or exiting
    STOPPED = "is stopped"  # SIGSTOP: it hangs

    @property
    def signal(self) -> FailureSignal:
        return FailureSignal.STOPPED if self is ProcessState.STOPPED else FailureSignal.PROCESS_EXIT


class ProcessInspector(Protocol):
    """Looks at a worker's process where it can (tmd's host); None means fine, or not ours to see."""

    def state(self, w: Worker) -> Optional[ProcessState]:
        """DIED or STOPPED, or None (running, or not on this host)."""

    def cpu_s(self, w: Worker) -> Optional[float]:
        """User + system CPU time (seconds) the process used so far, or None (not on this host, or gone)."""

    def waiting_for_cpu(self, w: Worker) -> bool:
        """Whether a thread of the process is runnable (``R``) or in an uninterruptible wait (``D``) now: it
        computes, or waits for a CPU or the disk, rather than sleeping on a socket or a lock. False where it
        cannot be seen (not on this host, gone)."""


class ExitedProcess(Protocol):
    """A process the launcher saw exit (tmd.local.Proc)."""

    node: str
    local_rank: int
    returncode: Optional[int]


PF_EXITING = 0x4  # Linux include/linux/sched.h: the task is in do_exit()


def thread_states(pid: int, task_dir: str = "/proc/{pid}/task") -> list[str]:
    """The state letter of each thread of process ``pid`` (field 3 of ``/proc/<pid>/task/<tid>/stat``; proc(5):
    ``R`` running or runnable, ``S`` sleeping, ``D`` disk wait, ``T`` stopped, ``Z`` zombie ...). Empty where the
    directory cannot be read (not Linux, the process gone); a thread that ends while being read is left out."""
    root = task_dir.format(pid=pid)
    try:
        tids = os.listdir(root)
    except OSError:
        return []
    states = []
    for tid in tids:
        try:
            with open(os.path.join(root, tid, "stat"), "rb") as f:
                stat = f.read()
            states.append(stat[stat.rindex(b")") + 2:].split()[0].decode())
        except (OSError, ValueError, IndexError):
            continue
    return states


def exiting(pid: int, stat_path: str = "/proc/{pid}/stat") -> bool:
    """Whether the kernel is tearing process ``pid`` down: its main thread's ``PF_EXITING`` flag (field 9,
    ``flags``, of ``/proc/<pid>/stat``; proc(5)). A SIGKILLed process shows it within microseconds of the
    signal, while its main thread turns zombie only once it has finished exiting, which includes freeing the
    address space when it is the last thread to let go of it (its sockets close when the last thread does): 0.1 to
    120 ms for a ~0.5 GB demo rank on this 2-core machine, measured, depending on which thread frees it.
    Also set for the last instant of a normal exit, after Python's own shutdown. False where the file cannot be
    read or parsed (not Linux, the process gone)."""
    try:
        with open(stat_path.format(pid=pid), "rb") as f:
            stat = f.read()
        fields = stat[stat.rindex(b")") + 2:].split()  # the command name (field 2) may hold spaces and ")"
        return bool(int(fields[6]) & PF_EXITING)
    except (OSError, ValueError, IndexError):
        return False


class HostProcesses:
    """:class:`ProcessInspector` over psutil, for the workers that registered with this host's name. Also
    kills them (:meth:`kill`: tmd fences a failed node's local processes)."""

    def __init__(self, hostname: Optional[str] = None) -> None:
        self.hostname = hostname or socket.gethostname()
        self._procs: dict[int, psutil.Process] = {}  # pid -> handle (psutil checks a reused pid's start time)

    def _process(self, w: Worker) -> Optional[psutil.Process]:
        if w.host != self.hostname:
            return None
        proc = self._procs.get(w.pid)
        if proc is None:
            try:
                proc = self._procs[w.pid] = psutil.Process(w.pid)
            except psutil.Error:
                return None
        return proc

    def state(self, w: Worker) -> Optional[ProcessState]:
        proc = self._process(w)
        if proc is None:
            return None
        try:
            status = proc.status()
        except psutil.NoSuchProcess:
            return ProcessState.DIED
        except psutil.Error:
            return None
        if status in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD) or exiting(w.pid):
            return ProcessState.DIED
        return ProcessState.STOPPED if status == psutil.STATUS_STOPPED else None

    def cpu_s(self, w: Worker) -> Optional[float]:
        proc = self._process(w)
        if proc is None:
            return None
        try:
            t = proc.cpu_times()
        except psutil.Error:
            return None
        return t.user + t.system

    def waiting_for_cpu(self, w: Worker) -> bool:
        return self._process(w) is not None and any(st in "RD" for st in thread_states(w.pid))

    def kill(self, w: Worker) -> bool:
        """SIGKILL ``w``'s process if it runs on this host (a stopped one too). Returns whether it was sent."""
        proc = self._process(w)
        if proc is None:
            return False
        try:
            proc.kill()
        except psutil.Error:
            return False
        return True


# --------------------------------------------------------------------------------------------------------------
# Verdicts
# --------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Failure:
    """``node`` is lost (``signal``: how it was noticed): the daemon fails it and starts recovery."""

    node: Node
    reason: str
    signal: FailureSignal


@dataclasses.dataclass(frozen=True)
class ProcessExited:
    """The launcher saw process ``node``/``local_rank`` exit with ``returncode``. ``worker``: its registered
    process (None: it never registered). ``expected``: it was done, or its node is failed (fenced). ``lost``:
    an unexpected exit of a process whose loss is no failure of the job (a standby's, a joiner's): the
    migration it takes part in aborts and a standby's processes are started again. An unexpected exit on a
    node of the job is a :class:`Failure`, which follows this verdict."""

    node: Node
    local_rank: int
    returncode: Optional[int]
    worker: Optional[Worker]
    expected: bool
    lost: bool


@dataclasses.dataclass(frozen=True)
class Unhealthy:
    """Processes ``silent`` of ``node`` sent nothing for ``heartbeat_timeout_s`` (``reason`` says so)."""

    node: Node
    reason: str
    silent: tuple[Worker, ...]


@dataclasses.dataclass(frozen=True)
class Healthy:
    """``node``, unhealthy, has every process heartbeating again (and nothing else keeps it unhealthy)."""

    node: Node


@dataclasses.dataclass(frozen=True)
class Slow:
    """``node`` is silent for ``silent_s`` seconds but used ``cpu_s`` seconds of CPU meanwhile: not failed."""

    node: Node
    silent_s: float
    cpu_s: float


Verdict = Union[Failure, ProcessExited, Unhealthy, Healthy, Slow]


class _NoProcesses:
    def state(self, w: Worker) -> Optional[ProcessState]:
        return None

    def cpu_s(self, w: Worker) -> Optional[float]:
        return None

    def waiting_for_cpu(self, w: Worker) -> bool:
        return False


@dataclasses.dataclass
class _TickState:
    """One :meth:`Detector.tick`: its verdicts so far and what they imply for the checks after them."""

    now: float
    verdicts: list[Verdict] = dataclasses.field(default_factory=list)
    failed: set[str] = dataclasses.field(default_factory=set)  # nodes failed by a verdict of this tick
    exited: set[int] = dataclasses.field(default_factory=set)  # id() of workers whose exit this tick reported

    def fail(self, n: Node, reason: str, signal: FailureSignal) -> None:
        self.verdicts.append(Failure(n, reason, signal))
        self.failed.add(n.name)

    def gone(self, w: Worker) -> bool:
        """``w`` exited (seen before, or in this tick)."""
        return w.exited or id(w) in self.exited


# --------------------------------------------------------------------------------------------------------------
class Detector:
    """Judges the job's nodes each tick; see the module docstring for the rules.

    ``exits``: returns the processes that exited since the last call (local mode: the launcher's poll);
    ``processes``: inspects processes on this host (default: none visible); ``replacing(node_name)``: whether
    that joining node takes over a failed node's ranks (its loss is then a failure of the job);
    ``held_unhealthy(node)``: something other than heartbeats (a bad GPU) keeps the node unhealthy;
    ``config``: the thresholds (:class:`tmd.config.DetectionConfig`, the job's); ``wall_clock``: epoch seconds
    (peers' counters carry epoch times). Times in seconds."""

    def __init__(
        self,
        registry: Registry,
        *,
        exits: Callable[[], Iterable[ExitedProcess]] = lambda: (),
        processes: Optional[ProcessInspector] = None,
        replacing: Callable[[str], bool] = lambda node_name: False,
        held_unhealthy: Callable[[Node], bool] = lambda node: False,
        config: DetectionConfig = DetectionConfig(),
        wall_clock: Callable[[], float] = time.time,
        exit_report_grace_s: float = EXIT_REPORT_GRACE_S,
    ) -> None:
        self.registry = registry
        self.exits = exits
        self.processes: ProcessInspector = processes or _NoProcesses()
        self.replacing = replacing
        self.held_unhealthy = held_unhealthy
        self.config = config
        self.wall_clock = wall_clock
        self.exit_report_grace_s = exit_report_grace_s
        self._suspect_cpu: dict[str, tuple[float, float]] = {}  # node -> (monotonic s, CPU s) when first silent
        self._held: list[tuple[float, str, str]] = []  # (monotonic s due, node, reason): exits awaiting a report

    def in_job(self, n: Node) -> bool:
        """Nodes whose loss is a failure of the job: active ones, and standbys taking over ranks."""
        return n.role == NodeRole.ACTIVE or (n.role == NodeRole.JOINING and self.replacing(n.name))

    def tick(self, now: float) -> list[Verdict]:
        """Every verdict for this moment (``now``: time.monotonic()), in the order to apply them: process
        exits, then processes dead or stopped, then heartbeats. A node is failed at most once per tick: later
        checks treat it as failed already (the exits of its other processes are expected)."""
        t = _TickState(now)
        self._held_exits(t)
        self._exits(t)
        self._liveness(t)
        self._heartbeats(t)
        return t.verdicts

    def broken_transfer(self, source: Node, leavers: Iterable[Worker], grace_s: float = 0.2) -> Optional[Failure]:
        """A joiner's state transfer broke: a Failure of the leavers' node ``source`` if one of its processes
        died (or is stopped): the warm joiners then take its ranks over in recovery. None if they all run
        (or are not ours to see): the migration merely aborts.

        The joiner may see the transfer break (a socket of the leaver closed) before the leaver shows as dead
        here (:func:`exiting`, a zombie); for up to ``grace_s`` seconds (0.2) the leavers are looked at again,
        every 10 ms, before they count as running. This blocks tmd's loop only on this rare error path."""
        leavers = list(leavers)
        deadline = time.monotonic() + grace_s
        while True:
            for w in leavers:
                state = self.processes.state(w)
                if state is not None:
                    return Failure(source, f"{w.node}/{w.local_rank} (pid {w.pid}) {state.value}",
                                   FailureSignal.PROCESS_EXIT)
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.01)  # the kernel's teardown of a killed process has no event we can wait on

    # --- the checks of one tick ---------------------------------------------------------------------------------
    def _in_job(self, t: _TickState, n: Node) -> bool:
        return n.name not in t.failed and self.in_job(n)

    def _exits(self, t: _TickState) -> None:
        for proc in self.exits():
            node = self.registry.nodes[proc.node]
            w = node.workers.get(proc.local_rank)
            if w is not None:
                t.exited.add(id(w))
            expected = w is not None and (w.done or w.fenced or node.name in t.failed)
            unexpected = w is not None and not expected
            in_job = unexpected and self._in_job(t, node)
            t.verdicts.append(ProcessExited(node, proc.local_rank, proc.returncode, w, expected,
                                            lost=unexpected and not in_job))
            reason = f"{proc.node}/{proc.local_rank} exited with code {proc.returncode}"
            if in_job and proc.returncode is not None and proc.returncode > 0 and self.exit_report_grace_s > 0:
                self._held.append((t.now + self.exit_report_grace_s, node.name, reason))
            elif in_job:
                t.fail(node, reason, FailureSignal.PROCESS_EXIT)

    def _held_exits(self, t: _TickState) -> None:
        """Exits held back for a RankFailed whose grace is over: their node fails now (if still in the job)."""
        due = [h for h in self._held if h[0] <= t.now]
        self._held = [h for h in self._held if h[0] > t.now]
        for _, name, reason in due:
            node = self.registry.nodes[name]
            if self._in_job(t, node):
                t.fail(node, reason, FailureSignal.PROCESS_EXIT)

    def _liveness(self, t: _TickState) -> None:
        """Processes on this host: a zombie or vanished one has died, a stopped one (SIGSTOP) hangs."""
        for n in list(self.registry.nodes.values()):
            if not self._in_job(t, n):
                continue
            for w in n.workers.values():
                if t.gone(w) or w.done or w.fenced:
                    continue
                state = self.processes.state(w)
                if state is not None:
                    t.fail(n, f"{w.node}/{w.local_rank} (pid {w.pid}) {state.value}", state.signal)
                    break

    def _heartbeats(self, t: _TickState) -> None:
        now = t.now
        for n in list(self.registry.nodes.values()):
            if n.role in (NodeRole.LEFT, NodeRole.FAILED) or n.name in t.failed:
                continue
            live = [w for w in n.workers.values() if not t.gone(w) and not w.done]
            silence = max((now - w.last_heartbeat for w in live), default=0.0)
            started = all(w.step_time_s is not None for w in live)
            limit_s = self.config.suspect_after_s if started else self.config.heartbeat_timeout_s
            if self._in_job(t, n) and live and silence > limit_s:
                blocked = self._peer_blocked_s(n)
                busy = False
                if blocked > self.config.blocked_after_s:
                    busy, slow = self._busy(n, live, now)
                    if slow is not None:
                        t.verdicts.append(slow)
                hung = blocked > self.config.blocked_after_s and not busy
                if hung or silence > self.config.heartbeat_timeout_s:
                    t.fail(n, f"no heartbeat for {silence:.2f} s (peers blocked for {blocked:.2f} s)",
                           FailureSignal.SILENT)
                    continue
            else:
                self._suspect_cpu.pop(n.name, None)
            silent = tuple(w for w in live if now - w.last_heartbeat > self.config.heartbeat_timeout_s)
            if silent and n.health != Health.UNHEALTHY:
                t.verdicts.append(Unhealthy(n, f"no heartbeat for {self.config.heartbeat_timeout_s:.1f} s", silent))
            elif not silent and n.health == Health.UNHEALTHY and live and len(n.workers) == n.expected_workers \
                    and not any(t.gone(w) for w in n.workers.values()) and not self.held_unhealthy(n):
                t.verdicts.append(Healthy(n))

    # --- the rules, on one node ---------------------------------------------------------------------------------
    def _peer_blocked_s(self, n: Node) -> float:
        """How long (seconds) a rank outside ``n`` has been blocked in a collective, from its last heartbeat. A
        rank that is done (or exited, or fenced) blocks on nothing: its last heartbeat's pending op is history."""
        now = self.wall_clock()
        worst = 0.0
        for w in self.registry.rank_owner.values():
            if w.done or w.exited or w.fenced:
                continue
            c = w.counters if isinstance(w.counters, dict) else {}
            pending, started = finite(c.get("pending")), finite(c.get("last_op_start_s"))
            if w.node != n.name and pending is not None and pending > 0 and started is not None and started > 0:
                worst = max(worst, now - started)
        return worst

    def _busy(self, n: Node, live: list[Worker], now: float) -> tuple[bool, Optional[Slow]]:
        """For a silent node whose processes run on this host: are they using CPU (alive, only slow to
        heartbeat) rather than blocked (hung, cut off)? The first call samples CPU time and says busy; a later
        call says busy if they used more than BUSY_CPU_S of CPU since (then also a :class:`Slow` verdict), or if
        a thread of theirs waits for a CPU now (a starved host: busy, no verdict). Remote processes: never
        busy."""
        total = 0.0
        for w in live:
            cpu = self.processes.cpu_s(w)
            if cpu is None:
                return False, None
            total += cpu
        first = self._suspect_cpu.get(n.name)
        if first is None:
            self._suspect_cpu[n.name] = (now, total)
            return True, None
        since, cpu = first
        if total - cpu > BUSY_CPU_S:
            self._suspect_cpu[n.name] = (now, total)
            return True, Slow(n, round(now - since, 3), round(total - cpu, 3))
        if any(self.processes.waiting_for_cpu(w) for w in live):
            return True, None
        return now - since < BUSY_GRACE_S, None

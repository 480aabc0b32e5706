"""The user's errors and misuse: when a rank's own mistake must fail the job at once, and when tmd must refuse to
move or recover it. Decides and journals; the daemon applies (:class:`JobFailed` ends the job with exit code 1).

- **A script error** (:class:`~tmd.protocol.RankFailed`, ``script_error``; ``state_mismatch``: replicas
  diverged after a migration or recovery; ``step_aborted_uncaught``: the script did not catch a ``StepAborted``
  of a peer's failure, and its rank is lost with it): ``rank_failed`` is journalled (rank, node, kind, error,
  traceback) and the job fails. No standby is spent: the failing process's exit that follows is not a node
  failure.
- **A startup failure**: a process of an active node that exits before its worker registered (before
  ``worker.init()`` reached tmd): ``startup_failed`` names node/local_rank, its rank (ranks are node-major), its
  exit code and the last :data:`LOG_TAIL_LINES` lines of its log (``<run_dir>/logs/<node>.<local_rank>.log``),
  then the job fails. A standby process that dies before registering is started again, but not after
  :data:`STANDBY_START_LIMIT` such deaths in a row (then ``standby_restarted`` is journalled with ``stopped``
  true and the reason, and the node stays without processes).
- **The crash-loop guard**: once an incident recovered with resume step S, a rank's failure (a process exit, a
  lost node, a RankFailed) before every rank committed step S fails the job: "step S failed again after
  recovery" (redoing it once more would fail the same way, spending a standby each time).
- **Misuse** (:class:`~tmd.protocol.RankWarning`): journalled ``job_warning`` and kept for ``tmctl status``; for
  unmanaged state or a process group created after the recorded steps (``REFUSING_WARNINGS``) a migration of the
  job is refused (``ErrorCode.UNMANAGED_STATE``; the daemon aborts one not yet decided) and a failure fails the job
  instead of recovering into a state that diverged (a regroup too: tmd.recovery ``Incidents.refusal``). ``state_after_update`` (rank state
  changed after an optimizer update) refuses nothing: only a replacement's RNG or data position may differ; nor does
  ``stateful_comm_hook`` (a DDP comm hook's state that no migration or recovery moves: the user is told).
"""
from __future__ import annotations

import collections
import os
from typing import Optional

from tmd import protocol as p
from tmd.episode import Episodes
from tmd.journal import Journal, cut_text
from tmd.protocol.layout import RunDir
from tmd.protocol.vocab import Event, FailureKind, IncidentState, NodeRole
from tmd.registry import Node, Registry, Worker

LOG_TAIL_LINES = 20  # lines of a process's log quoted when it died before registering
STANDBY_START_LIMIT = 3  # a standby's process dying this many times in a row before registering: not restarted
WHAT = {FailureKind.SCRIPT_ERROR: "raised", FailureKind.STATE_MISMATCH: "found diverged state",
        FailureKind.STEP_ABORTED_UNCAUGHT: "raised StepAborted and did not catch it"}  # a RankFailed, in its reason


class JobFailed(Exception):
    """The job must end now with exit code 1. ``reason``: one line naming the rank and node; ``details``: what
    tmd prints below it (a traceback, a log tail), or ""."""

    def __init__(self, reason: str, details: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.details = details


def log_tail(path: str, lines: int = LOG_TAIL_LINES, max_bytes: int = 64 * 1024) -> str:
    """The last ``lines`` lines of the file at ``path`` (at most its last ``max_bytes`` bytes), "" if unreadable."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_bytes))
            data = f.read()
    except OSError:
        return ""
    return "\n".join(data.decode(errors="replace").rstrip("\n").splitlines()[-lines:])


class Faults:
    """The rules of the module docstring over one job. ``failure`` (a dict: rank, node, kind, error, traceback)
    says why the job failed once it did; ``warnings`` (dicts: rank, node, code, message) the misuse reported."""

    def __init__(self, registry: Registry, journal: Journal, layout: RunDir, incidents: Episodes) -> None:
        self.registry = registry
        self.journal = journal
        self.layout = layout
        self.incidents = incidents
        self.failure: Optional[dict] = None
        self.warnings: list[dict] = []
        self.redo_step: Optional[int] = None  # the resume step of the incident that just recovered, until committed
        self._guarded_incident = 0  # id of the incident whose resume step the guard watches (or watched)
        self._standby_deaths: collections.Counter[str] = collections.Counter()  # node -> starts in a row that died
        self._died_unregistered: set[str] = set()  # standbys with a process that died before registering

    # --- the user's errors --------------------------------------------------------------------------------------
    def rank_failed(self, w: Worker, msg: p.RankFailed) -> JobFailed:
        """A rank reported it cannot go on: journal it and return the job's failure (the caller raises it)."""
        self.journal.record(Event.RANK_FAILED, rank=msg.rank, node=w.node, local_rank=w.local_rank, step=msg.step,
                            kind=msg.kind, error=msg.error, traceback=msg.traceback)
        reason = f"rank {msg.rank} on {w.node} {WHAT[msg.kind]} at step {msg.step}: {msg.error}"
        again = self._failed_again(msg.step)
        if again:
            reason = f"{again}: {reason}"
        # kept for every StatusReply: bounded, so a reply always fits in one frame (tmd.protocol.keys)
        self.failure = {"rank": msg.rank, "node": w.node, "kind": msg.kind, "error": cut_text(msg.error, 1000),
                        "traceback": cut_text(msg.traceback, 8000), "step": msg.step}
        return JobFailed(reason, msg.traceback)

    def startup_exit(self, node: Node, local_rank: int, returncode: Optional[int]) -> Optional[JobFailed]:
        """A process of ``node`` exited before its worker registered. An active node's: journal
        ``startup_failed`` and return the job's failure. A standby's: count it and return None (see
        :meth:`may_restart_standby`)."""
        if node.role == NodeRole.STANDBY:
            self._died_unregistered.add(node.name)
            return None
        if node.role != NodeRole.ACTIVE:
            return None
        rank = node.ranks[local_rank] if local_rank < len(node.ranks) else None
        log = self.layout.log(node.name, local_rank)
        tail = log_tail(log)
        self.journal.record(Event.STARTUP_FAILED, node=node.name, local_rank=local_rank, rank=rank,
                            returncode=returncode, log=log, log_tail=tail)
        reason = (f"rank {rank} ({node.name}/{local_rank}) exited with code {returncode} before worker.init() "
                  f"registered with tmd; its log: {log}")
        self.failure = {"rank": rank, "node": node.name, "kind": Event.STARTUP_FAILED, "error": reason,
                        "traceback": tail}
        return JobFailed(reason, tail)

    def registered(self, w: Worker) -> None:
        """A worker registered: its node's count of deaths before registering starts again."""
        self._standby_deaths.pop(w.node, None)
        self._died_unregistered.discard(w.node)

    def may_restart_standby(self, node: Node) -> Optional[str]:
        """Called when standby ``node`` has no process left: None if its processes may be started again, else
        why not (its last :data:`STANDBY_START_LIMIT` starts all died before registering)."""
        if node.name in self._died_unregistered:
            self._died_unregistered.discard(node.name)
            self._standby_deaths[node.name] += 1
        deaths = self._standby_deaths[node.name]
        if deaths >= STANDBY_START_LIMIT:
            return (f"its processes died before registering {deaths} times in a row; not started again "
                    f"(see {self.layout.log(node.name, 0)})")
        return None

    # --- misuse -------------------------------------------------------------------------------------------------
    def warned(self, w: Worker, msg: p.RankWarning) -> None:
        """A rank found misuse at start: journal and keep it (one entry per rank and code)."""
        if any(x["rank"] == msg.rank and x["code"] == msg.code for x in self.warnings):
            return
        # kept for every StatusReply, one per rank and code: bounded, so that a reply fits in one frame
        entry = {"rank": msg.rank, "node": w.node, "code": msg.code, "message": cut_text(msg.message, 1000)}
        self.warnings.append(entry)
        self.journal.record(Event.JOB_WARNING, **entry)

    def unmanaged(self) -> Optional[str]:
        """Why this job's state cannot be moved or recovered without diverging (its first ``REFUSING_WARNINGS``
        warning), or None."""
        w = next((x for x in self.warnings if x["code"] in p.REFUSING_WARNINGS), None)
        if w is None:
            return None
        return f"rank {w['rank']} on {w['node']} reported {w['code']}: {w['message']}"

    # --- recovery -----------------------------------------------------------------------------------------------
    def refuse_recovery(self, node: Node, reason: str) -> Optional[JobFailed]:
        """Node ``node`` was lost (``reason``): the job's failure if it must not be recovered from (the crash-loop
        guard, or misuse), else None. The guard counts a node's loss in the redone step only when the node holds
        a rank that incident recovered (a step whose data kills its ranks kills their replacements again); another
        node lost meanwhile is a failure of its own, recovered like any (an outside test's second kill -9, of the
        other node, failed the job although a standby and checkpoints were there)."""
        inc = self.incidents.latest
        again = self._failed_again(None) if inc is not None and set(node.ranks) & set(inc.lost) else None
        if again:
            why = f"{again}: {node.name} lost ({reason})"
        elif self.unmanaged():
            why = f"cannot recover from the loss of {node.name} ({reason}): {self.unmanaged()}"
        else:
            return None
        self.failure = {"rank": None, "node": node.name, "kind": Event.NODE_FAILED, "error": why, "traceback": ""}
        return JobFailed(why)

    def _failed_again(self, step: Optional[int]) -> Optional[str]:
        """"step S failed again after recovery ..." while the guard is armed (and ``step``, if known, is S), else
        None."""
        self.tick()
        s = self.redo_step
        if s is None or (step is not None and step != s):
            return None
        inc = self.incidents.latest
        return f"step {s} failed again after recovery (incident {inc.id if inc else '?'} redid it)"

    def tick(self) -> None:
        """Arm the crash-loop guard when an incident recovered; disarm it once every rank committed its resume
        step (a rank's step is the one it is on: past S once it committed S)."""
        inc = self.incidents.latest
        if inc is not None and inc.state == IncidentState.RECOVERED and inc.id != self._guarded_incident:
            self._guarded_incident = inc.id
            self.redo_step = inc.resume_step
        if self.redo_step is not None and self.registry.all_ranks_assigned() and \
                all(w.step > self.redo_step for w in self.registry.rank_owner.values()):
            self.redo_step = None

"""Moving a live but failing node off the job: a GPU that went bad, or (with ``migrate_stragglers``) a straggler.

:class:`Evacuation` reads what every heartbeat carries (the rank's ``busy_s`` counter for tmd.health's
StragglerDetector, its GPU sample for GpuHealthPolicy), journals the changes (``gpu_*``, ``straggler_*``) and
evacuates: starts a planned migration of the node to a warm standby, through tmd.control.JobControl. A node with
an unhealthy GPU stays unhealthy until the rank moves, even while its heartbeats are fine.
"""
from __future__ import annotations

from typing import Optional

from tmd.control import JobControl
from tmd.health import GpuHealthPolicy, StragglerDetector, finite
from tmd.guards import guard_of, warm_guard
from tmd.migration import MigrationError
from tmd.protocol.vocab import GPU_EVENTS, Event, GpuLevel, Health, NodeRole
from tmd.registry import Node, Worker


class Evacuation:
    """GPU health and stragglers of the ranks' owners; ``migrate_stragglers``: evacuate a straggler's node too
    (a bad GPU's node always is)."""

    def __init__(self, control: JobControl, migrate_stragglers: bool = False,
                 gpu_policy: Optional[GpuHealthPolicy] = None, stragglers: Optional[StragglerDetector] = None) -> None:
        self.control = control
        self.migrate_stragglers = migrate_stragglers
        self.gpu_policy = gpu_policy or GpuHealthPolicy()
        self.stragglers = stragglers or StragglerDetector()
        self._gpu_verdicts: dict[int, Optional[tuple[GpuLevel, str]]] = {}  # rank -> last verdict
        self._in_incident = False
        self._waiting: dict[str, str] = {}  # straggler's node -> why, its evacuation skipped: tried again each tick
        self._owners: dict[int, Worker] = {}  # rank -> the process whose heartbeats its verdicts come from

    def observe(self, w: Worker, counters: dict, now: float) -> Optional[str]:
        """One heartbeat's ``counters`` from ``w`` at ``now`` (time.monotonic()); only a rank's owner counts.
        Returns why the counters are malformed (``busy_s`` not a non-negative number, ``gpu`` not an object;
        that part is ignored), None when fine. Never raises."""
        if not isinstance(counters, dict):
            return "counters are not an object"
        owner = w.rank is not None and self.control.registry.rank_owner.get(w.rank) is w
        if not owner:
            return None
        if self._owners.get(w.rank) is not w:
            self._moved(w)
        problem = None
        if "busy_s" in counters:
            busy = finite(counters["busy_s"])
            if busy is not None and busy >= 0:
                self.stragglers.observe(w.rank, now, busy)
            else:
                problem = "busy_s is not a non-negative number"
        gpu = counters.get("gpu")
        if isinstance(gpu, dict):
            self._check_gpu(w, gpu)
        elif gpu is not None:
            problem = "gpu is not an object"
        return problem

    def _moved(self, w: Worker) -> None:
        """Rank ``w.rank`` is held by a new process (a migration's joiner, a recovery's replacement): the
        verdicts on its old process and GPU do not follow it. A straggler flag is cleared (journalled, with
        why) and its GPU verdict and windows start over; otherwise the node it moved to would inherit them, be
        taken for a suspect and take a healthy node's guard, or be evacuated again."""
        rank = w.rank
        first = rank not in self._owners
        self._owners[rank] = w
        if first:
            return
        if rank in self.stragglers.flagged:
            self.control.journal.record(Event.STRAGGLER_CLEARED, rank=rank, node=w.node, lateness=None,
                                        reason="its rank moved to another process")
        self.stragglers.forget(rank)
        self.gpu_policy.forget(rank)
        self._gpu_verdicts.pop(rank, None)

    def gpu_unhealthy(self, n: Node) -> bool:
        """Whether a rank of ``n`` has an unhealthy GPU verdict (heartbeats coming back do not clear it)."""
        return any((self._gpu_verdicts.get(r) or (None,))[0] == GpuLevel.UNHEALTHY for r in n.ranks)

    def flagged(self, n: Node) -> list[int]:
        """The ranks of ``n`` that are stragglers now, sorted."""
        return sorted(r for r in n.ranks if r in self.stragglers.flagged)

    def tick(self, now: float) -> None:
        """Journal ranks that turn into stragglers or recover (tmctl status shows them per node); with
        ``migrate_stragglers``, move a straggler's node to a warm standby. ``now``: time.monotonic(). While an
        incident runs nobody is judged, and every rank's window starts over at its start and its end: halted
        survivors wait for the lost ranks, and the first steps after a recovery are the redone ones."""
        in_incident = self.control.current_incident is not None
        if in_incident or self._in_incident:
            self._in_incident = in_incident
            self.stragglers.reset(now)
            return
        new, cleared = self.stragglers.evaluate(now)
        reg, journal = self.control.registry, self.control.journal
        for rank, event in [(r, Event.STRAGGLER_DETECTED) for r in new] + \
                [(r, Event.STRAGGLER_CLEARED) for r in cleared]:
            w = reg.rank_owner.get(rank)
            journal.record(event, rank=rank, node=w.node if w else None,
                           lateness=round(self.stragglers.lateness.get(rank, 0.0), 3))
            if event == Event.STRAGGLER_DETECTED and self.migrate_stragglers and w is not None:
                if not self.evacuate(reg.nodes[w.node], f"rank {rank} is a straggler"):
                    self._waiting[w.node] = f"rank {rank} is a straggler"
        for name, reason in list(self._waiting.items()):  # a standby or a guard may be warm now
            node = reg.nodes.get(name)
            if node is None or node.role != NodeRole.ACTIVE or not self.flagged(node) or \
                    self.evacuate(node, reason, quiet=True):
                del self._waiting[name]

    def evacuate(self, node: Node, reason: str, quiet: bool = False) -> bool:
        """Move a live but failing node to its warm guard, else to a warm standby, if one is free and nothing else
        runs (journals ``evacuation_started``, or ``evacuation_skipped`` with why unless ``quiet``: a retry).
        Returns whether the migration started. A straggler's node whose evacuation was skipped is tried again
        at every tick while its rank is still flagged (before 2026-11-29 it was not: with ``--guards 1`` the
        only standby was another node's guard when the straggler was flagged, the guard then moved to the
        straggler's node and warmed, and the node stayed slow to the job's end)."""
        c = self.control
        guard = guard_of(c.registry, node)  # warm for this node already (tmd.guards)
        standby = guard if guard is not None and warm_guard(guard) else \
            next(iter(c.registry.warm_standbys()), None)
        if standby is None or c.current_migration is not None or c.current_incident is not None:
            if not quiet:
                c.journal.record(Event.EVACUATION_SKIPPED, node=node.name, reason=reason,
                                 why="no warm standby" if standby is None else "a migration or recovery is running")
            return False
        try:
            m = c.request_migration([node.name], [standby.name], require_healthy=False)
        except MigrationError as e:
            if not quiet:
                c.journal.record(Event.EVACUATION_SKIPPED, node=node.name, reason=reason, why=str(e))
            return False
        c.journal.record(Event.EVACUATION_STARTED, node=node.name, standby=standby.name, migration_id=m.id,
                         reason=reason)
        return True

    def _check_gpu(self, w: Worker, sample: dict) -> None:
        """GPU health from the rank's pynvml probe: journal changes; an unhealthy GPU (critical XID, new
        uncorrected ECC errors, GPU lost) on a node that still runs is moved off by a planned migration."""
        verdict = self.gpu_policy.evaluate(w.rank, sample)
        if verdict == self._gpu_verdicts.get(w.rank):
            return
        self._gpu_verdicts[w.rank] = verdict
        journal = self.control.journal
        if verdict is None:
            journal.record(Event.GPU_HEALTHY, node=w.node, rank=w.rank)
            return
        level, reason = verdict
        journal.record(GPU_EVENTS[level], node=w.node, rank=w.rank, reason=reason)
        if level == GpuLevel.UNHEALTHY:
            node = self.control.registry.nodes[w.node]
            node.health, node.reason = Health.UNHEALTHY, reason
            self.evacuate(node, reason)

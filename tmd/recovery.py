"""Recovery from unexpected failures with a general standby (TrainMover, arXiv 2412.12636, section 5).

A node that dies, hangs or is cut off cannot hand its ranks over, so tmd runs an *incident* instead of a
migration:

1. **halting**: every survivor gets :class:`~tmd.protocol.Halt`; its mover Backend fails every group (a
   collective blocked on the lost peer returns at once, no gloo timeout), the step's optimizer update is
   refused, and the survivor answers ``halted`` with the last step it committed. Meanwhile a warm standby node
   is promoted: each of its processes is assigned one lost rank and runs shadow iterations (replaying that
   rank's recording), then answers ``warmed``. With no standby the incident waits (``recovery_waiting``),
   and goes on when one arrives.
2. **recovering**: with every survivor halted and every lost rank given a replacement, tmd picks the resume
   step ``S + 1`` where S is the highest committed step (survivors differ by at most one step: a step's
   all-reduce can finish on some ranks and not others). :class:`~tmd.protocol.Recover` tells every party to
   build the next generation of its groups, and pairs each replacement and each survivor that is behind with a
   survivor that committed S (a data-parallel replica: identical state), spreading the receivers over the
   replicas so transfers run in parallel. The plan does not wait for the replacements' warm-up: they receive
   their state and build their groups on a helper thread during their shadow iterations
   (worker.recovery.Recovery.prefetch), so only the warm-up itself stays on the failure's critical path.
3. **recovered** once every party reports it (a replacement: after its shadow iterations): the standby node
   now holds the lost ranks. The interrupted step is redone with the same data, so the final state is
   bit-identical to an uninterrupted run.

A failure during an incident (a survivor or a replacement lost too) supersedes it: a new incident covers
every rank still lost, keeping the replacements that are alive. The lost node is *fenced*: anything it sends
later (say it was SIGSTOPped and is continued) is answered with a Release that makes it exit.
"""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Callable, Optional

from tmd import protocol as p
from tmd.channel import WorkerChannel
from tmd.episode import Episode, Episodes
from tmd.guards import Adoption
from tmd.journal import Journal
from tmd.protocol.layout import RunDir
from tmd.protocol.vocab import Event, IncidentMark, IncidentState, NodeRole, RecoveryPhase
from tmd.registry import Node, Registry, Worker

RECOVERY_TIMEOUT_S = 300.0  # an incident stuck this long (standby waits aside) fails the job
MAX_FAILED_RECOVERIES = 3  # incidents in a row whose parties failed to recover (none finished between) end the job


class RecoveryError(RuntimeError):
    """A failure the job cannot recover from (no data-parallel replica left, no recording to warm a
    replacement with, survivors too far apart, an incident stuck past its deadline): tmd ends the job with
    this reason."""


@dataclasses.dataclass(kw_only=True)
class Incident(Episode):
    """One failure being recovered from: ranks ``lost`` (rank -> the failed node that held it) get
    ``replacements`` on standby nodes (``standbys``: failed node -> standby node); ``survivors`` (rank -> the
    process holding it) halt and then resume together with them. ``phases`` holds
    :class:`~tmd.protocol.vocab.IncidentMark` instants (epoch seconds)."""

    SPANS = {
        "halt": (IncidentMark.DETECTED, IncidentMark.HALTED),  # detection to every survivor halted
        "warm_up": (IncidentMark.PROMOTED, IncidentMark.WARMED),  # replacements' set-up and shadow iterations
        "plan": (IncidentMark.DETECTED, IncidentMark.RECOVERING),  # detection to plan sent
        "transfer_and_regroup": (IncidentMark.RECOVERING, IncidentMark.RECOVERED),  # plan to every party recovered
        "after_warm_up": (IncidentMark.WARMED, IncidentMark.RECOVERED),  # what the warm-up did not hide
        "total": (IncidentMark.DETECTED, IncidentMark.RECOVERED),
    }

    state: IncidentState = IncidentState.HALTING
    lost: dict[int, str]  # rank -> the failed node that held it
    survivors: dict[int, Worker]
    replacements: dict[int, Worker] = dataclasses.field(default_factory=dict)
    standbys: dict[str, str] = dataclasses.field(default_factory=dict)  # failed node -> standby node
    halted: dict[int, int] = dataclasses.field(default_factory=dict)  # rank -> committed step
    recovered: set = dataclasses.field(default_factory=set)
    generation: int = 0
    resume_step: Optional[int] = None
    bytes_moved: int = 0
    shadow_steps: dict[int, int] = dataclasses.field(default_factory=dict)  # rank -> shadow iterations its replacement ran
    waiting_standby: bool = False
    waiting_since: Optional[float] = None  # time.monotonic() when it began to wait for a standby
    snapshots: dict[int, list[int]] = dataclasses.field(default_factory=dict)  # rank -> snapshot steps it holds
    rollback_step: Optional[int] = None  # the snapshot step the job rolled back to (None: no rollback)

    def parties(self) -> list[Worker]:
        return [*self.survivors.values(), *self.replacements.values()]

    def phases_s(self) -> dict[str, float]:
        """Durations (seconds): halt (detection to every survivor halted), warm_up (promotion to every
        replacement warm: the script's set-up and shadow iterations), plan (detection to plan sent),
        transfer_and_regroup (plan to every party recovered; it overlaps warm_up, the replacements report
        recovered after their shadow iterations), after_warm_up (every replacement warm to every party
        recovered: the replacements' load and group swap, what the warm-up did not hide), total (detection to
        recovered). Spans whose ends were not both marked are left out."""
        return super().phases_s()

    def details(self) -> dict:
        return {"lost_ranks": sorted(self.lost), "failed_nodes": sorted(set(self.lost.values())),
                "standbys": dict(self.standbys), "waiting_standby": self.waiting_standby,
                "resume_step": self.resume_step, "generation": self.generation, "bytes_moved": self.bytes_moved,
                "rollback_step": self.rollback_step}


class Incidents(Episodes[Incident]):
    """Drives failure recovery. ``channel`` reaches the workers; ``run_dir`` holds the ranks' recordings
    (a replacement cannot be warmed without its rank's).
    ``regroup_after_s``: a collective failure that no node failure explains within this many seconds (a
    transient network fault: every process is alive) starts an incident with no lost rank: all groups are
    rebuilt and the step is redone. Also the list of this tmd's incidents (``all``, ``current``, ``get``,
    ``first_id``: tmd.episode.Episodes)."""

    def __init__(self, registry: Registry, journal: Journal, channel: WorkerChannel, run_dir: RunDir,
                 regroup_after_s: float = 2.0, snapshot_every: int = 0) -> None:
        super().__init__()
        self.registry = registry
        self.journal = journal
        self.channel = channel
        self.run_dir = run_dir
        self.lost: dict[int, str] = {}  # ranks whose node failed and that no one holds yet
        # rank -> the ranks holding a bit-identical copy of its replicated state (its replica class, itself
        # included), from the ranks' ReplicaReports; a rank missing here is taken to be replicated by every rank
        self.replicas: dict[int, list[int]] = {}
        self.unprotected: list[dict] = []  # the no_replica warnings: one per node whose loss takes a rank's copies
        self.snapshot_every = snapshot_every  # the ranks' buddy snapshots (worker.snapshot); 0: off
        self.keepers: dict[int, int] = {}  # rank -> the rank keeping its snapshot, once snapshots are on
        self.regroup_after_s = regroup_after_s
        self._unexplained: Optional[tuple[float, str]] = None  # (monotonic, what) of a collective failure
        self.failed_recoveries = 0  # incidents in a row that a party failed to recover from
        # called when a failed node finds no warm standby (with why): True if a standby will come (tmd.guards
        # releases a guard, which comes back as a general standby)
        self.free_standby: Callable[[str], bool] = lambda why: False
        # seconds an incident waits for a standby before it fails (RecoveryError: tmd then restarts the job from
        # its newest checkpoint, tmd.tiers); 0: it waits as long as it takes
        self.standby_wait_s = 0.0
        # why no incident may start (tmd.faults ``unmanaged``: misuse a rank reported), or None
        self.refusal: Callable[[], Optional[str]] = lambda: None

    # ---------------------------------------------------------------------------------------------------------
    def on_node_failed(self, node_name: str, reason: str, adopt: Optional[Adoption] = None) -> None:
        """An active node is lost. Marks it failed and starts an incident (superseding one in progress).
        ``adopt``: the joiners warm (or warming) for exactly this node's ranks, which become the replacements: a
        planned migration's whose leaver this node was, or this node's guard (tmd.guards). Raises RecoveryError
        if no replica is left."""
        self.lose(node_name, reason)
        self.start(f"{node_name}: {reason}", (node_name, adopt) if adopt else None)

    def lose(self, node_name: str, reason: str) -> None:
        """Mark node ``node_name`` failed and its ranks lost, for the incident the next :meth:`on_node_failed`
        starts (a node that fails together with that one)."""
        reg = self.registry
        for rank in reg.fail_node(reg.nodes[node_name], reason):
            self.lost[rank] = node_name

    def on_replacement_lost(self, node: Node, reason: str) -> None:
        """A standby taking over lost ranks failed before the incident finished: it is out, the incident
        restarts (with another standby). Raises RecoveryError as :meth:`start` does."""
        self.registry.fail_node(node, reason)
        self.start(f"replacement {node.name} lost: {reason}")

    def on_replicas(self, w: Worker, msg: p.ReplicaReport) -> None:
        """Rank ``msg.rank``'s replica class. Once every rank reported, journal ``no_replica`` for each node whose
        loss would take every copy of some rank's state (kept for ``tmctl status``): a failure there cannot be
        recovered."""
        ranks = sorted(set(msg.replicas))
        if msg.rank != w.rank:
            raise ValueError(f"replica report for rank {msg.rank} from the process of rank {w.rank}")
        if msg.rank not in ranks or ranks[-1] >= self.registry.world_size:
            raise ValueError(f"replica report of rank {msg.rank} names {ranks} (world size "
                             f"{self.registry.world_size})")
        for r in ranks:
            self.replicas[r] = ranks
        if len(self.replicas) < self.registry.world_size or self.unprotected:
            return
        node_of = {r: w.node for r, w in self.registry.rank_owner.items()}
        exposed = [r for r in range(self.registry.world_size)
                   if len({node_of.get(x) for x in self.replicas[r]}) == 1 and r in node_of]
        keepers = p.layout.snapshot_keepers(node_of) if len(node_of) == self.registry.world_size else {}
        if exposed and self.snapshot_every > 0 and keepers:
            self.keepers = keepers  # the ranks decide the same from the same map (worker.snapshot)
        self.journal.record(Event.REPLICA_CLASSES, replicas={str(r): c for r, c in sorted(self.replicas.items())},
                            keepers={str(r): k for r, k in sorted(self.keepers.items())})
        for r in exposed:
            node = node_of[r]
            if any(u["node"] == node for u in self.unprotected):
                continue
            consequence = (f"a failure of {node} rolls the job back to the last buddy snapshot (every "
                           f"{self.snapshot_every} steps)") if self.keepers else \
                f"a failure of {node} is not recoverable (no buddy snapshots)"
            entry = {"rank": r, "node": node, "code": Event.NO_REPLICA.value,
                     "message": f"rank {r}'s state has no replica outside {node}: {consequence}"}
            self.unprotected.append(entry)
            self.journal.record(Event.NO_REPLICA, **entry)

    def restore(self, replicas: dict[int, list[int]], keepers: dict[int, int], unprotected: list[dict]) -> None:
        """What a crashed tmd learned of the replica classes (tmd resume: its ``replica_classes`` and
        ``no_replica`` events); the ranks do not report them again."""
        self.replicas, self.keepers, self.unprotected = dict(replicas), dict(keepers), list(unprotected)

    def sources_for(self, rank: int, candidates: list[int]) -> list[int]:
        """The ranks of ``candidates`` that hold a bit-identical copy of ``rank``'s state (all of them when the
        job reported no replica classes)."""
        if rank not in self.replicas:
            return list(candidates)
        return [c for c in candidates if c in self.replicas[rank]]

    def start(self, reason: str, adopt: Optional[tuple[str, Adoption]] = None) -> Incident:
        """Start an incident covering every rank in ``lost``, superseding the running one (whose replacements
        that are alive and still needed are kept). ``adopt``: (failed node, the joiners warm for its ranks) that
        become replacements. Every survivor is told to halt; failed nodes without a
        replacement get a warm standby, or the incident waits for one. Raises RecoveryError when no rank
        survives or a lost rank has no recording yet, or when :attr:`refusal` gives a reason (a regroup after a
        collective failure too: a process group created after the recorded steps, which joiners lack, hung every
        regroup's setup until the store's timeout, incident after incident)."""
        refused = self.refusal()
        if refused:
            raise RecoveryError(f"cannot recover ({reason}): {refused}")
        reg = self.registry
        old = self.current
        if old is not None:
            old.state = IncidentState.SUPERSEDED
            self.journal.record(Event.RECOVERY_SUPERSEDED, incident_id=old.id, reason=reason)
        survivors = dict(sorted(reg.rank_owner.items()))
        if not survivors:
            raise RecoveryError(f"every rank is lost ({reason}): no data-parallel replica to recover from")
        orphans = [r for r in sorted(self.lost) if not self.sources_for(r, list(survivors))]
        unkept = [r for r in orphans if self.keepers.get(r) not in survivors]
        if unkept:
            r = unkept[0]
            kept = f"; rank {self.keepers[r]} kept its snapshot and is lost too" if r in self.keepers else \
                " and buddy snapshots are off"
            raise RecoveryError(f"the state of rank {r} has no surviving replica ({reason}): ranks "
                                f"{self.replicas[r]} held its only copies{kept}")
        # a rollback restores every lost rank from the snapshot its keeper holds, replicated or not
        unkept = [r for r in sorted(self.lost) if orphans and self.keepers.get(r) not in survivors]
        if unkept:
            r = unkept[0]
            raise RecoveryError(f"rank {orphans[0]}'s state has no surviving replica ({reason}): the job must roll "
                                f"back, but rank {self.keepers[r]}, which kept rank {r}'s snapshot, is lost too")
        missing = [r for r in self.lost if not os.path.exists(self.run_dir.recording(r))]
        if missing:
            raise RecoveryError(f"ranks {missing} were lost before the job recorded its first steps; a "
                                "replacement cannot be warmed without their recording")
        self._unexplained = None
        inc = Incident(id=self.next_id(), reason=reason, lost=dict(self.lost), survivors=survivors)
        inc.mark(IncidentMark.DETECTED)
        inc.set_deadline(RECOVERY_TIMEOUT_S)
        if old is not None:  # keep the replacements that are still alive and still needed
            for failed_node, standby in old.standbys.items():
                workers = reg.nodes[standby].workers
                if reg.nodes[standby].role == NodeRole.JOINING and failed_node in inc.lost.values() and \
                        all(not (w.exited or w.fenced) for w in workers.values()):
                    inc.standbys[failed_node] = standby
                    inc.replacements.update({w.rank: w for w in workers.values()})
        if adopt is not None:
            failed_node, adoption = adopt
            inc.standbys[failed_node] = adoption.standby
            for rank, w in adoption.joiners.items():
                w.rank, w.warm_for = rank, rank if adoption.warm else None
                inc.replacements[rank] = w
            inc.mark(IncidentMark.PROMOTED)  # the warm-up span then shows what was left of it: none if warm
            self._mark_warmed(inc)
        self.add(inc)
        self.journal.record(Event.RECOVERY_STARTED, incident_id=inc.id, reason=reason, lost_ranks=sorted(inc.lost),
                            survivors=sorted(survivors), adopted=dict(inc.standbys))
        for w in survivors.values():
            self.channel.send(w, p.Halt(incident_id=inc.id, reason=reason, failed_ranks=sorted(inc.lost)))
        self._promote(inc)
        return inc

    # ---------------------------------------------------------------------------------------------------------
    def on_report(self, w: Worker, msg: p.RecoveryReport) -> None:
        """A worker's recovery report. A collective failure with no incident running starts a regroup after
        ``regroup_after_s`` unless a node failure explains it first; reports of another incident, or in the
        wrong state, are journalled and ignored. Raises RecoveryError as :meth:`start` does (a party that
        failed to recover starts a new incident), and when ``MAX_FAILED_RECOVERIES`` incidents in a row failed
        that way (the same error each time would otherwise loop forever)."""
        inc = self.current
        if msg.phase == RecoveryPhase.COLLECTIVE_FAILED:
            if self.registry.rank_owner.get(msg.rank) is not w:  # only a rank's holder runs its collectives
                self.channel.ignore(w, Event.STALE_RECOVERY_REPORT, incident_id=msg.incident_id, phase=msg.phase,
                                    rank=msg.rank, reason=f"{w.node}/{w.local_rank} does not hold rank {msg.rank}")
                return
            self.journal.record(Event.COLLECTIVE_FAILED, node=w.node, local_rank=w.local_rank, rank=msg.rank,
                                error=msg.error)
            if inc is None and self._unexplained is None:
                self._unexplained = (time.monotonic(), f"rank {msg.rank} saw a collective fail: {msg.error}")
            return
        if inc is None:
            self.channel.ignore(w, Event.STALE_RECOVERY_REPORT, incident_id=msg.incident_id, phase=msg.phase,
                                rank=msg.rank, reason="no incident is running")
            return
        party = inc.survivors.get(msg.rank) is w or inc.replacements.get(msg.rank) is w
        if msg.phase == RecoveryPhase.WARMED and any(w is x for x in inc.replacements.values()):
            w.warm_for = w.rank  # valid across incidents: it warmed for this rank
            inc.shadow_steps[w.rank] = msg.shadow_steps
            self._mark_warmed(inc)
            self._maybe_plan(inc)
        elif msg.phase == RecoveryPhase.HALTED and msg.incident_id == inc.id and inc.survivors.get(msg.rank) is w:
            inc.halted[msg.rank] = msg.committed_step
            inc.snapshots[msg.rank] = list(msg.snapshots)
            if len(inc.halted) == len(inc.survivors) and IncidentMark.HALTED not in inc.phases:
                inc.mark(IncidentMark.HALTED)
                self.journal.record(Event.RECOVERY_HALTED, incident_id=inc.id,
                                    committed=dict(sorted(inc.halted.items())))
            self._maybe_plan(inc)
        elif msg.phase == RecoveryPhase.RECOVERED and msg.incident_id == inc.id and party and \
                inc.state == IncidentState.RECOVERING:
            if not msg.ok:
                # a party that fails the same way every time would start incidents forever: give up after a few
                self.failed_recoveries += 1
                why = f"rank {msg.rank} failed to recover: {msg.error}"
                if self.failed_recoveries >= MAX_FAILED_RECOVERIES:
                    self._fail(inc, f"{why} ({self.failed_recoveries} incidents in a row failed to recover)")
                self.start(why)
                return
            if msg.rank not in inc.recovered:  # a resent report counts once
                inc.recovered.add(msg.rank)
                inc.bytes_moved += msg.bytes_moved
            if len(inc.recovered) == len(inc.parties()):
                self._finish(inc)
        else:
            self.channel.ignore(w, Event.STALE_RECOVERY_REPORT, incident_id=msg.incident_id, phase=msg.phase,
                                rank=msg.rank, reason=f"incident {inc.id} is {inc.state}" if party else
                                f"{w.node}/{w.local_rank} has no part in incident {inc.id} as rank {msg.rank}")

    def tick(self, now_mono: float) -> None:
        """Regroup after an unexplained collective failure, look for a standby while one is awaited, and fail
        an incident stuck past its deadline, past ``--standby-wait-s`` without a standby, or whose survivors all
        exited (they finished the job's last step while the lost ranks had not: a standby arriving later would
        find no one to copy the state from). ``now_mono``: time.monotonic(). Raises RecoveryError then, after
        journalling the incident's failure (the checkpoint tier may restart the job)."""
        inc = self.current
        if inc is None and self._unexplained is not None and now_mono - self._unexplained[0] > self.regroup_after_s:
            what = self._unexplained[1]
            self.start(f"{what}; no node failed, regrouping")
            return
        if inc is None:
            return
        if inc.survivors and all(w.exited for w in inc.survivors.values()):  # they finished their loops and left
            self._fail(inc, f"every surviving rank ({', '.join(map(str, sorted(inc.survivors)))}) exited before "
                            f"incident {inc.id} could finish: nothing is left to recover ranks {sorted(inc.lost)} "
                            f"from")
        if inc.waiting_standby:
            self._promote(inc)
            self._maybe_plan(inc)  # the survivors halted long ago: the plan goes out with the promotion
            if inc.waiting_standby and self.standby_wait_s > 0 and inc.waiting_since is not None and \
                    now_mono - inc.waiting_since > self.standby_wait_s:
                self._fail(inc, f"no standby arrived within {self.standby_wait_s:g} s (--standby-wait-s)")
        elif inc.overdue(now_mono):
            self._fail(inc, f"recovery {inc.id} stuck in {inc.state} for {inc.deadline_s:.0f} s")

    # ---------------------------------------------------------------------------------------------------------
    def _fail(self, inc: Incident, why: str) -> None:
        """``inc`` cannot finish: journal its failure (its state becomes ``failed``) and raise RecoveryError."""
        stuck_in = inc.state
        inc.state = IncidentState.FAILED
        self.journal.record(Event.RECOVERY_FAILED, incident_id=inc.id, state=stuck_in, reason=why)
        raise RecoveryError(why)

    def _promote(self, inc: Incident) -> None:
        """Give every failed node without a replacement a warm standby, or wait for one."""
        reg = self.registry
        for failed_node in sorted(set(inc.lost.values()) - set(inc.standbys)):
            standby = next(iter(reg.warm_standbys(exclude=inc.standbys.values())), None)
            if standby is None:
                if not inc.waiting_standby:
                    self.free_standby(f"no general standby is warm for {failed_node}'s ranks")
                    inc.waiting_standby = True
                    inc.waiting_since = time.monotonic()
                    self.journal.record(Event.RECOVERY_WAITING, incident_id=inc.id, failed_node=failed_node,
                                        reason="no warm standby: training waits until one registers")
                return
            ranks = sorted(r for r, n in inc.lost.items() if n == failed_node)
            reg.promote(standby)
            inc.standbys[failed_node] = standby.name
            inc.phases.setdefault(IncidentMark.PROMOTED, time.time())
            self.journal.record(Event.STANDBY_PROMOTED, incident_id=inc.id, failed_node=failed_node,
                                standby=standby.name, ranks=ranks)
            for rank, w in zip(ranks, [standby.workers[i] for i in sorted(standby.workers)]):
                w.rank = rank
                w.warm_for = None
                inc.replacements[rank] = w
                self.channel.assign(w, rank, incident_id=inc.id)
        if inc.waiting_standby:
            inc.waiting_standby = False
            inc.set_deadline(RECOVERY_TIMEOUT_S)
            self.journal.record(Event.RECOVERY_STANDBY_FOUND, incident_id=inc.id, standbys=dict(inc.standbys))

    @staticmethod
    def _mark_warmed(inc: Incident) -> None:
        """Mark WARMED once every lost rank has a replacement that finished its shadow iterations."""
        if IncidentMark.WARMED not in inc.phases and set(inc.replacements) == set(inc.lost) and \
                all(w.warm_for == r for r, w in inc.replacements.items()):
            inc.mark(IncidentMark.WARMED)

    def _maybe_plan(self, inc: Incident) -> None:
        """Once every survivor halted and every lost rank has a replacement (warm or not: a replacement carries
        the plan out during its shadow iterations): pick the resume step and send the plan. Raises RecoveryError
        (after journalling the failure) when survivors disagree by more than one step."""
        if inc.state != IncidentState.HALTING or inc.waiting_standby or len(inc.halted) < len(inc.survivors):
            return
        if set(inc.replacements) != set(inc.lost):
            return
        self._mark_warmed(inc)  # replacements kept from a superseded incident or adopted from a migration
        committed = max(inc.halted.values())
        behind = sorted(r for r, c in inc.halted.items() if c < committed)
        if any(inc.halted[r] < committed - 1 for r in behind):
            self._fail(inc, f"survivors disagree by more than one step: {dict(sorted(inc.halted.items()))}")
        sources = sorted(r for r, c in inc.halted.items() if c == committed)
        receivers = sorted(inc.replacements) + behind
        resume = committed + 1
        if any(not self.sources_for(r, list(inc.survivors)) for r in inc.lost):
            # a lost rank's state has no surviving replica: roll the job back to the newest snapshot every
            # survivor holds; each lost rank gets the copy its keeper holds
            held = set.intersection(*(set(inc.snapshots.get(r, ())) for r in inc.survivors))
            if not held:
                self._fail(inc, f"ranks {sorted(inc.lost)} have no surviving replica and the survivors hold no "
                                f"common buddy snapshot ({dict(sorted(inc.snapshots.items()))})")
            inc.rollback_step = max(held)
            resume = inc.rollback_step + 1
            sends = [[self.keepers[dst], dst] for dst in sorted(inc.replacements)]
        else:
            sends = []
            for i, dst in enumerate(receivers):  # spread over each receiver's replicas: transfers run in parallel
                mine = self.sources_for(dst, sources)
                if not mine:
                    self._fail(inc, f"no survivor that committed step {committed} holds a replica of rank {dst}")
                sends.append([mine[i % len(mine)], dst])
        inc.generation = self.registry.generations.next()
        inc.resume_step = resume
        inc.state = IncidentState.RECOVERING
        inc.mark(IncidentMark.RECOVERING)
        rollback = -1 if inc.rollback_step is None else inc.rollback_step
        self.journal.record(Event.RECOVERY_PLAN, incident_id=inc.id, resume_step=inc.resume_step,
                            generation=inc.generation, sends=sends, rollback_step=rollback)
        plan = p.Recover(incident_id=inc.id, generation=inc.generation, resume_step=inc.resume_step, sends=sends,
                         rollback_step=rollback)
        for w in inc.parties():
            self.channel.send(w, plan)

    def _finish(self, inc: Incident) -> None:
        """Every party recovered: the standbys hold the lost ranks from now on."""
        reg = self.registry
        for standby in inc.standbys.values():
            node = reg.nodes[standby]
            reg.take_over(node, {r: w for r, w in inc.replacements.items() if w.node == standby})
        for rank in inc.replacements:
            self.lost.pop(rank, None)
        self.failed_recoveries = 0
        inc.state = IncidentState.RECOVERED
        inc.mark(IncidentMark.RECOVERED)
        self.journal.record(Event.RECOVERY_DONE, incident_id=inc.id, resume_step=inc.resume_step,
                            standbys=inc.standbys, bytes_moved=inc.bytes_moved, phases_s=inc.phases_s(),
                            shadow_steps={str(r): n for r, n in sorted(inc.shadow_steps.items())})

"""The migration state machine: one planned move of the ranks of one or more nodes (the leavers) to as many standby
nodes (the joiners), all in one prepare and one switch step.

    requested -> warming -> prepared -> switching -> transferred -> committed
         \\___________\\__________\\___________\\____________\\-> aborted (reason)

- requested:   validated; joiners are told their ranks (Assign role=joiner): the i-th leaver node's ranks go to
               the i-th standby's processes, in local-rank order.
- warming:     joiners run shadow iterations, replaying the recorded collectives (no communication). Phase 1
               starts once they are warm and every stayer of the migration before passed its switch step.
- prepared:    phase 1 done: every party built the next generation of the groups that contain a leaver, in the
               background, while training went on. (Entered after every ``prepared`` ack.)
- switching:   a switch step S was chosen and every party armed it; the leaver sends its state peer to peer to
               its joiner: the whole state at the boundary before S, or (worker.precopy) a pre-copy one step
               earlier followed by replayed optimizer steps and a small tail at S.
- transferred: every joiner (of every pair) received its state and verified the checksums, or loaded its
               pre-copy (the rest follows by replay). tmd decides the commit here and takes the ranks from the
               leaver nodes to the standbys (the point of no return); with a pre-copy this happens during step
               S - 1, so the stayers find the decision waiting at S and only swap their groups.
- committed:   phase 2: every party swapped in the new groups at S; the joiners run step S in the leavers' ranks.

Any failure (a party exiting, a refused switch step, a checksum mismatch, a phase deadline) in any pair before
the decision aborts the whole migration: every party drops what it staged, every standby comes back fresh, and
training goes on with the old groups. A leaver node lost after phase 1 started and before the decision hands its
pair's warm joiners to failure recovery (:meth:`Migrations.on_node_failed`). After the decision nothing aborts:
the migration commits, and a joiner that is lost (or cannot finish its state because its leaver died) is a
failure of the node that now holds its rank, which failure recovery (tmd.recovery) repairs from a replica; a
stayer's node lost then takes the undecided joiners' nodes with it (:meth:`Migrations.stranded_by`). Each
transition is journalled with its time and the lists ``sources`` and ``targets``.
The flow follows TrainMover (arXiv 2412.12636), sections 4-5: two-phase delta-based group setup, sandboxed
shadow iterations, and peer-to-peer state transfer.
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Optional, Sequence, Union

from tmd import protocol as p
from tmd.channel import WorkerChannel
from tmd.episode import Episode, Episodes
from tmd.guards import Adoption, guard_of, warm_guard
from tmd.journal import Journal
from tmd.protocol.vocab import (
    MIGRATION_EVENTS, ErrorCode, Event, Health, MigrationMark, MigrationPhase, MigrationRole, MigrationState,
    NodeRole,
)
from tmd.registry import Registry, Worker

STATES = tuple(s for s in MigrationState if s != MigrationState.ABORTED)  # the path of a migration that commits

# Seconds a migration may stay in a state before it is aborted (``prepared`` also bounds phase 1, which runs
# while the state is still ``warming``).
DEFAULT_DEADLINES_S: dict[MigrationState, float] = {
    MigrationState.WARMING: 300.0,
    MigrationState.PREPARED: 60.0,
    MigrationState.SWITCHING: 120.0,
    MigrationState.TRANSFERRED: 60.0,
}
DOWNTIME_WINDOW_STEPS = 6  # the switch step and the 5 after it
DOWNTIME_PENDING_MAX = 16  # the latest migrations whose downtime may still be filled in


def downtime_s(window_s: list[float], median_step_s: float) -> float:
    """A migration's downtime (seconds): the time the switch step and the ``DOWNTIME_WINDOW_STEPS - 1`` steps
    after it took on the lowest stayer rank (``window_s``, seconds each) beyond as many steps at that rank's median
    step time before the migration was requested (``median_step_s``). Never negative: a window faster than the
    median (noise) is no downtime, 0.0."""
    return round(max(0.0, sum(window_s) - len(window_s) * median_step_s), 6)


def _what_it_is(role: NodeRole) -> str:
    """A node's role in a refusal's words: "it is active", "it left the job", "it failed"."""
    return {NodeRole.LEFT: "it left the job", NodeRole.FAILED: "it failed"}.get(role, f"it is {role}")


def check_sources(reg: Registry, sources: list[str]) -> None:
    """Raise MigrationError for nodes to move that are named twice (``bad_request``) or are not active nodes of
    the job (``unknown_node``, naming the active ones). Under SLURM this runs before the targets are resolved
    (tmd.requests), so that a wrong source is named as such, not as a lack of warm standbys for ``any``."""
    twice = next((n for i, n in enumerate(sources) if n in sources[:i]), None)
    if twice is not None:
        raise MigrationError(ErrorCode.BAD_REQUEST, f"node '{twice}' is named twice among the nodes to move")
    actives = sorted(n.name for n in reg.nodes_in(NodeRole.ACTIVE))
    for source in sources:
        src = reg.nodes.get(source)
        if src is None or src.role != NodeRole.ACTIVE:
            what = f"{source} is not an active node ({_what_it_is(src.role)})" if src else \
                f"unknown node '{source}': it is not part of this job"
            raise MigrationError(ErrorCode.UNKNOWN_NODE, f"{what} (active nodes: {', '.join(actives) or 'none'})")


class MigrationError(Exception):
    """A request tmd refuses; ``code`` (an :class:`~tmd.protocol.vocab.ErrorCode`) is the ErrorReply code.
    Raises ValueError for a code that is not an ErrorCode."""

    def __init__(self, code: ErrorCode | str, message: str) -> None:
        super().__init__(message)
        self.code = ErrorCode(code)


@dataclasses.dataclass(kw_only=True)
class Migration(Episode):
    """One planned move of the ranks of nodes ``sources`` to standbys ``targets`` (``sources[i]`` to
    ``targets[i]``: a pair) under one group generation ``generation``. ``phases`` holds the states' and the
    :class:`~tmd.protocol.vocab.MigrationMark` instants (epoch seconds)."""

    SPANS = {
        "warm_up": (MigrationState.WARMING, MigrationMark.PREPARE_STARTED),  # shadow iterations
        "prepare": (MigrationMark.PREPARE_STARTED, MigrationState.PREPARED),  # phase 1, in the background
        "switch_wait": (MigrationState.SWITCHING, MigrationMark.TRANSFER_STARTED),  # arming until a leaver reached S
        "transfer": (MigrationMark.TRANSFER_STARTED, MigrationState.TRANSFERRED),  # state send/recv + verify
        "commit": (MigrationState.TRANSFERRED, MigrationState.COMMITTED),  # decision to joiners running at S
        "total": (MigrationState.REQUESTED, MigrationState.COMMITTED),
    }

    state: MigrationState = MigrationState.REQUESTED
    sources: list[str]  # the leaver nodes
    targets: list[str]  # the standby nodes, one per leaver node, in the same order
    generation: int
    leavers: dict[int, Worker]  # rank -> leaver process
    joiners: dict[int, Worker]  # rank -> joiner process (takes exactly the leaver's rank)
    stayers: dict[int, Worker]
    switch_step: Optional[int] = None
    request_step: int = -1
    acks: dict[MigrationPhase, set[bytes]] = dataclasses.field(default_factory=dict)  # phase -> identities that acked
    bytes_moved: int = 0
    transfer_s: float = 0.0
    rebuilt: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # "node/local_rank" -> group names
    downtime_s: Optional[float] = None
    median_step_s: Optional[float] = None
    pause_s: Optional[float] = None  # longest time a stayer stood at the switch step (seconds)
    ready_unix_s: dict[bytes, float] = dataclasses.field(default_factory=dict)  # party -> ready at S (committed)
    joiner_lag_s: Optional[float] = None  # last joiner ready at S - last stayer ready at S (seconds; see on_phase)
    shadow_steps: dict[int, int] = dataclasses.field(default_factory=dict)  # rank -> its joiner's shadow iterations
    lost: str = ""  # after the decision: why a party was lost (failure recovery repairs it)
    switched: set[bytes] = dataclasses.field(default_factory=set)  # stayers that reported ``committed`` at S

    @property
    def prepare_held(self) -> bool:
        """Warm, but phase 1 waits for the previous migration's stayers (see Migrations._prepare)."""
        return MigrationMark.PREPARE_HELD in self.phases and MigrationMark.PREPARE_STARTED not in self.phases

    @property
    def source(self) -> str:
        """The leaver nodes joined by commas (one node's name for a single move): for display."""
        return ",".join(self.sources)

    @property
    def target(self) -> str:
        """The standby nodes joined by commas (one node's name for a single move): for display."""
        return ",".join(self.targets)

    def pairs(self) -> list[tuple[str, str]]:
        """(leaver node, standby node) of every pair, in request order."""
        return list(zip(self.sources, self.targets))

    def leavers_on(self, node: str) -> dict[int, Worker]:
        """rank -> leaver process of leaver node ``node`` (empty for a node that is no source)."""
        return {r: w for r, w in self.leavers.items() if w.node == node}

    def joiners_on(self, node: str) -> dict[int, Worker]:
        """rank -> joiner process of standby ``node`` (empty for a node that is no target)."""
        return {r: w for r, w in self.joiners.items() if w.node == node}

    def leaver_side(self, joiner: Worker) -> tuple[str, list[Worker]]:
        """The leaver node paired with ``joiner``'s standby and that node's leaver processes. Raises ValueError
        when ``joiner`` is on none of the targets."""
        source = self.sources[self.targets.index(joiner.node)]
        return source, list(self.leavers_on(source).values())

    def parties(self) -> list[Worker]:
        return [*self.stayers.values(), *self.leavers.values(), *self.joiners.values()]

    def role_of(self, w: Worker) -> Optional[MigrationRole]:
        """``w``'s part in this migration, or None if it takes no part."""
        for role, group in ((MigrationRole.JOINER, self.joiners), (MigrationRole.LEAVER, self.leavers),
                            (MigrationRole.STAYER, self.stayers)):
            if any(w is x for x in group.values()):
                return role
        return None

    def phases_s(self) -> dict[str, float]:
        """Durations in seconds: warm_up (shadow iterations), prepare (phase 1 in the background), switch_wait
        (arming until the leaver reached S), transfer (state send/recv + verify), commit (decision to joiners
        running at S), total."""
        return super().phases_s()

    def details(self) -> dict:
        return {
            "sources": list(self.sources),
            "targets": list(self.targets),
            "source": self.source,
            "target": self.target,
            "generation": self.generation,
            "switch_step": self.switch_step,
            "ranks": sorted(self.leavers),
            "phases": dict(self.phases),
            "downtime_s": self.downtime_s,
            "downtime_after_step": (None if self.switch_step is None
                                    else self.switch_step + DOWNTIME_WINDOW_STEPS - 1),
            "median_step_s": self.median_step_s,
            "pause_s": self.pause_s,
            "joiner_lag_s": self.joiner_lag_s,
            "bytes_moved": self.bytes_moved,
            "transfer_s": self.transfer_s,
            "rebuilt": self.rebuilt,
        }


class Migrations(Episodes[Migration]):
    """Drives migrations: validates requests, sends each phase's messages through ``channel``, advances on the
    parties' reports and aborts on a failure or a missed deadline. Also the list of this tmd's migrations
    (``all``, ``current``, ``get``, ``first_id``: tmd.episode.Episodes)."""

    def __init__(
        self,
        registry: Registry,
        journal: Journal,
        channel: WorkerChannel,
        switch_slack_s: float = 0.5,
        deadlines_s: Optional[dict[str, float]] = None,
        record_steps: int = 0,
    ) -> None:
        """``switch_slack_s``: how far ahead (seconds of training) the switch step is placed, so every party
        hears of it before reaching it. ``deadlines_s``: state -> seconds, overriding DEFAULT_DEADLINES_S
        (ValueError for a key that is not a MigrationState). ``record_steps``: migrations wait until the job
        has recorded them."""
        super().__init__()
        self.registry = registry
        self.journal = journal
        self.channel = channel
        self.switch_slack_s = switch_slack_s
        self.record_steps = record_steps
        self.deadlines_s: dict[MigrationState, float] = {
            MigrationState(k): v for k, v in {**DEFAULT_DEADLINES_S, **(deadlines_s or {})}.items()}

    def get(self, migration_id: int) -> Migration:
        """Migration ``migration_id`` (negative: the latest). Raises MigrationError ``unknown_migration``."""
        m = self.find(migration_id)
        if m is None:
            raise MigrationError(ErrorCode.UNKNOWN_MIGRATION, f"no migration with id {migration_id}")
        return m

    # ---------------------------------------------------------------------------------------------------------
    def request(self, sources: Union[str, Sequence[str]], targets: Union[str, Sequence[str]],
                require_healthy: bool = True) -> Migration:
        """Validate and start one migration of node ``sources[i]``'s ranks to standby ``targets[i]`` for every
        i (a single node's name stands for a list of one). Raises MigrationError with a one-line reason, and
        nothing changes then: ``bad_request`` for no node, lists of different lengths, a node or standby named
        twice or a standby whose process count differs from its leaver node's rank count; ``unknown_node`` for
        a source that is not an active node; ``unknown_standby`` for a target that is not a standby;
        ``migration_running``; ``busy_standby`` for a standby that is not warm; ``not_ready`` while the job is
        not training, still recording, finishing, or a leaver node is not live and healthy.
        ``require_healthy`` false lets tmd evacuate a node that is alive but flagged unhealthy (a bad GPU).
        A guard (tmd.guards) is a target only for the node whose ranks it guards, once warm: its joiners skip the
        warm-up (phase 1 starts at once); any other guard is ``busy_standby``."""
        reg = self.registry
        sources = [sources] if isinstance(sources, str) else list(sources)
        targets = [targets] if isinstance(targets, str) else list(targets)
        self._check_lists(sources, targets)
        check_sources(reg, sources)
        standbys = sorted(n.name for n in reg.nodes_in(NodeRole.STANDBY))
        for target in targets:
            dst = reg.nodes.get(target)
            if dst is None or dst.role not in (NodeRole.STANDBY, NodeRole.JOINING, NodeRole.GUARDING):
                what = f"{target} is not a standby ({_what_it_is(dst.role)})" if dst else \
                    f"unknown standby '{target}': it is not a standby of this job"
                raise MigrationError(ErrorCode.UNKNOWN_STANDBY,
                                     f"{what} (standbys: {', '.join(standbys) or 'none'})")
        running = self.current
        if running is not None:
            raise MigrationError(
                ErrorCode.MIGRATION_RUNNING,
                f"migration {running.id} ({running.source} -> {running.target}) is still {running.state}",
            )
        for source, target in zip(sources, targets):
            dst = reg.nodes[target]
            if guard_of(reg, reg.nodes[source]) is dst and warm_guard(dst):
                continue  # the guard of exactly this node, warm: its joiners are ready (tmd.guards)
            if dst.role != NodeRole.STANDBY or not dst.warm:
                state = "cold: not all its processes are up" if dst.role == NodeRole.STANDBY else dst.role
                if dst.role == NodeRole.GUARDING:
                    state = f"guarding ranks {dst.guards}: it takes only the node holding them, once warm"
                raise MigrationError(ErrorCode.BUSY_STANDBY, f"standby '{target}' is busy ({state})")
        for source, target in zip(sources, targets):
            src, dst = reg.nodes[source], reg.nodes[target]
            if dst.expected_workers != len(src.ranks):
                raise MigrationError(ErrorCode.BAD_REQUEST,
                                     f"standby '{target}' has {dst.expected_workers} processes but node '{source}' "
                                     f"holds {len(src.ranks)} ranks: a standby takes one rank per process")
        if not reg.all_ranks_assigned() or reg.current_step() < 0:
            raise MigrationError(ErrorCode.NOT_READY, "the job has not started training yet")
        if reg.current_step() <= self.record_steps:
            raise MigrationError(ErrorCode.NOT_READY,
                                 f"the job is still recording its first {self.record_steps} steps for the joiners' "
                                 "shadow iterations; try again in a moment")
        for source in sources:
            src = reg.nodes[source]
            if (require_healthy and src.health != Health.HEALTHY) or len(src.workers) != len(src.ranks) or \
                    any(w.exited for w in src.workers.values()):
                raise MigrationError(ErrorCode.NOT_READY,
                                     f"node '{source}' is {src.health}; a planned migration needs a live leaver")
        if any(w.done for w in reg.rank_owner.values()):
            raise MigrationError(ErrorCode.NOT_READY, "the job is finishing")

        leavers: dict[int, Worker] = {}
        joiners: dict[int, Worker] = {}
        for source, target in zip(sources, targets):
            src, dst = reg.nodes[source], reg.nodes[target]
            leavers.update({r: reg.rank_owner[r] for r in src.ranks})
            if dst.role == NodeRole.GUARDING:  # each process is warm for its own rank already
                joiners.update({w.rank: w for w in dst.workers.values()})
            else:
                joiners.update({r: dst.workers[i] for i, r in enumerate(src.ranks)})
        stayers = {r: w for r, w in reg.rank_owner.items() if r not in leavers}
        m = self.add(Migration(id=self.next_id(), sources=sources, targets=targets,
                               generation=reg.generations.next(), leavers=dict(sorted(leavers.items())),
                               joiners=dict(sorted(joiners.items())), stayers=stayers,
                               request_step=reg.current_step()))
        guards = {t for t in targets if reg.nodes[t].role == NodeRole.GUARDING}
        for target in targets:
            reg.promote(reg.nodes[target])
        self._enter(m, MigrationState.REQUESTED, generation=m.generation, guards=sorted(guards))
        warm = m.acks.setdefault(MigrationPhase.WARMED, set())
        for rank, joiner in m.joiners.items():
            if joiner.node in guards:
                warm.add(joiner.identity)  # warm already: it learns its migration from the Prepare
            else:
                self.channel.assign(joiner, rank, migration_id=m.id)
        self._enter(m, MigrationState.WARMING)
        if len(warm) == len(m.joiners):
            self._prepare(m)
        return m

    @staticmethod
    def _check_lists(sources: list[str], targets: list[str]) -> None:
        """The request's shape: 1 to MAX_MIGRATE_NODES nodes, as many standbys, no standby named twice (a node
        named twice: :func:`check_sources`)."""
        if not sources or not targets:
            raise MigrationError(ErrorCode.BAD_REQUEST, "name at least one node to move and one standby to take it")
        if len(sources) > p.MAX_MIGRATE_NODES:
            raise MigrationError(ErrorCode.BAD_REQUEST, f"{len(sources)} nodes to move: one migration moves at "
                                                        f"most {p.MAX_MIGRATE_NODES}")
        if len(sources) != len(targets):
            raise MigrationError(ErrorCode.BAD_REQUEST,
                                 f"{len(sources)} node(s) to move ({','.join(sources)}) but {len(targets)} "
                                 f"standby(s) to take them ({','.join(targets)}): name one standby per node")
        twice = next((n for i, n in enumerate(targets) if n in targets[:i]), None)
        if twice is not None:
            raise MigrationError(ErrorCode.BAD_REQUEST, f"standby '{twice}' is named twice: one standby takes one "
                                                        "node's ranks")

    # ---------------------------------------------------------------------------------------------------------
    def on_phase(self, w: Worker, msg: p.PhaseDone) -> None:
        """A party reports a phase. Out-of-date or unexpected reports are journalled and ignored."""
        if msg.phase == MigrationPhase.COMMITTED and msg.ok:
            done = self.find(msg.migration_id) if msg.migration_id >= 0 else None
            if done is not None and done.role_of(w) in (MigrationRole.STAYER, MigrationRole.JOINER):
                self._note_ready(done, w, msg.ready_unix_s)
            if done is not None and any(w is s for s in done.stayers.values()):
                # how long training stood still on this stayer at the switch step (it may report after commit)
                done.pause_s = round(max(done.pause_s or 0.0, msg.seconds), 6)
                done.switched.add(w.identity)
                self._release_prepare()
                return
        if msg.phase == MigrationPhase.SENT and msg.ok:
            done = self.find(msg.migration_id) if msg.migration_id >= 0 else None
            if done is not None and done.state == MigrationState.COMMITTED and done.role_of(w) == MigrationRole.LEAVER:
                # a leaver reports SENT after the tail left; its joiner, on another connection, may have loaded
                # the tail and committed first: journal it all the same
                self._journal_sent(done, msg)
                return
        m = self.current
        if m is None or msg.migration_id != m.id:
            self.channel.ignore(w, Event.STALE_PHASE_REPORT, migration_id=msg.migration_id, phase=msg.phase)
            return
        role = m.role_of(w)
        if role is None or (msg.phase == MigrationPhase.WARMED and role != MigrationRole.JOINER):
            # a process with no such part (it holds the worker key, but tmd never asked it): counts for nothing
            self.channel.ignore(w, Event.UNEXPECTED_PHASE_REPORT, migration_id=m.id, state=m.state, phase=msg.phase,
                                rank=msg.rank, reason=f"it is no {role or 'party'} that reports {msg.phase} in "
                                f"migration {m.id}")
            return
        if not msg.ok:
            self.abort(m, f"{w.node}/{w.local_rank} (rank {msg.rank}) failed in {msg.phase}: {msg.error}")
            return
        acks = m.acks.setdefault(msg.phase, set())
        first = w.identity not in acks  # a resent report counts once (its bytes too)
        acks.add(w.identity)
        if msg.phase == MigrationPhase.WARMED and m.state == MigrationState.WARMING:
            m.shadow_steps.update({r: msg.shadow_steps for r, j in m.joiners.items() if j is w})  # its rank, not msg's
            if len(acks) == len(m.joiners):
                self._prepare(m)
        elif msg.phase == MigrationPhase.PREPARED and m.state == MigrationState.WARMING and \
                MigrationMark.PREPARE_STARTED in m.phases:
            m.rebuilt[f"{w.node}/{w.local_rank}"] = list(msg.groups)
            if len(acks) == len(m.parties()):
                self._enter(m, MigrationState.PREPARED, rebuilt=m.rebuilt)
                self._arm(m)
        elif msg.phase == MigrationPhase.ARMED and m.state == MigrationState.PREPARED:
            if msg.step >= (m.switch_step or 0):
                self.abort(m, f"rank {msg.rank} was already at step {msg.step} when switch step {m.switch_step} "
                              "was armed")
                return
            if len(acks) == len(m.parties()):
                self._enter(m, MigrationState.SWITCHING)
                self._decide_if_transferred(m)  # pre-copies may have been loaded before the last ack came
        elif msg.phase == MigrationPhase.SENT and m.state in (MigrationState.SWITCHING, MigrationState.TRANSFERRED):
            self._mark_transfer_start(m, msg.seconds)  # may trail the joiner's report
            self._journal_sent(m, msg)
        elif msg.phase == MigrationPhase.TRANSFERRED and m.state in (MigrationState.PREPARED,
                                                                    MigrationState.SWITCHING):
            m.bytes_moved += msg.bytes_moved if first else 0
            m.transfer_s = max(m.transfer_s, msg.seconds)
            self._mark_transfer_start(m, msg.seconds)
            self._decide_if_transferred(m)
        elif msg.phase == MigrationPhase.COMMITTED and m.state == MigrationState.TRANSFERRED:
            m.bytes_moved += msg.bytes_moved if first else 0  # a joiner's replayed gradients and tail
            if all(j.identity in acks for j in m.joiners.values()):
                self._commit(m)
        else:
            self.channel.ignore(w, Event.UNEXPECTED_PHASE_REPORT, migration_id=m.id, state=m.state, phase=msg.phase,
                                rank=msg.rank)

    def on_node_failed(self, node: str, reason: str) -> Optional[Adoption]:
        """Node ``node`` was declared failed: abort the running migration, if any. When ``node`` is one of its
        leaver nodes, phase 1 started and the commit was not decided yet, the joiners of its pair are warm for
        exactly its ranks: they are spared and returned for failure recovery to adopt; every other pair's
        standby comes back fresh. Otherwise returns None."""
        m = self.current
        if m is None:
            return None
        if node in m.sources and MigrationMark.PREPARE_STARTED in m.phases \
                and m.state != MigrationState.TRANSFERRED:
            target = m.targets[m.sources.index(node)]
            self.abort(m, f"leaver {node} lost: {reason}", spare=target)
            return Adoption(target, m.joiners_on(target))
        self.abort(m, f"node {node} lost during {m.state}: {reason}")
        return None

    def stranded_by(self, node: str) -> tuple[list[str], list[str]]:
        """(standby nodes, leaver nodes) that node ``node``'s loss strands: after the commit decision and before
        every joiner committed, the loss of a stayer's node leaves the joiners without a complete state (the
        leavers' step S - 1 fails with it, so their tail never comes, and a joiner is nobody's replica until it
        ran the switch step) and the leavers, which hold no rank any more, without a part. The standbys must fail
        with ``node`` (their ranks are recovered from replicas like its own) and the leavers be fenced. Empty
        lists otherwise."""
        m = self.current
        if m is None or m.state != MigrationState.TRANSFERRED or node in m.targets or node in m.sources:
            return [], []
        committed = m.acks.get(MigrationPhase.COMMITTED, set())
        targets = [t for t in m.targets if any(j.identity not in committed for j in m.joiners_on(t).values())]
        return targets, list(m.sources) if targets else []

    def on_worker_lost(self, w: Worker, why: str) -> None:
        """A process exited or stopped heartbeating: abort the migration it takes part in, if any."""
        m = self.current
        if m is None:
            return
        role = m.role_of(w)
        if role is None:
            return
        if w.done and role == MigrationRole.LEAVER:
            return  # a leaver leaving after the commit decision is the plan
        self.abort(m, f"{role} {w.node}/{w.local_rank} {why} during {m.state}")

    def tick(self, now_mono: float) -> None:
        """Abort the running migration if it is past its deadline (``now_mono``: time.monotonic()); start its
        held phase 1 once the previous migration's stayers passed its switch step (see :meth:`_prepare`)."""
        m = self.current
        if m is not None and m.overdue(now_mono):
            self.abort(m, f"timed out in state {m.state} after {m.deadline_s:.0f} s")
        self._release_prepare()

    def leaver_step(self, w: Worker, step: int) -> bool:
        """Whether ``w``'s report of ``step`` still counts for its rank although the rank passed to a joiner: a
        leaver's steps before the switch step (the commit is decided while it runs step S - 1)."""
        return any(m.switch_step is not None and step < m.switch_step and any(w is x for x in m.leavers.values())
                   and m.state in (MigrationState.TRANSFERRED, MigrationState.COMMITTED)
                   for m in self.all[-DOWNTIME_PENDING_MAX:])

    def on_step(self, rank: int, step: int) -> None:
        """Fill in the downtime of every committed migration whose window ends with ``rank``'s ``step``
        (back-to-back migrations each get their own; see :func:`downtime_s`). A window step whose time never came
        (its rank's process died before reporting it) is left out and journalled in ``missing_steps``."""
        for m in self.all[-DOWNTIME_PENDING_MAX:]:
            if m.state != MigrationState.COMMITTED or m.downtime_s is not None or not m.stayers:
                continue
            ref, S = min(m.stayers), m.switch_step
            if rank != ref or S is None or step < S + DOWNTIME_WINDOW_STEPS - 1:
                continue
            times = self.registry.step_times.get(ref, {})
            window = [times.get(s) for s in range(S, S + DOWNTIME_WINDOW_STEPS)]
            median = self.registry.median_step_s(ref, before=max(m.request_step, 2))
            if median is None:
                continue
            # ``ref`` reports its steps in order: one still missing now came from a process that died before its
            # report left (a failure inside the window) and never comes. The downtime covers the steps that did.
            missing = [S + i for i, t in enumerate(window) if t is None]
            present = [t for t in window if t is not None]
            m.downtime_s = downtime_s(present, median)
            m.median_step_s = round(median, 6)
            extra = {"missing_steps": missing} if missing else {}
            self.journal.record(Event.MIGRATION_DOWNTIME, migration_id=m.id, downtime_s=m.downtime_s,
                                median_step_s=median, window_s=[None if t is None else round(t, 6) for t in window],
                                pause_s=m.pause_s, joiner_lag_s=m.joiner_lag_s, **extra)

    # ---------------------------------------------------------------------------------------------------------
    def abort(self, m: Migration, reason: str, spare: Optional[str] = None) -> None:
        """Abort ``m`` as a whole: stayers and leavers keep their groups. The joiners of every pair are told too
        (they exit and each standby is restarted fresh), except those of standby ``spare``: failure recovery
        then takes them over. After the commit decision (state ``transferred``) nothing aborts: ``m`` commits
        with ``reason`` journalled as ``lost`` (the parties may be past the switch step already; a lost joiner
        is its node's failure, which failure recovery repairs)."""
        if m.finished:
            return
        if m.state == MigrationState.TRANSFERRED:
            m.lost = reason
            self._commit(m)
            return
        m.reason = reason
        self._enter(m, MigrationState.ABORTED, reason=reason)
        decision = p.Decide(migration_id=m.id, commit=False, reason=reason)
        for w in m.parties():
            if not w.exited and not (w.node == spare and m.role_of(w) == MigrationRole.JOINER):
                self.channel.send(w, decision)
        for name in m.targets:
            target = self.registry.nodes[name]
            if target.role == NodeRole.JOINING and name != spare:
                self.registry.back_to_standby(target)  # its processes exit; the launcher brings fresh ones up

    @staticmethod
    def _mark_transfer_start(m: Migration, seconds: float) -> None:
        """The transfer began ``seconds`` before now by one party's clock; keep the earliest report."""
        start = time.time() - seconds
        m.mark(MigrationMark.TRANSFER_STARTED, min(m.phases.get(MigrationMark.TRANSFER_STARTED, start), start))

    def _prepare(self, m: Migration) -> None:
        """Every joiner is warm: start phase 1 (every party builds the next generation of the groups that
        contain a leaver; leavers and joiners also their 2-rank transfer group). Held while a stayer of the
        previous migration may not have reached that one's switch step yet (:meth:`_unswitched`): a migration
        commits once its joiners run step S, and a stayer a few ms behind would take the next Prepare's role,
        groups and cleared decision for its own switch step (it would hang there, the job with it). Phase 1
        then starts on that stayer's ``committed`` report, or at the tick after its report of step S."""
        waiting = self._unswitched()
        if waiting:
            if not m.prepare_held:
                m.mark(MigrationMark.PREPARE_HELD)
                self.journal.record(Event.MIGRATION_PHASE, migration_id=m.id, phase=MigrationMark.PREPARE_HELD,
                                    waiting_for=sorted(f"{w.node}/{w.local_rank}" for w in waiting),
                                    previous=self.all[-2].id, previous_switch_step=self.all[-2].switch_step)
            return
        m.mark(MigrationMark.PREPARE_STARTED)
        self.journal.record(Event.MIGRATION_PHASE, migration_id=m.id, phase=MigrationMark.PREPARE_STARTED)
        leaver_ranks = sorted(m.leavers)
        for role, group in ((MigrationRole.STAYER, m.stayers), (MigrationRole.LEAVER, m.leavers),
                            (MigrationRole.JOINER, m.joiners)):
            for rank, w in group.items():
                prefix = p.layout.transfer_prefix(m.generation, rank) if role != MigrationRole.STAYER else ""
                self.channel.send(w, p.Prepare(migration_id=m.id, generation=m.generation, role=role,
                                               leaver_ranks=leaver_ranks, transfer_prefix=prefix))
        m.set_deadline(self.deadlines_s[MigrationState.PREPARED])

    def _unswitched(self) -> list[Worker]:
        """The live stayers of the migration before the current one, if it committed, that have not reported
        passing its switch step S: no ``committed`` report (a stayer with groups to swap sends one at S) and no
        step report of S or later (every stayer's, once it ran S). An earlier one was settled before its
        successor's phase 1 started."""
        before = self.all[-2] if len(self.all) >= 2 else None
        if before is None or before.state != MigrationState.COMMITTED or before.switch_step is None:
            return []
        return [w for w in before.stayers.values() if not w.exited and w.identity not in before.switched
                and w.step <= before.switch_step]

    def _release_prepare(self) -> None:
        """Start the current migration's held phase 1 if nothing holds it any more."""
        m = self.current
        if m is not None and m.prepare_held and m.state == MigrationState.WARMING:
            self._prepare(m)

    def _arm(self, m: Migration) -> None:
        """Pick the switch step: far enough ahead that every party hears of it before reaching it."""
        step = self.registry.current_step()
        median = self.registry.median_step_s(min(m.stayers or m.leavers)) or 1.0
        margin = 2 + math.ceil(self.switch_slack_s / max(median, 1e-3))
        m.switch_step = step + margin
        self.journal.record(Event.SWITCH_STEP_CHOSEN, migration_id=m.id, switch_step=m.switch_step, current_step=step)
        self._broadcast(m, p.Switch(migration_id=m.id, step=m.switch_step))

    def _decide_if_transferred(self, m: Migration) -> None:
        """Once every party armed S (state ``switching``) and every joiner reported ``transferred``: decide the
        commit. The leavers' ranks pass to the standbys now (the point of no return, see the module docstring);
        every party is told, and from here on a leaver exiting is the plan, whether or not its Done arrives."""
        if m.state != MigrationState.SWITCHING or \
                not all(j.identity in m.acks.get(MigrationPhase.TRANSFERRED, ()) for j in m.joiners.values()):
            return
        self._enter(m, MigrationState.TRANSFERRED)
        reg = self.registry
        for source, target in m.pairs():
            reg.hand_over(reg.nodes[source], reg.nodes[target], m.joiners_on(target),
                          f"ranks handed over to {target} in migration {m.id}")
        self._broadcast(m, p.Decide(migration_id=m.id, commit=True, reason="transferred"))
        for leaver in m.leavers.values():
            leaver.done = True

    def _journal_sent(self, m: Migration, msg: p.PhaseDone) -> None:
        self.journal.record(Event.MIGRATION_SENT, migration_id=m.id, rank=msg.rank, bytes_moved=msg.bytes_moved,
                            seconds=msg.seconds, precopy_step=msg.precopy_step, kept_tensors=msg.kept_tensors)

    def _commit(self, m: Migration) -> None:
        extra = {"lost": m.lost} if m.lost else {}
        self._enter(m, MigrationState.COMMITTED, switch_step=m.switch_step, bytes_moved=m.bytes_moved,
                    phases_s=m.phases_s(), shadow_steps={str(r): n for r, n in sorted(m.shadow_steps.items())},
                    **extra)

    @staticmethod
    def _note_ready(m: Migration, w: Worker, ready_unix_s: float) -> None:
        """Keep when stayer or joiner ``w`` was ready to run the switch step; once both kinds reported, the
        joiners' lag behind the stayers (seconds, >= 0): how long the stayers' first collective of S waits for
        the last joiner beyond their own pause. Same host: one clock; across hosts it includes their skew."""
        if ready_unix_s <= 0:
            return
        m.ready_unix_s[w.identity] = ready_unix_s
        joiners = [m.ready_unix_s[j.identity] for j in m.joiners.values() if j.identity in m.ready_unix_s]
        stayers = [m.ready_unix_s[x.identity] for x in m.stayers.values() if x.identity in m.ready_unix_s]
        if joiners and stayers:
            m.joiner_lag_s = round(max(0.0, max(joiners) - max(stayers)), 6)

    def _enter(self, m: Migration, state: MigrationState, **fields) -> None:
        """Move ``m`` to ``state``: mark it, reset that phase's acks, set the state's deadline, journal it."""
        m.state = state
        m.mark(state)
        m.acks.pop(state, None)
        m.set_deadline(self.deadlines_s.get(state, math.inf))
        self.journal.record(MIGRATION_EVENTS[state], migration_id=m.id, sources=m.sources, targets=m.targets,
                            **fields)

    def _broadcast(self, m: Migration, msg: p.Message) -> None:
        for w in m.parties():
            if not w.exited:
                self.channel.send(w, msg)

"""Guards: standbys warmed *before* a failure, each as one active node's ranks.

A general standby promoted after a failure must first run the training script's set-up and one or two shadow
iterations (TrainMover, arXiv 2412.12636, section 5: the sandboxed warm-up); on the demo GPT that is ~2 s of the
failure's critical path, most of the downtime. A **guard** does that work in advance: tmd assigns a warm standby
node the ranks of one active node (``Assign(guard=True)``); its processes run their shadow iterations in the sandbox
(replaying those ranks' recordings), report ``warmed`` and wait. If that node fails, the recovery *adopts* the
guard as its replacements (:class:`tmd.recovery.Adoption`, the path a migration's warm joiners take when their
leaver dies): only the state transfer and the group rebuild remain. A guard costs the standby node the memory of
one rank (the standby node is idle otherwise) and nothing on the active nodes.

The policy (``tmd local --guards N`` / ``tmd slurm --guards N``; 0, the default, turns guards off):

- **When**: while the job trains with no migration or incident running, once every rank is assigned and the
  recordings the guards replay exist; never after the job finished.
- **How many**: up to N standby nodes guard at once; the others stay general standbys.
- **Which node**: a node under suspicion first (health not ``healthy``, or flagged by tmd.evacuation: a GPU verdict
  or a straggler), then the others in the registry's order; one guard per node. When a node comes under suspicion
  with no guard while every guard is placed, a guard of a node not under suspicion is released: it comes back
  fresh and then guards the suspect.
- **Adopted**: when the node holding exactly a guard's ranks fails (:meth:`Guards.adopt`). A guard still warming
  is adopted too: it finishes its shadow iterations first.
- **Released** (its processes exit and come back fresh as a general standby: ~the import time of torch): when a
  failure finds no warm general standby (:meth:`Guards.free_one`: the recovery then waits for the fresh one,
  a few seconds more than with a general standby), when no active node holds its ranks any more, when one of its
  processes exits (after ``GIVE_UP_AFTER`` such deaths those ranks get no guard any more), and at the job's end.
- **Migrated to**: ``tmctl migrate --from NODE --to GUARD`` where GUARD is NODE's warm guard starts phase 1 at once
  (tmd.migration: its joiners skip the warm-up); any other guard is ``busy_standby``.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Callable, Optional

from tmd import protocol as p
from tmd.channel import WorkerChannel
from tmd.journal import Journal
from tmd.protocol.layout import RunDir
from tmd.protocol.vocab import Event, ExitCode, Health, NodeRole
from tmd.registry import Node, Registry, Worker

GIVE_UP_AFTER = 2  # guards of the same ranks that died before those ranks stop getting one


def guard_of(registry: Registry, node: Node) -> Optional[Node]:
    """The guard warm (or warming) for exactly ``node``'s ranks, or None."""
    return next((g for g in registry.nodes_in(NodeRole.GUARDING) if g.guards and g.guards == sorted(node.ranks)),
                None)


def warm_guard(node: Node) -> bool:
    """Whether ``node`` is a warm guard: every process of it registered, alive and done with its shadow
    iterations for the rank it was given."""
    return node.role == NodeRole.GUARDING and len(node.workers) == node.expected_workers and \
        all(not w.exited and w.rank is not None and w.warm_for == w.rank for w in node.workers.values())


@dataclasses.dataclass(frozen=True)
class Adoption:
    """Warm joiners a recovery takes as replacements for a failed node's ranks: ``standby`` (their node) and
    ``joiners`` (rank -> process). ``warm``: their shadow iterations are done (a guard still warming reports
    ``warmed`` later)."""

    standby: str
    joiners: dict[int, Worker]
    warm: bool = True


class Guards:
    """Places, tracks and releases guards (see the module docstring). ``count``: how many standby nodes may guard
    at once (0: off). ``suspects``: names of nodes under suspicion (tmd.evacuation's flags), guarded first."""

    def __init__(self, registry: Registry, journal: Journal, channel: WorkerChannel, run_dir: RunDir, count: int,
                 record_steps: int, suspects: Callable[[], set[str]] = set) -> None:
        self.registry = registry
        self.journal = journal
        self.channel = channel
        self.run_dir = run_dir
        self.count = count
        self.record_steps = record_steps
        self.suspects = suspects
        self._assigned_at: dict[str, float] = {}  # guarding node -> when it was assigned (epoch s)
        self.lost_guards: dict[tuple[int, ...], int] = {}  # ranks -> guards of them that died (GIVE_UP_AFTER: no more)

    def guarding(self) -> list[Node]:
        return self.registry.nodes_in(NodeRole.GUARDING)

    def tick(self, busy: bool, now_s: float) -> None:
        """Release guards whose ranks no active node holds; then, unless ``busy`` (a migration or incident runs,
        or the job is ending), guard unguarded nodes with warm standbys, up to ``count``. ``now_s``: epoch
        seconds."""
        if self.count <= 0:
            return
        reg = self.registry
        held = {tuple(n.ranks) for n in reg.nodes_in(NodeRole.ACTIVE)}
        if not busy:
            for g in self.guarding():
                if tuple(g.guards) not in held:
                    self.release(g, f"no active node holds ranks {g.guards} any more")
        if busy or not reg.all_ranks_assigned() or reg.current_step() <= self.record_steps:
            return
        while len(self.guarding()) < self.count:
            standby = next(iter(reg.warm_standbys()), None)
            node = self._pick(standby) if standby is not None else None
            if node is None:
                break
            self._assign(standby, node, now_s)
        self._make_room_for_suspects()

    def _make_room_for_suspects(self) -> None:
        """If a node under suspicion has no guard while some guard watches a node that is not, release that guard
        (it comes back fresh and then guards the suspect)."""
        if any(g.health != Health.HEALTHY for g in self.registry.nodes_in(NodeRole.STANDBY)):
            return  # a guard released earlier is still coming back
        suspects = self._suspect_nodes()
        guarded = {tuple(g.guards) for g in self.guarding()}
        unguarded = [n for n in suspects if tuple(n.ranks) not in guarded
                     and self.lost_guards.get(tuple(n.ranks), 0) < GIVE_UP_AFTER]
        if not unguarded:
            return
        suspect_ranks = {tuple(n.ranks) for n in suspects}
        idle = next((g for g in self.guarding() if tuple(g.guards) not in suspect_ranks), None)
        if idle is not None:
            self.release(idle, f"node {unguarded[0].name} is under suspicion and has no guard")

    def _suspect_nodes(self) -> list[Node]:
        """The active nodes under suspicion: not healthy, or named by ``suspects``."""
        names = self.suspects()
        return [n for n in self.registry.nodes_in(NodeRole.ACTIVE)
                if n.ranks and (n.health != Health.HEALTHY or n.name in names)]

    def _pick(self, standby: Node) -> Optional[Node]:
        """The active node ``standby`` should guard: suspects first, then registry order; None when every node
        that fits is guarded (or its recordings are not written yet)."""
        guarded = {tuple(g.guards) for g in self.guarding()}
        suspects = {n.name for n in self._suspect_nodes()}
        fits = [n for n in self.registry.nodes_in(NodeRole.ACTIVE)
                if n.ranks and tuple(n.ranks) not in guarded and len(n.ranks) == standby.expected_workers
                and self.lost_guards.get(tuple(n.ranks), 0) < GIVE_UP_AFTER
                and all(os.path.exists(self.run_dir.recording(r)) for r in n.ranks)]
        fits.sort(key=lambda n: n.name not in suspects)  # stable: registry order otherwise
        return fits[0] if fits else None

    def _assign(self, standby: Node, node: Node, now_s: float) -> None:
        self.registry.guard(standby, list(node.ranks))
        self._assigned_at[standby.name] = now_s
        self.journal.record(Event.GUARD_ASSIGNED, standby=standby.name, node=node.name, ranks=standby.guards,
                            suspect=node.name in {n.name for n in self._suspect_nodes()})
        workers = [standby.workers[i] for i in sorted(standby.workers)]
        for rank, w in zip(standby.guards, workers):
            w.rank, w.warm_for = rank, None
            self.channel.assign(w, rank, guard=True)

    def on_warmed(self, w: Worker, msg: p.RecoveryReport, now_s: float) -> bool:
        """A guard process finished its shadow iterations (a RecoveryReport ``warmed`` of incident 0). Returns
        False when ``w`` is not a process of a guard warming as ``msg.rank`` (the caller hands the report on)."""
        node = self.registry.nodes.get(w.node)
        if node is None or node.role != NodeRole.GUARDING or w.rank != msg.rank or msg.incident_id != 0:
            return False
        was_warm, w.warm_for = warm_guard(node), msg.rank
        if warm_guard(node) and not was_warm:
            self.journal.record(Event.GUARD_WARMED, standby=node.name, ranks=node.guards, shadow_steps=msg.shadow_steps,
                                warm_up_s=round(now_s - self._assigned_at.get(node.name, now_s), 3))
        return True

    def adopt(self, failed: Node) -> Optional[Adoption]:
        """Node ``failed`` (still holding its ranks) is lost: the guard warm for exactly its ranks is promoted and
        returned as the recovery's replacements, or None when it has none (or an unhealthy one: it is released)."""
        guard = guard_of(self.registry, failed)
        if guard is None:
            return None
        if guard.health != Health.HEALTHY:  # silent (hung, cut off): a general standby is the safer bet
            self.release(guard, f"{failed.name} failed while its guard was {guard.health}: {guard.reason}")
            return None
        warm = warm_guard(guard)
        joiners = {w.rank: w for w in guard.workers.values() if w.rank is not None}
        self.registry.promote(guard)
        return Adoption(guard.name, joiners, warm)

    def free_one(self, why: str) -> bool:
        """A failure found no warm general standby: release one guard so that it comes back as one: first a
        guard of ranks no active node holds (of no use now), then one of a node not under suspicion, in registry
        order. Returns False when there is none."""
        guards = self.guarding()
        if not guards:
            return False
        held = {tuple(n.ranks) for n in self.registry.nodes_in(NodeRole.ACTIVE)}
        suspect_ranks = {tuple(n.ranks) for n in self._suspect_nodes()}
        guards.sort(key=lambda g: (tuple(g.guards) in held, tuple(g.guards) in suspect_ranks))
        self.release(guards[0], why)
        return True

    def lost(self, node: Node, why: str) -> None:
        """A process of guard ``node`` exited (or its script failed in the sandbox): release the rest of it. After
        GIVE_UP_AFTER such losses for the same ranks, those ranks get no guard any more (a script that cannot
        run their shadow iterations would otherwise restart guards forever)."""
        if node.role != NodeRole.GUARDING:
            return
        ranks = tuple(node.guards)
        self.lost_guards[ranks] = self.lost_guards.get(ranks, 0) + 1
        gave_up = self.lost_guards[ranks] >= GIVE_UP_AFTER
        self.release(node, why + (f"; ranks {list(ranks)} get no guard any more" if gave_up else ""))

    def release(self, node: Node, why: str) -> None:
        """Let guard ``node`` go: its processes exit (a Release with exit code 0) and fresh standby processes come
        up (tmd restarts a standby left without processes)."""
        if node.role != NodeRole.GUARDING:
            return
        self.journal.record(Event.GUARD_RELEASED, standby=node.name, ranks=node.guards, reason=why)
        self.registry.back_to_standby(node)
        for w in node.workers.values():
            w.rank = w.warm_for = None
            if not w.exited:
                self.channel.send(w, p.Release(reason=f"guard released: {why}", exit_code=ExitCode.OK))

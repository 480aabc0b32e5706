"""What tmd knows about the job: nodes, their worker processes, rank ownership, step progress and generations.

A node's role (:class:`~tmd.protocol.vocab.NodeRole`) is ``active`` (holds ranks), ``standby`` (warm spare, no
ranks), ``guarding`` (a standby warmed as an active node's ranks, tmd.guards), ``joining`` (a standby taking over
ranks), ``left`` (a leaver that handed its ranks over), or ``failed``.
Ranks are node-major at job start: node i of the layout holds ranks ``i*ranks_per_node ... (i+1)*ranks_per_node -
1``. A role changes only through the Registry's transitions::

    standby --promote--> joining --hand_over / take_over--> active
    standby --guard--> guarding --promote--> joining   (a guarded node failed: the guard is adopted)
    joining | guarding --back_to_standby--> standby    (a migration aborted, a guard released: fresh processes)
    active | joining | guarding | standby --fail_node--> failed
    active --hand_over--> left                  (the leaver of a committed migration)
    left | failed --revive--> standby           (SLURM: a new standby job on a node handed back, fit again)

:class:`Generations` is the job's one counter of process-group generations, shared by migrations and recoveries.
"""
from __future__ import annotations

import collections
import dataclasses
import statistics
import time
from typing import Callable, Iterable, Optional, Union

from tmd.protocol.vocab import Health, NodeRole


@dataclasses.dataclass
class Worker:
    identity: bytes
    node: str
    local_rank: int
    pid: int
    host: str
    rank: Optional[int] = None
    last_heartbeat: float = 0.0  # time.monotonic() of the last message
    step: int = -1
    step_time_s: Optional[float] = None
    counters: dict = dataclasses.field(default_factory=dict)
    done: bool = False  # its rank's work is over (its Done came, or, for a leaver, the commit was decided)
    done_journalled: bool = False  # its Done is in the journal (a resent copy is acknowledged, not journalled)
    exited: bool = False
    fenced: bool = False  # its node was declared failed: it must not take part again
    fenced_on_exit: bool = False  # fenced because its node's processes exited (not silent or stopped)
    fence_sent: bool = False
    warm_for: Optional[int] = None  # a replacement's rank once its shadow iterations are done
    iface: str = ""  # the network interface its data plane uses (tmd.netif; "": unknown)
    data_host: str = ""  # the address its data plane binds and advertises ("": unknown)


@dataclasses.dataclass
class Node:
    name: str
    role: NodeRole
    ranks: list[int]
    expected_workers: int
    workers: dict[int, Worker] = dataclasses.field(default_factory=dict)  # local_rank -> worker
    health: Health = Health.UNKNOWN
    reason: str = ""
    guards: list[int] = dataclasses.field(default_factory=list)  # a guarding node: the ranks it is warm for

    @property
    def warm(self) -> bool:
        """A standby is warm when all its processes are registered, alive and heartbeating."""
        return (
            self.role == NodeRole.STANDBY
            and self.health == Health.HEALTHY
            and len(self.workers) == self.expected_workers
            and not any(w.exited for w in self.workers.values())
        )


class Generations:
    """The job's process-group generation counter: every migration and recovery builds its groups under a new
    generation (store prefixes ``tm/g<generation>/...``, tmd.protocol.layout), never a reused one. Generation 0
    is the job's first set of groups."""

    def __init__(self, current: int = 0) -> None:
        self.current = current

    def next(self) -> int:
        """Take a fresh generation (the previous highest + 1)."""
        self.current += 1
        return self.current

    def restore(self, highest: int) -> None:
        """A restarted tmd goes on after the highest generation the journal shows (``tmd resume``)."""
        self.current = max(self.current, highest)


class Registry:
    def __init__(self, nodes: list[str], ranks_per_node: int, standbys: list[str]) -> None:
        self.ranks_per_node = ranks_per_node
        self.world_size = len(nodes) * ranks_per_node
        self.nodes: dict[str, Node] = {}
        for i, name in enumerate(nodes):
            ranks = list(range(i * ranks_per_node, (i + 1) * ranks_per_node))
            self.nodes[name] = Node(name, NodeRole.ACTIVE, ranks, ranks_per_node)
        for name in standbys:
            self.nodes[name] = Node(name, NodeRole.STANDBY, [], ranks_per_node)
        self.generations = Generations()
        self.by_identity: dict[bytes, Worker] = {}
        self.rank_owner: dict[int, Worker] = {}
        # Completed (non-shadow) step times per rank: step -> seconds; bounded.
        self.step_times: dict[int, collections.OrderedDict[int, float]] = collections.defaultdict(
            collections.OrderedDict
        )
        # Why a standby node must not be picked now, or None (SLURM mode: the scheduler drains it, tmd.slurm).
        self.unusable: Callable[[str], Optional[str]] = lambda name: None

    # ---------------------------------------------------------------------------------------------------------
    def add_node(self, name: str) -> Node:
        """Add a standby node learned at run time (SLURM mode: a node of a standby job; ``tmctl standby add``)
        with ``ranks_per_node`` process slots: the world size never changes. Raises ValueError for a name
        already known."""
        if name in self.nodes:
            raise ValueError(f"node '{name}' is already part of this job (it is {self.nodes[name].role})")
        node = self.nodes[name] = Node(name, NodeRole.STANDBY, [], self.ranks_per_node)
        return node

    def add_worker(self, w: Worker) -> Node:
        """Register a worker process on its node. Raises KeyError for an unknown node and ValueError for a node
        that left the job or failed, or a local rank out of range or already taken by a live process."""
        node = self.nodes[w.node]
        if node.role in (NodeRole.LEFT, NodeRole.FAILED):
            raise ValueError(f"node {node.name} {'left the job' if node.role == NodeRole.LEFT else 'failed'}: "
                             "it takes no new process")
        if not 0 <= w.local_rank < node.expected_workers:
            raise ValueError(f"local rank {w.local_rank} out of range for node {node.name}")
        old = node.workers.get(w.local_rank)
        if old is not None and not old.exited:
            raise ValueError(f"{node.name}/{w.local_rank} is already registered (pid {old.pid})")
        w.last_heartbeat = time.monotonic()
        node.workers[w.local_rank] = w
        self.by_identity[w.identity] = w
        if node.role == NodeRole.ACTIVE:
            w.rank = node.ranks[w.local_rank]
            self.rank_owner[w.rank] = w
        if len(node.workers) == node.expected_workers:
            node.health = Health.HEALTHY
        return node

    def node_of(self, w: Worker) -> Node:
        return self.nodes[w.node]

    def active_workers(self) -> list[Worker]:
        return [self.rank_owner[r] for r in sorted(self.rank_owner)]

    def all_ranks_assigned(self) -> bool:
        return len(self.rank_owner) == self.world_size

    def record_step(self, rank: int, step: int, step_time_s: float) -> None:
        times = self.step_times[rank]
        times[step] = step_time_s
        while len(times) > 10_000:
            times.popitem(last=False)

    def median_step_s(self, rank: int, before: Optional[int] = None, skip_first: int = 1) -> Optional[float]:
        """Median step time of ``rank`` over steps ``skip_first <= step < before`` (seconds), or None."""
        values = [t for s, t in self.step_times.get(rank, {}).items() if s >= skip_first and (before is None or s < before)]
        return statistics.median(values) if values else None

    def current_step(self) -> int:
        """The highest step any active rank reported starting (-1 before the first)."""
        return max((w.step for w in self.rank_owner.values()), default=-1)

    def nodes_in(self, *roles: NodeRole) -> list[Node]:
        """The nodes whose role is one of ``roles``, in registration order."""
        return [n for n in self.nodes.values() if n.role in roles]

    def warm_standbys(self, exclude: Iterable[str] = ()) -> list[Node]:
        """The warm standby nodes that may take ranks now, in registration order: not in ``exclude`` (those
        already chosen for the same migration or incident), not :attr:`unusable`. Every choice of a standby
        (migrate ``any``, drains, evacuations, recoveries, guards) picks from this list, so none picks one twice."""
        skip = set(exclude)
        return [n for n in self.nodes.values()
                if n.role == NodeRole.STANDBY and n.warm and n.name not in skip and self.unusable(n.name) is None]

    # --- role transitions: the only places a node's role changes ------------------------------------------------
    def promote(self, node: Node) -> None:
        """A standby starts taking over ranks (a migration's joiners, or a failure's replacements), or a guard is
        adopted by the recovery of the node it guards. Raises ValueError unless ``node`` is a standby or a
        guard."""
        self._expect(node, (NodeRole.STANDBY, NodeRole.GUARDING), "promote")
        node.role, node.guards = NodeRole.JOINING, []

    def guard(self, node: Node, ranks: list[int]) -> None:
        """Standby ``node`` starts warming as ``ranks`` (an active node's, tmd.guards). Raises ValueError unless
        it is a standby, or when ``ranks`` does not fit its processes."""
        self._expect(node, NodeRole.STANDBY, "guard with")
        if len(ranks) != node.expected_workers:
            raise ValueError(f"standby '{node.name}' has {node.expected_workers} processes: it cannot guard "
                             f"{len(ranks)} ranks")
        node.role, node.guards = NodeRole.GUARDING, sorted(ranks)

    def back_to_standby(self, node: Node) -> None:
        """A promoted standby is not needed after all (its migration aborted) or a guard is let go: its
        processes exit and fresh standby processes come up, so its health is unknown until they register."""
        self._expect(node, (NodeRole.JOINING, NodeRole.GUARDING), "return to standby")
        node.role, node.health, node.guards = NodeRole.STANDBY, Health.UNKNOWN, []

    def hand_over(self, source: Node, target: Node, joiners: dict[int, Worker], reason: str) -> None:
        """A committed migration: ``target`` (joining) takes ``source``'s ranks, each owned by its joiner process
        from now on; ``source`` has left. Raises ValueError on nodes in the wrong roles."""
        self._expect(source, NodeRole.ACTIVE, "hand over from")
        self._expect(target, NodeRole.JOINING, "hand over to")
        for rank, joiner in joiners.items():
            joiner.rank = rank
            self.rank_owner[rank] = joiner
        target.role, target.ranks = NodeRole.ACTIVE, list(source.ranks)
        source.role, source.ranks = NodeRole.LEFT, []
        source.health, source.reason = Health.UNKNOWN, reason

    def take_over(self, target: Node, replacements: dict[int, Worker]) -> None:
        """A finished recovery: ``target`` (joining) holds the lost ranks its processes replaced."""
        self._expect(target, NodeRole.JOINING, "take over with")
        for rank, w in replacements.items():
            w.rank = rank
            self.rank_owner[rank] = w
        target.role = NodeRole.ACTIVE
        target.ranks = sorted(w.rank for w in target.workers.values() if w.rank is not None)

    def fail_node(self, node: Node, reason: str) -> list[int]:
        """``node`` is declared failed (lost, hung, cut off, or its standby job ended): it holds no rank any
        more and no process of it may take part again. Returns the ranks it held (now unowned)."""
        lost = list(node.ranks)
        for rank in lost:
            self.rank_owner.pop(rank, None)
        node.ranks, node.guards = [], []
        node.role, node.health, node.reason = NodeRole.FAILED, Health.UNHEALTHY, reason
        return lost

    def revive(self, node: Node) -> None:
        """A node that left the job or failed comes back as a fresh standby with no process (SLURM mode: a new
        standby job landed on it once SLURM had it back, fit). Its old processes are gone: their slots are free.
        Raises ValueError for a node in another role."""
        self._expect(node, (NodeRole.LEFT, NodeRole.FAILED), "revive")
        node.role, node.health, node.reason, node.ranks, node.guards = NodeRole.STANDBY, Health.UNKNOWN, "", [], []
        node.workers.clear()

    def restore(self, node: Node, role: NodeRole, ranks: list[int], reason: str = "") -> None:
        """``tmd resume``: set a node to the role the journal shows it had when the old tmd died."""
        node.role, node.ranks = role, list(ranks)
        if role == NodeRole.FAILED:
            node.health = Health.UNHEALTHY
        if reason:
            node.reason = reason

    @staticmethod
    def _expect(node: Node, role: Union[NodeRole, tuple[NodeRole, ...]], what: str) -> None:
        roles = role if isinstance(role, tuple) else (role,)
        if node.role not in roles:
            raise ValueError(f"cannot {what} node '{node.name}': it is {node.role}, not "
                             f"{' or '.join(r.value for r in roles)}")

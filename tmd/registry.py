"""What tmd knows about the job: nodes, their worker processes, rank ownership and step progress.

A node is ``active`` (holds ranks), ``standby`` (warm spare, no ranks), ``joining`` (a standby taking over a
leaver's ranks), ``left`` (a leaver that handed its ranks over), or ``failed``. Ranks are node-major at job start:
node i of the layout holds ranks ``i*ranks_per_node ... (i+1)*ranks_per_node - 1``.
"""
from __future__ import annotations

import collections
import dataclasses
import statistics
import time
from typing import Optional


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
    done: bool = False
    exited: bool = False
    fenced: bool = False  # its node was declared failed: it must not take part again
    fence_sent: bool = False
    warm_for: Optional[int] = None  # a replacement's rank once its shadow iterations are done


@dataclasses.dataclass
class Node:
    name: str
    role: str  # active | standby | joining | left | failed
    ranks: list[int]
    expected_workers: int
    workers: dict[int, Worker] = dataclasses.field(default_factory=dict)  # local_rank -> worker
    health: str = "unknown"  # unknown | healthy | unhealthy
    reason: str = ""
    suspect_cpu: Optional[tuple[float, float]] = None  # (monotonic s, CPU s) when it was first seen silent

    @property
    def warm(self) -> bool:
        """A standby is warm when all its processes are registered, alive and heartbeating."""
        return (
            self.role == "standby"
            and self.health == "healthy"
            and len(self.workers) == self.expected_workers
            and not any(w.exited for w in self.workers.values())
        )


class Registry:
    def __init__(self, nodes: list[str], ranks_per_node: int, standbys: list[str]) -> None:
        self.ranks_per_node = ranks_per_node
        self.world_size = len(nodes) * ranks_per_node
        self.nodes: dict[str, Node] = {}
        for i, name in enumerate(nodes):
            ranks = list(range(i * ranks_per_node, (i + 1) * ranks_per_node))
            self.nodes[name] = Node(name, "active", ranks, ranks_per_node)
        for name in standbys:
            self.nodes[name] = Node(name, "standby", [], ranks_per_node)
        self.by_identity: dict[bytes, Worker] = {}
        self.rank_owner: dict[int, Worker] = {}
        # Completed (non-shadow) step times per rank: step -> seconds; bounded.
        self.step_times: dict[int, collections.OrderedDict[int, float]] = collections.defaultdict(
            collections.OrderedDict
        )

    # ---------------------------------------------------------------------------------------------------------
    def add_node(self, name: str, role: str = "standby") -> Node:
        """Add a node learned at run time (SLURM mode: a node of a standby job) with ``ranks_per_node`` process
        slots. Only ``standby`` nodes can be added: the world size never changes. Raises ValueError for another
        role or a name already known."""
        if role != "standby":
            raise ValueError(f"only standby nodes can be added at run time, not {role!r}")
        if name in self.nodes:
            raise ValueError(f"node '{name}' is already part of this job (it is {self.nodes[name].role})")
        node = self.nodes[name] = Node(name, role, [], self.ranks_per_node)
        return node

    def add_worker(self, w: Worker) -> Node:
        """Register a worker process on its node. Raises KeyError for an unknown node and ValueError for a
        local rank out of range or already taken by a live process."""
        node = self.nodes[w.node]
        if not 0 <= w.local_rank < node.expected_workers:
            raise ValueError(f"local rank {w.local_rank} out of range for node {node.name}")
        old = node.workers.get(w.local_rank)
        if old is not None and not old.exited:
            raise ValueError(f"{node.name}/{w.local_rank} is already registered (pid {old.pid})")
        w.last_heartbeat = time.monotonic()
        node.workers[w.local_rank] = w
        self.by_identity[w.identity] = w
        if node.role == "active":
            w.rank = node.ranks[w.local_rank]
            self.rank_owner[w.rank] = w
        if len(node.workers) == node.expected_workers:
            node.health = "healthy"
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

    def reassign(self, rank: int, joiner: Worker) -> None:
        """After a committed migration: ``joiner`` now owns ``rank``."""
        joiner.rank = rank
        self.rank_owner[rank] = joiner

"""What ``tmctl status`` shows: the job's :class:`~tmd.protocol.StatusReply`, built from tmd's state.

One dict per node (name, role, ranks, health and its reason, live processes, heartbeat age, step, step time,
warm, straggler ranks, ``pids``: local rank (a string) -> pid of each live process, ``iface`` and ``address``: the
network interface and address its data plane uses (tmd.netif; None before a process registered); SLURM mode adds
the node's SLURM state), the latest migration and the latest failure recovery (their ``to_dict()``), the job's
generation and step, why it failed (``failure``), the misuse its ranks reported (``warnings``) and the job's
settings (``config``: tmd.config.JobConfig.to_dict()).
"""
from __future__ import annotations

import time
from typing import Callable, Optional

from tmd import protocol as p
from tmd.episode import Episode
from tmd.guards import warm_guard
from tmd.registry import Node, Registry


def node_status(n: Node, now: float, stragglers: list[int]) -> dict:
    """Node ``n`` as status shows it; ``now``: time.monotonic(); ``stragglers``: its straggler ranks. Ages and
    times in seconds (None when no live process reported one)."""
    workers = [w for w in n.workers.values() if not w.exited]
    ages = [now - w.last_heartbeat for w in workers]
    steps = [w.step for w in workers]
    times = [w.step_time_s for w in workers if w.step_time_s is not None]
    return {
        "name": n.name, "role": n.role, "ranks": n.ranks, "health": n.health, "reason": n.reason,
        "processes": len(workers), "expected_processes": n.expected_workers,
        "heartbeat_age_s": round(max(ages), 3) if ages else None,
        "step": max(steps) if steps else None,
        "step_time_s": round(max(times), 6) if times else None,
        # a guard (tmd.guards) is warm once every process of it finished its shadow iterations
        "warm": n.warm or warm_guard(n),
        "guards": list(n.guards),  # a guarding node: the ranks it is warm for
        "stragglers": stragglers,
        "pids": {str(w.local_rank): w.pid for w in workers},
        # the network its data plane uses (tmd.netif): the interface and the address of its first live process
        "iface": next((w.iface for w in workers if w.iface), None),
        "address": next((w.data_host for w in workers if w.data_host), None),
    }


MAX_WARNINGS = 64  # warnings a StatusReply carries (each at most ~1,000 characters: tmd.faults); the rest: journal


def status_reply(job: str, registry: Registry, migration: Optional[Episode], recovery: Optional[Episode],
                 stragglers: Callable[[Node], list[int]], decorate: Optional[Callable[[list[dict]], None]] = None,
                 now: Optional[float] = None, failure: Optional[dict] = None,
                 warnings: Optional[list[dict]] = None, page: Optional[str] = None,
                 config: Optional[dict] = None, checkpoints: Optional[dict] = None,
                 slurm: Optional[dict] = None) -> p.StatusReply:
    """The StatusReply of job ``job``: ``migration`` and ``recovery`` are the latest of each (or None);
    ``stragglers(node)`` gives a node's straggler ranks; ``decorate`` may add fields to the node dicts (SLURM
    mode); ``now`` defaults to time.monotonic(); ``failure``: why the job failed (tmd.faults), ``warnings``: the
    misuse ranks reported (the first MAX_WARNINGS - 1, then one saying how many more); ``page``: the status
    page's address (tmd.web), None when it is off; ``config``: the
    job's settings (tmd.config.JobConfig.to_dict()); ``checkpoints``: the checkpoint tier's state
    (tmd.tiers.Tier.status), None when it is off; ``slurm``: the SLURM side's summary
    (tmd.slurm.SlurmCluster.status), None in local mode."""
    now = time.monotonic() if now is None else now
    warnings = list(warnings or [])
    if len(warnings) > MAX_WARNINGS:  # one per rank and code can be thousands: the reply must fit one frame
        more = len(warnings) - MAX_WARNINGS + 1
        warnings = warnings[:MAX_WARNINGS - 1] + [{"rank": None, "node": None, "code": "more_warnings",
                                                   "message": f"{more} more warnings: tmctl events (job_warning)"}]
    nodes = [node_status(n, now, stragglers(n)) for n in registry.nodes.values()]
    if decorate is not None:
        decorate(nodes)
    return p.StatusReply(job=job, world_size=registry.world_size, generation=registry.generations.current,
                         step=registry.current_step(), nodes=nodes,
                         migration=migration.to_dict() if migration else None,
                         recovery=recovery.to_dict() if recovery else None, failure=failure,
                         warnings=warnings, page=page, config=config, checkpoints=checkpoints,
                         slurm=slurm)

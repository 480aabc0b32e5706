"""Emulated nodes that do not share cores (``tmd local --isolate-nodes``), as a cluster gives each node its machine.

Local mode runs every node's processes on this one host, so a standby's warm-up competes with the active ranks for
the same cores and shows up as their stall. With ``--isolate-nodes`` each node's processes are pinned to a CPU set:

- the standby nodes (``s<i>``, and so the guards, which are standbys warmed as a particular node's ranks, and the
  standbys added later) get CPUs of their own;
- the active nodes (``n<i>``) share the rest; where each node can have its own (at least ``per_node`` CPUs each),
  it does.

:func:`split_cpus` decides: with C usable CPUs and A active + S standby nodes (S counted as at least 1, so a run
started without standbys keeps the same active CPUs as one with them), ``per_node = max(1, C // (A + S))``; the
standbys get the last ``min(C - 1, per_node * S)`` CPUs, the active nodes the others. On a 2-CPU host: one CPU for
the standbys, one for the active ranks. A node keeps its CPU set for its life: a standby promoted by a migration
trains on the standbys' CPUs, as a standby machine would go on with its own cores.

**How.** cgroup v2 cpusets where this process's cgroup delegates the ``cpuset`` controller to its children and is
writable (a child cgroup ``tm-<tmd pid>-<node>`` per node, removed at the end); else ``sched_setaffinity``. Either
way the process pins itself before it runs the command: :func:`wrap` prefixes the command with
``python -m tmd.cpusets --cpus 0,1 [--cgroup DIR] --``, which joins the cgroup or sets its affinity and then execs
the command (no window in which the command runs unpinned; its threads inherit the set).

:class:`Isolation` is what the launcher holds; ``describe()`` is the line tmd prints and ``to_dict()`` what it
journals (``nodes_isolated``) and the benchmarks put in their JSON.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Optional, Sequence

MECHANISM_CGROUP = "cgroup-v2 cpuset"
MECHANISM_AFFINITY = "sched_setaffinity"


def usable_cpus() -> list[int]:
    """The CPUs this process may run on (sorted)."""
    return sorted(os.sched_getaffinity(0))


def split_cpus(cpus: Sequence[int], active_nodes: int, standby_nodes: int) -> tuple[list[int], list[int], int]:
    """``(active CPUs, standby CPUs, per_node)`` for ``active_nodes`` + ``standby_nodes`` nodes on ``cpus`` (see the
    module docstring). Raises ValueError with fewer than 2 CPUs or no active node."""
    cpus = sorted(cpus)
    if len(cpus) < 2:
        raise ValueError(f"--isolate-nodes needs at least 2 CPUs; this process may use {len(cpus)}")
    if active_nodes < 1:
        raise ValueError("--isolate-nodes needs at least one active node")
    spares = max(1, standby_nodes)
    per_node = max(1, len(cpus) // (active_nodes + spares))
    n_spare = min(len(cpus) - 1, per_node * spares)
    return cpus[:-n_spare], cpus[-n_spare:], per_node


def _node_sets(pool: list[int], nodes: list[str], per_node: int) -> dict[str, list[int]]:
    """Each node its own ``per_node`` CPUs of ``pool`` where the pool has room for all, else the whole pool."""
    if len(pool) >= per_node * len(nodes):
        return {n: pool[i * per_node:(i + 1) * per_node] for i, n in enumerate(nodes)}
    return {n: list(pool) for n in nodes}


def cgroup_v2_dir() -> Optional[str]:
    """This process's cgroup v2 directory when it delegates ``cpuset`` to its children and is writable, else None."""
    try:
        with open("/proc/self/mounts") as f:
            mounts = [line.split()[1] for line in f if line.split()[2:3] == ["cgroup2"]]
        with open("/proc/self/cgroup") as f:
            rel = next((line.strip()[3:] for line in f if line.startswith("0::")), None)
    except OSError:
        return None
    if rel is None:
        return None
    for mount in mounts:
        path = os.path.join(mount, rel.lstrip("/"))
        try:
            with open(os.path.join(path, "cgroup.subtree_control")) as f:
                delegated = "cpuset" in f.read().split()
        except OSError:
            continue
        if delegated and os.access(path, os.W_OK):
            return path
    return None


@dataclasses.dataclass
class Isolation:
    """The CPU sets of a local job's nodes. ``active``/``standby``: the two pools; ``per_node``: CPUs a node gets
    when its pool has room; ``cgroup_root``: the cgroup v2 directory the nodes' cgroups go under (None:
    sched_setaffinity)."""

    active: list[int]
    standby: list[int]
    per_node: int
    active_nodes: list[str]
    cgroup_root: Optional[str] = None
    _sets: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    _cgroups: dict[str, str] = dataclasses.field(default_factory=dict)

    @classmethod
    def plan(cls, active_nodes: list[str], standby_nodes: list[str], cpus: Optional[Sequence[int]] = None,
             use_cgroup: bool = True) -> "Isolation":
        """The isolation of these nodes on ``cpus`` (default: :func:`usable_cpus`). Raises ValueError as
        :func:`split_cpus`."""
        active, standby, per_node = split_cpus(usable_cpus() if cpus is None else cpus, len(active_nodes),
                                               len(standby_nodes))
        iso = cls(active, standby, per_node, list(active_nodes), cgroup_v2_dir() if use_cgroup else None)
        iso._sets.update(_node_sets(active, list(active_nodes), per_node))
        iso._sets.update(_node_sets(standby, list(standby_nodes), per_node))
        return iso

    @property
    def mechanism(self) -> str:
        return MECHANISM_CGROUP if self.cgroup_root else MECHANISM_AFFINITY

    def cpus_of(self, node: str, standby: bool) -> list[int]:
        """The CPU set of ``node``: its planned one, or (a node added later) its pool."""
        if node not in self._sets:
            self._sets[node] = list(self.standby if standby and node not in self.active_nodes else self.active)
        return self._sets[node]

    def wrap(self, node: str, standby: bool, argv: list[str]) -> list[str]:
        """``argv`` run pinned to ``node``'s CPU set (its cgroup made here, on the cgroup v2 path)."""
        cpus = self.cpus_of(node, standby)
        pin = [sys.executable, "-m", "tmd.cpusets", "--cpus", ",".join(map(str, cpus))]
        if self.cgroup_root:
            pin += ["--cgroup", self._cgroup(node, cpus)]
        return [*pin, "--", *argv]

    def _cgroup(self, node: str, cpus: list[int]) -> str:
        path = self._cgroups.get(node)
        if path is None:
            path = os.path.join(self.cgroup_root, f"tm-{os.getpid()}-{node}")
            os.makedirs(path, exist_ok=True)
            with open(os.path.join(path, "cpuset.cpus"), "w") as f:
                f.write(",".join(map(str, cpus)))
            self._cgroups[node] = path
        return path

    def close(self) -> None:
        """Remove the nodes' cgroups (those still holding a process stay)."""
        for path in self._cgroups.values():
            try:
                os.rmdir(path)
            except OSError:
                pass
        self._cgroups.clear()

    def to_dict(self) -> dict:
        """What tmd journals and the benchmarks report: the pools, each node's set so far and the mechanism."""
        return {"mechanism": self.mechanism, "active_cpus": self.active, "standby_cpus": self.standby,
                "per_node": self.per_node, "nodes": {n: list(c) for n, c in sorted(self._sets.items())}}

    def describe(self) -> str:
        """One line: the split, as tmd prints it."""
        return (f"isolated nodes ({self.mechanism}): active nodes on CPUs {_cpus(self.active)}, "
                f"standbys and guards on CPUs {_cpus(self.standby)}")


def _cpus(cpus: list[int]) -> str:
    return ",".join(map(str, cpus))


def pin_self(cpus: list[int], cgroup: Optional[str] = None) -> None:
    """Put this process in ``cgroup`` (a cgroup v2 directory) or, without one, set its affinity to ``cpus``. Raises
    OSError when neither can be done."""
    if cgroup:
        with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    else:
        os.sched_setaffinity(0, cpus)


def main(argv: Optional[list[str]] = None) -> None:
    """``python -m tmd.cpusets --cpus 0,1 [--cgroup DIR] -- COMMAND...``: pin, then exec COMMAND."""
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        sys.exit("tmd.cpusets: usage: python -m tmd.cpusets --cpus LIST [--cgroup DIR] -- COMMAND ...")
    at = argv.index("--")
    ap = argparse.ArgumentParser(prog="tmd.cpusets")
    ap.add_argument("--cpus", required=True)
    ap.add_argument("--cgroup")
    args = ap.parse_args(argv[:at])
    command = argv[at + 1:]
    if not command:
        sys.exit("tmd.cpusets: no command after --")
    try:
        pin_self([int(c) for c in args.cpus.split(",")], args.cgroup)
    except (OSError, ValueError) as e:
        sys.exit(f"tmd.cpusets: cannot pin to CPUs {args.cpus}: {e}")
    os.execvp(command[0], command)


if __name__ == "__main__":
    main()

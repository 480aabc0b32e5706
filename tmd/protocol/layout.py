"""Where things live: store key prefixes, the run directory's files, and the per-user state directory.

Every party builds these names here and nowhere else (tmd, the worker runtime, tmctl, the SLURM hooks, tests).
Only the standard library is imported: the SLURM prolog and epilog import this module with no PATH and must stay
well under a second.

Store prefixes: generation ``g`` of process group ``name`` rendezvouses under ``tm/g<g>/<name>``; a planned
migration's 2-rank transfer group for rank ``r`` under ``tm/g<g>/transfer/r<r>``; a recovery's transfer to rank
``r`` under ``tm/g<g>/recover/r<r>``. Generations are never reused (tmd.registry.Generations), so neither is a
prefix: gloo must never rendezvous twice under one prefix.
"""
from __future__ import annotations

import os
from typing import Optional

STORE_ROOT = "tm"
WORLD_GROUP = "world"  # the name of the world group (the default process group) in store keys and recordings


def group_prefix(generation: int, group: str) -> str:
    """Store prefix of generation ``generation`` of process group ``group`` (``tm/g3/world``)."""
    return f"{STORE_ROOT}/g{generation}/{group}"


def created_group_prefix(group: str) -> str:
    """Store prefix of process group ``group`` as the training script creates it (``tm/new/pg3``). Each group
    is created once per job by the ranks then active (a joiner creates its groups replaying, without the
    network); every later generation is ``group_prefix``."""
    return f"{STORE_ROOT}/new/{group}"


def snapshot_prefix(round_id: str, src: int, dst: int) -> str:
    """Store prefix of the 2-rank group over which rank ``src`` (0) sends its snapshot to its keeper ``dst`` (1)
    in snapshot round ``round_id`` (unique: derived from every rank's nonce of that step, worker.snapshot)."""
    return f"{STORE_ROOT}/snap/{round_id}/{src}-{dst}"


def snapshot_keepers(node_of: dict[int, str]) -> dict[int, int]:
    """Who keeps whose buddy snapshot: ``{rank: keeper rank}``, the rank at the same position on the next node
    (nodes ordered by their lowest rank, a ring). Empty (no snapshots) with fewer than two nodes or nodes of
    different sizes. tmd and every rank compute it from the same rank -> node map (the job's start)."""
    nodes: dict[str, list[int]] = {}
    for rank in sorted(node_of):
        nodes.setdefault(node_of[rank], []).append(rank)
    order = list(nodes.values())  # dicts keep insertion order: by lowest rank
    if len(order) < 2 or len({len(ranks) for ranks in order}) != 1:
        return {}
    return {rank: order[(i + 1) % len(order)][j] for i, ranks in enumerate(order) for j, rank in enumerate(ranks)}


def transfer_prefix(generation: int, rank: int) -> str:
    """Store prefix of a planned migration's 2-rank transfer group for ``rank`` (leaver 0, joiner 1)."""
    return f"{STORE_ROOT}/g{generation}/transfer/r{rank}"


def recovery_prefix(generation: int, receiver_rank: int) -> str:
    """Store prefix of a failure recovery's 2-rank transfer group to ``receiver_rank`` (sender 0, receiver 1)."""
    return f"{STORE_ROOT}/g{generation}/recover/r{receiver_rank}"


class RunDir:
    """The files of one job's run directory (``tmd local --run-dir``, default ``./tmrun``)::

        tmd.json               tmd's address, pid, job, launch command (tmctl and ``tmd resume`` read it)
        events.jsonl           the journal (tmd.journal)
        record/rank<R>.<G>.pt  rank R's recording of group G's first steps (worker.sandbox), replayed by joiners
        logs/<node>.<L>.log    each local-mode worker process's output (tmd.local)
    """

    TMD_JSON = "tmd.json"
    EVENTS = "events.jsonl"
    RECORD = "record"
    LOGS = "logs"

    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(path)

    @property
    def tmd_json(self) -> str:
        return os.path.join(self.path, self.TMD_JSON)

    @property
    def events(self) -> str:
        return os.path.join(self.path, self.EVENTS)

    @property
    def record_dir(self) -> str:
        return os.path.join(self.path, self.RECORD)

    @property
    def logs_dir(self) -> str:
        return os.path.join(self.path, self.LOGS)

    def log(self, node: str, local_rank: int) -> str:
        return os.path.join(self.logs_dir, f"{node}.{local_rank}.log")

    def recording(self, rank: int, group: str = WORLD_GROUP) -> str:
        return recording_path(self.record_dir, rank, group)


def recording_path(record_dir: str, rank: int, group: str = WORLD_GROUP) -> str:
    """``<record_dir>/rank<rank>.<group>.pt``: what rank ``rank`` recorded of ``group`` (a joiner gets
    ``record_dir`` in its Assign)."""
    return os.path.join(record_dir, f"rank{rank}.{group}.pt")


def recorded_groups(record_dir: str, rank: int) -> set[str]:
    """The names of the groups whose recording by rank ``rank`` is in ``record_dir`` (:func:`recording_path`);
    empty when the directory does not exist."""
    head, tail = f"rank{rank}.", ".pt"
    try:
        names = os.listdir(record_dir)
    except FileNotFoundError:
        return set()
    return {n[len(head):-len(tail)] for n in names
            if n.startswith(head) and n.endswith(tail) and len(n) > len(head) + len(tail)}


def state_dir(home: Optional[str] = None) -> str:
    """The per-user state directory: ``$TM_STATE_DIR``, else ``<home>/.trainmover`` (``home`` defaults to this
    user's; the SLURM hooks pass the job user's, since they run as root)."""
    if home is None and os.environ.get("TM_STATE_DIR"):
        return os.environ["TM_STATE_DIR"]
    return os.path.join(home if home is not None else os.path.expanduser("~"), ".trainmover")


def job_dir(job_id: str, root: Optional[str] = None) -> str:
    """``<state dir>/jobs/<job_id>``: a SLURM job's ``tmd.json`` (names its tmd) and ``hooks/`` reports."""
    return os.path.join(root if root is not None else state_dir(), "jobs", job_id)


def job_tmd_json(job_id: str, root: Optional[str] = None) -> str:
    return os.path.join(job_dir(job_id, root), RunDir.TMD_JSON)


def hook_report_dir(job_id: str, root: Optional[str] = None) -> str:
    """Where the SLURM hooks write ``<hook>.<node>.json`` reports of a job (tmd journals them)."""
    return os.path.join(job_dir(job_id, root), "hooks")


WEB_TOKEN_FILE = "web.token"  # in the job's keys directory: the bearer token of tmd's page and /metrics (tmd.web)


def web_token(keys_dir: str) -> str:
    """The file holding the web token of the job whose keys are in ``keys_dir`` (tmd.web)."""
    return os.path.join(keys_dir, WEB_TOKEN_FILE)

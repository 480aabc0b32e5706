"""The narrow interface the coordinator's state machines use to command workers.

:class:`~tmd.migration.Migrations` and :class:`~tmd.recovery.Incidents` decide; they reach worker processes only
through a :class:`WorkerChannel` (the daemon implements it over its ZeroMQ ROUTER; unit tests record what was
sent). Nothing here blocks: a send queues one frame.
"""
from __future__ import annotations

from typing import Protocol

from tmd import protocol as p
from tmd.protocol.vocab import Event
from tmd.registry import Worker


class WorkerChannel(Protocol):
    def send(self, worker: Worker, msg: p.Message) -> None:
        """Deliver ``msg`` to one worker process (dropped silently if the process is gone)."""

    def assign(self, worker: Worker, rank: int, *, migration_id: int = 0, incident_id: int = 0,
               guard: bool = False) -> None:
        """Give a standby process ``rank`` as a joiner: for migration ``migration_id`` (a planned move), for
        incident ``incident_id`` (replacing a failed rank), or as a guard (``guard``: warm now, tmd.guards). The Assign carries the current generation, the
        job's store and where the rank's recording lives."""

    def ignore(self, worker: Worker, event: Event, **fields) -> None:
        """Journal a report from ``worker`` that counts for nothing (stale, or from a process with no part in
        the migration or incident) as ``event`` with ``fields``, bounded per sender as refused input is
        (tmd.bad_input: one a second, the rest counted)."""

"""The narrow interface tmd's helpers use to act on the job: :class:`JobControl`.

The daemon (tmd.daemon.Daemon) implements it. Its collaborators hold a ``JobControl``, never the daemon: the
restart logic (tmd.resume), the SLURM side (tmd.slurm), GPU and straggler evacuation (tmd.evacuation) and the
end of the job (tmd.ending). Through it they read the registry and the journal, message workers and clients,
declare a node failed and start, inspect or abort planned migrations. They never call the daemon's private
methods, and none of them imports tmd.daemon.

Everything here runs in tmd's one thread: nothing blocks, nothing is locked.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Protocol, Sequence, Union

from tmd import protocol as p
from tmd.journal import Journal
from tmd.protocol.vocab import FailureSignal
from tmd.registry import Node, Registry, Worker

if TYPE_CHECKING:
    from tmd.guards import Guards
    from tmd.protocol.keys import JobKeys
    from tmd.local import LocalLauncher
    from tmd.migration import Migration
    from tmd.recovery import Incident


class JobControl(Protocol):
    """What tmd's helpers may see and do of the running job."""

    journal: Journal
    registry: Registry
    run_dir: str  # absolute path of the run directory (tmd.protocol.layout.RunDir)
    address: str  # tmd's ZeroMQ address (``tcp://HOST:PORT``)
    keys: Optional["JobKeys"]  # the job's CURVE keys and secret (tmd.protocol.keys); None without authentication
    hostname: str  # this host's name: workers registered with it run here (psutil can see them)
    store_host: str  # the job's rendezvous store, hosted by tmd (tmd.store)
    launcher: Optional["LocalLauncher"]  # starts and watches the job's processes (None: they start themselves)
    guards: "Guards"  # standbys warm as active nodes' ranks (tmd.guards): release one through it

    @property
    def store_port(self) -> int:
        """The TCP port of the job's store."""

    # --- messages -------------------------------------------------------------------------------------------
    def send(self, worker: Worker, msg: p.Message) -> None:
        """Queue ``msg`` for one worker process (dropped if it is gone)."""

    def reply(self, identity: bytes, msg: p.Message) -> None:
        """Queue ``msg`` for the ZeroMQ peer ``identity`` (a worker not registered yet, a client)."""

    # --- failures -------------------------------------------------------------------------------------------
    def fail_node(self, node: Node, reason: str, signal: FailureSignal) -> None:
        """``node`` is lost: fence it, abort the migration it takes part in and start (or restart) recovery.
        A node already failed is left alone. Raises tmd.recovery.RecoveryError when the job cannot recover, and
        tmd.faults.JobFailed when it must not (the crash-loop guard, misuse): the loop then ends the job."""

    def recover_ranks(self, lost: dict[int, str], reason: str) -> None:
        """Start a recovery of ranks that no process holds (``lost``: rank -> the failed node that held it), as a
        node failure would: a restarted tmd whose predecessor died during a recovery. Raises as fail_node does."""

    # --- planned migrations ---------------------------------------------------------------------------------
    def request_migration(self, sources: Union[str, Sequence[str]], targets: Union[str, Sequence[str]], *,
                          require_healthy: bool = True) -> "Migration":
        """Start moving the ranks of node ``sources[i]`` to standby ``targets[i]`` for every i, in one migration
        (one node's name stands for a list of one). Raises tmd.migration.MigrationError (its ``code`` says why)
        and changes nothing when it cannot start."""

    def migration(self, migration_id: int) -> "Migration":
        """Migration ``migration_id`` (negative: the latest), to read. Raises MigrationError
        ``unknown_migration``."""

    @property
    def current_migration(self) -> Optional["Migration"]:
        """The migration in progress, or None (read only: change it through this interface)."""

    def abort_migration(self, migration: "Migration", reason: str) -> None:
        """Abort ``migration`` (nothing happens if it already finished): the parties keep their old groups."""

    # --- failure recovery -----------------------------------------------------------------------------------
    @property
    def current_incident(self) -> Optional["Incident"]:
        """The failure recovery in progress, or None (read only)."""

"""What a client (tmctl, tests, benchmarks) may ask tmd, and what the SLURM hooks tell it.

:class:`Requests` serves the messages whose ``SENDER`` is ``CLIENT`` (StatusRequest, MigrateRequest,
MigrationRequest, AddStandbyRequest, EventsRequest; each answered with one reply) and ``HOOK`` (NodeNotice,
answered with nothing). The daemon routes them here only from identities that are not workers. A request tmd
refuses raises tmd.migration.MigrationError; the daemon answers it with an ErrorReply carrying its code.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

from tmd import protocol as p
from tmd.control import JobControl
from tmd.migration import MigrationError
from tmd.protocol.vocab import ErrorCode, Event

if TYPE_CHECKING:
    from tmd.slurm import SlurmCluster


class Requests:
    """``status()`` builds the job's StatusReply; ``cluster()`` is the SLURM side (None in local mode), which
    resolves migrate targets (``any``, a standby job id) and takes the hooks' notices."""

    def __init__(self, control: JobControl, status: Callable[[], p.StatusReply],
                 cluster: Callable[[], Optional["SlurmCluster"]]) -> None:
        self.control = control
        self.status_reply = status
        self.cluster = cluster

    def status(self, identity: bytes, msg: p.StatusRequest) -> None:
        self.control.reply(identity, self.status_reply())

    def migrate(self, identity: bytes, msg: p.MigrateRequest) -> None:
        """Start a migration (refused while a failure recovery runs); journals ``migrate_refused`` with why."""
        c, cluster = self.control, self.cluster()
        try:
            target = cluster.resolve_target(msg.target) if cluster is not None else msg.target
            inc = c.current_incident
            if inc is not None:
                raise MigrationError(ErrorCode.RECOVERING, f"recovery {inc.id} from a failure is in progress "
                                                           f"({inc.state}); try again once it is done")
            m = c.request_migration(msg.source, target)
        except MigrationError as e:
            c.journal.record(Event.MIGRATE_REFUSED, source=msg.source, target=msg.target, code=e.code, reason=str(e))
            raise
        c.reply(identity, p.MigrationReply(migration=m.to_dict()))

    def migration(self, identity: bytes, msg: p.MigrationRequest) -> None:
        self.control.reply(identity, p.MigrationReply(migration=self.control.migration(msg.migration_id).to_dict()))

    def add_standby(self, identity: bytes, msg: p.AddStandbyRequest) -> None:
        """Local mode: add standby node ``msg.node`` and start its processes; answered with the status."""
        c = self.control
        if c.launcher is None:
            raise MigrationError(ErrorCode.NOT_SUPPORTED, "tmd does not start processes in this mode: submit a "
                                 "standby job (sbatch slurm/standby.sbatch) and it registers by itself")
        name = msg.node.strip()
        if not name or not name.replace("-", "").replace("_", "").isalnum():
            raise MigrationError(ErrorCode.BAD_REQUEST, f"bad node name {msg.node!r}: letters, digits, - and _ only")
        try:
            c.registry.add_node(name)
        except ValueError as e:
            raise MigrationError(ErrorCode.BAD_REQUEST, str(e)) from None
        c.journal.record(Event.STANDBY_ADDED, node=name)
        c.launcher.start_node(name, standby=True)
        self.status(identity, p.StatusRequest())

    def events(self, identity: bytes, msg: p.EventsRequest) -> None:
        self.control.reply(identity, p.EventsReply(events=self.control.journal.since(msg.after, msg.limit)))

    def node_notice(self, identity: bytes, msg: p.NodeNotice) -> None:
        """A SLURM hook's notice: the SLURM side acts on it; without one it is only journalled."""
        cluster = self.cluster()
        if cluster is not None:
            cluster.on_notice(msg)
        else:
            self.control.journal.record(Event.NODE_NOTICE, node=msg.node, slurm_job=msg.job_id, hook=msg.hook,
                                        detail=msg.detail)

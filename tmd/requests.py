"""What a client (tmctl, tests, benchmarks) may ask tmd, and what the SLURM hooks tell it.

:class:`Requests` serves the messages whose ``SENDER`` is ``CLIENT`` (StatusRequest, MigrateRequest,
MigrationRequest, AddStandbyRequest, EventsRequest; each answered with one reply) and ``HOOK`` (NodeNotice,
answered with a NodeNoticeAck). The daemon routes them here only from identities that are not workers. A request
tmd refuses raises tmd.migration.MigrationError; the daemon answers it with an ErrorReply carrying its code.
"""
from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING, Callable, Optional

from tmd import protocol as p
from tmd.control import JobControl
from tmd.migration import MigrationError, check_sources
from tmd.protocol.vocab import ErrorCode, Event, NodeRole

if TYPE_CHECKING:
    from tmd.slurm import SlurmCluster

NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # a standby's name: a file name on every system
MAX_ADDED_STANDBYS = 4  # nodes alive beyond the job's own at start, by tmctl standby add (each: ranks_per_node processes)
ADD_STANDBY_INTERVAL_S = 10.0  # seconds between two standbys added by request


class Requests:
    """``status()`` builds the job's StatusReply; ``cluster()`` is the SLURM side (None in local mode), which
    resolves migrate targets (``any``, a standby job id) and takes the hooks' notices."""

    def __init__(self, control: JobControl, status: Callable[[], p.StatusReply],
                 cluster: Callable[[], Optional["SlurmCluster"]], max_added_standbys: int = MAX_ADDED_STANDBYS,
                 add_standby_interval_s: float = ADD_STANDBY_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``max_added_standbys``: how many more nodes than the job started with (those of a resumed tmd's
        journal) may be alive, that is neither failed nor left, once ``tmctl standby add`` added one: a standby
        that took over a failed node's ranks replaces it and frees its place; ``add_standby_interval_s``:
        seconds between two added standbys;
        ``clock``: monotonic seconds (tests pass their own)."""
        self.control = control
        self.status_reply = status
        self.cluster = cluster
        self.max_added_standbys = max_added_standbys
        self.add_standby_interval_s = add_standby_interval_s
        self.clock = clock
        self._initial_nodes = len(control.registry.nodes)  # the job's nodes and standbys at start
        self._last_added: Optional[float] = None

    def status(self, identity: bytes, msg: p.StatusRequest) -> None:
        self.control.reply(identity, self.status_reply())

    def migrate(self, identity: bytes, msg: p.MigrateRequest) -> None:
        """Start one migration of every (``msg.sources[i]``, ``msg.targets[i]``) pair (refused while a failure
        recovery runs); journals ``migrate_refused`` with the lists as asked and why. Under SLURM each target
        may be a standby job id or ``any`` (tmd.slurm.SlurmCluster.resolve_target)."""
        c, cluster = self.control, self.cluster()
        try:
            if cluster is not None:  # before "any" or a job id is resolved: a wrong source is named as such
                check_sources(c.registry, list(msg.sources))
            targets = cluster.resolve_targets(list(msg.targets)) if cluster is not None else list(msg.targets)
            inc = c.current_incident
            if inc is not None:
                raise MigrationError(ErrorCode.RECOVERING, f"recovery {inc.id} from a failure is in progress "
                                                           f"({inc.state}); try again once it is done")
            m = c.request_migration(list(msg.sources), targets)
        except MigrationError as e:
            c.journal.record(Event.MIGRATE_REFUSED, sources=msg.sources, targets=msg.targets, code=e.code,
                             reason=str(e))
            raise
        c.reply(identity, p.MigrationReply(migration=m.to_dict()))

    def migration(self, identity: bytes, msg: p.MigrationRequest) -> None:
        self.control.reply(identity, p.MigrationReply(migration=self.control.migration(msg.migration_id).to_dict()))

    def add_standby(self, identity: bytes, msg: p.AddStandbyRequest) -> None:
        """Local mode: add standby node ``msg.node`` and start its processes; answered with the status.
        Refused (ErrorReply, journalled as ``standby_refused``): a name that is not NODE_NAME (letters, digits,
        ``.``, ``_``, ``-``; at most 64 characters, not starting with a punctuation mark) or already in use;
        more than ``max_added_standbys`` nodes alive beyond the job's own at start (each costs ``ranks_per_node``
        processes; failed and left nodes count for nothing); a request sooner than ``add_standby_interval_s`` seconds after the last
        one that was served."""
        c = self.control
        name = msg.node  # as given: a name with blanks is refused, not trimmed into another
        try:
            if c.launcher is None or self.cluster() is not None:  # SLURM: a standby is a node a standby job holds
                raise MigrationError(ErrorCode.NOT_SUPPORTED, "tmctl standby add is for local mode: under SLURM, "
                                     "submit a standby job (sbatch --reservation=standby slurm/standby.sbatch JOBID) "
                                     "and its node registers by itself")
            if not NODE_NAME.fullmatch(name):
                raise MigrationError(ErrorCode.BAD_REQUEST, f"bad node name {name[:80]!r}: 1 to 64 letters, digits, "
                                                            f"'.', '_' and '-', starting with a letter or digit")
            if name in c.registry.nodes:
                raise MigrationError(ErrorCode.BAD_REQUEST, f"node '{name}' is already part of this job (it is "
                                                            f"{c.registry.nodes[name].role})")
            alive = sum(1 for n in c.registry.nodes.values() if n.role not in (NodeRole.FAILED, NodeRole.LEFT))
            if alive - self._initial_nodes >= self.max_added_standbys:
                raise MigrationError(ErrorCode.BAD_REQUEST, f"{alive} nodes are alive, {alive - self._initial_nodes}"
                                     f" more than the job started with: the most tmctl standby add allows (tmd's "
                                     f"max_added_standbys, {self.max_added_standbys})")
            now = self.clock()
            if self._last_added is not None and now - self._last_added < self.add_standby_interval_s:
                wait = self.add_standby_interval_s - (now - self._last_added)
                raise MigrationError(ErrorCode.NOT_READY, f"one standby per {self.add_standby_interval_s:g} s: "
                                                          f"try again in {wait:.1f} s")
            try:
                c.registry.add_node(name)
            except ValueError as e:
                raise MigrationError(ErrorCode.BAD_REQUEST, str(e)) from None
        except MigrationError as e:
            c.journal.record(Event.STANDBY_REFUSED, node=name, code=e.code, reason=str(e))
            raise
        self._last_added = now
        c.journal.record(Event.STANDBY_ADDED, node=name)
        try:
            c.launcher.start_node(name, standby=True)
        except OSError as e:  # e.g. its log file cannot be created; the node stays known, with no process
            c.journal.record(Event.STANDBY_REFUSED, node=name, code=ErrorCode.BAD_REQUEST, reason=str(e))
            raise MigrationError(ErrorCode.BAD_REQUEST, f"cannot start standby {name}: {e}") from None
        self.status(identity, p.StatusRequest())

    def events(self, identity: bytes, msg: p.EventsRequest) -> None:
        self.control.reply(identity, p.EventsReply(events=self.control.journal.since(msg.after, msg.limit)))

    def node_notice(self, identity: bytes, msg: p.NodeNotice) -> None:
        """A SLURM hook's notice, acknowledged (the hook resends until it is): the SLURM side acts on it (once
        per hook, node and job, however often it comes); without one it is only journalled."""
        cluster = self.cluster()
        if cluster is not None:
            cluster.on_notice(msg)
        else:
            self.control.journal.record(Event.NODE_NOTICE, node=msg.node, slurm_job=msg.job_id, hook=msg.hook,
                                        detail=msg.detail)
        self.control.reply(identity, p.NodeNoticeAck(node=msg.node, job_id=msg.job_id, hook=msg.hook))

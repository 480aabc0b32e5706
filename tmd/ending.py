"""The end of a job: once every rank is done, tmd releases what is left and decides its exit code.

When every rank's owner reported Done, :class:`JobEnd` journals ``job_finished``, aborts a migration still in
flight and sends every standby and joiner process a Release (exit code 0). The job's exit code is 0 once no
process tmd started still runs; processes still running ``grace_s`` (30 s) after the job finished are
terminated (``processes_terminated``).
"""
from __future__ import annotations

import math
from typing import Optional

from tmd import protocol as p
from tmd.control import JobControl
from tmd.protocol.vocab import Event, ExitCode, NodeRole

RELEASE_GRACE_S = 30.0  # processes still running this long after the job finished are terminated


class JobEnd:
    """Watches for the end of the job (``tick``); ``released`` once the job finished and the spare processes
    were told to go (a standby that exits then is not started again)."""

    def __init__(self, control: JobControl, grace_s: float = RELEASE_GRACE_S) -> None:
        self.control = control
        self.grace_s = grace_s
        self.released = False
        self._deadline = math.inf  # time.monotonic() after which processes still running are terminated

    def tick(self, now: float) -> Optional[ExitCode]:
        """The job's exit code once it is over (every rank finished and its processes are gone), else None.
        ``now``: time.monotonic()."""
        c = self.control
        reg = c.registry
        if not reg.all_ranks_assigned() or not all(w.done for w in reg.rank_owner.values()):
            return None
        if not self.released:
            self.released = True
            self._deadline = now + self.grace_s
            c.journal.record(Event.JOB_FINISHED, step=reg.current_step())
            if c.current_migration is not None:
                c.abort_migration(c.current_migration, "the job finished before the migration committed")
            for n in reg.nodes_in(NodeRole.STANDBY, NodeRole.GUARDING, NodeRole.JOINING):
                for w in n.workers.values():
                    if not w.exited:
                        c.send(w, p.Release(reason="job finished", exit_code=ExitCode.OK))
        launcher = c.launcher
        if launcher is None or not launcher.running():
            return ExitCode.OK
        if now > self._deadline:
            stuck = [f"{proc.node}/{proc.local_rank}" for proc in launcher.running()]
            c.journal.record(Event.PROCESSES_TERMINATED, processes=stuck,
                             reason=f"still running {self.grace_s:.0f} s after the job finished")
            launcher.terminate_all()
            return ExitCode.OK
        return None

"""The job's step times for the journal: which steps every active rank has finished, and how long each took.

Ranks report each step (``StepReport``); tmd feeds the reports of the ranks' current owners to :class:`StepLog`.
A step is complete once every rank of the world reported it; its time is the slowest rank's (the job moves at
the pace of its slowest rank). :meth:`StepLog.flush` hands out the steps completed since the last flush, which
tmd journals as one ``step_times`` event about once a second (``[[step, ts, seconds], ...]``), the source of
``tmctl timeline``, the status page's timeline and the step-time metrics.

A rank that reports a step it already reported (the job rolled back to a snapshot and redoes it) starts that
step's record afresh, so a redone step is logged again with its new time.
"""
from __future__ import annotations

import time
from typing import Optional

MAX_PENDING = 4096  # steps partly reported that are kept (older ones are dropped: a rank that never reports)


class StepLog:
    def __init__(self, world_size: int) -> None:
        """``world_size``: the ranks that must report a step before it is complete."""
        self.world_size = world_size
        self._pending: dict[int, tuple[set[int], float]] = {}  # step -> (ranks that reported it, slowest s)
        self._done: list[list] = []  # [step, ts (epoch s), seconds] not flushed yet

    def report(self, rank: int, step: int, seconds: float, ts: Optional[float] = None) -> None:
        """Rank ``rank`` finished ``step`` in ``seconds`` (wall time from its previous step boundary), at epoch
        ``ts`` (default now)."""
        ranks, slowest = self._pending.get(step, (set(), 0.0))
        if rank in ranks:  # a redone step: what was reported before the rollback no longer counts
            ranks, slowest = set(), 0.0
        ranks.add(rank)
        slowest = max(slowest, seconds)
        if len(ranks) < self.world_size:
            self._pending[step] = (ranks, slowest)
            if len(self._pending) > MAX_PENDING:
                del self._pending[min(self._pending)]
            return
        self._pending.pop(step, None)
        self._done.append([step, round(time.time() if ts is None else ts, 6), round(slowest, 6)])

    @property
    def ready(self) -> int:
        """Completed steps not flushed yet."""
        return len(self._done)

    @property
    def pending(self) -> list[int]:
        """The steps some but not every rank reported, oldest first."""
        return sorted(self._pending)

    def flush(self) -> list[list]:
        """The steps completed since the last flush, oldest first: ``[step, ts (epoch s), seconds]`` each."""
        done, self._done = self._done, []
        return done

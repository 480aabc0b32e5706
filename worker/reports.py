"""What a rank tells tmd about its own progress: one :class:`Reporter` for every report but the heartbeat.

A migration's or a recovery's phase goes out through one method, :meth:`Reporter.report`: a
:class:`tmd.protocol.MigrationPhase` becomes a ``PhaseDone`` of that migration, a
:class:`tmd.protocol.RecoveryPhase` a ``RecoveryReport`` of that incident. Step times and the end of the loop
(``StepReport``, ``Done``), a failure of the rank's own making (``RankFailed``) and misuse found at start
(``RankWarning``) go out here too. Sending never blocks (worker.agent queues the message); any thread
may report. Only :meth:`Reporter.done` waits: for tmd's acknowledgement, before the process may exit.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional, Sequence, Union

from tmd import protocol as p

log = logging.getLogger("worker.reports")

Phase = Union[p.MigrationPhase, p.RecoveryPhase]
TRACEBACK_CHARS = 8000  # a RankFailed carries at most this much of a traceback (its tail)
DONE_RESEND_S = 0.5  # Done is sent again after this many seconds without tmd's DoneAck...
DONE_BUDGET_S = 3.0  # ...until this many seconds have passed (then the process ends anyway: tmd may be gone)


def describe_error(error: Union[str, BaseException]) -> str:
    """An exception as ``"TypeName: message"`` (a string is kept as it is)."""
    return error if isinstance(error, str) else f"{type(error).__name__}: {error}"


class Reporter:
    """Sends this rank's reports through ``send`` (worker.agent.Agent.send); ``rank()`` gives the rank they
    carry (-1 before one is assigned)."""

    def __init__(self, send: Callable[[p.Message], None], rank: Callable[[], int]) -> None:
        self.send = send
        self.rank = rank
        self._done_acked = threading.Event()

    def report(self, episode_id: int, phase: Phase, *, ok: bool = True, error: Union[str, BaseException] = "",
               step: int = -1, bytes_moved: int = 0, seconds: float = 0.0,
               groups: Optional[Sequence[str]] = None, snapshots: Sequence[int] = (), precopy_step: int = -1,
               kept_tensors: int = 0, ready_unix_s: float = 0.0, shadow_steps: int = 0) -> None:
        """Report ``phase`` of migration or incident ``episode_id`` (0: no incident known yet).

        ``ok`` false: the phase failed and ``error`` (a string or the exception) says why. ``step``: for a
        migration phase, the step the rank is on (``armed``) or the switch step (``committed``); for a recovery
        phase, the last step whose update this rank committed (-1: none or unknown). ``bytes_moved`` (bytes) and
        ``seconds`` measure a transfer or a wait; ``groups`` (migration ``prepared`` only) names the groups this
        rank rebuilt; ``snapshots`` (recovery ``halted`` only) the steps of the complete snapshots this rank
        holds (worker.snapshot); ``precopy_step`` and ``kept_tensors`` (migration ``sent`` only): see
        :class:`tmd.protocol.messages.PhaseDone`, as is ``ready_unix_s`` (migration ``committed`` only);
        ``shadow_steps``: a joiner's shadow iterations (``warmed`` only, migration or recovery). Raises TypeError
        for a phase of neither kind and ValueError for ``groups`` on a recovery phase."""
        if isinstance(phase, p.MigrationPhase):
            self.send(p.PhaseDone(migration_id=episode_id, rank=self.rank(), phase=phase, ok=ok,
                                  error=describe_error(error), step=step, bytes_moved=bytes_moved, seconds=seconds,
                                  groups=list(groups or []), precopy_step=precopy_step, kept_tensors=kept_tensors,
                                  ready_unix_s=ready_unix_s, shadow_steps=shadow_steps))
        elif isinstance(phase, p.RecoveryPhase):
            if groups:
                raise ValueError("a recovery report carries no groups")
            self.send(p.RecoveryReport(incident_id=episode_id, rank=self.rank(), phase=phase, ok=ok,
                                       error=describe_error(error), committed_step=step, bytes_moved=bytes_moved,
                                       seconds=seconds, snapshots=list(snapshots), shadow_steps=shadow_steps))
        else:
            raise TypeError(f"not a migration or recovery phase: {phase!r}")

    def step_time(self, step: int, seconds: float, shadow: bool) -> None:
        """Step ``step`` took ``seconds`` (wall time from the previous boundary); ``shadow``: a shadow
        iteration."""
        self.send(p.StepReport(rank=self.rank(), step=step, step_time_s=seconds, shadow=shadow))

    def failed(self, step: int, kind: p.FailureKind, error: Union[str, BaseException], traceback: str = "") -> None:
        """This rank cannot go on and the job must fail (``RankFailed``): ``kind`` says why, ``error`` in one line
        (an exception becomes ``"TypeName: message"``), ``traceback`` its formatted traceback (the tail of at most
        ``TRACEBACK_CHARS`` characters is kept)."""
        line = describe_error(error).splitlines()[0] if describe_error(error) else ""
        self.send(p.RankFailed(rank=self.rank(), step=step, kind=kind, error=line,
                               traceback=traceback[-TRACEBACK_CHARS:]))

    def warning(self, code: p.WarningCode, message: str) -> None:
        """Misuse found (``RankWarning``; tmd.protocol.WarningCode says which)."""
        self.send(p.RankWarning(rank=self.rank(), code=code, message=message))

    def replicas(self, ranks: list[int]) -> None:
        """Tell tmd which ranks hold a bit-identical copy of this rank's replicated state (its class)."""
        self.send(p.ReplicaReport(rank=self.rank(), replicas=list(ranks)))

    def snapshot(self, step: int, nbytes: int, seconds: float) -> None:
        """Tell tmd what this rank's buddy snapshot of ``step`` costs: ``nbytes`` of host memory per copy (its
        own; the buddy's it keeps is as large), ``seconds`` for the host copy (the step-time overhead)."""
        self.send(p.SnapshotReport(rank=self.rank(), step=step, bytes_per_copy=nbytes, copy_s=seconds))

    def done(self, final_step: int, left: bool, budget_s: float = DONE_BUDGET_S) -> bool:
        """The training loop ended after ``final_step`` (``left``: as a leaver that handed over): send ``Done``
        every DONE_RESEND_S seconds until tmd acknowledges it (:meth:`on_done_ack`), for at most ``budget_s``
        seconds. Returns whether it was acknowledged. Without this wait, a process that exits at once could be
        gone (and its queued message with it) before tmd read its Done: tmd would take its exit for a death."""
        deadline = time.monotonic() + budget_s
        while True:
            self.send(p.Done(rank=self.rank(), final_step=final_step, left=left))
            if self._done_acked.wait(max(0.0, min(DONE_RESEND_S, deadline - time.monotonic()))):
                return True
            if time.monotonic() >= deadline:
                log.warning("tmd did not acknowledge this rank's end within %g s", budget_s)
                return False

    def on_done_ack(self, msg: p.DoneAck) -> None:
        """tmd has this rank's Done (agent thread)."""
        self._done_acked.set()

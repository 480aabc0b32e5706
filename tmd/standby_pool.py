"""The standby pool of ``tmd slurm --keep-standbys N``: tmd submits standby jobs itself so that N standby nodes
stay warm or on their way, over a job of weeks that consumes one with each migration or failure.

A standby node counts while it is a standby of the job (warm or still warming) that SLURM does not drain; a
standby job that has not started counts as one node on its way. Whenever fewer than N count, tmd submits one
standby job (``sbatch --reservation=R slurm/standby.sbatch JOBID``, through the SLURM client wrapper of the
poller, tmd.slurm.run_slurm) into the reservation, one at a time: a consumed (now active), failed, or drained
standby is replaced that way. Submissions are rate-limited (``min_interval_s`` apart, at most ``max_per_window``
within ``window_s``). When sbatch refuses (the reservation is missing, the user may not use it, the controller
does not answer) or a submitted job ends without ever holding a warm standby, the reason is journalled and
shown by ``tmctl status``, and the next try waits ``backoff_s``, doubling up to ``max_backoff_s``: never a loop.
A full reservation needs no special case: the submitted job stays pending (squeue says why) and counts as on its
way, so nothing more is submitted. tmd cancels the standby jobs it submitted when the training job ends.

:class:`PoolPolicy` decides, with no SLURM and no clock of its own (tests drive it with a fake clock and a fake
sbatch); tmd.slurm.SlurmCluster counts the standbys and runs the submissions.
"""
from __future__ import annotations

import collections
import dataclasses
import os
import time
from typing import Callable, Optional

import tmd

STANDBY_SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(tmd.__file__))), "slurm",
                              "standby.sbatch")


@dataclasses.dataclass(frozen=True)
class StandbyPoolConfig:
    """The options of the standby pool (``keep`` is ``tmd slurm --keep-standbys``; the rest are defaults).
    Times are seconds."""

    keep: int = 0  # standby nodes kept warm or on their way (0: off, standbys are submitted by hand)
    min_interval_s: float = 5.0  # between two submissions
    max_per_window: int = 10  # submissions within window_s at most (a cap, whatever else goes wrong)
    window_s: float = 3600.0
    backoff_s: float = 10.0  # wait after a refusal, doubling with each refusal in a row
    max_backoff_s: float = 300.0
    script: str = STANDBY_SCRIPT  # the standby job's batch script (its first argument: the training job's id)

    def __post_init__(self) -> None:
        if self.keep < 0 or self.max_per_window < 1:
            raise ValueError(f"keep must be >= 0 and max_per_window >= 1 (got {self.keep}, {self.max_per_window})")
        if min(self.min_interval_s, self.window_s, self.backoff_s, self.max_backoff_s) < 0:
            raise ValueError("the standby pool's intervals are seconds >= 0")


class PoolPolicy:
    """When to submit the next standby job. The owner calls :meth:`due` with the count of standbys warm or on
    their way; when it returns True, it submits one job and reports the outcome with :meth:`submitted` or
    :meth:`refused`, and later :meth:`job_ended` for each job it submitted. :attr:`reason` says why the pool is
    short (None when it is not, or not for a reason worth telling)."""

    def __init__(self, config: StandbyPoolConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self.jobs: list[str] = []  # every standby job submitted, in order
        self.useful: set[str] = set()  # those that held a warm standby at some point
        self.in_flight = False
        self.refusals = 0  # in a row
        self.retry_at: Optional[float] = None
        self.reason: Optional[str] = None
        self._times: collections.deque[float] = collections.deque()  # submission times within window_s

    def due(self, have: int, reservation_ok: Optional[bool] = None, reservation: str = "") -> bool:
        """True when one standby job should be submitted now: ``have`` (standbys warm or on their way) is under
        ``keep``, no submission is in flight, the reservation is not known to be missing (``reservation_ok``
        False; None: unknown), the backoff after a refusal is over, and the rate limits allow it. Sets
        :attr:`reason` when something other than time holds the pool back."""
        c, now = self.config, self.clock()
        if have >= c.keep or self.in_flight:
            return False
        if reservation_ok is False:
            self.reason = f"reservation '{reservation}' does not exist: no standby job can be submitted until an " \
                          "admin creates it"
            return False
        if self.retry_at is not None and now < self.retry_at:
            return False
        while self._times and now - self._times[0] >= c.window_s:
            self._times.popleft()
        if len(self._times) >= c.max_per_window:
            self.reason = f"{len(self._times)} standby jobs submitted within {c.window_s:g} s, the most allowed"
            self.retry_at = self._times[0] + c.window_s
            return False
        if self._times and now - self._times[-1] < c.min_interval_s:
            return False
        return True

    def submitting(self) -> None:
        """A submission starts now."""
        self.in_flight = True
        self._times.append(self.clock())

    def submitted(self, job_id: str) -> None:
        """sbatch accepted standby job ``job_id``."""
        self.in_flight = False
        self.jobs.append(job_id)
        self.reason = None  # the job, pending or running, tells the rest (refusals in a row count on until warm)

    def refused(self, why: str) -> float:
        """sbatch refused or failed (``why``, one line): back off. Returns the seconds until the next try."""
        self.in_flight = False
        return self._back_off(f"sbatch refused a standby job: {why}")

    def warm(self, job_id: str) -> None:
        """Standby job ``job_id`` holds a warm standby: what it was submitted for. Clears the backoff."""
        if job_id in self.jobs:
            self.useful.add(job_id)
            self.refusals, self.retry_at, self.reason = 0, None, None

    def job_ended(self, job_id: str, why: str) -> Optional[float]:
        """Standby job ``job_id`` ended (``why``). One that never held a warm standby counts as a refusal (its
        script fails, its node is unfit...): returns the backoff in seconds then, else None."""
        if job_id not in self.jobs or job_id in self.useful:
            return None
        return self._back_off(f"standby job {job_id} ended without a warm standby: {why}")

    def _back_off(self, reason: str) -> float:
        c = self.config
        self.refusals += 1
        wait = min(c.backoff_s * 2 ** (self.refusals - 1), c.max_backoff_s)
        self.retry_at = self.clock() + wait
        self.reason = reason
        return wait

    def to_dict(self, have: int) -> dict:
        """For status: keep, have (standbys warm or on their way), jobs submitted, refusals in a row, reason,
        retry_in_s (None when not backing off)."""
        now = self.clock()
        retry = None if self.retry_at is None or now >= self.retry_at else round(self.retry_at - now, 1)
        return {"keep": self.config.keep, "have": have, "submitted": list(self.jobs), "refusals": self.refusals,
                "reason": self.reason, "retry_in_s": retry}


def sbatch_argv(config: StandbyPoolConfig, reservation: str, job_id: str, log_dir: str) -> list[str]:
    """The sbatch command line of one standby job for training job ``job_id`` in ``reservation``; its output goes
    to ``log_dir/standby-<id>.out``. ``--parsable`` prints ``ID[;CLUSTER]``."""
    return ["sbatch", "--parsable", f"--reservation={reservation}", "--nodes=1", "--job-name=tm-standby",
            f"--output={os.path.join(log_dir, 'standby-%j.out')}", config.script, job_id]


def parse_job_id(out: str) -> str:
    """sbatch --parsable's ``ID`` or ``ID;CLUSTER`` -> ``ID``. Raises ValueError on anything else."""
    jid = out.strip().split(";")[0]
    if not jid.isdigit():
        raise ValueError(f"sbatch printed {out.strip()[:80]!r}, not a job id")
    return jid

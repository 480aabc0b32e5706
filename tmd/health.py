"""Straggler detection from the mover Backend's counters, which every heartbeat carries.

In lockstep training every rank meets the others at each collective, so step times cannot tell which rank is
slow: all of them slow down together. Collective *arrival lateness* can. A rank's ``busy_s`` counter grows while
its collectives are in flight; a late rank finds its peers already waiting, so its collectives finish almost at
once, while every peer's ``busy_s`` grows by the time it waited for it. Over a sliding window, the share of wall
time a rank spends in collectives (its *wait share*) is therefore lowest on the straggler, and
``lateness = median(peers' wait share) - own wait share`` measures how much of the job's time it costs.

Lateness is assessed once per window, on consecutive, non-overlapping windows. A rank is flagged after ``patience``
late windows in a row and cleared after as many on time, so one slow step (a long first step, a checkpoint)
shorter than ``(patience - 1) * window_s`` is never a straggler. Same idea as the
collective-wait statistics of NVIDIA resiliency-ext's straggler detector, computed from counters, not traces.
"""
from __future__ import annotations

import collections
import math
import statistics
from typing import Any, Optional

from tmd.protocol.vocab import GpuLevel


def finite(value: Any) -> Optional[float]:
    """``value`` as a float if it is a finite number (not a bool, not text), else None: what a heartbeat's
    counters are read with, so a malformed one is ignored rather than raising."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        f = float(value)
    except OverflowError:
        return None
    return f if math.isfinite(f) else None


def _whole(value: Any) -> Optional[int]:
    """``value`` if it is an int (not a bool), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class StragglerDetector:
    def __init__(self, window_s: float = 2.0, lateness_threshold: float = 0.2, patience: int = 3) -> None:
        """``window_s``: seconds per assessment window; ``lateness_threshold``: flag when peers spend this much
        more of their wall time (a fraction, 0..1) waiting in collectives than the rank does."""
        self.window_s = window_s
        self.lateness_threshold = lateness_threshold
        self.patience = patience
        self._samples: dict[int, collections.deque[tuple[float, float]]] = collections.defaultdict(collections.deque)
        self._streak: dict[int, int] = collections.defaultdict(int)
        self.flagged: dict[int, float] = {}  # rank -> lateness at the last evaluation
        self.lateness: dict[int, float] = {}
        self._next_eval = 0.0

    def observe(self, rank: int, now_s: float, busy_s: float) -> None:
        """One heartbeat of ``rank`` at monotonic time ``now_s`` with its counter ``busy_s`` (seconds)."""
        samples = self._samples[rank]
        if samples and busy_s < samples[-1][1]:
            samples.clear()  # a new process took this rank: its counters started over
        samples.append((now_s, busy_s))
        while samples and now_s - samples[0][0] > self.window_s:
            samples.popleft()

    def reset(self, now_s: float) -> None:
        """Start every rank's window over at monotonic time ``now_s`` (the job halted, or just resumed, for an
        incident: collective waits then say nothing about who is slow). Flagged ranks stay flagged until
        ``patience`` on-time windows clear them."""
        self._samples.clear()
        self._streak.clear()
        self._next_eval = now_s + self.window_s

    def forget(self, rank: int) -> None:
        self._samples.pop(rank, None)
        self._streak.pop(rank, None)
        self.flagged.pop(rank, None)
        self.lateness.pop(rank, None)

    def _wait_share(self, rank: int) -> Optional[float]:
        samples = self._samples.get(rank)
        if not samples or samples[-1][0] - samples[0][0] < self.window_s / 2:
            return None
        (t0, b0), (t1, b1) = samples[0], samples[-1]
        return (b1 - b0) / (t1 - t0)

    def evaluate(self, now_s: float) -> tuple[list[int], list[int]]:
        """Assess the window that just ended (once per ``window_s``). Returns (newly flagged, newly cleared)."""
        if now_s < self._next_eval:
            return [], []
        self._next_eval = now_s + self.window_s
        shares = {r: s for r in self._samples if (s := self._wait_share(r)) is not None}
        new, cleared = [], []
        if len(shares) < 3:  # with two ranks each is the other's only peer: lateness is ambiguous
            return new, cleared
        for rank, share in shares.items():
            peers = [s for r, s in shares.items() if r != rank]
            self.lateness[rank] = lateness = statistics.median(peers) - share
            late = lateness > self.lateness_threshold
            streak = self._streak[rank]
            self._streak[rank] = streak = (max(streak, 0) + 1) if late else (min(streak, 0) - 1)
            if late and streak >= self.patience and rank not in self.flagged:
                self.flagged[rank] = lateness
                new.append(rank)
            elif not late and -streak >= self.patience and rank in self.flagged:
                del self.flagged[rank]
                cleared.append(rank)
            elif rank in self.flagged:
                self.flagged[rank] = lateness
        return new, cleared


# XIDs after which the GPU, its memory or its links cannot be trusted to keep training correctly, from NVIDIA's
# XID catalog (https://docs.nvidia.com/deploy/xid-errors/). Others (13: graphics engine exception, 31: MMU
# fault, 43: GPU stopped processing, ...) are usually the application's own fault and follow its process.
CRITICAL_XIDS = frozenset({
    48,   # double-bit (uncorrectable) ECC error
    63,   # ECC page retirement / row remapping recorded
    64,   # ECC page retirement / row remapping failed
    74,   # NVLink error
    79,   # GPU has fallen off the bus
    92,   # high single-bit ECC error rate
    94,   # contained ECC error
    95,   # uncontained ECC error
    119,  # GSP RPC timeout
    120,  # GSP error
})
HW_THROTTLE = ("hw_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown")


class GpuHealthPolicy:
    """Judges the GPU samples ranks send in heartbeats (:meth:`worker.gpu_health.GpuProbe.sample`).

    *unhealthy* (move the rank off this GPU): NVML reports the GPU lost; a critical XID (:data:`CRITICAL_XIDS`,
    from NVIDIA's XID catalog, docs.nvidia.com/deploy/xid-errors) seen since the rank's probe started; or
    volatile uncorrected ECC errors above the count first seen for that GPU (any increase).
    *degraded* (slow, still correct): the core temperature above ``max_temperature_c`` (degrees Celsius); or a
    hardware clock slowdown (:data:`HW_THROTTLE`) active for ``throttle_patience`` consecutive samples (one
    sample per heartbeat, 0.5 s by default), so a brief power-brake blip is not flagged.

    XIDs and the ECC increase stay reported while the rank stays on that GPU; a sample from another GPU (its
    ``uuid`` changed) or a lower ECC count (driver reloaded) starts the rank over, as does :meth:`forget`."""

    def __init__(self, max_temperature_c: float = 90, throttle_patience: int = 3,
                 critical_xids: frozenset[int] = CRITICAL_XIDS) -> None:
        self.max_temperature_c = max_temperature_c
        self.throttle_patience = throttle_patience
        self.critical_xids = critical_xids
        self._gpu: dict[int, Optional[str]] = {}  # rank -> uuid of the GPU its baseline is for
        self._ecc_baseline: dict[int, int] = {}
        self._throttled: dict[int, int] = {}  # rank -> consecutive samples with a hardware slowdown

    def forget(self, rank: int) -> None:
        self._gpu.pop(rank, None)
        self._ecc_baseline.pop(rank, None)
        self._throttled.pop(rank, None)

    def evaluate(self, rank: int, sample: dict) -> Optional[tuple[GpuLevel, str]]:
        """One heartbeat's sample of ``rank``: None when fine (or the sample is empty: no GPU), else
        ``(GpuLevel.UNHEALTHY | GpuLevel.DEGRADED, "rank R GPU I: reason with the value")``, the worst state
        found. A field of the wrong type (text where a number belongs) is ignored: never raises."""
        if not sample or not isinstance(sample, dict):
            return None
        uuid = sample.get("uuid") if isinstance(sample.get("uuid"), str) else None
        if rank in self._gpu and uuid != self._gpu[rank]:
            self.forget(rank)
        self._gpu[rank] = uuid
        unhealthy, degraded = [], []
        if sample.get("gpu_lost") is True:
            unhealthy.append("GPU is lost (NVML)")
        xids = sample.get("xids") if isinstance(sample.get("xids"), list) else []
        xids = [x for x in xids if _whole(x) is not None] or \
            ([sample["xid"]] if _whole(sample.get("xid")) is not None else [])
        critical = [x for x in xids if x in self.critical_xids]
        if critical:
            unhealthy.append(f"critical XID {', '.join(map(str, critical))}")
        ecc = _whole(sample.get("ecc_uncorrected"))
        if ecc is not None:
            baseline = self._ecc_baseline.get(rank)
            if baseline is None or ecc < baseline:
                self._ecc_baseline[rank] = baseline = ecc
            if ecc > baseline:
                unhealthy.append(f"{ecc - baseline} new uncorrected ECC errors ({ecc} since driver load)")
        temperature = finite(sample.get("temperature_c"))
        if temperature is not None and temperature > self.max_temperature_c:
            degraded.append(f"temperature {sample['temperature_c']} C > {self.max_temperature_c} C")
        throttle = sample.get("throttle") if isinstance(sample.get("throttle"), list) else ()
        slowdown = [r for r in throttle if isinstance(r, str) and r in HW_THROTTLE]
        self._throttled[rank] = streak = self._throttled.get(rank, 0) + 1 if slowdown else 0
        if slowdown and streak >= self.throttle_patience:
            degraded.append(f"{', '.join(slowdown)} for {streak} samples")
        if not (unhealthy or degraded):
            return None
        return (GpuLevel.UNHEALTHY if unhealthy else GpuLevel.DEGRADED,
                f"rank {rank} GPU {_whole(sample.get('index'))}: {'; '.join(unhealthy or degraded)}")

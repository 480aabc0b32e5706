"""TrainMover's rank-side runtime, imported by training scripts: ``session = worker.init()``.

Submodules: ``session`` (public API and the step loop), ``agent`` (ZeroMQ link to tmd), ``commands`` (the agent
thread's handling of tmd's commands), ``control`` (where the process stands: the one Condition both threads share),
``migration`` (joiner, leaver, stayers), ``recovery`` (survivors and replacements after a failure), ``reports``
(what a rank tells tmd), ``exit`` (the one way to end the process early), ``groups`` (generations, two-phase
setup), ``sandbox`` (record/replay), ``transfer`` (peer-to-peer state transfer), ``rank_state`` (each rank's
own RNG and rank-local state, kept by every rank; the replica fingerprint), ``misuse`` (unmanaged DDP/FSDP state), ``object_collectives`` (``all_gather_object`` & co. under a failure), ``gpu_health`` (NVML probe),
``backend`` and ``_C`` (the mover Backend).
Imports are lazy so that ``import worker`` stays cheap until ``init()`` is called.
"""
from __future__ import annotations

from typing import Any

__all__ = ["init", "Session", "LeaverExit", "StepAborted"]


def init(*args: Any, **kwargs: Any):
    """See :func:`worker.session.init`."""
    from worker.session import init as _init

    return _init(*args, **kwargs)


def __getattr__(name: str) -> Any:
    if name in ("Session", "LeaverExit", "StepAborted"):
        from worker import session

        return getattr(session, name)
    raise AttributeError(name)

"""TrainMover's rank-side runtime, imported by training scripts: ``session = worker.init()``.

Submodules: ``session`` (public API), ``agent`` (ZeroMQ link to tmd), ``groups`` (generations, two-phase setup),
``sandbox`` (record/replay), ``transfer`` (peer-to-peer state transfer), ``backend`` and ``_C`` (the mover Backend).
Imports are lazy so that ``import worker`` stays cheap until ``init()`` is called.
"""
from __future__ import annotations

from typing import Any

__all__ = ["init", "Session", "LeaverExit"]


def init(*args: Any, **kwargs: Any):
    """See :func:`worker.session.init`."""
    from worker.session import init as _init

    return _init(*args, **kwargs)


def __getattr__(name: str) -> Any:
    if name in ("Session", "LeaverExit"):
        from worker import session

        return getattr(session, name)
    raise AttributeError(name)

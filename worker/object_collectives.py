"""torch.distributed's object collectives under a peer's failure: :class:`StepAborted`, not garbage.

Once a collective of a step failed (a peer died, hung or was cut off) the movers latch the failure and complete
the step's later collectives with their outputs as they are (csrc/mover_backend.cpp), so that the step reaches the
optimizer, which refuses its update. Tensor collectives then return stale values the step throws away, but the
object collectives unpickle theirs: ``all_gather_object`` read a zero-length buffer (``EOFError``) and
``broadcast_object_list`` sized its buffer from an uncommunicated tensor. A script in the README's plain loop, which
catches only ``worker.StepAborted``, died of that, and the job failed as if every survivor had been lost.

:func:`install` (by ``worker.init()``) wraps each of :data:`NAMES` in ``torch.distributed`` (and
``torch.distributed.distributed_c10d``, where torch's own callers look them up) once per process: while the failure
is latched (worker.step_ledger ``failure``) the call raises :class:`StepAborted` before it starts, an exception
raised inside it becomes :class:`StepAborted` (chained), and a call that returned while the failure was latched
raises it too (its outputs were not communicated). Without a failure the call is torch's, unchanged. A script that
bound one of these functions to a name of its own before ``worker.init()`` (``from torch.distributed import
all_gather_object``) keeps torch's.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional

from worker.control import Control
from worker.step_ledger import StepAborted, failure

NAMES = ("all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list", "send_object_list",
         "recv_object_list")

_control: Optional[Control] = None  # the session's, once install() ran


def _aborted(name: str, why: str) -> StepAborted:
    return StepAborted(f"torch.distributed.{name}: a peer's failure is latched ({why}); the step is redone after "
                       "recovery")


def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (one of :data:`NAMES`) raising :class:`StepAborted` while a failure is latched (module docstring)."""
    name = fn.__name__

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        control = _control
        if control is None:
            return fn(*args, **kwargs)
        why = failure(control)
        if why is not None:
            raise _aborted(name, why)
        try:
            out = fn(*args, **kwargs)
        except Exception as e:
            why = failure(control)
            if why is None:
                raise
            raise _aborted(name, why) from e
        why = failure(control)
        if why is not None:  # completed without communicating: its objects are not the peers'
            raise _aborted(name, why)
        return out

    call.tm_wrapped = fn  # type: ignore[attr-defined]
    return call


def install(control: Control) -> None:
    """Make the object collectives of ``torch.distributed`` raise :class:`StepAborted` under ``control``'s latched
    failures (module docstring). Wraps each once per process; a later call only changes the Control."""
    global _control
    _control = control
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    for name in NAMES:
        fn = getattr(c10d, name, None)
        if fn is None or hasattr(fn, "tm_wrapped"):
            continue
        wrapped = wrap(fn)
        setattr(c10d, name, wrapped)
        if getattr(dist, name, None) is fn:
            setattr(dist, name, wrapped)

"""The one way a worker process ends early: :func:`exit_process` (``code``, ``why``).

A worker process leaves without unwinding the training script in a few cases only, and every one of them goes
through here, so that its log always says why and its exit status is one of :class:`tmd.protocol.ExitCode`:

- tmd releases a standby, a joiner or a fenced process (``Release``): its ``exit_code`` (``OK``, ``REFUSED``,
  ``FENCED``), at once on the agent thread (worker.commands);
- a joiner's migration is aborted (``Decide(commit=False)``): ``OK``, at once on the agent thread; its sandboxed
  process is thrown away and tmd starts a fresh standby;
- a joiner whose state transfer failed, or whose migration was not committed, while no recovery plan came:
  ``FAILED`` (worker.migration);
- a replacement whose recovery failed (``FAILED``), or a rank that heard nothing from tmd for
  ``RECOVERY_TIMEOUT_S`` seconds while waiting in a recovery (``FAILED``) (worker.recovery);
- a rank whose replicated state differs from its replicas' after a migration or recovery: ``FAILED``, after
  reporting ``RankFailed(state_mismatch)`` (worker.session, from worker.step_exchange's fingerprint check);
- a leaver that handed its rank over: ``OK`` from an ``atexit`` handler, after the script's own ``finally``
  blocks ran, skipping the interpreter's teardown (seconds of CPU for torch, stolen from co-located ranks).

``os._exit`` skips ``atexit`` handlers and buffered output, hence the explicit flush.
"""
from __future__ import annotations

import os
import sys
from typing import Callable, NoReturn, TextIO, Union

from tmd import protocol as p

_before_exit: list[Callable[[], None]] = []


def before_exit(fn: Callable[[], None]) -> None:
    """Have :func:`exit_process` call ``fn()`` before the process ends (errors ignored; keep it short:
    worker.backend releases the group setups this rank still holds in the job's store, a second at most)."""
    _before_exit.append(fn)


def describe(code: Union[p.ExitCode, int]) -> str:
    """``"3 (FENCED)"``: an exit code with its :class:`p.ExitCode` name when it has one."""
    try:
        return f"{int(code)} ({p.ExitCode(int(code)).name})"
    except ValueError:
        return str(int(code))


def exit_process(code: Union[p.ExitCode, int], why: str) -> NoReturn:
    """Print ``[worker] exiting with code <code> (<NAME>): <why>`` (to stdout for ``ExitCode.OK``, to stderr
    otherwise), run what :func:`before_exit` registered, flush stdout and stderr, and end the process with
    ``code`` (``os._exit``: no ``atexit`` handlers, no interpreter teardown). ``code`` is a :class:`p.ExitCode`,
    or the code tmd put in a ``Release``. Never returns; printing errors (a closed stream) are ignored."""
    status = int(code)
    stream: TextIO = sys.stdout if status == p.ExitCode.OK else sys.stderr
    try:
        print(f"[worker] exiting with code {describe(status)}: {why}", file=stream, flush=True)
    except Exception:  # noqa: BLE001 - a closed or broken stream must not keep the process alive
        pass
    for fn in _before_exit:
        try:
            fn()
        except Exception:  # noqa: BLE001 - ending the process comes first
            pass
    flush_stdio()
    os._exit(status)


def flush_stdio() -> None:
    """Flush stdout and stderr before an ``os._exit``; errors (a closed stream) are ignored."""
    for s in (sys.stdout, sys.stderr):
        try:
            s.flush()
        except Exception:  # noqa: BLE001
            pass

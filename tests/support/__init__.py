"""Helpers shared by the end-to-end tests."""
from __future__ import annotations

import os
import time

from tmd.journal import read_events


def events(run_dir: str) -> list[dict]:
    """tmd's journal of ``run_dir`` (``events.jsonl``), oldest first."""
    return read_events(os.path.join(run_dir, "events.jsonl"))


def wait_until(predicate, timeout_s: float, what: str, poll_s: float = 0.1):
    """``predicate()``'s first truthy value, polled every ``poll_s`` s; AssertionError after ``timeout_s`` s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)  # polling another process's (or SLURM's) state: there is no event to wait on
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")

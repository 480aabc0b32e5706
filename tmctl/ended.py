"""A job whose tmd no longer answers: tmctl reads the run directory's journal (``events.jsonl``) instead.

:func:`find_run_dir` finds the run directory the CLI's options point at (the same order as
:func:`tmctl.client.find_coordinator`; an explicit ``--coordinator`` names no run directory unless ``--run-dir`` is
given too); :func:`last_known` condenses the journal into the last known state of the job, marked ``ended`` when
tmd journalled its own stop (``tmd_stopped``). A journal without it means tmd died (``tmd resume`` restarts it).
"""
from __future__ import annotations

import json
import os
from typing import Optional

from tmctl.client import DEFAULT_RUN_DIR
from tmd.journal import read_events
from tmd.protocol import layout
from tmd.protocol.vocab import Event


def find_run_dir(coordinator: Optional[str], run_dir: Optional[str], job: Optional[str]) -> Optional[str]:
    """The run directory whose ``events.jsonl`` exists for these options, or None."""
    candidates: list[str] = []
    if run_dir:
        candidates.append(run_dir)
    elif coordinator or os.environ.get("TM_COORDINATOR"):
        return None
    elif job:
        try:
            with open(layout.job_tmd_json(job)) as f:
                info = json.load(f)
            if isinstance(info, dict) and isinstance(info.get("run_dir"), str):
                candidates.append(info["run_dir"])
        except (OSError, ValueError):
            return None
    elif os.environ.get("TM_RUN_DIR"):
        candidates.append(os.environ["TM_RUN_DIR"])
    else:
        candidates.append(DEFAULT_RUN_DIR)
    for path in candidates:
        if os.path.exists(layout.RunDir(path).events):
            return path
    return None


def read_journal(run_dir: str) -> list[dict]:
    """Every event of ``run_dir``'s journal, oldest first."""
    return read_events(layout.RunDir(run_dir).events)


def last_known(run_dir: str, events: Optional[list[dict]] = None) -> dict:
    """The job's last known state from its journal: ``ended`` (tmd journalled its stop), ``job``, ``run_dir``,
    ``exit_code`` (None if tmd did not stop cleanly), ``reason`` (why it failed, or None), ``failure`` (the rank's
    report: rank_failed or startup_failed fields, or None), ``warnings`` (job_warning fields), ``step`` (the last
    step seen), ``config`` (the job's settings: the last job_config's, or None), ``last_event`` (seq, ts (epoch
    seconds), event)."""
    events = read_journal(run_dir) if events is None else events
    out: dict = {"ended": False, "job": None, "run_dir": os.path.abspath(run_dir), "exit_code": None,
                 "reason": None, "failure": None, "warnings": [], "step": None, "config": None,
                 "last_event": None}
    for ev in events:
        name = ev.get("event")
        if name == Event.TMD_STARTED:
            out["job"] = ev.get("job")
        elif name == Event.TMD_STOPPED:
            out["exit_code"] = ev.get("exit_code")
        elif name == Event.JOB_FAILED:
            out["reason"] = ev.get("reason")
        elif name in (Event.RANK_FAILED, Event.STARTUP_FAILED):
            out["failure"] = {k: v for k, v in ev.items() if k not in ("seq", "ts")}
        elif name == Event.JOB_CONFIG:
            out["config"] = ev.get("config")
        elif name in (Event.JOB_WARNING, Event.NO_REPLICA):  # as the live status lists them (tmd.daemon.status)
            out["warnings"].append({k: ev.get(k) for k in ("rank", "node", "code", "message")})
        steps = [ev["step"]] if isinstance(ev.get("step"), int) else []
        if name == Event.STEP_TIMES and isinstance(ev.get("steps"), list):  # [[step, ts, seconds], ...]
            steps += [row[0] for row in ev["steps"] if isinstance(row, list) and row and isinstance(row[0], int)]
        if steps:
            out["step"] = max(steps) if out["step"] is None else max(out["step"], *steps)
    if events:
        last = events[-1]
        out["ended"] = last.get("event") == Event.TMD_STOPPED
        out["last_event"] = {k: last.get(k) for k in ("seq", "ts", "event")}
    return out

"""Where the benchmarks keep their results: ``benchmarks/results/<name>.json`` and a timeline picture per job.

:func:`save` writes a benchmark's result (what it prints on stdout) with a description of the machine it ran on
(:func:`machine`), and beside it one PNG per run directory that has a journal: the job's step times with its
migrations and incidents shaded (:mod:`tmctl.timeline_plot`, as ``tmctl timeline --png`` draws it).
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import socket
import sys
from typing import Optional, Sequence

from benchmarks import docs_page

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def _cpu_model() -> Optional[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _memory_bytes() -> Optional[int]:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def machine() -> dict:
    """The machine a result was measured on: hostname, CPU model and count, memory (bytes), python and torch
    versions, platform, and the date (ISO 8601, UTC)."""
    try:
        import torch

        torch_version: Optional[str] = torch.__version__
    except ImportError:
        torch_version = None
    return {"hostname": socket.gethostname(), "cpu_model": _cpu_model(), "cpu_count": os.cpu_count(),
            "memory_bytes": _memory_bytes(), "python": platform.python_version(), "torch": torch_version,
            "platform": platform.platform(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


ISOLATE_HELP = ("run every job with tmd local --isolate-nodes: each emulated node on CPUs of its own, standbys and "
                "guards apart from the active ranks (tmd/cpusets.py); the split is in the JSON's 'isolation'")


def isolation(run_dir: str) -> Optional[dict]:
    """The CPU split a job of ``run_dir`` ran with (its journal's ``nodes_isolated`` event: mechanism, active and
    standby CPUs, each node's set), or None for a job whose nodes shared this host's cores (co-located)."""
    from tmd.journal import read_events
    from tmd.protocol import layout
    from tmd.protocol.vocab import Event

    path = layout.RunDir(run_dir).events
    events = read_events(path) if os.path.exists(path) else []
    found = next((e for e in events if e["event"] == Event.NODES_ISOLATED), None)
    return None if found is None else {k: v for k, v in found.items() if k not in ("seq", "ts", "event")}


def setting(isolated: bool) -> str:
    """How a benchmark's emulated nodes shared the host: ``isolated`` or ``co-located``."""
    return "isolated" if isolated else "co-located"


def result_name(name: str, isolated: bool) -> str:
    """The name a benchmark's result is saved under: ``<name>`` co-located, ``<name>-isolated`` isolated, so that
    both settings are kept side by side in ``benchmarks/results/``."""
    return f"{name}-isolated" if isolated else name


def save(name: str, result: dict, run_dirs: Sequence[str] = (), results_dir: str = RESULTS_DIR) -> list[str]:
    """Write ``<results_dir>/<name>.json`` (``result`` plus ``machine``: :func:`machine`; ``<name>-isolated.json``
    when ``result["setting"]`` is ``isolated``: :func:`result_name`) and, for each of
    ``run_dirs`` whose ``events.jsonl`` exists, its timeline picture ``<name>.png`` (one run dir) or
    ``<name>-<k>.png`` (k = 1, 2, ... over the run dirs given). Returns the paths written. A picture that cannot be
    drawn is reported on stderr and skipped: the JSON is what matters. Saving into ``benchmarks/results/`` of a
    checkout also regenerates ``docs/benchmarks.md`` (:mod:`benchmarks.docs_page`). Raises OSError when the JSON
    cannot be written."""
    from tmd import timeline
    from tmd.journal import read_events
    from tmd.protocol import layout

    name = result_name(name, result.get("setting") == setting(True))
    os.makedirs(results_dir, exist_ok=True)
    written = []
    path = os.path.join(results_dir, f"{name}.json")
    with open(path, "w") as f:
        json.dump({**result, "machine": machine()}, f, indent=2, default=str)
        f.write("\n")
    written.append(path)
    for k, run_dir in enumerate(run_dirs, 1):
        journal = layout.RunDir(run_dir).events
        if not os.path.exists(journal):
            continue
        png = os.path.join(results_dir, f"{name}.png" if len(run_dirs) == 1 else f"{name}-{k}.png")
        try:
            from tmctl import timeline_plot

            tl = timeline.build(read_events(journal))
            timeline_plot.draw(tl.to_dict(), png, title=f"{name}: {os.path.basename(os.path.normpath(run_dir))}")
        except Exception as e:  # noqa: BLE001 - a picture that fails never loses the measured result
            print(f"[report] no picture for {run_dir}: {type(e).__name__}: {e}", file=sys.stderr)
            continue
        written.append(png)
    if os.path.abspath(results_dir) == os.path.abspath(RESULTS_DIR) and os.path.isdir(os.path.dirname(docs_page.PAGE)):
        with open(docs_page.PAGE, "w", encoding="utf-8") as f:  # the docs' benchmarks page, current with this run
            f.write(docs_page.render(results_dir))
        written.append(docs_page.PAGE)
    return written

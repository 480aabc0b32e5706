"""Memory of the stayers, the leaver and the joiner around a planned migration. Prints one JSON object.

    python -m benchmarks.memory [--steps 45] [--migrate-at 15] [--tiny] [--run-dir tmrun/bench-memory]

Workload: the demo's (byte-level GPT, DDP, 2 nodes x 2 ranks + standby s1, AdamW, Shakespeare), local mode; n2
moves to s1 once training is past ``--migrate-at`` and s1 is warm.

A sampler polls tmd's status (the job's step) and reads, every ``SAMPLE_S`` seconds, each rank process's RSS and
USS (psutil ``memory_full_info``: pages only this process maps) and its peak RSS (``VmHWM`` in
``/proc/<pid>/status``). Per stayer (n1's ranks) and summed over them, all in bytes:

- ``before``: the highest sample over the ``WINDOW`` steps before the request;
- ``during``: the highest sample from the request to one step past the switch step (phase 1's groups built, the
  swap, the transfer);
- ``after``: the highest sample over steps ``switch + SETTLE`` to ``switch + SETTLE + WINDOW`` (the old
  generation destroyed, the downtime window over);
- ``drift``: the same "highest over ``WINDOW`` steps" ``WINDOW`` steps earlier than ``before``, against
  ``before``: how much RSS moves with no migration at all (the noise floor of the growth figures).

``growth_during`` / ``growth_after`` = during / before - 1 and after / before - 1 (RSS and USS). Leaver vs joiner:
each process's peak RSS (VmHWM; the leaver's last read before it exits), per local rank, and the ratio joiner /
leaver. Targets (issue 12, target 7): stayers' RSS growth during and after <= 1% (summed over the stayers; a fall
is no growth), joiner's peak <= 1.10 x the leaver's. Reported, not asserted.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from typing import Optional

import psutil

from benchmarks import report
from tmctl.client import CoordinatorUnreachable
from tmctl.localjob import final_hashes, job_client, migrate_when_ready, tmd_command
from tmd import protocol as p

SAMPLE_S = 0.25  # seconds between samples
WINDOW = 4  # steps per measuring window
SETTLE = 5  # steps after the switch step before the "after" window (the downtime window)
RSS_GROWTH_MAX = 0.01
JOINER_OVER_LEAVER_MAX = 1.10


def registered_pids(run_dir: str) -> dict[str, dict[int, int]]:
    """node -> {local_rank: pid} from the journal's ``worker_registered`` events."""
    out: dict[str, dict[int, int]] = {}
    path = p.layout.RunDir(run_dir).events
    if not os.path.exists(path):
        return out
    with open(path) as f:
        for line in f:
            e = json.loads(line)
            if e["event"] == p.Event.WORKER_REGISTERED:
                out.setdefault(e["node"], {})[e["local_rank"]] = e["pid"]
    return out


def vm_hwm_bytes(pid: int) -> Optional[int]:
    """Peak RSS (``VmHWM``, bytes) of ``pid``, None when it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def sample(pid: int) -> Optional[dict]:
    """{rss, uss, hwm} in bytes for ``pid``, None when it is gone."""
    try:
        full = psutil.Process(pid).memory_full_info()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None
    hwm = vm_hwm_bytes(pid)
    return {"rss": full.rss, "uss": full.uss, "hwm": hwm}


class Sampler(threading.Thread):
    """Samples every rank process of ``nodes`` every ``SAMPLE_S`` seconds with the job's current step:
    ``samples`` is a list of (step, pid, {rss, uss, hwm}); ``last_hwm``: pid -> the last VmHWM read."""

    def __init__(self, run_dir: str, client, nodes: tuple[str, ...]) -> None:
        super().__init__(daemon=True, name="memory-sampler")
        self.run_dir, self.client, self.nodes = run_dir, client, nodes
        self.samples: list[tuple[int, int, dict]] = []
        self.last_hwm: dict[int, int] = {}
        self.pids: dict[str, dict[int, int]] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                st = self.client.request(p.StatusRequest())
            except CoordinatorUnreachable:
                break
            if isinstance(st, p.StatusReply):
                self.pids = registered_pids(self.run_dir)
                for node in self.nodes:
                    for pid in self.pids.get(node, {}).values():
                        s = sample(pid)
                        if s is not None:
                            self.samples.append((st.step, pid, s))
                            if s["hwm"] is not None:
                                self.last_hwm[pid] = s["hwm"]
            self.stop.wait(SAMPLE_S)


def window_max(samples: list[tuple[int, int, dict]], pid: int, lo: int, hi: int, key: str) -> Optional[int]:
    """Highest ``key`` of ``pid``'s samples taken at steps ``lo <= step <= hi``; None without one."""
    vals = [s[key] for step, q, s in samples if q == pid and lo <= step <= hi and s[key] is not None]
    return max(vals) if vals else None


def growth(after: Optional[int], before: Optional[int]) -> Optional[float]:
    return round(after / before - 1, 5) if after and before else None


def stayer_table(samples: list, pids: list[int], request_step: int, switch_step: int) -> dict:
    """Per stayer pid and summed: before / during / after / drift (RSS and USS, bytes) and the growth ratios."""
    windows = {
        "drift": (request_step - 2 * WINDOW, request_step - WINDOW - 1),
        "before": (request_step - WINDOW, request_step - 1),
        "during": (request_step, switch_step + 1),
        "after": (switch_step + SETTLE, switch_step + SETTLE + WINDOW),
    }
    per_pid = {}
    total: dict[str, dict[str, Optional[int]]] = {k: {w: 0 for w in windows} for k in ("rss", "uss")}
    for pid in pids:
        row = {}
        for key in ("rss", "uss"):
            for w, (lo, hi) in windows.items():
                v = window_max(samples, pid, lo, hi, key)
                row[f"{key}_{w}_bytes"] = v
                total[key][w] = None if v is None or total[key][w] is None else total[key][w] + v
            for w in ("during", "after", "drift"):
                row[f"{key}_growth_{w}"] = growth(row[f"{key}_{w}_bytes"], row[f"{key}_before_bytes"])
        per_pid[str(pid)] = row
    summed = {}
    for key in ("rss", "uss"):
        for w in windows:
            summed[f"{key}_{w}_bytes"] = total[key][w]
        for w in ("during", "after", "drift"):
            summed[f"{key}_growth_{w}"] = growth(total[key][w], total[key]["before"])
    return {"windows_steps": windows, "per_process": per_pid, "total": summed}


def run(steps: int, migrate_at: int, tiny: bool, run_dir: str) -> dict:
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(os.path.dirname(os.path.abspath(run_dir)), exist_ok=True)
    with open(run_dir.rstrip("/") + ".log", "w") as log:
        proc = subprocess.Popen(tmd_command(run_dir, 1, steps, tiny, True), stdout=log, stderr=subprocess.STDOUT)
    sampler = None
    try:
        client = job_client(run_dir, proc)
        sampler = Sampler(run_dir, job_client(run_dir, proc), ("n1", "n2", "s1"))
        sampler.start()
        with contextlib.redirect_stdout(sys.stderr):  # stdout carries only the result
            m = migrate_when_ready(client, proc, migrate_at, "n2", "s1")
        request_step = min((step for step, _, _ in sampler.samples if step >= migrate_at), default=migrate_at)
        switch_step = m["switch_step"]
        while proc.poll() is None and (not sampler.samples
                                       or sampler.samples[-1][0] <= switch_step + SETTLE + WINDOW):
            time.sleep(0.2)
        rc = proc.wait(timeout=900)
    finally:
        if sampler is not None:
            sampler.stop.set()
            sampler.join(timeout=5)
        if proc.poll() is None:
            proc.terminate()
            proc.wait()
    pids = sampler.pids
    stayers = sorted(pids.get("n1", {}).values())
    table = stayer_table(sampler.samples, stayers, request_step, switch_step or request_step)
    pairs = {}
    for local_rank, leaver in sorted(pids.get("n2", {}).items()):
        joiner = pids.get("s1", {}).get(local_rank)
        lh, jh = sampler.last_hwm.get(leaver), sampler.last_hwm.get(joiner)
        pairs[str(local_rank)] = {"leaver_pid": leaver, "joiner_pid": joiner, "leaver_peak_rss_bytes": lh,
                                  "joiner_peak_rss_bytes": jh,
                                  "joiner_over_leaver": round(jh / lh, 4) if jh and lh else None}
    ratios = [v["joiner_over_leaver"] for v in pairs.values() if v["joiner_over_leaver"]]
    t = table["total"]
    # growth, not change: RSS that falls (the heap trim returning the retired generation's pages) uses no memory
    worst_growth = max((g for g in (t["rss_growth_during"], t["rss_growth_after"]) if g is not None), default=None)
    return {
        "state": m["state"], "exit_code": rc, "request_step": request_step, "switch_step": switch_step,
        "downtime_s": m["downtime_s"], "stayer_pause_s": m["pause_s"],
        "stayers": table, "leaver_vs_joiner": pairs,
        "joiner_over_leaver_max": max(ratios) if ratios else None,
        "final_hashes": final_hashes(run_dir),
        "series": {str(pid): [[step, s["rss"], s["uss"]] for step, q, s in sampler.samples if q == pid]
                   for pid in stayers},
        "met": {"stayer_rss_growth": worst_growth is not None and worst_growth <= RSS_GROWTH_MAX,
                "joiner_peak": bool(ratios) and max(ratios) <= JOINER_OVER_LEAVER_MAX},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=45)
    ap.add_argument("--migrate-at", type=int, default=15)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--run-dir", default="tmrun/bench-memory")
    ap.add_argument("--no-save", action="store_true", help="print only (do not write benchmarks/results)")
    args = ap.parse_args(argv)
    if args.migrate_at < 2 * WINDOW:
        ap.error(f"--migrate-at must be >= {2 * WINDOW} (two measuring windows before the request)")
    live = run(args.steps, args.migrate_at, args.tiny, args.run_dir)
    result = {
        "workload": {"model": "tiny" if args.tiny else "gpt-256x4", "nodes": 2, "ranks_per_node": 2,
                     "steps": args.steps, "migrate_at": args.migrate_at},
        "sample_s": SAMPLE_S, "window_steps": WINDOW, "settle_steps": SETTLE,
        "migration": live,
        "targets": {"stayer_rss_growth_max": RSS_GROWTH_MAX, "joiner_over_leaver_max": JOINER_OVER_LEAVER_MAX},
    }
    print(json.dumps(result), flush=True)
    if not args.no_save:
        report.save("memory", result, [args.run_dir])
    return 0 if live["state"] == p.MigrationState.COMMITTED else 1


if __name__ == "__main__":
    sys.exit(main())

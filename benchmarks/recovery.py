"""Failure-recovery downtime vs. a checkpoint-restart baseline, measured in one run. Prints one JSON object.

    python -m benchmarks.recovery [--steps 60] [--fail-at 20] [--tiny] [--faults kill,kill_guarded,stop]

Workload: the demo's (byte-level GPT, DDP, 2 nodes x 2 ranks + 1 warm standby s1, AdamW, Shakespeare), local mode.
Each fault kind gets its own fresh job: once training is past ``--fail-at`` and s1 is warm, every rank process of
node n2 gets the signal (``kill``: SIGKILL; ``stop``: SIGSTOP, then SIGCONT once tmd reports ``recovery_done``).
tmd detects it, halts the survivors, promotes s1, transfers state from a data-parallel replica and redoes the
interrupted step. ``kill_guarded`` runs tmd with ``--guards 1``: s1 warms in advance as the ranks of one node
(tmd.guards), and that node (``guarded_node``) is killed once the guard is warm; the recovery adopts s1 with no
warm-up left.

The signal goes out at a uniformly random point of the step: ``kill_offset_s`` (drawn from [0, median step), seeded
by ``--fail-at``) after the status poll that first saw step ``step_at_kill`` begin (``step_at_kill`` may be a step or
two past ``--fail-at`` if the standby was not warm yet).

Per fault:

- ``detection_latency_s``: tmd's ``node_failed`` journal timestamp minus the benchmark's ``time.time()`` taken just
  before the first ``os.kill``.
- ``recovery_downtime_s``: (time the redone step is seen committed) - (kill) - ``median_step_s``. "Seen committed"
  is the first ``tmctl`` status poll (every ``POLL_S``) after the incident is ``recovered`` whose ``step`` (the
  highest step an active rank started; ranks report a step when they begin the next one) is past the resume step.
  ``median_step_s`` is the median of the step times the ranks themselves report to tmd (``step_time_s`` in
  status, collected for every step the polls saw during the ``MEDIAN_WINDOW`` steps before the kill; this excludes
  poll jitter). ``median_step_polled_s`` is the same median from the poll timestamps, for comparison.
  ``recovery_downtime_from_last_commit_s`` uses the baseline's definition instead: (redone step seen committed) -
  (step before it seen committed, by the same polls) - ``median_step_s``; it also counts the part of the
  interrupted step done before the kill. (When n2 had already sent its share of the step's all-reduce, the
  survivors still commit that step after the kill and ``resume_step`` is ``step_at_kill + 1``: that "last commit"
  then comes after the kill and this figure is the smaller one.)
- ``phases_s``, ``bytes_moved``: from tmd's ``recovery_done`` event (tmd.recovery.Incident.phases_s: halt,
  warm_up, plan, transfer_and_regroup, after_warm_up, total); ``resume_step`` from ``recovery_plan``.
- ``timeline_s``: when each step of the recovery happened, in seconds after the kill: ``detected``
  (``node_failed``), ``halted`` (every survivor halted), ``plan_sent``, ``recovered`` (``recovery_done``: every
  party recovered, the replacements after their shadow iterations) and ``redone_step_committed`` (seen by the
  polls; ``recovery_downtime_s`` is this minus ``median_step_s``).
- ``bit_identical``: every rank's final state hash equals the uninterrupted reference run's (same seed and steps,
  no standby; run once and shared by all faults).
- ``stop`` only: the stopped processes get SIGCONT once ``recovery_done`` is journalled and the redone step is seen
  committed, while the job trains on; ``old_processes_gone`` (they, fenced by tmd, exited within
  ``GONE_TIMEOUT_S``; a zombie counts as gone) and ``fenced_exit_codes`` (their return codes from tmd's
  ``process_exit`` events; tmd fences with exit code 3). ``bit_identical`` then also says that the continued stale
  processes did not disturb the job.

Baseline (same run, ``benchmarks/cold_restart.run_cold_restart``): 4 plain gloo ranks train to ``--fail-at``, save
model + optimizer + data position with torch.distributed.checkpoint, exit, and 4 fresh processes load and go on.
It saves **once, at the restart point**, not every step, and its API has no per-step option. Its ``downtime_s``
(save + process restart + DDP warm-up + load + first-step excess) is ``checkpoint_restart_downtime_s``. A job that
checkpoints every step would instead pay ``checkpoint_s`` on every step (``per_step_checkpoint_overhead``, as a
fraction of its median step) and, at a failure, lose the save but gain failure detection and the lost partial step,
neither of which the baseline includes; ``checkpoint_restart_downtime_excl_save_s`` and ``ratio_excl_save`` give
that conservative view.

Targets (issue 12, target 2: failure recovery): recovery downtime <= 1 median step + 0.3 s, bit-identical; and
ratio >= 20x. They are reported in
``targets`` / ``met``, not asserted: the machine is shared and noisy.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time

import psutil

from benchmarks import report
from benchmarks.cold_restart import run_cold_restart
from tmctl.client import Client, CoordinatorUnreachable
from tmctl.localjob import final_hashes, job_client, tmd_command
from tmd import protocol as p

POLL_S = 0.01  # status poll period (s) in the step-time window and around the failure
IDLE_POLL_S = 0.2  # poll period (s) before that: startup is CPU-bound on a small machine, don't add to it
MEDIAN_WINDOW = 20  # steps before the kill whose step times make the median
GONE_TIMEOUT_S = 10.0  # how long (s) continued SIGSTOPped processes get to exit
FOLLOW_TIMEOUT_S = 300.0  # how long (s) to follow a recovery before giving up on it (and the job)
JOB_TIMEOUT_S = 900.0

DOWNTIME_SLACK_S = 0.3  # target: downtime <= 1 median step + this
RATIO_MIN = 20.0


def read_events(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "events.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def first_event(events: list[dict], name: str, after_ts: float = 0.0) -> dict | None:
    return next((e for e in events if e["event"] == name and e["ts"] >= after_ts), None)


def node_pids(run_dir: str, node: str) -> dict[int, int]:
    """local_rank -> pid of ``node``'s rank processes, from ``worker_registered`` events."""
    return {e["local_rank"]: e["pid"] for e in read_events(run_dir)
            if e["event"] == "worker_registered" and e["node"] == node}


def process_gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.NoSuchProcess:
        return True


class StepClock:
    """Polls tmd's status and keeps, per step value, when a poll first saw it (``seen``: step -> epoch s) and the
    step times the ranks reported (``reported``: (node, step) -> s)."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.seen: dict[int, float] = {}
        self.reported: dict[tuple[str, int], float] = {}

    def poll(self) -> p.StatusReply:
        st = self.client.request(p.StatusRequest())
        now = time.time()
        if isinstance(st, p.StatusReply):
            self.seen.setdefault(st.step, now)
            for n in st.nodes:
                if n["role"] == "active" and n["step"] is not None and n["step_time_s"] is not None:
                    self.reported.setdefault((n["name"], n["step"] - 1), n["step_time_s"])
        return st

    def median_step_s(self, before: int) -> float | None:
        """Median reported step time over the ``MEDIAN_WINDOW`` steps before step ``before``."""
        lo = before - MEDIAN_WINDOW
        times = [t for (_, s), t in self.reported.items() if lo <= s < before]
        return statistics.median(times) if times else None

    def median_step_polled_s(self, before: int) -> float | None:
        """The same median from poll timestamps (a gap of k steps between two polls counts as k equal steps)."""
        pts = sorted((s, t) for s, t in self.seen.items() if before - MEDIAN_WINDOW <= s <= before)
        per_step = []
        for (s0, t0), (s1, t1) in zip(pts, pts[1:]):
            per_step += [(t1 - t0) / (s1 - s0)] * (s1 - s0)
        return statistics.median(per_step) if per_step else None


def start_job(run_dir: str, standbys: int, steps: int, tiny: bool, script_args: tuple,
              tmd_args: tuple = ()) -> subprocess.Popen:
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(os.path.dirname(run_dir) or ".", exist_ok=True)
    with open(run_dir + ".log", "w") as log:  # tmd's own output (the ranks log to <run_dir>/logs)
        return subprocess.Popen(tmd_command(run_dir, standbys, steps, tiny, True, script_args, tmd_args),
                                stdout=log, stderr=subprocess.STDOUT)


def finish_job(proc: subprocess.Popen) -> int:
    try:
        return proc.wait(timeout=JOB_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait()


def run_reference(run_dir: str, steps: int, tiny: bool, script_args: tuple) -> dict:
    """The uninterrupted job (no standby): its final hashes."""
    rc = finish_job(start_job(run_dir, 0, steps, tiny, script_args))
    hashes = final_hashes(run_dir)
    return {"exit_code": rc, "hashes": hashes, "ranks_agree": len(hashes) == 4 and len(set(hashes.values())) == 1}


def wait_to_strike(clock: "StepClock", proc: subprocess.Popen, at_step: int) -> p.StatusReply | None:
    """Poll until training began step ``at_step`` with standby s1 warm (a general standby, or a guard done with
    its warm-up), polling fast only in the step-time window before it. None when the job ended first."""
    while True:
        if proc.poll() is not None:
            return None
        try:
            st = clock.poll()
        except CoordinatorUnreachable:
            continue  # tmd busy or gone: the next turn tells
        if st.step >= at_step and any(n["name"] == "s1" and n["warm"] for n in st.nodes):
            return st
        time.sleep(POLL_S if st.step >= at_step - MEDIAN_WINDOW - 1 else IDLE_POLL_S)


def struck_node(run_dir: str, guarded: bool, default: str) -> str:
    """The node to strike: the one a guard is warm for (``guarded``: its ``guard_assigned`` event), else
    ``default``."""
    if not guarded:
        return default
    return next(e["node"] for e in read_events(run_dir) if e["event"] == p.Event.GUARD_ASSIGNED)


def follow_recovery(clock: "StepClock", proc: subprocess.Popen, timeout_s: float,
                    begun: int) -> tuple[int | None, float | None, int]:
    """Poll until the incident is recovered and training began the step after its resume step (the redone step
    committed). Returns (the resume step or None, ``time.time()`` when that was seen or None, the highest step
    seen begun before the plan, at least ``begun``)."""
    resume, highest = None, begun
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            st = clock.poll()
        except CoordinatorUnreachable:
            continue
        rec = st.recovery
        if rec and rec.get("resume_step") is not None:
            resume = rec["resume_step"]
            if rec["state"] == p.IncidentState.RECOVERED and st.step >= resume + 1:
                return resume, time.time(), highest
        else:
            highest = max(highest, st.step)
        time.sleep(POLL_S)
    return resume, None, highest


def inject_failure(run_dir: str, steps: int, fail_at: int, tiny: bool, script_args: tuple, sig: signal.Signals,
                   reference: dict, after_recovery=None, guarded: bool = False) -> dict:
    """Start the job with standby s1, send ``sig`` to every n2 rank process at step >= ``fail_at`` with s1 warm,
    follow the recovery to the redone step's commit, call ``after_recovery(pids, proc)`` (its dict is merged
    into the result), wait for the job and measure. ``guarded``: run tmd with ``--guards 1`` and strike the node
    s1 guards once the guard is warm (tmd.guards: s1 is adopted with no warm-up left)."""
    proc = start_job(run_dir, 1, steps, tiny, script_args, ("--guards", "1") if guarded else ())
    extra: dict = {}
    pids: dict[int, int] = {}
    try:
        clock = StepClock(job_client(run_dir, proc))
        st = wait_to_strike(clock, proc, fail_at)
        if st is None:
            return job_ended_early(run_dir, proc.returncode)
        victim = struck_node(run_dir, guarded, "n2")
        if guarded:
            extra["guarded_node"] = victim
        pids = node_pids(run_dir, victim)
        step_at_kill = st.step
        median = clock.median_step_s(step_at_kill)
        kill_offset = random.Random(fail_at).uniform(0.0, median or 0.0)  # a failure strikes anywhere in a step
        time.sleep(kill_offset)
        t_kill = time.time()
        for pid in pids.values():
            os.kill(pid, sig)
        resume, t_committed, _ = follow_recovery(clock, proc, FOLLOW_TIMEOUT_S, st.step)
        if after_recovery is not None:
            extra.update(after_recovery(pids, proc))
        if t_committed is None and proc.poll() is None:
            extra["error"] = f"no committed step after the resume step within {FOLLOW_TIMEOUT_S:.0f} s; job stopped"
            proc.terminate()
        rc = finish_job(proc)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait()
        if sig == signal.SIGSTOP:  # never leave stopped processes behind, whatever happened
            for pid in pids.values():
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass

    events = read_events(run_dir)
    failed = first_event(events, "node_failed", t_kill - 1.0)
    done = first_event(events, "recovery_done", t_kill - 1.0)
    plan = first_event(events, "recovery_plan", t_kill - 1.0)
    job_failed = first_event(events, "job_failed")
    halted = first_event(events, "recovery_halted", t_kill - 1.0)
    downtime = t_committed - t_kill - median if (t_committed and median is not None) else None
    t_prev = clock.seen.get(resume) if resume is not None else None
    hashes = final_hashes(run_dir)
    return {
        "exit_code": rc,
        "step_at_kill": step_at_kill,
        "kill_offset_s": round(kill_offset, 4),
        "killed_pids": sorted(pids.values()),
        "failure_signal": failed["signal"] if failed else None,
        "detection_latency_s": round(failed["ts"] - t_kill, 4) if failed else None,
        "resume_step": plan["resume_step"] if plan else resume,
        "median_step_s": round(median, 4) if median is not None else None,
        "median_step_polled_s": round(m, 4) if (m := clock.median_step_polled_s(step_at_kill)) is not None else None,
        "recovery_downtime_s": round(downtime, 4) if downtime is not None else None,
        "recovery_downtime_from_last_commit_s": round(t_committed - t_prev - median, 4)
        if (t_committed and t_prev and median is not None) else None,
        "kill_to_recovery_done_s": round(done["ts"] - t_kill, 4) if done else None,
        "phases_s": done["phases_s"] if done else None,
        "timeline_s": timeline_s(t_kill, {"detected": failed, "halted": halted, "plan_sent": plan, "recovered": done},
                                 t_committed),
        "bytes_moved": done["bytes_moved"] if done else None,
        "job_failed": job_failed.get("reason") if job_failed else None,
        "bit_identical": reference["ranks_agree"] and hashes == reference["hashes"],
        **extra,
    }


def timeline_s(t_kill: float, events: dict[str, dict | None], t_committed: float | None) -> dict[str, float]:
    """Seconds after the kill (epoch ``t_kill``) of each journal event of ``events`` (name -> event or None: left
    out) and of ``t_committed`` as ``redone_step_committed`` (None: left out)."""
    marks = {name: e["ts"] for name, e in events.items() if e is not None}
    if t_committed is not None:
        marks["redone_step_committed"] = t_committed
    return {name: round(t - t_kill, 4) for name, t in marks.items()}


def job_ended_early(run_dir: str, rc: int) -> dict:
    """The job ended before the fault was injected: report why instead of measuring."""
    events = read_events(run_dir)
    why = [{k: e.get(k) for k in ("event", "node", "reason", "signal")}
           for e in events if e["event"] in ("node_failed", "job_failed")]
    return {"exit_code": rc, "error": f"job ended before the fault was injected; see {run_dir}.log", "events": why,
            "recovery_downtime_s": None, "median_step_s": None, "bit_identical": False}


def fault_kill(run_dir: str, steps: int, fail_at: int, tiny: bool, script_args: tuple, reference: dict) -> dict:
    """SIGKILL every rank process of n2."""
    return inject_failure(run_dir, steps, fail_at, tiny, script_args, signal.SIGKILL, reference)


def fault_kill_guarded(run_dir: str, steps: int, fail_at: int, tiny: bool, script_args: tuple,
                       reference: dict) -> dict:
    """SIGKILL every rank process of the node that standby s1 guards (``tmd local --guards 1``)."""
    return inject_failure(run_dir, steps, fail_at, tiny, script_args, signal.SIGKILL, reference, guarded=True)


def fault_stop(run_dir: str, steps: int, fail_at: int, tiny: bool, script_args: tuple, reference: dict) -> dict:
    """SIGSTOP every rank process of n2; once tmd reports ``recovery_done``, SIGCONT them: fenced, they must exit."""

    def resume_stopped(pids: dict[int, int], proc: subprocess.Popen) -> dict:
        deadline = time.monotonic() + FOLLOW_TIMEOUT_S
        while (first_event(read_events(run_dir), "recovery_done") is None and proc.poll() is None
               and time.monotonic() < deadline):
            time.sleep(0.05)
        t_cont = time.time()
        for pid in pids.values():
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + GONE_TIMEOUT_S
        while not all(process_gone(pid) for pid in pids.values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        gone = all(process_gone(pid) for pid in pids.values())
        exits: dict[int, int] = {}
        deadline = time.monotonic() + 2.0  # tmd reaps and journals an exit within a tick or so
        while len(exits) < len(pids) and time.monotonic() < deadline:
            exits = {e["local_rank"]: e["returncode"] for e in read_events(run_dir)
                     if e["event"] == "process_exit" and e["node"] == "n2" and e["ts"] >= t_cont}
            time.sleep(0.05)
        return {"old_processes_gone": gone, "gone_within_s": GONE_TIMEOUT_S,
                "fenced_exit_codes": [exits.get(lr) for lr in sorted(pids)]}

    return inject_failure(run_dir, steps, fail_at, tiny, script_args, signal.SIGSTOP, reference, resume_stopped)


FAULTS = {"kill": fault_kill, "kill_guarded": fault_kill_guarded, "stop": fault_stop}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--fail-at", type=int, default=20, help="inject the fault once training reaches this step")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--faults", default="kill,kill_guarded,stop",
                    help="comma-separated: kill, kill_guarded (the node a guard is warm for), stop")
    ap.add_argument("--min-step-time-s", type=float, default=0.0,
                    help="pad each training step to at least this (examples.train_gpt); 0: the plain workload")
    ap.add_argument("--run-dir", default="tmrun/bench_recovery")
    args = ap.parse_args(argv)
    faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    if unknown := [f for f in faults if f not in FAULTS]:
        ap.error(f"unknown fault kind(s): {unknown}; choose from {sorted(FAULTS)}")
    if not MEDIAN_WINDOW // 4 <= args.fail_at < args.steps - 5:
        ap.error("need a few steps before --fail-at and at least 5 after it")
    script_args = ("--min-step-time-s", str(args.min_step_time_s)) if args.min_step_time_s > 0 else ()

    reference = run_reference(os.path.join(args.run_dir, "reference"), args.steps, args.tiny, script_args)
    results = {f: FAULTS[f](os.path.join(args.run_dir, f), args.steps, args.fail_at, args.tiny, script_args, reference)
               for f in faults}
    cold = run_cold_restart(world=4, steps=args.steps, restart_at=args.fail_at, tiny=args.tiny)
    cold_downtime = cold["downtime_s"]
    cold_excl_save = cold_downtime - cold["checkpoint_s"]

    for r in results.values():
        ours = r["recovery_downtime_s"]
        r["ratio"] = round(cold_downtime / max(ours, 1e-3), 1) if ours is not None else None
        r["ratio_excl_save"] = round(cold_excl_save / max(ours, 1e-3), 1) if ours is not None else None
        r["met"] = {
            "downtime": ours is not None and ours <= DOWNTIME_SLACK_S,  # ours is beyond one median step already
            "ratio": r["ratio"] is not None and r["ratio"] >= RATIO_MIN,
            "ratio_excl_save": r["ratio_excl_save"] is not None and r["ratio_excl_save"] >= RATIO_MIN,
            "bit_identical": r["bit_identical"],
        }
    result = {
        "workload": {"model": "tiny" if args.tiny else "gpt-256x4", "nodes": 2, "ranks_per_node": 2, "standbys": 1,
                     "steps": args.steps, "fail_at": args.fail_at, "min_step_time_s": args.min_step_time_s},
        "reference": {"exit_code": reference["exit_code"], "ranks_agree": reference["ranks_agree"]},
        "faults": results,
        "checkpoint_restart": {
            "checkpoint_restart_downtime_s": round(cold_downtime, 4),
            "checkpoint_restart_downtime_excl_save_s": round(cold_excl_save, 4),
            "checkpoints": "once, at the restart point (run_cold_restart has no per-step option)",
            "per_step_checkpoint_overhead": round(cold["checkpoint_s"] / cold["median_step_s"], 3),
            **{k: cold[k] for k in ("median_step_s", "checkpoint_s", "restart_s", "warmup_s", "load_s",
                                    "first_step_s", "checkpoint_bytes", "ranks_agree")},
        },
        "targets": {"downtime_s_max": f"median_step_s + {DOWNTIME_SLACK_S}", "ratio_min": RATIO_MIN},
        "met": {k: all(r["met"][k] for r in results.values())
                for k in ("downtime", "ratio", "ratio_excl_save", "bit_identical")},
    }
    print(json.dumps(result), flush=True)
    report.save("recovery", result, [os.path.join(args.run_dir, f) for f in faults])  # one picture per fault
    ok = all(r["exit_code"] == 0 and r["bit_identical"] for r in results.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Effective training time ratio (ETTR) of a long run with repeated planned migrations, and of one with repeated
kill -9 failures, against an uninterrupted run in the same invocation. Prints one JSON object.

    python -m benchmarks.ettr [--minutes 10] [--migrate-every-s 60] [--kill-every-s 120] [--step-s 0.75]
                              [--runs migrate,kill] [--tiny] [--run-dir tmrun/bench-ettr]

Workload: the demo's (byte-level GPT, DDP, 2 nodes x 2 ranks, AdamW, Shakespeare), local mode, ``--steps`` steps
(default ``--minutes`` x 60 / ``--step-s``, the same in every run of the invocation). Each run starts as many
standby nodes as its events need plus one spare (a standby is used up by each event: a migration's leaver exits,
a killed node does not come back), and so does the uninterrupted run, so that the idle standby processes cost
the same in all of them.

- ``reference``: no event. Its median step time (the slowest rank's wall time per step, from tmd's
  ``step_times`` journal events, over its training part) is the *uninterrupted median step*.
- ``migrate``: a planned migration every ``--migrate-every-s`` seconds, alternating between the node holding ranks
  0-1 and the node holding ranks 2-3, each to a fresh warm standby (n2 -> s1, n1 -> s2, s1 -> s3, ...).
- ``kill``: every ``--kill-every-s`` seconds every rank process of one active node (alternating as above) gets
  SIGKILL; tmd recovers onto a standby.
- ``kill_guarded``: the same with ``tmd local --guards 2`` and 2 more standbys: every active node has a guard
  (tmd.guards), warm before each kill, which its recovery adopts with no warm-up; a new guard is placed on the
  node that took the ranks over.

The clock starts once every standby is warm and training is past ``WARMUP_STEPS`` (``t0``; the step then is
``first_step``): the *training part* of a
run is from the end of ``first_step`` to the end of the last step (``step_times`` timestamps), and events come at
``t0 + k x every`` while at least ``MIN_STEPS_LEFT`` steps remain. Per run::

    ETTR = (last_step - first_step) x uninterrupted median step / wall time of the training part

A step redone after a failure counts once; the time of the lost attempt is in the wall time.
``ettr_own_median`` uses instead the run's own median step before its first event (for comparison; on a shared
machine the two medians differ by the noise between runs, and a run's step time drifts by +-20 % over minutes).

Each event also gets its ``loss`` (:func:`event_loss`): the wall time of its window (from the step at the request
to ``AFTER_STEPS`` steps after the switch or redone step) over that many of the median of the ``BASELINE_STEPS``
steps just before it. Per run, ``lost_s_per_event`` is their median, ``ettr_event_losses`` = 1 - their sum / wall
time (the ETTR with no drift between or within runs in it), and ``ettr_at_cadence`` = 1 - ``lost_s_per_event`` /
the event period (that ETTR with events at the target's cadence all the way: a run's last minute or two has none,
``MIN_STEPS_LEFT``). A migration's event also carries its joiners' ``warm_up_s`` and ``shadow_steps`` (from
``migration_committed``): in local mode the joiners warm up on the stayers' cores. ``bit_identical``: every
rank's final state hash equals the reference's.

Targets (issue 12, target 5): ETTR >= 0.995 with migrations, >= 0.98 with kills, bit-identical final state in
both. ``met`` judges ``ettr_at_cadence``, ``met_vs_reference`` the ETTR against the reference's median (which the
drift between runs moves by a few percent either way). Reported, not asserted.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from typing import Optional

from benchmarks import report
from tmctl.client import Client, CoordinatorUnreachable
from tmctl.localjob import final_hashes, job_client, tmd_command
from tmd import protocol as p

WARMUP_STEPS = 10  # the clock starts no sooner than this step (the recorded first steps and process start-up)
MIN_STEPS_LEFT = 30  # no event once fewer steps than this remain (a migration's warm-up and switch need ~10)
POLL_S = 0.5  # status poll period (seconds)
FOLLOW_TIMEOUT_S = 300.0  # how long (seconds) to follow one event before giving up on the run
WARM_TIMEOUT_S = 600.0  # how long (seconds) the standbys get to be warm
BASELINE_STEPS = 20  # an event's own baseline: the median of this many steps before it (event_loss)
AFTER_STEPS = 5  # an event's window ends this many steps after its switch or redone step (tmd's downtime window)
TARGETS = {"migrate": 0.995, "kill": 0.98, "kill_guarded": 0.98}
KIND = {"migrate": "migrate", "kill": "kill", "kill_guarded": "kill"}  # a run's events
GUARDS = {"kill_guarded": 2}  # tmd local --guards: with 2 active nodes, every node is guarded (tmd.guards)


# --- pure parts (unit-tested) ----------------------------------------------------------------------------------
def step_series(events: list[dict]) -> dict[int, tuple[float, float]]:
    """step -> (ts of its end, epoch s; the slowest rank's step time, s) from ``step_times`` journal events. A step
    reported again (redone after a failure) keeps its last report."""
    out: dict[int, tuple[float, float]] = {}
    for e in events:
        if e.get("event") == p.Event.STEP_TIMES:
            for step, ts, seconds in e["steps"]:
                out[int(step)] = (float(ts), float(seconds))
    return out


def median_step_s(series: dict[int, tuple[float, float]], lo: int, hi: int) -> Optional[float]:
    """Median step time (seconds) over steps ``lo < step <= hi`` of ``series``; None without one."""
    times = [sec for step, (_, sec) in series.items() if lo < step <= hi]
    return statistics.median(times) if times else None


def ettr(series: dict[int, tuple[float, float]], first_step: int, median_s: float) -> dict:
    """ETTR of the training part from the end of ``first_step`` to the end of the last step in ``series``:
    ``steps`` (last - first), ``wall_s``, ``ideal_s`` (steps x ``median_s``) and ``ettr`` (ideal / wall, 5
    decimals). Raises ValueError when ``first_step`` is not in ``series`` or no step follows it."""
    if first_step not in series:
        raise ValueError(f"step {first_step} has no step_times entry")
    last = max(series)
    if last <= first_step:
        raise ValueError(f"no step after {first_step}")
    wall = series[last][0] - series[first_step][0]
    steps = last - first_step
    return {"first_step": first_step, "last_step": last, "steps": steps, "wall_s": round(wall, 3),
            "ideal_s": round(steps * median_s, 3), "ettr": round(steps * median_s / wall, 5)}


def event_loss(series: dict[int, tuple[float, float]], event_ts: float, end_step: int,
               before: int = BASELINE_STEPS) -> Optional[dict]:
    """The wall time one event cost, against the run's own steps just before it (drift between runs and over a
    run does not enter). The event's window runs from ``start``, the first step to end after ``event_ts`` (epoch
    s), to ``end_step`` (the switch step or the redone step plus ``AFTER_STEPS``); its baseline is the median
    time of the ``before`` steps before ``start``. Returns ``{"start_step", "end_step", "baseline_s", "window_s",
    "lost_s"}`` (seconds; ``lost_s`` = window wall time - its steps x baseline, a failed attempt's time
    included), or None when the window or its baseline is not in ``series``.

    A step the series lacks just before the window (tmd journals a step's time only once every rank reported it,
    and a kill can take a rank's report of its last step with it) moves the window's start back to the last step
    the series has, with the steps between counted in the window."""
    start = min((s for s, (ts, _) in series.items() if ts >= event_ts), default=None)
    if start is None or end_step < start or end_step not in series:
        return None
    start = next((s + 1 for s in range(start - 1, start - 1 - before, -1) if s in series), None)
    if start is None:
        return None
    base = [series[s][1] for s in range(start - before, start) if s in series]
    if len(base) < before // 2:
        return None
    baseline = statistics.median(base)
    window = series[end_step][0] - series[start - 1][0]
    return {"start_step": start, "end_step": end_step, "baseline_s": round(baseline, 6),
            "window_s": round(window, 3), "lost_s": round(window - (end_step - start + 1) * baseline, 3)}


def at_cadence(lost_s_per_event: Optional[float], every_s: float) -> Optional[float]:
    """ETTR of a run with an event every ``every_s`` seconds that each cost ``lost_s_per_event`` seconds:
    ``1 - lost / every`` (5 decimals); None without a loss or a cadence."""
    if lost_s_per_event is None or every_s <= 0:
        return None
    return round(1 - lost_s_per_event / every_s, 5)


def standbys_needed(expected_s: float, every_s: float) -> int:
    """Standby nodes a run of about ``expected_s`` seconds with an event every ``every_s`` seconds needs: one per
    event that fits, plus a spare (a slower run than expected fits no more events: they stop ``MIN_STEPS_LEFT``
    steps before the end)."""
    return (int(expected_s // every_s) if every_s > 0 else 0) + 1


# --- running a job ---------------------------------------------------------------------------------------------
def read_events(run_dir: str) -> list[dict]:
    path = p.layout.RunDir(run_dir).events
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def holder_of(st: p.StatusReply, rank: int) -> Optional[str]:
    """The active node holding ``rank``."""
    return next((n["name"] for n in st.nodes if n["role"] == p.NodeRole.ACTIVE and rank in (n["ranks"] or [])), None)


def warm_standbys(st: p.StatusReply, guards: bool = False) -> list[str]:
    """The warm standby nodes in name order (``guards``: warm guards too)."""
    roles = (p.NodeRole.STANDBY, p.NodeRole.GUARDING) if guards else (p.NodeRole.STANDBY,)
    return sorted((n["name"] for n in st.nodes if n["role"] in roles and n["warm"]),
                  key=lambda name: (len(name), name))


class Run:
    """One job of the invocation: started with ``standbys`` standby nodes; :meth:`drive` fires the events."""

    def __init__(self, name: str, run_dir: str, steps: int, standbys: int, tiny: bool, ranks_per_node: int,
                 guards: int = 0, isolate: bool = False) -> None:
        self.name, self.run_dir, self.steps, self.standbys, self.guards = name, run_dir, steps, standbys, guards
        self.ranks_per_node = ranks_per_node
        shutil.rmtree(run_dir, ignore_errors=True)
        os.makedirs(os.path.dirname(os.path.abspath(run_dir)), exist_ok=True)
        with open(run_dir.rstrip("/") + ".log", "w") as log:  # tmd's own output (the ranks log to <run_dir>/logs)
            tmd_args = (("--guards", str(guards)) if guards else ()) + (("--isolate-nodes",) if isolate else ())
            self.proc = subprocess.Popen(tmd_command(run_dir, standbys, steps, tiny, True, tmd_args=tmd_args),
                                         stdout=log, stderr=subprocess.STDOUT)
        self.client: Optional[Client] = None
        self.events: list[dict] = []
        self.t0: Optional[float] = None
        self.first_step: Optional[int] = None

    def status(self) -> Optional[p.StatusReply]:
        try:
            st = self.client.request(p.StatusRequest())
        except CoordinatorUnreachable:
            return None
        return st if isinstance(st, p.StatusReply) else None

    def wait_warm(self) -> None:
        """Wait until every standby is warm and training is past ``WARMUP_STEPS``; set ``t0`` and ``first_step``."""
        self.client = job_client(self.run_dir, self.proc)
        deadline = time.monotonic() + WARM_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name}: the job ended before its standbys were warm")
            st = self.status()
            if st is not None and len(warm_standbys(st, guards=True)) >= self.standbys and st.step >= WARMUP_STEPS \
                    and sum(n["role"] == p.NodeRole.GUARDING for n in st.nodes) >= self.guards:
                self.t0, self.first_step = time.time(), st.step
                return
            time.sleep(POLL_S)
        raise TimeoutError(f"{self.name}: standbys not warm within {WARM_TIMEOUT_S:.0f} s")

    def drive(self, kind: str, every_s: float) -> None:
        """Fire an event (``migrate`` or ``kill``) every ``every_s`` seconds from ``t0`` while at least
        ``MIN_STEPS_LEFT`` steps remain, alternating between the holders of rank 0 and of the last rank."""
        k = 0
        while self.proc.poll() is None:
            due = self.t0 + (k + 1) * every_s
            while time.time() < due and self.proc.poll() is None:
                time.sleep(min(POLL_S, max(0.0, due - time.time())))
            st = self.status()
            if st is None or self.proc.poll() is not None or st.step > self.steps - MIN_STEPS_LEFT:
                return
            rank = 0 if k % 2 else (st.world_size - 1)  # the last rank's node first (n2), then rank 0's, ...
            source = holder_of(st, rank)
            spares = warm_standbys(st, guards=kind == "kill")
            if source is None or not spares:
                print(f"[{self.name}] event {k + 1}: no {'holder' if source is None else 'warm standby'}; stop",
                      file=sys.stderr, flush=True)
                return
            rec = self.migrate(source, spares[0]) if kind == "migrate" else self.kill(st, source)
            rec.update({"k": k + 1, "step_at_request": st.step})
            self.events.append(rec)
            print(f"[{self.name}] event {k + 1}: {json.dumps(rec)}", file=sys.stderr, flush=True)
            if rec.get("state") not in (p.MigrationState.COMMITTED, p.IncidentState.RECOVERED):
                return
            k += 1

    def migrate(self, source: str, target: str) -> dict:
        t = time.time()
        reply = self.client.request(p.MigrateRequest(sources=[source], targets=[target]))
        if isinstance(reply, p.ErrorReply):
            return {"kind": "migrate", "source": source, "target": target, "state": "refused",
                    "reason": reply.message}
        mid = reply.migration["id"]
        deadline = time.monotonic() + FOLLOW_TIMEOUT_S
        m = reply.migration
        while time.monotonic() < deadline and self.proc.poll() is None:
            m = self.client.request(p.MigrationRequest(migration_id=mid)).migration
            if p.MigrationState(m["state"]).finished:
                break
            time.sleep(0.1)
        return {"kind": "migrate", "id": mid, "source": source, "target": target, "ts": round(t, 3),
                "state": m["state"], "reason": m.get("reason"), "switch_step": m.get("switch_step"),
                "took_s": round(time.time() - t, 3)}

    def kill(self, st: p.StatusReply, node: str) -> dict:
        pids = [pid for n in st.nodes if n["name"] == node for pid in n["pids"].values()]
        t = time.time()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + FOLLOW_TIMEOUT_S
        rec = None
        while time.monotonic() < deadline and self.proc.poll() is None:
            st = self.status()
            rec = st.recovery if st is not None else None
            if rec and rec.get("failed_nodes") and node in rec["failed_nodes"] and \
                    p.IncidentState(rec["state"]).finished:
                break
            time.sleep(0.1)
        return {"kind": "kill", "node": node, "pids": pids, "ts": round(t, 3),
                "state": rec["state"] if rec else None, "incident": rec and rec.get("id"),
                "resume_step": rec and rec.get("resume_step"), "took_s": round(time.time() - t, 3)}

    def finish(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        finally:
            if self.proc.poll() is None:
                self.proc.terminate()
                self.proc.wait()


def run_job(name: str, run_dir: str, steps: int, standbys: int, tiny: bool, kind: Optional[str],
            every_s: float, guards: int = 0, isolate: bool = False) -> dict:
    """Run one job to its end, firing ``kind`` events every ``every_s`` seconds (none for the reference), with
    ``guards`` guards (tmd local --guards), its nodes on CPUs of their own with ``isolate`` (--isolate-nodes). Returns its raw figures (series not included: see :func:`summarise`)."""
    run = Run(name, run_dir, steps, standbys, tiny, 2, guards, isolate)
    try:
        run.wait_warm()
        print(f"[{name}] standbys warm at step {run.first_step}", file=sys.stderr, flush=True)
        if kind is not None:
            run.drive(kind, every_s)
        rc = run.finish(timeout_s=max(1800.0, steps * 10.0))
    except BaseException:
        run.finish(timeout_s=0.1) if run.proc.poll() is None else None
        raise
    events = read_events(run_dir)
    series = step_series(events)
    committed = {e["migration_id"]: e for e in events if e["event"] == p.Event.MIGRATION_COMMITTED}
    for e in run.events:  # what each migration's joiners did before the switch
        if e["kind"] == "migrate" and e.get("id") in committed:
            e["warm_up_s"] = (committed[e["id"]].get("phases_s") or {}).get("warm_up")
            e["shadow_steps"] = committed[e["id"]].get("shadow_steps")
    return {"name": name, "run_dir": run_dir, "exit_code": rc, "standbys": standbys, "first_step": run.first_step,
            "t0": run.t0, "events": run.events, "series": series, "final_hashes": final_hashes(run_dir)}


def summarise(job: dict, ref_median_s: float, ref_hashes: dict) -> dict:
    """A run's figures: ETTR against ``ref_median_s``, its own median before its first event, bit identity."""
    series = job.pop("series")
    fig = ettr(series, job["first_step"], ref_median_s)
    first_event = min((e["step_at_request"] for e in job["events"]), default=fig["last_step"])
    own = median_step_s(series, job["first_step"], first_event)
    fig["ettr_own_median"] = round(fig["steps"] * own / fig["wall_s"], 5) if own else None
    fig["own_median_step_s"] = round(own, 6) if own else None
    fig["events_done"] = sum(1 for e in job["events"]
                             if e.get("state") in (p.MigrationState.COMMITTED, p.IncidentState.RECOVERED))
    fig["bit_identical"] = bool(ref_hashes) and job["final_hashes"] == ref_hashes
    for e in job["events"]:
        end = e.get("switch_step") if e["kind"] == "migrate" else e.get("resume_step")
        e["loss"] = event_loss(series, e["ts"], end + AFTER_STEPS) if isinstance(end, int) and "ts" in e else None
    lost = [e["loss"]["lost_s"] for e in job["events"] if e["loss"]]
    fig["lost_s_per_event"] = round(statistics.median(lost), 3) if lost else None
    fig["ettr_event_losses"] = round(1 - sum(lost) / fig["wall_s"], 5) \
        if lost and len(lost) == len(job["events"]) else None
    return {**job, **fig}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0, help="expected length of each run's training")
    ap.add_argument("--step-s", type=float, default=0.75,
                    help="expected step time (seconds), to turn --minutes into steps")
    ap.add_argument("--steps", type=int, default=0, help="steps per run (default: from --minutes and --step-s)")
    ap.add_argument("--migrate-every-s", type=float, default=60.0)
    ap.add_argument("--kill-every-s", type=float, default=120.0)
    ap.add_argument("--runs", default="migrate,kill,kill_guarded",
                    help="event runs after the reference, from: migrate, kill, kill_guarded")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--run-dir", default="tmrun/bench-ettr")
    ap.add_argument("--no-save", action="store_true", help="print only (do not write benchmarks/results)")
    ap.add_argument("--isolate-nodes", action="store_true", help=report.ISOLATE_HELP)
    args = ap.parse_args(argv)
    runs = [r for r in args.runs.split(",") if r]
    if any(r not in TARGETS for r in runs):
        ap.error(f"--runs takes {', '.join(TARGETS)}")
    steps = args.steps or round(args.minutes * 60 / args.step_s)
    if steps < WARMUP_STEPS + 2 * MIN_STEPS_LEFT:
        ap.error(f"a run needs at least {WARMUP_STEPS + 2 * MIN_STEPS_LEFT} steps (more --minutes or --steps)")
    expected_s = steps * args.step_s
    every = {"migrate": args.migrate_every_s, "kill": args.kill_every_s, "kill_guarded": args.kill_every_s}
    standbys = {r: standbys_needed(expected_s, every[r]) + GUARDS.get(r, 0) for r in runs}
    ref_standbys = max(standbys.values(), default=1)
    dirs = {"reference": os.path.join(args.run_dir, "reference"), **{r: os.path.join(args.run_dir, r) for r in runs}}

    ref = run_job("reference", dirs["reference"], steps, ref_standbys, args.tiny, None, 0.0,
                  isolate=args.isolate_nodes)
    ref_series = ref["series"]
    ref_median = median_step_s(ref_series, ref["first_step"], max(ref_series))
    results = {"reference": summarise(ref, ref_median, ref["final_hashes"])}
    for r in runs:
        job = run_job(r, dirs[r], steps, standbys[r], args.tiny, KIND[r], every[r], GUARDS.get(r, 0),
                      args.isolate_nodes)
        results[r] = summarise(job, ref_median, results["reference"]["final_hashes"])
        results[r]["ettr_at_cadence"] = at_cadence(results[r]["lost_s_per_event"], every[r])
    result = {
        "workload": {"model": "tiny" if args.tiny else "gpt-256x4", "nodes": 2, "ranks_per_node": 2, "steps": steps},
        "setting": report.setting(args.isolate_nodes),
        "isolation": report.isolation(dirs["reference"]),
        "uninterrupted_median_step_s": round(ref_median, 6),
        "uninterrupted_median_from": "the reference run (no event, same standbys) of this invocation",
        "every_s": {r: every[r] for r in runs},
        "guards": {r: GUARDS[r] for r in runs if r in GUARDS},
        "runs": results,
        "targets": {r: TARGETS[r] for r in runs},
        "met": {r: (results[r]["ettr_at_cadence"] or 0.0) >= TARGETS[r] and results[r]["bit_identical"]
                for r in runs},
        "met_vs_reference": {r: results[r]["ettr"] >= TARGETS[r] and results[r]["bit_identical"] for r in runs},
    }
    print(json.dumps(result, default=str), flush=True)
    if not args.no_save:
        report.save("ettr", result, [dirs[k] for k in ("reference", *runs)])
    ok = all(results[r]["exit_code"] == 0 for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Chaos soak: one long job under a seeded random schedule of faults, each repaired by the first tier that can (a
replica, a buddy snapshot, a checkpoint), against an uninterrupted run of the same job. Prints one JSON object.

    python -m benchmarks.chaos [--quick] [--events 30] [--seed 0] [--steps N] [--run-dir DIR] [--no-save]

Workload: the demo GPT (``--tiny`` with ``--quick``), DDP, 2 nodes x 2 ranks, 3 standbys, dropout drawn from
per-rank RNG streams, local mode with ``--checkpoint-dir`` and ``--checkpoint-every 10``. Events, drawn with
``random.Random(seed)``, one at a time once the job trains again with a warm standby (a standby is added by
request when none is left):

- ``kill``: kill -9 every process of one active node (replica tier: a standby takes its ranks);
- ``stop``: SIGSTOP every process of one active node (tmd finds it stopped, fences it; replica tier);
- ``migrate``: a planned migration of one active node to a warm standby;
- ``standby_kill``: kill -9 a standby's processes (it is started again and warms; the job is untouched);
- ``all_active``: kill -9 every active process at once (checkpoint tier: every process relaunched);
- ``corrupt_all_active``: one byte of the newest checkpoint flipped, then ``all_active`` (the checkpoint before it);
- ``tmd_kill``: kill -9 of ``tmd local``, then ``tmd resume --run-dir`` (the ranks train on; the resumed tmd
  re-learns the job and keeps the checkpoint tier: a later ``all_active`` is restarted by it).

Per event: its ``tier`` (``replica``, ``snapshot``, ``checkpoint``, ``migration`` or ``none``), ``downtime_s``
(a recovery's detection to recovered; a migration's downtime; a restart's failure to the first step after it) and
``work_lost_s`` (a restart's: training since the checkpoint; 0 where only the interrupted step is redone); for
``tmd_kill`` (tier ``none``) the rank's view: the longest gap between two consecutive steps' ends in ``step_times``
from the kill to a step after the re-learning, less that step's own time, and ``relearn_s`` (tmd's re-learning).
Per run:
``ettr`` (steps x the uninterrupted median step / the wall time of training), ``bit_identical`` (every rank's
final parameter, optimizer and RNG hash equals the uninterrupted run's) and the exit code.

Not in this soak (said in its output, ``not_covered``): a network partition (``--netns-node``; a tmd restarted
by ``tmd resume`` cannot recreate namespaces, so it would not restart such a job from a checkpoint), the TP x FSDP2
job of examples/train_llama.py with a node lost together with its snapshot keeper.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
from typing import Optional

from benchmarks import report
from tmctl.localjob import Job, diagnose, events, tmd_command, wait_until
from tmd import protocol as p
from worker import checkpoint as ck

KINDS = ("kill", "stop", "migrate", "standby_kill", "all_active", "corrupt_all_active", "tmd_kill")
GAP_STEPS = 6  # steps of training between two events (past the previous one's redone or resumed step)
EVENT_TIMEOUT_S = 240.0
# valid checkpoints an event needs before it fires: one to restart from; for a corruption, one to corrupt and one to
# fall back to. (Runs here fired them too early: a save in flight when a node was stopped or killed never
# commits, and the job then rightly failed with nothing to restart from.)
CHECKPOINTS_NEEDED = {"all_active": 1, "corrupt_all_active": 2}
# steps a kind needs left after it: tmd resume takes seconds to start, and the ranks train on meanwhile (a run here
# fired tmd_kill near the end: the ranks finished while tmd was down, and the resumed tmd, seeing none come back,
# restarted the job from its last checkpoint)
STEPS_AFTER = {"tmd_kill": 100}
QUICK_S_MAX = 480.0  # --quick: the whole soak (the uninterrupted run not included) within 8 minutes
NUMERICS = ("--dropout", "0.1", "--seed-mode", "per-rank")
# the soak's step floor, in the uninterrupted run too: its median step is the ETTR's unit, so both must be paced
# alike (a reference run at the tiny GPT's unpaced ~0.06 s/step made the 0.1 s steps of the soak count as lost time)
PACING = ("--min-step-time-s", "0.1")
NOT_COVERED = ["a network partition (--netns-node: a tmd restarted by tmd resume cannot recreate namespaces)",
               "TP x FSDP2 (examples/train_llama.py) with a node lost together with its snapshot keeper"]


def schedule(n: int, seed: int) -> list[str]:
    """``n`` event kinds drawn with ``random.Random(seed)``, every kind at least once when ``n`` allows."""
    rng = random.Random(seed)
    kinds = list(KINDS)[:n] + [rng.choice(KINDS) for _ in range(max(0, n - len(KINDS)))]
    rng.shuffle(kinds)
    return kinds


def finals(run_dir: str) -> dict[int, list[str]]:
    out = {}
    for path in glob.glob(os.path.join(run_dir, "final", "rank*.json")):
        with open(path) as f:
            d = json.load(f)
        out[d["rank"]] = [d["state_sha256"], d.get("rng_sha256")]
    return out


def step_ends(evs: list[dict]) -> dict[int, tuple[float, float]]:
    """step -> (ts of its end, slowest rank's seconds) from ``step_times``; a redone step keeps its last report."""
    out = {}
    for e in evs:
        if e["event"] == p.Event.STEP_TIMES:
            for step, ts, sec in e["steps"]:
                out[int(step)] = (float(ts), float(sec))
    return out


def outcome(evs: list[dict], after_seq: int) -> Optional[dict]:
    """What repaired the fault fired after journal entry ``after_seq``: the first recovery_done, job_restarting,
    migration_committed or standby_restarted after it (None while there is none yet)."""
    for e in evs:
        if e["seq"] <= after_seq:
            continue
        if e["event"] == p.Event.RECOVERY_DONE:
            rolled = e.get("rollback_step", -1)
            return {"tier": "snapshot" if isinstance(rolled, int) and rolled >= 0 else "replica",
                    "downtime_s": (e.get("phases_s") or {}).get("total"), "work_lost_s": 0.0,
                    "resume_step": e.get("resume_step"), "ts": e["ts"]}
        if e["event"] == p.Event.JOB_RESTARTING:
            return {"tier": "checkpoint", "work_lost_s": e.get("work_lost_s"), "resume_step": e.get("step"),
                    "ts": e["ts"], "restart": True}
        if e["event"] == p.Event.MIGRATION_COMMITTED:
            return {"tier": "migration", "work_lost_s": 0.0, "resume_step": e.get("switch_step"), "ts": e["ts"],
                    "migration_id": e.get("migration_id")}
        if e["event"] == p.Event.MIGRATION_ABORTED:
            return {"tier": "none", "aborted": e.get("reason"), "work_lost_s": 0.0, "resume_step": None,
                    "ts": e["ts"]}
        if e["event"] == p.Event.JOB_RELEARNED:  # a tmd restarted by tmd resume re-learned every rank
            return {"tier": "none", "work_lost_s": 0.0, "resume_step": e.get("step"), "ts": e["ts"],
                    "relearn_s": e.get("after_s"), "tmd_restart": True}
        if e["event"] == p.Event.STANDBY_RESTARTED:
            return {"tier": "none", "downtime_s": 0.0, "work_lost_s": 0.0, "resume_step": None, "ts": e["ts"]}
    return None


def step_gap(ends: dict[int, tuple[float, float]], since: float) -> Optional[float]:
    """The ranks' view of a pause from ``since`` (a wall time) on: the longest gap between the ends of two
    consecutive steps, less the later step's own seconds (None without such a pair)."""
    gaps = [ends[s][0] - ends[s - 1][0] - ends[s][1] for s in ends if s - 1 in ends and ends[s][0] >= since]
    return round(max(0.0, max(gaps)), 3) if gaps else None


def migration_downtime(evs: list[dict], migration_id: int) -> Optional[tuple[float]]:
    """``(downtime_s,)`` of migration ``migration_id`` from its ``migration_downtime`` entry (None while there is
    none: tmd writes it a window of steps after ``migration_committed``)."""
    for e in evs:
        if e["event"] == p.Event.MIGRATION_DOWNTIME and e.get("migration_id") == migration_id:
            return (e.get("downtime_s"),)
    return None


def reference_command(run_dir: str, steps: int, tiny: bool) -> list[str]:
    """The uninterrupted run: the soak's job (numerics and pacing alike), no standby, no checkpoints."""
    return tmd_command(run_dir, 0, steps, tiny, True, NUMERICS + PACING)


class Soak:
    """The job under the schedule (tmctl.localjob.Job) and what each event did."""

    def __init__(self, run_dir: str, steps: int, tiny: bool) -> None:
        self.run_dir = run_dir
        self.root = os.path.join(run_dir, "ckpt")
        self.job = Job(os.path.join(run_dir, "job"), 3, steps, *NUMERICS, *PACING, tiny=tiny,
                       tmd_args=("--checkpoint-dir", self.root, "--checkpoint-every", "10"))
        self.events: list[dict] = []
        self.added = 0

    def journal(self) -> list[dict]:
        return events(self.job.run_dir)

    def status(self) -> Optional[p.StatusReply]:
        try:
            reply = self.job.status()
            return reply if isinstance(reply, p.StatusReply) else None
        except Exception:  # noqa: BLE001 - tmd is between two daemons (a restart): ask again
            return None

    def ready(self, min_step: int) -> p.StatusReply:
        """The status once every rank is past ``min_step`` with a warm standby (one is added when none is)."""
        asked = [0.0]

        def check():
            if self.job.proc.poll() is not None:  # the job ended (failed): nothing left to wait for
                raise AssertionError(f"tmd exited with {self.job.proc.returncode} before step {min_step}")
            st = self.status()
            if st is None or st.step < min_step or st.recovery and st.recovery.get("state") in ("halting", "recovering"):
                return None
            if not any(n["role"] == p.NodeRole.STANDBY and n["warm"] for n in st.nodes):
                if not any(n["role"] == p.NodeRole.STANDBY for n in st.nodes) and time.monotonic() - asked[0] > 15:
                    asked[0] = time.monotonic()
                    self.added += 1
                    self.job.client.request(p.AddStandbyRequest(node=f"x{self.added}"))
                return None
            return st

        return wait_until(check, EVENT_TIMEOUT_S, f"training past step {min_step} with a warm standby", poll_s=0.3)

    def pids(self, st: p.StatusReply, roles: tuple) -> dict[str, list[int]]:
        return {n["name"]: [int(pid) for pid in n["pids"].values()] for n in st.nodes if n["role"] in roles}

    def fire(self, kind: str, st: p.StatusReply, rng: random.Random) -> dict:
        active = self.pids(st, (p.NodeRole.ACTIVE,))
        node = rng.choice(sorted(active))
        info = {"kind": kind, "step": st.step, "ts": time.time()}
        if kind in ("kill", "stop"):
            for pid in active[node]:
                os.kill(pid, signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
            info["node"] = node
        elif kind == "migrate":
            target = next(n["name"] for n in st.nodes if n["role"] == p.NodeRole.STANDBY and n["warm"])
            info.update(node=node, target=target, id=self.job.migrate(node, target))
        elif kind == "tmd_kill":  # the ranks train on; tmd resume re-learns the job from the journal and them
            os.kill(self.job.proc.pid, signal.SIGKILL)
            self.job.proc.wait()
            self.job.proc = subprocess.Popen([sys.executable, "-m", "tmd.cli", "resume", "--run-dir",
                                              self.job.run_dir, "--quiet"], stdout=subprocess.DEVNULL)
        elif kind == "standby_kill":
            standby = sorted(self.pids(st, (p.NodeRole.STANDBY,)).items())[0]
            for pid in standby[1]:
                os.kill(pid, signal.SIGKILL)
            info["node"] = standby[0]
        else:
            pids = [pid for ps in active.values() for pid in ps]
            if kind == "corrupt_all_active":  # before the processes stop: tmd may find one stopped and choose the
                # checkpoint to restart from at once (a run here chose it, valid, before it was corrupted; the ranks
                # then refused it). A save that commits after this one is newer: the restart takes that one.
                valid = [path for _, path in ck.checkpoints(self.root) if ck.verify(path)[0] is None]
                if valid:
                    data = sorted(glob.glob(os.path.join(valid[0], "__*.distcp")))[0]
                    with open(data, "r+b") as f:
                        b = f.read(1)
                        f.seek(0)
                        f.write(bytes([b[0] ^ 0xFF]))
                    info["corrupted"] = valid[0]
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)  # all at once: none goes on alone
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
        return info

    def follow(self, info: dict, after_seq: int) -> dict:
        """Wait for the event's repair, then for training past its resumed step; fill in its figures."""
        got = wait_until(lambda: outcome(self.journal(), after_seq), EVENT_TIMEOUT_S, f"the repair of {info}",
                         poll_s=0.2)
        fired = info["ts"]
        info.update(got)
        resume = got.get("resume_step")
        if got.get("restart"):  # downtime: the failure to the end of the first step after the restart
            ends = wait_until(lambda: {s: v for s, v in step_ends(self.journal()).items()
                                       if v[0] > got["ts"]} or None, EVENT_TIMEOUT_S, "a step after the restart")
            info["downtime_s"] = round(min(ts for ts, _ in ends.values()) - info["ts"], 3)
        elif got.get("tmd_restart"):  # the rank's view: the gap in step_times around the kill
            ends = wait_until(lambda: (lambda e: e if any(ts > got["ts"] + 1.0 for ts, _ in e.values()) else None)(
                step_ends(self.journal())), EVENT_TIMEOUT_S, "a step after the re-learning")
            info["downtime_s"] = step_gap(ends, fired)
        elif got["tier"] == "migration":  # tmd journals it once a window of steps after the switch has run
            info["downtime_s"] = wait_until(lambda: migration_downtime(self.journal(), got["migration_id"]),
                                            EVENT_TIMEOUT_S, f"the downtime of migration {got['migration_id']}",
                                            poll_s=0.2)[0]
        info["next_step"] = (resume or info["step"]) + GAP_STEPS
        return info

    def drive(self, kinds: list[str], rng: random.Random, steps: int) -> None:
        next_step = 12  # past the recorded first steps and the first checkpoint
        for kind in kinds:
            if next_step > steps - 2 * GAP_STEPS - STEPS_AFTER.get(kind, 0):
                print(f"[chaos] {kind}: no steps left for it", file=sys.stderr, flush=True)
                break
            st = self.ready(next_step)
            need = CHECKPOINTS_NEEDED.get(kind, 0)
            if need:
                wait_until(lambda: len([1 for _, d in ck.checkpoints(self.root) if ck.verify(d)[0] is None]) >= need,
                           EVENT_TIMEOUT_S, f"{need} valid checkpoints", poll_s=0.2)
                st = self.ready(next_step)
            after = max((e["seq"] for e in self.journal()), default=0)
            info = self.follow(self.fire(kind, st, rng), after)
            print(f"[chaos] {json.dumps(info, default=str)}", file=sys.stderr, flush=True)
            self.events.append(info)
            next_step = info["next_step"]


def ettr(evs: list[dict], median_s: float) -> dict:
    """(steps x the uninterrupted median step) / the wall time from the end of the first reported step to the end
    of the last (every attempt, restarts and repairs in it)."""
    ends = step_ends(evs)
    first, last = min(ends), max(ends)
    wall = ends[last][0] - ends[first][0]
    return {"steps": last - first, "wall_s": round(wall, 3), "ettr": round((last - first) * median_s / wall, 5)}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="about 10 events on the tiny GPT (CI-sized, minutes)")
    ap.add_argument("--events", type=int, default=0, help="events (default 30; 10 with --quick)")
    ap.add_argument("--steps", type=int, default=0, help="steps of the job (default: 25 per event + 140)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--run-dir", default="tmrun/bench-chaos")
    ap.add_argument("--no-save", action="store_true", help="print only (do not write benchmarks/results)")
    args = ap.parse_args(argv)
    n = args.events or (10 if args.quick else 30)
    steps = args.steps or 25 * n + 140
    tiny = args.quick
    shutil.rmtree(args.run_dir, ignore_errors=True)
    ref_dir = os.path.join(args.run_dir, "uninterrupted")
    os.makedirs(ref_dir)
    subprocess.run(reference_command(ref_dir, steps, tiny), check=True, timeout=7200,
                   stdout=subprocess.DEVNULL)
    ref_ends = step_ends(events(ref_dir))
    median_s = statistics.median(sec for _, sec in ref_ends.values())
    started = time.monotonic()
    soak = Soak(args.run_dir, steps, tiny)
    rng = random.Random(args.seed)
    try:
        soak.drive(schedule(n, args.seed), rng, steps)
        rc = soak.job.finish(timeout_s=3600)
    except AssertionError:  # a wait timed out: the journal's tail and every rank's stacks, for the diagnosis
        print(diagnose(soak.job.run_dir), file=sys.stderr, flush=True)
        raise
    finally:
        soak.job.close()
    evs = events(soak.job.run_dir)
    result = {
        "workload": {"model": "tiny" if tiny else "gpt-256x4", "parallelism": "DDP", "nodes": 2, "ranks_per_node": 2,
                     "standbys": 3, "steps": steps, "checkpoint_every": 10, "seed": args.seed, "quick": args.quick},
        "faults": soak.events, "faults_done": len(soak.events),
        "tiers": {t: sum(1 for e in soak.events if e.get("tier") == t)
                  for t in ("replica", "snapshot", "checkpoint", "migration", "none")},
        "uninterrupted_median_step_s": round(median_s, 6), **ettr(evs, median_s),
        "bit_identical": finals(soak.job.run_dir) == finals(ref_dir) and len(finals(ref_dir)) == 4,
        "exit_code": rc, "soak_s": round(time.monotonic() - started, 1), "not_covered": NOT_COVERED,
    }
    result["targets"] = {"faults": n, **({"soak_s_max": QUICK_S_MAX} if args.quick else {})}
    result["met"] = {"bit_identical": result["bit_identical"], "exit_code_0": rc == 0,
                     "every_fault_fired": len(soak.events) == n,
                     **({"within_8_minutes": result["soak_s"] <= QUICK_S_MAX} if args.quick else {})}
    print(json.dumps(result, default=str), flush=True)
    if not args.no_save:
        report.save("chaos", result, [ref_dir, soak.job.run_dir])
    return 0 if rc == 0 and result["bit_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""Chaos soak: two long jobs under seeded random schedules of faults, each against an uninterrupted run of itself.

Every fault is repaired by the first tier that can (a replica, a buddy snapshot, a checkpoint). Prints one JSON
object.

    python -m benchmarks.chaos [--quick] [--gpt-events N] [--llama-events N] [--seed 0] [--run-dir DIR] [--no-save]

Workloads, one after the other, both in local mode with ``--checkpoint-dir`` and ``--checkpoint-every 10``, 3
standbys, steps padded to at least 0.1 s (``--min-step-time-s``, in the uninterrupted runs too: the ETTR's unit),
the tiny models (``--tiny``; ``--quick`` only has fewer events):

- ``gpt``: the demo GPT, DDP, 2 nodes x 2 ranks, dropout drawn from per-rank RNG streams: every rank's state has
  replicas. 18 events (10 with ``--quick``), 25 steps per event + 140.
- ``llama``: examples/train_llama.py, TP 2 x FSDP2 2 on 4 nodes x 1 rank: no rank's state has a replica, so a
  lost node is rolled back to a buddy snapshot (``--snapshot-every 2``; rank r's is kept by rank r + 1, the
  ``replica_classes`` event's ``keepers``), and a node lost with its keeper restarts from the checkpoint. Every
  node, standbys added by request too, and tmd run in network namespaces of their own (``tmd local
  --netns-all``), so a node can be cut off. 12 events (5 with ``--quick``), 25 steps per event + 140. Its
  processes are started cold (no fork server in namespaces): a restart relaunches 7 processes importing torch.

Events, drawn with ``random.Random(seed)`` from the workload's kinds (every kind at least once when the count
allows; ``llama``'s first five drawn first: partition, keeper_kill, kill, migrate, stop), one at a time once the
job trains again with a warm standby (one is added by request while fewer than 2 standbys are left):

- ``kill``: kill -9 every process of one active node (replica tier; ``llama``: snapshot tier);
- ``stop``: SIGSTOP every process of one active node (tmd finds it stopped, fences it; as ``kill``);
- ``partition`` (``llama``): one active node's namespace cut off (every packet dropped, tmd/netns.py); tmd finds
  it silent, fences it and repairs it (snapshot tier); the namespace is healed once the repair is done;
- ``migrate``: a planned migration of one active node to a warm standby;
- ``standby_kill``: kill -9 a standby's processes (it is started again and warms; the job is untouched);
- ``keeper_kill`` (``llama``): kill -9 a node together with the node keeping its buddy snapshot (checkpoint tier);
- ``all_active``: kill -9 every active process at once (checkpoint tier: every process relaunched);
- ``corrupt_all_active``: one byte of the newest checkpoint flipped, then ``all_active`` (the checkpoint before it);
- ``tmd_kill`` (``gpt``): kill -9 of ``tmd local``, then ``tmd resume --run-dir`` (the ranks train on; the resumed
  tmd re-learns the job and keeps the checkpoint tier: a later ``all_active`` is restarted by it).

Per event: its ``tier`` (``replica``, ``snapshot``, ``checkpoint``, ``migration`` or ``none``), ``downtime_s``
(a recovery's detection to recovered; a migration's downtime; a restart's failure to the first step after it),
``work_lost_s`` (a restart's: training since the checkpoint, tmd's figure; a roll-back to a buddy snapshot's: the
end of the snapshot's step to the end of the last step before the fault; 0 where only the interrupted step is
redone) and, for a recovery, ``detect_s`` (the fault to tmd's ``node_failed``); for ``tmd_kill`` (tier ``none``)
the rank's view: the longest gap between two consecutive steps' ends in ``step_times`` from the kill to a step
after the re-learning, less that step's own time, and ``relearn_s`` (tmd's re-learning). Per job (``gpt``,
``llama``; their events in ``gpt_faults``, ``llama_faults``): ``ettr`` (steps x the uninterrupted median step /
the wall time of training; ``soak_median_step_s`` shows what the soak's steady state costs besides the faults:
snapshots, namespaces, standbys), ``bit_identical`` (every rank's final parameter, optimizer and RNG hash equals the
uninterrupted run's), ``standbys_by_request`` (``asked``, ``added`` by the journal's ``standby_added``, and
``unanswered``: a request with no reply within tmctl's timeout is asked again at the next poll; standbys asked for
and none added fails the soak), the exit code and ``soak_s`` (seconds); ``totals`` sums them. The uninterrupted
runs have no standby, no checkpoints, no snapshots and no namespaces.

Not in this soak (said in its output, ``not_covered``): ``tmd_kill`` in the ``llama`` job (a tmd restarted by
``tmd resume`` cannot recreate namespaces, so it would fail the job at its next checkpoint restart), a partition
in the ``gpt`` job, and no standby within ``--standby-wait-s`` (the soak always adds one).
"""
from __future__ import annotations

import argparse
import dataclasses
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
from tmctl.client import CoordinatorUnreachable
from tmctl.localjob import Job, diagnose, events, final_hashes, tmd_command, wait_until
from tmd import netns
from tmd import protocol as p
from worker import checkpoint as ck

GAP_STEPS = 6  # steps of training between two events (past the previous one's redone or resumed step)
EVENT_TIMEOUT_S = 240.0
# valid checkpoints an event needs before it fires: one to restart from; for a corruption, one to corrupt and one to
# fall back to. (Runs here fired them too early: a save in flight when a node was stopped or killed never
# commits, and the job then rightly failed with nothing to restart from.)
CHECKPOINTS_NEEDED = {"all_active": 1, "keeper_kill": 1, "corrupt_all_active": 2}
# steps a kind needs left after it: tmd resume takes seconds to start, and the ranks train on meanwhile (a run here
# fired tmd_kill near the end: the ranks finished while tmd was down, and the resumed tmd, seeing none come back,
# restarted the job from its last checkpoint)
STEPS_AFTER = {"tmd_kill": 100}
STEP_TIMES_WAIT_S = 5.0  # for the step times a roll-back's work lost needs (tmd journals them once a second)
MIN_STANDBYS = 2  # fewer standbys (warm or starting) than this: one is added by request (cold in namespaces)
QUICK_S_MAX = 480.0  # --quick: both soaks (the uninterrupted runs not included) within 8 minutes
# the soak's step floor, in the uninterrupted run too: its median step is the ETTR's unit, so both must be paced
# alike (a reference run at the tiny GPT's unpaced ~0.06 s/step made the 0.1 s steps of the soak count as lost time)
PACING = ("--min-step-time-s", "0.1")
CHECKPOINT_EVERY = 10
NOT_COVERED = ["tmd_kill in the TP x FSDP2 job (its nodes run in network namespaces, which a tmd restarted by "
               "tmd resume cannot recreate: it would fail the job at the next checkpoint restart)",
               "a partition of the DDP GPT job (partitions run in the TP x FSDP2 job only)",
               "no standby within --standby-wait-s (the soak always adds one)"]


@dataclasses.dataclass(frozen=True)
class Workload:
    """One job of the soak: ``script`` on ``nodes`` x ``ranks_per_node`` ranks with ``script_args`` (its numerics,
    the uninterrupted run's too), under ``tmd_args`` (the soak's only, besides the checkpoint options), faulted by
    ``kinds`` (the first ones drawn first), ``events`` events by default (``quick_events`` with --quick) over
    ``steps_per_event`` steps each plus 140. The tiny model (``--tiny``) in both forms of the soak (``model``:
    its name in the result)."""
    name: str
    script: str
    nodes: int
    ranks_per_node: int
    parallelism: str
    model: str
    kinds: tuple[str, ...]
    script_args: tuple[str, ...]
    tmd_args: tuple[str, ...]
    events: int
    quick_events: int
    steps_per_event: int

    def steps(self, n: int) -> int:
        return self.steps_per_event * n + 140


# The tiny models in the full soak too: the full-size GPT's ~1.3 s steps (benchmarks/results/ettr.json) over 590
# steps, and the Llama's ~0.6 s (benchmarks/results/checkpoint.json), would take most of an hour, with their
# uninterrupted runs, on 2 cores.
GPT = Workload("gpt", "examples.train_gpt", nodes=2, ranks_per_node=2, parallelism="DDP", model="tiny GPT",
               kinds=("kill", "stop", "migrate", "standby_kill", "all_active", "corrupt_all_active", "tmd_kill"),
               script_args=("--dropout", "0.1", "--seed-mode", "per-rank"), tmd_args=(),
               events=18, quick_events=10, steps_per_event=25)
# TP over (n1, n2) and (n3, n4), FSDP2 over (n1, n3) and (n2, n4): no rank's state has a replica
LLAMA = Workload("llama", "examples.train_llama", nodes=4, ranks_per_node=1, parallelism="TP 2 x FSDP2 2",
                 model="tiny Llama", kinds=("partition", "keeper_kill", "kill", "migrate", "stop", "all_active",
                                      "corrupt_all_active", "standby_kill"),
                 script_args=("--tp", "2", "--dp-shard", "2"), tmd_args=("--netns-all", "--snapshot-every", "2"),
                 events=12, quick_events=5, steps_per_event=25)
WORKLOADS = (GPT, LLAMA)
KINDS = tuple(dict.fromkeys(k for w in WORKLOADS for k in w.kinds))  # every kind of either workload


def schedule(n: int, seed: int, kinds: tuple[str, ...] = GPT.kinds) -> list[str]:
    """``n`` event kinds drawn from ``kinds`` with ``random.Random(seed)``: every kind at least once when ``n``
    allows, else the first ``n`` kinds."""
    rng = random.Random(seed)
    drawn = list(kinds)[:n] + [rng.choice(kinds) for _ in range(max(0, n - len(kinds)))]
    rng.shuffle(drawn)
    return drawn


def step_ends(evs: list[dict], first: bool = False) -> dict[int, tuple[float, float]]:
    """step -> (ts of its end, slowest rank's seconds) from ``step_times``; a redone step keeps its last report
    (its first with ``first``)."""
    out = {}
    for e in evs:
        if e["event"] == p.Event.STEP_TIMES:
            for step, ts, sec in e["steps"]:
                if not (first and int(step) in out):
                    out[int(step)] = (float(ts), float(sec))
    return out


def outcome(evs: list[dict], after_seq: int) -> Optional[dict]:
    """What repaired the fault fired after journal entry ``after_seq``: the first recovery_done, job_restarting,
    migration_committed or standby_restarted after it (None while there is none yet). A recovery rolled back to a
    buddy snapshot (its ``recovery_plan``'s ``rollback_step``) is the snapshot tier, else the replica tier."""
    plans = {}
    for e in evs:
        if e["event"] == p.Event.RECOVERY_PLAN:
            plans[e.get("incident_id")] = e.get("rollback_step", -1)
        if e["seq"] <= after_seq:
            continue
        if e["event"] == p.Event.RECOVERY_DONE:
            rolled = plans.get(e.get("incident_id"), -1)
            snapshot = isinstance(rolled, int) and rolled >= 0
            return {"tier": "snapshot" if snapshot else "replica", "downtime_s": (e.get("phases_s") or {}).get("total"),
                    "work_lost_s": 0.0, "resume_step": e.get("resume_step"), "ts": e["ts"],
                    **({"rollback_step": rolled} if snapshot else {})}
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


def rolled_back_s(evs: list[dict], rollback_step: int, fired: float) -> Optional[float]:
    """The training a roll-back to the buddy snapshot of ``rollback_step`` lost (seconds): from that step's end to
    the end of the last step done before the fault fired at wall time ``fired`` (first reports: the redone steps'
    later ones are not the lost work); None when the journal lacks either."""
    ends = step_ends(evs, first=True)
    done = [s for s, (ts, _) in ends.items() if ts <= fired]
    if rollback_step not in ends or not done:
        return None
    return round(max(0.0, ends[max(done)][0] - ends[rollback_step][0]), 3)


def step_gap(ends: dict[int, tuple[float, float]], since: float) -> Optional[float]:
    """The ranks' view of a pause from ``since`` (a wall time) on: the longest gap between the ends of two
    consecutive steps, less the later step's own seconds (None without such a pair)."""
    gaps = [ends[s][0] - ends[s - 1][0] - ends[s][1] for s in ends if s - 1 in ends and ends[s][0] >= since]
    return round(max(0.0, max(gaps)), 3) if gaps else None


def migration_downtime(evs: list[dict], migration_id: int, after_seq: int = 0) -> Optional[tuple[float]]:
    """``(downtime_s,)`` of migration ``migration_id`` from its ``migration_downtime`` entry after journal entry
    ``after_seq`` (None while there is none: tmd writes it a window of steps after ``migration_committed``). Ids
    start at 1 again in the daemon of each relaunch from a checkpoint: an earlier migration may have the same one."""
    for e in evs:
        if e["seq"] > after_seq and e["event"] == p.Event.MIGRATION_DOWNTIME and e.get("migration_id") == migration_id:
            return (e.get("downtime_s"),)
    return None


def keepers(evs: list[dict]) -> dict[int, int]:
    """{rank: the rank keeping its buddy snapshot} from the journal's last ``replica_classes`` ({} before any)."""
    last = [e for e in evs if e["event"] == p.Event.REPLICA_CLASSES]
    return {int(r): int(k) for r, k in (last[-1].get("keepers") or {}).items()} if last else {}


def reference_command(run_dir: str, steps: int, workload: Workload = GPT) -> list[str]:
    """The uninterrupted run: the soak's job (numerics and pacing alike), no standby, no checkpoints, no snapshots,
    no namespaces."""
    return tmd_command(run_dir, 0, steps, True, True, workload.script_args + PACING, nodes=workload.nodes,
                       ranks_per_node=workload.ranks_per_node, script=workload.script)


class Soak:
    """One workload's job under the schedule (tmctl.localjob.Job) and what each event did."""

    def __init__(self, run_dir: str, steps: int, workload: Workload = GPT) -> None:
        self.run_dir = run_dir
        self.root = os.path.join(run_dir, "ckpt")
        os.makedirs(run_dir, exist_ok=True)  # the job's pace file goes beside its run dir
        self.job = Job(os.path.join(run_dir, "job"), 3, steps, *workload.script_args, *PACING,
                       nodes=workload.nodes, ranks_per_node=workload.ranks_per_node, script=workload.script,
                       tmd_args=(*workload.tmd_args, "--checkpoint-dir", self.root,
                                 "--checkpoint-every", str(CHECKPOINT_EVERY)))
        self.events: list[dict] = []
        self.added = 0
        # every AddStandbyRequest: {"node", "answer": "added", an ErrorReply's code, or "unanswered" (and "error")}
        self.standby_asks: list[dict] = []
        self.cut: Optional[netns.NodeNamespace] = None  # a partitioned node's namespace, until it is healed

    def journal(self) -> list[dict]:
        return events(self.job.run_dir)

    def status(self) -> Optional[p.StatusReply]:
        try:
            reply = self.job.status()
            return reply if isinstance(reply, p.StatusReply) else None
        except Exception:  # noqa: BLE001 - tmd is between two daemons (a restart): ask again
            return None

    def add_standby(self) -> bool:
        """Ask tmd for one more standby (``x1``, ``x2``, ...); returns whether it answered (added, or refused: an
        ErrorReply). No answer (tmctl's timeout, or tmd between two daemons of a restart) is noted in
        ``standby_asks`` and not raised, as an unanswered status is not: the caller asks again later."""
        self.added += 1
        node = f"x{self.added}"
        try:
            reply = self.job.client.request(p.AddStandbyRequest(node=node))
        except CoordinatorUnreachable as e:
            self.standby_asks.append({"node": node, "answer": "unanswered", "error": str(e)})
            print(f"[chaos] standby {node} asked for, no answer: {e}", file=sys.stderr, flush=True)
            return False
        answer = "added" if isinstance(reply, p.StatusReply) else getattr(reply, "code", type(reply).__name__)
        self.standby_asks.append({"node": node, "answer": answer})
        return True

    def standbys_added(self) -> dict:
        """What the requests for standbys did: ``asked``, ``unanswered``, ``added`` (the journal's
        ``standby_added``). Raises AssertionError when standbys were asked for and none was added, or when one tmd
        answered as added is not in the journal."""
        journal = {e["node"] for e in self.journal() if e["event"] == p.Event.STANDBY_ADDED}
        answered = {a["node"] for a in self.standby_asks if a["answer"] == "added"}
        assert answered <= journal, f"standbys {sorted(answered - journal)} answered as added are not in the journal"
        assert journal or not self.standby_asks, f"standbys were asked for and none was added: {self.standby_asks}"
        return {"asked": len(self.standby_asks), "added": len(journal),
                "unanswered": sum(1 for a in self.standby_asks if a["answer"] == "unanswered")}

    def ready(self, min_step: int) -> p.StatusReply:
        """The status once every rank is past ``min_step`` with a warm standby (one is added by request while fewer
        than MIN_STANDBYS are left, at most one per 15 s; an unanswered request is asked again at the next
        poll)."""
        asked = [0.0]

        def check():
            if self.job.proc.poll() is not None:  # the job ended (failed): nothing left to wait for
                raise AssertionError(f"tmd exited with {self.job.proc.returncode} before step {min_step}")
            st = self.status()
            if st is None:
                return None
            standbys = [n for n in st.nodes if n["role"] == p.NodeRole.STANDBY]
            if len(standbys) < MIN_STANDBYS and time.monotonic() - asked[0] > 15:
                asked[0] = time.monotonic() if self.add_standby() else 0.0
            if st.step < min_step or st.recovery and st.recovery.get("state") in ("halting", "recovering"):
                return None
            return st if any(n["warm"] for n in standbys) else None

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
        elif kind == "partition":  # a node whose namespace tmd.json names (those added by request are not there)
            with open(p.layout.RunDir(self.job.run_dir).tmd_json) as f:
                specs = json.load(f)["netns"]
            listed = sorted(n for n in active if n in specs)
            assert listed, f"no active node of {sorted(active)} has its namespace in tmd.json"
            node = node if node in listed else rng.choice(listed)
            self.cut = netns.NodeNamespace.from_spec(node, specs[node])
            self.cut.cut()  # its processes live on, no packet gets in or out
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
            lost = sorted(active)
            if kind == "keeper_kill":  # a rank's node and the node of the rank keeping its buddy snapshot
                node_of = {r: n["name"] for n in st.nodes if n["role"] == p.NodeRole.ACTIVE for r in n["ranks"]}
                rank = rng.choice(sorted(node_of))
                keeper = node_of[keepers(self.journal())[rank]]
                assert keeper != node_of[rank], f"rank {rank}'s snapshot is kept on its own node {keeper}"
                lost = [node_of[rank], keeper]
                info.update(node=node_of[rank], keeper=keeper)
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
            pids = [pid for n in lost for pid in active[n]]
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)  # all at once: none goes on alone
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
        return info

    def follow(self, info: dict, after_seq: int) -> dict:
        """Wait for the event's repair (then heal a partitioned node), then for training past its resumed step;
        fill in its figures."""
        try:
            got = wait_until(lambda: outcome(self.journal(), after_seq), EVENT_TIMEOUT_S, f"the repair of {info}",
                             poll_s=0.2)
        finally:
            if self.cut is not None:  # repaired (tmd fenced its processes) or given up on: let packets through
                self.cut.heal()
                self.cut = None
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
            info["downtime_s"] = wait_until(lambda: migration_downtime(self.journal(), got["migration_id"], after_seq),
                                            EVENT_TIMEOUT_S, f"the downtime of migration {got['migration_id']}",
                                            poll_s=0.2)[0]
        if got["tier"] in ("replica", "snapshot"):
            journal = self.journal()
            failed = next((e for e in journal if e["seq"] > after_seq and e["event"] == p.Event.NODE_FAILED), None)
            info["detect_s"] = round(failed["ts"] - fired, 3) if failed else None
            if got["tier"] == "snapshot":  # tmd journals step times once a second: the steps before the fault
                # may come after recovery_done (a run here had step 41's after it: its work lost came out null)
                deadline = time.monotonic() + STEP_TIMES_WAIT_S
                while (lost := rolled_back_s(journal, got["rollback_step"], fired)) is None \
                        and time.monotonic() < deadline:
                    time.sleep(0.2)
                    journal = self.journal()
                info["work_lost_s"] = lost
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


def tiers(faults: list[dict]) -> dict[str, int]:
    return {t: sum(1 for e in faults if e.get("tier") == t)
            for t in ("replica", "snapshot", "checkpoint", "migration", "none")}


def run(workload: Workload, n: int, seed: int, run_dir: str) -> tuple[dict, list[dict], list[str]]:
    """One workload's uninterrupted run and soak of ``n`` events in ``run_dir``: (its section of the result, its
    events, its two run directories). Raises AssertionError (after printing the diagnosis) when a wait timed
    out."""
    steps = workload.steps(n)
    ref_dir = os.path.join(run_dir, "uninterrupted")
    os.makedirs(ref_dir)
    subprocess.run(reference_command(ref_dir, steps, workload), check=True, timeout=7200,
                   stdout=subprocess.DEVNULL)
    median_s = statistics.median(sec for _, sec in step_ends(events(ref_dir)).values())
    started = time.monotonic()
    soak = Soak(run_dir, steps, workload)
    try:
        soak.drive(schedule(n, seed, workload.kinds), random.Random(seed), steps)
        rc = soak.job.finish(timeout_s=3600)
        standbys = soak.standbys_added()
    except AssertionError:  # a wait timed out: the journal's tail and every rank's stacks, for the diagnosis
        print(diagnose(soak.job.run_dir), file=sys.stderr, flush=True)
        raise
    finally:
        soak.job.close()
    expected = final_hashes(ref_dir, rng=True)  # {rank: (state, RNG)}
    section = {
        "workload": {"model": workload.model, "parallelism": workload.parallelism,
                     "nodes": workload.nodes, "ranks_per_node": workload.ranks_per_node, "standbys": 3,
                     "steps": steps, "checkpoint_every": CHECKPOINT_EVERY, "tmd": " ".join(workload.tmd_args) or "—"},
        "faults_done": len(soak.events), "faults_planned": n, "tiers": tiers(soak.events),
        "uninterrupted_median_step_s": round(median_s, 6), "soak_median_step_s": round(statistics.median(
            sec for _, sec in step_ends(events(soak.job.run_dir)).values()), 6),
        **ettr(events(soak.job.run_dir), median_s),
        "bit_identical": final_hashes(soak.job.run_dir, rng=True) == expected and len(expected) == workload.nodes *
        workload.ranks_per_node,
        "standbys_by_request": standbys, "exit_code": rc, "soak_s": round(time.monotonic() - started, 1),
    }
    return section, soak.events, [ref_dir, soak.job.run_dir]


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer events (CI-sized, minutes)")
    for w in WORKLOADS:
        ap.add_argument(f"--{w.name}-events", type=int, default=None,
                        help=f"events of the {w.name} job (default {w.events}; {w.quick_events} with --quick; "
                             f"0: leave the job out)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--run-dir", default="tmrun/bench-chaos")
    ap.add_argument("--no-save", action="store_true", help="print only (do not write benchmarks/results)")
    args = ap.parse_args(argv)
    planned = {w.name: (w.quick_events if args.quick else w.events) if getattr(args, f"{w.name}_events") is None
               else getattr(args, f"{w.name}_events") for w in WORKLOADS}
    shutil.rmtree(args.run_dir, ignore_errors=True)
    started = time.monotonic()
    result: dict = {}
    run_dirs: list[str] = []
    for w in WORKLOADS:
        if planned[w.name] > 0:
            section, faults, dirs = run(w, planned[w.name], args.seed, os.path.join(args.run_dir, w.name))
            result[w.name] = section
            result[f"{w.name}_faults"] = faults
            run_dirs += dirs
    sections = [result[w.name] for w in WORKLOADS if w.name in result]
    faults = [e for w in WORKLOADS for e in result.get(f"{w.name}_faults", [])]
    result["totals"] = {"faults_done": len(faults), "kinds": len({e["kind"] for e in faults}),
                        "bit_identical": all(s["bit_identical"] for s in sections),
                        "exit_codes_0": all(s["exit_code"] == 0 for s in sections),
                        "soak_s": round(sum(s["soak_s"] for s in sections), 1),
                        "total_s": round(time.monotonic() - started, 1), **tiers(faults)}
    result["seed"], result["quick"], result["not_covered"] = args.seed, args.quick, NOT_COVERED
    totals = result["totals"]
    result["targets"] = {"faults": sum(planned.values()), **({"soak_s_max": QUICK_S_MAX} if args.quick else {})}
    result["met"] = {"bit_identical": totals["bit_identical"], "exit_code_0": totals["exit_codes_0"],
                     "every_fault_fired": totals["faults_done"] == sum(planned.values()),
                     **({"within_8_minutes": totals["soak_s"] <= QUICK_S_MAX} if args.quick else {})}
    print(json.dumps(result, default=str), flush=True)
    if not args.no_save:
        report.save("chaos", result, run_dirs)
    return 0 if totals["exit_codes_0"] and totals["bit_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""Failure recovery side by side with peers, in one run: this project, torchft 0.2 (async and sync quorum) and
torchrun + torch.distributed.checkpoint every step, on the same workload and kill point. Prints one JSON object.

    python -m benchmarks.peers [--steps 30] [--kill-at 15] [--tiny] [--peers trainmover,trainmover_guarded,...]

Workload (every peer): the demo's byte-level GPT (examples/gpt.py, 3.3 M parameters; ``--tiny``: 40 k), AdamW
(lr 3e-4, weight decay 0.1), Shakespeare batches that are a function of (seed, rank, step) (examples/data.py), seed
0, 4 data-parallel workers of 1 thread each (one process each), gloo on loopback, CPU. The fault: once the job has
begun step ``--kill-at``, ``KILL_FRACTION`` of a median step later, the benchmark sends SIGKILL to the process of
worker 3 (``t_kill``: ``time.time()`` just before ``os.kill``). Each peer runs twice: uninterrupted (its own
reference) and with the kill.

Peers:

- ``trainmover``: ``tmd local`` with 4 nodes x 1 rank running examples/train_gpt.py plus one warm standby s1;
  the kill hits node n4's rank process once s1 is warm. tmd detects it, halts the survivors, promotes s1, copies the
  state from a data-parallel replica and redoes the interrupted step (benchmarks/recovery.py measures the same on 2
  nodes x 2 ranks).
- ``trainmover_guarded``: the same with ``tmd local --guards 1`` (tmd.guards): s1 warms as one node's rank before
  the failure, and the kill hits that node (n1 by tmd's choice; the workers are symmetric) once s1 is warm. The
  recovery adopts s1 with no warm-up left. ``time_to_full_strength_ratio_vs_torchft_async_guarded`` is the headline
  ratio for this case: what a failure of a guarded node costs.
- ``torchft_async`` / ``torchft_sync``: torchft 0.2 (``pip install --no-build-isolation -e .[bench]``), benchmarks/peers/ft_worker.py:
  4 replica groups of 1 rank, one ``torchft.Manager`` each (``use_async_quorum`` True, torchft's default, or
  False), the gradients averaged by ``Manager.allreduce`` (torchft 0.2.0's ``DistributedDataParallel`` kills the
  survivors on a peer's death, see ft_worker.py), a ``torchft_lighthouse`` process with torchft's defaults
  (heartbeat timeout 5 s, join timeout 60 s, quorum tick 100 ms) but ``min_replicas`` 3, and the Managers'
  ``min_replica_size`` 3, so the survivors may go on without the killed replica. Gloo timeout 5 s and Manager
  timeout 30 s as in torchft's own train_ddp.py example: with torchft's default 60 s, a survivor whose ring
  neighbour is not the dead replica waits the whole 60 s, and the next quorum waits for it. The replacement replica
  (same replica id prefix, so the same replica rank and data shard) is started **at** ``t_kill``: no launcher
  detection delay, the most favourable case for torchft. It heals from a live replica over torchft's HTTP
  transport.
- ``torchrun_dcp``: ``torchrun --standalone --nproc-per-node 4 --max-restarts 1`` running
  benchmarks/peers/dcp_worker.py (torch's DDP, a DCP checkpoint after every step). torchrun sees the dead worker,
  stops the others and restarts all 4, which load the newest checkpoint and go on.

Figures per peer (seconds are wall-clock, epoch; "commit" = a step's optimizer update is applied):

- ``median_step_s``: median interval between consecutive commits of the job before the kill (the first two
  commits excluded), from the peer's own commit stream: tmd's ``step_times`` journal (a step's time stamp: when
  tmd had every rank's report of it) for trainmover, worker 0's log (the time after its ``optimizer.step``) for
  the others. For torchrun_dcp it includes the per-step checkpoint (``checkpoint_s``: median save + barrier).
- ``survivor_stall_s``: the longest pause of the survivors' commit stream around the kill beyond one median step:
  max over consecutive commits (c_i, c_i+1) with c_i+1 > t_kill and c_i < t_full of (c_i+1 - c_i) - median_step_s.
  ``survivor_lost_s``: the sum of those excesses (> 0) over the same commits (several pauses: the kill, and for
  torchft the replacement's join). For torchrun_dcp the "survivors" are the restarted processes of ranks 0-2.
- ``time_to_full_strength_s``: t_full - t_kill, where t_full is the commit of the first step after the kill that
  all 4 workers computed and all-reduced together, the replacement included: trainmover, the ``step_times`` stamp
  of the resume step; torchft, the latest commit (over the replacement and worker 0) of the first step the
  replacement commits while participating with 4 participants; torchrun_dcp, the latest first commit over the
  4 restarted processes. It contains that one step's own time.
- ``steps_recomputed``: steps whose computation was thrown away and done again: trainmover, the highest step an
  active rank had begun (tmd status polls every ``POLL_S``) before the recovery plan, minus the resume step, plus
  one (0 when none had begun it); torchft and torchrun_dcp, worker 0's begins of a step index beyond the first
  (a step begun three times counts 2).
  ``steps_lost`` (committed updates rolled back) is 0 for every peer here: trainmover and torchft recover from a
  live replica, and DCP checkpoints every committed step.
- ``worker_batches_dropped``: over the steps of the final trajectory, the worker-batches that never went into an
  update: sum of (4 - participants) over committed steps (torchft's ``num_participants`` per commit; a healing
  replica of the async quorum does not participate). 0 by construction for trainmover and torchrun_dcp (every
  committed step all-reduces all 4 ranks); ``bit_identical`` confirms it.
- ``bit_identical``: every worker's final state hash (examples/state_hash.final_state_hash of model + optimizer)
  equals that of the peer's own uninterrupted run (all 4 workers' hashes equal there too).
- ``ratios``: the peer's time to full strength (and survivor stall) over trainmover's, in this run.

Target (issue 12, target 3): trainmover's time to full strength >= 8x better than torchft_async's, trainmover
bit-identical. Reported in ``targets``/``met``, not asserted: the machine is shared and noisy. A peer that cannot
run here (torchft or torchrun absent) is listed in ``skipped`` with the reason.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from typing import Callable, Iterable, Optional, Sequence

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEERS_DIR = os.path.join(REPO_ROOT, "benchmarks", "peers")
WORLD = 4
VICTIM = 3  # the worker (rank / replica) that is killed; trainmover: node n4
KILL_FRACTION = 0.5  # the kill lands this fraction of a median step after the step began
POLL_S = 0.01
JOB_TIMEOUT_S = 300.0
FT_MIN_REPLICAS = 3  # lighthouse min_replicas and Manager min_replica_size: survivors may go on without one
TARGET_RATIO = 8.0  # trainmover's time to full strength vs torchft_async's

PEERS = ("trainmover", "trainmover_guarded", "torchft_async", "torchft_sync", "torchrun_dcp")


# --------------------------------------------------------------------------------------------------
# Pure arithmetic on commit streams (unit-tested)
# --------------------------------------------------------------------------------------------------


def median_step(commit_ts: Sequence[float], before: float, skip: int = 2) -> Optional[float]:
    """Median interval (s) between consecutive commit times (epoch s, any order) earlier than ``before``, the first
    ``skip`` commits excluded (start-up). None with fewer than two such commits."""
    ts = sorted(t for t in commit_ts if t < before)[skip:]
    gaps = [b - a for a, b in zip(ts, ts[1:])]
    return statistics.median(gaps) if gaps else None


def stall(commit_ts: Sequence[float], t_kill: float, t_full: float, median: float) -> tuple[float, float]:
    """(longest, total) excess (s) over ``median`` of the pauses between consecutive commits (c_i, c_i+1) with
    c_i+1 > ``t_kill`` and c_i < ``t_full``; (0.0, 0.0) when there is none. Raises ValueError if no commit
    precedes the kill."""
    ts = sorted(commit_ts)
    if not ts or ts[0] >= t_kill:
        raise ValueError("no commit before the kill")
    excess = [b - a - median for a, b in zip(ts, ts[1:]) if b > t_kill and a < t_full]
    return max([0.0, *excess]), sum(e for e in excess if e > 0)


def recomputed(started_steps: Iterable[int]) -> int:
    """Step computations thrown away and done again: begins beyond the first of each step index (a step begun
    three times counts 2)."""
    steps = list(started_steps)
    return len(steps) - len(set(steps))


def dropped(commits: Iterable[tuple[int, int]], world: int) -> int:
    """Worker-batches never trained: sum of (world - participants) over (step, participants) commits, the last
    commit of each step counting."""
    last = dict(commits)
    return sum(world - n for n in last.values())


def ratio(theirs: Optional[float], ours: Optional[float], floor: float = 1e-3) -> Optional[float]:
    """theirs / ours (ours floored at ``floor`` s), rounded to 0.1; None if either is unknown."""
    if theirs is None or ours is None:
        return None
    return round(theirs / max(ours, floor), 1)


def figures(commit_ts: Sequence[float], t_kill: float, t_full: Optional[float]) -> dict:
    """The timing figures every peer reports, from its survivors' commit times and t_kill / t_full (epoch s)."""
    median = median_step(commit_ts, t_kill)
    out = {"median_step_s": _r(median), "survivor_stall_s": None, "survivor_lost_s": None,
           "time_to_full_strength_s": _r(t_full - t_kill) if t_full is not None else None}
    if median is not None and t_full is not None:
        longest, total = stall(commit_ts, t_kill, t_full, median)
        out["survivor_stall_s"], out["survivor_lost_s"] = _r(longest), _r(total)
    return out


def _r(x: Optional[float]) -> Optional[float]:
    return round(x, 4) if x is not None else None


def read_jsonl(path: str) -> list[dict]:
    """The JSON lines of ``path`` ([] if it does not exist; a torn last line, from a kill, is skipped)."""
    out = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
    except FileNotFoundError:
        pass
    return out


# --------------------------------------------------------------------------------------------------
# Shared process plumbing
# --------------------------------------------------------------------------------------------------


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["OMP_NUM_THREADS"] = "1"
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return env


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(procs: Iterable[subprocess.Popen]) -> None:
    """SIGKILL whichever of ``procs`` (this benchmark's own children) still run, and reap them."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def _wait_start(log_path: str, step: int, procs: Sequence[subprocess.Popen], timeout_s: float) -> list[dict]:
    """Wait until worker 0's log shows it began ``step``; returns its records. Raises RuntimeError if a process
    exits non-zero first or after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        recs = read_jsonl(log_path)
        if any(r["event"] == "start" and r["step"] >= step for r in recs):
            return recs
        if any(p.poll() not in (None, 0) for p in procs):
            raise RuntimeError(f"a worker exited with {[p.poll() for p in procs]} before step {step}")
        time.sleep(POLL_S)
    raise RuntimeError(f"step {step} not reached within {timeout_s:.0f} s")


def _sleep_into_step(recs: list[dict], before_step: int) -> None:
    """Sleep ``KILL_FRACTION`` of the median step (from worker 0's commits so far) after step ``before_step``
    began."""
    ends = [r["ts"] for r in recs if r["event"] == "end"]
    med = median_step(ends, float("inf")) or 0.0
    began = max(r["ts"] for r in recs if r["event"] == "start" and r["step"] >= before_step)
    time.sleep(max(0.0, began + KILL_FRACTION * med - time.time()))


# --------------------------------------------------------------------------------------------------
# (a) trainmover
# --------------------------------------------------------------------------------------------------


_references: dict[str, tuple[int, dict]] = {}  # run dir -> (exit code, final hashes): one reference per invocation


def run_trainmover(work: str, steps: int, kill_at: int, tiny: bool, guarded: bool = False) -> dict:
    """Reference and kill run under tmd (4 nodes x 1 rank, standby s1 in the kill run). ``guarded``: tmd runs
    with ``--guards 1`` (tmd.guards: s1 warms as one node's rank before any failure) and the node s1 guards is
    killed once s1 is warm; otherwise worker ``VICTIM``'s node, with s1 a general standby."""
    from benchmarks.recovery import (
        StepClock, finish_job, follow_recovery, node_pids, read_events, struck_node, wait_to_strike,
    )
    from tmctl.localjob import final_hashes, job_client, tmd_command
    from tmd import protocol as p

    def start(run_dir: str, standbys: int, tmd_args: tuple = ()) -> subprocess.Popen:
        shutil.rmtree(run_dir, ignore_errors=True)
        os.makedirs(os.path.dirname(run_dir), exist_ok=True)
        with open(run_dir + ".log", "w") as log:
            return subprocess.Popen(tmd_command(run_dir, standbys, steps, tiny, True, tmd_args=tmd_args, nodes=WORLD,
                                                ranks_per_node=1),
                                    stdout=log, stderr=subprocess.STDOUT, env=_env())

    ref_dir = os.path.join(work, "tm_reference")
    kill_dir = os.path.join(work, "tm_kill_guarded" if guarded else "tm_kill")
    if ref_dir not in _references:
        _references[ref_dir] = (finish_job(start(ref_dir, 0)), final_hashes(ref_dir))
    ref_rc, ref = _references[ref_dir]

    proc = start(kill_dir, 1, ("--guards", "1") if guarded else ())
    victim = f"n{VICTIM + 1}"
    try:
        clock = StepClock(job_client(kill_dir, proc))
        st = wait_to_strike(clock, proc, kill_at)
        if st is None:
            raise RuntimeError(f"tmd exited with {proc.returncode} before the kill; see {kill_dir}.log")
        victim = struck_node(kill_dir, guarded, victim)
        pids = node_pids(kill_dir, victim)
        med = clock.median_step_s(st.step) or 0.0
        time.sleep(KILL_FRACTION * med)
        t_kill = time.time()
        for pid in pids.values():
            os.kill(pid, signal.SIGKILL)
        resume, _, highest_begun = follow_recovery(clock, proc, JOB_TIMEOUT_S, st.step)
        rc = finish_job(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    events = read_events(kill_dir)
    plan = next((e for e in events if e["event"] == p.Event.RECOVERY_PLAN), None)
    resume = plan["resume_step"] if plan else resume
    stamps = [(s, ts) for e in events if e["event"] == p.Event.STEP_TIMES for s, ts, _ in e["steps"]]
    commit_ts = [ts for _, ts in stamps]
    t_full = next((ts for s, ts in stamps if s == resume and ts > t_kill), None) if resume is not None else None
    hashes = final_hashes(kill_dir)
    return {
        "exit_code": rc, "reference_exit_code": ref_rc,
        **figures(commit_ts, t_kill, t_full),
        "steps_recomputed": max(0, highest_begun - resume + 1) if resume is not None else None,
        "steps_lost": 0,
        "worker_batches_dropped": 0,
        "bit_identical": len(ref) == WORLD and len(set(ref.values())) == 1 and hashes == ref,
        "detail": {"killed_node": victim, "guarded": guarded,
                   "resume_step": resume, "highest_step_begun_before_plan": highest_begun,
                   "recovery_phases_s": next((e["phases_s"] for e in events
                                              if e["event"] == p.Event.RECOVERY_DONE), None)},
    }


# --------------------------------------------------------------------------------------------------
# (b, c) torchft
# --------------------------------------------------------------------------------------------------


def lighthouse_binary() -> str:
    """torchft's lighthouse executable (``torchft_lighthouse``, beside this Python or on PATH)."""
    beside = os.path.join(os.path.dirname(sys.executable), "torchft_lighthouse")
    return beside if os.path.exists(beside) else (shutil.which("torchft_lighthouse") or beside)


def _wait_port(port: int, proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """Wait until something accepts on 127.0.0.1:``port``. Raises RuntimeError if ``proc`` exits first or after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the lighthouse exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"the lighthouse did not listen on port {port} within {timeout_s:.0f} s")


def torchft_missing() -> Optional[str]:
    """Why torchft cannot run here (None if it can): the import error, or a wrong version."""
    if importlib.util.find_spec("torchft") is None:
        return "torchft is not installed (pip install --no-build-isolation -e .[bench])"
    try:
        from importlib.metadata import version

        importlib.import_module("torchft")  # the real import: its dependencies, its extension against this torch

        v = version("torchft")
    except Exception as e:  # noqa: BLE001 - any import failure is a reason to skip, reported verbatim
        return f"import torchft failed: {type(e).__name__}: {e}"
    if not v.startswith("0.2."):
        return f"torchft {v} is installed; this benchmark compares with 0.2"
    if not os.path.exists(lighthouse_binary()):
        return "torchft's torchft_lighthouse executable is not found"
    return None


def _ft_job(work: str, steps: int, tiny: bool, sync: bool, kill_at: Optional[int]) -> dict:
    """One torchft job of 4 replica groups; with ``kill_at``, replica ``VICTIM`` is killed and replaced."""
    from torch.distributed import TCPStore

    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    lh_port = _free_port()
    with open(os.path.join(work, "lighthouse.log"), "w") as log:  # torchft's defaults but min_replicas
        lighthouse = subprocess.Popen([lighthouse_binary(), "--min_replicas", str(FT_MIN_REPLICAS),
                                       "--bind", f"[::]:{lh_port}"], stdout=log, stderr=subprocess.STDOUT)
    lighthouse_addr = f"http://127.0.0.1:{lh_port}"
    _wait_port(lh_port, lighthouse)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    procs: list[subprocess.Popen] = []

    def spawn(replica: int, replacement: bool = False) -> subprocess.Popen:
        cmd = [sys.executable, os.path.join(PEERS_DIR, "ft_worker.py"), "--replica", str(replica),
               "--replicas", str(WORLD), "--min-replicas", str(FT_MIN_REPLICAS), "--steps", str(steps),
               "--lighthouse", lighthouse_addr, "--store", f"127.0.0.1:{store.port}",
               "--log", os.path.join(work, f"replica{replica}.jsonl"),
               "--out", os.path.join(work, f"final{replica}.json")]
        cmd += (["--tiny"] if tiny else []) + (["--sync"] if sync else []) + (["--replacement"] if replacement else [])
        suffix = ".replacement" if replacement else ""
        with open(os.path.join(work, f"replica{replica}{suffix}.log"), "w") as log:
            proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT)
        procs.append(proc)
        return proc

    t_kill = None
    try:
        victim = None
        for r in range(WORLD):
            proc = spawn(r)
            victim = proc if r == VICTIM else victim
        if kill_at is not None:
            recs = _wait_start(os.path.join(work, "replica0.jsonl"), kill_at, procs, JOB_TIMEOUT_S)
            _sleep_into_step(recs, kill_at)
            t_kill = time.time()
            victim.kill()
            spawn(VICTIM, replacement=True)  # at once: no launcher detection delay
        deadline = time.monotonic() + JOB_TIMEOUT_S
        live = [p for p in procs if p is not victim or kill_at is None]
        while any(p.poll() is None for p in live) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in live):
                break
            time.sleep(0.05)
        codes = [p.poll() for p in live]
    finally:
        _stop([*procs, lighthouse])
    finals = {r: read_jsonl(os.path.join(work, f"final{r}.json")) for r in range(WORLD)}
    hashes = {r: f[0]["state_sha256"] for r, f in finals.items() if f}
    return {"exit_codes": codes, "t_kill": t_kill, "hashes": hashes,
            "logs": {r: read_jsonl(os.path.join(work, f"replica{r}.jsonl")) for r in range(WORLD)}}


def run_torchft(work: str, steps: int, kill_at: int, tiny: bool, sync: bool) -> dict:
    ref = _ft_job(os.path.join(work, "reference"), steps, tiny, sync, None)
    job = _ft_job(os.path.join(work, "kill"), steps, tiny, sync, kill_at)
    t_kill = job["t_kill"]
    w0 = job["logs"][0]
    ends0 = [r for r in w0 if r["event"] == "end"]
    commits0 = [r for r in ends0 if r["committed"]]
    replacement = [r for r in job["logs"][VICTIM] if r["ts"] > t_kill]
    first_full = next((r for r in replacement if r["event"] == "end" and r["committed"] and r["participating"]
                       and r["participants"] == WORLD), None)
    t_full = None
    if first_full is not None:
        same = [r["ts"] for r in commits0 if r["step"] == first_full["step"]]
        t_full = max([first_full["ts"], *same])
    ref_ok = len(ref["hashes"]) == WORLD and len(set(ref["hashes"].values())) == 1
    return {
        "exit_codes": job["exit_codes"], "reference_exit_codes": ref["exit_codes"],
        **figures([r["ts"] for r in commits0], t_kill, t_full),
        "steps_recomputed": recomputed(r["step"] for r in w0 if r["event"] == "start"),
        "steps_lost": 0,
        "worker_batches_dropped": dropped(((r["step"], r["participants"]) for r in commits0), WORLD),
        "bit_identical": ref_ok and job["hashes"] == ref["hashes"],
        "detail": {
            "failed_commits_worker0": sum(1 for r in ends0 if not r["committed"]),
            "reduced_strength_steps": sorted({r["step"] for r in commits0 if r["participants"] < WORLD}),
            "first_full_strength_step": first_full["step"] if first_full else None,
            "replacement_first_record_s": _r(replacement[0]["ts"] - t_kill) if replacement else None,
            "use_async_quorum": not sync,
        },
    }


# --------------------------------------------------------------------------------------------------
# (d) torchrun + DCP every step
# --------------------------------------------------------------------------------------------------


def torchrun_missing() -> Optional[str]:
    """Why torchrun + DCP cannot run here (None if it can)."""
    if importlib.util.find_spec("torch.distributed.run") is None or importlib.util.find_spec(
            "torch.distributed.checkpoint") is None:
        return "torch.distributed.run (torchrun) or torch.distributed.checkpoint is not available"
    return None


def _dcp_job(work: str, steps: int, tiny: bool, kill_at: Optional[int]) -> dict:
    shutil.rmtree(work, ignore_errors=True)
    logs, outs, ckpt = (os.path.join(work, d) for d in ("logs", "final", "ckpt"))
    for d in (logs, outs, ckpt):
        os.makedirs(d)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD),
           "--max-restarts", "1", "--monitor-interval", "0.1",
           os.path.join(PEERS_DIR, "dcp_worker.py"), "--steps", str(steps), "--ckpt", ckpt, "--log-dir", logs,
           "--out-dir", outs] + (["--tiny"] if tiny else [])
    with open(os.path.join(work, "torchrun.log"), "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT)
    t_kill = None
    try:
        if kill_at is not None:
            recs = _wait_start(os.path.join(logs, "rank0.jsonl"), kill_at, [proc], JOB_TIMEOUT_S)
            victim_pid = read_jsonl(os.path.join(logs, f"rank{VICTIM}.jsonl"))[-1]["pid"]
            _sleep_into_step(recs, kill_at)
            t_kill = time.time()
            os.kill(victim_pid, signal.SIGKILL)
        rc = proc.wait(timeout=JOB_TIMEOUT_S)
    finally:
        _stop([proc])
    hashes = {}
    for r in range(WORLD):
        f = read_jsonl(os.path.join(outs, f"rank{r}.json"))
        if f:
            hashes[r] = f[0]["state_sha256"]
    return {"exit_code": rc, "t_kill": t_kill, "hashes": hashes,
            "logs": {r: read_jsonl(os.path.join(logs, f"rank{r}.jsonl")) for r in range(WORLD)}}


def run_dcp(work: str, steps: int, kill_at: int, tiny: bool) -> dict:
    ref = _dcp_job(os.path.join(work, "reference"), steps, tiny, None)
    job = _dcp_job(os.path.join(work, "kill"), steps, tiny, kill_at)
    t_kill = job["t_kill"]
    w0 = job["logs"][0]
    first_pid = {r: logs[0]["pid"] for r, logs in job["logs"].items() if logs}
    restarted_first_end = [next((x["ts"] for x in logs if x["event"] == "end" and x["pid"] != first_pid[r]), None)
                           for r, logs in job["logs"].items()]
    t_full = max(restarted_first_end) if restarted_first_end and None not in restarted_first_end else None
    ref_ok = len(ref["hashes"]) == WORLD and len(set(ref["hashes"].values())) == 1
    saves = [x["save_s"] for x in ref["logs"][0] if x["event"] == "saved"]
    loaded = [x for x in w0 if x["event"] == "loaded"]
    return {
        "exit_code": job["exit_code"], "reference_exit_code": ref["exit_code"],
        **figures([x["ts"] for x in w0 if x["event"] == "end"], t_kill, t_full),
        "steps_recomputed": recomputed(x["step"] for x in w0 if x["event"] == "start"),
        "steps_lost": 0,
        "worker_batches_dropped": 0,
        "bit_identical": ref_ok and job["hashes"] == ref["hashes"],
        "detail": {"checkpoint_s": _r(statistics.median(saves)) if saves else None,
                   "resume_step": loaded[0]["next_step"] if loaded else None,
                   "load_s": _r(loaded[0]["load_s"]) if loaded else None,
                   "restarted_processes_first_record_s": _r(min(
                       (x["ts"] for x in w0 if x["pid"] != first_pid[0]), default=t_kill) - t_kill)},
    }


# --------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------

ROWS = ("survivor_stall_s", "time_to_full_strength_s", "steps_recomputed", "worker_batches_dropped",
        "bit_identical")


def table(results: dict) -> str:
    """A plain-text table, peer x figure (stderr only; the JSON is the result)."""
    head = f"{'peer':<19}" + "".join(f"{c:>26}" for c in ROWS)
    lines = [head]
    for name, r in results.items():
        lines.append(f"{name:<19}" + "".join(f"{str(r.get(c)):>26}" for c in ROWS))
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--kill-at", type=int, default=15, help="kill worker 3 once the job began this step")
    ap.add_argument("--tiny", action="store_true", help="the 40 k-parameter GPT (fast check of the plumbing)")
    ap.add_argument("--peers", default=",".join(PEERS), help=f"comma-separated, from {', '.join(PEERS)}")
    ap.add_argument("--work-dir", default="tmrun/bench_peers")
    args = ap.parse_args(argv)
    chosen = [x.strip() for x in args.peers.split(",") if x.strip()]
    if unknown := [x for x in chosen if x not in PEERS]:
        ap.error(f"unknown peer(s) {unknown}; choose from {list(PEERS)}")
    if not 4 <= args.kill_at < args.steps - 4:
        ap.error("need at least 4 steps before --kill-at and 4 after it")
    work = os.path.abspath(args.work_dir)

    runners: dict[str, tuple[Callable[[], Optional[str]], Callable[[], dict]]] = {
        "trainmover": (lambda: None, lambda: run_trainmover(work, args.steps, args.kill_at, args.tiny)),
        "trainmover_guarded": (lambda: None, lambda: run_trainmover(work, args.steps, args.kill_at, args.tiny,
                                                                    guarded=True)),
        "torchft_async": (torchft_missing, lambda: run_torchft(os.path.join(work, "ft_async"), args.steps,
                                                               args.kill_at, args.tiny, sync=False)),
        "torchft_sync": (torchft_missing, lambda: run_torchft(os.path.join(work, "ft_sync"), args.steps,
                                                              args.kill_at, args.tiny, sync=True)),
        "torchrun_dcp": (torchrun_missing, lambda: run_dcp(os.path.join(work, "dcp"), args.steps, args.kill_at,
                                                           args.tiny)),
    }
    results: dict[str, dict] = {}
    skipped: dict[str, str] = {}
    for name in chosen:
        missing, run = runners[name]
        if (why := missing()) is not None:
            skipped[name] = why
            print(f"[peers] skipping {name}: {why}", file=sys.stderr, flush=True)
            continue
        print(f"[peers] {name} ...", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        try:
            results[name] = run()
        except Exception as e:  # noqa: BLE001 - one peer failing must not lose the others' figures
            results[name] = {"error": f"{type(e).__name__}: {e}"}
        results[name]["wall_s"] = round(time.monotonic() - t0, 1)

    ours = results.get("trainmover", {})
    guarded = results.get("trainmover_guarded", {})
    for name, r in results.items():
        if not name.startswith("trainmover") and "error" not in r:
            r["ratios"] = {
                "time_to_full_strength_vs_trainmover": ratio(r.get("time_to_full_strength_s"),
                                                             ours.get("time_to_full_strength_s")),
                "survivor_stall_vs_trainmover": ratio(r.get("survivor_stall_s"), ours.get("survivor_stall_s")),
                "time_to_full_strength_vs_trainmover_guarded": ratio(r.get("time_to_full_strength_s"),
                                                                     guarded.get("time_to_full_strength_s")),
            }
    ft = results.get("torchft_async", {})
    headline = ratio(ft.get("time_to_full_strength_s"), ours.get("time_to_full_strength_s"))
    result = {
        "workload": {"model": "tiny" if args.tiny else "gpt-256x4", "workers": WORLD, "threads_per_worker": 1,
                     "backend": "gloo", "device": "cpu", "steps": args.steps, "kill_at": args.kill_at,
                     "kill_fraction_of_step": KILL_FRACTION, "killed_worker": VICTIM,
                     "torchft_min_replicas": FT_MIN_REPLICAS},
        "peers": results,
        "skipped": skipped,
        "targets": {"time_to_full_strength_ratio_vs_torchft_async_min": TARGET_RATIO,
                    "trainmover_bit_identical": True},
        "met": {"time_to_full_strength_ratio": headline is not None and headline >= TARGET_RATIO,
                "trainmover_bit_identical": bool(ours.get("bit_identical"))},
        "time_to_full_strength_ratio_vs_torchft_async": headline,
        # the same with the failed node guarded (tmd.guards): what a failure of a guarded node costs
        "time_to_full_strength_ratio_vs_torchft_async_guarded": ratio(ft.get("time_to_full_strength_s"),
                                                                      guarded.get("time_to_full_strength_s")),
    }
    print(table(results), file=sys.stderr, flush=True)
    print(json.dumps(result), flush=True)
    from benchmarks import report

    report.save("peers", result, [os.path.join(work, d) for name, d in (("trainmover", "tm_kill"),
                                  ("trainmover_guarded", "tm_kill_guarded")) if name in results])
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

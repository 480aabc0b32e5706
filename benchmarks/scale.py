"""How a planned migration's cost grows with the world size, against a full rebuild of every group, in one run.
Prints one JSON object and saves it (benchmarks/results/scale.json, a timeline picture per job).

    python -m benchmarks.scale [--nodes 4,8,16] [--repeats 3] [--ranks-per-node 2] [--steps 40] [--migrate-at 12]
                               [--pad-s 0.4]

Workload: the tiny demo GPT (DDP) on K nodes x 2 ranks, plus one subgroup per node (``--group-size 2``), so the
job has K + 1 groups (the world group and K node subgroups) and each rank is in 2 of them. One standby (s1);
node n2 migrates to it once training runs. For each size it reports, from tmd's migration record:

- ``stayer_pause_s``: the longest time a stayer stood at the switch step; ``joiner_lag_s``: how much later the last
  joiner was ready to run the switch step than the last stayer (the stayers' first collective of it waits that
  long); ``switch_stall_s`` = the two together, what the stayers lose at the switch (target: it grows <= 1.5x);
- ``prepare_s``: phase 1 (every party building the next generation of its groups, in the background);
- the groups rebuilt (the record's ``rebuilt``: party ``node/local_rank`` -> names of the groups it built a next
  generation of): per party role, how many groups one party of that role rebuilt (delta-based: a stayer rebuilds
  only the world group, which holds a leaver; the leaver rebuilds none; the joiner rebuilds the world group and
  n2's node subgroup, which only the joiners are members of), the distinct groups rebuilt, and the group
  memberships rebuilt in all (summed over every party) against those of a full rebuild (2 per rank);
- ``downtime_s`` (switch step + 5 steps over the median) and the median step;
- ``peak_rss_bytes``: the peak summed RSS of the job's processes (tmd, the ranks and the standby).

Each size runs ``--repeats`` jobs, the sizes alternated (4, 8, 16, 4, 8, 16, ...: a slow spell of the shared
machine does not land on one size only); a size's timings are the medians over its committed jobs, every job's
own under ``samples``. In the same run, right after each size's first job, ``full_rebuild_s`` is what rebuilding
every group of that world costs with the job's own code path: ``world`` fresh processes (no training) meet on a
TCPStore, then each builds a new generation of every group it is a member of (the world group and its node
subgroup, ``worker.backend.build_inner`` under a new store prefix, as ``GroupManager.build_all`` does after a
failure); the figure is the slowest rank's time for that. The ratios compare the largest world with the
smallest. Target (issue 12): the stayer pause grows by at most 1.5x from 8 to 32 ranks while the full rebuild grows
with the world.

On this 2-core machine K x 2 processes share two cores, so every figure at 32 ranks includes oversubscription
(the steps themselves slow down); ``--pad-s`` (the demo's ``--min-step-time-s``) keeps steps regular. Ratios
within one run are what compare. The full rebuild is measured with the job stopped (no training competing for
the cores), so it is a lower bound of what it would cost inside the job.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
from typing import Optional

from benchmarks import report
from tmctl.localjob import job_client, migrate_when_ready, tmd_command
from tmd import protocol as p

GROUP_SIZE = 2  # the demo's --group-size: with 2 ranks per node, one subgroup per node
LEAVER_NODE, STANDBY_NODE = "n2", "s1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def groups_of_rank(rank: int, world: int, group_size: int = GROUP_SIZE) -> list[list[int]]:
    """The global ranks of every group ``rank`` is a member of in the demo with ``--group-size group_size``:
    the world group, then its block of ``group_size`` consecutive ranks."""
    first = rank - rank % group_size
    return [list(range(world)), list(range(first, min(first + group_size, world)))]


def groups_in_job(world: int, group_size: int = GROUP_SIZE) -> int:
    """Process groups of the demo job: the world group and one per ``group_size`` consecutive ranks."""
    return 1 + -(-world // group_size)


def rebuilt_by_role(rebuilt: dict[str, list[str]], leaver_nodes: tuple[str, ...],
                    joiner_nodes: tuple[str, ...]) -> dict:
    """Summarise a migration record's ``rebuilt`` (``"node/local_rank"`` -> group names that party built a next
    generation of). Returns ``per_party`` (role -> the most groups one party of that role rebuilt; None when no
    party of the role reported), ``parties`` (role -> how many parties reported), ``distinct_groups`` (groups
    with a new generation) and ``memberships`` (group builds summed over every party)."""
    counts: dict[str, list[int]] = {str(r): [] for r in p.MigrationRole}
    names: set[str] = set()
    for party, groups in rebuilt.items():
        node = party.split("/", 1)[0]
        role = (p.MigrationRole.LEAVER if node in leaver_nodes else
                p.MigrationRole.JOINER if node in joiner_nodes else p.MigrationRole.STAYER)
        counts[str(role)].append(len(groups))
        names.update(groups)
    return {"per_party": {role: (max(v) if v else None) for role, v in counts.items()},
            "parties": {role: len(v) for role, v in counts.items()},
            "distinct_groups": len(names),
            "memberships": sum(sum(v) for v in counts.values())}


def ratio(small: Optional[float], large: Optional[float]) -> Optional[float]:
    """``large / small`` rounded to 3 digits; None when either is missing or ``small`` is not positive."""
    ok = all(isinstance(x, (int, float)) for x in (small, large))
    return round(large / small, 3) if ok and small > 0 else None


class RssSampler:
    """Samples the summed RSS (bytes) of a process and all its descendants every ``period_s`` seconds on a
    thread; ``peak`` is the largest sum seen."""

    def __init__(self, pid: int, period_s: float = 1.0) -> None:
        self.pid, self.period_s, self.peak, self.procs_at_peak = pid, period_s, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="rss-sampler")
        self._thread.start()

    def _run(self) -> None:
        import psutil

        while not self._stop.wait(self.period_s):
            try:
                root = psutil.Process(self.pid)
                procs = [root, *root.children(recursive=True)]
            except psutil.Error:
                continue
            total = 0
            for proc in procs:
                try:
                    total += proc.memory_info().rss
                except psutil.Error:
                    pass
            if total > self.peak:
                self.peak, self.procs_at_peak = total, len(procs)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def run_size(nodes: int, rpn: int, steps: int, migrate_at: int, pad_s: float, run_dir: str,
             tmd_args: tuple = ()) -> dict:
    """One job of ``nodes`` x ``rpn`` ranks with a migration n2 -> s1 (``tmd_args``: tmd local's own options); what
    tmd's record says of it."""
    shutil.rmtree(run_dir, ignore_errors=True)
    args = ("--group-size", str(GROUP_SIZE), "--min-step-time-s", str(pad_s))
    t0 = time.monotonic()
    proc = subprocess.Popen(tmd_command(run_dir, 1, steps, True, True, args, tmd_args, nodes=nodes, ranks_per_node=rpn),
                            stdout=subprocess.DEVNULL)
    rss = RssSampler(proc.pid)
    try:
        client = job_client(run_dir, proc, timeout_s=30)
        m = migrate_when_ready(client, proc, migrate_at, LEAVER_NODE, STANDBY_NODE)
        rc = proc.wait(timeout=900)
    finally:
        rss.stop()
        if proc.poll() is None:
            proc.terminate()
            proc.wait()
    world = nodes * rpn
    rebuilt = rebuilt_by_role(m.get("rebuilt") or {}, (LEAVER_NODE,), (STANDBY_NODE,))
    return {
        "nodes": nodes, "world": world, "state": m["state"], "reason": m.get("reason"), "exit_code": rc,
        "groups_in_job": groups_in_job(world),
        "stayer_pause_s": m.get("pause_s"), "joiner_lag_s": m.get("joiner_lag_s"),
        "switch_stall_s": None if m.get("pause_s") is None else round(m["pause_s"] + (m.get("joiner_lag_s") or 0.0), 6),
        "prepare_s": (m.get("phases_s") or {}).get("prepare"),
        "downtime_s": m.get("downtime_s"), "median_step_s": m.get("median_step_s"),
        "switch_step": m.get("switch_step"), "phases_s": m.get("phases_s"),
        "groups_rebuilt_per_party": rebuilt["per_party"],
        "parties_reporting": rebuilt["parties"],
        "distinct_groups_rebuilt": rebuilt["distinct_groups"],
        "group_memberships_rebuilt": rebuilt["memberships"],
        "group_memberships_in_job": 2 * world,
        "bytes_moved": m.get("bytes_moved"),
        "peak_rss_bytes": rss.peak, "processes_at_peak": rss.procs_at_peak,
        "job_wall_s": round(time.monotonic() - t0, 1),
    }


TIMED = ("stayer_pause_s", "joiner_lag_s", "switch_stall_s", "prepare_s", "downtime_s", "median_step_s",
         "peak_rss_bytes", "job_wall_s")  # a size's figures: medians over its jobs


def summarize(samples: list[dict]) -> dict:
    """One size's figures from its jobs (``run_size``'s dicts, in order): the first committed job's record with
    each of ``TIMED`` replaced by its median over the committed jobs that have it (None: none has), plus
    ``samples`` (each job's state and ``TIMED`` figures) and ``jobs_committed``. With no committed job, the first
    job's record."""
    committed = [s for s in samples if s.get("state") == p.MigrationState.COMMITTED]
    out = dict((committed or samples)[0])
    for key in TIMED:
        values = [s[key] for s in committed if s.get(key) is not None]
        out[key] = statistics.median(values) if values else (None if committed else out.get(key))
    out["samples"] = [{k: s.get(k) for k in ("state", "reason", "exit_code", "error", *TIMED) if k in s}
                      for s in samples]
    out["jobs_committed"] = len(committed)
    return out


def full_rebuild_s(world: int, attempts: int = 3, timeout_s: float = 240.0) -> dict:
    """Build a new generation of every group of a ``world``-rank demo job with ``world`` fresh processes (see the
    module docstring). Returns ``seconds`` (the slowest rank's build time), ``median_rank_s``, ``wall_s`` (the
    whole measurement, process start-up included) and ``attempts`` (a rank failing, e.g. a gloo connection reset
    under load, kills the attempt and a fresh one starts on a new store). Raises RuntimeError when every one of
    ``attempts`` attempts failed, each bounded by ``timeout_s`` seconds."""
    t0 = time.monotonic()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("TM_KEYS", None)  # no job here: plain store prefixes
    errors = []
    for attempt in range(1, attempts + 1):
        port = free_port()
        procs = [subprocess.Popen([sys.executable, "-m", "benchmarks.scale", "--rebuild-rank", str(r), "--world",
                                   str(world), "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env=env)
                 for r in range(world)]
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                codes = [proc.poll() for proc in procs]
                if any(c not in (None, 0) for c in codes) or all(c == 0 for c in codes):
                    break
                time.sleep(0.1)  # child processes: nothing to wait on for "any of them exited"
            codes = [proc.poll() for proc in procs]
            if all(c == 0 for c in codes):
                times = sorted(json.loads(proc.stdout.read().strip().splitlines()[-1])["seconds"] for proc in procs)
                return {"seconds": round(times[-1], 6), "median_rank_s": round(times[len(times) // 2], 6),
                        "wall_s": round(time.monotonic() - t0, 1), "attempts": attempt}
            failed = next((k for k, c in enumerate(codes) if c not in (None, 0)), None)
            why = (f"rank {failed} exited with {codes[failed]}: "
                   + procs[failed].stderr.read().strip().splitlines()[-1][:300]) if failed is not None \
                else f"not done after {timeout_s:.0f} s"
            errors.append(why)
            print(f"[scale] full rebuild of {world} ranks, attempt {attempt}: {why}", file=sys.stderr, flush=True)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
                proc.stdout.close()
                proc.stderr.close()
    raise RuntimeError(f"full rebuild of {world} ranks failed {attempts} times: {errors}")


def rebuild_rank(rank: int, world: int, port: int) -> None:
    """One process of :func:`full_rebuild_s`: meet the others on the store, then time building a new generation
    of every group this rank is a member of; print ``{"rank", "seconds"}``."""
    import datetime

    import torch
    import torch.distributed as dist

    from worker import backend as mb

    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=240)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timeout, wait_for_workers=False)
    store.add("arrived", 1)  # every process is up and connected before anyone starts the clock
    if rank == 0:
        while store.add("arrived", 0) < world:
            time.sleep(0.02)
        store.set("go", "1")
    store.wait(["go"])
    t0 = time.perf_counter()
    world_ranks, node_ranks = groups_of_rank(rank, world)
    built = [mb.build_inner(store, p.layout.group_prefix(1, name), ranks.index(rank), len(ranks), 240.0)
             for name, ranks in ((p.layout.WORLD_GROUP, world_ranks), (f"node{node_ranks[0]}", node_ranks))]
    seconds = time.perf_counter() - t0
    print(json.dumps({"rank": rank, "seconds": seconds}), flush=True)
    # every rank stays until all are done: a rank that exits closes its gloo pairs while a slower peer may still be
    # completing its side of the full mesh ("Connection closed by peer" at 32 ranks under load); the master keeps
    # the store up until then as well
    store.add("done", 1)
    while store.add("done", 0) < world:
        time.sleep(0.02)
    del built


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", default="4,8,16", help="comma-separated node counts")
    ap.add_argument("--repeats", type=int, default=3, help="jobs per size (alternated across sizes)")
    ap.add_argument("--ranks-per-node", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--migrate-at", type=int, default=12)
    ap.add_argument("--pad-s", type=float, default=0.4, help="--min-step-time-s of the jobs (keeps steps regular)")
    ap.add_argument("--run-dir", default="tmrun/bench-scale")
    ap.add_argument("--no-save", action="store_true", help="print only (a trial run)")
    ap.add_argument("--isolate-nodes", action="store_true", help=report.ISOLATE_HELP)
    ap.add_argument("--heartbeat-timeout-s", type=float, default=15.0,
                    help="tmd's heartbeat timeout (seconds; default 15: at 32 ranks 17 processes share a core, and a "
                         "rank starved for 5 s while the world starts would be declared dead before its first step)")
    ap.add_argument("--rebuild-rank", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rebuild_rank is not None:
        rebuild_rank(args.rebuild_rank, args.world, args.port)
        return 0
    t0 = time.monotonic()
    node_counts = [int(n) for n in args.nodes.split(",")]
    jobs: dict[int, list[dict]] = {n: [] for n in node_counts}
    rebuilds: dict[int, dict] = {}
    run_dirs = []
    for repeat in range(args.repeats):
        for nodes in node_counts:
            run_dir = os.path.join(args.run_dir, f"n{nodes}-{repeat}")
            try:
                tmd_args = ("--heartbeat-timeout-s", str(args.heartbeat_timeout_s),
                            *(("--isolate-nodes",) if args.isolate_nodes else ()))
                job = run_size(nodes, args.ranks_per_node, args.steps, args.migrate_at, args.pad_s, run_dir, tmd_args)
            except (RuntimeError, subprocess.TimeoutExpired) as e:  # a job that fails is reported, the rest go on
                job = {"nodes": nodes, "world": nodes * args.ranks_per_node, "state": None, "error": str(e)}
            jobs[nodes].append(job)
            run_dirs.append(run_dir)
            print(json.dumps(job), file=sys.stderr, flush=True)
            if repeat == 0:
                try:
                    rebuild = full_rebuild_s(job["world"])
                    rebuilds[nodes] = dict(
                        full_rebuild_s=rebuild["seconds"], full_rebuild_median_rank_s=rebuild["median_rank_s"],
                        full_rebuild_wall_s=rebuild["wall_s"], full_rebuild_attempts=rebuild["attempts"])
                except RuntimeError as e:
                    rebuilds[nodes] = dict(full_rebuild_s=None, full_rebuild_error=str(e))
    sizes = [{**summarize(jobs[n]), **rebuilds[n]} for n in node_counts]
    small, large = sizes[0], sizes[-1]
    ratios = {k: ratio(small.get(k), large.get(k))
              for k in ("stayer_pause_s", "switch_stall_s", "prepare_s", "full_rebuild_s", "downtime_s",
                        "median_step_s")}
    growth_max = 1.5
    result = {
        "workload": {"model": "gpt-tiny", "ranks_per_node": args.ranks_per_node, "group_size": GROUP_SIZE,
                     "steps": args.steps, "migrate_at": args.migrate_at, "pad_s": args.pad_s,
                     "heartbeat_timeout_s": args.heartbeat_timeout_s,
                     "repeats": args.repeats,
                     "migration": f"{LEAVER_NODE} -> {STANDBY_NODE}"},
        "setting": report.setting(args.isolate_nodes),
        "isolation": {n: report.isolation(os.path.join(args.run_dir, f"n{n}-0")) for n in node_counts},
        "sizes": sizes,
        "worlds": [small["world"], large["world"]],
        "ratios_largest_over_smallest": ratios,
        "targets": {"switch_stall_growth_max": growth_max,
                    "switch_stall_growth_met": (ratios["switch_stall_s"] is not None
                                                and ratios["switch_stall_s"] <= growth_max),
                    "full_rebuild_grows": ratios["full_rebuild_s"] is not None and ratios["full_rebuild_s"] > 1.0},
        "wall_s": round(time.monotonic() - t0, 1),
    }
    print(json.dumps(result), flush=True)
    if not args.no_save:
        report.save("scale", result, run_dirs)
    return 0 if all(j["state"] == p.MigrationState.COMMITTED for js in jobs.values() for j in js) else 1


if __name__ == "__main__":
    sys.exit(main())

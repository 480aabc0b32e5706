"""Group setup time through the job's rendezvous store (tmd.store, CURVE) against c10d's TCPStore, in one run.
Prints one JSON object and saves it (benchmarks/results/rendezvous.json).

    python -m benchmarks.rendezvous [--worlds 4,8,16] [--rounds 10] [--no-save]

For each world size W, this process hosts both stores as tmd does (a TCPStore master, libuv backend, as tmd hosted
it before issue 33; and tmd.store.StoreServer with a fresh job's keys, only the worker key admitted) and starts W
rank processes with ``TM_KEYS`` set to the job's worker keys. Each rank connects to both (worker.store.JobStore
over CURVE; a TCPStore client), then ``--rounds`` times and alternating the store (TCPStore, job store, TCPStore,
...), all ranks meet at a barrier and each builds a gloo group of all W ranks under a fresh prefix exactly as the
job does (worker.backend.build_inner: the job's secret namespace, gloo bound to 127.0.0.1), then releases it
(worker.backend.release_in_background: over the job store this also tells the store it may drop the setup's
keys). A round's figure is its slowest rank's setup time; reported per store: the median and every round, and
the ratio job store / TCPStore of the medians. Target (issue 33): at most 1.2x at world 4, 8 and 16.

On this shared 2-core machine W ranks share two cores; rounds alternate the stores so a slow spell of the machine
does not land on one only. Ratios within one run are what compare.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Optional

from benchmarks import report

TARGET = 1.2
STORES = ("tcpstore", "job_store")
HOST = "127.0.0.1"
TIMEOUT_S = 120.0


def rank_main(rank: int, world: int, tcp_port: int, job_port: int, rounds: int) -> None:
    """One rank: connect to both stores, then per round meet the others and time one gloo group's setup. Prints
    one JSON line per round: ``{"round", "store", "seconds"}``."""
    import torch
    import torch.distributed as dist

    from worker import backend as mb
    from worker.store import JobStore

    torch.set_num_threads(1)
    tcp = dist.TCPStore(HOST, tcp_port, is_master=False, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    job = JobStore.of_job(HOST, job_port, TIMEOUT_S)
    for r in range(rounds * len(STORES)):
        name = STORES[r % len(STORES)]
        store = tcp if name == "tcpstore" else job
        tcp.add(f"bench/arrived/{r}", 1)  # the barrier is the TCPStore's for both: the same skew for each
        tcp.wait([f"bench/go/{r}"])
        t0 = time.perf_counter()
        pg = mb.build_inner(store, f"bench/w{world}/r{r}", rank, world, TIMEOUT_S, HOST)
        seconds = time.perf_counter() - t0
        print(json.dumps({"round": r, "store": name, "seconds": seconds}), flush=True)
        mb.release_in_background(pg)
    tcp.add("bench/finished", 1)
    mb.wait_for_background(10.0)
    os._exit(0)  # no gloo teardown at interpreter exit (a pair whose peer closed first can abort)


def measure(world: int, rounds: int) -> dict:
    """Both stores at ``world`` ranks: the median slowest-rank setup time of each, every round's, the ratio."""
    import torch.distributed as dist

    from tmd.protocol.keys import KEYS_ENV, JobKeys
    from tmd.store import StoreServer

    with tempfile.TemporaryDirectory(prefix="tm-bench-rdzv-") as tmp:
        keys = JobKeys.create(os.path.join(tmp, "keys"))
        env = {**os.environ, KEYS_ENV: keys.worker_keys(), "OMP_NUM_THREADS": "1"}
        tcp = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
        job = StoreServer(HOST, keys)
        procs = [subprocess.Popen([sys.executable, "-m", "benchmarks.rendezvous", "--rank", str(rank),
                                   "--world", str(world), "--ports", f"{tcp.port},{job.port}",
                                   "--rounds", str(rounds)], env=env, stdout=subprocess.PIPE, text=True)
                 for rank in range(world)]
        try:
            for r in range(rounds * len(STORES)):
                tcp.wait([f"bench/arrived/{r}"])  # (exists once the first rank arrived)
                while tcp.add(f"bench/arrived/{r}", 0) < world:
                    time.sleep(0.005)
                tcp.set(f"bench/go/{r}", "1")
            outs = [proc.communicate(timeout=TIMEOUT_S)[0] for proc in procs]
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            job.stop()
        if any(proc.returncode for proc in procs):
            raise RuntimeError(f"world {world}: a rank failed (exit codes {[proc.returncode for proc in procs]})")
        slowest: dict[int, tuple[str, float]] = {}
        for out in outs:
            for line in out.splitlines():
                row = json.loads(line)
                if row["round"] not in slowest or row["seconds"] > slowest[row["round"]][1]:
                    slowest[row["round"]] = (row["store"], row["seconds"])
        left, served = len(job.state.data), job.served
    per_store = {name: [round(s, 4) for r, (n, s) in sorted(slowest.items()) if n == name] for name in STORES}
    medians = {name: statistics.median(v) for name, v in per_store.items()}
    return {"world": world, "tcpstore_s": round(medians["tcpstore"], 4), "job_store_s": round(medians["job_store"], 4),
            "ratio": round(medians["job_store"] / medians["tcpstore"], 3), "rounds": per_store,
            "job_store_keys_left": left,
            "job_store_requests_per_rank_and_setup": round(served / (world * rounds), 1)}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="4,8,16", help="comma-separated world sizes")
    ap.add_argument("--rounds", type=int, default=10, help="group setups per store and world")
    ap.add_argument("--no-save", action="store_true", help="print only (a trial run)")
    ap.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--ports", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rank is not None:
        tcp_port, job_port = (int(x) for x in args.ports.split(","))
        rank_main(args.rank, args.world, tcp_port, job_port, args.rounds)
        return 0
    sizes = [measure(int(w), args.rounds) for w in args.worlds.split(",")]
    result = {"workload": {"group": "gloo, all ranks, worker.backend.build_inner", "rounds": args.rounds,
                           "host": HOST},
              "sizes": sizes, "target_ratio_max": TARGET,
              "met": all(s["ratio"] <= TARGET for s in sizes)}
    print(json.dumps(result))
    if not args.no_save:
        for path in report.save("rendezvous", result):
            print(f"[rendezvous] wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

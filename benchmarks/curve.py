"""The cost of the control plane's CURVE encryption and authentication, with and without, in one run. Prints JSON.

    python -m benchmarks.curve [--heartbeats 20000] [--migrations 2] [--steps 60] [--tiny]

1. **Heartbeats** (in process, loopback): a worker agent's DEALER sends tmd's ROUTER real encoded
   :class:`~tmd.protocol.Heartbeat` frames, plain ZeroMQ vs CURVE (tmd.protocol.keys: the job's worker key, tmd's
   authenticator). Reported: microseconds per heartbeat received (one-way throughput) and per request/reply
   round trip, each the median of interleaved rounds, and the ratios CURVE / plain. A worker sends 10 heartbeats
   a second, so the absolute figure, not only the ratio, says whether it matters.
2. **Planned-migration downtime** (real jobs, benchmarks.migration's workload): ``tmd local`` with and without
   ``--no-auth``, alternated, ``--migrations`` each; reported: each run's downtime and stayer pause (seconds) and
   the ratios of the medians. On this shared 2-core machine a single downtime varies by tens of milliseconds,
   so the ratio of medians is what compares.

Target (issue 10): CURVE within 5% (ratio <= 1.05) on both. Reported, not asserted.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import zmq

from tmd import protocol as p
from tmd.protocol.keys import Authenticator, JobKeys


def _pair(keys: JobKeys | None) -> tuple[zmq.Context, zmq.Socket, zmq.Socket, Authenticator | None]:
    ctx = zmq.Context()
    auth = None
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        auth = Authenticator(ctx, keys)
        auth.start()
        keys.serve(router)
        keys.connect_as(dealer, p.Sender.WORKER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer.connect(f"tcp://127.0.0.1:{port}")
    dealer.send(b"hello")  # the handshake happens before the clock starts
    router.recv_multipart()
    return ctx, router, dealer, auth


def _heartbeat_round(keys: JobKeys | None, n: int) -> tuple[float, float]:
    """(µs per heartbeat one way, µs per request/reply round trip)."""
    ctx, router, dealer, auth = _pair(keys)
    frame = p.encode(p.Heartbeat(step=1234, counters={"ops_issued": 12345, "ops_completed": 12345, "busy_s": 12.5,
                                                      "blocked_s": 0.25, "last_op_start": time.time(),
                                                      "last_op_end": time.time()}))
    try:
        t = time.perf_counter()
        for _ in range(n):
            dealer.send(frame)
        for _ in range(n):
            router.recv_multipart()
        one_way = (time.perf_counter() - t) / n * 1e6
        rounds = max(1, n // 10)
        t = time.perf_counter()
        for _ in range(rounds):
            dealer.send(frame)
            ident, _ = router.recv_multipart()
            router.send_multipart([ident, frame])
            dealer.recv()
        rtt = (time.perf_counter() - t) / rounds * 1e6
        return one_way, rtt
    finally:
        dealer.close()
        router.close()
        if auth is not None:
            auth.stop()
        ctx.term()


def heartbeats(n: int, rounds: int = 5) -> dict:
    keys = JobKeys.create(os.path.join(tempfile.mkdtemp(prefix="tm-curve-"), "keys"))
    plain, curve = [], []
    for _ in range(rounds):  # interleaved: drift of a shared machine hits both alike
        plain.append(_heartbeat_round(None, n))
        curve.append(_heartbeat_round(keys, n))
    med = lambda xs, i: statistics.median(x[i] for x in xs)  # noqa: E731
    return {
        "heartbeats_per_round": n, "rounds": rounds,
        "plain_us_per_heartbeat": round(med(plain, 0), 2), "curve_us_per_heartbeat": round(med(curve, 0), 2),
        "plain_us_round_trip": round(med(plain, 1), 2), "curve_us_round_trip": round(med(curve, 1), 2),
        "ratio_one_way": round(med(curve, 0) / med(plain, 0), 3),
        "ratio_round_trip": round(med(curve, 1) / med(plain, 1), 3),
        "cpu_share_at_10_per_s": round(med(curve, 0) * 10 / 1e6, 6),
    }


def migrations(k: int, steps: int, migrate_at: int, tiny: bool, root: str) -> dict:
    from benchmarks.migration import run_live

    runs: dict[str, list[dict]] = {"curve": [], "plain": []}
    for i in range(k):
        for mode, args in (("curve", ()), ("plain", ("--no-auth",))):
            r = run_live(steps, migrate_at, tiny, os.path.join(root, f"{mode}{i}"), tmd_args=args)
            runs[mode].append({key: r[key] for key in ("state", "downtime_s", "stayer_pause_s", "median_step_s")})
    med = {mode: {key: statistics.median(r[key] for r in rs if r[key] is not None)
                  for key in ("downtime_s", "stayer_pause_s")} for mode, rs in runs.items()}
    return {
        "runs": runs, "medians": med,
        "ratio_downtime": round(med["curve"]["downtime_s"] / max(med["plain"]["downtime_s"], 1e-3), 3),
        "ratio_stayer_pause": round(med["curve"]["stayer_pause_s"] / max(med["plain"]["stayer_pause_s"], 1e-3), 3),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heartbeats", type=int, default=20000)
    ap.add_argument("--migrations", type=int, default=2, help="Jobs per mode (0: heartbeats only).")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--migrate-at", type=int, default=20)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--run-dir", default="tmrun/bench-curve")
    args = ap.parse_args(argv)
    result = {"heartbeats": heartbeats(args.heartbeats)}
    if args.migrations:
        result["migration"] = migrations(args.migrations, args.steps, args.migrate_at, args.tiny, args.run_dir)
    result["target_ratio_max"] = 1.05
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

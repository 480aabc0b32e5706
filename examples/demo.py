"""The end-to-end demo: a live migration of a training GPT, checked bit for bit against an uninterrupted run.

    python -m examples.demo [--steps 40] [--migrate-at 15] [--tiny] [--min-step-time-s S] [--netns-all]

1. Reference: ``tmd local`` runs 2 nodes x 2 ranks with no standby for ``--steps`` steps.
2. Migration: the same job with standby node s1; once rank 0 reaches ``--migrate-at`` the demo asks tmd to migrate
   n2 -> s1 through the same request path ``tmctl migrate`` uses (tmctl.client), and follows it to commit.
3. Every rank's final parameters + optimizer state hash must equal the reference run's.

tmd places the switch step about half a second of training ahead (``tmd.migration``), so a job whose steps are
very short (``--tiny``: ~20 ms) would end before it. ``--min-step-time-s`` pads every step of both runs to at least
that many seconds (examples/train_gpt.py; the numerics are unchanged); it defaults to 0.1 s with ``--tiny`` and to 0
otherwise. Where the job still ends first, the migration is aborted ("the job finished before the migration
committed") and the demo exits 1.

With ``--netns-all`` (root) the migration run puts tmd and every node in a network namespace of its own, each
with its own address on a bridge (``tmd local --netns-all``), as on separate hosts; the reference run is plain.

The last line of output is one JSON object:
``{"steps", "median_step_s", "migrations": [{"from", "to", "switch_step", "phases_s", "downtime_s",
"bytes_moved"}], "bit_identical"}``. Exit code 0 only when the migration committed and the states are identical.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

from tmctl.client import Client, find_keys
from tmctl.localjob import end_job, final_hashes, migrate_when_ready, tmd_command, wait_for_address
from tmd import protocol as p


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Live-migration demo (local mode)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--migrate-at", type=int, default=15)
    ap.add_argument("--tiny", action="store_true", help="a tiny GPT (fast)")
    ap.add_argument("--min-step-time-s", type=float, default=None,
                    help="pad every step to at least this many seconds (numerics unchanged); "
                         "default 0.1 with --tiny, else 0")
    ap.add_argument("--run-dir", default="tmrun/demo")
    ap.add_argument("--verbose", action="store_true", help="echo every rank's output")
    ap.add_argument("--netns-all", action="store_true",
                    help="the migration run with tmd and each node in a network namespace of its own (root)")
    args = ap.parse_args(argv)
    if args.min_step_time_s is None:
        args.min_step_time_s = 0.1 if args.tiny else 0.0
    shutil.rmtree(args.run_dir, ignore_errors=True)
    ref_dir, mig_dir = os.path.join(args.run_dir, "reference"), os.path.join(args.run_dir, "migration")

    print(f"[demo] reference run: 2 nodes x 2 ranks, {args.steps} steps", flush=True)
    script_args = ("--min-step-time-s", str(args.min_step_time_s)) if args.min_step_time_s > 0 else ()
    rc = subprocess.run(tmd_command(ref_dir, 0, args.steps, args.tiny, quiet=not args.verbose,
                                    script_args=script_args)).returncode
    if rc != 0:
        print(f"[demo] reference run failed with {rc}", file=sys.stderr)
        return 1

    print(f"[demo] migration run: 2 nodes x 2 ranks + standby s1; n2 -> s1 at step ~{args.migrate_at}", flush=True)
    cmd = tmd_command(mig_dir, 1, args.steps, args.tiny, quiet=not args.verbose, script_args=script_args)
    if args.netns_all:
        cmd[cmd.index("--"):cmd.index("--")] = ["--netns-all"]
    proc = subprocess.Popen(cmd)
    try:
        client = Client(wait_for_address(mig_dir, proc), timeout_s=10.0, keys_dir=find_keys(mig_dir, None))
        m = migrate_when_ready(client, proc, args.migrate_at, "n2", "s1")
        rc = proc.wait(timeout=1800)
    finally:
        end_job(proc)

    ref, got = final_hashes(ref_dir), final_hashes(mig_dir)
    identical = len(ref) == 4 and ref == got and len(set(ref.values())) == 1
    result = {
        "steps": args.steps,
        "median_step_s": m.get("median_step_s"),
        "migrations": [{
            "from": m["source"], "to": m["target"], "state": m["state"], "reason": m["reason"],
            "switch_step": m["switch_step"], "phases_s": m["phases_s"], "downtime_s": m["downtime_s"],
            "stayer_pause_s": m["pause_s"], "joiner_lag_s": m.get("joiner_lag_s"),
            "bytes_moved": m["bytes_moved"],
        }],
        "bit_identical": identical,
    }
    if not identical:
        print(f"[demo] final states differ: reference {ref} vs migrated {got}", file=sys.stderr)
    print(json.dumps(result), flush=True)
    return 0 if (rc == 0 and identical and m["state"] == p.MigrationState.COMMITTED) else 1


if __name__ == "__main__":
    sys.exit(main())

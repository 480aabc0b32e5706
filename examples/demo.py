"""The end-to-end demo: a live migration of a training GPT, checked bit for bit against an uninterrupted run.

    python -m examples.demo [--steps 40] [--migrate-at 15] [--tiny]

1. Reference: ``tmd local`` runs 2 nodes x 2 ranks with no standby for ``--steps`` steps.
2. Migration: the same job with standby node s1; once rank 0 reaches ``--migrate-at`` the demo asks tmd to migrate
   n2 -> s1 through the same request path ``tmctl migrate`` uses (tmctl.client), and follows it to commit.
3. Every rank's final parameters + optimizer state hash must equal the reference run's.

The last line of output is one JSON object:
``{"steps", "median_step_s", "migrations": [{"from", "to", "switch_step", "phases_s", "downtime_s",
"bytes_moved"}], "bit_identical"}``. Exit code 0 only when the migration committed and the states are identical.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import time

from tmctl.client import Client, CoordinatorUnreachable
from tmd import protocol as p


def tmd_command(run_dir: str, standbys: int, steps: int, tiny: bool, quiet: bool, script_args: tuple = ()) -> list[str]:
    """``tmd local`` for 2 nodes x 2 ranks running examples.train_gpt (``script_args`` are appended to it)."""
    cmd = [sys.executable, "-m", "tmd.cli", "local", "--nodes", "2", "--ranks-per-node", "2",
           "--standbys", str(standbys), "--run-dir", run_dir]
    if quiet:
        cmd.append("--quiet")
    cmd += ["--", sys.executable, "-m", "examples.train_gpt", "--steps", str(steps), *script_args]
    return cmd + (["--tiny"] if tiny else [])


def final_hashes(run_dir: str) -> dict[int, str]:
    out = {}
    for path in sorted(glob.glob(os.path.join(run_dir, "final", "rank*.json"))):
        with open(path) as f:
            d = json.load(f)
        out[d["rank"]] = d["state_sha256"]
    return out


def wait_for_address(run_dir: str, proc: subprocess.Popen, timeout_s: float = 60.0) -> str:
    path = os.path.join(run_dir, "tmd.json")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"tmd exited with {proc.returncode} before it was up")
        if os.path.exists(path):
            with open(path) as f:
                return json.load(f)["address"]
        time.sleep(0.1)  # another process writes it: nothing to wait on
    raise TimeoutError(f"tmd did not write {path} within {timeout_s} s")


def migrate_when_ready(client: Client, proc: subprocess.Popen, at_step: int, source: str, target: str) -> dict:
    """Wait until training reaches ``at_step`` and the standby is warm, request the migration, follow it."""
    while True:
        if proc.poll() is not None:
            raise RuntimeError("the job ended before the migration was requested")
        st = client.request(p.StatusRequest())
        warm = any(n["name"] == target and n["warm"] for n in st.nodes)
        if st.step >= at_step and warm:
            break
        time.sleep(0.2)
    reply = client.request(p.MigrateRequest(source, target))
    if isinstance(reply, p.ErrorReply):
        raise RuntimeError(f"migration refused: {reply.message}")
    mid = reply.migration["id"]
    print(f"[demo] migration {mid}: {source} -> {target} requested at step {st.step}", flush=True)
    seen = set()
    while True:
        m = client.request(p.MigrationRequest(mid)).migration
        if m["state"] not in seen:
            seen.add(m["state"])
            print(f"[demo] migration {mid}: {m['state']}" + (f" ({m['reason']})" if m["reason"] else ""), flush=True)
        if m["state"] in ("committed", "aborted"):
            break
        time.sleep(0.05)
    # downtime_s is known once the 5 steps after the switch step are done
    while m["state"] == "committed" and m["downtime_s"] is None and proc.poll() is None:
        time.sleep(0.2)
        try:
            m = client.request(p.MigrationRequest(mid)).migration
        except CoordinatorUnreachable:
            break
    return m


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Live-migration demo (local mode)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--migrate-at", type=int, default=15)
    ap.add_argument("--tiny", action="store_true", help="a tiny GPT (fast)")
    ap.add_argument("--run-dir", default="tmrun/demo")
    ap.add_argument("--verbose", action="store_true", help="echo every rank's output")
    args = ap.parse_args(argv)
    shutil.rmtree(args.run_dir, ignore_errors=True)
    ref_dir, mig_dir = os.path.join(args.run_dir, "reference"), os.path.join(args.run_dir, "migration")

    print(f"[demo] reference run: 2 nodes x 2 ranks, {args.steps} steps", flush=True)
    rc = subprocess.run(tmd_command(ref_dir, 0, args.steps, args.tiny, quiet=not args.verbose)).returncode
    if rc != 0:
        print(f"[demo] reference run failed with {rc}", file=sys.stderr)
        return 1

    print(f"[demo] migration run: 2 nodes x 2 ranks + standby s1; n2 -> s1 at step ~{args.migrate_at}", flush=True)
    proc = subprocess.Popen(tmd_command(mig_dir, 1, args.steps, args.tiny, quiet=not args.verbose))
    try:
        client = Client(wait_for_address(mig_dir, proc), timeout_s=10.0)
        m = migrate_when_ready(client, proc, args.migrate_at, "n2", "s1")
        rc = proc.wait(timeout=1800)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait()

    ref, got = final_hashes(ref_dir), final_hashes(mig_dir)
    identical = len(ref) == 4 and ref == got and len(set(ref.values())) == 1
    result = {
        "steps": args.steps,
        "median_step_s": m.get("median_step_s"),
        "migrations": [{
            "from": m["source"], "to": m["target"], "state": m["state"], "reason": m["reason"],
            "switch_step": m["switch_step"], "phases_s": m["phases_s"], "downtime_s": m["downtime_s"],
            "stayer_pause_s": m["pause_s"],
            "bytes_moved": m["bytes_moved"],
        }],
        "bit_identical": identical,
    }
    if not identical:
        print(f"[demo] final states differ: reference {ref} vs migrated {got}", file=sys.stderr)
    print(json.dumps(result), flush=True)
    return 0 if (rc == 0 and identical and m["state"] == "committed") else 1


if __name__ == "__main__":
    sys.exit(main())

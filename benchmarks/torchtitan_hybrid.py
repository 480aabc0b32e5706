"""torchtitan's own Trainer beside examples.train_llama, in the same layouts and the same run: planned-migration
downtime, stayer pause and recovery downtime. Prints one JSON object on stdout (progress goes to stderr).

    python -m benchmarks.torchtitan_hybrid [--steps 40] [--migrate-at 4] [--kill-at 30] [--snapshot-every 4]
                                           [--min-step-time-s 0.15] [--layouts fsdp,tp_fsdp] [--verify]

Each job is benchmarks.hybrid's (``run_layout``): local mode, 2 nodes x 2 ranks plus 2 warm standbys, tmd
``--snapshot-every K``; once training is at ``--migrate-at`` and s1 is warm, a planned migration n2 -> s1; at
``--kill-at`` every process of s1 kills itself with SIGKILL during the forward and tmd recovers on s2 by rolling
back to the last buddy snapshot (neither layout has a replica on another node). Figures per job as there:
``planned_downtime_s`` (tmd's migration record: the switch step and the 5 after it over the median step before the
request, lowest stayer), ``stayer_pause_s`` (the longest a stayer stood still at the switch step),
``recovery_downtime_s`` (``recovery_done``'s ``phases_s.total``: detection to every party recovered),
``steps_redone`` and ``downtime_incl_redo_s`` (that plus the redone steps at the median step), ``median_step_s``.

Workloads, per layout: ``train_llama`` (examples.train_llama ``--tiny``: dim 32, 2 layers; FSDP2 ``--dp-shard 4``,
or ``--tp 2 --dp-shard 2``) and ``torchtitan`` (torchtitan 0.3.0's Trainer through worker.integrations.torchtitan:
``llama3_tiny``: ``llama3_debugmodel`` cut to 2 layers, dim 256, sequence 64, batch 2 per data-parallel rank; FSDP2
over 4, or ``--parallelism.tensor-parallel-degree 2``). ``ratio_to_train_llama`` divides torchtitan's figures by
train_llama's. ``--verify`` also runs each job uninterrupted and compares every rank's final hash
(``bit_identical``). Needs torchtitan (``pip install -e .[torchtitan]``); exits 1 when a job failed, did not
migrate, or did not recover.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from benchmarks import hybrid, report

LAYOUTS = {"fsdp": hybrid.LAYOUTS["fsdp"], "tp_fsdp": hybrid.LAYOUTS["tp_fsdp"]}
TITAN_LAYOUTS = {"fsdp": (), "tp_fsdp": ("--parallelism.tensor-parallel-degree", "2")}
DATA_DOCS = 2000


def titan_workload(data_dir: str) -> hybrid.Workload:
    return hybrid.Workload("examples.torchtitan.train", TITAN_LAYOUTS,
                           args=("--module", "examples.torchtitan.config", "--config", "llama3_tiny",
                                 "--dataloader.dataset-path", data_dir), tiny=False)


def row(r: dict) -> dict[str, Any]:
    """The figures compared, from one hybrid.run_layout result."""
    mig, rec = r["planned_migration"] or {}, r["recovery"] or {}
    return {
        "ok": hybrid.job_ok(r), "exit_code": r["exit_code"], "error": r["error"], "wall_s": r["wall_s"],
        "median_step_s": mig.get("median_step_s"), "switch_step": mig.get("switch_step"),
        "planned_downtime_s": mig.get("downtime_s"), "stayer_pause_s": mig.get("stayer_pause_s"),
        "bytes_per_moved_rank": mig.get("bytes_per_moved_rank"),
        "recovery_downtime_s": rec.get("downtime_s"), "rollback_step": rec.get("rollback_step"),
        "steps_redone": rec.get("steps_redone"), "downtime_incl_redo_s": rec.get("downtime_incl_redo_s"),
        "bit_identical": r.get("bit_identical"),
    }


def ratios(titan: dict, llama: dict) -> dict[str, float | None]:
    keys = ("median_step_s", "planned_downtime_s", "stayer_pause_s", "recovery_downtime_s")
    return {k: round(titan[k] / llama[k], 2) if titan.get(k) is not None and llama.get(k) else None for k in keys}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--migrate-at", type=int, default=4)
    ap.add_argument("--kill-at", type=int, default=30, help="s1 kills itself in this step's forward")
    ap.add_argument("--snapshot-every", type=int, default=4)
    ap.add_argument("--min-step-time-s", type=float, default=0.15,
                    help="pad every step to at least this (both workloads; as benchmarks.hybrid)")
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, from {sorted(LAYOUTS)}")
    ap.add_argument("--verify", action="store_true", help="also run each job uninterrupted and compare hashes")
    ap.add_argument("--run-dir", default="tmrun/bench_torchtitan")
    args = ap.parse_args(argv)
    layouts = hybrid.checked_job_args(ap, args, LAYOUTS)
    from examples.torchtitan.make_data import write

    root = args.run_dir
    data_dir = os.path.join(root, "data")
    write(data_dir, DATA_DOCS)
    workloads = {"train_llama": hybrid.LLAMA, "torchtitan": titan_workload(data_dir)}
    jobs: dict[str, dict[str, dict]] = {layout: {} for layout in layouts}
    run_dirs = []
    for layout in layouts:
        for name, workload in workloads.items():
            hybrid.log(f"{layout} / {name}: {' '.join(workload.layouts[layout]) or '(no layout flag)'}")
            args.run_dir = os.path.join(root, name)
            r = hybrid.run_layout(layout, args, workload)
            jobs[layout][name] = row(r)
            run_dirs.append(os.path.join(args.run_dir, layout, "job"))
            hybrid.log(f"{layout} / {name}: exit {r['exit_code']} in {r['wall_s']} s"
                       + (f", error: {r['error']}" if r["error"] else ""))
        jobs[layout]["ratio_to_train_llama"] = ratios(jobs[layout]["torchtitan"], jobs[layout]["train_llama"])
    result = {
        "workload": {"nodes": 2, "ranks_per_node": 2, "standbys": hybrid.STANDBYS, "steps": args.steps,
                     "migrate_at": args.migrate_at, "kill_at": args.kill_at, "snapshot_every": args.snapshot_every,
                     "min_step_time_s": args.min_step_time_s,
                     "train_llama": "examples.train_llama --tiny (dim 32, 2 layers)",
                     "torchtitan": "torchtitan 0.3.0 llama3_tiny: llama3_debugmodel cut to 2 layers (dim 256), "
                                   "seq 64, batch 2"},
        "verified": args.verify,
        "layouts": jobs,
        "jobs_ok": {f"{layout}/{name}": jobs[layout][name]["ok"] for layout in layouts for name in workloads},
    }
    print(json.dumps(result), flush=True)
    report.save("torchtitan_hybrid", result, run_dirs)
    return 0 if all(result["jobs_ok"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())

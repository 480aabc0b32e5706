"""Issue 12's targets 1, 4 and 5 in both settings, co-located and isolated, in one run. Prints one JSON object and
saves it (benchmarks/results/settings.json).

    python -m benchmarks.settings [--only migration,scale,ettr] [--ettr-minutes 3] [--scale-nodes 4,8,16]
                                  [--scale-repeats 1] [--migration-repeat 3]

Each benchmark runs twice, back to back: first with its emulated nodes sharing this host's cores (co-located,
``benchmarks/results/<name>.json``), then with ``tmd local --isolate-nodes`` (isolated, each node on CPUs of its
own, standbys and guards apart from the active ranks: ``benchmarks/results/<name>-isolated.json``, which also says
the CPU split under ``isolation``). The summary puts the three targets side by side:

- target 1 (``benchmarks.migration``): the pre-copy path's switch stall <= 20 ms (the seconds the stayers lose at the
  switch step) and downtime <= 50 ms (seconds over the median step around the switch);
- target 4 (``benchmarks.scale``): the switch stall grows by at most 1.5x from the smallest to the largest world
  (8 to 32 ranks with the default ``--scale-nodes``);
- target 5 (``benchmarks.ettr``): ETTR >= 0.995 with a planned migration every ``--ettr-migrate-every-s`` seconds,
  extrapolated to that cadence from the measured seconds lost per event (``ettr_at_cadence``).

On this 2-core host the isolated split is one core for the standbys and one for every active rank, so the active
ranks run on half the cores: step times grow, and what the split removes is the joiners' warm-up competing with the
stayers. Ratios within one run are what compare; the machine is shared and noisy.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from benchmarks import report

BENCHMARKS = ("migration", "scale", "ettr")


def _load(name: str, isolated: bool) -> dict:
    with open(os.path.join(report.RESULTS_DIR, f"{report.result_name(name, isolated)}.json"), encoding="utf-8") as f:
        return json.load(f)


def _migration(result: dict) -> dict:
    live = result["live_migration"]
    medians = live.get("medians") or {}
    stall = medians.get("switch_stall_s", live.get("switch_stall_s"))
    downtime = medians.get("downtime_s", live.get("downtime_s"))
    return {"switch_stall_s": stall, "downtime_s": downtime,
            "switch_stall_met": stall is not None and stall <= result["targets"]["switch_stall_s_max"],
            "downtime_met": downtime is not None and downtime <= result["targets"]["downtime_s_max"],
            "all_committed": live.get("all_committed")}


def _scale(result: dict) -> dict:
    ratios = result["ratios_largest_over_smallest"]
    return {"worlds": result["worlds"], "switch_stall_s": [s.get("switch_stall_s") for s in result["sizes"]],
            "switch_stall_growth": ratios["switch_stall_s"],
            "switch_stall_growth_met": result["targets"]["switch_stall_growth_met"],
            "full_rebuild_growth": ratios["full_rebuild_s"]}


def _ettr(result: dict) -> dict:
    run = result["runs"]["migrate"]
    return {"ettr_at_cadence": run.get("ettr_at_cadence"), "ettr_vs_reference": run.get("ettr"),
            "lost_s_per_event": run.get("lost_s_per_event"), "events": run.get("events_done"),
            "bit_identical": run.get("bit_identical"), "met": result["met"]["migrate"]}


SUMMARY = {"migration": _migration, "scale": _scale, "ettr": _ettr}
TARGET = {"migration": "1: switch stall <= 0.02 s and downtime <= 0.05 s",
          "scale": "4: switch stall growth <= 1.5x from the smallest to the largest world",
          "ettr": "5: ETTR >= 0.995 with planned migrations"}


def summarise(names=BENCHMARKS) -> dict:
    """The side-by-side table from the saved results of ``names``: ``{name: {"target": ..., "co-located": {...},
    "isolated": {...}}}``. Raises OSError/KeyError when a result of either setting is missing or malformed."""
    return {name: {"target": TARGET[name], "co-located": SUMMARY[name](_load(name, False)),
                   "isolated": {**SUMMARY[name](_load(name, True)),
                                "split": _split(_load(name, True).get("isolation"))}}
            for name in names}


def _split(isolation) -> dict | None:
    """The CPU split of an isolated result (scale keeps one per size: the first is shown)."""
    if isinstance(isolation, dict) and isolation and all(isinstance(v, (dict, type(None))) for v in isolation.values()):
        isolation = next((v for v in isolation.values() if v), None)
    if not isolation:
        return None
    return {k: isolation[k] for k in ("mechanism", "active_cpus", "standby_cpus") if k in isolation}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.settings", description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=",".join(BENCHMARKS), help="comma-separated subset of migration,scale,ettr")
    ap.add_argument("--summarise-only", action="store_true", help="rerun nothing: summarise the saved results")
    ap.add_argument("--migration-repeat", type=int, default=3)
    ap.add_argument("--scale-nodes", default="4,8,16")
    ap.add_argument("--scale-repeats", type=int, default=1)
    ap.add_argument("--ettr-minutes", type=float, default=3.0)
    ap.add_argument("--ettr-migrate-every-s", type=float, default=45.0)
    args = ap.parse_args(argv)
    names = [n for n in args.only.split(",") if n]
    if any(n not in BENCHMARKS for n in names):
        ap.error(f"--only takes {', '.join(BENCHMARKS)}")
    status = 0
    if not args.summarise_only:
        from benchmarks import ettr, migration, scale

        argv_of = {
            "migration": (migration.main, ["--repeat", str(args.migration_repeat)]),
            "scale": (scale.main, ["--nodes", args.scale_nodes, "--repeats", str(args.scale_repeats)]),
            "ettr": (ettr.main, ["--minutes", str(args.ettr_minutes), "--runs", "migrate",
                                 "--migrate-every-s", str(args.ettr_migrate_every_s)]),
        }
        for name in names:
            run, base = argv_of[name]
            for isolated in (False, True):
                print(f"[settings] {name} {report.setting(isolated)}", file=sys.stderr, flush=True)
                status |= run(base + (["--isolate-nodes"] if isolated else []))
    result = {"targets_side_by_side": summarise(names)}
    print(json.dumps(result, default=str), flush=True)
    report.save("settings", result)
    return status


if __name__ == "__main__":
    sys.exit(main())

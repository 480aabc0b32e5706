"""benchmarks.settings: targets 1, 4 and 5 side by side from the co-located and isolated results, and
benchmarks.report keeping an isolated result beside the co-located one."""
from __future__ import annotations

import json

from benchmarks import report, settings

SPLIT = {"mechanism": "sched_setaffinity", "active_cpus": [0], "standby_cpus": [1], "per_node": 1, "nodes": {}}


def _migration(stall, downtime, isolated):
    live = {"switch_stall_s": stall, "downtime_s": downtime, "all_committed": True,
            "medians": {"switch_stall_s": stall, "downtime_s": downtime}}
    return {"setting": report.setting(isolated), "isolation": SPLIT if isolated else None, "live_migration": live,
            "targets": {"switch_stall_s_max": 0.02, "downtime_s_max": 0.05}}


def test_an_isolated_result_is_saved_beside_the_co_located_one_and_both_are_summarised(tmp_path):
    report.save("migration", _migration(0.083, 0.81, False), results_dir=str(tmp_path))
    report.save("migration", _migration(0.015, 0.0, True), results_dir=str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["migration-isolated.json", "migration.json"]
    assert json.loads((tmp_path / "migration.json").read_text())["setting"] == "co-located"

    side = settings.summarise(["migration"], str(tmp_path))["migration"]
    assert side["co-located"]["switch_stall_s"] == 0.083 and not side["co-located"]["downtime_met"]
    assert side["isolated"]["switch_stall_met"] and side["isolated"]["downtime_met"]
    assert side["isolated"]["split"] == {"mechanism": "sched_setaffinity", "active_cpus": [0], "standby_cpus": [1]}


def test_the_scale_split_is_read_from_its_per_size_isolation():
    assert settings._split({"4": None, "16": None}) is None
    assert settings._split({"4": SPLIT, "16": SPLIT})["active_cpus"] == [0]

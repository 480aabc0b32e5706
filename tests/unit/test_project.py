"""benchmarks/project.py: the projection's arithmetic, its layouts and where its measured inputs come from."""
from __future__ import annotations

import json
import math
import os
import shutil

import pytest

from benchmarks import project as pj


def synthetic() -> dict:
    """Measured inputs with round values, so each term can be checked by hand."""
    def t(value):
        return {"value": value, "unit": "", "from": "x.json: y"}

    return {"swap_s": t(0.001), "group_build_s_by_world": t({8: 0.01}), "group_build_exponent": t(1.0),
            "tail_s_per_tensor": t(4e-6), "detection_exit_s": t(0.01), "halt_s": t(0.02), "plan_s": t(0.03),
            "migration_shadow_steps": t(1), "recovery_shadow_steps": t({"fsdp": 0, "pp_dp": 1}),
            "snapshot_copies_at_peak": t(4.0)}


def test_layouts():
    assert pj.layout("llama3-8b", 32) == pj.Layout(32, 8, 1, 4, 1)
    assert pj.layout("llama3-70b", 32) == pj.Layout(32, 8, 4, 1, 1)
    assert pj.layout("llama3-70b", 256) == pj.Layout(256, 8, 4, 8, 1)
    big = pj.layout("llama3-70b", 1024)
    assert big == pj.Layout(1024, 8, 4, 8, 4) and big.replicated and big.groups() == {
        "tp": 8, "pp": 4, "dp_shard": 8, "dp_replicate": 4}
    with pytest.raises(ValueError, match="llama3-70b needs a multiple of 32 GPUs, not 48"):
        pj.layout("llama3-70b", 48)


def test_nccl_init_and_the_power_fit():
    assert pj.nccl_init_s(96_000) == pytest.approx(0.5 + 265.0)
    assert pj.nccl_init_s(1024) == pytest.approx(0.5 + 265.0 * 1024 / 96_000)
    assert pj.fit_power([8, 16, 32], [2 * x ** 1.5 for x in (8, 16, 32)]) == pytest.approx(1.5)
    with pytest.raises(ValueError):
        pj.fit_power([8], [1.0])


def test_the_8b_row_at_32_gpus_by_hand():
    row = pj.project("llama3-8b", 32, synthetic())
    state = 8.03e9 * 12 / 32
    assert row["state_bytes_per_rank"] == round(state)
    p = row["planned_terms"]
    assert p["swap"]["s"] == 0.001 and p["swap"]["kind"] == "measured"
    assert p["switch_barrier"]["s"] == pytest.approx(5 * 5e-6, abs=1e-4)
    assert p["tail"]["s"] == pytest.approx(2 * 3 * (9 * 32 + 3) * 4e-6, abs=1e-4)
    assert p["last_gradients"]["s"] == pytest.approx(8.03e9 * 4 / 32 / 50e9, abs=1e-4)
    assert row["planned_s"] == pytest.approx(sum(t["s"] for t in p.values()), abs=1e-3)
    u = row["unplanned_terms"]
    assert u["nccl_init"]["s"] == pytest.approx(pj.nccl_init_s(8) + pj.nccl_init_s(4), abs=1e-4)
    assert u["state"]["s"] == pytest.approx(state / min(50e9, 63e9 * 0.8), abs=1e-4)  # from the keeper
    assert u["redo"]["s"] == 2.0 and u["replay"]["s"] == 0.0
    assert row["unplanned_s"] == pytest.approx(sum(t["s"] for t in u.values()), abs=1e-3)
    snap = row["buddy_snapshots"]
    assert snap["on"] and snap["host_bytes_per_rank"] == round(4 * state)
    assert snap["stall_s_per_rank"] == pytest.approx(state / (63e9 * 0.8), abs=1e-4)
    assert row["paper"] == {"planned_s": 11.5, "unplanned_s": 19.6, "source": "[TM]"}


def test_a_replicated_layout_recovers_from_a_replica_with_no_snapshot():
    row = pj.project("llama3-70b", 1024, synthetic())
    state = 70.6e9 * 12 / (8 * 4 * 8)
    assert row["unplanned_terms"]["state"]["s"] == pytest.approx(state / 50e9, abs=1e-4)
    assert row["unplanned_terms"]["replay"]["s"] == 8.0  # pipeline: one shadow step of the assumed 8 s
    assert row["buddy_snapshots"]["on"] is False and row["buddy_snapshots"]["host_bytes_per_rank"] == 0


def test_measured_inputs_name_their_files_and_a_missing_one_is_refused(tmp_path):
    m = pj.measured_inputs()
    for term in m.values():
        assert os.path.exists(os.path.join(pj.RESULTS, term["from"].split(":")[0])) or term["from"].startswith("fit")
    for name in ("scale", "tail", "recovery", "hybrid"):
        shutil.copy(os.path.join(pj.RESULTS, f"{name}.json"), tmp_path)
    with pytest.raises(ValueError, match=r"cannot read the measured inputs in .*ettr\.json"):
        pj.measured_inputs(str(tmp_path))


def test_the_output_is_labelled_a_projection(capsys):
    assert pj.main(["--gpus", "32,1024"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kind"].startswith("PROJECTION") and out["gpus"] == [32, 1024]
    assert [(r["model"], r["gpus"]) for r in out["rows"]] == [
        ("llama3-8b", 32), ("llama3-8b", 1024), ("llama3-70b", 32), ("llama3-70b", 1024)]
    assert all(math.isfinite(r["planned_s"]) and "paper" in r for r in out["rows"])
    assert pj.main(["--gpus", "40"]) == 2

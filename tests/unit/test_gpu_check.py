"""The GPU check (benchmarks/gpu_check.py, scripts/gpu-check.sh): its checks' logic on the CPU, its outcomes, and the
script skipping at once on a machine without a GPU."""
from __future__ import annotations

import json
import os
import subprocess
import time

import pytest
import torch

from benchmarks import gpu_check

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CPU = torch.device("cpu")
pytestmark = pytest.mark.timeout(120)


@pytest.mark.skipif(torch.cuda.is_available() or os.path.exists("/dev/nvidia0"), reason="a GPU is present")
def test_the_script_skips_without_a_gpu_in_under_30_s():
    start = time.monotonic()
    r = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu-check.sh")], capture_output=True, text=True,
                       timeout=60)
    elapsed = time.monotonic() - start
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1
    line = json.loads(lines[0])
    assert line["mode"] == "skipped" and line["ok"] is True and line["checks"] == {}
    assert "torch_cuda" in line and line["reason"]
    assert elapsed < 30


def test_every_check_but_the_migration_passes_on_the_cpu():
    only = tuple(c for c in gpu_check.CHECKS if c != "migration")
    out = gpu_check.run_checks(CPU, only)
    assert list(out) == list(only)
    assert {name: o["result"] for name, o in out.items()} == {name: "pass" for name in only}, out
    assert out["nccl_world"]["inner"] == "gloo" and out["mesh_group"]["groups_built"] == 2
    assert out["transfer"]["payload_bytes"] > 0 and out["transfer"]["gb_s"] > 0
    assert out["rng"]["cuda_rng_states"] == 0


def test_a_wrong_outcome_fails_an_exception_errs_and_neither_stops_the_others(monkeypatch):
    def wrong(device):
        gpu_check.expect(False, "draws differ")

    def broken(device):
        raise OSError("no such device")

    monkeypatch.setattr(gpu_check, "check_rng", wrong)
    monkeypatch.setattr(gpu_check, "check_mover_gloo", broken)
    out = gpu_check.run_checks(CPU, ("mover_gloo", "rng", "transfer"))
    assert out["mover_gloo"]["result"] == "error" and out["mover_gloo"]["reason"].startswith("OSError: no such device")
    assert out["rng"] == {"result": "fail", "reason": "draws differ", "s": out["rng"]["s"]}
    assert out["transfer"]["result"] == "pass"
    line = gpu_check.report("ran", "cpu", out, 1.0)
    assert line["ok"] is False and json.loads(json.dumps(line)) == line


def test_the_migration_job_runs_train_gpt_on_the_device_two_nodes_of_one_rank(tmp_path):
    cmd = gpu_check.migration_commands(str(tmp_path), torch.device("cuda", 0), 1)
    assert cmd[cmd.index("--nodes") + 1] == "2" and cmd[cmd.index("--ranks-per-node") + 1] == "1"
    assert cmd[cmd.index("--standbys") + 1] == "1"
    assert cmd[cmd.index("--device") + 1] == "cuda" and "--min-step-time-s" in cmd
    reference = gpu_check.migration_commands(str(tmp_path), CPU, 0)
    assert "--min-step-time-s" not in reference and cmd[cmd.index("examples.train_gpt") + 2] == "24"


def test_an_unknown_check_is_refused_with_one_line(capsys):
    assert gpu_check.main(["--device", "cpu", "--only", "rng,warp"]) == 2
    assert capsys.readouterr().err.strip() == (f"gpu_check: unknown checks ['warp']; known: "
                                               f"{', '.join(gpu_check.CHECKS)}")


def test_a_check_is_not_started_once_the_budget_is_spent(monkeypatch):
    monkeypatch.setitem(gpu_check._deadline, "at", time.monotonic() + 5)  # less than MIN_LEFT_S
    out = gpu_check.run_checks(CPU, ("rng",))
    assert out == {"rng": {"result": "error", "reason": "not started: the time budget was spent", "s": 0.0}}
    assert gpu_check.left_s(120) <= 5

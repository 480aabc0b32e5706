"""tmctl.localjob, the job harness the end-to-end tests, the benchmarks and the demo share: the parts that need no
real job (a stand-in process plays tmd)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tmctl import localjob
from tmd import protocol as p


def test_final_hashes_reads_every_rank_file(tmp_path):
    os.makedirs(tmp_path / "final")
    for rank, sha in ((1, "bb"), (0, "aa")):
        (tmp_path / "final" / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "state_sha256": sha}))
    assert localjob.final_hashes(str(tmp_path)) == {0: "aa", 1: "bb"}
    assert localjob.final_hashes(str(tmp_path / "none")) == {}


def test_wait_for_address_reads_tmd_json_and_notices_an_early_exit(tmp_path):
    writer = subprocess.Popen([sys.executable, "-c", "import json, sys, time; time.sleep(0.3); "
                               "open(sys.argv[1], 'w').write(json.dumps({'address': 'tcp://127.0.0.1:5'})); "
                               "time.sleep(30)", p.layout.RunDir(str(tmp_path)).tmd_json])
    try:
        assert localjob.wait_for_address(str(tmp_path), writer, timeout_s=30) == "tcp://127.0.0.1:5"
    finally:
        writer.kill()
        writer.wait()
    dead = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    dead.wait()
    with pytest.raises(RuntimeError, match="tmd exited with 3 before it was up"):
        localjob.wait_for_address(str(tmp_path / "other"), dead, timeout_s=30)


def test_a_job_whose_tmd_never_comes_up_raises_and_is_ended(tmp_path, monkeypatch):
    """tmd (here a process that sleeps) never writes tmd.json: Job raises TimeoutError and ends it, no orphan."""
    started, real_popen = [], subprocess.Popen

    def popen(cmd, **kwargs):
        started.append(real_popen([sys.executable, "-c", "import time; time.sleep(60)"], **kwargs))
        return started[-1]

    real_wait = localjob.wait_for_address
    monkeypatch.setattr(subprocess, "Popen", popen)
    monkeypatch.setattr(localjob, "wait_for_address", lambda run_dir, proc, timeout_s=60.0: real_wait(
        run_dir, proc, timeout_s=0.5))
    with pytest.raises(TimeoutError):
        localjob.Job(str(tmp_path / "job"), 1, 10)
    assert started and started[0].poll() is not None  # terminated, and waited for

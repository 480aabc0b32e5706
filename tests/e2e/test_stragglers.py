"""Straggler detection in a real job with one slow rank."""
import subprocess

import pytest

from tests.support import events, wait_until
from tests.support.job import tmd_command, wait_for_address, job_client
from tmctl.client import Client
from tmd import protocol as p


@pytest.mark.timeout(180)
def test_a_slow_rank_in_a_real_job_shows_as_straggler(tmp_path):
    run_dir = str(tmp_path)
    proc = subprocess.Popen(tmd_command(run_dir, 0, 100_000, True, True, ("--slow-rank", "3", "--slow-s", "0.05")),
                            stdout=subprocess.DEVNULL)
    try:
        client = job_client(run_dir, proc)
        detected = wait_until(lambda: [e for e in events(run_dir) if e["event"] == p.Event.STRAGGLER_DETECTED], 120,
                              "a straggler_detected event")
        assert [(e["rank"], e["node"]) for e in detected] == [(3, "n2")] and detected[0]["lateness"] > 0.2
        nodes = {n["name"]: n for n in client.request(p.StatusRequest()).nodes}
        assert nodes["n2"]["stragglers"] == [3] and nodes["n1"]["stragglers"] == []
    finally:
        proc.terminate()
        proc.wait(timeout=30)

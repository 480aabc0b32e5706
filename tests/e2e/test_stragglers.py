"""Straggler detection in a real job with one slow rank; then SIGTERM to tmd stops that local job and every
process it started."""
import signal
import subprocess

import psutil
import pytest

from tmctl.localjob import end_job, events, job_client, tmd_command, wait_until
from tmd import protocol as p
from worker.fork_server import SERVER_NAME


@pytest.mark.timeout(180)
def test_a_slow_rank_shows_as_straggler_then_sigterm_stops_the_job(tmp_path):
    run_dir = str(tmp_path)
    proc = subprocess.Popen(tmd_command(run_dir, 1, 100_000, True, True, ("--slow-rank", "3", "--slow-s", "0.05")),
                            stdout=subprocess.DEVNULL)
    try:
        client = job_client(run_dir, proc)
        detected = wait_until(lambda: [e for e in events(run_dir) if e["event"] == p.Event.STRAGGLER_DETECTED], 120,
                              "a straggler_detected event")
        assert [(e["rank"], e["node"]) for e in detected] == [(3, "n2")] and detected[0]["lateness"] > 0.2
        nodes = {n["name"]: n for n in client.request(p.StatusRequest()).nodes}
        assert nodes["n2"]["stragglers"] == [3] and nodes["n1"]["stragglers"] == []

        # SIGTERM to tmd (local mode): exit code 128 + 15, and no process it started is left behind
        children = psutil.Process(proc.pid).children(recursive=True)  # with the fork server, if used
        assert len([c for c in children if c.name() != SERVER_NAME]) == 6  # 2 nodes x 2 ranks + the standby's 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
        gone, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, alive
    finally:
        end_job(proc)
    names = [e["event"] for e in events(run_dir)]
    assert p.Event.TMD_SIGNALLED in names and names[-1] == p.Event.TMD_STOPPED

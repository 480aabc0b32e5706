"""The user's errors, end to end in local mode: a mistake of the training script fails the job at once, loudly,
and spends no standby; misuse is refused. Small scripts (tests/e2e/scripts/user_error.py: a DDP linear model),
2 nodes x 2 ranks; every job here ends within seconds. The job that never manages its model also carries the
straggler detection and the end of a local job by SIGTERM."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tmctl.localjob import events, job_client, run_tmd, start_tmd, tmd_log, wait_until
from tmd import protocol as p
from tmd.protocol.vocab import Event, ExitCode, FailureKind
from worker.fork_server import SERVER_NAME

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "user_error.py")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def tmd_local(run_dir: str, standbys: int, *command: str) -> list[str]:
    return [sys.executable, "-m", "tmd.cli", "local", "--nodes", "2", "--ranks-per-node", "2",
            "--standbys", str(standbys), "--run-dir", run_dir, "--quiet", "--", *command]


def script(*args: str) -> tuple[str, ...]:
    return (sys.executable, SCRIPT, *args)


def run_job(run_dir: str, standbys: int, command: tuple,
            timeout_s: float = 90) -> tuple[subprocess.CompletedProcess, float]:
    """tmd's result (its stdout and stderr as text) and the seconds it ran; tmd forked warm where it can be (the
    e2e conftest, tmctl.warm_start)."""
    t0 = time.monotonic()
    r = run_tmd(tmd_local(run_dir, standbys, *command), run_dir, timeout_s, check=False, capture=True)
    return r, time.monotonic() - t0


def named(run_dir: str, name: str) -> list[dict]:
    return [e for e in events(run_dir) if e["event"] == name]


def tmctl(run_dir: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tmctl.cli", *args, "--run-dir", run_dir], capture_output=True,
                          text=True, timeout=30, cwd=REPO)


@pytest.mark.timeout(60)
def test_every_rank_exiting_before_init_ends_the_job_in_seconds(tmp_path):
    run_dir = str(tmp_path / "job")
    r, took = run_job(run_dir, 0, (sys.executable, "-c", "import sys; print('argparse says no'); sys.exit(2)"))
    assert r.returncode == ExitCode.FAILED, r.stderr
    assert took < 30, took  # tmd's own start (torch for the store) included; today it never ended
    (failed,) = named(run_dir, Event.JOB_FAILED)
    assert "exited with code 2 before worker.init()" in failed["reason"]
    first = named(run_dir, Event.STARTUP_FAILED)[0]
    assert first["log_tail"] == "argparse says no" and first["returncode"] == 2
    assert "argparse says no" in r.stderr  # the log tail is printed, --quiet or not


@pytest.mark.timeout(60)
def test_an_interface_the_nodes_lack_fails_their_ranks_at_start_naming_node_and_interface(tmp_path):
    run_dir = str(tmp_path / "job")
    cmd = [sys.executable, "-m", "tmd.cli", "local", "--nodes", "2", "--ranks-per-node", "1", "--standbys", "0",
           "--run-dir", run_dir, "--quiet", "--iface", "tm-nope0", "--", *script("--steps", "50")]
    t0 = time.monotonic()
    r = run_tmd(cmd, run_dir, 60, check=False, capture=True)
    assert r.returncode == ExitCode.FAILED, r.stderr
    assert time.monotonic() - t0 < 30  # no rendezvous waited for them
    startup = named(run_dir, Event.STARTUP_FAILED)[0]
    assert startup["returncode"] == ExitCode.REFUSED
    line = f"node {startup['node']}: network interface 'tm-nope0' does not exist"
    assert line in startup["log_tail"] and line in r.stderr, r.stderr
    assert not named(run_dir, Event.WORKER_REGISTERED) and not named(run_dir, Event.NODE_FAILED)


@pytest.mark.timeout(90)
def test_one_rank_exiting_before_init_is_named_and_the_rest_terminated(tmp_path):
    run_dir = str(tmp_path / "job")
    r, took = run_job(run_dir, 1, script("--die", "n2/1:3", "--steps", "200"))
    assert r.returncode == ExitCode.FAILED, r.stderr
    assert took < 45, took  # not the store's 120 s wait
    (startup,) = named(run_dir, Event.STARTUP_FAILED)
    assert (startup["node"], startup["local_rank"], startup["rank"], startup["returncode"]) == ("n2", 1, 3, 3)
    assert "a mistake before worker.init(), exiting with code 3" in startup["log_tail"]
    (failed,) = named(run_dir, Event.JOB_FAILED)
    assert failed["reason"].startswith("rank 3 (n2/1) exited with code 3"), failed
    assert not named(run_dir, Event.NODE_FAILED) and not named(run_dir, Event.RECOVERY_STARTED)
    assert not named(run_dir, Event.RANK_DONE)  # the others were terminated, not left to finish
    # After the job: tmctl reads the journal
    st = tmctl(run_dir, "status", "--json")
    assert st.returncode == 0, st.stderr
    state = json.loads(st.stdout)
    assert state["ended"] is True and state["exit_code"] == 1 and state["failure"]["rank"] == 3
    ev = tmctl(run_dir, "events", "--json")
    assert ev.returncode == 0
    assert any(json.loads(line)["event"] == Event.STARTUP_FAILED for line in ev.stdout.splitlines())


@pytest.mark.timeout(90)
def test_a_rank_raising_in_a_step_fails_the_job_with_its_traceback(tmp_path):
    run_dir = str(tmp_path / "job")
    r, took = run_job(run_dir, 1, script("--raise-at", "5", "--raise-rank", "3", "--steps", "400"))
    assert r.returncode == ExitCode.FAILED, r.stderr
    assert took < 60, took  # 400 steps would take 20 s more; today it hung for good
    (rf,) = named(run_dir, Event.RANK_FAILED)
    assert (rf["rank"], rf["node"], rf["step"], rf["kind"]) == (3, "n2", 5, FailureKind.SCRIPT_ERROR)
    assert rf["error"] == "ValueError: a bad batch at step 5" and "Traceback" in rf["traceback"]
    assert "train_step" in rf["traceback"]
    (failed,) = named(run_dir, Event.JOB_FAILED)
    assert "rank 3 on n2 raised at step 5: ValueError: a bad batch at step 5" in failed["reason"]
    assert "ValueError: a bad batch at step 5" in r.stderr and "Traceback" in r.stderr  # printed by tmd
    # no standby spent: nothing promoted, no node failed
    assert not named(run_dir, Event.STANDBY_PROMOTED) and not named(run_dir, Event.RECOVERY_STARTED)
    assert not named(run_dir, Event.NODE_FAILED)
    st = tmctl(run_dir, "status")
    assert st.returncode == 0 and "has ended" in st.stdout and "ValueError: a bad batch at step 5" in st.stdout, st


@pytest.mark.timeout(90)
def test_a_steps_loop_that_does_not_catch_step_aborted_is_named_not_taken_for_lost_ranks(tmp_path):
    run_dir = str(tmp_path / "job")
    r, took = run_job(run_dir, 0, script("--uncaught-at", "5", "--kill-rank", "3", "--steps", "400"))
    assert r.returncode == ExitCode.FAILED, r.stderr
    assert took < 60, took
    reports = named(run_dir, Event.RANK_FAILED)  # a survivor's (n1's, or n2/1 if it got there before its fencing)
    uncaught = [e for e in reports if e["kind"] == FailureKind.STEP_ABORTED_UNCAUGHT]
    assert uncaught and uncaught[0]["step"] == 5 and "StepAborted" in uncaught[0]["traceback"], reports
    (failed,) = named(run_dir, Event.JOB_FAILED)
    assert f"rank {uncaught[0]['rank']} on {uncaught[0]['node']} raised StepAborted and did not catch it at step 5" \
        in failed["reason"] and "catch worker.StepAborted and continue" in failed["reason"], failed
    assert "every rank is lost" not in failed["reason"] and "did not catch it" in r.stderr


@pytest.mark.timeout(120)
def test_a_job_that_never_manages_its_model_is_warned_and_not_migrated_and_sigterm_stops_it(tmp_path):
    """Also, on the same job (one start-up): straggler detection (rank 3 sleeps 50 ms more than its peers in every
    step), then SIGTERM to tmd stops the local job and every process it started."""
    run_dir = str(tmp_path / "job")
    proc = start_tmd(tmd_local(run_dir, 1, *script("--unmanaged", "--steps", "2000", "--slow-rank", "3")),
                     tmd_log(run_dir))
    try:
        client = job_client(run_dir, proc)
        st = wait_until(lambda: (lambda s: s if s.warnings and s.step > 5 and
                                 any(n["name"] == "s1" and n["warm"] for n in s.nodes) else None)(
            client.request(p.StatusRequest())), 60, "a misuse warning, step 5 and a warm standby")
        assert {w["node"] for w in st.warnings} <= {"n1", "n2"} and st.warnings[0]["message"]
        assert all(set(n["pids"]) == {"0", "1"} for n in st.nodes)  # --json carries each local rank's pid
        assert named(run_dir, Event.JOB_WARNING)
        shown = tmctl(run_dir, "status")
        assert "warning" in shown.stdout and st.warnings[0]["code"] in shown.stdout, shown
        r = tmctl(run_dir, "migrate", "--from", "n2", "--to", "s1")
        assert r.returncode == 2 and "refused" in r.stderr and st.warnings[0]["code"] in r.stderr, r
        assert not named(run_dir, Event.MIGRATION_REQUESTED)

        detected = wait_until(lambda: named(run_dir, Event.STRAGGLER_DETECTED), 60, "a straggler_detected event")
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
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
    names = [e["event"] for e in events(run_dir)]
    assert Event.TMD_SIGNALLED in names and names[-1] == Event.TMD_STOPPED

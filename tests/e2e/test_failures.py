"""Unexpected failures, end to end in local mode: real processes, tmd, 2 nodes x 2 ranks, a tiny GPT.

Every test ends with training complete and each rank's final parameters and optimizer state bit-identical to an
uninterrupted run of the same seed (sha256 per rank). Faults at an exact point of a step are injected by the
training script itself (``--fault NODE:STEP:PHASE`` kills every process of NODE with SIGKILL); the others are
signals sent from here once tmd's journal shows the moment has come.
"""
from __future__ import annotations

import json
import os
import signal

import psutil
import pytest

from tmctl.localjob import Job, events, final_hashes, wait_until
from tmd import netns
from tmd import protocol as p


STEPS = 60
BASE = ("--min-step-time-s", "0.03")  # padding only: the numerics are those of the reference


@pytest.fixture(scope="module")
def reference(gpt_reference) -> dict[int, str]:
    return gpt_reference(STEPS)


def assert_recovered(job: Job, reference: dict[int, str], rc: int, incidents: int = 1) -> list[dict]:
    assert rc == 0, [e for e in events(job.run_dir) if e["event"] in ("job_failed", "node_failed")]
    done = job.events("recovery_done")
    assert len(done) == incidents, done
    assert final_hashes(job.run_dir) == reference
    assert not job.events("job_failed")
    return done


@pytest.mark.timeout(300)
def test_kill_node_during_a_step_then_with_no_standby_left_the_job_waits_then_resumes(start_job, reference):
    """Two incidents, one job (one start-up). n1 is killed in step 12's optimizer step and recovered onto the
    standby s1; then n2 dies half-way through step 30's backward pass, no standby is left, the job waits until
    ``tmctl standby add s9`` gives it one, and resumes.

    Also: long and slow steps are not failures. Rank 3 sleeps 2.5 s in its first step and in step 6 (its peers
    wait at the collective, its heartbeats go on): the only node failures are the kills. n1 holds rank 0, the root
    of DDP's bucket regrouping, which its replacement replays before its first step. (Kills in the forward pass
    and between steps: test_two_failures_in_a_row_*.)"""
    job = start_job(1, STEPS, *BASE, "--fault", "n1:12:optimizer", "--fault", "n2:30:backward", "--slow-rank", "3",
                    "--slow-steps", "0,6", "--slow-s", "2.5")
    job.wait_event("recovery_waiting")
    status = json.loads(job.tmctl("status", "--json").stdout)
    assert status["recovery"]["waiting_standby"] is True and status["recovery"]["lost_ranks"] == [2, 3]
    assert "waiting for a standby" in job.tmctl("status").stdout
    step = status["step"]
    r = job.tmctl("standby", "add", "s9")
    assert r.returncode == 0, r.stderr
    assert job.tmctl("standby", "add", "s9").returncode == 2  # a name in use: refused, nothing changes
    done = assert_recovered(job, reference, job.finish(), incidents=2)
    failed = job.events("node_failed")
    assert [(e["node"], e["signal"]) for e in failed] == [("n1", "process_exit"), ("n2", "process_exit")]
    started = job.events("recovery_started")
    assert len(started) == 2
    assert started[0]["lost_ranks"] == [0, 1] and started[0]["survivors"] == [2, 3]
    # Killed as it updates (its all-reduce finished on the survivors), step 12 is redone or committed: the job
    # resumes at 12 or after it.
    assert done[0]["resume_step"] in (12, 13)
    assert done[0]["standbys"] == {"n1": "s1"}
    # the replacements get state from replicas; so does a survivor halted before it committed the step another
    # survivor committed (rank 3 halted in step 12 while rank 2 finished it: the job resumes at 13, rank 3 rolls
    # forward)
    plan = job.events("recovery_plan")[0]
    committed = job.events("recovery_halted")[0]["committed"]
    behind = [int(r) for r, s in committed.items() if s + 1 < plan["resume_step"]]
    assert sorted(dst for _, dst in plan["sends"]) == sorted([0, 1, *behind]), (plan, committed)
    # no shadow iteration: the job's recorded steps 0, 1 and 2 were alike (DDP's layout and regrouping aside), so
    # the replacements regrouped their DDP buckets from the recording and ran the redone step as their first
    # (Session._no_shadow_iteration_needed): one step less on the failure's critical path
    assert done[0]["shadow_steps"] == {"0": 0, "1": 0}, done[0]
    # the second incident waited for the standby added by request, and resumed where it stopped
    assert done[1]["standbys"] == {"n2": "s9"}
    assert done[1]["resume_step"] <= step + 1


# A SIGSTOP hang, then SIGCONT: test_fidelity.test_sigstop_hang_then_sigcont_is_fenced_and_bit_identical


@pytest.mark.timeout(300)
def test_two_failures_in_a_row_with_guards_adopted_then_released(start_job, reference):
    # --guards 2: s1 warms as n1's ranks, s2 as n2's, before any failure (rank 0 pauses 3 s at step 6: they are
    # warm by then). n2 dies in the forward pass of step 10 (redone): its guard s2 is adopted, with no warm-up
    # left. s2 (now holding ranks 2-3, unguarded) dies between steps 30 and 31 (step 30 stands): no general
    # standby is left, so the guard s1 is released, comes back fresh and takes ranks 2-3 as a general standby.
    job = start_job(2, STEPS, *BASE, "--fault", "n2:10:forward", "--fault", "s2:30:between", "--slow-rank", "0",
              "--slow-steps", "6", "--slow-s", "3", tmd_args=("--guards", "2"))
    done = assert_recovered(job, reference, job.finish(), incidents=2)
    assert sorted((e["standby"], e["node"], tuple(e["ranks"])) for e in job.events("guard_assigned")) == \
        [("s1", "n1", (0, 1)), ("s2", "n2", (2, 3))]
    first_failure = job.events("node_failed")[0]["seq"]
    assert sorted(e["standby"] for e in job.events("guard_warmed") if e["seq"] < first_failure) == ["s1", "s2"]
    # each guard ran one shadow iteration: DDP's regrouping replayed right after it (worker.ddp_regroup)
    assert [e["shadow_steps"] for e in job.events("guard_warmed") if e["seq"] < first_failure] == [1, 1]
    started = job.events("recovery_started")
    assert [e["adopted"] for e in started] == [{"n2": "s2"}, {}]
    assert [d["standbys"] for d in done] == [{"n2": "s2"}, {"s2": "s1"}]
    assert [d["resume_step"] for d in done] == [10, 31]
    assert done[0]["shadow_steps"] == {} and done[0]["phases_s"]["warm_up"] < 0.05, done[0]  # warm already
    assert done[1]["shadow_steps"] == {"2": 0, "3": 0}, done[1]  # s1, fresh: none needed (the test above)
    released = job.events("guard_released")
    assert [(e["standby"], e["ranks"]) for e in released] == [("s1", [0, 1])], released
    assert "no general standby" in released[0]["reason"]
    assert job.events("standby_restarted")[0]["node"] == "s1"  # its fresh processes came up as a standby
    assert job.events("recovery_waiting")  # the second incident waited for them


@pytest.mark.timeout(300)
def test_a_migration_to_the_guard_of_its_node_skips_the_warm_up(start_job, reference):
    # --guards 1: s1 warms as n1's ranks (rank 0 pauses 2 s at step 6 meanwhile); steps padded to 0.1 s so the
    # migration has room to commit
    job = start_job(1, STEPS, *BASE, "--min-step-time-s", "0.1", "--slow-rank", "0", "--slow-steps", "6",
                    "--slow-s", "2", tmd_args=("--guards", "1"))
    job.wait_event("guard_warmed", standby="s1")
    s1 = next(n for n in job.status().nodes if n["name"] == "s1")
    assert (s1["role"], s1["warm"], s1["guards"]) == ("guarding", True, [0, 1])
    assert "guarding 0-1 (warm)" in job.tmctl("status").stdout
    refused = job.tmctl("migrate", "--from", "n2", "--to", "s1")  # another node's guard: busy, nothing changes
    assert refused.returncode == 2 and "guarding ranks [0, 1]" in refused.stderr, refused.stderr
    moved = job.tmctl("migrate", "--from", "n1", "--to", "s1")
    assert moved.returncode == 0, moved.stdout + moved.stderr
    assert job.finish() == 0
    assert final_hashes(job.run_dir) == reference
    assert job.events("migration_requested")[0]["guards"] == ["s1"]
    assert [e["migration_id"] for e in job.events("migration_committed")] == [1]
    assert not job.events("migration_aborted") and not job.events("guard_released")
    # no warm-up: phase 1 started right after the request, and the joiners' only shadow iterations were the guard's
    requested, prepare = job.events("migration_requested")[0], job.events("migration_phase")[0]
    assert prepare["phase"] == "prepare_started" and prepare["seq"] - requested["seq"] <= 2, (requested, prepare)


@pytest.mark.timeout(300)
def test_leaver_killed_during_a_migration_falls_back_to_a_replica(start_job, reference):
    job = start_job(1, STEPS, *BASE)
    job.wait_training()
    assert job.tmctl("migrate", "--from", "n2", "--to", "s1", "--no-wait").returncode == 0
    job.wait_event("migration_switching")
    for pid in job.pids("n2"):
        os.kill(pid, signal.SIGKILL)
    rc = job.finish()
    if job.events("migration_aborted"):  # usual: the leaver died before its state was out
        assert "leaver n2 lost" in job.events("migration_aborted")[0]["reason"]
        assert job.events("recovery_started")[0]["adopted"] == {"n2": "s1"}  # the warm joiners carry on
        assert_recovered(job, reference, rc)
    else:  # the state was already transferred: the leaver's exit was the plan
        assert job.events("migration_committed") and rc == 0 and final_hashes(job.run_dir) == reference


@pytest.mark.timeout(300)
def test_joiner_killed_during_the_switch(start_job, reference):
    job = start_job(2, STEPS, *BASE)
    job.wait_training()
    wait_until(lambda: all(n["warm"] for n in job.status().nodes if n["role"] == "standby"), 120, "two warm standbys")
    assert job.tmctl("migrate", "--from", "n2", "--to", "s1", "--no-wait").returncode == 0
    job.wait_event("migration_switching")
    for pid in job.pids("s1"):
        psutil.Process(pid).kill()
    rc = job.finish()
    assert rc == 0
    assert final_hashes(job.run_dir) == reference
    if job.events("migration_aborted"):  # training went on with the old groups
        assert not job.events("recovery_done")
    else:  # the commit was decided first: s1's loss is a failure, s2 takes over
        assert job.events("recovery_done")[0]["standbys"] == {"s1": "s2"}


@pytest.mark.timeout(300)
@pytest.mark.skipif(not netns.available(), reason="needs root, ip and tc for network namespaces")
def test_network_partition_of_a_node(start_job, reference):
    job = start_job(1, STEPS, *BASE, tmd_args=("--netns-node", "n2"))
    job.wait_training()
    with open(os.path.join(job.run_dir, "tmd.json")) as f:
        spec = json.load(f)["netns"]["n2"]
    ns = netns.NodeNamespace.existing("n2", spec["name"], spec["index"])
    ns.cut()  # n2's processes live on, but no packet gets in or out
    job.wait_event("recovery_done")
    assert [e["signal"] for e in job.events("node_failed")] == ["silent"]
    assert job.events("node_fenced")  # on this host tmd can make sure they never come back
    ns.heal()
    assert_recovered(job, reference, job.finish())


@pytest.mark.timeout(300)
def test_leaver_killed_after_the_commit_decision_is_a_failure_of_the_joiners_node(start_job, reference):
    """The commit is decided once the joiners loaded their pre-copy, during the step before the switch step S
    (steps padded to 0.4 s here, so the leaver's tail at S is hundreds of ms away). Killing the leaver then leaves
    the joiners without their tail: they exit, tmd never aborts a decided migration (some stayers may already
    train in the new groups), and the loss of s1, which now holds the ranks, is repaired from a replica by s2."""
    job = start_job(2, STEPS, *BASE, "--min-step-time-s", "0.4")
    job.wait_training(5)
    wait_until(lambda: all(n["warm"] for n in job.status().nodes if n["role"] == "standby"), 120, "two warm standbys")
    assert job.tmctl("migrate", "--from", "n2", "--to", "s1", "--no-wait").returncode == 0
    job.wait_event("migration_transferred")
    for pid in job.pids("n2"):
        os.kill(pid, signal.SIGKILL)
    job.wait_event("recovery_done")
    job.end_padding()  # the faults are over: the remaining steps at their own speed
    rc = job.finish()
    assert not job.events("migration_aborted")
    committed = job.events("migration_committed")
    assert committed and "lost" in committed[0], committed
    assert not job.events("migration_sent")  # the tail never left: the kill landed inside the window
    done = assert_recovered(job, reference, rc)
    assert done[0]["standbys"] == {"s1": "s2"}

"""Fidelity after failures when randomness is per rank: real jobs (tmd local, 2 nodes x 2 ranks, tiny GPT with
dropout), each compared bit for bit (every rank's final parameter and optimizer sha256) with an uninterrupted run
of the same script and seed mode. One reference run per seed mode, shared by the module's tests.

Per-rank seeding (``torch.manual_seed(seed + rank)``) makes every rank's dropout masks its own: a replacement must
continue with the lost rank's RNG stream (kept by every rank at each step, worker.rank_state), not its sender's.
"""
from __future__ import annotations

import os
import signal

import pytest

from tmctl.localjob import Job, events, final_hashes
from tmd import protocol as p

STEPS = 24
BASE = ("--min-step-time-s", "0.03")  # padding only: the numerics are those of the reference
DROPOUT = ("--dropout", "0.2")


def seed_args(mode: str) -> tuple:
    return DROPOUT + ("--seed-mode", mode)


@pytest.fixture(scope="module")
def reference(gpt_reference):
    """{rank: sha256} of the uninterrupted run in seed mode ``mode`` (tests/e2e/conftest.py; BASE only pads)."""
    return lambda mode: gpt_reference(STEPS, *seed_args(mode))


def assert_identical(job: Job, reference: dict[int, str], rc: int, incidents: int = 1) -> None:
    assert rc == 0, [e for e in events(job.run_dir) if e["event"] in ("job_failed", "node_failed", "rank_failed")]
    assert len(job.events(p.Event.RECOVERY_DONE)) == incidents
    assert final_hashes(job.run_dir) == reference


@pytest.mark.timeout(300)
def test_sigstop_hang_then_sigcont_is_fenced_and_bit_identical(start_job, reference):
    """n2's ranks hang (SIGSTOP): tmd fails the node as stopped, fences it (kills exactly its processes) and
    recovers onto s1, reseeding per step from the lost ranks' own (rank, step); the SIGCONT comes too late, and n2
    never finishes as a rank.

    Also the per-step seed mode's recovery (the only one: shared seeding is every other e2e job's, per-rank RNG
    streams are the two-failures test's, with a kill in the forward pass and one in the optimizer step)."""
    expected = reference("per-step")  # before the job: never alongside it
    job = start_job(1, STEPS, *BASE, *seed_args("per-step"))
    job.wait_training(min_step=6)
    stopped = job.pids("n2")
    for pid in stopped:
        os.kill(pid, signal.SIGSTOP)
    job.wait_event(p.Event.RECOVERY_DONE)
    assert [e["signal"] for e in job.events(p.Event.NODE_FAILED)] == [p.FailureSignal.STOPPED]
    assert sorted(job.events(p.Event.NODE_FENCED)[0]["killed_pids"]) == sorted(stopped)
    for pid in stopped:
        try:
            os.kill(pid, signal.SIGCONT)  # too late: fenced (killed, or told to exit when it calls in)
        except ProcessLookupError:
            pass
    assert_identical(job, expected, job.finish())
    assert not job.events(p.Event.JOB_FAILED)
    exits = {e["local_rank"]: e["returncode"] for e in job.events(p.Event.PROCESS_EXIT) if e["node"] == "n2"}
    assert set(exits.values()) <= {-9, 3}, exits  # never 0: it did not finish the job as a rank


@pytest.mark.timeout(300)
def test_two_failures_in_a_row_per_rank_is_bit_identical(start_job, reference):
    # --guards 1: s1 is placed as n1's guard once the ranks are recorded (rank 0 pauses 1.5 s in step 4 for it);
    # n2 (unguarded) fails first and the general standby s2 replaces it; then n1 fails and its guard s1 is adopted.
    # The job clears its gradients after the optimizer step (the reference before the backward: the same numerics
    # uninterrupted): after the first kill, in the forward pass, the survivors' backward has put their own
    # gradients in .grad, which the redone step must not add to its own (worker.recovery: Gradients).
    expected = reference("per-rank")  # before the job: never alongside it
    job = start_job(2, STEPS, *BASE, *seed_args("per-rank"), "--fault", "n2:6:forward", "--fault", "n1:16:optimizer",
                      "--slow-rank", "0", "--slow-steps", "4", "--slow-s", "1.5", "--zero-grad", "after-step",
                      tmd_args=("--guards", "1"))
    assert_identical(job, expected, job.finish(), incidents=2)
    assert [e["adopted"] for e in job.events(p.Event.RECOVERY_STARTED)] == [{}, {"n1": "s1"}]
    assert [d["standbys"] for d in job.events(p.Event.RECOVERY_DONE)] == [{"n2": "s2"}, {"n1": "s1"}]


@pytest.mark.timeout(300)
def test_joiner_with_a_fresh_model_fails_the_job_on_the_replica_check(start_job):
    # The model is neither managed nor wrapped in DDP (no misuse warning can see it): the migration moves only the
    # optimizer, the joiners keep a freshly initialised model, and the first step after the switch must fail the
    # job instead of training on diverged.
    job = start_job(1, STEPS, *BASE, *seed_args("shared"), "--unmanaged-model")
    job.wait_training(min_step=4)
    reply = job.client.request(p.MigrateRequest(sources=["n2"], targets=["s1"]))
    assert not isinstance(reply, p.ErrorReply), reply
    rc = job.finish()
    assert rc != 0
    failed = job.events(p.Event.RANK_FAILED)
    assert failed and {e["kind"] for e in failed} == {p.FailureKind.STATE_MISMATCH}, failed
    assert "differ" in failed[0]["error"]

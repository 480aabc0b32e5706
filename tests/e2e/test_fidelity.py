"""Fidelity after failures when randomness is per rank: real jobs (tmd local, 2 nodes x 2 ranks, tiny GPT with
dropout), each compared bit for bit (every rank's final parameter and optimizer sha256) with an uninterrupted run
of the same script and seed mode. One reference run per seed mode, shared by the module's tests.

Per-rank seeding (``torch.manual_seed(seed + rank)``) makes every rank's dropout masks its own: a replacement must
continue with the lost rank's RNG stream (kept by every rank at each step, worker.rank_state), not its sender's.
"""
from __future__ import annotations

import os
import signal
import subprocess

import pytest

from tests.e2e.test_failures import BASE, Job
from tests.support.job import final_hashes, tmd_command, wait_for_address, job_client
from tmctl.client import Client
from tests.support import events
from tmd import protocol as p

STEPS = 24
DROPOUT = ("--dropout", "0.2")


def seed_args(mode: str) -> tuple:
    return DROPOUT + ("--seed-mode", mode)


class FidelityJob(Job):
    """test_failures' Job, of STEPS steps with dropout and seed mode ``mode``."""

    def __init__(self, tmp_path, standbys: int, mode: str, *script_args: str) -> None:  # noqa: super() not called
        self.run_dir = str(tmp_path / "job")
        cmd = tmd_command(self.run_dir, standbys, STEPS, True, True, BASE + seed_args(mode) + script_args)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
        self.client = job_client(self.run_dir, self.proc)


_references: dict[str, dict[int, str]] = {}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    def get(mode: str) -> dict[int, str]:
        if mode not in _references:
            run_dir = str(tmp_path_factory.mktemp(f"reference-{mode}"))
            subprocess.run(tmd_command(run_dir, 0, STEPS, True, True, BASE + seed_args(mode)),
                           check=True, timeout=300, stdout=subprocess.DEVNULL)
            hashes = final_hashes(run_dir)
            assert len(hashes) == 4 and len(set(hashes.values())) == 1
            _references[mode] = hashes
        return _references[mode]
    return get


def assert_identical(job: Job, reference: dict[int, str], rc: int, incidents: int = 1) -> None:
    assert rc == 0, [e for e in events(job.run_dir) if e["event"] in ("job_failed", "node_failed", "rank_failed")]
    assert len(job.events(p.Event.RECOVERY_DONE)) == incidents
    assert final_hashes(job.run_dir) == reference


@pytest.mark.timeout(300)
# (shared seeding is the demo's own: every other e2e job kills nodes with it; the forward phase with per-rank
# seeds is the two-failures test's first fault)
@pytest.mark.parametrize("mode,phase", [("per-rank", "optimizer"), ("per-step", "forward")])
def test_kill_node_is_bit_identical(tmp_path, reference, mode, phase):
    job = FidelityJob(tmp_path, 1, mode, "--fault", f"n2:8:{phase}")
    assert_identical(job, reference(mode), job.finish())


@pytest.mark.timeout(300)
def test_sigstop_per_rank_is_bit_identical(tmp_path, reference):
    job = FidelityJob(tmp_path, 1, "per-rank")
    job.wait_training(min_step=6)
    for pid in job.pids("n2"):
        os.kill(pid, signal.SIGSTOP)
    job.wait_event(p.Event.RECOVERY_DONE)
    for pid in job.pids("n2"):
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    assert_identical(job, reference("per-rank"), job.finish())


@pytest.mark.timeout(300)
def test_two_failures_in_a_row_per_rank_is_bit_identical(tmp_path, reference):
    job = FidelityJob(tmp_path, 2, "per-rank", "--fault", "n2:6:forward", "--fault", "n1:16:optimizer")
    assert_identical(job, reference("per-rank"), job.finish(), incidents=2)


@pytest.mark.timeout(300)
def test_joiner_with_a_fresh_model_fails_the_job_on_the_replica_check(tmp_path):
    # The model is neither managed nor wrapped in DDP (no misuse warning can see it): the migration moves only the
    # optimizer, the joiners keep a freshly initialised model, and the first step after the switch must fail the
    # job instead of training on diverged.
    job = FidelityJob(tmp_path, 1, "shared", "--unmanaged-model")
    job.wait_training(min_step=4)
    reply = job.client.request(p.MigrateRequest(sources=["n2"], targets=["s1"]))
    assert not isinstance(reply, p.ErrorReply), reply
    rc = job.finish()
    assert rc != 0
    failed = job.events(p.Event.RANK_FAILED)
    assert failed and {e["kind"] for e in failed} == {p.FailureKind.STATE_MISMATCH}, failed
    assert "differ" in failed[0]["error"]

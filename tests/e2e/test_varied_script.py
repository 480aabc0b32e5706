"""End to end, a script that is not one of the examples (tests/e2e/scripts/varied.py): an MLP with dropout,
LayerNorm and buffers that forward passes change identically on every rank (a forward counter, every pass, and a
running average of the batch mean over all ranks, as SyncBatchNorm's statistics, from step KILL_AT on: the killed
step is the first to change it), DDP, per-rank seeds, two optimizers (SGD
with momentum and a managed OneCycle schedule for the body, AdamW for the output layer), two micro-batches per step
(the first under ``no_sync()``), autocast and a GradScaler, gradient clipping, the plain ``for step in
session.steps(n)`` loop catching ``StepAborted``, and ``zero_grad()`` after ``optimizer.step()``; a MultiStepLR
(its state holds a ``collections.Counter``), a rank-local list that grows every step and a replicated count of
samples changed before the update (each broke a migration or a kill before 2026-11-29: an outside tester's scripts).
In every job the GradScaler skips the update of the steps OVERFLOW_AT (non-finite gradients): the last recorded step
(a migration's joiner replays its exchange at the step's end in its sandbox) and the step before each kill, so the
redone step's receivers get their own RNG and loader from a step without an update (before 2026-11-29 they got
their sender's RNG and no loader state: the final states differed).

One job (2 nodes x 2 ranks, 2 standbys): ``n2 -> s1`` is migrated at step 4 or later, then n1's processes kill
themselves in step KILL_AT's forward pass, after its buffers changed and before the backward; n1 is recovered on s2
from its replicas on s1, the node that just joined. Every rank's final parameters, buffers and optimizer state
(learning rate included) are bit-identical to an uninterrupted run: a redone step counts its batch once.

A second job adds a collective each process makes once, in its own second iteration: the joiners must run it in
their sandbox (more than one shadow iteration), and the migration commits without a hang, bit-identical. A third
makes it in each process's first iteration and kills a node: its replacements run one shadow iteration, not none.
The three compare with one uninterrupted run: the calibration's all-reduce does not change the numerics (its value
is not used), nor does the padding of steps (``--step-time-s``).
"""
from __future__ import annotations

import os
import sys

import pytest

from tmctl.localjob import (end_job, events, final_hashes, job_client, migrate_when_ready, run_tmd, start_tmd,
                            tmd_log)
from tmd import protocol as p

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "varied.py")
STEPS = 40
KILL_AT = 30  # after the switch step (about step 10-20 here: the joiner's warm-up runs while training goes on)
EARLY_KILL_AT = 12  # the third job's kill of n2
OVERFLOW_AT = (2, EARLY_KILL_AT - 1, KILL_AT - 1)  # steps whose updates the GradScaler skips (see above)


def command(run_dir: str, standbys: int, *script_args: str) -> list[str]:
    return [sys.executable, "-m", "tmd.cli", "local", "--nodes", "2", "--ranks-per-node", "2", "--standbys",
            str(standbys), "--run-dir", run_dir, "--quiet", "--", sys.executable, SCRIPT, "--steps", str(STEPS),
            "--stats-from", str(KILL_AT), "--overflow-at", ",".join(map(str, OVERFLOW_AT)), *script_args]


def migrate_n2_and_finish(run_dir: str, standbys: int, *script_args: str) -> list[dict]:
    """Run the job (steps padded to 0.15 s), migrate n2 -> s1 once it is at step 4 and s1 is warm, and return the
    journal once the job ended with exit code 0."""
    proc = start_tmd(command(run_dir, standbys, "--step-time-s", "0.15", *script_args), tmd_log(run_dir))
    try:
        migration = migrate_when_ready(job_client(run_dir, proc), proc, 4, "n2", "s1")
        assert migration["state"] == p.MigrationState.COMMITTED, migration
        assert proc.wait(timeout=240) == 0
    finally:
        end_job(proc)
    return events(run_dir)


@pytest.fixture(scope="module")
def expected(tmp_path_factory) -> dict[int, str]:
    """{rank: final state sha256} of the uninterrupted run of STEPS steps, shared by the module's tests."""
    run_dir = str(tmp_path_factory.mktemp("reference"))
    run_tmd(command(run_dir, 0), run_dir, timeout_s=120)
    hashes = final_hashes(run_dir)
    assert len(hashes) == 4 and len(set(hashes.values())) == 1, hashes  # replicas: one state
    return hashes


@pytest.mark.timeout(300)
def test_a_migration_then_a_kill_mid_step_are_bit_identical(tmp_path, expected):

    run_dir = str(tmp_path / "job")
    journal = migrate_n2_and_finish(run_dir, 2, "--fault", f"n1:{KILL_AT}")

    def of(kind: p.Event) -> list[dict]:
        return [e for e in journal if e["event"] == kind]

    committed, = of(p.Event.MIGRATION_COMMITTED)
    assert committed["switch_step"] < KILL_AT, "the kill came before the switch: raise KILL_AT"
    plan, = of(p.Event.RECOVERY_PLAN)
    assert plan["rollback_step"] == -1 and plan["resume_step"] == KILL_AT, plan  # from replicas, KILL_AT redone
    assert sorted(plan["sends"]) == [[2, 0], [3, 1]], plan  # from s1's ranks, the joiners
    done, = of(p.Event.RECOVERY_DONE)
    assert done["standbys"] == {"n1": "s2"}, done
    # no shadow iteration: the recorded steps 0, 1 and 2 issued the same collectives (DDP's bucket layout and
    # regrouping aside; the statistic's all-reduce and DDP's buffer broadcast in every forward pass)
    assert done["shadow_steps"] == {"0": 0, "1": 0}, done
    assert final_hashes(run_dir) == expected


@pytest.mark.timeout(300)
def test_a_collective_of_a_process_s_second_iteration_keeps_the_joiner_in_its_sandbox(tmp_path, expected):
    """``--calibrate-once``: every process all-reduces once in its own second iteration. The job's recorded step 1
    then issues a collective its step 2 does not, so each joiner runs all 3 shadow iterations
    (worker.sandbox.unsteady_after_first) instead of stopping after one because DDP's regrouping could be replayed:
    had it stopped, its first live step would make that all-reduce where the stayers make none, and the job would
    hang until gloo's timeout, then recover."""
    run_dir = str(tmp_path / "job")
    journal = migrate_n2_and_finish(run_dir, 1, "--calibrate-once")
    committed, = [e for e in journal if e["event"] == p.Event.MIGRATION_COMMITTED]
    assert committed["shadow_steps"] == {"2": 3, "3": 3}, committed
    assert not [e for e in journal if e["event"] == p.Event.RECOVERY_STARTED]
    assert final_hashes(run_dir) == expected


@pytest.mark.timeout(300)
def test_a_collective_of_a_process_s_first_iteration_gives_a_replacement_a_shadow_iteration(tmp_path, expected):
    """``--calibrate-first``: every process all-reduces once in its own first iteration, then n2 is killed. The
    job's recorded step 0 issues a collective its step 2 does not, so the replacements (a general standby) replay
    it in one shadow iteration (worker.sandbox.unsteady_from_start) instead of running none: had they run none,
    their redone step would make that all-reduce live where the survivors make none, and the job would hang until
    gloo's timeout."""
    run_dir = str(tmp_path / "job")
    proc = start_tmd(command(run_dir, 1, "--calibrate-first", "--fault", f"n2:{EARLY_KILL_AT}",
                             "--step-time-s", "0.15"), tmd_log(run_dir))
    try:
        assert proc.wait(timeout=240) == 0
    finally:
        end_job(proc)
    journal = events(run_dir)
    done, = [e for e in journal if e["event"] == p.Event.RECOVERY_DONE]
    assert done["standbys"] == {"n2": "s1"} and done["shadow_steps"] == {"2": 1, "3": 1}, done
    assert done["phases_s"]["total"] < 30, done  # no gloo timeout on the way
    assert final_hashes(run_dir) == expected


PLAIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "plain_loop.py")


def plain_command(run_dir: str, standbys: int, *script_args: str) -> list[str]:
    return [sys.executable, "-m", "tmd.cli", "local", "--nodes", "2", "--ranks-per-node", "2", "--standbys",
            str(standbys), "--run-dir", run_dir, "--quiet", "--", sys.executable, PLAIN, "--steps", "20", *script_args]


@pytest.mark.timeout(300)
def test_a_kill_in_the_plain_loop_with_a_static_graph_and_an_object_all_gather_recovers_once(tmp_path):
    """tests/e2e/scripts/plain_loop.py: DDP(static_graph=True) regroups its buckets in a process's third iteration,
    with two broadcasts the job's recorded steps 0 and 1 lack. n2 kills itself in step 12: its replacements run
    3 shadow iterations (worker.sandbox.new_ops_at), not 2, whose limit made them issue those broadcasts live in
    the redone step where the survivors issue none (a hang until gloo's 120 s timeout, then a second incident).
    The survivors were waiting in ``dist.all_gather_object``: it raises StepAborted, which the plain loop
    catches (worker.object_collectives), where it unpickled a latched collective's empty buffer (EOFError: every
    survivor died, and the job failed)."""
    reference = str(tmp_path / "reference")
    run_tmd(plain_command(reference, 0, "--gather-objects"), reference, timeout_s=120)
    run_dir = str(tmp_path / "job")
    run_tmd(plain_command(run_dir, 1, "--gather-objects", "--fault", "n2:12", "--step-time-s", "0.1"), run_dir,
            timeout_s=240)
    journal = events(run_dir)
    done, = [e for e in journal if e["event"] == p.Event.RECOVERY_DONE]
    assert done["standbys"] == {"n2": "s1"} and done["shadow_steps"] == {"2": 3, "3": 3}, done
    assert done["phases_s"]["total"] < 30, done  # no gloo timeout on the way
    assert len([e for e in journal if e["event"] == p.Event.RECOVERY_STARTED]) == 1  # no second incident
    hashes = final_hashes(run_dir)
    assert len(hashes) == 4 and hashes == final_hashes(reference), hashes

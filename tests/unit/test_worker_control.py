"""The worker's inbox/state object (worker.control.Control) on its own: no processes, no torch, no sockets."""
import threading
import time

import pytest

from tmd import protocol as p
from worker.control import Attempt, Control, Stage

pytestmark = pytest.mark.timeout(10)


def assign(role=p.WorkerRole.ACTIVE, rank=2, migration_id=0, incident_id=0):
    return p.Assign(role=role, rank=rank, world_size=4, store_host="h", store_port=1, generation=0, record_steps=3,
                    record_dir="/r", migration_id=migration_id, incident_id=incident_id)


def halt(incident_id, reason="n2 lost"):
    return p.Halt(incident_id=incident_id, reason=reason, failed_ranks=[2, 3])


def plan(incident_id, generation=5):
    return p.Recover(incident_id=incident_id, generation=generation, resume_step=10, sends=[])


def switch(step, migration_id=1):
    return p.Switch(migration_id=migration_id, step=step)


def decide(commit, migration_id=1):
    return p.Decide(migration_id=migration_id, commit=commit, reason="" if commit else "joiner died")


def active(step=-1, groups=None):
    c = Control()
    c.start(assign())
    if groups is not None:
        c.attach(groups)
    if step >= 0:
        c.boundary(step)
    return c


def in_thread(fn):
    """Run ``fn`` on a thread; returns (thread, result dict filled with 'value' when it returns)."""
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("value", fn()), daemon=True)
    t.start()
    return t, out


# --- halts -------------------------------------------------------------------------------------------------------
def test_a_halt_wakes_a_waiter():
    c = active(step=7)
    t, out = in_thread(lambda: c.wait_until(lambda: c.halt is not None, 5.0))
    time.sleep(0.05)
    assert t.is_alive()  # nothing to wake it yet
    started = time.monotonic()
    c.on_halt(halt(1))
    t.join(2.0)
    assert not t.is_alive() and out["value"] is True
    assert time.monotonic() - started < 1.0
    assert c.halt.incident_id == 1 and c.halt_reason() == "halted by tmd: n2 lost"


def test_a_waiter_times_out_without_a_halt():
    c = active()
    assert c.wait_until(lambda: c.halt is not None, 0.05) is False


def test_a_newer_halt_supersedes_an_older_one_and_an_older_one_is_ignored():
    c = active(step=7)
    c.on_halt(halt(1))
    c.on_halt(halt(3, "n1 lost"))
    assert c.halt.incident_id == 3
    c.on_halt(halt(2, "late news"))  # an older incident arriving late changes nothing
    assert c.halt.incident_id == 3 and c.halt_reason() == "halted by tmd: n1 lost"


def test_a_halt_fails_the_movers_of_an_active_rank_only():
    assert active(groups=object()).on_halt(halt(1)) is True
    assert active().on_halt(halt(1)) is False  # no groups built yet: nothing to fail
    joiner = Control()
    joiner.start(assign(p.WorkerRole.JOINER, migration_id=1))
    joiner.attach(object())
    assert joiner.on_halt(halt(1)) is False  # a joiner's movers replay: nothing blocks on a peer
    assert Control().on_halt(halt(1)) is False  # a standby


def test_a_newer_halt_supersedes_a_recovery_attempt_in_flight():
    c = active(step=7)
    c.on_halt(halt(1))
    c.on_recover(plan(1))
    attempt = Attempt(c.halt, c.plan)
    assert not c.superseded(attempt)
    t, out = in_thread(lambda: c.await_attempt(attempt, 5.0))
    time.sleep(0.05)
    c.on_halt(halt(2))  # a second failure while the first plan is carried out
    t.join(2.0)
    assert out["value"] == (True, False)  # superseded, the helper not finished: the attempt is cancelled
    assert c.finish_attempt(attempt) is True  # the helper, finishing late, must release what it built


def test_a_finished_attempt_clears_its_halt_and_plan():
    c = active(step=7)
    c.on_halt(halt(1))
    c.on_recover(plan(1))
    attempt = Attempt(c.halt, c.plan)
    assert c.finish_attempt(attempt) is False  # the training thread still owns the result
    assert c.await_attempt(attempt, 1.0) == (False, True)
    c.recovered(attempt)
    assert c.halt is None and c.plan is None and c.halt_reason() is None


def test_recovered_keeps_a_newer_halt():
    c = active(step=7)
    c.on_halt(halt(1))
    attempt = Attempt(c.halt, plan(1))
    c.on_halt(halt(2))
    c.recovered(attempt)
    assert c.halt.incident_id == 2  # the newer incident still has to be recovered from


# --- switch step and decision ---------------------------------------------------------------------------------------
def test_a_switch_for_a_step_already_reached_is_refused_as_late():
    c = active(step=12)
    armed = c.on_switch(switch(12))
    assert armed == (False, "already at step 12", 12)
    assert c.switch is None
    assert c.on_switch(switch(11)).accepted is False


def test_a_switch_for_a_later_step_is_armed_and_taken_at_that_boundary_only():
    c = active(step=12)
    assert c.on_switch(switch(14)) == (True, "", 12)
    assert c.boundary(13) is None
    s = c.boundary(14)
    assert s is not None and s.step == 14
    c.clear_switch(1)
    assert c.switch is None and c.boundary(14) is None


def test_a_joiner_is_never_late():
    c = Control()
    c.start(assign(p.WorkerRole.JOINER, migration_id=1))
    c.set_step(30)  # its shadow iterations' numbering says nothing about the rank's steps
    assert c.on_switch(switch(12)) == (True, "", -1)
    assert c.switch.step == 12


def test_an_aborted_decision_clears_the_armed_switch():
    c = active(step=12)
    c.on_switch(switch(14))
    assert c.on_decide(decide(False)) is False  # an active rank does not exit
    assert c.switch is None and c.boundary(14) is None
    assert c.decision.commit is False


def test_an_abort_of_another_migration_keeps_the_armed_switch():
    c = active(step=12)
    c.on_switch(switch(14, migration_id=2))
    c.on_decide(decide(False, migration_id=1))
    assert c.switch.migration_id == 2


def test_a_commit_keeps_the_armed_switch():
    c = active(step=12)
    c.on_switch(switch(14))
    c.on_decide(decide(True))
    assert c.switch is not None and c.decision.commit is True


def test_an_aborted_joiner_must_exit_but_a_commit_is_final():
    c = Control()
    c.start(assign(p.WorkerRole.JOINER, migration_id=1))
    assert c.on_decide(decide(False)) is True
    c = Control()
    c.start(assign(p.WorkerRole.JOINER, migration_id=1))
    assert c.on_decide(decide(True)) is False
    assert c.on_decide(decide(False)) is None  # ignored: tmd never aborts after deciding the commit
    assert c.decision.commit is True


def test_prepare_forgets_the_previous_decision_and_a_decision_wakes_a_waiter():
    c = active(step=3)
    c.on_decide(decide(False))
    c.on_prepare(p.Prepare(migration_id=2, generation=4, role=p.MigrationRole.STAYER, leaver_ranks=[2, 3],
                           transfer_prefix=""))
    assert c.decision is None and c.migration_role == p.MigrationRole.STAYER
    t, out = in_thread(lambda: c.wait_until(lambda: c.decision is not None, 5.0))
    time.sleep(0.05)
    c.on_decide(decide(True, migration_id=2))
    t.join(2.0)
    assert out["value"] is True and c.decision.migration_id == 2


def test_a_prepare_is_refused_while_another_migrations_switch_step_is_still_ahead():
    # a stayer a few ms behind migration 1's switch step must keep migration 1's role and decision for it
    c = active(step=10)
    c.on_prepare(p.Prepare(migration_id=1, generation=2, role=p.MigrationRole.STAYER, leaver_ranks=[2, 3],
                           transfer_prefix=""))
    c.on_switch(switch(12))
    c.on_decide(decide(True))
    second = p.Prepare(migration_id=2, generation=3, role=p.MigrationRole.LEAVER, leaver_ranks=[0, 1],
                       transfer_prefix="tm/x")
    for step in (11, 12):  # before S, and at S (the training thread may be inside its switch boundary)
        c.boundary(step)
        assert "switch step 12 of migration 1 is armed" in c.on_prepare(second)
        assert c.migration_role == p.MigrationRole.STAYER and c.decision.commit and c.migration_id == 1
    c.clear_switch(1)  # acted on
    assert c.on_prepare(second) == ""
    assert c.migration_role == p.MigrationRole.LEAVER and c.decision is None and c.migration_id == 2


# --- assignment and release ----------------------------------------------------------------------------------------
def test_release_exits_at_once_only_a_standby_a_joiner_or_a_fenced_process():
    finished = p.Release(reason="job finished", exit_code=int(p.ExitCode.OK))
    fenced = p.Release(reason="declared failed", exit_code=int(p.ExitCode.FENCED))
    assert Control().on_release(finished) is True  # a standby holds nothing of value
    joiner = Control()
    joiner.start(assign(p.WorkerRole.JOINER, migration_id=1))
    assert joiner.on_release(finished) is True
    assert active().on_release(finished) is False  # an active rank finishes its loop itself
    assert active().on_release(fenced) is True


def test_wait_assigned_returns_the_assignment_or_a_release():
    c = Control()
    assert c.wait_assigned(0.01) is None
    t, out = in_thread(lambda: c.wait_assigned(5.0))
    c.on_assign(assign(rank=1))
    t.join(2.0)
    assert out["value"].rank == 1
    c.on_release(p.Release(reason="refused", exit_code=int(p.ExitCode.REFUSED)))
    assert isinstance(c.wait_assigned(0.01), p.Release)  # a release wins


def test_stages_follow_the_role():
    c = Control()
    assert (c.stage, c.role, c.rank) == (Stage.STANDBY, p.WorkerRole.STANDBY, -1)
    c.start(assign(p.WorkerRole.JOINER, rank=3, migration_id=1))
    assert (c.stage, c.role, c.rank) == (Stage.JOINING, p.WorkerRole.JOINER, 3)
    c.enter(Stage.SHADOW)
    assert c.stage == Stage.SHADOW
    c.become_active()
    assert (c.stage, c.role) == (Stage.TRAINING, p.WorkerRole.ACTIVE)
    assert active().stage == Stage.TRAINING

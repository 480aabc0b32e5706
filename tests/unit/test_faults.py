"""The user's errors and misuse on tmd's side (tmd.faults): a rank's script error, a rank that died before it
registered, a standby that keeps dying, the crash-loop guard after a recovery, and misuse refusing migrations and
recoveries. No processes: a Registry with fake workers and fake incidents."""
import os
from types import SimpleNamespace

import pytest

from tmd import protocol as p
from tmd.episode import Episodes
from tmd.faults import STANDBY_START_LIMIT, Faults, log_tail
from tmd.journal import Journal
from tmd.protocol.layout import RunDir
from tmd.protocol.vocab import Event, FailureKind, IncidentState, WarningCode
from tmd.registry import Registry, Worker

pytestmark = pytest.mark.timeout(10)


@pytest.fixture
def world(tmp_path):
    reg = Registry(["n1", "n2"], 2, ["s1"])
    for node in ("n1", "n2", "s1"):
        for lr in range(2):
            reg.add_worker(Worker(f"{node}/{lr}".encode(), node, lr, 100 + lr, "h"))
    for w in reg.rank_owner.values():
        w.step = 10
    journal = Journal(None)
    incidents = Episodes()
    return SimpleNamespace(reg=reg, journal=journal, incidents=incidents, layout=RunDir(str(tmp_path)),
                           faults=Faults(reg, journal, RunDir(str(tmp_path)), incidents))


def events(journal, name):
    return [e for e in journal.since(0, 1000) if e["event"] == name]


def recovered(world, incident_id, resume_step, lost=(2, 3)):
    """Incident ``incident_id`` recovered ranks ``lost`` (n2's) and resumed at ``resume_step``."""
    world.incidents.add(SimpleNamespace(id=incident_id, state=IncidentState.RECOVERED, resume_step=resume_step,
                                        finished=True, lost={r: "n2" for r in lost}))


def test_a_script_error_fails_the_job_with_its_traceback(world):
    w = world.reg.rank_owner[3]
    msg = p.RankFailed(rank=3, step=5, kind=FailureKind.SCRIPT_ERROR, error="ValueError: bad",
                       traceback="Traceback...\nValueError: bad")
    failed = world.faults.rank_failed(w, msg)
    assert "rank 3 on n2" in failed.reason and "step 5" in failed.reason and "ValueError: bad" in failed.reason
    assert failed.details.startswith("Traceback")
    (ev,) = events(world.journal, Event.RANK_FAILED)
    assert ev["rank"] == 3 and ev["node"] == "n2" and ev["kind"] == FailureKind.SCRIPT_ERROR
    assert world.faults.failure["traceback"].startswith("Traceback")


def test_an_uncaught_step_aborted_fails_the_job_naming_the_rank_and_what_to_do(world):
    """Not "every rank is lost (n1/0 died)": the survivor that did not catch its StepAborted says so first."""
    msg = p.RankFailed(rank=0, step=7, kind=FailureKind.STEP_ABORTED_UNCAUGHT,
                       error="rank 0 step 7: update refused, a collective failed. In a session.steps() loop, catch "
                             "worker.StepAborted and continue", traceback="Traceback...\nStepAborted: rank 0 step 7")
    failed = world.faults.rank_failed(world.reg.rank_owner[0], msg)
    assert failed.reason.startswith("rank 0 on n1 raised StepAborted and did not catch it at step 7: rank 0 step 7: "
                                    "update refused")
    assert "catch worker.StepAborted" in failed.reason and failed.details.endswith("StepAborted: rank 0 step 7")
    (ev,) = events(world.journal, Event.RANK_FAILED)
    assert ev["kind"] == FailureKind.STEP_ABORTED_UNCAUGHT and world.faults.failure["kind"] == ev["kind"]


def test_a_rank_that_died_before_registering_is_named_with_its_log_tail(world):
    path = world.layout.log("n2", 1)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write("".join(f"line {i}\n" for i in range(50)) + "SyntaxError: oops\n")
    failed = world.faults.startup_exit(world.reg.nodes["n2"], 1, 2)
    assert "rank 3 (n2/1) exited with code 2 before worker.init()" in failed.reason
    (ev,) = events(world.journal, Event.STARTUP_FAILED)
    assert ev["rank"] == 3 and ev["returncode"] == 2 and ev["log_tail"].endswith("SyntaxError: oops")
    assert len(ev["log_tail"].splitlines()) == 20 and log_tail(path, 2) == "line 49\nSyntaxError: oops"


def test_a_standby_dying_before_registering_is_not_restarted_forever(world):
    f, s1 = world.faults, world.reg.nodes["s1"]
    for _ in range(STANDBY_START_LIMIT - 1):
        assert f.startup_exit(s1, 0, 1) is None
        assert f.may_restart_standby(s1) is None
    f.startup_exit(s1, 0, 1)
    assert "died before registering 3 times in a row" in f.may_restart_standby(s1)
    f.registered(Worker(b"x", "s1", 0, 1, "h"))  # one that registers starts the count over
    assert f.may_restart_standby(s1) is None


def test_crash_loop_guard_until_the_redone_step_committed(world):
    f, reg = world.faults, world.reg
    n2 = reg.nodes["n2"]
    assert f.refuse_recovery(n2, "killed") is None  # no recovery yet: recover
    recovered(world, 1, 10)
    for w in reg.rank_owner.values():
        w.step = 10  # resumed at step 10, not committed yet
    failed = f.refuse_recovery(n2, "n2/0 exited with code -9")
    assert failed is not None and failed.reason.startswith("step 10 failed again after recovery")
    # a RankFailed at the redone step says so too; at another step it does not
    again = f.rank_failed(reg.rank_owner[2], p.RankFailed(rank=2, step=10, kind=FailureKind.SCRIPT_ERROR,
                                                          error="E: x", traceback=""))
    assert again.reason.startswith("step 10 failed again after recovery")
    for w in reg.rank_owner.values():
        w.step = 11  # every rank committed step 10: the guard is off
    assert f.refuse_recovery(n2, "killed") is None and f.redo_step is None
    recovered(world, 1, 10)  # the same incident does not arm it again
    assert f.refuse_recovery(n2, "killed") is None


def test_another_node_lost_during_the_redone_step_is_recovered_not_a_crash_loop(world):
    """Outside test: kill -9 of n1, recovered; kill -9 of n2 while step 17 was redone failed the job ("step 17
    failed again after recovery") although a standby and checkpoints were there. Only the ranks the incident
    recovered, failing again, are a crash loop."""
    f, reg = world.faults, world.reg
    recovered(world, 1, 10, lost=(0, 1))  # n1's ranks were recovered
    for w in reg.rank_owner.values():
        w.step = 10
    assert f.refuse_recovery(reg.nodes["n2"], "n2/0 exited with code -9") is None  # n2 holds ranks 2, 3
    failed = f.refuse_recovery(reg.nodes["n1"], "n1/0 exited with code -9")  # (the node now holding ranks 0, 1)
    assert failed is not None and failed.reason.startswith("step 10 failed again after recovery")


def test_state_changed_after_an_update_is_kept_and_journalled_but_refuses_nothing(world):
    """``state_after_update``: only a replacement's RNG or data position may differ, migrations stay exact; a
    later warning of unmanaged state refuses as before."""
    f = world.faults
    f.warned(world.reg.rank_owner[1], p.RankWarning(rank=1, code=WarningCode.STATE_AFTER_UPDATE,
                                                     message="the CPU RNG changed"))
    assert [w["code"] for w in f.warnings] == [WarningCode.STATE_AFTER_UPDATE]
    assert len(events(world.journal, Event.JOB_WARNING)) == 1
    assert f.unmanaged() is None and f.refuse_recovery(world.reg.nodes["n2"], "killed") is None
    f.warned(world.reg.rank_owner[0], p.RankWarning(rank=0, code=WarningCode.UNMANAGED_PARAMETERS, message="x"))
    assert f.unmanaged() == "rank 0 on n1 reported unmanaged_parameters: x"


def test_misuse_refuses_recovery_and_is_kept_once_per_rank(world):
    f = world.faults
    msg = p.RankWarning(rank=0, code=WarningCode.NOTHING_MANAGED, message="session.manage was never called")
    f.warned(world.reg.rank_owner[0], msg)
    f.warned(world.reg.rank_owner[0], msg)
    assert f.warnings == [{"rank": 0, "node": "n1", "code": WarningCode.NOTHING_MANAGED,
                           "message": "session.manage was never called"}]
    assert len(events(world.journal, Event.JOB_WARNING)) == 1
    assert "nothing_managed" in f.unmanaged()
    failed = f.refuse_recovery(world.reg.nodes["n2"], "killed")
    assert failed is not None and "cannot recover from the loss of n2" in failed.reason

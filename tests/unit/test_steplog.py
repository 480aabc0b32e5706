"""StepLog (which steps every rank finished, the slowest time) and the journal's listeners."""
from __future__ import annotations

from tmd.journal import Journal
from tmd.protocol.vocab import Event
from tmd.steplog import MAX_PENDING, StepLog


def test_a_step_is_logged_once_every_rank_reported_it_with_the_slowest_time():
    log = StepLog(world_size=3)
    log.report(0, 5, 0.10, ts=100.0)
    log.report(2, 5, 0.30, ts=100.1)
    assert log.flush() == []
    log.report(1, 5, 0.20, ts=100.2)
    log.report(0, 6, 0.11, ts=100.3)
    assert log.flush() == [[5, 100.2, 0.3]]
    assert log.flush() == []


def test_a_redone_step_starts_afresh_and_is_logged_again():
    log = StepLog(world_size=2)
    log.report(0, 7, 0.1, ts=1.0)
    log.report(1, 7, 0.1, ts=1.1)
    log.report(0, 8, 9.0, ts=1.2)  # rank 1 dies in step 8: step 8 never completes before the rollback
    log.report(0, 7, 0.2, ts=5.0)  # the job rolled back to 7 and redoes it
    log.report(1, 7, 0.25, ts=5.1)
    log.report(0, 8, 0.2, ts=5.3)  # rank 0 reports 8 again: its pre-rollback 9.0 s no longer counts
    log.report(1, 8, 0.3, ts=5.4)
    assert log.flush() == [[7, 1.1, 0.1], [7, 5.1, 0.25], [8, 5.4, 0.3]]


def test_steps_that_never_complete_are_bounded():
    log = StepLog(world_size=2)
    for s in range(MAX_PENDING + 10):
        log.report(0, s, 0.1)
    assert log.pending == list(range(10, MAX_PENDING + 10))


def test_journal_listeners_see_each_entry_and_cannot_break_recording(capsys):
    j = Journal(None)
    seen = []
    j.subscribe(seen.append)
    j.subscribe(lambda entry: 1 / 0)
    first = j.record(Event.TMD_STARTED, job="x")
    second = j.record(Event.STEP_TIMES, steps=[[1, 2.0, 0.5]])
    assert seen == [first, second] and second["steps"] == [[1, 2.0, 0.5]]
    assert j.listener_errors == 2
    assert capsys.readouterr().err.count("journal listener failed") == 1

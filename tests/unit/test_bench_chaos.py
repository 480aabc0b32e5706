"""benchmarks.chaos's pure parts: the seeded schedule, which tier repaired an event, the ETTR."""
from __future__ import annotations

import pytest

from benchmarks.chaos import KINDS, ettr, outcome, schedule


def test_the_schedule_is_seeded_and_has_every_kind_when_it_can():
    assert schedule(10, 3) == schedule(10, 3) != schedule(10, 4)
    assert set(schedule(10, 3)) == set(KINDS) and len(schedule(30, 0)) == 30
    assert len(schedule(3, 0)) == 3


@pytest.mark.parametrize("entry, tier", [
    ({"event": "recovery_done", "rollback_step": -1, "resume_step": 13, "phases_s": {"total": 1.5}}, "replica"),
    ({"event": "recovery_done", "rollback_step": 10, "resume_step": 11, "phases_s": {"total": 2.5}}, "snapshot"),
    ({"event": "job_restarting", "tier": "checkpoint", "step": 20, "work_lost_s": 4.0}, "checkpoint"),
    ({"event": "migration_committed", "migration_id": 2, "switch_step": 30}, "migration"),
    ({"event": "standby_restarted", "node": "s1"}, "none"),
])
def test_the_tier_of_an_event_is_what_repaired_it_after_it(entry, tier):
    journal = [{"seq": 1, "ts": 1.0, "event": "recovery_done", "rollback_step": 5},  # before the event: not it
               {"seq": 2, "ts": 2.0, "event": "node_failed"}, {"seq": 3, "ts": 3.0, **entry}]
    got = outcome(journal, after_seq=1)
    assert got["tier"] == tier and got["ts"] == 3.0
    assert outcome(journal[:2], after_seq=1) is None


def test_ettr_counts_the_steps_over_the_wall_time_of_every_attempt():
    journal = [{"seq": 1, "ts": 0, "event": "step_times", "steps": [[0, 100.0, 1.0], [1, 101.0, 1.0]]},
               {"seq": 2, "ts": 0, "event": "step_times", "steps": [[1, 110.0, 1.0], [2, 111.0, 1.0]]}]  # restarted
    assert ettr(journal, median_s=1.0) == {"steps": 2, "wall_s": 11.0, "ettr": 0.18182}

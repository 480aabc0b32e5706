"""The pure parts of benchmarks/recovery.py: the recovery's timeline after the kill and the step-time medians."""
from benchmarks.recovery import StepClock, timeline_s


def test_timeline_is_in_seconds_after_the_kill_and_leaves_out_what_did_not_happen():
    events = {"detected": {"ts": 100.25}, "halted": None, "plan_sent": {"ts": 100.5}, "recovered": {"ts": 101.0}}
    assert timeline_s(100.0, events, 102.125) == {"detected": 0.25, "plan_sent": 0.5, "recovered": 1.0,
                                                  "redone_step_committed": 2.125}
    assert timeline_s(100.0, {"detected": None}, None) == {}


def test_medians_use_the_steps_before_the_kill_only():
    clock = StepClock(client=None)
    clock.reported = {("n1", s): 1.0 + (s % 2) * 0.5 for s in range(30)}  # 1.0 / 1.5 alternating
    clock.reported[("n1", 25)] = 99.0  # after the kill: not counted
    assert clock.median_step_s(20) == 1.25
    clock.seen = {10: 0.0, 12: 2.0, 13: 4.0}  # a gap of two steps counts as two equal steps
    assert clock.median_step_polled_s(13) == 1.0

"""The ETTR and memory benchmarks' pure parts: step series from the journal, medians, ETTR, standby counts,
memory windows."""
import pytest

from benchmarks import ettr, memory
from tmd import protocol as p


def journal(*batches):
    return [{"event": p.Event.STEP_TIMES, "steps": b} for b in batches] + [{"event": p.Event.JOB_FINISHED}]


def test_step_series_keeps_the_last_report_of_a_redone_step():
    s = ettr.step_series(journal([[1, 10.0, 1.0], [2, 11.0, 1.0]], [[2, 13.5, 1.2], [3, 14.5, 1.0]]))
    assert s == {1: (10.0, 1.0), 2: (13.5, 1.2), 3: (14.5, 1.0)}


def test_median_over_the_open_closed_range():
    s = {1: (1.0, 9.0), 2: (2.0, 1.0), 3: (3.0, 2.0), 4: (4.0, 3.0)}
    assert ettr.median_step_s(s, 1, 4) == 2.0
    assert ettr.median_step_s(s, 4, 9) is None


def test_ettr_is_ideal_over_wall():
    s = {k: (100.0 + k * 1.0, 1.0) for k in range(5, 16)}
    s[15] = (100.0 + 15 + 0.5, 1.5)  # half a step lost somewhere
    fig = ettr.ettr(s, 5, 1.0)
    assert fig["steps"] == 10 and fig["wall_s"] == 10.5 and fig["ideal_s"] == 10.0
    assert fig["ettr"] == round(10 / 10.5, 5)
    with pytest.raises(ValueError):
        ettr.ettr(s, 4, 1.0)
    with pytest.raises(ValueError):
        ettr.ettr(s, 15, 1.0)


def test_standbys_needed_is_one_per_event_plus_a_spare():
    assert ettr.standbys_needed(600, 60) == 11
    assert ettr.standbys_needed(600, 120) == 6
    assert ettr.standbys_needed(50, 60) == 1
    assert ettr.standbys_needed(600, 0) == 1


def test_memory_windows_take_the_highest_sample_per_process():
    samples = [(step, pid, {"rss": rss, "uss": rss // 2, "hwm": None})
               for step, pid, rss in [(3, 1, 100), (5, 1, 101), (6, 1, 99), (10, 1, 120), (16, 1, 102),
                                      (3, 2, 200), (5, 2, 200), (10, 2, 200), (16, 2, 198)]]
    t = memory.stayer_table(samples, [1, 2], request_step=8, switch_step=10)
    assert t["windows_steps"]["before"] == (4, 7)
    assert t["per_process"]["1"]["rss_before_bytes"] == 101
    assert t["per_process"]["1"]["rss_during_bytes"] == 120
    assert t["per_process"]["1"]["rss_after_bytes"] == 102
    assert t["total"]["rss_before_bytes"] == 301 and t["total"]["rss_after_bytes"] == 300
    assert t["total"]["rss_growth_after"] == round(300 / 301 - 1, 5)


def test_an_event_s_loss_is_its_window_over_its_own_baseline():
    # steps of 1 s ending at t = step; the event at t = 20.5 slows steps 21-23 by 0.5 s and redoes nothing
    s = {k: (float(k), 1.0) for k in range(0, 21)}
    t = 20.0
    for k in range(21, 40):
        step_s = 1.5 if k <= 23 else 1.0
        t += step_s
        s[k] = (t, step_s)
    loss = ettr.event_loss(s, 20.5, end_step=28)
    assert loss == {"start_step": 21, "end_step": 28, "baseline_s": 1.0, "window_s": 9.5, "lost_s": 1.5}
    # a failed attempt's time is in the window even though the series keeps only the redone step's time
    s2 = dict(s)
    s2.update({k: (ts + 4.0, sec) for k, (ts, sec) in s.items() if k >= 22})
    assert ettr.event_loss(s2, 20.5, end_step=28)["lost_s"] == 5.5
    assert ettr.event_loss(s, 50.0, end_step=28) is None  # no step after the event
    assert ettr.event_loss(s, 20.5, end_step=45) is None  # the window's end is not in the series
    assert ettr.event_loss({k: v for k, v in s.items() if k > 15}, 20.5, end_step=28) is None  # no baseline
    # the step just before the window has no entry (a killed rank never reported it): the window starts one
    # step earlier and counts that step too
    gap = {k: v for k, v in s.items() if k != 20}
    assert ettr.event_loss(gap, 20.5, end_step=28) == {"start_step": 20, "end_step": 28, "baseline_s": 1.0,
                                                       "window_s": 10.5, "lost_s": 1.5}


def test_summarise_counts_every_event_s_loss_or_gives_no_figure():
    s = {k: (float(k), 1.0) for k in range(0, 101)}
    job = {"series": s, "first_step": 10, "final_hashes": {0: "h"},
           "events": [{"kind": "migrate", "ts": 30.5, "switch_step": 35, "state": "committed",
                       "step_at_request": 30}]}
    fig = ettr.summarise(dict(job, events=[dict(job["events"][0])]), 1.0, {0: "h"})
    assert fig["events"][0]["loss"]["lost_s"] == 0.0 and fig["ettr_event_losses"] == 1.0
    lost = dict(job["events"][0], switch_step=None)  # an event whose window is unknown
    fig = ettr.summarise(dict(job, events=[dict(job["events"][0]), lost]), 1.0, {0: "h"})
    assert fig["ettr_event_losses"] is None and fig["lost_s_per_event"] == 0.0


def test_ettr_at_the_event_cadence():
    assert ettr.at_cadence(1.2, 60.0) == 0.98
    assert ettr.at_cadence(None, 60.0) is None and ettr.at_cadence(1.0, 0.0) is None

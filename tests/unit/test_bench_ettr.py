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

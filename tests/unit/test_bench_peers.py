"""The peers benchmark's arithmetic on commit streams (benchmarks/peers.py): no processes."""
from __future__ import annotations

import json

import pytest

from benchmarks import peers


def test_median_step_skips_startup_and_later_commits():
    ts = [0.0, 5.0, 6.0, 7.0, 8.0, 9.5, 30.0]  # two start-up commits, steady 1 s steps, one after the kill
    assert peers.median_step(ts, before=20.0) == 1.0
    assert peers.median_step([0.0, 1.0, 2.0], before=20.0) is None  # one interval left after the skip: none


def test_stall_longest_and_total_excess_over_the_median():
    # commits every 1 s, kill at 10.5, survivors pause until 15, go on at reduced strength, pause again (the
    # replacement's join) until 18.5, full strength at 19.5
    ts = [8.0, 9.0, 10.0, 15.0, 16.0, 17.0, 18.5, 19.5, 20.5]
    longest, total = peers.stall(ts, t_kill=10.5, t_full=19.5, median=1.0)
    assert longest == pytest.approx(4.0)
    assert total == pytest.approx(4.0 + 0.5)


def test_stall_counts_the_gap_across_the_kill_only_once_full_strength_is_known():
    ts = [8.0, 9.0, 10.0, 12.0, 13.0]
    assert peers.stall(ts, t_kill=10.2, t_full=12.0, median=1.0) == (pytest.approx(1.0), pytest.approx(1.0))
    with pytest.raises(ValueError):
        peers.stall([11.0, 12.0], t_kill=10.0, t_full=12.0, median=1.0)


def test_recomputed_counts_every_begin_beyond_the_first():
    assert peers.recomputed([0, 1, 2, 3, 3, 4]) == 1
    assert peers.recomputed([0, 1, 2, 2, 2, 3, 3]) == 3  # begun thrice: thrown away twice
    assert peers.recomputed([]) == 0


def test_dropped_sums_missing_workers_the_last_commit_of_a_step_counting():
    commits = [(0, 4), (1, 4), (2, 3), (3, 3), (4, 4), (4, 4)]
    assert peers.dropped(commits, world=4) == 2
    assert peers.dropped([(5, 3), (5, 4)], world=4) == 0  # step 5 committed again at full strength


def test_ratio_floors_ours_and_passes_unknowns():
    assert peers.ratio(6.3, 0.7) == 9.0
    assert peers.ratio(1.0, 0.0) == 1000.0
    assert peers.ratio(None, 1.0) is None and peers.ratio(1.0, None) is None


def test_figures_put_together():
    ts = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 9.0, 10.0]
    out = peers.figures(ts, t_kill=5.5, t_full=9.0)
    assert out == {"median_step_s": 1.0, "survivor_stall_s": 3.0, "survivor_lost_s": 3.0,
                   "time_to_full_strength_s": 3.5}
    assert peers.figures(ts, t_kill=5.5, t_full=None)["survivor_stall_s"] is None


def test_read_jsonl_skips_a_torn_last_line(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text(json.dumps({"event": "start", "step": 0}) + "\n" + '{"event": "en')
    assert peers.read_jsonl(str(path)) == [{"event": "start", "step": 0}]
    assert peers.read_jsonl(str(tmp_path / "missing.jsonl")) == []


def test_a_missing_torchft_is_a_reason_to_skip(monkeypatch):
    real = peers.importlib.util.find_spec
    monkeypatch.setattr(peers.importlib.util, "find_spec", lambda name: None if name == "torchft" else real(name))
    assert "pip install --no-build-isolation -e .[bench]" in peers.torchft_missing()

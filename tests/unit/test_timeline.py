"""Unit tests of tmd.timeline (journal -> spans, phases, marks), its terminal rendering (tmctl.render) and its
picture (tmctl.timeline_plot: the band strip counted from the PNG's pixels, the PNG's size and metadata).

Journals are built by hand in the shape tmd records them (tmd/migration.py, tmd/recovery.py, tmd/daemon.py).
"""
import json

import pytest

from tmd import protocol as p
from tmd import timeline
from tmd.protocol.vocab import IncidentMark, IncidentState, MigrationState

T0 = 1_700_000_000.0
MIGRATION_STATES = [MigrationState.REQUESTED, MigrationState.WARMING, MigrationState.PREPARED,
                    MigrationState.SWITCHING, MigrationState.TRANSFERRED, MigrationState.COMMITTED]


class Journal:
    """Builds journal entries with increasing seq."""

    def __init__(self):
        self.events = []

    def add(self, name, ts, **fields):
        self.events.append({"seq": len(self.events) + 1, "ts": ts, "event": str(name), **fields})

    def started(self, ts=T0, job="local-42"):
        self.add(p.Event.TMD_STARTED, ts, job=job, address="tcp://127.0.0.1:1", world_size=4, nodes=["n1", "n2"],
                 standbys=["s1", "s2"], store_port=2, record_steps=3, snapshot_every=0)

    def steps(self, first, ts, count, seconds=0.1, every_s=0.1):
        rows = [[first + i, ts + i * every_s, seconds] for i in range(count)]
        self.add(p.Event.STEP_TIMES, rows[-1][1], steps=rows)
        return rows

    def migration(self, mid, start, states=MIGRATION_STATES, every_s=0.5, sources=("n2",), targets=("s1",),
                  **final):
        for i, state in enumerate(states):
            extra = final if state.finished else {}
            self.add(p.MIGRATION_EVENTS[state], start + i * every_s, migration_id=mid, sources=list(sources),
                     targets=list(targets), **extra)

    def incident(self, iid, start, node="n2", ranks=(2, 3), end=p.Event.RECOVERY_DONE, signal="process_exit"):
        self.add(p.Event.NODE_FAILED, start, node=node, reason=f"{node}/0 (pid 99) died", signal=signal,
                 ranks=list(ranks), silent_s=0.25)
        self.add(p.Event.RECOVERY_STARTED, start + 0.01, incident_id=iid, reason=f"{node}: {node}/0 (pid 99) died",
                 lost_ranks=list(ranks), survivors=[0, 1], adopted={})
        self.add(p.Event.STANDBY_PROMOTED, start + 0.02, incident_id=iid, failed_node=node, standby="s1",
                 ranks=list(ranks))
        self.add(p.Event.RECOVERY_HALTED, start + 0.1, incident_id=iid, committed={"0": 4, "1": 4})
        self.add(p.Event.RECOVERY_PLAN, start + 0.5, incident_id=iid, resume_step=4, generation=1, sends=[[0, 2]],
                 rollback_step=3)
        if end is not None:
            self.add(end, start + 0.7, incident_id=iid, resume_step=4, standbys={node: "s1"}, bytes_moved=10,
                     phases_s={"total": 0.69})


def test_a_committed_migration_is_one_span_with_a_phase_per_state():
    j = Journal()
    j.started()
    j.migration(1, T0 + 10, switch_step=40, bytes_moved=100, phases_s={})
    tl = timeline.build(j.events)
    (span,) = tl.to_dict()["spans"]
    assert span == {
        "kind": "migration", "id": 1, "label": "migration 1: n2→s1", "start": T0 + 10, "end": T0 + 12.5,
        "outcome": "committed",
        "phases": [{"name": "requested", "start": T0 + 10, "end": T0 + 10.5},
                   {"name": "warming", "start": T0 + 10.5, "end": T0 + 11},
                   {"name": "prepared", "start": T0 + 11, "end": T0 + 11.5},
                   {"name": "switching", "start": T0 + 11.5, "end": T0 + 12},
                   {"name": "transferred", "start": T0 + 12, "end": T0 + 12.5}]}
    assert tl.job == "local-42" and tl.start == T0 and tl.end == T0 + 12.5


def test_aborted_and_running_migrations_and_several_nodes():
    j = Journal()
    j.started()
    j.migration(1, T0 + 1, states=[MigrationState.REQUESTED, MigrationState.WARMING, MigrationState.ABORTED],
                reason="joiner checksum mismatch")
    j.migration(2, T0 + 5, states=MIGRATION_STATES[:3], sources=("n1", "n2"), targets=("s1", "s2"))
    spans = timeline.build(j.events).to_dict()["spans"]
    assert [(s["id"], s["outcome"], s["end"]) for s in spans] == [(1, "aborted", T0 + 2), (2, "running", None)]
    assert [ph["name"] for ph in spans[0]["phases"]] == ["requested", "warming"]
    assert spans[0]["phases"][-1]["end"] == T0 + 2
    assert spans[1]["label"] == "migration 2: n1→s1, n2→s2"
    assert spans[1]["phases"][-1] == {"name": "prepared", "start": T0 + 6, "end": None}


def test_an_incident_is_one_span_with_its_phases_and_the_failure_is_a_mark():
    j = Journal()
    j.started()
    j.incident(1, T0 + 20)
    d = timeline.build(j.events).to_dict()
    (span,) = d["spans"]
    assert span["kind"] == "incident" and span["id"] == 1 and span["outcome"] == "recovered"
    assert span["label"] == "incident 1: n2 lost (process_exit)"
    assert span["start"] == T0 + 20.01 and span["end"] == T0 + 20.7
    assert [(ph["name"], ph["start"], ph["end"]) for ph in span["phases"]] == [
        (IncidentState.HALTING, T0 + 20.01, T0 + 20.02), (IncidentMark.PROMOTED, T0 + 20.02, T0 + 20.1),
        (IncidentMark.HALTED, T0 + 20.1, T0 + 20.5), (IncidentState.RECOVERING, T0 + 20.5, T0 + 20.7)]
    assert d["marks"] == [{"ts": T0 + 20, "kind": "node_failed",
                           "label": "n2 failed: n2/0 (pid 99) died (process_exit, silent 0.25 s)"}]


def test_an_incident_is_labelled_with_the_nodes_that_failed_for_it():
    j = Journal()
    j.incident(1, T0, node="n2", ranks=(2, 3))
    j.incident(2, T0 + 10, node="s1", ranks=(2, 3), signal="heartbeat")  # s1 took n2's ranks, then failed
    j.add(p.Event.NODE_FAILED, T0 + 20, node="n1", reason="silent", signal="heartbeat", ranks=[0, 1])
    j.add(p.Event.RECOVERY_STARTED, T0 + 20.1, incident_id=3, reason="n1: silent", lost_ranks=[0, 1])
    j.add(p.Event.NODE_FAILED, T0 + 20.2, node="n3", reason="died", signal="process_exit", ranks=[4, 5])
    j.add(p.Event.RECOVERY_SUPERSEDED, T0 + 20.3, incident_id=3, reason="n3 failed too")
    j.add(p.Event.RECOVERY_STARTED, T0 + 20.3, incident_id=4, reason="n3: died", lost_ranks=[0, 1, 4, 5])
    j.add(p.Event.RECOVERY_STARTED, T0 + 30, incident_id=5, reason="rank 1 failed to recover", lost_ranks=[])
    assert [s.label for s in timeline.build(j.events).spans] == [
        "incident 1: n2 lost (process_exit)", "incident 2: s1 lost (heartbeat)", "incident 3: n1 lost (heartbeat)",
        "incident 4: n1 lost (heartbeat), n3 lost (process_exit)", "incident 5: rank 1 failed to recover"]
    assert [s.outcome for s in timeline.build(j.events).spans] == [
        "recovered", "recovered", "superseded", "running", "running"]


@pytest.mark.parametrize("end, outcome", [(p.Event.RECOVERY_FAILED, "failed"),
                                          (p.Event.RECOVERY_SUPERSEDED, "superseded"), (None, "running")])
def test_incident_outcomes(end, outcome):
    j = Journal()
    j.incident(3, T0, end=end)
    (span,) = timeline.build(j.events).spans
    assert span.outcome == outcome
    assert (span.end is None) == (end is None)


def test_steps_marks_and_the_window():
    j = Journal()
    j.started()
    first = j.steps(0, T0 + 1, 10)
    j.add(p.Event.STRAGGLER_DETECTED, T0 + 2.5, rank=3, node="n2", lateness=0.4)
    j.migration(1, T0 + 3, every_s=0.1)
    second = j.steps(10, T0 + 4, 10, seconds=0.2)
    j.steps(5, T0 + 6, 1, seconds=0.3)  # a redone step after a rollback appears again
    j.add(p.Event.JOB_FAILED, T0 + 7, reason="rank 3 raised")
    tl = timeline.build(j.events)
    assert tl.steps == first + second + [[5, T0 + 6, 0.3]]
    assert [(m.kind, m.label) for m in tl.marks] == [("straggler", "straggler: rank 3 on n2"),
                                                    ("job_failed", "job failed: rank 3 raised")]
    late = timeline.build(j.events, since_ts=T0 + 5).to_dict()
    assert late["start"] == T0 + 5 and late["end"] == T0 + 7
    assert late["steps"] == [s for s in second if s[1] >= T0 + 5] + [[5, T0 + 6, 0.3]]
    assert late["spans"] == [] and [m["kind"] for m in late["marks"]] == ["job_failed"]
    assert len(timeline.build(j.events, since_ts=T0 + 3.2).spans) == 1  # still running then
    assert timeline.build(j.events, since_ts=T0 - 600).start == tl.start  # a window older than the job


def test_malformed_entries_are_skipped():
    j = Journal()
    j.started()
    j.migration(1, T0 + 1)
    good = timeline.build(j.events).to_dict()
    junk = [
        None, 42, "text", [], {}, {"event": "step_times"}, {"ts": "now", "event": "migration_requested"},
        {"ts": float("nan"), "event": "migration_requested", "migration_id": 9},
        {"ts": T0 + 2, "event": 5}, {"ts": T0 + 2, "event": "migration_warming", "migration_id": "1"},
        {"ts": T0 + 2, "event": "migration_warming", "migration_id": True},
        {"ts": T0 + 2, "event": "step_times", "steps": "lots"},
        {"ts": T0 + 2, "event": "step_times", "steps": [[1, 2], ["a", T0, 0.1], [1, T0, -1], None, [1, T0, None]]},
        {"ts": T0 + 2, "event": "recovery_started", "incident_id": None},
        {"ts": T0 + 2, "event": "no_such_event", "migration_id": 1},
    ]
    mixed = j.events[:3] + junk + j.events[3:]
    assert timeline.build(mixed).to_dict() == good
    wild = timeline.build([{"ts": T0, "event": "node_failed", "node": ["x"] * 3, "reason": {"a": 1}, "ranks": 7},
                           {"ts": T0 + 1, "event": "recovery_started", "incident_id": 2, "lost_ranks": "all",
                            "reason": "x" * 1000},
                           {"ts": T0 + 2, "event": "migration_committed", "migration_id": 5, "sources": 3}])
    assert [s.label[:20] for s in wild.spans] == ["incident 2: " + "x" * 8, "migration 5: -→-"]
    assert len(wild.spans[0].label) < 140 and wild.spans[1].outcome == "committed"
    json.dumps(wild.to_dict())


def test_an_empty_journal():
    d = timeline.build([]).to_dict()
    assert d == {"job": None, "start": None, "end": None, "steps": [], "spans": [], "marks": []}


# ------------------------------------------------------------------------------------------------------------
# the terminal rendering
# ------------------------------------------------------------------------------------------------------------
def test_sparkline_bins_keep_each_columns_slowest_step():
    from tmctl import render

    steps = [[i, T0 + i, 0.1] for i in range(10)] + [[10, T0 + 4.2, 0.8]]
    line = render.sparkline(steps, T0, T0 + 10, 10)
    assert len(line) == 10 and line[4] == "█" and set(line[:4] + line[5:]) == {"▁"}
    assert render.sparkline([[0, T0 + 1, 0.5]], T0, T0 + 10, 5) == "█    "
    assert render.sparkline([], T0, T0, 3) == "   "


def test_timeline_lines_mark_spans_and_failures():
    from tmctl import render

    j = Journal()
    j.started()
    j.steps(0, T0, 100)
    j.migration(1, T0 + 2, every_s=0.2)
    j.incident(1, T0 + 6)
    lines = render.timeline_lines(timeline.build(j.events).to_dict(), 60)
    assert lines[0] == "job local-42: 100 step(s) over 9.9 s; step time max 0.100 s, median 0.100 s"
    assert lines[1] == "0.100 s ┤" + "█" * 50 and lines[2].startswith("        └")
    assert lines[3].strip() == "0 s" + " " * 42 + "9.9 s"
    marker = lines[2][len("        └"):]
    assert "M" in marker and "R" in marker and "x" in marker and len(marker) == 60 - 8 - 2
    assert marker.index("M") < marker.index("x")
    assert lines[4].startswith("M migration 1: n2→s1  committed in 1.00 s  (requested 0.20 s, warming 0.20 s")
    assert lines[5].startswith("R incident 1: n2 lost (process_exit)  recovered in 0.69 s  (halting 0.01 s")
    assert lines[6].startswith("x    6.00 s  n2 failed:")


# ------------------------------------------------------------------------------------------------------------
# the picture
# ------------------------------------------------------------------------------------------------------------
def crowded_journal():
    """3 migrations (two of them 0.3 s apart) and 2 incidents (the second starts as the first ends)."""
    j = Journal()
    j.started()
    for k in range(30):
        j.steps(k * 10, T0 + 1 + k, 10, seconds=0.1 + 0.4 * (k in (6, 13, 20)))
    j.migration(1, T0 + 5, every_s=0.1)
    j.migration(2, T0 + 12, every_s=0.01)
    j.migration(3, T0 + 12.3, states=MIGRATION_STATES[:4], every_s=0.01)  # still running at the end
    j.incident(1, T0 + 20)
    j.incident(2, T0 + 20.7, node="n1", ranks=(0, 1))
    return j


def test_png_bands_count_each_kind_and_the_size_is_exact(tmp_path):
    from tmctl import timeline_plot

    tl = timeline.build(crowded_journal().events)
    assert tl.count(timeline.SpanKind.MIGRATION) == 3 and tl.count(timeline.SpanKind.INCIDENT) == 2
    path = str(tmp_path / "t.png")
    info = timeline_plot.draw(tl.to_dict(), path, width_px=900, height_px=400)
    assert info == {"migration": 3, "incident": 2, "marks": 2, "steps": 300}
    assert timeline_plot.count_bands(path) == {"migration": 3, "incident": 2}
    assert timeline_plot.png_description(path) == info
    import matplotlib.image

    assert matplotlib.image.imread(path).shape[:2] == (400, 900)


def test_png_of_a_quiet_job_and_of_no_steps(tmp_path):
    from tmctl import timeline_plot

    j = Journal()
    j.started()
    j.steps(0, T0 + 1, 50)
    path = str(tmp_path / "quiet.png")
    timeline_plot.draw(timeline.build(j.events).to_dict(), path)
    assert timeline_plot.count_bands(path) == {"migration": 0, "incident": 0}
    j = Journal()
    j.migration(1, T0)
    path = str(tmp_path / "nosteps.png")
    timeline_plot.draw(timeline.build(j.events).to_dict(), path)
    assert timeline_plot.count_bands(path) == {"migration": 1, "incident": 0}


def test_band_layout_separates_touching_spans():
    from tmctl import timeline_plot

    bands = timeline_plot.band_layout([(10.0, 10.0), (10.2, 10.4), (11.0, 30.0), (995.0, 999.0)], 5, 1000)
    gap, width = timeline_plot.BAND_GAP_PX, timeline_plot.MIN_BAND_PX
    for (a, b), (c, _) in zip(bands, bands[1:]):
        assert b - a >= width and c - b >= gap
    assert bands[-1][1] <= 1000

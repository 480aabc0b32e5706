"""tmd.metrics: counters and histograms from real-shaped journal entries, live gauges from a status dict, malformed
entries ignored. Values are read back by parsing the exposition."""
import dataclasses
import math
import threading

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tmd import protocol as p
from tmd.metrics import Metrics
from tmd.protocol.vocab import Event, FailureSignal, Health, MigrationState, NodeRole

pytestmark = pytest.mark.timeout(30)

T0 = 1_800_000_000.0


def samples(m: Metrics) -> dict:
    """(sample name, sorted label items) -> value, without the ``_created`` timestamps."""
    body, ctype = m.exposition()
    assert ctype.startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            if not s.name.endswith("_created"):
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(m: Metrics, name: str, **labels) -> float:
    return samples(m)[(name, tuple(sorted({"job": "j", **labels}.items())))]


def entry(seq: int, event: Event, **fields) -> dict:
    return {"seq": seq, "ts": T0 + seq, "event": event, **fields}


def journal() -> list[dict]:
    """A job's journal: 5 steps, a committed and an aborted migration, a node failure recovered, stragglers."""
    return [
        entry(1, Event.TMD_STARTED, job="j", nodes=["n1", "n2"], standbys=["s1", "s2"], world_size=2),
        entry(2, Event.STANDBY_WARM, node="s1"),
        entry(3, Event.STEP_TIMES, steps=[[1, T0 + 2.5, 0.02], [2, T0 + 2.6, 0.03], [3, T0 + 2.7, 0.5]]),
        entry(4, Event.MIGRATION_REQUESTED, migration_id=1, sources=["n2"], targets=["s1"]),
        entry(5, Event.MIGRATION_COMMITTED, migration_id=1, sources=["n2"], targets=["s1"], switch_step=5,
              bytes_moved=1_000_000, phases_s={"warm_up": 1.5, "prepare": 0.2, "switch_wait": 0.04,
                                               "transfer": 0.3, "commit": 0.005, "total": 2.2}),
        entry(6, Event.MIGRATION_DOWNTIME, migration_id=1, downtime_s=0.12, median_step_s=0.02,
              window_s=[0.1, 0.02, 0.02], pause_s=0.08, joiner_lag_s=0.03),
        entry(7, Event.MIGRATION_ABORTED, migration_id=2, sources=["n1"], targets=["s2"], reason="joiner lost"),
        entry(8, Event.STRAGGLER_DETECTED, rank=1, node="s1", lateness=0.4),
        entry(9, Event.STRAGGLER_DETECTED, rank=1, node="s1", lateness=0.5),
        entry(10, Event.NODE_FAILED, node="n1", reason="n1/0 exited with code -9", signal=FailureSignal.PROCESS_EXIT,
              ranks=[0], silent_s=0.7),
        entry(11, Event.RECOVERY_STARTED, incident_id=1, reason="n1 failed", lost_ranks=[0]),
        entry(12, Event.RECOVERY_DONE, incident_id=1, resume_step=4, standbys={"n1": "s2"}, bytes_moved=500_000,
              phases_s={"halt": 0.3, "warm_up": 4.0, "plan": 4.1, "transfer_and_regroup": 0.6, "total": 4.7}),
        entry(13, Event.RECOVERY_FAILED, incident_id=2, state="recovering", reason="no standby"),
        entry(14, Event.RECOVERY_SUPERSEDED, incident_id=3, reason="newer failure"),
        entry(15, Event.STEP_TIMES, steps=[[3, T0 + 14.5, 0.04]]),  # step 3 redone after the rollback
    ]


def test_counters_and_histograms_from_the_journal():
    m = Metrics("j")
    m.replay(journal())
    assert value(m, "trainmover_steps_total") == 4
    assert value(m, "trainmover_step_time_seconds_count") == 4
    assert value(m, "trainmover_step_time_seconds_sum") == pytest.approx(0.59)
    assert value(m, "trainmover_step_time_seconds_bucket", le="0.025") == 1
    assert value(m, "trainmover_step_time_seconds_bucket", le="0.05") == 3
    assert value(m, "trainmover_step_time_seconds_bucket", le="0.5") == 4
    assert value(m, "trainmover_migrations_total", state=MigrationState.COMMITTED.value) == 1
    assert value(m, "trainmover_migrations_total", state=MigrationState.ABORTED.value) == 1
    for phase, seconds in {"warm_up": 1.5, "prepare": 0.2, "switch_wait": 0.04, "transfer": 0.3,
                           "commit": 0.005, "total": 2.2}.items():
        assert value(m, "trainmover_migration_phase_seconds_count", phase=phase) == 1
        assert value(m, "trainmover_migration_phase_seconds_sum", phase=phase) == pytest.approx(seconds)
    assert value(m, "trainmover_migration_downtime_seconds_sum") == pytest.approx(0.12)
    assert value(m, "trainmover_migration_downtime_seconds_count") == 1
    assert value(m, "trainmover_migration_stayer_pause_seconds_sum") == pytest.approx(0.08)
    assert value(m, "trainmover_migration_joiner_lag_seconds_sum") == pytest.approx(0.03)
    assert value(m, "trainmover_recoveries_total", state="recovered") == 1
    assert value(m, "trainmover_recoveries_total", state="failed") == 1
    assert value(m, "trainmover_recoveries_total", state="superseded") == 1
    assert value(m, "trainmover_recovery_phase_seconds_sum", phase="total") == pytest.approx(4.7)
    assert value(m, "trainmover_recovery_phase_seconds_count", phase="transfer_and_regroup") == 1
    assert value(m, "trainmover_node_failures_total", node="n1", signal="process_exit") == 1
    assert value(m, "trainmover_detection_latency_seconds_sum") == pytest.approx(0.7)
    assert value(m, "trainmover_detection_latency_seconds_bucket", le="0.5") == 0
    assert value(m, "trainmover_detection_latency_seconds_bucket", le="1.0") == 1
    assert value(m, "trainmover_moved_bytes_total", kind="migration") == 1_000_000
    assert value(m, "trainmover_moved_bytes_total", kind="recovery") == 500_000
    assert value(m, "trainmover_stragglers_total", node="s1") == 2


def test_known_label_sets_start_at_zero_and_every_sample_has_the_job_label():
    m = Metrics("j")
    s = samples(m)
    assert value(m, "trainmover_steps_total") == 0
    assert value(m, "trainmover_migrations_total", state="committed") == 0
    assert value(m, "trainmover_recoveries_total", state="superseded") == 0
    assert value(m, "trainmover_moved_bytes_total", kind="recovery") == 0
    assert value(m, "trainmover_checkpoints_total", state="failed") == 0
    assert value(m, "trainmover_restarts_total", tier="checkpoint") == 0
    assert all(dict(labels).get("job") == "j" for _, labels in s)
    # a node's sets once it runs a process: the alert increase(trainmover_stragglers_total[30m]) > 0 then sees
    # the first straggler (a series born at 1 shows no increase)
    m.observe(entry(1, Event.WORKER_REGISTERED, node="n2", local_rank=0, pid=9, rank=1, role="active"))
    assert value(m, "trainmover_stragglers_total", node="n2") == 0
    assert value(m, "trainmover_node_failures_total", node="n2", signal="silent") == 0


def test_replay_equals_observing_each_entry():
    a, b = Metrics("j"), Metrics("j")
    a.replay(journal())
    for e in journal():
        b.observe(e)
    assert samples(a) == samples(b)


MALFORMED = [
    None, 42, "step_times", [], {}, {"event": None}, {"event": 7}, {"event": "no_such_event"},
    {"event": Event.STEP_TIMES}, {"event": Event.STEP_TIMES, "steps": "lots"},
    {"event": Event.STEP_TIMES, "steps": [None, [1], [1, 2], [1, 2, "x"], [1, 2, -1.0], [1, 2, float("nan")],
                                          [1, 2, float("inf")], [1, 2, True], {"a": 1}]},
    {"event": Event.MIGRATION_COMMITTED.value, "phases_s": "fast", "bytes_moved": -5},
    {"event": Event.MIGRATION_COMMITTED, "phases_s": {"total": "2", "transfer": None, "bogus": 1.0, 3: 4},
     "bytes_moved": "1000"},
    {"event": Event.MIGRATION_DOWNTIME, "downtime_s": "0.1", "pause_s": None},
    {"event": Event.MIGRATION_DOWNTIME, "downtime_s": float("nan"), "pause_s": -1, "joiner_lag_s": "x"},
    {"event": Event.NODE_FAILED, "node": ["n1"], "signal": "telepathy", "silent_s": "3"},
    {"event": Event.NODE_FAILED, "node": None, "signal": None, "silent_s": float("-inf")},
    {"event": Event.RECOVERY_DONE, "phases_s": [1, 2], "bytes_moved": float("inf")},
    {"event": Event.STRAGGLER_DETECTED, "node": None}, {"event": Event.STRAGGLER_DETECTED, "node": {"x": 1}},
    {"event": Event.STRAGGLER_DETECTED, "node": ""},
]


def test_malformed_entries_are_skipped_without_raising():
    m = Metrics("j")
    for e in MALFORMED:
        m.observe(e)
    s = samples(m)
    # the events themselves still count where the event alone says it (a committed migration, a recovery) ...
    assert value(m, "trainmover_migrations_total", state="committed") == 2
    assert value(m, "trainmover_recoveries_total", state="recovered") == 1
    # ... but no malformed field reached a metric
    assert value(m, "trainmover_steps_total") == 0
    assert value(m, "trainmover_moved_bytes_total", kind="migration") == 0
    assert value(m, "trainmover_moved_bytes_total", kind="recovery") == 0
    names = {name for name, _ in s}
    for absent in ("trainmover_migration_phase_seconds_count", "trainmover_migration_downtime_seconds_count",
                   "trainmover_migration_stayer_pause_seconds_count", "trainmover_migration_joiner_lag_seconds_count",
                   "trainmover_detection_latency_seconds_count",
                   "trainmover_node_failures_total", "trainmover_stragglers_total",
                   "trainmover_recovery_phase_seconds_count"):
        assert absent not in names
    assert not any(math.isnan(v) for v in s.values())


def test_a_label_value_is_cut_and_odd_text_stays_valid():
    m = Metrics("j")
    m.observe(entry(1, Event.STRAGGLER_DETECTED, rank=0, node='n"1\\\n' + "x" * 500))
    [(name, labels)] = [k for k in samples(m) if k[0] == "trainmover_stragglers_total"]
    assert len(dict(labels)["node"]) == 128 and dict(labels)["node"].startswith('n"1\\\n')


def status(**overrides) -> dict:
    nodes = [
        {"name": "n1", "role": NodeRole.ACTIVE, "ranks": [0], "health": Health.HEALTHY, "reason": "",
         "processes": 1, "expected_processes": 1, "heartbeat_age_s": 0.25, "step": 12, "step_time_s": 0.031,
         "warm": False, "stragglers": [], "pids": {"0": 100}},
        {"name": "n2", "role": NodeRole.FAILED, "ranks": [], "health": Health.UNHEALTHY, "reason": "silent",
         "processes": 0, "expected_processes": 1, "heartbeat_age_s": None, "step": None, "step_time_s": None,
         "warm": False, "stragglers": [], "pids": {}},
        {"name": "s1", "role": NodeRole.ACTIVE, "ranks": [1], "health": Health.HEALTHY, "reason": "",
         "processes": 1, "expected_processes": 1, "heartbeat_age_s": 0.5, "step": 12, "step_time_s": 0.04,
         "warm": True, "stragglers": [1], "pids": {"0": 101}},
        {"name": "s2", "role": NodeRole.STANDBY, "ranks": [], "health": Health.HEALTHY, "reason": "",
         "processes": 1, "expected_processes": 1, "heartbeat_age_s": 0.1, "step": 3, "step_time_s": None,
         "warm": True, "stragglers": [], "pids": {"0": 102}},
        {"name": "s3", "role": NodeRole.STANDBY, "ranks": [], "health": Health.UNKNOWN, "reason": "",
         "processes": 0, "expected_processes": 1, "heartbeat_age_s": None, "step": None, "step_time_s": None,
         "warm": False, "stragglers": [], "pids": {}},
        {"name": "s4", "role": NodeRole.GUARDING, "ranks": [], "health": Health.HEALTHY, "reason": "",
         "processes": 1, "expected_processes": 1, "heartbeat_age_s": 0.1, "step": 2, "step_time_s": None,
         "warm": True, "stragglers": [], "pids": {"0": 103}, "guards": [0]},
    ]
    reply = p.StatusReply(job="j", world_size=2, generation=3, step=12, nodes=nodes,
                          migration={"id": 1, "state": MigrationState.COMMITTED, "reason": "", "phases_s": {}},
                          recovery={"id": 1, "state": "recovering", "reason": "n2 failed", "phases_s": {}},
                          failure=None, warnings=[])
    return {**dataclasses.asdict(reply), **overrides}


def test_live_gauges_from_the_status():
    m = Metrics("j")
    names = {name for name, _ in samples(m)}
    assert "trainmover_step" not in names  # nothing published yet
    m.set_live(status())
    assert value(m, "trainmover_world_size") == 2
    assert value(m, "trainmover_step") == 12
    assert value(m, "trainmover_generation") == 3
    assert 0.25 <= value(m, "trainmover_node_heartbeat_age_seconds", node="n1") < 0.25 + 5
    assert 0.5 <= value(m, "trainmover_node_heartbeat_age_seconds", node="s1") < 0.5 + 5
    assert ("trainmover_node_heartbeat_age_seconds", (("job", "j"), ("node", "n2"))) not in samples(m)
    assert [value(m, "trainmover_node_healthy", node=n) for n in ("n1", "n2", "s1", "s2", "s3")] == [1, 0, 1, 1, 0]
    for node, role in (("n1", "active"), ("n2", "failed"), ("s1", "active"), ("s2", "standby")):
        for r in NodeRole:
            assert value(m, "trainmover_node_role", node=node, role=r.value) == (1 if r == role else 0)
    assert value(m, "trainmover_node_step", node="n1") == 12
    assert value(m, "trainmover_node_step_time_seconds", node="s1") == pytest.approx(0.04)
    assert value(m, "trainmover_standbys", state="warm") == 1
    assert value(m, "trainmover_standbys", state="cold") == 1
    assert value(m, "trainmover_standbys", state="guarding") == 1
    assert value(m, "trainmover_node_role", node="s4", role="guarding") == 1
    assert value(m, "trainmover_migration_in_progress") == 0
    assert value(m, "trainmover_recovery_in_progress") == 1
    assert value(m, "trainmover_job_failed") == 0
    m.set_live(status(failure={"error": "boom"}, migration={"state": "switching"}, recovery=None,
                      nodes=[None, {"name": 5}, {"name": "x", "role": "dancer", "health": 3,
                                                 "heartbeat_age_s": "old"}]))
    assert value(m, "trainmover_job_failed") == 1
    assert value(m, "trainmover_migration_in_progress") == 1
    assert value(m, "trainmover_recovery_in_progress") == 0
    assert not any(dict(labels).get("node") in ("n1", "5") for _, labels in samples(m))
    m.set_live("not a dict")  # ignored at scrape time
    assert "trainmover_step" not in {name for name, _ in samples(m)}


def test_observing_while_scraping_from_other_threads():
    m = Metrics("j")
    m.set_live(status())
    stop = threading.Event()
    errors = []

    def scrape():
        while not stop.is_set():
            try:
                samples(m)
            except Exception as e:  # noqa: BLE001
                errors.append(e)

    threads = [threading.Thread(target=scrape) for _ in range(2)]
    for t in threads:
        t.start()
    for i in range(2000):
        m.observe(entry(i, Event.STEP_TIMES, steps=[[i, T0 + i, 0.01]]))
        if i % 100 == 0:
            m.set_live(status(step=i))
    stop.set()
    for t in threads:
        t.join()
    assert not errors and value(m, "trainmover_steps_total") == 2000


def test_checkpoints_and_restarts_are_counted():
    m = Metrics("j")
    m.replay([entry(1, Event.CHECKPOINT_COMMITTED, step=5, path="/c/step-000000005"),
              entry(2, Event.CHECKPOINT_FAILED, rank=0, node="n1", message="checkpoint at step 10 not saved"),
              entry(3, Event.JOB_RESTARTING, tier="checkpoint", step=5, work_lost_s=7.5, reason="every rank is lost"),
              entry(4, Event.JOB_RESTARTING, tier="checkpoint", step=5, work_lost_s="bad", reason="again")])
    assert value(m, "trainmover_checkpoints_total", state="committed") == 1
    assert value(m, "trainmover_checkpoints_total", state="failed") == 1
    assert value(m, "trainmover_restarts_total", tier="checkpoint") == 2
    assert value(m, "trainmover_restart_work_lost_seconds_sum") == 7.5

"""benchmarks.chaos's pure parts: the seeded schedule of each workload, which tier repaired an event, the work a
roll-back to a buddy snapshot lost, the ETTR."""
from __future__ import annotations

import pytest

from benchmarks import chaos
from benchmarks.chaos import GPT, KINDS, LLAMA, ettr, outcome, schedule


def bare_soak(journal) -> chaos.Soak:
    """A Soak without a job, reading ``journal()`` (a callable returning the journal)."""
    soak = object.__new__(chaos.Soak)
    soak.journal, soak.cut = journal, None
    return soak


def test_the_schedule_is_seeded_and_has_every_kind_of_its_workload_when_it_can():
    assert schedule(10, 3) == schedule(10, 3) != schedule(10, 4)
    assert set(schedule(10, 3, GPT.kinds)) == set(GPT.kinds) and len(schedule(30, 0)) == 30
    assert len(schedule(3, 0)) == 3
    assert set(schedule(LLAMA.events, 0, LLAMA.kinds)) == set(LLAMA.kinds)
    # --quick's few llama events still cut a node off and lose one with its snapshot keeper
    assert {"partition", "keeper_kill"} <= set(schedule(LLAMA.quick_events, 0, LLAMA.kinds))
    assert set(KINDS) == set(GPT.kinds) | set(LLAMA.kinds) and "tmd_kill" not in LLAMA.kinds  # see NOT_COVERED
    assert GPT.events + LLAMA.events >= 30


@pytest.mark.parametrize("entry, tier", [
    ({"event": "recovery_done", "rollback_step": -1, "resume_step": 13, "phases_s": {"total": 1.5}}, "replica"),
    ({"event": "job_restarting", "tier": "checkpoint", "step": 20, "work_lost_s": 4.0}, "checkpoint"),
    ({"event": "migration_committed", "migration_id": 2, "switch_step": 30}, "migration"),
    ({"event": "standby_restarted", "node": "s1"}, "none"),
    ({"event": "job_relearned", "after_s": 0.4, "step": 31}, "none"),  # tmd_kill: tmd resume re-learned the job
])
def test_the_tier_of_an_event_is_what_repaired_it_after_it(entry, tier):
    journal = [{"seq": 1, "ts": 1.0, "event": "recovery_done", "rollback_step": 5},  # before the event: not it
               {"seq": 2, "ts": 2.0, "event": "node_failed"}, {"seq": 3, "ts": 3.0, **entry}]
    got = outcome(journal, after_seq=1)
    assert got["tier"] == tier and got["ts"] == 3.0
    assert outcome(journal[:2], after_seq=1) is None


def test_a_recovery_whose_plan_rolled_back_to_a_buddy_snapshot_is_the_snapshot_tier():
    journal = [{"seq": 1, "ts": 1.0, "event": "recovery_plan", "incident_id": 1, "rollback_step": -1},
               {"seq": 2, "ts": 1.5, "event": "recovery_done", "incident_id": 1, "resume_step": 9},
               {"seq": 3, "ts": 2.0, "event": "recovery_plan", "incident_id": 2, "rollback_step": 10},
               {"seq": 4, "ts": 3.0, "event": "recovery_done", "incident_id": 2, "resume_step": 11,
                "phases_s": {"total": 2.5}}]
    assert outcome(journal, after_seq=0)["tier"] == "replica"
    got = outcome(journal, after_seq=2)
    assert (got["tier"], got["rollback_step"], got["downtime_s"]) == ("snapshot", 10, 2.5)


def test_a_roll_back_loses_the_steps_since_the_snapshot_as_first_done():
    steps = [[s, 100.0 + s, 1.0] for s in range(14)]  # steps 0..13 end at 100..113; the fault fires at 113.5
    redone = [[s, 120.0 + s, 1.0] for s in range(11, 14)]  # redone after the roll-back to step 10
    journal = [{"seq": 1, "ts": 0, "event": "step_times", "steps": steps},
               {"seq": 2, "ts": 0, "event": "step_times", "steps": redone}]
    assert chaos.rolled_back_s(journal, rollback_step=10, fired=113.5) == 3.0
    assert chaos.rolled_back_s(journal, rollback_step=10, fired=50.0) is None


def test_a_roll_backs_work_lost_waits_for_the_step_times_tmd_journals_after_the_recovery(monkeypatch):
    """tmd journals step times once a second: the end of the snapshot's step may come after recovery_done."""
    failed = {"seq": 2, "ts": 113.6, "event": "node_failed", "node": "n1"}
    plan = {"seq": 3, "ts": 113.7, "event": "recovery_plan", "incident_id": 1, "rollback_step": 10}
    done = {"seq": 4, "ts": 114.0, "event": "recovery_done", "incident_id": 1, "resume_step": 11,
            "phases_s": {"total": 0.4}}
    early = {"seq": 1, "ts": 0, "event": "step_times", "steps": [[s, 100.0 + s, 1.0] for s in range(10)]}
    late = {"seq": 5, "ts": 114.5, "event": "step_times", "steps": [[s, 100.0 + s, 1.0] for s in range(10, 14)]}
    reads = iter([[early, failed, plan, done]] * 2)
    monkeypatch.setattr(chaos, "wait_until", lambda f, *a, **k: next(v for v in iter(f, object()) if v))
    soak = bare_soak(lambda: next(reads, [early, failed, plan, done, late]))
    info = soak.follow({"kind": "kill", "step": 13, "ts": 113.5}, after_seq=1)
    assert (info["tier"], info["work_lost_s"], info["detect_s"]) == ("snapshot", 3.0, 0.1)


def test_the_keepers_are_the_last_replica_classes_ones():
    journal = [{"seq": 1, "ts": 0, "event": "replica_classes", "keepers": {"0": 2}},
               {"seq": 2, "ts": 1, "event": "replica_classes", "keepers": {"0": 1, "1": 2, "2": 3, "3": 0}}]
    assert chaos.keepers(journal) == {0: 1, 1: 2, 2: 3, 3: 0} and chaos.keepers([]) == {}


def test_ettr_counts_the_steps_over_the_wall_time_of_every_attempt():
    journal = [{"seq": 1, "ts": 0, "event": "step_times", "steps": [[0, 100.0, 1.0], [1, 101.0, 1.0]]},
               {"seq": 2, "ts": 0, "event": "step_times", "steps": [[1, 110.0, 1.0], [2, 111.0, 1.0]]}]  # restarted
    assert ettr(journal, median_s=1.0) == {"steps": 2, "wall_s": 11.0, "ettr": 0.18182}


def test_a_migrations_downtime_is_waited_for_as_tmd_journals_it_after_the_commit(monkeypatch):
    committed = {"seq": 2, "ts": 5.0, "event": "migration_committed", "migration_id": 7, "switch_step": 30}
    downtime = {"seq": 3, "ts": 6.0, "event": "migration_downtime", "migration_id": 7, "downtime_s": 0.12}
    other = {"seq": 4, "ts": 6.5, "event": "migration_downtime", "migration_id": 6, "downtime_s": 9.0}
    # an earlier daemon's migration 7 (ids start at 1 again after a relaunch from a checkpoint): not this one's
    earlier = {"seq": 1, "ts": 1.0, "event": "migration_downtime", "migration_id": 7, "downtime_s": 5.0}
    reads = iter([[earlier, committed], [earlier, committed], [earlier, committed, other]])
    monkeypatch.setattr(chaos, "wait_until", lambda f, *a, **k: next(v for v in iter(f, object()) if v))
    soak = bare_soak(lambda: next(reads, [earlier, committed, other, downtime]))
    info = soak.follow({"kind": "migrate", "step": 20, "ts": 4.0}, after_seq=1)
    assert (info["tier"], info["downtime_s"], info["next_step"]) == ("migration", 0.12, 30 + chaos.GAP_STEPS)


def test_the_uninterrupted_run_is_paced_as_the_soak_is_without_its_faults_machinery():
    for workload in (GPT, LLAMA):
        cmd = " ".join(chaos.reference_command("/tmp/x", 40, workload))
        assert " ".join(chaos.PACING) in cmd and " ".join(workload.script_args) in cmd and workload.script in cmd
        assert cmd.endswith("--tiny")
        assert "--netns-all" not in cmd and "--checkpoint-dir" not in cmd and "--standbys 0" in cmd
    assert "--nodes 4 --ranks-per-node 1" in " ".join(chaos.reference_command("/tmp/x", 40, LLAMA))


def test_waiting_for_the_next_event_stops_when_the_job_ended():
    class Ended:
        returncode = 1

        def poll(self):
            return 1

    soak = object.__new__(chaos.Soak)
    soak.job = type("J", (), {"proc": Ended()})()
    with pytest.raises(AssertionError, match="tmd exited with 1 before step 12"):
        soak.ready(12)


def test_a_tmd_kills_downtime_is_the_ranks_longest_pause_between_two_steps_after_it(monkeypatch):
    """tmd_kill: the ranks train on while tmd is down; its downtime is the gap in their step_times after the kill
    (a step's own seconds taken off), not tmd's re-learning time."""
    steps = [[s, 100.0 + 0.1 * s, 0.1] for s in range(10)] + [[10, 103.0, 0.1], [11, 103.1, 0.1], [12, 104.2, 1.0]]
    journal = [{"seq": 1, "ts": 0, "event": "step_times", "steps": steps},
               {"seq": 2, "ts": 103.05, "event": "job_relearned", "after_s": 0.7, "step": 10}]  # after the gap
    monkeypatch.setattr(chaos, "wait_until", lambda f, *a, **k: next(v for v in iter(f, object()) if v))
    soak = bare_soak(lambda: journal)
    info = soak.follow({"kind": "tmd_kill", "step": 5, "ts": 100.55}, after_seq=1)  # killed at 100.55
    assert (info["tier"], info["downtime_s"], info["relearn_s"]) == ("none", 2.0, 0.7)
    assert chaos.step_gap(chaos.step_ends(journal), since=200.0) is None


def test_an_unanswered_request_for_a_standby_is_asked_again_at_the_next_poll_and_the_added_ones_are_checked(
        monkeypatch):
    """A full soak died on one AddStandbyRequest left unanswered for tmctl's 10 s (its reply was lost, tmd.netns's
    bridge MAC): it is noted and asked again, as an unanswered status is; the standbys asked for must be in the
    journal."""
    from tmctl.client import TimedOut
    from tmd import protocol as p

    def status(nodes):
        return p.StatusReply(job="j", world_size=1, generation=0, step=20, nodes=nodes, migration=None,
                             recovery=None, failure=None, warnings=[])

    standbys = [{"role": p.NodeRole.STANDBY, "warm": False, "name": "s1"}]  # warm once x2 was asked for
    asked = []

    class Client:
        def request(self, msg):
            asked.append(msg.node)
            if len(asked) == 1:
                raise TimedOut("tcp://10.214.0.2:1", 10.0)
            standbys[0]["warm"] = True
            standbys.append({"role": p.NodeRole.STANDBY, "warm": False, "name": msg.node})
            return status(standbys)

    journal = [{"seq": 1, "ts": 0, "event": p.Event.STANDBY_ADDED, "node": "x1"}]  # added, its reply lost
    soak = bare_soak(lambda: journal)
    soak.job = type("J", (), {"proc": type("P", (), {"poll": lambda self: None})(), "client": Client()})()
    soak.added, soak.standby_asks = 0, []
    soak.status = lambda: status(list(standbys))
    monkeypatch.setattr(chaos, "wait_until", lambda f, *a, **k: next(v for v in iter(f, object()) if v))
    assert soak.ready(12).step == 20
    assert asked == ["x1", "x2"] and [a["answer"] for a in soak.standby_asks] == ["unanswered", "added"]
    with pytest.raises(AssertionError, match=r"\['x2'\] answered as added are not in the journal"):
        soak.standbys_added()
    journal.append({"seq": 2, "ts": 1, "event": p.Event.STANDBY_ADDED, "node": "x2"})
    assert soak.standbys_added() == {"asked": 2, "added": 2, "unanswered": 1}
    soak.standby_asks, journal[:] = [{"node": "x3", "answer": "unanswered"}], []
    with pytest.raises(AssertionError, match="asked for and none was added"):
        soak.standbys_added()

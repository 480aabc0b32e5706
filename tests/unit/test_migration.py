"""The migration state machine on its own: what tmd sends, in which state, and when it aborts."""
import math

import pytest

from tmd import protocol as p
from tmd.guards import Adoption
from tmd.journal import Journal
from tmd.migration import MigrationError, Migrations
from tmd.protocol.vocab import (
    ErrorCode, Event, Health, MigrationMark, MigrationPhase, MigrationRole, MigrationState, NodeRole,
)
from tests.support import RecordingChannel
from tmd.registry import Node, Registry, Worker

pytestmark = pytest.mark.timeout(10)


@pytest.fixture
def world():
    return make_world(["s1"])


def make_world(standbys: list[str]):
    """Nodes n1 (ranks 0-1) and n2 (ranks 2-3) at step 10 and warm 2-process ``standbys``: (registry,
    Migrations, what it sent, journal)."""
    reg = Registry(["n1", "n2"], 2, standbys)
    for node in ("n1", "n2", *standbys):
        for lr in range(2):
            reg.add_worker(Worker(f"{node}/{lr}".encode(), node, lr, 100, "h"))
    for rank, w in reg.rank_owner.items():
        w.step = 10
        for s in range(1, 10):
            reg.record_step(rank, s, 0.1)
    sent: list[tuple[str, p.Message]] = []
    journal = Journal(None)
    migs = Migrations(reg, journal, RecordingChannel(sent, world_size=4, generation=1, journal=journal), record_steps=3)
    return reg, migs, sent, journal


def ack(migs, reg, who, phase, mid=1, step=-1, ok=True, error="", shadow_steps=0):
    for ident in who:
        w = reg.by_identity[ident.encode()]
        migs.on_phase(w, p.PhaseDone(migration_id=mid, rank=w.rank if w.rank is not None else -1, phase=phase, ok=ok,
                                     error=error, step=step, bytes_moved=10, seconds=0.01, groups=[],
                                     shadow_steps=shadow_steps))


ALL = ["n1/0", "n1/1", "n2/0", "n2/1", "s1/0", "s1/1"]


def test_happy_path_messages_and_states(world):
    reg, migs, sent, _ = world
    m = migs.request("n2", "s1")
    assert m.state == MigrationState.WARMING and sorted(m.leavers) == [2, 3]
    assert [(w, msg.rank) for w, msg in sent] == [("s1/0", 2), ("s1/1", 3)]  # joiners take the leavers' ranks
    sent.clear()
    ack(migs, reg, ["s1/0", "s1/1"], MigrationPhase.WARMED)
    prepares = {w: msg for w, msg in sent}
    assert set(prepares) == set(ALL)
    assert prepares["n1/0"].role == MigrationRole.STAYER and prepares["n2/1"].role == MigrationRole.LEAVER
    assert prepares["s1/1"].role == MigrationRole.JOINER
    assert prepares["n2/1"].transfer_prefix == prepares["s1/1"].transfer_prefix == p.layout.transfer_prefix(m.generation, 3)
    assert prepares["s1/0"].transfer_prefix == p.layout.transfer_prefix(m.generation, 2) and not prepares["n1/0"].transfer_prefix
    assert all(msg.leaver_ranks == [2, 3] for msg in prepares.values())
    sent.clear()
    ack(migs, reg, ALL, MigrationPhase.PREPARED)
    assert m.state == MigrationState.PREPARED
    switch = {msg.step for _, msg in sent if isinstance(msg, p.Switch)}
    assert switch == {10 + 2 + math.ceil(0.5 / 0.1)}  # current step + margin from the median step time
    ack(migs, reg, ALL, MigrationPhase.ARMED, step=11)
    assert m.state == MigrationState.SWITCHING
    sent.clear()
    ack(migs, reg, ["s1/0", "s1/1"], MigrationPhase.TRANSFERRED)
    assert m.state == MigrationState.TRANSFERRED and m.bytes_moved == 20
    assert {w for w, msg in sent if isinstance(msg, p.Decide) and msg.commit} == set(ALL)
    ack(migs, reg, ["s1/0", "s1/1"], MigrationPhase.COMMITTED)
    assert m.state == MigrationState.COMMITTED
    assert reg.nodes["s1"].role == NodeRole.ACTIVE and reg.nodes["s1"].ranks == [2, 3]
    assert reg.nodes["n2"].role == NodeRole.LEFT
    assert reg.rank_owner[2].identity == b"s1/0"


def test_the_commit_journals_each_joiner_s_shadow_iterations(world):
    reg, migs, _, journal = world
    m = migs.request("n2", "s1")
    ack(migs, reg, ["s1/0"], MigrationPhase.WARMED, shadow_steps=1)  # DDP regrouped after its first iteration
    ack(migs, reg, ["s1/1"], MigrationPhase.WARMED, shadow_steps=3)
    ack(migs, reg, ALL, MigrationPhase.PREPARED)
    ack(migs, reg, ALL, MigrationPhase.ARMED, step=11)
    ack(migs, reg, ["s1/0", "s1/1"], MigrationPhase.TRANSFERRED)
    ack(migs, reg, ["s1/0", "s1/1"], MigrationPhase.COMMITTED)
    assert m.state == MigrationState.COMMITTED
    committed = [e for e in journal.since(0, 100) if e["event"] == Event.MIGRATION_COMMITTED]
    assert [e["shadow_steps"] for e in committed] == [{"2": 1, "3": 3}]


def test_requests_that_are_refused_change_nothing(world):
    reg, migs, sent, _ = world
    reg.nodes["n3"] = Node("n3", NodeRole.LEFT, [], 2)  # handed its ranks over in an earlier migration
    reg.nodes["n4"] = Node("n4", NodeRole.FAILED, [], 2)
    for args, code, words in [
            (("n9", "s1"), ErrorCode.UNKNOWN_NODE, "unknown node 'n9': it is not part of this job"),
            (("s1", "s1"), ErrorCode.UNKNOWN_NODE, "s1 is not an active node (it is standby)"),
            (("n2", "s9"), ErrorCode.UNKNOWN_STANDBY, "unknown standby 's9': it is not a standby of this job"),
            (("n2", "n1"), ErrorCode.UNKNOWN_STANDBY, "n1 is not a standby (it is active)"),  # known, not unknown
            (("n2", "n3"), ErrorCode.UNKNOWN_STANDBY, "n3 is not a standby (it left the job)"),
            (("n3", "s1"), ErrorCode.UNKNOWN_NODE, "n3 is not an active node (it left the job)"),
            (("n4", "s1"), ErrorCode.UNKNOWN_NODE, "n4 is not an active node (it failed)")]:
        with pytest.raises(MigrationError) as e:
            migs.request(*args)
        assert e.value.code == code and str(e.value).startswith(words), str(e.value)
    reg.nodes["s1"].workers[1].exited = True
    with pytest.raises(MigrationError, match="standby 's1' is busy"):
        migs.request("n2", "s1")
    reg.nodes["s1"].workers[1].exited = False
    migs.request("n2", "s1")
    with pytest.raises(MigrationError, match="still warming") as e:
        migs.request("n1", "s1")
    assert e.value.code == ErrorCode.MIGRATION_RUNNING
    assert len(migs.all) == 1 and not [m for _, m in sent if isinstance(m, p.Prepare)]


def test_a_rank_already_past_the_switch_step_aborts_before_anyone_switches(world):
    reg, migs, sent, _ = world
    m = migs.request("n2", "s1")
    ack(migs, reg, ["s1/0", "s1/1"], MigrationPhase.WARMED)
    ack(migs, reg, ALL, MigrationPhase.PREPARED)
    sent.clear()
    w = reg.by_identity[b"n1/0"]
    migs.on_phase(w, p.PhaseDone(migration_id=1, rank=0, phase=MigrationPhase.ARMED, ok=False, error="already at step 99", step=99, bytes_moved=0, seconds=0.0, groups=[]))
    assert m.state == MigrationState.ABORTED and "already at step 99" in m.reason
    assert {ident for ident, msg in sent if isinstance(msg, p.Decide) and not msg.commit} == set(ALL)
    assert reg.nodes["s1"].role == NodeRole.STANDBY and reg.rank_owner[2].identity == b"n2/0"


def test_checksum_failure_and_deadline_abort(world):
    reg, migs, sent, _ = world
    m = migs.request("n2", "s1")
    ack(migs, reg, ["s1/0"], MigrationPhase.TRANSFERRED, ok=False, error="ChecksumError: state refused")
    assert m.state == MigrationState.ABORTED and "ChecksumError" in m.reason
    m2 = migs.request("n2", "s1") if reg.nodes["s1"].warm else None
    assert m2 is None  # aborted joiners exit; the standby must come back warm first
    reg.nodes["s1"].health = Health.HEALTHY
    m2 = migs.request("n2", "s1")
    migs.tick(m2.deadline + 1)
    assert m2.state == MigrationState.ABORTED and m2.reason == "timed out in state warming after 300 s"


def test_stale_reports_are_ignored(world):
    reg, migs, _, journal = world
    m = migs.request("n2", "s1")
    ack(migs, reg, ["s1/0"], MigrationPhase.WARMED, mid=7)
    assert m.state == MigrationState.WARMING
    assert journal.since(0, 100)[-1]["event"] == Event.STALE_PHASE_REPORT


def test_reports_of_a_process_with_no_part_in_the_migration_count_for_nothing():
    """The worker key is every process's: a stayer's WARMED, or any report of a process outside the migration
    (here a second standby s2), must not advance it, nor abort it."""
    reg, migs, sent, journal = make_world(["s1", "s2"])
    m = migs.request("n2", "s1")
    ack(migs, reg, ["n1/0", "n1/1", "s2/0", "s2/1"], MigrationPhase.WARMED)  # as many as the joiners: not them
    ack(migs, reg, ["s2/0"], MigrationPhase.PREPARED, ok=False, error="spoofed")
    assert m.state == MigrationState.WARMING and MigrationMark.PREPARE_STARTED not in m.phases
    odd = [e for e in journal.since(0, 100) if e["event"] == Event.UNEXPECTED_PHASE_REPORT]
    assert len(odd) == 5 and odd[0]["reason"] == "it is no stayer that reports warmed in migration 1"
    assert odd[2]["reason"] == "it is no party that reports warmed in migration 1"
    ack(migs, reg, ["s1/0", "s1/1"], MigrationPhase.WARMED)  # the joiners: phase 1 starts
    assert MigrationMark.PREPARE_STARTED in m.phases


def switching(migs, reg):
    """A migration n2 -> s1 that every party armed (state switching)."""
    m = migs.request("n2", "s1")
    ack(migs, reg, ["s1/0", "s1/1"], MigrationPhase.WARMED, mid=m.id)
    ack(migs, reg, ALL, MigrationPhase.PREPARED, mid=m.id)
    ack(migs, reg, ALL, MigrationPhase.ARMED, mid=m.id, step=11)
    return m


def test_stayer_pause_is_recorded_even_after_commit(world):
    reg, migs, _, _ = world
    m = switching(migs, reg)
    ack(migs, reg, ["s1/0", "s1/1"], MigrationPhase.TRANSFERRED)
    stayer = reg.by_identity[b"n1/0"]
    migs.on_phase(stayer, p.PhaseDone(migration_id=1, rank=0, phase=MigrationPhase.COMMITTED, ok=True, error="", step=16, bytes_moved=0, seconds=0.125, groups=[]))
    ack(migs, reg, ["s1/0", "s1/1"], MigrationPhase.COMMITTED)
    assert m.state == MigrationState.COMMITTED
    late = reg.by_identity[b"n1/1"]  # reports after the migration committed: still counted
    migs.on_phase(late, p.PhaseDone(migration_id=1, rank=1, phase=MigrationPhase.COMMITTED, ok=True, error="", step=16, bytes_moved=0, seconds=0.25, groups=[]))
    assert m.to_dict()["pause_s"] == 0.25


def test_a_leaver_s_sent_report_after_the_commit_is_journalled(world):
    # The leaver reports SENT once its tail left; its joiner (another connection) may load it and commit first.
    reg, migs, _, journal = world
    m = switching(migs, reg)
    ack(migs, reg, ["n2/1"], MigrationPhase.SENT)
    ack(migs, reg, ["s1/0", "s1/1"], MigrationPhase.TRANSFERRED)
    ack(migs, reg, ["s1/0", "s1/1"], MigrationPhase.COMMITTED)
    assert m.state == MigrationState.COMMITTED
    ack(migs, reg, ["n2/0"], MigrationPhase.SENT)  # late
    ack(migs, reg, ["n1/0"], MigrationPhase.SENT)  # not a leaver: stale
    entries = journal.since(0, 100)
    assert sorted(e["rank"] for e in entries if e["event"] == Event.MIGRATION_SENT) == [2, 3]
    assert entries[-1]["event"] == Event.STALE_PHASE_REPORT and entries[-1]["sender"].startswith("n1/0")


def commit_migration(migs, reg):
    m = switching(migs, reg)
    ack(migs, reg, ["s1/0", "s1/1"], MigrationPhase.TRANSFERRED, mid=m.id)
    ack(migs, reg, ["s1/0", "s1/1"], MigrationPhase.COMMITTED, mid=m.id)
    return m


def test_episode_shape_ids_events_and_durations(world):
    reg, migs, _, journal = world
    migs.first_id = 4  # a restarted tmd goes on after the journal's last migration
    m = commit_migration(migs, reg)
    assert m.id == 4 and migs.get(4) is m and migs.get(-1) is m and migs.current is None and m.finished
    with pytest.raises(MigrationError) as e:
        migs.get(3)
    assert e.value.code == ErrorCode.UNKNOWN_MIGRATION
    assert m.generation == reg.generations.current == 1  # the registry's one counter
    states = [e["event"] for e in journal.since(0, 100) if e.get("migration_id") == 4 and "sources" in e]
    assert states == [Event.MIGRATION_REQUESTED, Event.MIGRATION_WARMING, Event.MIGRATION_PREPARED,
                      Event.MIGRATION_SWITCHING, Event.MIGRATION_TRANSFERRED, Event.MIGRATION_COMMITTED]
    d = m.to_dict()
    assert set(d) == {"id", "sources", "targets", "source", "target", "generation", "state", "reason",
                      "switch_step", "ranks", "phases",
                      "downtime_after_step",
                      "phases_s", "downtime_s", "median_step_s", "pause_s", "joiner_lag_s", "bytes_moved", "transfer_s", "rebuilt"}
    assert d["state"] == MigrationState.COMMITTED and d["ranks"] == [2, 3] and d["id"] == 4
    assert (d["sources"], d["targets"], d["source"], d["target"]) == (["n2"], ["s1"], "n2", "s1")
    assert all(e["sources"] == ["n2"] and e["targets"] == ["s1"] for e in journal.since(0, 100) if "sources" in e)
    assert set(d["phases_s"]) == {"warm_up", "prepare", "switch_wait", "transfer", "commit", "total"}
    assert d["phases_s"]["total"] == round(m.phases[MigrationState.COMMITTED] - m.phases[MigrationState.REQUESTED], 6)


def test_phase_one_has_the_prepared_deadline(world):
    reg, migs, _, _ = world
    m = migs.request("n2", "s1")
    ack(migs, reg, ["s1/0", "s1/1"], MigrationPhase.WARMED)  # phase 1 starts; the state is still warming
    migs.tick(m.deadline - 1)
    assert m.state == MigrationState.WARMING
    migs.tick(m.deadline + 1)
    assert m.state == MigrationState.ABORTED and m.reason == "timed out in state warming after 60 s"


def test_a_lost_joiner_aborts_before_the_decision(world):
    reg, migs, sent, _ = world
    m = migs.request("n2", "s1")
    ack(migs, reg, ["s1/0", "s1/1"], MigrationPhase.WARMED)
    ack(migs, reg, ALL, MigrationPhase.PREPARED)
    ack(migs, reg, ALL, MigrationPhase.ARMED, step=11)
    ack(migs, reg, ["s1/0"], MigrationPhase.TRANSFERRED)  # s1/1 has not loaded its state yet
    migs.on_worker_lost(reg.by_identity[b"s1/1"], "exited with code 1")
    assert m.state == MigrationState.ABORTED and m.reason == "joiner s1/1 exited with code 1 during switching"
    assert reg.nodes["s1"].role == NodeRole.STANDBY and reg.nodes["s1"].health == Health.UNKNOWN
    assert reg.nodes["n2"].role == NodeRole.ACTIVE and reg.rank_owner[3] is reg.by_identity[b"n2/1"]


def test_the_decision_is_the_point_of_no_return(world):
    """Once every joiner reported ``transferred`` (a pre-copy loaded: before the switch step), the ranks pass to
    the standby and every party hears the commit; a party lost afterwards never turns it into an abort (some
    parties may run in the new groups already): the migration commits, and the lost joiner is its node's failure."""
    reg, migs, sent, journal = world
    m = migs.request("n2", "s1")
    ack(migs, reg, ["s1/0", "s1/1"], MigrationPhase.WARMED)
    ack(migs, reg, ALL, MigrationPhase.PREPARED)
    ack(migs, reg, ["s1/0", "s1/1"], MigrationPhase.TRANSFERRED)  # early: a stayer's ARMED ack is still missing
    assert m.state == MigrationState.PREPARED
    assert migs.stranded_by("n1") == ([], [])  # before the decision a stayer's loss merely aborts
    sent.clear()
    ack(migs, reg, ALL, MigrationPhase.ARMED, step=11)
    assert m.state == MigrationState.TRANSFERRED  # decided as soon as the last party armed S
    assert {w for w, msg in sent if isinstance(msg, p.Decide) and msg.commit} == set(ALL)
    assert reg.nodes["s1"].role == NodeRole.ACTIVE and reg.nodes["n2"].role == NodeRole.LEFT
    assert reg.rank_owner[2] is reg.by_identity[b"s1/0"] and reg.rank_owner[3] is reg.by_identity[b"s1/1"]
    # a stayer's node lost now takes the undecided joiners' state with it: s1 fails too, n2's leavers are fenced
    assert migs.stranded_by("n1") == (["s1"], ["n2"]) and migs.stranded_by("s1") == ([], [])
    leaver, stayer = reg.by_identity[b"n2/0"], reg.by_identity[b"n1/0"]
    # the leaver still runs step S - 1 in rank 2: its report of it counts, not one of S
    assert migs.leaver_step(leaver, m.switch_step - 1) and not migs.leaver_step(leaver, m.switch_step)
    assert not migs.leaver_step(stayer, m.switch_step - 1)
    migs.on_worker_lost(leaver, "exited with code 0")
    assert m.state == MigrationState.TRANSFERRED  # the leaver leaving is the plan once commit was decided
    sent.clear()
    migs.on_worker_lost(reg.by_identity[b"s1/1"], "exited with code 1")
    assert m.state == MigrationState.COMMITTED and m.lost == "joiner s1/1 exited with code 1 during transferred"
    assert not [msg for _, msg in sent if isinstance(msg, p.Decide)]  # no abort after a commit decision
    committed = [e for e in journal.since(0, 100) if e["event"] == Event.MIGRATION_COMMITTED]
    assert committed[-1]["lost"] == m.lost
    assert reg.nodes["s1"].role == NodeRole.ACTIVE  # s1 holds ranks 2, 3: failure recovery repairs them


def test_joiner_lag_behind_the_stayers_at_the_switch_step(world):
    reg, migs, _, journal = world
    m = commit_migration(migs, reg)
    for who, ready in (("n1/0", 100.010), ("n1/1", 100.020), ("s1/0", 100.050)):
        migs.on_phase(reg.by_identity[who.encode()], p.PhaseDone(
            migration_id=m.id, rank=0, phase=MigrationPhase.COMMITTED, ok=True, error="", step=m.switch_step,
            bytes_moved=0, seconds=0.001, groups=[], ready_unix_s=ready))
    assert m.joiner_lag_s == pytest.approx(0.030)  # the last joiner against the last stayer


def test_downtime_of_the_window_after_the_switch_step(world):
    reg, migs, _, journal = world
    m = commit_migration(migs, reg)
    S = m.switch_step
    for s in range(S, S + 6):
        reg.record_step(0, s, 0.5 if s == S else 0.1)
        migs.on_step(0, s)
        assert (m.downtime_s is None) == (s < S + 5)
    assert m.downtime_s == pytest.approx(0.4) and m.median_step_s == pytest.approx(0.1)
    assert journal.since(0, 100)[-1]["event"] == Event.MIGRATION_DOWNTIME


def test_downtime_is_never_negative_and_each_migration_gets_its_own(world):
    import dataclasses

    reg, migs, _, journal = world
    m1 = commit_migration(migs, reg)
    S = m1.switch_step
    m2 = migs.add(dataclasses.replace(m1, id=m1.id + 1, switch_step=S + 2, downtime_s=None))  # back to back
    for s in range(S, S + 8):
        reg.record_step(0, s, 0.5 if s == S + 7 else 0.05)  # faster than the median (0.1) but one slow step
        migs.on_step(0, s)
    assert m1.downtime_s == 0.0  # 6 x 0.05 = 0.3 < 6 x 0.1: noise, not a negative downtime
    assert m2.downtime_s == pytest.approx(5 * 0.05 + 0.5 - 0.6)
    assert [e["migration_id"] for e in journal.since(0, 100) if e["event"] == Event.MIGRATION_DOWNTIME] == \
        [m1.id, m2.id]


def test_a_back_to_back_migrations_phase_1_waits_until_every_stayer_passed_the_last_switch_step():
    reg, migs, sent, journal = make_world(["s1", "s2"])
    first = commit_migration(migs, reg)  # n2 -> s1, committed once s1's processes run S
    S = first.switch_step
    sent.clear()
    second = migs.request("n1", "s2")
    ack(migs, reg, ["s2/0", "s2/1"], MigrationPhase.WARMED, mid=second.id)
    assert not any(isinstance(msg, p.Prepare) for _, msg in sent)  # n1 may still be before S
    assert second.prepare_held and second.state == MigrationState.WARMING
    held = [e for e in journal.since(0, 1000) if e.get("phase") == "prepare_held"]
    assert [(e["migration_id"], e["waiting_for"], e["previous_switch_step"]) for e in held] == \
        [(second.id, ["n1/0", "n1/1"], S)]
    ack(migs, reg, ["n1/0"], MigrationPhase.COMMITTED, mid=first.id, step=S)  # n1/0 swapped its groups at S
    migs.tick(0.0)
    assert not any(isinstance(msg, p.Prepare) for _, msg in sent)  # n1/1 has not
    reg.by_identity[b"n1/1"].step = S  # its report of step S - 1: at S, maybe not past it yet
    migs.tick(0.0)
    assert not any(isinstance(msg, p.Prepare) for _, msg in sent)
    reg.by_identity[b"n1/1"].step = S + 1  # it reported step S: past it
    migs.tick(0.0)
    prepares = {w: msg for w, msg in sent if isinstance(msg, p.Prepare)}
    assert set(prepares) == {"n1/0", "n1/1", "s1/0", "s1/1", "s2/0", "s2/1"}
    assert all(msg.migration_id == second.id for msg in prepares.values()) and not second.prepare_held
    assert len([e for e in journal.since(0, 1000) if e.get("phase") == "prepare_held"]) == 1  # journalled once


# --- several nodes in one migration ------------------------------------------------------------------------------
@pytest.fixture
def world4():
    """4 nodes x 2 ranks (n1: ranks 0-1 ... n4: ranks 6-7) and warm standbys s1, s2, s3 (s3 has 3 processes)."""
    reg = Registry(["n1", "n2", "n3", "n4"], 2, ["s1", "s2"])
    reg.nodes["s3"] = Node("s3", NodeRole.STANDBY, [], 3)
    for name, node in reg.nodes.items():
        for lr in range(node.expected_workers):
            reg.add_worker(Worker(f"{name}/{lr}".encode(), name, lr, 100, "h"))
    for rank, w in reg.rank_owner.items():
        w.step = 10
        for s in range(1, 10):
            reg.record_step(rank, s, 0.1)
    sent: list[tuple[str, p.Message]] = []
    journal = Journal(None)
    migs = Migrations(reg, journal, RecordingChannel(sent, world_size=8, generation=1, journal=journal), record_steps=3)
    return reg, migs, sent, journal


ALL4 = [f"{n}/{lr}" for n in ("n1", "n2", "n3", "n4", "s1", "s2") for lr in range(2)]
JOINERS2 = ["s1/0", "s1/1", "s2/0", "s2/1"]


def test_two_nodes_move_in_one_prepare_and_one_switch_and_commit_together(world4):
    reg, migs, sent, journal = world4
    m = migs.request(["n2", "n4"], ["s2", "s1"])  # n2's ranks to s2, n4's to s1
    assert m.state == MigrationState.WARMING and m.generation == reg.generations.current == 1
    assert sorted(m.leavers) == [2, 3, 6, 7] and sorted(m.stayers) == [0, 1, 4, 5]
    assert [(w, msg.rank, msg.migration_id) for w, msg in sent] == [
        ("s2/0", 2, 1), ("s2/1", 3, 1), ("s1/0", 6, 1), ("s1/1", 7, 1)]
    assert reg.nodes["s1"].role == reg.nodes["s2"].role == NodeRole.JOINING
    sent.clear()
    ack(migs, reg, JOINERS2[:3], MigrationPhase.WARMED)
    assert not sent  # phase 1 waits for every joiner of every pair
    ack(migs, reg, ["s2/1"], MigrationPhase.WARMED)
    prepares = {w: msg for w, msg in sent}
    assert set(prepares) == set(ALL4) and all(isinstance(msg, p.Prepare) for msg in prepares.values())
    assert all(msg.leaver_ranks == [2, 3, 6, 7] and msg.generation == 1 for msg in prepares.values())
    assert {w for w, msg in prepares.items() if msg.role == MigrationRole.LEAVER} == {"n2/0", "n2/1", "n4/0", "n4/1"}
    assert prepares["n4/1"].transfer_prefix == prepares["s1/1"].transfer_prefix == p.layout.transfer_prefix(1, 7)
    assert prepares["n2/0"].transfer_prefix == prepares["s2/0"].transfer_prefix == p.layout.transfer_prefix(1, 2)
    sent.clear()
    ack(migs, reg, ALL4, MigrationPhase.PREPARED)
    ack(migs, reg, ALL4, MigrationPhase.ARMED, step=11)
    switches = [(w, msg.step) for w, msg in sent if isinstance(msg, p.Switch)]
    assert len(switches) == len(ALL4) and len({step for _, step in switches}) == 1  # one switch step for all
    assert m.state == MigrationState.SWITCHING
    ack(migs, reg, ["s1/0", "s1/1", "s2/0"], MigrationPhase.TRANSFERRED)
    assert m.state == MigrationState.SWITCHING  # one pair still transferring
    ack(migs, reg, ["s2/1"], MigrationPhase.TRANSFERRED)
    assert m.state == MigrationState.TRANSFERRED and m.bytes_moved == 40
    ack(migs, reg, JOINERS2, MigrationPhase.COMMITTED)
    assert m.state == MigrationState.COMMITTED
    roles = {n.name: (n.role, n.ranks) for n in reg.nodes.values()}
    assert roles["s2"] == (NodeRole.ACTIVE, [2, 3]) and roles["s1"] == (NodeRole.ACTIVE, [6, 7])
    assert roles["n2"] == roles["n4"] == (NodeRole.LEFT, []) and roles["n1"] == (NodeRole.ACTIVE, [0, 1])
    assert [reg.rank_owner[r].identity for r in (2, 3, 6, 7)] == [b"s2/0", b"s2/1", b"s1/0", b"s1/1"]
    d = m.to_dict()
    assert (d["sources"], d["targets"], d["source"], d["target"], d["ranks"]) == (
        ["n2", "n4"], ["s2", "s1"], "n2,n4", "s2,s1", [2, 3, 6, 7])
    events = [e for e in journal.since(0, 100) if e.get("migration_id") == 1]
    assert [e["event"] for e in events].count(Event.MIGRATION_COMMITTED) == 1
    assert all(e["sources"] == ["n2", "n4"] and e["targets"] == ["s2", "s1"] for e in events if "sources" in e)


@pytest.mark.parametrize("phase, who", [(MigrationPhase.PREPARED, "n3/0"), (MigrationPhase.TRANSFERRED, "s1/1")])
def test_one_pair_failing_aborts_the_whole_migration(world4, phase, who):
    reg, migs, sent, _ = world4
    m = migs.request(["n2", "n4"], ["s2", "s1"])
    ack(migs, reg, JOINERS2, MigrationPhase.WARMED)
    if phase == MigrationPhase.TRANSFERRED:
        ack(migs, reg, ALL4, MigrationPhase.PREPARED)
        ack(migs, reg, ALL4, MigrationPhase.ARMED, step=11)
        ack(migs, reg, ["s2/0", "s2/1", "s1/0"], MigrationPhase.TRANSFERRED)  # n2 -> s2 went through
    sent.clear()
    ack(migs, reg, [who], phase, ok=False, error="ChecksumError: state refused")
    assert m.state == MigrationState.ABORTED and "ChecksumError" in m.reason
    # every party of every pair drops what it staged; both standbys come back fresh; nothing changed hands
    assert {w for w, msg in sent if isinstance(msg, p.Decide) and not msg.commit} == set(ALL4)
    assert reg.nodes["s1"].role == reg.nodes["s2"].role == NodeRole.STANDBY
    assert reg.nodes["n2"].role == reg.nodes["n4"].role == NodeRole.ACTIVE
    assert [reg.rank_owner[r].identity for r in (2, 6)] == [b"n2/0", b"n4/0"]


def test_a_leaver_node_lost_mid_migration_hands_only_its_pairs_joiners_to_recovery(world4):
    reg, migs, sent, _ = world4
    m = migs.request(["n2", "n4"], ["s2", "s1"])
    assert migs.on_node_failed("n3", "exited") is None  # a stayer's node: the migration aborts, nothing adopted
    assert m.state == MigrationState.ABORTED and m.reason == "node n3 lost during warming: exited"
    for node in ("s1", "s2"):
        reg.nodes[node].health = Health.HEALTHY  # the fresh standbys came back
    m = migs.request(["n2", "n4"], ["s2", "s1"])
    ack(migs, reg, JOINERS2, MigrationPhase.WARMED, mid=m.id)  # phase 1 started
    sent.clear()
    adopt = migs.on_node_failed("n4", "exited")
    assert m.state == MigrationState.ABORTED and m.reason == "leaver n4 lost: exited"
    assert adopt == Adoption("s1", {6: reg.by_identity[b"s1/0"], 7: reg.by_identity[b"s1/1"]}, warm=True)
    told = {w for w, msg in sent if isinstance(msg, p.Decide) and not msg.commit}
    assert told == set(ALL4) - {"s1/0", "s1/1"}  # s1's joiners are spared for the recovery
    assert reg.nodes["s1"].role == NodeRole.JOINING and reg.nodes["s2"].role == NodeRole.STANDBY
    assert migs.on_node_failed("n2", "exited") is None  # nothing runs any more


def test_leaver_side_names_the_pair_of_a_joiner(world4):
    reg, migs, _, _ = world4
    m = migs.request(["n2", "n4"], ["s2", "s1"])
    source, leavers = m.leaver_side(reg.by_identity[b"s1/0"])
    assert source == "n4" and [w.identity for w in leavers] == [b"n4/0", b"n4/1"]
    assert m.pairs() == [("n2", "s2"), ("n4", "s1")]
    with pytest.raises(ValueError):
        m.leaver_side(reg.by_identity[b"n1/0"])


@pytest.mark.parametrize("sources, targets, code, words", [
    (["n1", "n1"], ["s1", "s2"], ErrorCode.BAD_REQUEST, "node 'n1' is named twice among the nodes to move"),
    (["n1", "n2"], ["s1", "s1"], ErrorCode.BAD_REQUEST, "standby 's1' is named twice: one standby takes one node's "
                                                        "ranks"),
    (["n1", "n2"], ["s1"], ErrorCode.BAD_REQUEST, "2 node(s) to move (n1,n2) but 1 standby(s) to take them (s1): "
                                                  "name one standby per node"),
    ([], [], ErrorCode.BAD_REQUEST, "name at least one node to move"),
    (["n1", "n9"], ["s1", "s2"], ErrorCode.UNKNOWN_NODE, "unknown node 'n9': it is not part of this job"),
    (["n1", "s2"], ["s1", "s2"], ErrorCode.UNKNOWN_NODE, "s2 is not an active node (it is standby)"),
    (["n1", "n2"], ["s1", "n3"], ErrorCode.UNKNOWN_STANDBY, "n3 is not a standby (it is active)"),
    (["n1", "n2"], ["s1", "s9"], ErrorCode.UNKNOWN_STANDBY, "unknown standby 's9'"),
    (["n1", "n2"], ["s1", "s3"], ErrorCode.BAD_REQUEST, "standby 's3' has 3 processes but node 'n2' holds 2 ranks"),
])
def test_bad_multi_node_requests_are_refused_with_one_line_and_change_nothing(world4, sources, targets, code, words):
    reg, migs, sent, journal = world4
    with pytest.raises(MigrationError) as e:
        migs.request(sources, targets)
    assert e.value.code == code and str(e.value).startswith(words), str(e.value)
    assert "\n" not in str(e.value)
    assert not migs.all and not sent and not journal.since(0, 100) and reg.generations.current == 0
    assert all(reg.nodes[n].role == NodeRole.STANDBY for n in ("s1", "s2", "s3"))


def test_a_cold_standby_or_a_node_that_is_not_active_refuses_the_whole_request(world4):
    reg, migs, sent, _ = world4
    reg.nodes["s2"].workers[1].exited = True
    with pytest.raises(MigrationError, match="standby 's2' is busy") as e:
        migs.request(["n1", "n2"], ["s1", "s2"])
    assert e.value.code == ErrorCode.BUSY_STANDBY and reg.nodes["s1"].role == NodeRole.STANDBY
    reg.nodes["s2"].workers[1].exited = False
    reg.fail_node(reg.nodes["n3"], "lost")
    with pytest.raises(MigrationError, match="n3 is not an active node \\(it failed\\)") as e:
        migs.request(["n1", "n3"], ["s1", "s2"])
    assert e.value.code == ErrorCode.UNKNOWN_NODE and not migs.all and not sent


def test_migrate_requests_decode_strictly():
    ok = p.MigrateRequest(sources=["n1", "n2"], targets=["s1", "s2"])
    assert p.decode(p.encode(ok)) == ok
    frame = lambda **f: p.encode(p.MigrateRequest(**{"sources": ["n1"], "targets": ["s1"], **f}))  # noqa: E731
    for bad in [frame(sources=[]), frame(targets=[""]), frame(sources=["n" * 65]), frame(sources=[1]),
                frame(sources="n1"), frame(targets=[f"s{i}" for i in range(p.MAX_MIGRATE_NODES + 1)]),
                frame(sources=[["n1"]]), frame(targets=None)]:
        with pytest.raises(p.ProtocolError):
            p.decode(bad)
    assert p.decode(frame(sources=["n" * 64])).sources == ["n" * 64]


def test_a_window_step_lost_with_its_process_is_left_out_of_the_downtime(world):
    """The stayer holding the window's reference rank dies during the switch step and its report of that step
    never comes (a recovery redoes the next one): the downtime covers the steps that were reported, once."""
    reg, migs, _, journal = world
    m = commit_migration(migs, reg)
    S = m.switch_step
    for s in range(S + 1, S + 6):  # step S's report was lost
        reg.record_step(0, s, 0.2 if s == S + 1 else 0.1)
        migs.on_step(0, s)
    assert m.downtime_s == pytest.approx(0.1)
    downtime = [e for e in journal.since(0, 100) if e["event"] == Event.MIGRATION_DOWNTIME]
    assert len(downtime) == 1 and downtime[0]["missing_steps"] == [S] and downtime[0]["window_s"][0] is None

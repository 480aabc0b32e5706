"""The recovery state machine on its own (tmd.recovery.Incidents): what tmd sends, in which state, when an
incident is superseded, waits for a standby, or fails the job. No processes: a Registry with fake workers, a
channel that records what would be sent, and a run directory with fake recordings."""
import math
import os

import pytest

from tmd import protocol as p
from tmd.journal import Journal
from tmd.migration import Migrations
from tmd.protocol.layout import RunDir
from tmd.protocol.vocab import (
    Event, IncidentMark, IncidentState, MigrationPhase, MigrationState, NodeRole, RecoveryPhase,
)
from tmd.recovery import RECOVERY_TIMEOUT_S, Incidents, RecoveryError
from tests.support import RecordingChannel
from tmd.registry import Registry, Worker

pytestmark = pytest.mark.timeout(10)

NODES = ["n1", "n2", "n3"]  # ranks 0-1, 2-3, 4-5: every rank is a data-parallel replica of the others
SURVIVORS = ["n1/0", "n1/1", "n3/0", "n3/1"]  # when n2 fails


def add_node_workers(reg, node):
    for lr in range(reg.ranks_per_node):
        reg.add_worker(Worker(f"{node}/{lr}".encode(), node, lr, 100, "h"))


class World:
    def __init__(self, tmp_path, standbys=("s1", "s2"), recorded=range(6), snapshot_every=0):
        self.reg = Registry(NODES, 2, list(standbys))
        for node in NODES + list(standbys):
            add_node_workers(self.reg, node)
        for rank, w in self.reg.rank_owner.items():
            w.step = 10
            for s in range(1, 10):
                self.reg.record_step(rank, s, 0.1)
        self.run_dir = RunDir(str(tmp_path))
        os.makedirs(self.run_dir.record_dir)
        for rank in recorded:
            with open(self.run_dir.recording(rank), "wb") as f:
                f.write(b"fake recording")
        self.sent: list[tuple[str, p.Message]] = []
        self.journal = Journal(None)
        self.channel = RecordingChannel(self.sent, world_size=6, generation=0, journal=self.journal)
        self.incidents = Incidents(self.reg, self.journal, self.channel, self.run_dir, snapshot_every=snapshot_every)

    def w(self, ident):
        return self.reg.by_identity[ident.encode()]

    def report(self, ident, phase, incident_id=1, committed_step=-1, ok=True, error="", bytes_moved=0,
               snapshots=()):
        w = self.w(ident)
        self.incidents.on_report(w, p.RecoveryReport(
            incident_id=incident_id, rank=w.rank if w.rank is not None else -1, phase=phase, ok=ok, error=error,
            committed_step=committed_step, bytes_moved=bytes_moved, seconds=0.0, snapshots=list(snapshots)))

    def halt_all(self, committed, incident_id=1, snapshots=None):
        """``committed``: identity -> the step it committed; ``snapshots``: identity -> the snapshot steps it
        holds."""
        for ident, step in committed.items():
            self.report(ident, RecoveryPhase.HALTED, incident_id, committed_step=step,
                        snapshots=(snapshots or {}).get(ident, ()))

    def replicas(self, classes):
        """Every rank reports its replica class (``classes``: rank -> its class), as at the job's first step."""
        for rank, ranks in sorted(classes.items()):
            self.incidents.on_replicas(self.reg.rank_owner[rank], p.ReplicaReport(rank=rank, replicas=ranks))

    def sent_of(self, kind):
        return [(ident, msg) for ident, msg in self.sent if isinstance(msg, kind)]

    def events(self, name=None):
        return [e for e in self.journal.since(0, 10_000) if name is None or e["event"] == name]


@pytest.fixture
def world(tmp_path):
    return World(tmp_path)


def test_halting_recovering_recovered_with_sends_spread_over_replicas(world):
    world.incidents.on_node_failed("n2", "exited with code -9")
    inc = world.incidents.current
    assert inc.id == 1 and inc.state == IncidentState.HALTING and inc.lost == {2: "n2", 3: "n2"}
    assert sorted(inc.survivors) == [0, 1, 4, 5] and world.reg.nodes["n2"].role == NodeRole.FAILED
    halts = world.sent_of(p.Halt)
    assert sorted(ident for ident, _ in halts) == sorted(SURVIVORS)
    assert all(msg.incident_id == 1 and msg.failed_ranks == [2, 3] for _, msg in halts)
    # the first warm standby is promoted: one process per lost rank, told its rank for this incident
    assert world.reg.nodes["s1"].role == NodeRole.JOINING and world.reg.nodes["s2"].role == NodeRole.STANDBY
    assert [(ident, msg.rank, msg.incident_id) for ident, msg in world.sent_of(p.Assign)] == \
        [("s1/0", 2, 1), ("s1/1", 3, 1)]
    assert inc.standbys == {"n2": "s1"} and sorted(inc.replacements) == [2, 3]

    # rank 5's step did not commit everywhere (its all-reduce finished on some ranks only): it is one behind
    world.halt_all({"n1/0": 9, "n1/1": 9, "n3/0": 9, "n3/1": 8})
    assert world.events(Event.RECOVERY_HALTED)[0]["committed"] == {0: 9, 1: 9, 4: 9, 5: 8}
    # the plan does not wait for the replacements' warm-up: they carry it out during their shadow iterations
    assert inc.state == IncidentState.RECOVERING and inc.resume_step == 10
    assert IncidentMark.WARMED not in inc.phases
    assert inc.generation == world.reg.generations.current == 1
    plans = world.sent_of(p.Recover)
    assert sorted(ident for ident, _ in plans) == sorted(SURVIVORS + ["s1/0", "s1/1"])
    plan = plans[0][1]
    assert all(msg == plan for _, msg in plans)
    # receivers (the replacements, then the survivor behind) are spread over the replicas that committed step 9
    assert plan.sends == [[0, 2], [1, 3], [4, 5]] and plan.resume_step == 10 and plan.generation == 1

    # a process with no part in it (the standby s2: it holds the worker key too) neither fails nor finishes it
    for rank, ok in ((0, False), (2, True), (3, True)):
        world.incidents.on_report(world.w("s2/0"), p.RecoveryReport(
            incident_id=1, rank=rank, phase=RecoveryPhase.RECOVERED, ok=ok, error="forged", committed_step=-1,
            bytes_moved=10 ** 12, seconds=0.0))
    assert world.incidents.current is inc and not inc.recovered and world.incidents.failed_recoveries == 0
    for ident in SURVIVORS + ["n1/0"]:  # n1/0's report comes twice: it counts once, its bytes too
        world.report(ident, RecoveryPhase.RECOVERED, bytes_moved=100)
    world.report("s1/0", RecoveryPhase.WARMED)
    assert IncidentMark.WARMED not in inc.phases and len(world.sent_of(p.Recover)) == 6  # no second plan
    world.report("s1/1", RecoveryPhase.WARMED)
    assert IncidentMark.WARMED in inc.phases and inc.state == IncidentState.RECOVERING
    world.report("s1/0", RecoveryPhase.RECOVERED, bytes_moved=100)
    assert inc.state == IncidentState.RECOVERING
    world.report("s1/1", RecoveryPhase.RECOVERED, bytes_moved=100)
    assert inc.state == IncidentState.RECOVERED and world.incidents.current is None and inc.bytes_moved == 600
    s1 = world.reg.nodes["s1"]
    assert s1.role == NodeRole.ACTIVE and s1.ranks == [2, 3] and world.reg.rank_owner[3] is world.w("s1/1")
    assert world.incidents.lost == {}
    done = world.events(Event.RECOVERY_DONE)[0]
    assert done["standbys"] == {"n2": "s1"} and done["resume_step"] == 10 and done["bytes_moved"] == 600
    assert set(done["phases_s"]) == {"halt", "warm_up", "plan", "transfer_and_regroup", "after_warm_up", "total"}
    d = inc.to_dict()
    assert set(d) == {"id", "state", "reason", "lost_ranks", "failed_nodes", "standbys", "waiting_standby",
                      "resume_step", "generation", "bytes_moved", "phases_s", "rollback_step"}
    assert d["state"] == IncidentState.RECOVERED and d["lost_ranks"] == [2, 3] and d["failed_nodes"] == ["n2"]
    assert d["reason"] == "n2: exited with code -9" and world.incidents.get(-1) is inc


def test_a_second_failure_supersedes_the_first_and_keeps_a_live_replacement(world):
    world.incidents.on_node_failed("n2", "exited")
    first = world.incidents.current
    world.report("s1/0", RecoveryPhase.WARMED)
    world.report("s1/1", RecoveryPhase.WARMED)
    world.halt_all({"n1/0": 9, "n1/1": 9})  # n3 never halts: it fails next
    world.sent.clear()

    world.incidents.on_node_failed("n3", "stopped heartbeating")
    second = world.incidents.current
    assert first.state == IncidentState.SUPERSEDED and second.id == 2 and second.state == IncidentState.HALTING
    assert world.events(Event.RECOVERY_SUPERSEDED)[0]["incident_id"] == 1
    assert second.lost == {2: "n2", 3: "n2", 4: "n3", 5: "n3"} and sorted(second.survivors) == [0, 1]
    assert {msg.incident_id for _, msg in world.sent_of(p.Halt)} == {2}
    assert all(msg.failed_ranks == [2, 3, 4, 5] for _, msg in world.sent_of(p.Halt))
    # s1 (alive, still replacing n2) is kept, already warm; s2 is promoted for n3
    assert second.standbys == {"n2": "s1", "n3": "s2"}
    assert [(ident, msg.rank, msg.incident_id) for ident, msg in world.sent_of(p.Assign)] == \
        [("s2/0", 4, 2), ("s2/1", 5, 2)]
    assert second.replacements[2] is world.w("s1/0") and second.replacements[5] is world.w("s2/1")

    world.halt_all({"n1/0": 9, "n1/1": 9}, incident_id=1)  # the first incident's: stale
    assert len(second.halted) == 0 and world.events(Event.STALE_RECOVERY_REPORT)
    world.halt_all({"n1/0": 9, "n1/1": 9}, incident_id=2)
    world.report("s2/0", RecoveryPhase.WARMED, incident_id=2)
    world.report("s2/1", RecoveryPhase.WARMED, incident_id=2)
    assert second.state == IncidentState.RECOVERING
    assert world.sent_of(p.Recover)[0][1].sends == [[0, 2], [1, 3], [0, 4], [1, 5]]


def test_a_lost_replacement_is_replaced_by_another_standby(world):
    world.incidents.on_node_failed("n2", "exited")
    world.w("s1/0").exited = True
    world.incidents.on_replacement_lost(world.reg.nodes["s1"], "s1/0 exited")
    inc = world.incidents.current
    assert inc.id == 2 and world.reg.nodes["s1"].role == NodeRole.FAILED
    assert inc.standbys == {"n2": "s2"} and inc.replacements == {2: world.w("s2/0"), 3: world.w("s2/1")}


def test_a_superseding_incident_does_not_keep_a_replacement_whose_process_died(tmp_path):
    world = World(tmp_path, standbys=("s1", "s2", "s3"))
    world.incidents.on_node_failed("n2", "exited")
    world.w("s1/0").exited = True  # not declared failed yet when n3 fails too
    world.incidents.on_node_failed("n3", "exited")
    inc = world.incidents.current
    assert inc.id == 2 and inc.standbys == {"n2": "s2", "n3": "s3"}
    assert [(ident, msg.rank, msg.incident_id) for ident, msg in world.sent_of(p.Assign)][2:] == \
        [("s2/0", 2, 2), ("s2/1", 3, 2), ("s3/0", 4, 2), ("s3/1", 5, 2)]


def test_without_a_standby_the_incident_waits_then_promotes_one_that_registers(tmp_path):
    world = World(tmp_path, standbys=())
    world.incidents.on_node_failed("n2", "exited")
    inc = world.incidents.current
    assert inc.waiting_standby and inc.to_dict()["waiting_standby"] is True
    assert world.events(Event.RECOVERY_WAITING)[0]["failed_node"] == "n2"
    world.halt_all({ident: 9 for ident in SURVIVORS})
    world.incidents.tick(inc.deadline + 3600)  # waiting for a standby is not being stuck
    assert inc.state == IncidentState.HALTING and inc.waiting_standby and not world.sent_of(p.Recover)
    assert not world.sent_of(p.Assign) and len(world.events(Event.RECOVERY_WAITING)) == 1

    world.reg.add_node("s9")  # tmctl standby add: its processes come up and register
    add_node_workers(world.reg, "s9")
    world.incidents.tick(0.0)
    assert not inc.waiting_standby and inc.standbys == {"n2": "s9"}
    assert world.reg.nodes["s9"].role == NodeRole.JOINING
    assert world.events(Event.STANDBY_PROMOTED)[0]["standby"] == "s9"
    assert world.events(Event.RECOVERY_STANDBY_FOUND)[0]["standbys"] == {"n2": "s9"}
    assert [(ident, msg.rank) for ident, msg in world.sent_of(p.Assign)] == [("s9/0", 2), ("s9/1", 3)]
    assert inc.deadline > 0.0 and not inc.overdue(0.0)  # a fresh deadline from the promotion
    # the survivors halted long ago: the plan goes out with the promotion, the replacements warm meanwhile
    assert inc.state == IncidentState.RECOVERING and len(world.sent_of(p.Recover)) == 6


def test_survivors_more_than_one_step_apart_cannot_recover(world):
    world.incidents.on_node_failed("n2", "exited")
    world.report("s1/0", RecoveryPhase.WARMED)
    world.report("s1/1", RecoveryPhase.WARMED)
    with pytest.raises(RecoveryError, match="survivors disagree by more than one step"):
        world.halt_all({"n1/0": 9, "n1/1": 9, "n3/0": 9, "n3/1": 7})
    inc = world.incidents.all[-1]
    assert inc.state == IncidentState.FAILED and not world.sent_of(p.Recover)
    assert world.events(Event.RECOVERY_FAILED)[0]["state"] == IncidentState.HALTING


def test_a_rank_lost_before_its_recording_exists_cannot_be_replaced(tmp_path):
    world = World(tmp_path, recorded=[0, 1, 3, 4, 5])
    with pytest.raises(RecoveryError, match=r"ranks \[2\] were lost before the job recorded"):
        world.incidents.on_node_failed("n2", "exited")
    assert world.incidents.current is None and not world.sent_of(p.Halt)


def test_every_rank_lost_cannot_recover(world):
    world.incidents.on_node_failed("n1", "exited")
    world.incidents.on_node_failed("n2", "exited")
    with pytest.raises(RecoveryError, match="every rank is lost"):
        world.incidents.on_node_failed("n3", "exited")


@pytest.mark.parametrize("stuck_in", [IncidentState.HALTING, IncidentState.RECOVERING])
def test_an_incident_past_its_deadline_fails_naming_the_state_it_was_stuck_in(world, stuck_in):
    world.incidents.on_node_failed("n2", "exited")
    inc = world.incidents.current
    if stuck_in == IncidentState.RECOVERING:
        world.report("s1/0", RecoveryPhase.WARMED)
        world.report("s1/1", RecoveryPhase.WARMED)
        world.halt_all({ident: 9 for ident in SURVIVORS})
    assert inc.state == stuck_in
    world.incidents.tick(inc.deadline - 1)
    assert inc.state == stuck_in
    with pytest.raises(RecoveryError) as e:
        world.incidents.tick(inc.deadline + 1)
    assert str(e.value) == f"recovery 1 stuck in {stuck_in} for {RECOVERY_TIMEOUT_S:.0f} s"
    assert inc.state == IncidentState.FAILED and inc.finished and world.incidents.current is None
    failed = world.events()[-1]
    assert failed["event"] == Event.RECOVERY_FAILED and failed["state"] == stuck_in and failed["incident_id"] == 1


def test_a_failed_recovered_report_starts_a_new_incident(world):
    world.incidents.on_node_failed("n2", "exited")
    first = world.incidents.current
    world.report("s1/0", RecoveryPhase.WARMED)
    world.report("s1/1", RecoveryPhase.WARMED)
    world.halt_all({ident: 9 for ident in SURVIVORS})
    assert first.state == IncidentState.RECOVERING
    world.sent.clear()
    world.report("n3/1", RecoveryPhase.RECOVERED, ok=False, error="ChecksumError: state refused")
    second = world.incidents.current
    assert first.state == IncidentState.SUPERSEDED and second.id == 2 and second.state == IncidentState.HALTING
    assert second.reason == "rank 5 failed to recover: ChecksumError: state refused"
    assert {msg.incident_id for _, msg in world.sent_of(p.Halt)} == {2}
    assert second.standbys == {"n2": "s1"} and not world.sent_of(p.Assign)  # the warm replacements are kept
    world.halt_all({ident: 9 for ident in SURVIVORS}, incident_id=2)
    assert second.state == IncidentState.RECOVERING  # replacements still warm for their ranks: plan at once
    assert second.generation == 2  # a new generation: a store prefix is never reused


def test_the_warm_joiners_of_a_migration_whose_leaver_died_are_adopted(world):
    migs = Migrations(world.reg, world.journal, world.channel, record_steps=3)
    m = migs.request("n2", "s1")
    for ident in ("s1/0", "s1/1"):
        w = world.w(ident)
        migs.on_phase(w, p.PhaseDone(migration_id=m.id, rank=w.rank, phase=MigrationPhase.WARMED, ok=True, error="",
                                     step=-1, bytes_moved=0, seconds=0.0, groups=[]))
    world.sent.clear()
    # what the daemon does when a leaver's node dies after phase 1 started
    world.w("n2/0").exited = world.w("n2/1").exited = True
    world.incidents.on_node_failed("n2", "exited", adopt=migs.on_node_failed("n2", "exited"))
    assert m.state == MigrationState.ABORTED
    assert {ident for ident, _ in world.sent_of(p.Decide)} == set(SURVIVORS)  # not the dead leavers, not the joiners
    inc = world.incidents.current
    assert inc.standbys == {"n2": "s1"} and world.events(Event.RECOVERY_STARTED)[0]["adopted"] == {"n2": "s1"}
    assert world.reg.nodes["s1"].role == NodeRole.JOINING and world.reg.nodes["s2"].role == NodeRole.STANDBY
    assert not world.sent_of(p.Assign) and not world.events(Event.STANDBY_PROMOTED)
    assert inc.replacements == {2: world.w("s1/0"), 3: world.w("s1/1")}
    world.halt_all({ident: 9 for ident in SURVIVORS})
    assert inc.state == IncidentState.RECOVERING  # the joiners warmed for exactly these ranks already
    for ident in SURVIVORS + ["s1/0", "s1/1"]:
        world.report(ident, RecoveryPhase.RECOVERED)
    assert world.reg.nodes["s1"].role == NodeRole.ACTIVE and world.reg.nodes["s1"].ranks == [2, 3]


def test_an_unexplained_collective_failure_regroups_every_rank(world):
    world.report("n1/0", RecoveryPhase.COLLECTIVE_FAILED, incident_id=0, error="connection reset")
    assert world.incidents.current is None
    world.incidents.tick(math.inf)
    inc = world.incidents.current
    assert inc.lost == {} and sorted(inc.survivors) == [0, 1, 2, 3, 4, 5] and not inc.standbys
    assert inc.reason == "rank 0 saw a collective fail: connection reset; no node failed, regrouping"
    world.halt_all({f"{n}/{lr}": 9 for n in NODES for lr in range(2)})
    assert inc.state == IncidentState.RECOVERING and world.sent_of(p.Recover)[0][1].sends == []


def test_a_refused_job_regroups_no_more(world):
    """tmd.faults' refusal (a rank reported a process group created after the recorded steps, which joiners lack)
    stops a regroup after a collective failure too: each one's setup waited for the store's timeout, incident after
    incident (outside review m01)."""
    world.incidents.refusal = lambda: "rank 0 on n1 reported late_group: process group pg2 was created at step 8"
    world.report("n1/0", RecoveryPhase.COLLECTIVE_FAILED, incident_id=0, error="connection reset")
    with pytest.raises(RecoveryError, match=r"cannot recover \(rank 0 saw a collective fail: connection reset; no "
                                            r"node failed, regrouping\): rank 0 on n1 reported late_group: process "
                                            r"group pg2 was created at step 8"):
        world.incidents.tick(math.inf)
    assert world.incidents.current is None and not world.sent_of(p.Halt)


# --- replica classes and buddy snapshots ------------------------------------------------------------------------------
# HSDP: replicas across nodes
ACROSS = {0: [0, 2, 4], 2: [0, 2, 4], 4: [0, 2, 4], 1: [1, 3, 5], 3: [1, 3, 5], 5: [1, 3, 5]}
IN_NODE = {r: [r - r % 2, r - r % 2 + 1] for r in range(6)}  # e.g. a pipeline stage per node, replicated in the node
ALONE = {r: [r] for r in range(6)}  # pure FSDP: no rank has a replica


def test_replica_reports_give_each_rank_its_class_and_sources_come_from_it_only(world):
    world.incidents.on_replicas(world.w("n1/0"), p.ReplicaReport(rank=0, replicas=[4, 2, 0, 2]))
    assert world.incidents.replicas == {0: [0, 2, 4], 2: [0, 2, 4], 4: [0, 2, 4]}
    assert world.incidents.sources_for(2, [0, 1, 4, 5]) == [0, 4]
    assert world.incidents.sources_for(3, [0, 1, 4, 5]) == [0, 1, 4, 5]  # no class known: every rank
    world.replicas(ACROSS)
    assert world.incidents.sources_for(3, [0, 1, 4, 5]) == [1, 5]
    assert not world.events(Event.NO_REPLICA) and world.incidents.keepers == {}

    world.incidents.on_node_failed("n2", "exited")
    world.report("s1/0", RecoveryPhase.WARMED)
    world.report("s1/1", RecoveryPhase.WARMED)
    world.halt_all({"n1/0": 9, "n1/1": 9, "n3/0": 9, "n3/1": 8})
    plan = world.sent_of(p.Recover)[0][1]
    # each receiver (the replacements, then rank 5, behind) gets its state from a survivor of its class
    assert plan.sends == [[0, 2], [1, 3], [1, 5]] and plan.rollback_step == -1 and plan.resume_step == 10
    assert all(src in ACROSS[dst] for src, dst in plan.sends)


def test_a_receiver_whose_class_has_no_survivor_that_committed_fails_the_incident(world):
    world.replicas(ACROSS)
    world.incidents.on_node_failed("n2", "exited")
    world.report("s1/0", RecoveryPhase.WARMED)
    world.report("s1/1", RecoveryPhase.WARMED)
    with pytest.raises(RecoveryError, match=r"no survivor that committed step 9 holds a replica of rank 3"):
        world.halt_all({"n1/0": 9, "n1/1": 8, "n3/0": 9, "n3/1": 8})  # ranks 1 and 5 (3's class) behind


@pytest.mark.parametrize("every, consequence", [
    (0, "a failure of {node} is not recoverable (no buddy snapshots)"),
    (5, "a failure of {node} rolls the job back to the last buddy snapshot (every 5 steps)"),
])
def test_a_rank_with_no_replica_off_its_node_is_journalled_once_per_node(tmp_path, every, consequence):
    world = World(tmp_path, snapshot_every=every)
    world.replicas({r: ranks for r, ranks in ALONE.items() if r < 5})
    assert not world.events(Event.NO_REPLICA)  # not every rank reported yet
    world.replicas(ALONE)
    world.replicas(ALONE)  # (a rank that reports again changes nothing)
    entries = world.events(Event.NO_REPLICA)
    assert [(e["rank"], e["node"]) for e in entries] == [(0, "n1"), (2, "n2"), (4, "n3")]
    assert entries[1]["message"] == "rank 2's state has no replica outside n2: " + consequence.format(node="n2")
    assert entries[1]["code"] == Event.NO_REPLICA
    assert [{k: e[k] for k in ("rank", "node", "code", "message")} for e in entries] == world.incidents.unprotected
    assert world.incidents.keepers == ({0: 2, 1: 3, 2: 4, 3: 5, 4: 0, 5: 1} if every else {})


def test_a_lost_rank_with_no_surviving_replica_and_no_snapshots_fails_at_start(tmp_path):
    world = World(tmp_path)
    world.replicas(IN_NODE)
    with pytest.raises(RecoveryError) as e:
        world.incidents.on_node_failed("n2", "exited with code -9")
    assert str(e.value) == ("the state of rank 2 has no surviving replica (n2: exited with code -9): ranks [2, 3] "
                            "held its only copies and buddy snapshots are off")
    assert world.incidents.current is None and not world.sent_of(p.Halt) and not world.sent_of(p.Assign)


def rolled_back_world(tmp_path, classes=ALONE):
    world = World(tmp_path, snapshot_every=5)
    world.replicas(classes)
    world.incidents.on_node_failed("n2", "exited")
    world.report("s1/0", RecoveryPhase.WARMED)
    world.report("s1/1", RecoveryPhase.WARMED)
    return world


@pytest.mark.parametrize("classes", [ALONE, IN_NODE])
def test_with_snapshots_a_lost_rank_with_no_replica_rolls_the_job_back(tmp_path, classes):
    world = rolled_back_world(tmp_path, classes)
    inc = world.incidents.current
    assert inc.state == IncidentState.HALTING and sorted(inc.replacements) == [2, 3]
    # rank 5's round 9 has not completed (and rank 0 holds an older one too): 4 is the newest step all hold
    held = {"n1/0": [0, 4, 9], "n1/1": [4, 9], "n3/0": [4, 9], "n3/1": [4]}
    world.halt_all({"n1/0": 11, "n1/1": 11, "n3/0": 11, "n3/1": 10}, snapshots=held)
    assert inc.snapshots == {0: [0, 4, 9], 1: [4, 9], 4: [4, 9], 5: [4]}
    assert inc.state == IncidentState.RECOVERING and inc.rollback_step == 4 and inc.resume_step == 5
    plans = world.sent_of(p.Recover)
    assert sorted(ident for ident, _ in plans) == sorted(SURVIVORS + ["s1/0", "s1/1"])
    plan = plans[0][1]
    # each lost rank gets the copy its keeper (same position on the next node, n3) holds; survivors restore theirs
    assert plan.sends == [[4, 2], [5, 3]] and plan.rollback_step == 4 and plan.resume_step == 5
    assert world.events(Event.RECOVERY_PLAN)[0]["rollback_step"] == 4
    for ident in SURVIVORS + ["s1/0", "s1/1"]:
        world.report(ident, RecoveryPhase.RECOVERED, committed_step=4)
    assert inc.state == IncidentState.RECOVERED and inc.to_dict()["rollback_step"] == 4


def test_survivors_with_no_common_snapshot_fail_the_incident_with_the_reason(tmp_path):
    world = rolled_back_world(tmp_path)
    inc = world.incidents.current
    with pytest.raises(RecoveryError) as e:
        world.halt_all({ident: 11 for ident in SURVIVORS},
                       snapshots={"n1/0": [9], "n1/1": [9], "n3/0": [9], "n3/1": []})
    assert str(e.value) == ("ranks [2, 3] have no surviving replica and the survivors hold no common buddy snapshot "
                            "({0: [9], 1: [9], 4: [9], 5: []})")
    assert inc.state == IncidentState.FAILED and not world.sent_of(p.Recover)
    assert world.events(Event.RECOVERY_FAILED)[0]["reason"] == str(e.value)


def test_a_rollback_is_refused_at_start_when_a_keeper_is_lost_too(tmp_path):
    world = World(tmp_path, standbys=("s1", "s2", "s3"), snapshot_every=5)
    world.replicas(ALONE)
    world.incidents.on_node_failed("n2", "exited")  # ranks 2, 3: kept on n3
    with pytest.raises(RecoveryError) as e:
        world.incidents.on_node_failed("n3", "exited")  # and with it the copies of 2 and 3
    assert str(e.value) == ("the state of rank 2 has no surviving replica (n3: exited): ranks [2] held its only "
                            "copies; rank 4 kept its snapshot and is lost too")


def test_a_rollback_is_refused_at_start_when_a_replicated_rank_s_keeper_is_lost(tmp_path):
    """Rank 0 has a surviving replica (rank 4), but a rollback restores every lost rank from its keeper (rank 4
    holds its own state of the step, not a snapshot kept for rank 0): with that keeper lost too, no plan could."""
    world = World(tmp_path, standbys=("s1", "s2", "s3"), snapshot_every=5)
    world.replicas({0: [0, 4], 4: [0, 4], 1: [1, 5], 5: [1, 5], 2: [2], 3: [3]})  # keepers: 0 -> 2, 2 -> 4
    world.incidents.on_node_failed("n1", "exited")  # ranks 0, 1 have replicas on n3: no rollback
    assert world.incidents.current.state == IncidentState.HALTING
    with pytest.raises(RecoveryError) as e:
        world.incidents.on_node_failed("n2", "exited")  # rank 2 has none: a rollback, but 0's keeper is gone
    assert str(e.value) == ("rank 2's state has no surviving replica (n2: exited): the job must roll back, but rank "
                            "2, which kept rank 0's snapshot, is lost too")


def test_a_party_failing_to_recover_again_and_again_ends_the_job(world):
    """A party whose recovery fails the same way every time would start incidents forever: after
    MAX_FAILED_RECOVERIES in a row the job fails with the error; one that finishes resets the count."""
    from tmd.recovery import MAX_FAILED_RECOVERIES

    world.incidents.on_node_failed("n2", "exited")
    world.report("s1/0", RecoveryPhase.WARMED)
    world.report("s1/1", RecoveryPhase.WARMED)
    for n in range(1, MAX_FAILED_RECOVERIES + 1):
        inc = world.incidents.current
        world.halt_all({ident: 9 for ident in SURVIVORS}, incident_id=inc.id)
        assert inc.state == IncidentState.RECOVERING
        if n < MAX_FAILED_RECOVERIES:
            world.report("n3/1", RecoveryPhase.RECOVERED, ok=False, error="ValueError: same every time",
                         incident_id=inc.id)
            assert world.incidents.current.id == inc.id + 1
    with pytest.raises(RecoveryError, match=f"same every time \\({MAX_FAILED_RECOVERIES} incidents in a row"):
        world.report("n3/1", RecoveryPhase.RECOVERED, ok=False, error="ValueError: same every time",
                     incident_id=inc.id)
    assert inc.state == IncidentState.FAILED and world.events()[-1]["event"] == Event.RECOVERY_FAILED


def test_with_standby_wait_s_an_incident_without_a_standby_fails_for_the_checkpoint_tier(tmp_path):
    world = World(tmp_path, standbys=())
    world.incidents.standby_wait_s = 30.0
    world.incidents.on_node_failed("n2", "exited")
    inc = world.incidents.current
    world.halt_all({ident: 9 for ident in SURVIVORS})
    world.incidents.tick(inc.waiting_since + 29.0)  # still waiting
    assert inc.state == IncidentState.HALTING
    with pytest.raises(RecoveryError, match=r"no standby arrived within 30 s \(--standby-wait-s\)"):
        world.incidents.tick(inc.waiting_since + 31.0)
    assert inc.state == IncidentState.FAILED and world.events(Event.RECOVERY_FAILED)


def test_an_incident_whose_survivors_all_exited_fails_instead_of_waiting_for_a_standby_forever(tmp_path):
    """The lost node died at the job's last step: the survivors finished it and exited. No standby can be given the
    state any more, so the incident fails (the checkpoint tier may restart the job) instead of waiting forever."""
    world = World(tmp_path, standbys=())
    world.incidents.on_node_failed("n2", "exited")
    inc = world.incidents.current
    assert inc.waiting_standby
    world.incidents.tick(0.0)
    assert inc.state == IncidentState.HALTING  # one survivor left is enough to wait on
    for ident in SURVIVORS:
        world.w(ident).done = world.w(ident).exited = True
    with pytest.raises(RecoveryError, match=r"every surviving rank \(0, 1, 4, 5\) exited before incident 1 could "
                                            r"finish: nothing is left to recover ranks \[2, 3\] from"):
        world.incidents.tick(0.0)
    assert inc.state == IncidentState.FAILED and world.events(Event.RECOVERY_FAILED)[0]["state"] == "halting"

"""Guards (tmd.guards) with the recovery state machine: where and when a guard is placed, its adoption by the
recovery of the node it guards (no Assign, no warm-up to wait for), its release when a failure elsewhere finds no
general standby, and the roles it moves through. No processes: the World of test_recovery (3 nodes x 2 ranks,
fake recordings, a channel that records what would be sent)."""
import pytest

from tmd import protocol as p
from tmd.guards import Guards, warm_guard
from tmd.migration import MigrationError, Migrations
from tmd.protocol.vocab import ErrorCode, Event, ExitCode, Health, IncidentMark, NodeRole, RecoveryPhase
from tmd.status import node_status
from tests.unit.test_recovery import World

pytestmark = pytest.mark.timeout(10)


class Guarded(World):
    def __init__(self, tmp_path, count=1, standbys=("s1", "s2"), suspects=(), **kw):
        super().__init__(tmp_path, standbys=standbys, **kw)
        for n in self.reg.nodes.values():
            n.health = Health.HEALTHY
        self.suspect_names = set(suspects)
        self.guards = Guards(self.reg, self.journal, self.channel, self.run_dir, count, record_steps=3,
                             suspects=lambda: set(self.suspect_names))
        self.incidents.free_standby = self.guards.free_one

    def warm(self, node):
        for w in self.reg.nodes[node].workers.values():
            assert self.guards.on_warmed(w, p.RecoveryReport(
                incident_id=0, rank=w.rank, phase=RecoveryPhase.WARMED, ok=True, error="", committed_step=-1,
                bytes_moved=0, seconds=0.0, shadow_steps=2), now_s=105.0)

    def fail(self, node):
        adopt = self.guards.adopt(self.reg.nodes[node])
        self.incidents.on_node_failed(node, "exited with code -9", adopt)


def test_a_guard_is_placed_once_the_job_trains_and_its_ranks_are_recorded(tmp_path):
    world = Guarded(tmp_path, recorded=[2, 3, 4, 5])  # n1's ranks (0, 1) have no recording yet
    world.guards.tick(busy=True, now_s=100.0)
    assert world.sent == []  # a migration or incident runs: nothing placed
    for w in world.reg.rank_owner.values():
        w.step = 3  # still recording its first 3 steps
    world.guards.tick(busy=False, now_s=100.0)
    assert world.sent == []
    for w in world.reg.rank_owner.values():
        w.step = 10
    world.guards.tick(busy=False, now_s=100.0)
    s1 = world.reg.nodes["s1"]
    assert s1.role == NodeRole.GUARDING and s1.guards == [2, 3]  # n1 has no recording: n2 is the first that fits
    assert [(ident, m.rank, m.guard, m.migration_id, m.incident_id) for ident, m in world.sent_of(p.Assign)] == \
        [("s1/0", 2, True, 0, 0), ("s1/1", 3, True, 0, 0)]
    assert world.events(Event.GUARD_ASSIGNED)[0]["node"] == "n2"
    world.guards.tick(busy=False, now_s=101.0)
    assert len(world.sent_of(p.Assign)) == 2 and world.reg.nodes["s2"].role == NodeRole.STANDBY  # count 1

    assert not node_status(s1, 0.0, [])["warm"]
    world.warm("s1")
    assert warm_guard(s1) and node_status(s1, 0.0, [])["warm"]
    assert node_status(s1, 0.0, [])["guards"] == [2, 3]
    warmed = world.events(Event.GUARD_WARMED)
    assert len(warmed) == 1 and warmed[0]["warm_up_s"] == 5.0 and warmed[0]["shadow_steps"] == 2


def test_suspects_are_guarded_first(tmp_path):
    world = Guarded(tmp_path, count=2, suspects=["n3"])
    world.reg.nodes["n2"].health = Health.UNHEALTHY
    world.guards.tick(busy=False, now_s=100.0)
    assert (world.reg.nodes["s1"].guards, world.reg.nodes["s2"].guards) == ([2, 3], [4, 5])


def test_a_node_coming_under_suspicion_takes_the_guard_of_one_that_is_not(tmp_path):
    world = Guarded(tmp_path, standbys=("s1",))
    world.guards.tick(busy=False, now_s=100.0)
    assert world.reg.nodes["s1"].guards == [0, 1]
    world.guards.tick(busy=False, now_s=101.0)
    assert world.events(Event.GUARD_RELEASED) == []  # nobody under suspicion
    world.suspect_names.add("n3")
    world.guards.tick(busy=False, now_s=102.0)
    s1 = world.reg.nodes["s1"]
    assert s1.role == NodeRole.STANDBY and "n3 is under suspicion" in world.events(Event.GUARD_RELEASED)[0]["reason"]
    world.guards.tick(busy=False, now_s=103.0)  # its fresh processes are not up yet: nothing more happens
    assert len(world.events(Event.GUARD_RELEASED)) == 1 and s1.role == NodeRole.STANDBY
    s1.health = Health.HEALTHY  # (they came up)
    world.guards.tick(busy=False, now_s=104.0)
    assert s1.guards == [4, 5] and world.events(Event.GUARD_ASSIGNED)[-1]["suspect"] is True


def test_the_guarded_nodes_failure_adopts_the_warm_guard_without_an_assign(tmp_path):
    world = Guarded(tmp_path)
    world.guards.tick(busy=False, now_s=100.0)  # s1 guards n1 (ranks 0, 1)
    world.warm("s1")
    world.sent.clear()
    world.fail("n1")
    inc = world.incidents.current
    assert world.reg.nodes["s1"].role == NodeRole.JOINING and inc.standbys == {"n1": "s1"}
    assert world.sent_of(p.Assign) == []  # the guard holds its ranks already: nothing to assign, no warm-up
    assert world.reg.nodes["s2"].role == NodeRole.STANDBY  # the general standby stays free
    assert IncidentMark.WARMED in inc.phases
    world.halt_all({"n2/0": 9, "n2/1": 9, "n3/0": 9, "n3/1": 9})
    plans = world.sent_of(p.Recover)
    assert sorted(ident for ident, _ in plans) == ["n2/0", "n2/1", "n3/0", "n3/1", "s1/0", "s1/1"]
    assert world.events(Event.RECOVERY_STARTED)[0]["adopted"] == {"n1": "s1"}


def test_an_unhealthy_guard_is_released_not_adopted(tmp_path):
    world = Guarded(tmp_path)
    world.guards.tick(busy=False, now_s=100.0)
    world.warm("s1")
    world.reg.nodes["s1"].health, world.reg.nodes["s1"].reason = Health.UNHEALTHY, "no heartbeat for 5.0 s"
    world.fail("n1")
    assert world.incidents.current.standbys == {"n1": "s2"}  # the general standby, with a warm-up
    assert world.reg.nodes["s1"].role == NodeRole.STANDBY and world.events(Event.GUARD_RELEASED)
    assert [m.rank for _, m in world.sent_of(p.Assign) if not m.guard] == [0, 1]


def test_a_guard_still_warming_is_adopted_and_warms_for_the_incident(tmp_path):
    world = Guarded(tmp_path)
    world.guards.tick(busy=False, now_s=100.0)
    world.fail("n1")
    inc = world.incidents.current
    assert inc.standbys == {"n1": "s1"} and IncidentMark.WARMED not in inc.phases
    assert not world.guards.on_warmed(world.w("s1/0"), p.RecoveryReport(
        incident_id=0, rank=0, phase=RecoveryPhase.WARMED, ok=True, error="", committed_step=-1, bytes_moved=0,
        seconds=0.0), now_s=101.0)  # no longer a guard: the incident takes the report
    world.report("s1/0", RecoveryPhase.WARMED, incident_id=0)
    world.report("s1/1", RecoveryPhase.WARMED, incident_id=0)
    assert IncidentMark.WARMED in inc.phases


def test_a_failure_elsewhere_with_no_general_standby_releases_a_guard(tmp_path):
    world = Guarded(tmp_path, standbys=("s1",))
    world.guards.tick(busy=False, now_s=100.0)
    world.warm("s1")
    world.sent.clear()
    world.fail("n2")  # s1 guards n1, not n2
    inc = world.incidents.current
    s1 = world.reg.nodes["s1"]
    assert inc.waiting_standby and s1.role == NodeRole.STANDBY and s1.guards == []
    releases = world.sent_of(p.Release)
    assert sorted(i for i, _ in releases) == ["s1/0", "s1/1"] and all(r.exit_code == ExitCode.OK for _, r in releases)
    assert world.events(Event.GUARD_RELEASED)[0]["ranks"] == [0, 1]
    # its fresh processes register: the incident promotes it as a general standby
    s1.workers.clear()
    for lr in range(2):
        world.reg.add_worker(type(world.w("n1/0"))(f"s1/{lr}b".encode(), "s1", lr, 200, "h"))
    world.incidents.tick(0.0)
    assert inc.standbys == {"n2": "s1"} and [m.rank for _, m in world.sent_of(p.Assign)] == [2, 3]


def test_a_guard_whose_ranks_no_node_holds_is_released_and_none_is_placed_while_busy(tmp_path):
    world = Guarded(tmp_path)
    world.guards.tick(busy=False, now_s=100.0)
    world.reg.nodes["s1"].guards = [0, 9]  # (what a layout change would leave)
    world.guards.tick(busy=True, now_s=101.0)
    assert world.reg.nodes["s1"].role == NodeRole.GUARDING  # not while a migration or incident runs
    world.guards.tick(busy=False, now_s=102.0)
    assert world.events(Event.GUARD_RELEASED)[0]["standby"] == "s1"
    assert world.reg.nodes["s2"].role == NodeRole.GUARDING and world.reg.nodes["s2"].guards == [0, 1]


def test_a_guard_is_a_migration_target_only_for_its_node_once_warm(tmp_path):
    world = Guarded(tmp_path)
    world.guards.tick(busy=False, now_s=100.0)  # s1 guards n1 (ranks 0, 1)
    migs = Migrations(world.reg, world.journal, world.channel, record_steps=3)
    for source in ("n1", "n2"):  # warming: not yet; another node's: never
        with pytest.raises(MigrationError) as e:
            migs.request(source, "s1")
        assert e.value.code == ErrorCode.BUSY_STANDBY and "guarding ranks [0, 1]" in str(e.value)
        assert world.reg.nodes["s1"].role == NodeRole.GUARDING and migs.current is None
    world.warm("s1")
    world.sent.clear()
    m = migs.request("n1", "s1")
    assert world.sent_of(p.Assign) == []  # warm for these ranks already: phase 1 starts at once
    prepares = {ident: msg for ident, msg in world.sent_of(p.Prepare)}
    assert sorted(prepares) == ["n1/0", "n1/1", "n2/0", "n2/1", "n3/0", "n3/1", "s1/0", "s1/1"]
    assert prepares["s1/1"].role == p.MigrationRole.JOINER and prepares["s1/1"].migration_id == m.id
    assert {r: w.identity for r, w in m.joiners.items()} == {0: b"s1/0", 1: b"s1/1"}
    assert world.reg.nodes["s1"].role == NodeRole.JOINING
    assert world.events(Event.MIGRATION_REQUESTED)[0]["guards"] == ["s1"]


def test_roles_only_move_by_the_rules(tmp_path):
    world = Guarded(tmp_path)
    world.guards.tick(busy=False, now_s=100.0)
    with pytest.raises(ValueError, match="cannot guard with node 's1': it is guarding, not standby"):
        world.reg.guard(world.reg.nodes["s1"], [2, 3])
    with pytest.raises(ValueError, match="2 processes: it cannot guard 3 ranks"):
        world.reg.guard(world.reg.nodes["s2"], [2, 3, 4])
    assert world.guards.adopt(world.reg.nodes["n2"]) is None  # n2 has no guard


def test_guards_off_by_default(tmp_path):
    world = Guarded(tmp_path, count=0)
    world.guards.tick(busy=False, now_s=100.0)
    assert world.sent == [] and world.reg.nodes_in(NodeRole.GUARDING) == []


def test_guards_of_ranks_whose_guards_keep_dying_stop(tmp_path):
    # (a script that fails in the sandbox for those ranks would otherwise restart guards forever)
    world = Guarded(tmp_path, standbys=("s1",))
    s1 = world.reg.nodes["s1"]
    for attempt in range(2):
        world.guards.tick(busy=False, now_s=100.0 + attempt)
        assert s1.role == NodeRole.GUARDING and s1.guards == [0, 1]
        world.guards.lost(s1, "s1/0 exited with code 1")
        assert s1.role == NodeRole.STANDBY
        s1.health = Health.HEALTHY  # (fresh processes came up)
    assert "ranks [0, 1] get no guard any more" in world.events(Event.GUARD_RELEASED)[-1]["reason"]
    world.guards.tick(busy=False, now_s=110.0)
    assert s1.guards == [2, 3]  # the next node instead


def test_a_failure_without_a_standby_frees_a_useless_guard_first(tmp_path):
    world = Guarded(tmp_path, count=2, standbys=("s1", "s2"))
    world.guards.tick(busy=False, now_s=100.0)  # s1: n1 (0, 1), s2: n2 (2, 3)
    world.reg.nodes["s2"].guards = [8, 9]  # ranks no node holds (what a layout change would leave)
    assert world.guards.free_one("needed")
    assert world.reg.nodes["s2"].role == NodeRole.STANDBY and world.reg.nodes["s1"].role == NodeRole.GUARDING


def test_an_evacuation_goes_to_the_nodes_warm_guard_first(tmp_path):
    from types import SimpleNamespace

    from tmd.evacuation import Evacuation

    world = Guarded(tmp_path)
    world.guards.tick(busy=False, now_s=100.0)  # s1 guards n1; s2 is a general standby
    migs = Migrations(world.reg, world.journal, world.channel, record_steps=3)
    control = SimpleNamespace(registry=world.reg, journal=world.journal, current_migration=None,
                              current_incident=None, request_migration=lambda s, t, require_healthy: migs.request(
                                  s, t, require_healthy=require_healthy))
    evacuation = Evacuation(control)
    evacuation.evacuate(world.reg.nodes["n2"], "rank 3 is a straggler")  # n2 has no guard: the general standby
    assert world.events(Event.EVACUATION_STARTED)[-1]["standby"] == "s2"
    migs.abort(migs.current, "(this test)")
    world.warm("s1")
    evacuation.evacuate(world.reg.nodes["n1"], "an unhealthy GPU")
    assert world.events(Event.EVACUATION_STARTED)[-1]["standby"] == "s1"  # warm for n1 already


def test_a_stragglers_evacuation_skipped_for_want_of_a_standby_is_tried_again_once_one_is_warm(tmp_path):
    """Outside test with --migrate-stragglers --guards 1: when rank 3 was flagged the only standby guarded n1
    (evacuation_skipped); the guard then moved to n2 and warmed, but nothing tried again: n2 stayed slow."""
    from types import SimpleNamespace

    from tmd.evacuation import Evacuation
    from tmd.registry import Worker

    world = Guarded(tmp_path, standbys=("s1",))
    world.guards.tick(busy=False, now_s=100.0)  # s1 guards n1: no general standby
    migs = Migrations(world.reg, world.journal, world.channel, record_steps=3)
    control = SimpleNamespace(registry=world.reg, journal=world.journal, current_migration=None,
                              current_incident=None, request_migration=lambda s, t, require_healthy: migs.request(
                                  s, t, require_healthy=require_healthy))
    flagged = SimpleNamespace(flagged={3}, lateness={3: 0.9}, reset=lambda now: None, new=[3])
    flagged.evaluate = lambda now: (flagged.new, [])
    evacuation = Evacuation(control, migrate_stragglers=True, stragglers=flagged)
    evacuation.tick(200.0)
    assert [e["why"] for e in world.events(Event.EVACUATION_SKIPPED)] == ["no warm standby"]
    flagged.new = []
    evacuation.tick(200.1)
    assert world.events(Event.EVACUATION_STARTED) == [] and len(world.events(Event.EVACUATION_SKIPPED)) == 1
    world.reg.add_node("s9")  # a standby comes and warms
    for lr in range(2):
        world.reg.add_worker(Worker(f"s9/{lr}".encode(), "s9", lr, 900 + lr, "h"))
    evacuation.tick(200.2)
    (started,) = world.events(Event.EVACUATION_STARTED)
    assert started["node"] == "n2" and started["standby"] == "s9" and started["reason"] == "rank 3 is a straggler"

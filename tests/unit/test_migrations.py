"""The migration state machine on its own: what tmd sends, in which state, and when it aborts."""
import math

import pytest

from tmd import protocol as p
from tmd.journal import Journal
from tmd.migration import MigrationError, Migrations
from tmd.registry import Registry, Worker

pytestmark = pytest.mark.timeout(10)


@pytest.fixture
def world():
    reg = Registry(["n1", "n2"], 2, ["s1"])
    for node in ("n1", "n2", "s1"):
        for lr in range(2):
            reg.add_worker(Worker(f"{node}/{lr}".encode(), node, lr, 100, "h"))
    for rank, w in reg.rank_owner.items():
        w.step = 10
        for s in range(1, 10):
            reg.record_step(rank, s, 0.1)
    sent: list[tuple[str, p.Message]] = []
    journal = Journal(None)
    migs = Migrations(reg, journal, RecordingChannel(sent), record_steps=3)
    return reg, migs, sent, journal


def ack(migs, reg, who, phase, mid=1, step=-1, ok=True, error=""):
    for ident in who:
        w = reg.by_identity[ident.encode()]
        migs.on_phase(w, p.PhaseDone(migration_id=mid, rank=w.rank if w.rank is not None else -1, phase=phase, ok=ok, error=error, step=step, bytes_moved=10, seconds=0.01, groups=[]))


class RecordingChannel:
    """A WorkerChannel that keeps what would be sent: (identity, message)."""

    def __init__(self, sent):
        self.sent = sent

    def send(self, w, msg):
        self.sent.append((w.identity.decode(), msg))

    def assign(self, w, rank, *, migration_id=0, incident_id=0):
        self.send(w, p.Assign(role=p.WorkerRole.JOINER, rank=rank, world_size=4, store_host="", store_port=0,
                              generation=1, record_steps=3, record_dir="", migration_id=migration_id,
                              incident_id=incident_id))


ALL = ["n1/0", "n1/1", "n2/0", "n2/1", "s1/0", "s1/1"]


def test_happy_path_messages_and_states(world):
    reg, migs, sent, _ = world
    m = migs.request("n2", "s1")
    assert m.state == "warming" and sorted(m.leavers) == [2, 3]
    assert [(w, msg.rank) for w, msg in sent] == [("s1/0", 2), ("s1/1", 3)]  # joiners take the leavers' ranks
    sent.clear()
    ack(migs, reg, ["s1/0", "s1/1"], "warmed")
    prepares = {w: msg for w, msg in sent}
    assert set(prepares) == set(ALL)
    assert prepares["n1/0"].role == "stayer" and prepares["n2/1"].role == "leaver" and prepares["s1/1"].role == "joiner"
    assert prepares["n2/1"].transfer_prefix == prepares["s1/1"].transfer_prefix != prepares["s1/0"].transfer_prefix
    assert all(msg.leaver_ranks == [2, 3] for msg in prepares.values())
    sent.clear()
    ack(migs, reg, ALL, "prepared")
    assert m.state == "prepared"
    switch = {msg.step for _, msg in sent if isinstance(msg, p.Switch)}
    assert switch == {10 + 2 + math.ceil(0.5 / 0.1)}  # current step + margin from the median step time
    ack(migs, reg, ALL, "armed", step=11)
    assert m.state == "switching"
    sent.clear()
    ack(migs, reg, ["s1/0", "s1/1"], "transferred")
    assert m.state == "transferred" and m.bytes_moved == 20
    assert {w for w, msg in sent if isinstance(msg, p.Decide) and msg.commit} == set(ALL)
    ack(migs, reg, ["s1/0", "s1/1"], "committed")
    assert m.state == "committed"
    assert reg.nodes["s1"].role == "active" and reg.nodes["s1"].ranks == [2, 3] and reg.nodes["n2"].role == "left"
    assert reg.rank_owner[2].identity == b"s1/0"


def test_requests_that_are_refused_change_nothing(world):
    reg, migs, sent, _ = world
    for args, code in [(("n9", "s1"), "unknown_node"), (("s1", "s1"), "unknown_node"), (("n2", "s9"), "unknown_standby"),
                       (("n2", "n1"), "unknown_standby")]:
        with pytest.raises(MigrationError) as e:
            migs.request(*args)
        assert e.value.code == code
    reg.nodes["s1"].workers[1].exited = True
    with pytest.raises(MigrationError, match="standby 's1' is busy"):
        migs.request("n2", "s1")
    reg.nodes["s1"].workers[1].exited = False
    migs.request("n2", "s1")
    with pytest.raises(MigrationError, match="still warming") as e:
        migs.request("n1", "s1")
    assert e.value.code == "migration_running"
    assert len(migs.all) == 1 and not [m for _, m in sent if isinstance(m, p.Prepare)]


def test_a_rank_already_past_the_switch_step_aborts_before_anyone_switches(world):
    reg, migs, sent, _ = world
    m = migs.request("n2", "s1")
    ack(migs, reg, ["s1/0", "s1/1"], "warmed")
    ack(migs, reg, ALL, "prepared")
    sent.clear()
    w = reg.by_identity[b"n1/0"]
    migs.on_phase(w, p.PhaseDone(migration_id=1, rank=0, phase="armed", ok=False, error="already at step 99", step=99, bytes_moved=0, seconds=0.0, groups=[]))
    assert m.state == "aborted" and "already at step 99" in m.reason
    assert {ident for ident, msg in sent if isinstance(msg, p.Decide) and not msg.commit} == set(ALL)
    assert reg.nodes["s1"].role == "standby" and reg.rank_owner[2].identity == b"n2/0"


def test_checksum_failure_and_deadline_abort(world):
    reg, migs, sent, _ = world
    m = migs.request("n2", "s1")
    ack(migs, reg, ["s1/0"], "transferred", ok=False, error="ChecksumError: state refused")
    assert m.state == "aborted" and "ChecksumError" in m.reason
    m2 = migs.request("n2", "s1") if reg.nodes["s1"].warm else None
    assert m2 is None  # aborted joiners exit; the standby must come back warm first
    reg.nodes["s1"].health = "healthy"
    m2 = migs.request("n2", "s1")
    migs.tick(m2.deadline + 1)
    assert m2.state == "aborted" and m2.reason.startswith("timed out in state warming")


def test_stale_reports_are_ignored(world):
    reg, migs, _, journal = world
    m = migs.request("n2", "s1")
    ack(migs, reg, ["s1/0"], "warmed", mid=7)
    assert m.state == "warming"
    assert journal.since(0, 100)[-1]["event"] == "stale_phase_report"


def test_stayer_pause_is_recorded_even_after_commit(world):
    reg, migs, _, _ = world
    m = migs.request("n2", "s1")
    ack(migs, reg, ["s1/0", "s1/1"], "warmed")
    ack(migs, reg, ALL, "prepared")
    ack(migs, reg, ALL, "armed", step=11)
    ack(migs, reg, ["s1/0", "s1/1"], "transferred")
    stayer = reg.by_identity[b"n1/0"]
    migs.on_phase(stayer, p.PhaseDone(migration_id=1, rank=0, phase="committed", ok=True, error="", step=16, bytes_moved=0, seconds=0.125, groups=[]))
    ack(migs, reg, ["s1/0", "s1/1"], "committed")
    assert m.state == "committed"
    late = reg.by_identity[b"n1/1"]  # reports after the migration committed: still counted
    migs.on_phase(late, p.PhaseDone(migration_id=1, rank=1, phase="committed", ok=True, error="", step=16, bytes_moved=0, seconds=0.25, groups=[]))
    assert m.to_dict()["pause_s"] == 0.25

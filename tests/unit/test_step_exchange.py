"""The per-step exchange on its own (worker.step_exchange): the exchange blob, replica classes learned from the first
exchange's fingerprints, the fingerprint check within a class, buddy snapshots agreed and taken at the agreed
steps, and a change to the RNG or a rank-local object after the update reported once. No processes: the world's
all-gather is a stub that answers with every rank's blob (tests.unit.rank_rooms)."""
import os

import pytest
import torch

from tmd import protocol as p
from worker import rank_state
from worker.control import Stage
from worker.snapshot import round_id
from worker.step_exchange import NO_FINGERPRINT, pack, unpack
from tests.unit.rank_rooms import (
    NODE_OF, Failed, World, blob, fp, fsdp_rank, loader_steps, make, one_step, trained, with_loader,
)

pytestmark = pytest.mark.timeout(10)


# --- the exchange blob ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("state", [b"", b"\x00\x01rank state", os.urandom(5000)])
def test_pack_unpack_round_trips(state):
    meta = {"node": "n\u00e9", "nonce": "ab", "held": [4, 9], "want": True}
    assert unpack(pack(fp(7), meta, state)) == (fp(7), meta, state)
    assert unpack(pack(NO_FINGERPRINT, {}, state)) == (NO_FINGERPRINT, {}, state)
    assert len(NO_FINGERPRINT) == rank_state.FINGERPRINT_BYTES


# --- replica classes and the fingerprint check --------------------------------------------------------------------
def test_classes_are_learned_from_equal_fingerprints_and_reported_once():
    rec = make(rank=1)
    rec.exchange.learn_classes({0: fp(1), 1: fp(2), 2: fp(1), 3: fp(2)}, NODE_OF)  # HSDP: replicate across nodes
    assert rec.exchange.classes == {0: [0, 2], 1: [1, 3], 2: [0, 2], 3: [1, 3]}
    assert rec.sent == [p.ReplicaReport(rank=1, replicas=[1, 3])]
    assert not rec.exchange.snapshots.enabled  # every class spans both nodes (and snapshots are off anyway)


def test_a_joiner_learning_classes_from_its_recording_reports_nothing_but_configures_snapshots():
    rec = make(rank=2, every=5, stage=Stage.SHADOW)
    rec.exchange.learn_classes({r: fp(r) for r in range(4)}, NODE_OF)  # FSDP: no rank has a replica
    assert rec.exchange.classes == {r: [r] for r in range(4)} and rec.sent == []
    assert rec.exchange.snapshots.enabled and (rec.exchange.snapshots.keeper, rec.exchange.snapshots.buddy) == (0, 0)


def test_verify_fails_the_job_on_a_mismatch_within_a_class_only():
    rec = make(rank=0)
    rec.exchange.classes = {0: [0, 2], 1: [1, 3], 2: [0, 2], 3: [1, 3]}
    rec.exchange.verify(5, {0: fp(1), 1: fp(2), 2: fp(1), 3: fp(3)})  # 1 and 3 differ: not rank 0's class
    assert rec.failures == []
    with pytest.raises(Failed):
        rec.exchange.verify(5, {0: fp(1), 1: fp(2), 2: fp(9), 3: fp(2)})
    ((kind, error),) = rec.failures
    assert kind == p.FailureKind.STATE_MISMATCH
    assert error == ("managed state differs between data-parallel replicas at step 5: ranks [0] agree with "
                     "rank 0, ranks [2] differ")


def test_verify_ignores_ranks_that_sent_no_fingerprint():
    rec = make(rank=0)
    rec.exchange.classes = {r: [0, 1, 2, 3] for r in range(4)}
    rec.exchange.verify(5, {0: fp(1), 3: fp(1)})  # ranks 1 and 2 not verifying this step (filtered by the caller)
    assert rec.failures == []


def test_before_classes_are_known_every_verifying_rank_is_one_class():
    rec = make(rank=0)
    with pytest.raises(Failed):
        rec.exchange.verify(0, {0: fp(1), 1: fp(2)})


def test_the_first_exchange_learns_the_classes_and_later_ones_send_no_fingerprint(monkeypatch):
    rec = make(rank=0)
    model, opt, sched = trained()
    rec.manage({"model": model, "optimizer": opt, "scheduler": sched}, rank_local=False)
    mine = rank_state.fingerprint(rec.ledger.replicated, rec.ledger.optimizers)
    world = World(rec, [None, blob(mine, "n1"), blob(mine, "n2"), blob(mine, "n2")], monkeypatch)
    one_step(rec, model, opt, sched, 0)
    assert world.calls[0][0] == mine and world.calls[0][1]["node"] == "n1"
    assert rec.exchange.classes == {r: [0, 1, 2, 3] for r in range(4)} and rec.ledger.committed_step == 0
    assert rec.sent == [p.ReplicaReport(rank=0, replicas=[0, 1, 2, 3])]
    assert rec.exchange.own_state(0, 0) == world.calls[0][2] and rec.exchange.own_state(0, 1) is None
    world.peers = [None] + [blob(NO_FINGERPRINT, n) for n in ("n1", "n2", "n2")]
    one_step(rec, model, opt, sched, 1)
    assert world.calls[1][0] == NO_FINGERPRINT and len(rec.sent) == 1 and rec.ledger.committed_step == 1


def test_a_replica_that_differs_at_the_first_step_after_a_recovery_fails_the_job(monkeypatch):
    rec = make(rank=0)
    model, opt, sched = trained()
    rec.manage({"model": model, "optimizer": opt}, rank_local=False)
    rec.exchange.classes = {r: [0, 1, 2, 3] for r in range(4)}
    rec.exchange.verify_next = True
    World(rec, [None, blob(fp(9), "n1"), blob(NO_FINGERPRINT, "n2"), blob(NO_FINGERPRINT, "n2")], monkeypatch)
    rec.control.set_step(3)
    rec.begin_step()
    model(torch.ones(1, 3)).sum().backward()
    with pytest.raises(Failed):
        opt.step()
    assert rec.failures[0][0] == p.FailureKind.STATE_MISMATCH and "ranks [1] differ" in rec.failures[0][1]


def test_a_snapshot_is_taken_at_the_agreed_steps_with_the_round_of_every_rank_s_nonce(monkeypatch):
    rec = make(rank=0, every=2)
    model, opt, sched = trained()
    rec.manage({"model": model, "optimizer": opt, "scheduler": sched}, rank_local=False)
    rec.exchange.classes = {r: [r] for r in range(4)}  # FSDP: no rank has a replica
    rec.exchange.snapshots.configure(NODE_OF, rec.exchange.classes)
    rounds = []
    monkeypatch.setattr(rec.exchange.snapshots, "_send", lambda snap, name: rounds.append(("send", snap.step, name)))
    monkeypatch.setattr(rec.exchange.snapshots, "_receive", lambda step, name: rounds.append(("receive", step, name)))
    peers = [None] + [blob(NO_FINGERPRINT, n, nonce=f"{r}") for r, n in ((1, "n1"), (2, "n2"), (3, "n2"))]
    world = World(rec, peers, monkeypatch)
    for step in range(4):
        one_step(rec, model, opt, sched, step)
        live = {"model": {k: v.clone() for k, v in model.state_dict().items()}, "scheduler": sched.state_dict()}
        if step == 1:
            at_one = live
    rec.begin_step()  # the next step's start
    nonces = [world.calls[1][1]["nonce"], "1", "2", "3"]
    assert sorted(r for r in rounds if r[1] == 1) == [("receive", 1, round_id(nonces)), ("send", 1, round_id(nonces))]
    assert sorted(rec.exchange.snapshots.own) == [1, 3] and len(rounds) == 4
    snap = rec.exchange.snapshots.own[1]
    assert snap.rank_state == world.calls[1][2]  # this rank's state sent in step 1's exchange
    assert all(torch.equal(snap.states["model"][k], v) for k, v in at_one["model"].items())
    # the snapshot of step S is the state a step S + 1 starts from: the scheduler stepped after the optimizer
    assert snap.states["scheduler"]["last_epoch"] == at_one["scheduler"]["last_epoch"] == 2
    assert snap.states["optimizer"]["param_groups"][0]["lr"] == pytest.approx(0.5 / 3)
    assert [c[1]["held"] for c in world.calls] == [[], [], [], []]  # no round completed (stubbed exchange)


def test_any_rank_wanting_a_snapshot_makes_the_next_commit_take_one(monkeypatch):
    rec, model, opt, sched = fsdp_rank(monkeypatch, 100)
    World(rec, [None, blob(NO_FINGERPRINT, "n1"), blob(NO_FINGERPRINT, "n2", want=True),
                blob(NO_FINGERPRINT, "n2")], monkeypatch)
    one_step(rec, model, opt, sched, 5)
    rec.begin_step()
    assert sorted(rec.exchange.snapshots.own) == [5]


def test_the_checkpoint_savers_statuses_are_read_from_the_exchange_of_the_step_just_committed(monkeypatch):
    """worker.checkpointing decides a save from them: every rank that committed a step holds the same."""
    rec = make(rank=0)
    model, opt, sched = trained()
    rec.manage({"model": model, "optimizer": opt, "scheduler": sched}, rank_local=False)
    rec.exchange.classes = {r: [0, 1] for r in range(2)}
    assert rec.exchange.saver_statuses(0) is None  # the job saves no checkpoints: nothing published
    rec.exchange.saver = lambda: [2, 0, 1]
    peer = pack(NO_FINGERPRINT, {"node": "n2", "nonce": "00", "held": [], "want": False, "saver": [2, 0, 0]}, b"")
    world = World(rec, [None, peer], monkeypatch)
    one_step(rec, model, opt, sched, 4)
    assert world.calls[0][1]["saver"] == [2, 0, 1]
    assert rec.exchange.saver_statuses(4) == [[2, 0, 1], [2, 0, 0]]
    assert rec.exchange.saver_statuses(3) is None  # not the committed step's exchange


def test_a_round_due_at_a_step_without_an_update_is_taken_as_the_next_step_begins(monkeypatch):
    """Steps 2 (the last recorded one) and 5 (K - 1) are due but make no update (a GradScaler's overflow skip):
    their exchange runs at the step's end (worker.session ``_close_step``) and their snapshots are taken; the job
    held none before 9 (outside review: an unreplicated job killed at step 13 had nothing to roll back to)."""
    rec, model, opt, sched = fsdp_rank(monkeypatch, 6)
    rec.exchange.snapshots.first = 2
    World(rec, [None] + [blob(NO_FINGERPRINT, n) for n in ("n1", "n2", "n2")], monkeypatch)
    for step in range(7):
        rec.control.set_step(step)
        rec.begin_step()
        model(torch.ones(4, 3)).sum().backward()
        if step not in (2, 5):
            opt.step()
        opt.zero_grad()
        rec.session._close_step()
    rec.begin_step()
    assert sorted(rec.exchange.snapshots.own) == [2, 5]
    assert rank_state.deserialize(rec.exchange.snapshots.own[5].rank_state)["local"] == {}


@pytest.mark.parametrize("after_update, named", [
    (None, None),
    ("rng", "the CPU RNG"),
    ("loader", "rank-local object 'data'"),
])
def test_state_changed_after_the_update_is_reported_once(monkeypatch, after_update, named):
    """What a script changes between the optimizer update (the exchange) and the next step's start is missing from
    the copy a failure's replacement resumes from: each rank says so once (RankWarning state_after_update)."""
    rec, model, opt, loader = with_loader(monkeypatch)
    for step in range(4):
        rec.control.set_step(step)
        rec.begin_step()
        torch.nn.functional.dropout(model(loader.batch(step)), 0.5).sum().backward()  # RNG drawn in the step
        opt.step()
        opt.zero_grad()
        if after_update == "rng":
            torch.rand(3)  # e.g. sampling text for the log after the update
        elif after_update == "loader":
            loader.batch(step + 1)  # e.g. prefetching the next step's batch
    warnings = [m for m in rec.sent if isinstance(m, p.RankWarning)]
    if named is None:
        assert warnings == []
        return
    assert len(warnings) == 1 and warnings[0].code == p.WarningCode.STATE_AFTER_UPDATE, warnings
    assert named in warnings[0].message and "step 0's optimizer update and step 1's start" in warnings[0].message


def test_no_warning_for_a_step_that_did_not_commit_or_a_shadow_iteration(monkeypatch):
    """The RNG moved after an exchange whose step then failed (the survivor puts it back), or in a joiner's shadow
    iteration: nothing to say."""
    rec = make(rank=0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec.manage({"model": model, "optimizer": opt}, rank_local=False)
    World(rec, [None] + [blob(NO_FINGERPRINT, n) for n in ("n1", "n2", "n2")], monkeypatch)
    rec.control.set_step(0)
    rec.begin_step()
    model(torch.ones(2, 3)).sum().backward()
    rec.exchange.run()  # the exchange ran, then a later collective of the step failed: no update committed
    torch.rand(3)
    rec.control.set_step(1)
    rec.begin_step()
    rec.control.enter(Stage.SHADOW)
    model(torch.ones(2, 3)).sum().backward()
    opt.step()
    torch.rand(3)
    rec.control.set_step(2)
    rec.begin_step()
    assert not [m for m in rec.sent if isinstance(m, p.RankWarning)]


class Odd:
    """A rank-local object whose state_dict holds ``value`` (at ``pos/seen``)."""

    def __init__(self, value):
        self.value = value

    def state_dict(self):
        return {"pos": {"seen": self.value}}

    def load_state_dict(self, state):
        self.value = state["pos"]["seen"]


@pytest.mark.parametrize("value, kind", [
    (__import__("numpy").float64(0.5), "numpy.float64"),
    (__import__("collections").deque([1]), "collections.deque"),
    ({1, 2}, "builtins.set"),  # torch.load(weights_only=True) takes a set, a migration's transfer does not
])
def test_a_rank_local_state_that_cannot_move_fails_the_job_at_the_first_step(monkeypatch, value, kind):
    """A rank-local state_dict holding what torch.load(weights_only=True) or worker.transfer refuses would make a
    failure's replacement (or a migration's joiner) fail: the first exchange fails the job at once instead, naming
    the object, the type and the rule."""
    rec, model, opt, loader = with_loader(monkeypatch)
    rec.manage({"sampler": Odd(value)}, rank_local=True)
    rec.control.set_step(0)
    rec.begin_step()
    model(torch.ones(4, 3)).sum().backward()
    with pytest.raises(Failed):
        opt.step()
    kind_, message = rec.failures[0]
    assert kind_ == p.FailureKind.SCRIPT_ERROR and "\n" not in message
    assert f"rank-local managed object 'sampler'" in message and f"holds a {kind} at pos/seen" in message
    assert "plain data" in message


def test_plain_rank_local_and_replicated_states_pass_and_are_checked_once(monkeypatch):
    """A Counter (MultiStepLR's milestones) is plain data; the check runs at the first exchange only."""
    import collections
    rec, model, opt, loader = with_loader(monkeypatch)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, [2, 3])
    rec.manage({"scheduler": sched}, rank_local=False)
    rec.manage({"counts": Odd(collections.Counter({"a": 1}))}, rank_local=True)
    calls = []
    monkeypatch.setattr(rank_state, "check_plain", lambda *a, real=rank_state.check_plain, **k: calls.append(1)
                        or real(*a, **k))
    loader_steps(rec, model, opt, loader, 2)
    assert rec.failures == [] and len(calls) == 2  # rank-local, then replicated: once


def test_a_replicated_state_that_cannot_be_sent_fails_the_job_at_the_first_step(monkeypatch):
    rec, model, opt, loader = with_loader(monkeypatch)
    rec.manage({"ema": Odd(__import__("numpy").float32(1))}, rank_local=False)
    rec.control.set_step(0)
    rec.begin_step()
    model(torch.ones(4, 3)).sum().backward()
    with pytest.raises(Failed):
        opt.step()
    assert "replicated managed object 'ema'" in rec.failures[0][1] and "numpy.float32" in rec.failures[0][1]

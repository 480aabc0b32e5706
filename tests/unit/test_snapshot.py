"""Buddy snapshots on their own (worker.snapshot, tmd.protocol.layout.snapshot_keepers): who keeps whose copy,
when snapshots are on, the agreement on which steps are kept, and host copies that never alias the live state.
No processes: the background exchange of a round is replaced by recording stubs."""
import collections
import threading

import pytest
import torch

from tmd import protocol as p
from worker import snapshot as snapshot_mod
from worker.snapshot import Snapshot, Snapshots, copy_state, round_id

pytestmark = pytest.mark.timeout(10)

TWO_NODES = {0: "n1", 1: "n1", 2: "n2", 3: "n2"}
DDP_CLASSES = {r: [0, 1, 2, 3] for r in range(4)}  # every rank a replica of every other
FSDP_CLASSES = {r: [r] for r in range(4)}  # no rank has a replica: each class lies on one node
HSDP_CLASSES = {0: [0, 2], 2: [0, 2], 1: [1, 3], 3: [1, 3]}  # replicate across nodes, shard in node


# --- who keeps whose snapshot -------------------------------------------------------------------------------------
def test_keepers_of_two_nodes_are_the_same_position_on_the_other_node():
    assert p.layout.snapshot_keepers(TWO_NODES) == {0: 2, 1: 3, 2: 0, 3: 1}


def test_keepers_of_three_nodes_form_a_ring_ordered_by_lowest_rank():
    # n3 holds the lowest ranks, so it comes first in the ring whatever its name
    node_of = {0: "n3", 1: "n3", 2: "n1", 3: "n1", 4: "n2", 5: "n2"}
    assert p.layout.snapshot_keepers(node_of) == {0: 2, 1: 3, 2: 4, 3: 5, 4: 0, 5: 1}


def test_keepers_of_interleaved_nodes_follow_each_node_s_own_rank_order():
    node_of = {0: "a", 1: "b", 2: "a", 3: "b"}  # a: [0, 2], b: [1, 3]
    assert p.layout.snapshot_keepers(node_of) == {0: 1, 2: 3, 1: 0, 3: 2}


@pytest.mark.parametrize("node_of", [
    {0: "n1", 1: "n1", 2: "n2"},  # nodes of different sizes
    {0: "n1", 1: "n1"},  # one node: no peer node to keep a copy
    {},
])
def test_no_keepers_without_two_nodes_of_one_size(node_of):
    assert p.layout.snapshot_keepers(node_of) == {}


def test_snapshot_and_created_group_prefixes_are_distinct_per_round_and_pair():
    a = p.layout.snapshot_prefix("abc", 0, 2)
    assert a != p.layout.snapshot_prefix("abc", 2, 0) and a != p.layout.snapshot_prefix("abd", 0, 2)
    assert a.startswith(p.layout.STORE_ROOT + "/") and "abc" in a
    assert p.layout.created_group_prefix("pg3") != p.layout.group_prefix(0, "pg3")


def test_round_id_is_short_deterministic_and_depends_on_every_nonce():
    assert round_id(["a", "b"]) == round_id(["a", "b"]) and len(round_id(["a"])) == 16
    assert round_id(["a", "b"]) != round_id(["a", "c"]) != round_id(["b", "a"])


# --- on or off ----------------------------------------------------------------------------------------------------
def snaps(rank=0, every=5):
    return Snapshots(every, rank, groups=None)


def test_off_when_every_is_zero_even_if_a_class_lies_on_one_node():
    s = snaps(every=0)
    s.configure(TWO_NODES, FSDP_CLASSES)
    assert not s.enabled and s.keeper is None and s.buddy is None
    assert not s.due(4, [True])


@pytest.mark.parametrize("classes", [DDP_CLASSES, HSDP_CLASSES])
def test_off_when_every_class_spans_nodes(classes):
    s = snaps()
    s.configure(TWO_NODES, classes)
    assert not s.enabled and not s.due(4, [True, True])


def test_off_when_the_nodes_cannot_pair_up():
    s = snaps()
    s.configure({0: "n1", 1: "n1", 2: "n2"}, {r: [r] for r in range(3)})
    assert not s.enabled


def test_on_when_some_class_lies_on_one_node_with_keeper_and_buddy_from_the_ring():
    node_of = {0: "n1", 1: "n1", 2: "n2", 3: "n2", 4: "n3", 5: "n3"}
    # a pipeline stage (ranks 0, 1) replicated only inside n1; the others replicated across n2, n3
    classes = {0: [0, 1], 1: [0, 1], 2: [2, 4], 4: [2, 4], 3: [3, 5], 5: [3, 5]}
    for rank, keeper, buddy in [(0, 2, 4), (3, 5, 1), (5, 1, 3)]:
        s = snaps(rank=rank)
        s.configure(node_of, classes)
        assert s.enabled and (s.keeper, s.buddy) == (keeper, buddy)


def test_due_every_k_steps_or_when_any_rank_wants_one():
    s = snaps(every=5)
    s.configure(TWO_NODES, FSDP_CLASSES)
    assert [step for step in range(15) if s.due(step, [False] * 4)] == [4, 9, 14]
    assert s.due(7, [False, False, True, False])


def test_the_last_recorded_step_takes_the_first_snapshot():
    """Without it, an FSDP job that lost a node between its recorded steps and step K - 1 had nothing to roll
    back to and failed (an outside script: kill -9 at step 5, "the survivors hold no common buddy snapshot")."""
    s = Snapshots(10, 0, groups=None, first=2)  # record_steps 3
    s.configure(TWO_NODES, FSDP_CLASSES)
    assert [step for step in range(25) if s.due(step, [False] * 4)] == [2, 9, 19]


# --- agreement: held, latest, prune -------------------------------------------------------------------------------
def holding(own, kept, rank=0):
    s = snaps(rank=rank)
    s.configure(TWO_NODES, FSDP_CLASSES)
    s.own = {step: Snapshot(step, {}, b"") for step in own}
    s.kept = {step: Snapshot(step, {}, b"") for step in kept}
    return s


def test_held_is_the_steps_with_both_copies_and_latest_the_newest():
    s = holding(own=[4, 9, 14], kept=[4, 9])  # round 14 still in flight
    assert s.held() == [4, 9] and s.latest() == 9
    assert holding(own=[4], kept=[]).latest() == -1


def test_prune_drops_steps_older_than_the_newest_one_every_rank_holds():
    s = holding(own=[4, 9, 14], kept=[4, 9, 14])
    s.prune([[4, 9, 14], [4, 9], [9, 14], [9]])
    assert sorted(s.own) == [9, 14] and sorted(s.kept) == [9, 14] and s.held() == [9, 14]


def test_prune_keeps_everything_while_some_rank_holds_nothing():
    s = holding(own=[4, 9], kept=[4, 9])
    s.prune([[4, 9], [], [4, 9], [9]])  # e.g. a replacement that adopted its snapshot and has no buddy copy yet
    assert s.held() == [4, 9]


def test_prune_never_drops_this_rank_s_own_latest():
    s = holding(own=[4, 9, 14], kept=[4, 9, 14])  # round 14 completed here after the exchange published [4, 9]
    s.prune([[4, 9], [9, 14], [9], [9, 14]])
    assert s.held() == [9, 14]
    s.prune([[14], [14], [14], [14]])
    assert s.held() == [14] and sorted(s.own) == [14]


def test_prune_never_drops_a_step_every_rank_holds_while_no_newer_one_is_common():
    """Rank 0 holds 4 and 9; rank 1 holds 4 and 14 (its round 9 broke, or completes after round 14). Step 4 is the
    newest step both hold: a failure now must still find it."""
    r0 = holding(own=[4, 9], kept=[4, 9], rank=0)
    r1 = holding(own=[4, 9, 14], kept=[4, 14], rank=1)
    published = [r0.held(), r1.held()]
    for s in (r0, r1):
        s.prune(published)
    assert set(r0.held()) & set(r1.held()) == {4}, (r0.held(), r1.held())
    r1.kept[9] = Snapshot(9, {}, b"")  # rank 1's round 9 completes late: 9 is common now, 4 can go
    published = [r0.held(), r1.held()]
    for s in (r0, r1):
        s.prune(published)
    assert (r0.held(), r1.held()) == ([9], [9, 14])


# --- taking one ---------------------------------------------------------------------------------------------------
class Holder:
    def __init__(self, state):
        self.state = state

    def state_dict(self):
        return self.state


def test_take_copies_to_host_memory_and_starts_both_halves_of_the_round(monkeypatch):
    s = snaps(rank=1)
    s.configure(TWO_NODES, FSDP_CLASSES)
    s.want = True
    calls, done = [], threading.Barrier(3, timeout=5)

    def send(snap, name):
        calls.append(("send", snap.step, name, threading.current_thread() is not threading.main_thread()))
        done.wait()

    def receive(step, name):
        calls.append(("receive", step, name, threading.current_thread() is not threading.main_thread()))
        done.wait()

    monkeypatch.setattr(s, "_send", send)
    monkeypatch.setattr(s, "_receive", receive)
    w = torch.arange(6, dtype=torch.float32)
    s.take(9, {"model": Holder({"w": w})}, b"rank-state", "round1")
    done.wait()
    assert sorted(calls) == [("receive", 9, "round1", True), ("send", 9, "round1", True)]
    snap = s.own[9]
    assert snap.rank_state == b"rank-state" and torch.equal(snap.states["model"]["w"], w)
    assert snap.states["model"]["w"].data_ptr() != w.data_ptr()
    assert s.bytes_per_copy == 6 * 4 + len(b"rank-state") and s.take_s >= 0.0
    assert not s.want and s.held() == []  # no buddy copy yet: not complete
    w.add_(1)
    assert torch.equal(s.own[9].states["model"]["w"], torch.arange(6, dtype=torch.float32))


def test_a_round_that_fails_leaves_the_previous_snapshot(monkeypatch):
    """A lost peer makes a round's send and receive fail: the round never completes and nothing is kept."""
    s = holding(own=[4], kept=[4], rank=1)
    s.groups = type("Groups", (), {"connect_store": lambda self: (_ for _ in ()).throw(ConnectionError("gone")),
                                   "host": "h"})()
    s._send(Snapshot(9, {}, b""), "r")  # log, no raise
    s._receive(9, "r")
    assert s.held() == [4] and 9 not in s.kept


# --- rolling back -------------------------------------------------------------------------------------------------
def test_own_copy_is_fresh_each_time_and_kept_copy_raises_when_not_held():
    s = snaps()
    w = torch.ones(3)
    s.own[4] = Snapshot(4, {"model": {"w": w}}, b"rs")
    a, b = s.own_copy(4), s.own_copy(4)
    assert a.step == 4 and a.rank_state == b"rs" and torch.equal(a.states["model"]["w"], w)
    assert a.states["model"]["w"].data_ptr() not in (w.data_ptr(), b.states["model"]["w"].data_ptr())
    a.states["model"]["w"].mul_(5)  # an optimizer loaded from it updates its tensors in place
    assert torch.equal(s.own[4].states["model"]["w"], torch.ones(3))
    with pytest.raises(KeyError):
        s.own_copy(9)
    with pytest.raises(KeyError):
        s.kept_copy(4)


def test_adopt_holds_a_received_snapshot_as_own_and_asks_for_a_fresh_round():
    s = holding(own=[4, 9], kept=[4, 9])
    w = torch.zeros(2)
    s.adopt(Snapshot(9, {"model": {"w": w}}, b"rs"))
    assert sorted(s.own) == [9] and s.kept == {} and s.want and s.latest() == -1
    w.add_(1)
    assert torch.equal(s.own_copy(9).states["model"]["w"], torch.zeros(2))
    assert s.frozen(s.own[9])["model"].state_dict() is s.own[9].states["model"]


# --- copy_state ---------------------------------------------------------------------------------------------------
def test_copy_state_deep_copies_an_optimizer_state_dict():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    original = opt.state_dict()
    copied = copy_state(original)
    before = {k: v["exp_avg"].clone() for k, v in original["state"].items()}
    lr = original["param_groups"][0]["lr"]
    for v in original["state"].values():
        v["exp_avg"].add_(1.0)  # in place, as the next step would
    original["param_groups"][0]["lr"] = 99.0
    original["param_groups"][0]["params"].append(42)
    assert all(torch.equal(copied["state"][k]["exp_avg"], before[k]) for k in before)
    assert copied["param_groups"][0]["lr"] == lr and 42 not in copied["param_groups"][0]["params"]


def test_copy_state_keeps_an_ordered_dict_and_its_metadata():
    sd = torch.nn.Linear(2, 2).state_dict()
    copied = copy_state(sd)
    assert isinstance(copied, collections.OrderedDict) and list(copied) == list(sd)
    assert copied._metadata == sd._metadata and copied._metadata is not sd._metadata
    for k in sd:
        assert torch.equal(copied[k], sd[k]) and copied[k].data_ptr() != sd[k].data_ptr()
    torch.nn.Linear(2, 2).load_state_dict(copied)  # loads like the original (version metadata included)


def test_copy_state_detaches_parameters_and_keeps_tuples_and_plain_values():
    param = torch.nn.Parameter(torch.ones(2))
    copied = copy_state({"p": param, "t": (1, torch.zeros(1)), "s": "x", "n": None})
    assert type(copied["p"]) is torch.Tensor and not copied["p"].requires_grad
    assert isinstance(copied["t"], tuple) and copied["t"][0] == 1 and copied["s"] == "x" and copied["n"] is None


def sharded(mesh, rows=2):
    """A module whose weight is a DTensor (as after fully_shard), rank 1's shard of a (4 * rows, 3) tensor."""
    from torch.distributed.tensor import DTensor, Shard

    model = torch.nn.Module()
    local = torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3)
    model.weight = torch.nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                                         shape=torch.Size((4 * rows, 3)), stride=(3, 1)))
    return model


def test_copy_state_of_a_dtensor_is_a_host_copy_of_its_local_shard_with_its_layout(mesh):
    from worker import transfer

    model = sharded(mesh)
    local = model.weight.to_local()
    copied = copy_state(model.state_dict())["weight"]
    # kept as a buddy's copy arrives: DTensor.from_local would move the shard back to the mesh's device
    assert isinstance(copied, transfer.ReceivedShard) and copied.local.device.type == "cpu"
    assert (copied.shape, copied.placements, copied.mesh) == ((8, 3), ("S(0)",), (4,))
    assert torch.equal(copied.local, local) and copied.local.data_ptr() != local.data_ptr()
    again = copy_state({"w": copied})["w"]
    assert (again.shape, again.placements, again.mesh) == (copied.shape, copied.placements, copied.mesh)
    assert torch.equal(again.local, copied.local) and again.local.data_ptr() != copied.local.data_ptr()
    assert snapshot_mod._nbytes({"w": copied, "x": [torch.zeros(4, dtype=torch.int64)]}) == 6 * 4 + 4 * 8
    assert snapshot_mod._nbytes({"w": model.weight}) == 6 * 4


def test_a_sharded_snapshot_loads_back_bit_identically_without_aliasing(mesh):
    from worker import transfer

    model = sharded(mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    before = model.weight.to_local().clone()
    s = snaps(rank=1)
    s.own[4] = Snapshot(4, {"model": copy_state(model.state_dict()), "opt": copy_state(opt.state_dict())}, b"")
    with torch.no_grad():
        model.weight.to_local().add_(7.0)  # training goes on
    transfer.load_state({"model": model, "opt": opt}, s.own_copy(4).states)
    assert torch.equal(model.weight.to_local(), before)
    with torch.no_grad():
        model.weight.to_local().add_(1.0)  # the loaded state is not the snapshot's
    assert torch.equal(s.own[4].states["model"]["weight"].local, before)


def test_prune_bounds_what_a_rank_holds_while_rounds_keep_failing_elsewhere():
    """A rank whose rounds keep failing (held nothing in common) must not make every other rank keep every copy:
    at most MAX_HELD of each kind stay, the common step (4) among them."""
    from worker.snapshot import MAX_HELD

    s = holding(own=[4, 9, 14, 19, 24], kept=[4, 9, 14, 19, 24])
    s.prune([[4, 9, 14, 19, 24], [4]])
    assert len(s.own) == len(s.kept) == MAX_HELD and 4 in s.own and 24 in s.own, sorted(s.own)
    s.prune([[9, 14, 19, 24], []])  # nothing common: still bounded, the newest kept
    assert len(s.own) <= MAX_HELD and 24 in s.own


def test_copy_state_keeps_a_counter():
    """MultiStepLR's milestones are a collections.Counter: a snapshot keeps the type, so a recovery from a buddy
    snapshot loads the same type as a recovery from a replica."""
    sched = torch.optim.lr_scheduler.MultiStepLR(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1.0), [3, 3])
    copied = copy_state(sched.state_dict())
    assert type(copied["milestones"]) is collections.Counter and copied["milestones"] == {3: 2}


def test_a_round_due_at_a_step_without_an_exchange_is_due_at_the_next_one():
    """A round was due only at the exact steps, checked in the exchange: a due step whose exchange did not run (its
    optimizer update skipped) took no snapshot, and an unreplicated job then had none to roll back to (outside
    review: "the survivors hold no common buddy snapshot"). Now the next exchange takes it, once."""
    s = Snapshots(10, 0, groups=None, first=2)  # record_steps 3
    s.configure(TWO_NODES, FSDP_CLASSES)
    exchanged = [0, 1, 3, 4, 5, 6, 7, 8, 10, 11, 12, 19, 20, 27, 31]  # none at 2, 9, 13-18, 21-26, 28-30
    assert [step for step in exchanged if s.due(step, [False] * 4)] == [3, 10, 19, 31]
    assert not s.due(31, [False] * 4) and s.due(29, [False] * 4)  # a redone step: itself only

"""The rank side of recovery on its own (worker.recovery.Recovery): the per-step exchange blob, replica classes
learned from the first exchange's fingerprints, the fingerprint check within a class, buddy snapshots taken at
the agreed steps, a survivor's rollback to its own snapshot, and a replacement's plan carried out during its
shadow iterations. No processes: the world's all-gather is a stub
that answers with every rank's blob, and the groups are a stub that builds nothing."""
import os
import threading
import time

import pytest
import torch

from tmd import protocol as p
from worker import rank_state
from worker.control import Attempt, Control, Stage
from worker import recovery
from worker.recovery import NO_FINGERPRINT, Recovery, pack, unpack
from worker.reports import Reporter
from worker.snapshot import Snapshots, round_id

pytestmark = pytest.mark.timeout(10)

NODE_OF = {0: "n1", 1: "n1", 2: "n2", 3: "n2"}


class Groups:
    """What Recovery needs of a GroupManager: no failure latched, a store, generations that build nothing."""

    timeout_s, host = 5.0, "h"

    def __init__(self):
        self.installed = []

    def failure(self):
        return None

    def connect_store(self):
        return object()

    def build_all(self, generation, store):
        return {}

    def install(self, built):
        self.installed.append(built)


class Failed(Exception):
    pass


def make(rank=0, every=0, stage=None):
    control = Control()
    control.start(p.Assign(role=p.WorkerRole.ACTIVE, rank=rank, world_size=4, store_host="h", store_port=1,
                           generation=0, record_steps=3, record_dir="/r", migration_id=0, incident_id=0))
    control.attach(Groups())
    if stage is not None:
        control.enter(stage)
    sent = []
    failures = []

    def fail(kind, error):
        failures.append((kind, error))
        raise Failed(error)

    rec = Recovery(control, Reporter(sent.append, lambda: control.rank), fail)
    rec.node = NODE_OF[rank]
    rec.snapshots = Snapshots(every, rank, control.groups)
    rec.sent, rec.failures = sent, failures
    return rec


def blob(fp, node, held=(), want=False, state=b"", nonce="00"):
    return pack(fp, {"node": node, "nonce": nonce, "held": list(held), "want": want}, state)


def fp(tag):
    return bytes([tag]) * rank_state.FINGERPRINT_BYTES


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
    rec._learn_classes({0: fp(1), 1: fp(2), 2: fp(1), 3: fp(2)}, NODE_OF)  # HSDP: replicate across nodes
    assert rec.classes == {0: [0, 2], 1: [1, 3], 2: [0, 2], 3: [1, 3]}
    assert rec.sent == [p.ReplicaReport(rank=1, replicas=[1, 3])]
    assert not rec.snapshots.enabled  # every class spans both nodes (and snapshots are off anyway)


def test_a_joiner_learning_classes_from_its_recording_reports_nothing_but_configures_snapshots():
    rec = make(rank=2, every=5, stage=Stage.SHADOW)
    rec._learn_classes({r: fp(r) for r in range(4)}, NODE_OF)  # FSDP: no rank has a replica
    assert rec.classes == {r: [r] for r in range(4)} and rec.sent == []
    assert rec.snapshots.enabled and (rec.snapshots.keeper, rec.snapshots.buddy) == (0, 0)


def test_verify_fails_the_job_on_a_mismatch_within_a_class_only():
    rec = make(rank=0)
    rec.classes = {0: [0, 2], 1: [1, 3], 2: [0, 2], 3: [1, 3]}
    rec._verify(5, {0: fp(1), 1: fp(2), 2: fp(1), 3: fp(3)})  # 1 and 3 differ: not rank 0's class
    assert rec.failures == []
    with pytest.raises(Failed):
        rec._verify(5, {0: fp(1), 1: fp(2), 2: fp(9), 3: fp(2)})
    ((kind, error),) = rec.failures
    assert kind == p.FailureKind.STATE_MISMATCH
    assert error == ("managed state differs between data-parallel replicas at step 5: ranks [0] agree with "
                     "rank 0, ranks [2] differ")


def test_verify_ignores_ranks_that_sent_no_fingerprint():
    rec = make(rank=0)
    rec.classes = {r: [0, 1, 2, 3] for r in range(4)}
    rec._verify(5, {0: fp(1), 3: fp(1)})  # ranks 1 and 2 not verifying this step (filtered by the caller)
    assert rec.failures == []


def test_before_classes_are_known_every_verifying_rank_is_one_class():
    rec = make(rank=0)
    with pytest.raises(Failed):
        rec._verify(0, {0: fp(1), 1: fp(2)})


# --- the exchange in a step ---------------------------------------------------------------------------------------
class World:
    """Stands in for the world's all-gather: every rank's blob, this rank's own at its index."""

    def __init__(self, rec, peers, monkeypatch):
        self.rec, self.peers, self.calls = rec, peers, []
        monkeypatch.setattr(rank_state, "all_gather_bytes", self.gather)

    def gather(self, data):
        self.calls.append(unpack(data))
        out = list(self.peers)
        out[self.rec.control.rank] = data
        return out


def trained(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    return model, opt, sched


def one_step(rec, model, opt, sched, step):
    rec.control.set_step(step)
    rec.begin_step()
    model(torch.ones(4, 3)).sum().backward()
    opt.step()
    sched.step()
    opt.zero_grad()


def test_the_first_exchange_learns_the_classes_and_later_ones_send_no_fingerprint(monkeypatch):
    rec = make(rank=0)
    model, opt, sched = trained()
    rec.manage({"model": model, "optimizer": opt, "scheduler": sched}, rank_local=False)
    mine = rank_state.fingerprint(rec.replicated, rec.optimizers)
    world = World(rec, [None, blob(mine, "n1"), blob(mine, "n2"), blob(mine, "n2")], monkeypatch)
    one_step(rec, model, opt, sched, 0)
    assert world.calls[0][0] == mine and world.calls[0][1]["node"] == "n1"
    assert rec.classes == {r: [0, 1, 2, 3] for r in range(4)} and rec.committed_step == 0
    assert rec.sent == [p.ReplicaReport(rank=0, replicas=[0, 1, 2, 3])]
    assert rec.own_state(0, 0) == world.calls[0][2] and rec.own_state(0, 1) is None
    world.peers = [None] + [blob(NO_FINGERPRINT, n) for n in ("n1", "n2", "n2")]
    one_step(rec, model, opt, sched, 1)
    assert world.calls[1][0] == NO_FINGERPRINT and len(rec.sent) == 1 and rec.committed_step == 1


def test_a_replica_that_differs_at_the_first_step_after_a_recovery_fails_the_job(monkeypatch):
    rec = make(rank=0)
    model, opt, sched = trained()
    rec.manage({"model": model, "optimizer": opt}, rank_local=False)
    rec.classes = {r: [0, 1, 2, 3] for r in range(4)}
    rec.verify_next = True
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
    rec.classes = {r: [r] for r in range(4)}  # FSDP: no rank has a replica
    rec.snapshots.configure(NODE_OF, rec.classes)
    rounds = []
    monkeypatch.setattr(rec.snapshots, "_send", lambda snap, name: rounds.append(("send", snap.step, name)))
    monkeypatch.setattr(rec.snapshots, "_receive", lambda step, name: rounds.append(("receive", step, name)))
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
    assert sorted(rec.snapshots.own) == [1, 3] and len(rounds) == 4
    snap = rec.snapshots.own[1]
    assert snap.rank_state == world.calls[1][2]  # this rank's state sent in step 1's exchange
    assert all(torch.equal(snap.states["model"][k], v) for k, v in at_one["model"].items())
    # the snapshot of step S is the state a step S + 1 starts from: the scheduler stepped after the optimizer
    assert snap.states["scheduler"]["last_epoch"] == at_one["scheduler"]["last_epoch"] == 2
    assert snap.states["optimizer"]["param_groups"][0]["lr"] == pytest.approx(0.5 / 3)
    assert [c[1]["held"] for c in world.calls] == [[], [], [], []]  # no round completed (stubbed exchange)


def test_any_rank_wanting_a_snapshot_makes_the_next_commit_take_one(monkeypatch):
    rec = make(rank=0, every=100)
    model, opt, sched = trained()
    rec.manage({"model": model, "optimizer": opt}, rank_local=False)
    rec.classes = {r: [r] for r in range(4)}
    rec.snapshots.configure(NODE_OF, rec.classes)
    monkeypatch.setattr(rec.snapshots, "_send", lambda snap, name: None)
    monkeypatch.setattr(rec.snapshots, "_receive", lambda step, name: None)
    World(rec, [None, blob(NO_FINGERPRINT, "n1"), blob(NO_FINGERPRINT, "n2", want=True),
                blob(NO_FINGERPRINT, "n2")], monkeypatch)
    one_step(rec, model, opt, sched, 5)
    rec.begin_step()
    assert sorted(rec.snapshots.own) == [5]


# --- rolling back -------------------------------------------------------------------------------------------------
def test_a_survivor_rolls_back_to_its_own_snapshot(monkeypatch):
    rec = make(rank=0, every=2)
    model, opt, sched = trained()
    rec.manage({"model": model, "optimizer": opt}, rank_local=False)
    rec.classes = {r: [r] for r in range(4)}
    rec.snapshots.configure(NODE_OF, rec.classes)
    monkeypatch.setattr(rec.snapshots, "_send", lambda snap, name: None)
    monkeypatch.setattr(rec.snapshots, "_receive", lambda step, name: None)
    World(rec, [None] + [blob(NO_FINGERPRINT, n) for n in ("n1", "n2", "n2")], monkeypatch)
    for step in range(2):
        one_step(rec, model, opt, sched, step)
    rec.begin_step()
    rec.snapshots.kept[1] = rec.snapshots.own[1]  # the buddy's copy arrived
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    rng = rank_state.deserialize(rec.snapshots.own[1].rank_state)["cpu_rng"]
    for step in range(2, 4):
        one_step(rec, model, opt, sched, step)
    torch.rand(7)  # the RNG moved on too
    rec.control.on_halt(p.Halt(incident_id=1, reason="n2 lost", failed_ranks=[2, 3]))
    rec.control.on_recover(p.Recover(incident_id=1, generation=1, resume_step=2, sends=[], rollback_step=1))
    assert rec._carry_out(rec.control.plan, 3, torch.get_rng_state()) == 2
    assert all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())
    assert torch.equal(torch.get_rng_state(), rng) and rec.committed_step == 1
    assert rec.kept is None and rec.snapshots.want and rec.verify_next
    assert rec.sent[-1].phase == p.RecoveryPhase.RECOVERED and rec.sent[-1].committed_step == 1
    # what was loaded is a copy: training on does not change the snapshot
    one_step(rec, model, opt, sched, 2)
    assert all(torch.equal(rec.snapshots.own[1].states["model"][k], v) for k, v in weights.items())


@pytest.mark.parametrize("set_to_none", [True, False])
def test_a_survivor_s_recovery_clears_the_gradients_its_interrupted_step_left(monkeypatch, set_to_none):
    # A script that zeroes its gradients after the optimizer step: the interrupted step's backward ran, its
    # update was refused, and the redone step must not add this rank's own gradients to its own.
    rec = make(rank=0)
    model, opt, sched = trained()
    frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    model.register_parameter("frozen", frozen)
    rec.manage({"model": model, "optimizer": opt}, rank_local=False)
    assert {id(t) for t in rec.trained} == {id(model.weight), id(model.bias)}
    World(rec, [None] + [blob(NO_FINGERPRINT, n) for n in ("n1", "n2", "n2")], monkeypatch)
    rec.control.set_step(0)
    rec.begin_step()
    model(torch.ones(4, 3)).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=set_to_none)  # what the next step begins with
    rec.control.set_step(1)
    rec.begin_step()
    model(torch.ones(4, 3)).sum().backward()  # the interrupted step: its gradients stay in .grad
    assert model.weight.grad.abs().sum() > 0
    rec.control.on_halt(p.Halt(incident_id=1, reason="n2 lost", failed_ranks=[2, 3]))
    rec.control.on_recover(p.Recover(incident_id=1, generation=1, resume_step=1, sends=[], rollback_step=-1))
    assert rec._carry_out(rec.control.plan, 0, torch.get_rng_state()) == 1
    for param in (model.weight, model.bias):
        if set_to_none:
            assert param.grad is None
        else:
            assert param.grad is not None and not param.grad.any()
    # a gradient that was there as the step began (the last step's, in a script that zeroes before the
    # backward) is zeroed, not dropped
    model(torch.ones(4, 3)).sum().backward()
    rec.begin_step()
    model(torch.ones(4, 3)).sum().backward()
    rec.control.on_recover(p.Recover(incident_id=1, generation=2, resume_step=1, sends=[], rollback_step=-1))
    rec._carry_out(rec.control.plan, 0, torch.get_rng_state())
    assert model.weight.grad is not None and not model.weight.grad.any()


class Counting(torch.nn.Module):
    """A layer whose forward pass changes two buffers in place, replaces a third and leaves a fourth alone."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.register_buffer("running", torch.zeros(3))
        self.register_buffer("mask", torch.ones(3))
        self.register_buffer("avg", torch.zeros(3))

    def forward(self, x):
        with torch.no_grad():
            self.calls += 1
            self.running.mul_(0.9).add_(x.mean(0), alpha=0.1)
            self.avg = 0.5 * self.avg + 0.5 * x.mean(0)  # a new tensor each time
        return self.lin(x * self.mask)


def test_an_interrupted_step_s_buffer_changes_are_put_back(monkeypatch):
    rec = make(rank=0)
    model = Counting()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec.manage({"model": model, "optimizer": opt}, rank_local=False)
    World(rec, [None] + [blob(NO_FINGERPRINT, n) for n in ("n1", "n2", "n2")], monkeypatch)
    for step in range(2):
        rec.control.set_step(step)
        rec.begin_step()
        model(torch.full((4, 3), float(step + 1))).sum().backward()
        opt.step()
        opt.zero_grad()
    copies = {k: id(v) for k, v in rec.buffer_copies.items()}
    assert list(copies) == [("model", "calls"), ("model", "running"), ("model", "mask"), ("model", "avg")]
    before = {k: v.clone() for k, v in model.named_buffers()}
    rec.control.set_step(2)
    rec.begin_step()
    model(torch.full((4, 3), 7.0)).sum().backward()  # the interrupted step's forward pass ran
    assert int(model.calls) == 3
    rec.restore_buffers()
    assert all(torch.equal(v, before[k]) for k, v in model.named_buffers())
    # redone with the same data, the buffers are what one pass gives
    rec.begin_step()
    model(torch.full((4, 3), 7.0))
    assert int(model.calls) == 3
    assert {k: id(v) for k, v in rec.buffer_copies.items()} == copies  # copied into the same tensors each step


class Loader:
    """A rank-local data loader whose position moves with every batch it serves (a count and a tensor cursor)."""

    def __init__(self):
        self.served, self.cursor = 0, torch.zeros(2, dtype=torch.int64)

    def batch(self, step):
        self.served += 1
        self.cursor += torch.tensor([1, step])  # in place: a state_dict sharing it would see this change
        return torch.full((4, 3), float(step + 1))

    def state_dict(self):
        return {"served": self.served, "cursor": self.cursor}

    def load_state_dict(self, state):
        self.served, self.cursor = state["served"], state["cursor"]


def with_loader(monkeypatch):
    """Rank 0 of 4 managing a linear model and its SGD (replicated) and a :class:`Loader` (rank-local, ``data``)."""
    rec = make(rank=0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = Loader()
    rec.manage({"model": model, "optimizer": opt}, rank_local=False)
    rec.manage({"data": loader}, rank_local=True)
    World(rec, [None] + [blob(NO_FINGERPRINT, n) for n in ("n1", "n2", "n2")], monkeypatch)
    return rec, model, opt, loader


@pytest.mark.parametrize("done", [False, True])
def test_a_survivor_draws_the_redone_step_from_where_the_interrupted_attempt_began(monkeypatch, done):
    """The interrupted step's batches moved the rank-local loader; a survivor that did not commit that step loads
    the loader's state as the attempt began before the plan is carried out, so the redone step serves the same
    position once. A survivor that committed the step anyway keeps the state it stands at."""
    rec, model, opt, loader = with_loader(monkeypatch)
    for step in range(2):
        rec.control.set_step(step)
        rec.begin_step()
        model(loader.batch(step)).sum().backward()
        opt.step()
        opt.zero_grad()
    at_begin = (loader.served, loader.cursor.clone())
    rec.control.set_step(2)
    rec.begin_step()
    model(loader.batch(2)).sum().backward()  # the interrupted attempt drew its batch
    after = (loader.served, loader.cursor.clone())
    rec.control.on_halt(p.Halt(incident_id=1, reason="n2 lost", failed_ranks=[2, 3]))
    rec.control.on_recover(p.Recover(incident_id=1, generation=1, resume_step=3 if done else 2, sends=[]))
    assert rec.recover(2, done) == (3 if done else 2)
    expected = after if done else at_begin
    assert loader.served == expected[0] and torch.equal(loader.cursor, expected[1])
    if not done:  # the redone step draws once, from the attempt's start, and the kept copy is not aliased
        rec.begin_step()
        loader.batch(2)
        assert loader.served == after[0] and torch.equal(loader.cursor, after[1])
        assert rec.local_copies["data"]["served"] == at_begin[0]


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
    rec._exchange()  # the exchange ran, then a later collective of the step failed: no update committed
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


def test_a_forward_pass_stops_once_the_step_is_void_and_only_within_a_step(monkeypatch):
    rec = make(rank=0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))
    ran = []
    for m in model:
        m.register_forward_pre_hook(rec._abort_forward)
        m.register_forward_hook(lambda m, a, out: ran.append(type(m).__name__))
    rec.control.set_step(4)
    rec.begin_step()
    model(torch.ones(2, 3))
    assert ran == ["Linear", "ReLU", "Linear"]
    ran.clear()
    def halt(module, args):  # the halt arrives while the first layer ran
        rec.control.on_halt(p.Halt(incident_id=1, reason="n2 lost", failed_ranks=[2, 3]))

    model[1].register_forward_pre_hook(halt, prepend=True)
    with pytest.raises(recovery.StepAborted, match="step 4: forward pass stopped, halted by tmd: n2 lost"):
        model(torch.ones(2, 3))
    assert ran == ["Linear"]  # neither the ReLU nor the second layer ran
    rec.in_step = False  # outside a step (an evaluation after the loop) nothing is stopped
    model(torch.ones(2, 3))
    assert len(ran) == 4


def test_only_a_plain_ddp_model_gets_its_forward_stopped():
    assert not recovery._stoppable(torch.nn.Linear(2, 2))  # not DDP: its forward is the script's own


@pytest.fixture
def world_of_one():
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


class WithUnused(torch.nn.Module):
    """A 3 -> 8 -> 1 MLP (``net``) and a layer the forward never uses: DDP needs ``find_unused_parameters``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        self.unused = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@pytest.mark.parametrize("find_unused", [False, True])
def test_a_ddp_backward_pass_stops_once_the_step_is_void_and_the_reset_reducer_runs_the_redone_step(world_of_one,
                                                                                                   find_unused):
    from torch.nn.parallel import DistributedDataParallel as DDP

    rec = make(rank=0)
    torch.manual_seed(0)
    module = WithUnused() if find_unused else torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.ReLU(),
                                                                  torch.nn.Linear(8, 1))
    model = DDP(module, find_unused_parameters=find_unused)
    assert recovery._backward_stoppable(model)
    rec.manage({"model": model}, rank_local=False)
    net = model.module.net if find_unused else model.module
    first, last = net[0].weight, net[2].weight

    def step(halt_at_last_layer: bool) -> None:
        rec.control.set_step(4)
        rec.begin_step()
        loss = model(torch.ones(2, 3)).sum()
        if halt_at_last_layer:  # the halt arrives as the last layer's gradient (the first one) was computed
            def halt(grad):
                rec.control.on_halt(p.Halt(incident_id=1, reason="n2 lost", failed_ranks=[2, 3]))

            handle = last.register_hook(halt)
        try:
            loss.backward()
        finally:
            if halt_at_last_layer:
                handle.remove()

    step(False)  # DDP's first step: it regroups its buckets (no failure)
    expected = [q.grad.clone() if q.grad is not None else None for q in model.parameters()]
    model.zero_grad(set_to_none=True)
    with pytest.raises(recovery.StepAborted, match="step 4: backward pass stopped, halted by tmd: n2 lost"):
        step(True)
    assert last.grad is not None and first.grad is None  # the rest of the backward pass did not run
    with pytest.raises(RuntimeError, match="finished reduction"):  # the reducer was left half-way
        model(torch.ones(2, 3))
    # what the recovery does before the step is redone: the incident ends, the reducer is reset, the gradients
    rec.control.recovered(Attempt(rec.control.halt, None))  # are put back
    rec._reset_reducers()
    model.zero_grad(set_to_none=True)
    step(False)
    assert all(torch.equal(q.grad, e) if e is not None else q.grad is None
               for q, e in zip(model.parameters(), expected))
    rec.in_step = False  # outside a step nothing is stopped
    rec.control.on_halt(p.Halt(incident_id=2, reason="n1 lost", failed_ranks=[0]))
    model(torch.ones(2, 3)).sum().backward()



def test_what_is_armed_for_the_next_backward_pass_runs_at_its_first_gradient_once(world_of_one):
    from torch.nn.parallel import DistributedDataParallel as DDP

    rec = make(rank=0)
    ran = []
    assert not rec.at_next_backward(lambda: ran.append(1))  # no managed DDP model: nothing to arm
    model = DDP(torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)))
    rec.manage({"model": model}, rank_local=False)
    loss = model(torch.ones(2, 3)).sum()
    assert rec.at_next_backward(lambda: ran.append(rec.in_step)) and ran == []
    loss.backward()
    assert ran == [False]  # once, though four parameters got gradients
    model(torch.ones(2, 3)).sum().backward()
    assert ran == [False]

    rec.at_next_backward(lambda: ran.append("void"))  # a void step runs nothing: it stays armed
    rec.control.set_step(4)
    rec.begin_step()
    rec.control.on_halt(p.Halt(incident_id=1, reason="n2 lost", failed_ranks=[2, 3]))
    with pytest.raises(recovery.StepAborted):
        model(torch.ones(2, 3))
    assert ran == [False]


def test_a_grad_scaler_forgets_the_interrupted_step_s_unscale(monkeypatch):
    # The interrupted step ran scaler.unscale_(opt); its scaler.step(opt) was refused, so update() never came.
    rec = make(rank=0)
    model, opt, sched = trained()
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    rec.manage({"model": model, "optimizer": opt, "scaler": scaler}, rank_local=False)
    scaler.scale(model(torch.ones(4, 3)).sum()).backward()
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="unscale_"):
        scaler.unscale_(opt)  # what the redone step would hit
    rec.restore_grad_scalers()
    scaler.unscale_(opt)
    assert scaler.get_scale() == 8.0  # the scale changes only in update()


def test_a_rollback_to_a_snapshot_not_held_is_refused():
    rec = make(rank=0, every=2)
    rec.control.on_halt(p.Halt(incident_id=1, reason="n2 lost", failed_ranks=[2, 3]))
    rec.control.on_recover(p.Recover(incident_id=1, generation=1, resume_step=5, sends=[], rollback_step=4))
    with pytest.raises(RuntimeError, match="holds no complete snapshot of it"):
        rec._carry_out(rec.control.plan, 7, None)


# --- a replacement's plan carried out during its shadow iterations (Recovery.prefetch) ------------------------------
class JoinerGroups(Groups):
    """Groups of a joiner: the mode and tolerance it takes when it becomes active, and every build counted."""

    def __init__(self):
        super().__init__()
        self.built = []
        self.modes = []

    def build_all(self, generation, store):
        self.built.append(generation)
        return {"world": f"gen{generation}"}

    def set_mode(self, mode):
        self.modes.append(mode)

    def set_tolerant(self):
        pass


def replacement(monkeypatch, rank=2):
    """A joiner replacing lost rank ``rank`` of incident 1, managing a small model; its state transfers are
    stubs that hand over ``sent_state`` (and count the receptions)."""
    from worker import recovery as wr

    control = Control()
    control.start(p.Assign(role=p.WorkerRole.JOINER, rank=rank, world_size=4, store_host="h", store_port=1,
                           generation=0, record_steps=3, record_dir="/r", migration_id=0, incident_id=1))
    control.attach(JoinerGroups())
    sent = []
    rec = Recovery(control, Reporter(sent.append, lambda: control.rank), lambda kind, error: None)
    model = torch.nn.Linear(3, 2)
    rec.manage({"model": model}, rank_local=False)
    source = torch.nn.Linear(3, 2)
    received = []

    def recv_state(pg, src):
        received.append(pg)
        return {"model": {k: v.clone() for k, v in source.state_dict().items()}}, \
            {"step": 8, "rng": None, "rank_state": None}, 100, 0.0

    monkeypatch.setattr(wr.mb, "build_inner", lambda *a, **k: object())
    monkeypatch.setattr(wr.mb, "release_in_background", lambda pg: None)
    monkeypatch.setattr(wr.transfer, "recv_state", recv_state)
    rec.sent, rec.received, rec.model, rec.source = sent, received, model, source
    return rec


def plan(incident_id=1, generation=1, sends=((0, 2),)):
    return p.Recover(incident_id=incident_id, generation=generation, resume_step=8, sends=[list(s) for s in sends],
                     rollback_step=-1)


def test_a_plan_that_comes_during_the_shadow_iterations_is_carried_out_meanwhile_then_loaded(monkeypatch):
    rec = replacement(monkeypatch)
    rec.prefetch()
    rec.control.on_recover(plan())
    assert rec.control.wait_until(lambda: rec.control.groups.built == [1], 5.0)  # while the shadow runs
    assert len(rec.received) == 1
    assert not torch.equal(rec.model.weight, rec.source.weight)  # loaded only after the shadow iterations
    assert rec.replace(1) == 8
    assert len(rec.received) == 1 and rec.control.groups.built == [1]  # no second attempt
    assert torch.equal(rec.model.weight, rec.source.weight) and rec.control.groups.installed == [{"world": "gen1"}]
    assert [m.phase for m in rec.sent] == [p.RecoveryPhase.WARMED, p.RecoveryPhase.RECOVERED]
    assert rec.control.role == p.WorkerRole.ACTIVE and rec.control.plan is None


def test_a_plan_that_comes_after_the_shadow_iterations_is_carried_out_once(monkeypatch):
    rec = replacement(monkeypatch)
    rec.prefetch()
    timer = threading.Timer(0.2, rec.control.on_recover, (plan(),))
    timer.start()
    assert rec.replace(1) == 8  # the plan came while replace() waited: the prefetch launched nothing
    timer.join()
    assert len(rec.received) == 1 and rec.control.groups.built == [1]
    assert torch.equal(rec.model.weight, rec.source.weight)


def test_a_prefetched_plan_superseded_by_a_newer_one_is_dropped(monkeypatch):
    rec = replacement(monkeypatch)
    rec.prefetch()
    rec.control.on_recover(plan(incident_id=1, generation=1))
    assert rec.control.wait_until(lambda: rec.control.groups.built == [1], 5.0)
    rec.control.on_recover(plan(incident_id=2, generation=2, sends=((1, 2),)))  # a second failure's plan
    assert rec.replace(1) == 8
    assert rec.control.groups.built == [1, 2] and rec.control.groups.installed == [{"world": "gen2"}]
    assert rec.sent[-1].phase == p.RecoveryPhase.RECOVERED and rec.sent[-1].incident_id == 2


def test_a_replacement_is_never_prefetched_into_sending_its_live_state(monkeypatch):
    rec = replacement(monkeypatch)
    rec.prefetch()
    rec.control.on_recover(plan(sends=((2, 3), (0, 2))))  # (no plan tmd makes: a replacement is no source)
    time.sleep(0.2)
    assert rec.control.groups.built == [] and rec.received == []


class LateCounting(torch.nn.Module):
    """A layer whose forward pass leaves its buffer alone until ``start`` is set (a counter that starts later)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)
        self.register_buffer("late", torch.zeros(3))
        self.start = False

    def forward(self, x):
        if self.start:
            with torch.no_grad():
                self.late.add_(x.mean(0))
        return self.lin(x)


def _run_steps(rec, model, opt, steps):
    for step in steps:
        rec.control.set_step(step)
        rec.begin_step()
        model(torch.full((4, 3), float(step + 1))).sum().backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("first_change", ["interrupted", "committed"])
def test_a_buffer_that_starts_changing_after_the_first_step_is_put_back_too(monkeypatch, first_change):
    """The first steps leave the buffer alone. ``interrupted``: the step that changes it first is interrupted, and
    it is put back. ``committed``: a committed step changed it first, and an interrupted step after that gets the
    committed value back, not the value of the first steps."""
    rec = make(rank=0)
    model = LateCounting()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec.manage({"model": model, "optimizer": opt}, rank_local=False)
    World(rec, [None] + [blob(NO_FINGERPRINT, n) for n in ("n1", "n2", "n2")], monkeypatch)
    _run_steps(rec, model, opt, range(3))
    model.start = True
    step = 3
    if first_change == "committed":
        _run_steps(rec, model, opt, [3])
        step = 4
    before = model.late.clone()
    rec.control.set_step(step)
    rec.begin_step()
    model(torch.full((4, 3), 9.0)).sum().backward()  # the interrupted step's forward pass changed it
    assert not torch.equal(model.late, before)
    rec.restore_buffers()
    assert torch.equal(model.late, before)
    if first_change == "committed":
        assert before.any()  # the committed value, not the zeros of the first steps


def test_a_joiner_regroups_its_ddp_buckets_without_scanning_every_object(world_of_one, monkeypatch):
    """track_ddp_modules (a joiner, before its script builds anything) keeps each DDP as it is built, so
    regroup_ddp_buckets does not walk gc.get_objects() (~0.1 s for the demo GPT, on a failure's critical path)."""
    import gc

    from torch.nn.parallel import DistributedDataParallel as DDP

    import weakref

    monkeypatch.setattr(recovery, "_ddp_modules", weakref.WeakSet())  # none from the tests before
    recovery.track_ddp_modules()
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)))
    assert list(recovery._ddp_modules) == [model]

    def scanned():
        raise AssertionError("gc.get_objects() was called")

    monkeypatch.setattr(gc, "get_objects", scanned)
    assert not recovery.regroup_ddp_buckets()  # no backward pass yet: nothing to regroup from
    model(torch.randn(4, 3)).sum().backward()
    assert recovery.regroup_ddp_buckets() and model._has_rebuilt_buckets
    assert not recovery.regroup_ddp_buckets()  # regrouped already
    del model
    gc.collect()
    assert not list(recovery._ddp_modules)  # weak: a dropped model is not kept alive


class Reordered(torch.nn.Module):
    """``a`` is registered first but used last: the gradients come in another order than DDP's first layout
    (parameters in reverse registration order) assumes."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 1)
        self.b = torch.nn.Linear(3, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(torch.relu(self.b(x)))


def test_a_replacement_regroups_its_ddp_buckets_before_any_step(world_of_one, monkeypatch):
    """regroup_ddp_buckets(before_first=True): no backward pass gave the gradients' order, every parameter is
    pushed in index order, and the regrouping is the one every rank adopts (rank 0's broadcast; here, a world of
    one, this rank's own). The first step then runs on the regrouped buckets and does not regroup again."""
    import weakref

    from torch.nn.parallel import DistributedDataParallel as DDP

    monkeypatch.setattr(recovery, "_ddp_modules", weakref.WeakSet())
    recovery.track_ddp_modules()
    assert recovery.ddp_to_regroup() == (True, None)  # no DDP: nothing to regroup
    torch.manual_seed(0)
    model = DDP(Reordered(), bucket_cap_mb=1e-6)  # a bucket per parameter
    reference = Reordered()
    reference.load_state_dict(model.module.state_dict())
    assert recovery.ddp_to_regroup() == (True, model)
    first_layout = [b.buffer().numel() for b in model.reducer._get_zeros_like_grad_buckets()]
    assert recovery.regroup_ddp_buckets(before_first=True) and model._has_rebuilt_buckets
    regrouped = [b.buffer().numel() for b in model.reducer._get_zeros_like_grad_buckets()]
    # DDP's first layout: one bucket; regrouped: one per parameter (the cap), in index order (a.weight, a.bias,
    # b.weight, b.bias), the proposal a world of one adopts
    assert first_layout == [41] and regrouped == [8, 1, 24, 8]
    assert recovery.ddp_to_regroup() == (True, None)
    x = torch.randn(4, 3)
    model(x).sum().backward()
    reference(x).sum().backward()
    for got, want in zip(model.module.parameters(), reference.parameters()):
        assert torch.equal(got.grad, want.grad)
    model(x).sum().backward()  # the second forward finds nothing left to regroup
    assert [b.buffer().numel() for b in model.reducer._get_zeros_like_grad_buckets()] == regrouped


def test_only_one_plain_ddp_is_regrouped_by_a_replacement(world_of_one, monkeypatch):
    import gc
    import weakref

    from torch.nn.parallel import DistributedDataParallel as DDP

    monkeypatch.setattr(recovery, "_ddp_modules", weakref.WeakSet())
    recovery.track_ddp_modules()
    static = DDP(Reordered(), static_graph=True)
    assert recovery.ddp_to_regroup() == (False, None)  # a static graph regroups its own way
    del static
    gc.collect()
    kept = [DDP(WithUnused(), find_unused_parameters=True)]  # (the set is weak: the test holds its models)
    assert recovery.ddp_to_regroup() == (True, None)  # it never regroups: nothing to do
    kept += [DDP(Reordered()), DDP(Reordered())]
    assert recovery.ddp_to_regroup() == (False, None)  # which regroups first is the script's order
    assert not recovery.regroup_ddp_buckets(before_first=True)
    assert not any(m._has_rebuilt_buckets for m in kept[1:])

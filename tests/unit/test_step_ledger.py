"""The step ledger on its own (worker.step_ledger): what an interrupted attempt changed is put back as it began
(buffers, gradients, a GradScaler's unscale mark). No processes (tests.unit.rank_rooms)."""
import time

import pytest
import torch

from tmd import protocol as p
from worker.step_exchange import NO_FINGERPRINT
from tests.unit.rank_rooms import World, blob, make, trained

pytestmark = pytest.mark.timeout(10)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_a_survivor_s_recovery_clears_the_gradients_its_interrupted_step_left(monkeypatch, set_to_none):
    # A script that zeroes its gradients after the optimizer step: the interrupted step's backward ran, its
    # update was refused, and the redone step must not add this rank's own gradients to its own.
    rec = make(rank=0)
    model, opt, sched = trained()
    frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    model.register_parameter("frozen", frozen)
    rec.manage({"model": model, "optimizer": opt}, rank_local=False)
    assert {id(t) for t in rec.ledger.trained} == {id(model.weight), id(model.bias)}
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
    assert rec.recovery._carry_out(rec.control.plan, 0, torch.get_rng_state()) == 1
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
    rec.recovery._carry_out(rec.control.plan, 0, torch.get_rng_state())
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
    copies = {k: id(v) for k, v in rec.ledger.buffer_copies.items()}
    assert list(copies) == [("model", "calls"), ("model", "running"), ("model", "mask"), ("model", "avg")]
    before = {k: v.clone() for k, v in model.named_buffers()}
    rec.control.set_step(2)
    rec.begin_step()
    model(torch.full((4, 3), 7.0)).sum().backward()  # the interrupted step's forward pass ran
    assert int(model.calls) == 3
    rec.ledger.restore_buffers()
    assert all(torch.equal(v, before[k]) for k, v in model.named_buffers())
    # redone with the same data, the buffers are what one pass gives
    rec.begin_step()
    model(torch.full((4, 3), 7.0))
    assert int(model.calls) == 3
    assert {k: id(v) for k, v in rec.ledger.buffer_copies.items()} == copies  # copied into the same tensors each step


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
    rec.ledger.restore_grad_scalers()
    scaler.unscale_(opt)
    assert scaler.get_scale() == 8.0  # the scale changes only in update()


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


def test_an_overflow_step_s_scale_backoff_is_put_back_by_a_survivor_that_did_not_commit_it(monkeypatch):
    """An overflow step makes no update, so nothing is refused: scaler.update() backs the scale off, then a failure
    is noticed at the step's end (its exchange). The survivor put its buffers and objects back but not the scale,
    and the redone step backed off twice (an outside review's GradScaler script, killed in an overflow step: only
    the scaler's state differed from the uninterrupted run's)."""
    rec = make(rank=0)
    model, opt, sched = trained()
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=1)
    rec.manage({"model": model, "optimizer": opt, "scaler": scaler}, rank_local=False)
    World(rec, [None] + [blob(NO_FINGERPRINT, n) for n in ("n1", "n2", "n2")], monkeypatch)

    def attempt(step, overflow):
        rec.control.set_step(step)
        rec.begin_step()
        loss = model(torch.ones(4, 3)).sum()
        scaler.scale(loss * float("inf") if overflow else loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()

    attempt(0, False)
    rec.session._close_step()
    assert scaler.get_scale() == 16.0  # grown after one good step
    began = scaler.state_dict()
    attempt(1, True)
    assert scaler.get_scale() == 8.0 and rec.ledger.committed_step == 0  # backed off; no update
    rec.control.on_halt(p.Halt(incident_id=1, reason="n2 lost", failed_ranks=[2, 3]))
    rec.control.on_recover(p.Recover(incident_id=1, generation=1, resume_step=1, sends=[], rollback_step=-1))
    assert rec.recovery.recover(1, False) == 1
    assert scaler.state_dict() == began
    # a scaler whose first scale() ran in an interrupted attempt initialises again at the redone step's
    fresh = torch.amp.GradScaler("cpu", init_scale=4.0)
    rec.manage({"fresh": fresh}, rank_local=False)
    rec.control.set_step(1)
    rec.begin_step()
    fresh.scale(torch.ones(()))
    fresh._scale.fill_(1.0)
    rec.ledger.restore_grad_scaler_scales()
    assert fresh._scale is None and fresh.scale(torch.ones(())).item() == 4.0


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
    rec.ledger.restore_buffers()
    assert torch.equal(model.late, before)
    if first_change == "committed":
        assert before.any()  # the committed value, not the zeros of the first steps


class Progress:
    """A replicated object the script changes as it draws each batch, before the optimizer's update."""

    def __init__(self):
        self.samples = 0
        self.seen: list[int] = []

    def state_dict(self):
        return {"samples": self.samples, "seen": list(self.seen)}

    def load_state_dict(self, state):
        self.samples, self.seen = state["samples"], list(state["seen"])


def test_a_replicated_object_changed_before_the_update_is_put_back_with_the_rank_local_ones(monkeypatch):
    """Redone after a failure, the interrupted step would count its samples twice (found by an outside script: a
    kill -9 gave 656 samples where the uninterrupted run had 640)."""
    rec = make(rank=0)
    model, opt, sched = trained()
    progress, position = Progress(), Progress()
    rec.manage({"model": model, "optimizer": opt, "scheduler": sched, "progress": progress}, rank_local=False)
    rec.manage({"position": position}, rank_local=True)
    World(rec, [None] + [blob(NO_FINGERPRINT, n) for n in ("n1", "n2", "n2")], monkeypatch)
    for step in range(3):
        rec.control.set_step(step)
        rec.begin_step()
        for obj in (progress, position):
            obj.samples += 16
            obj.seen.append(step)
        if step < 2:
            model(torch.ones(4, 3)).sum().backward()
            opt.step()
            sched.step()
    assert set(rec.ledger.object_copies) == {"scheduler", "progress"}  # not the model nor the optimizer
    rec.ledger.restore_objects()  # step 2 was interrupted before its update
    assert (progress.samples, progress.seen) == (32, [0, 1]) and (position.samples, position.seen) == (32, [0, 1])
    assert sched.last_epoch == 2


def test_an_lbfgs_step_whose_closure_saw_a_failure_is_void_and_put_back(monkeypatch):
    """(outside review s17) LBFGS runs forward, backward and collectives inside step(), after the refusal: a peer's
    failure during them left the parameters and the optimizer's history moved on a survivor that did not commit,
    and the replicas diverged after the recovery (state_mismatch). The update is now void and put back."""
    from worker.step_ledger import StepAborted

    rec = make(rank=0)
    model, _, _ = trained()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4, history_size=3)
    rec.manage({"model": model, "optimizer": opt}, rank_local=False)
    World(rec, [None] + [blob(NO_FINGERPRINT, n) for n in ("n1", "n2", "n2")], monkeypatch)
    x = torch.randn(8, 3, generator=torch.Generator().manual_seed(1))
    calls = []

    def closure(fail_at=None):
        calls.append(1)
        if len(calls) == fail_at:  # a collective of the closure failed: the mover latched it (here: tmd's halt)
            rec.control.on_halt(p.Halt(incident_id=1, reason="n2 lost", failed_ranks=[2, 3]))
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        return loss

    rec.control.set_step(0)
    rec.begin_step()
    opt.step(closure)  # no failure: committed as any step
    assert rec.ledger.committed(0)
    before = [t.clone() for t in model.parameters()]
    history = [t.clone() for t in opt.state_dict()["state"][0]["old_dirs"]]
    rec.control.set_step(1)
    rec.begin_step()
    calls.clear()
    with pytest.raises(StepAborted, match="update void"):
        opt.step(lambda: closure(fail_at=2))
    assert not rec.ledger.committed(1)
    assert not all(torch.equal(a, b) for a, b in zip(model.parameters(), before))  # the closure moved them
    rec.ledger.restore_closure_steps(1)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    restored = opt.state_dict()["state"][0]
    assert len(restored["old_dirs"]) == len(history) and all(
        torch.equal(a, b) for a, b in zip(restored["old_dirs"], history))


def test_a_step_without_a_closure_copies_nothing_and_a_failure_after_its_refusal_still_commits(monkeypatch):
    """torch calls a step pre-hook with step()'s args, the optimizer first: a plain ``opt.step()`` must not be
    taken for a closure step (it deep-copied every optimizer's state at every step, which failed on FSDP2's
    DTensors), and its update, once past the refusal, commits as before."""
    rec = make(rank=0)
    model, _, _ = trained()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    rec.manage({"model": model, "optimizer": opt}, rank_local=False)
    World(rec, [None] + [blob(NO_FINGERPRINT, n) for n in ("n1", "n2", "n2")], monkeypatch)
    x = torch.randn(8, 3, generator=torch.Generator().manual_seed(1))
    rec.control.set_step(0)
    rec.begin_step()
    model(x).pow(2).mean().backward()
    def peer_fails(o, a, k):  # once this step is past the refusal (its all-reduce done here)
        rec.control.on_halt(p.Halt(incident_id=1, reason="n2 lost", failed_ranks=[2, 3]))

    opt.register_step_pre_hook(peer_fails)
    opt.step()
    assert rec.ledger.closure_copies == [] and rec.ledger.committed(0)

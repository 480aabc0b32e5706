"""The void-pass stopper on its own (worker.void_passes): a DDP model's forward and backward passes stop once the
step is void, its reducer is reset for the redone step, and what is armed for the next backward pass runs once."""

import pytest
import torch

from tmd import protocol as p
from worker import void_passes
from worker.control import Attempt
from worker.step_ledger import StepAborted
from tests.unit.rank_rooms import WithUnused, make, world_of_one


@pytest.fixture(autouse=True)
def _no_pipelining_imported(monkeypatch):
    """The stopper leaves every pass alone once ``torch.distributed.pipelining`` is imported (worker.void_passes
    ``_stoppable``). torchtitan imports it whatever the layout, and test_torchtitan_integration imports torchtitan
    in this same process, so these tests of a plain DDP model take the module out of ``sys.modules`` meanwhile."""
    import sys

    monkeypatch.delitem(sys.modules, "torch.distributed.pipelining", raising=False)

pytestmark = pytest.mark.timeout(10)


def test_a_forward_pass_stops_once_the_step_is_void_and_only_within_a_step(monkeypatch):
    rec = make(rank=0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))
    ran = []
    for m in model:
        m.register_forward_pre_hook(rec.stopper.abort_forward)
        m.register_forward_hook(lambda m, a, out: ran.append(type(m).__name__))
    rec.control.set_step(4)
    rec.begin_step()
    model(torch.ones(2, 3))
    assert ran == ["Linear", "ReLU", "Linear"]
    ran.clear()
    def halt(module, args):  # the halt arrives while the first layer ran
        rec.control.on_halt(p.Halt(incident_id=1, reason="n2 lost", failed_ranks=[2, 3]))

    model[1].register_forward_pre_hook(halt, prepend=True)
    with pytest.raises(StepAborted, match="step 4: forward pass stopped, halted by tmd: n2 lost"):
        model(torch.ones(2, 3))
    assert ran == ["Linear"]  # neither the ReLU nor the second layer ran
    rec.stopper.in_step = False  # outside a step (an evaluation after the loop) nothing is stopped
    model(torch.ones(2, 3))
    assert len(ran) == 4


def test_only_a_plain_ddp_model_gets_its_forward_stopped():
    assert not void_passes._stoppable(torch.nn.Linear(2, 2))  # not DDP: its forward is the script's own


@pytest.mark.parametrize("find_unused", [False, True])
def test_a_ddp_backward_pass_stops_once_the_step_is_void_and_the_reset_reducer_runs_the_redone_step(world_of_one,
                                                                                                   find_unused):
    from torch.nn.parallel import DistributedDataParallel as DDP

    rec = make(rank=0)
    torch.manual_seed(0)
    module = WithUnused() if find_unused else torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.ReLU(),
                                                                  torch.nn.Linear(8, 1))
    model = DDP(module, find_unused_parameters=find_unused)
    assert void_passes._backward_stoppable(model)
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
    with pytest.raises(StepAborted, match="step 4: backward pass stopped, halted by tmd: n2 lost"):
        step(True)
    assert last.grad is not None and first.grad is None  # the rest of the backward pass did not run
    with pytest.raises(RuntimeError, match="finished reduction"):  # the reducer was left half-way
        model(torch.ones(2, 3))
    # what the recovery does before the step is redone: the incident ends, the reducer is reset, the gradients
    rec.control.recovered(Attempt(rec.control.halt, None))  # are put back
    rec.stopper.reset_reducers()
    model.zero_grad(set_to_none=True)
    step(False)
    assert all(torch.equal(q.grad, e) if e is not None else q.grad is None
               for q, e in zip(model.parameters(), expected))
    rec.stopper.in_step = False  # outside a step nothing is stopped
    rec.control.on_halt(p.Halt(incident_id=2, reason="n1 lost", failed_ranks=[0]))
    model(torch.ones(2, 3)).sum().backward()


def test_a_forward_stopped_after_a_no_sync_one_leaves_the_redone_step_syncing_buffers_as_a_fresh_model(world_of_one):
    """DDP broadcasts its buffers at a forward's start only when the previous forward synced. A survivor stopped in
    the synced micro-batch's forward, after a ``no_sync()`` one, kept the no_sync forward's False; a replacement
    (a fresh DDP model) has True: the redone step's first forward broadcast on one side only and every rank hung."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    rec = make(rank=0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 1))
    model = DDP(net)
    assert model.require_forward_param_sync  # fresh
    rec.manage({"model": model}, rank_local=False)
    rec.control.set_step(4)
    rec.begin_step()
    with model.no_sync():
        model(torch.ones(2, 3)).sum().backward()
    assert not model.require_forward_param_sync

    def halt(module, args):  # the halt arrives as the synced micro-batch's forward runs
        rec.control.on_halt(p.Halt(incident_id=1, reason="n2 lost", failed_ranks=[2, 3]))

    net[1].register_forward_pre_hook(halt, prepend=True)
    with pytest.raises(StepAborted, match="forward pass stopped"):
        model(torch.ones(2, 3))
    assert not model.require_forward_param_sync  # never reached DDP's post-forward
    rec.control.recovered(Attempt(rec.control.halt, None))
    rec.stopper.reset_reducers()
    assert model.require_forward_param_sync and model.will_sync_module_buffers()


def test_what_is_armed_for_the_next_backward_pass_runs_at_its_first_gradient_once(world_of_one):
    from torch.nn.parallel import DistributedDataParallel as DDP

    rec = make(rank=0)
    ran = []
    assert not rec.stopper.at_next_backward(lambda: ran.append(1))  # no managed DDP model: nothing to arm
    model = DDP(torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)))
    rec.manage({"model": model}, rank_local=False)
    loss = model(torch.ones(2, 3)).sum()
    assert rec.stopper.at_next_backward(lambda: ran.append(rec.stopper.in_step)) and ran == []
    loss.backward()
    assert ran == [False]  # once, though four parameters got gradients
    model(torch.ones(2, 3)).sum().backward()
    assert ran == [False]

    rec.stopper.at_next_backward(lambda: ran.append("void"))  # a void step runs nothing: it stays armed
    rec.control.set_step(4)
    rec.begin_step()
    rec.control.on_halt(p.Halt(incident_id=1, reason="n2 lost", failed_ranks=[2, 3]))
    with pytest.raises(StepAborted):
        model(torch.ones(2, 3))
    assert ran == [False]

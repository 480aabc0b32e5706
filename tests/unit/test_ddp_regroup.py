"""A joiner's DDP regrouping without an iteration (worker.ddp_regroup): found without a scan of every object,
before any step, and only for one plain DDP model."""

import pytest
import torch

from worker import ddp_regroup
from tests.unit.rank_rooms import WithUnused, world_of_one

pytestmark = pytest.mark.timeout(10)


def test_a_joiner_regroups_its_ddp_buckets_without_scanning_every_object(world_of_one, monkeypatch):
    """track_ddp_modules (a joiner, before its script builds anything) keeps each DDP as it is built, so
    regroup_ddp_buckets does not walk gc.get_objects() (~0.1 s for the demo GPT, on a failure's critical path)."""
    import gc

    from torch.nn.parallel import DistributedDataParallel as DDP

    import weakref

    monkeypatch.setattr(ddp_regroup, "_ddp_modules", weakref.WeakSet())  # none from the tests before
    ddp_regroup.track_ddp_modules()
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)))
    assert list(ddp_regroup._ddp_modules) == [model]

    def scanned():
        raise AssertionError("gc.get_objects() was called")

    monkeypatch.setattr(gc, "get_objects", scanned)
    assert not ddp_regroup.regroup_ddp_buckets()  # no backward pass yet: nothing to regroup from
    model(torch.randn(4, 3)).sum().backward()
    assert ddp_regroup.regroup_ddp_buckets() and model._has_rebuilt_buckets
    assert not ddp_regroup.regroup_ddp_buckets()  # regrouped already
    del model
    gc.collect()
    assert not list(ddp_regroup._ddp_modules)  # weak: a dropped model is not kept alive


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

    monkeypatch.setattr(ddp_regroup, "_ddp_modules", weakref.WeakSet())
    ddp_regroup.track_ddp_modules()
    assert ddp_regroup.ddp_to_regroup() == (True, None)  # no DDP: nothing to regroup
    torch.manual_seed(0)
    model = DDP(Reordered(), bucket_cap_mb=1e-6)  # a bucket per parameter
    reference = Reordered()
    reference.load_state_dict(model.module.state_dict())
    assert ddp_regroup.ddp_to_regroup() == (True, model)
    first_layout = [b.buffer().numel() for b in model.reducer._get_zeros_like_grad_buckets()]
    assert ddp_regroup.regroup_ddp_buckets(before_first=True) and model._has_rebuilt_buckets
    regrouped = [b.buffer().numel() for b in model.reducer._get_zeros_like_grad_buckets()]
    # DDP's first layout: one bucket; regrouped: one per parameter (the cap), in index order (a.weight, a.bias,
    # b.weight, b.bias), the proposal a world of one adopts
    assert first_layout == [41] and regrouped == [8, 1, 24, 8]
    assert ddp_regroup.ddp_to_regroup() == (True, None)
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

    monkeypatch.setattr(ddp_regroup, "_ddp_modules", weakref.WeakSet())
    ddp_regroup.track_ddp_modules()
    static = DDP(Reordered(), static_graph=True)
    assert ddp_regroup.ddp_to_regroup() == (False, None)  # a static graph regroups its own way
    del static
    gc.collect()
    kept = [DDP(WithUnused(), find_unused_parameters=True)]  # (the set is weak: the test holds its models)
    assert ddp_regroup.ddp_to_regroup() == (True, None)  # it never regroups: nothing to do
    kept += [DDP(Reordered()), DDP(Reordered())]
    assert ddp_regroup.ddp_to_regroup() == (False, None)  # which regroups first is the script's order
    assert not ddp_regroup.regroup_ddp_buckets(before_first=True)
    assert not any(m._has_rebuilt_buckets for m in kept[1:])

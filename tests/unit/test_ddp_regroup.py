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


def test_a_joiner_in_a_job_resumed_from_a_checkpoint_regroups_ddp_as_the_job_did(world_of_one, monkeypatch,
                                                                                  tmp_path):
    """A job resumed from a checkpoint regroups its DDP to the checkpoint's layout before its first step, answered
    without the network (worker.checkpointing.regroup_to), so its recording had no regrouping at all. A
    replacement then ran a shadow iteration, could not regroup from the recording and went live with DDP's first
    layout: its DDP made the regrouping's broadcasts live while the stayers all-reduced gradients (a wrong model
    on every rank, or a hang until gloo's timeout). And a joiner's first shadow iteration, on DDP's first layout,
    diverged from a recording made on the regrouped one. The session writes the regrouping at the start of the
    recording's step 0 and a joiner replays it before any iteration: a replacement runs no shadow iteration, a
    shadow iteration replays, and the joiner's buckets are the job's."""
    import datetime
    import threading
    import types
    import weakref

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from tmd import protocol as p
    from worker import backend as mb
    from worker import checkpointing, sandbox
    from worker.session import Session

    def layout(model):
        return [b.buffer().numel() for b in model.reducer._get_zeros_like_grad_buckets()]

    def session_of(group):
        session = object.__new__(Session)
        session._control = types.SimpleNamespace(rank=0)
        session._step_starts, session._record_writer = {}, None
        session._groups = types.SimpleNamespace(groups={name: group})
        return session

    monkeypatch.setattr(ddp_regroup, "_ddp_modules", weakref.WeakSet())
    ddp_regroup.track_ddp_modules()
    name = p.layout.WORLD_GROUP
    mb._register()  # (the session registers the mover's backend in worker.init)
    inner = dist.ProcessGroupGloo(dist.PrefixStore("job", dist.HashStore()), 0, 1, datetime.timedelta(seconds=10))
    pg = mb.new_mover_group([0], inner, mode=p.MoverMode.RECORD)
    torch.manual_seed(0)
    job = DDP(Reordered(), bucket_cap_mb=1e-6, process_group=pg)  # a bucket per parameter once regrouped
    first_layout = layout(job)
    buckets = [[2], [3], [0], [1]]  # the checkpoint's layout: b.weight, b.bias, a.weight, a.bias
    assert checkpointing.regroup_to(job, buckets) and layout(job) == [24, 8, 8, 1] != first_layout
    # what SessionCheckpoints.start keeps after that load; the session's recording of the job's first 3 steps
    session = session_of(types.SimpleNamespace(name=name, mover=mb.mover_of(pg), ranks=[0]))
    session._checkpoints = types.SimpleNamespace(regrouped=(pg, checkpointing.regrouping_ops(buckets)))
    for step in range(4):
        session._mark_recorded_step(step, 3, str(tmp_path))
        if step < 3:
            job(torch.randn(4, 3)).sum().backward()
    session._record_writer.join(10)
    assert isinstance(session._record_writer, threading.Thread) and not session._record_writer.is_alive()

    for replacement in (True, False):  # a failure's replacement (no shadow iteration), a joiner that runs one
        monkeypatch.setattr(ddp_regroup, "_ddp_modules", weakref.WeakSet())
        ddp_regroup.track_ddp_modules()
        replay = mb.new_mover_group([0], None, mode=p.MoverMode.REPLAY)
        mover = mb.mover_of(replay)
        recording = sandbox.start_replay(mover, str(tmp_path), 0, name, wait_s=0)
        torch.manual_seed(0)
        model = DDP(Reordered(), bucket_cap_mb=1e-6, process_group=replay)  # the joiner's script
        joiner = session_of(types.SimpleNamespace(name=name, mover=mover, ranks=[0], recording=recording))
        joiner._regroup_as_resumed()  # Session.steps, before any iteration
        assert layout(model) == layout(job)
        recordings = {name: recording}
        if replacement:
            assert sandbox.unsteady_from_start(recordings, {name: mover.replay_position}, {name}) == ""
            continue
        model(torch.randn(4, 3)).sum().backward()  # a shadow iteration on the job's buckets: it replays
        assert not ddp_regroup.regroup_ddp_buckets()  # nothing left to regroup
        assert sandbox.unsteady_after_first(recordings, {name: mover.replay_position}, {name}) == ""

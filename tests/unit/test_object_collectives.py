"""worker.object_collectives: torch.distributed's object collectives raise StepAborted, not a garbage unpickling
error, while a peer's failure is latched (outside review r01: all_gather_object's EOFError ended the plain loop)."""
from __future__ import annotations

import datetime

import pytest
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from tests.unit.rank_rooms import Groups, make
from worker import object_collectives
from worker.step_ledger import StepAborted


class _Latchable(Groups):
    why = None

    def failure(self):
        return self.why


@pytest.fixture
def installed(monkeypatch):
    """A rank whose groups' failure the test latches, with the object collectives installed over it (undone
    after the test)."""
    for name in object_collectives.NAMES:
        monkeypatch.setattr(dist, name, getattr(dist, name))
        monkeypatch.setattr(c10d, name, getattr(c10d, name))
    monkeypatch.setattr(object_collectives, "_control", None)
    groups = _Latchable()
    rec = make(rank=0, groups=groups)
    object_collectives.install(rec.control)
    return groups


def test_every_object_collective_refuses_to_start_while_a_failure_is_latched(installed):
    installed.why = "a collective failed: n2/0 is gone"
    for name in object_collectives.NAMES:
        assert getattr(dist, name) is getattr(c10d, name)  # torch's own callers get it too
        with pytest.raises(StepAborted, match=rf"torch.distributed.{name}: a peer's failure is latched \(a "
                                              r"collective failed: n2/0 is gone\)"):
            getattr(dist, name)([None])


def test_a_failure_latched_during_the_call_turns_its_error_or_its_result_into_step_aborted(installed):
    def unpickled_nothing(out):  # the peer died in the call: torch unpickles a zero-length buffer
        installed.why = "n2/0 is gone"
        raise EOFError("Ran out of input")

    with pytest.raises(StepAborted, match="n2/0 is gone") as caught:
        object_collectives.wrap(unpickled_nothing)([None])
    assert isinstance(caught.value.__cause__, EOFError)

    def returned_stale(out):  # completed without communicating: the objects are not the peers'
        installed.why = "n2/0 is gone"
        out[0] = "stale"

    with pytest.raises(StepAborted):
        object_collectives.wrap(returned_stale)([None])


def test_without_a_failure_the_call_is_torch_s(installed):
    def raises(out):
        raise ValueError("the script's own")

    with pytest.raises(ValueError, match="the script's own"):
        object_collectives.wrap(raises)([None])
    store = dist.HashStore()
    pg = dist.ProcessGroupGloo(dist.PrefixStore("objects", store), 0, 1, datetime.timedelta(seconds=10))
    out = [None]
    dist.all_gather_object(out, {"loss": 0.5}, group=pg)
    assert out == [{"loss": 0.5}]


def test_installing_twice_wraps_once(installed):
    first = dist.all_gather_object
    object_collectives.install(make(rank=0, groups=installed).control)
    assert dist.all_gather_object is first and first.tm_wrapped.__name__ == "all_gather_object"


"""The one rule for a DTensor's local shard (worker.dtensor): no collective, the shard's own storage and version
counter, a plain tensor passed through."""
import pytest
import torch

from worker import dtensor


def test_a_plain_tensor_is_its_own_shard():
    t = torch.ones(3)
    assert dtensor.local_shard(t) is t and not dtensor.is_dtensor(t)


def test_a_dtensor_s_local_shard_shares_storage_and_version_without_a_collective(mesh):
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.debug import CommDebugMode

    # from_local, not distribute_tensor: the fake group's scatter leaves the shard uninitialised (NaN at times)
    param = torch.nn.Parameter(DTensor.from_local(torch.arange(4.0).reshape(2, 2), mesh, [Shard(0)], run_check=False))
    with CommDebugMode() as comm:
        shard = dtensor.local_shard(param)
        layout = dtensor.dtensor_layout(param)
    assert comm.get_total_counts() == 0
    assert dtensor.is_dtensor(param) and type(shard) is torch.Tensor and not shard.requires_grad
    assert shard.shape == (2, 2) and layout == ((8, 2), ("S(0)",), (4,))
    assert shard.untyped_storage().data_ptr() == param.to_local().untyped_storage().data_ptr()
    before = param._local_tensor._version
    with torch.no_grad():
        shard.add_(1.0)  # an in-place change through the shard shows in the DTensor's own shard and its version
    assert param._local_tensor._version == before + 1 and torch.equal(param.to_local(), shard)
    with pytest.raises(AttributeError):
        dtensor.dtensor_layout(torch.ones(2))

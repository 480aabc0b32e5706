"""Fixtures of the unit tests."""
from __future__ import annotations

import pytest
import torch.distributed as dist

from tmd.protocol.keys import JobKeys


@pytest.fixture(scope="module")
def mesh():
    """A 1-D DeviceMesh of 4 ranks on torch's fake process group, this process standing for rank 1: its
    collectives do nothing, and CommDebugMode counts every one issued. Skips where a default process group
    exists already."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    try:
        yield init_device_mesh("cpu", (4,))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> JobKeys:
    """A fresh job's keys (tmd.protocol.keys), one set per test module."""
    return JobKeys.create(str(tmp_path_factory.mktemp("job") / "keys"))

"""worker.checkpointing on one process: a saver group that cannot be built (a peer lost at the step boundary where
it is built) is bounded and reported, and the rank trains on."""
from __future__ import annotations

import contextlib
import time

import pytest
import torch.distributed as dist

from tmd import protocol as p
from worker import checkpointing

pytestmark = pytest.mark.timeout(30)


def test_a_saver_group_whose_peer_never_comes_is_given_up_and_reported(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpointing, "GROUP_BUILD_TIMEOUT_S", 0.5)
    warned = []
    store = dist.HashStore()  # rank 1 of 2 never builds its side
    tier = checkpointing.SessionCheckpoints(
        checkpointing.Settings(root=str(tmp_path), every=5, job_id="j"), lambda: store, "127.0.0.1",
        lambda code, message: warned.append((code, message)), contextlib.nullcontext)
    began = time.monotonic()
    tier.after_commit(5, 0, 2, 3, {}, {})  # returns: the save is left undone, not the rank blocked for 600 s
    assert time.monotonic() - began < 10
    assert [code for code, _ in warned] == [p.WarningCode.CHECKPOINT_FAILED]
    assert warned[0][1].startswith("checkpoint at step 5 not saved: the saver group of generation 3 was not built "
                                   "within 0.5 s")
    tier.after_commit(10, 0, 2, 3, {}, {})  # the same generation: not tried again (its store keys are spent)
    assert len(warned) == 1

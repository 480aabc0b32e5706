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
    tier.after_commit(1, 0, 2, 3, {}, {})  # returns: the save is left undone, not the rank blocked for 600 s
    assert time.monotonic() - began < 10
    assert [code for code, _ in warned] == [p.WarningCode.CHECKPOINT_FAILED]
    assert warned[0][1].startswith("checkpoints of generation 3 not saved: its saver group was not built within "
                                   "0.5 s at step 1")
    tier.after_commit(5, 0, 2, 3, {}, {})  # the same generation: not tried again (its store keys are spent)
    assert len(warned) == 1


def test_the_saver_group_is_built_at_the_generations_first_step_not_at_its_first_save(tmp_path, monkeypatch):
    """A tmd killed between a generation's first step and its first due save takes its store with it: the saver
    group must have been built already, at the first committed step, while that store was up (built at the save,
    it waited 60 s for a dead store in the chaos soak)."""
    live, dead = dist.HashStore(), dist.HashStore()
    stores, built, saved = [live], [], []

    class Saver:  # worker.checkpoint.Checkpointer's part used here
        rank = 0

        def __init__(self, *args, **kwargs) -> None:
            pass

        def save(self, step, *args) -> None:
            saved.append(step)

    monkeypatch.setattr(checkpointing, "saver_group", lambda store, prefix, *a: built.append((store, prefix)))
    monkeypatch.setattr(checkpointing.checkpoint, "Checkpointer", Saver)
    tier = checkpointing.SessionCheckpoints(
        checkpointing.Settings(root=str(tmp_path), every=5, job_id="j"), lambda: stores[0], "127.0.0.1",
        lambda code, message: pytest.fail(message), contextlib.nullcontext)
    tier.after_commit(1, 0, 2, 0, {}, {})  # generation 0's first committed step
    stores[0] = dead  # tmd killed: a restarted one hosts another store
    for step in range(2, 11):
        tier.after_commit(step, 0, 2, 0, {}, {})
    assert built == [(live, "tm/ckpt/g0")] and saved == [5, 10]
    tier.after_commit(11, 0, 2, 1, {}, {})  # a new generation (a recovery, a migration): its own group, at once
    assert built[-1] == (dead, "tm/ckpt/g1")

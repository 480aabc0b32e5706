"""worker.checkpointing on one process: the saver group is built off the training thread, so a store that never
answers (tmd killed, its store gone) never holds a step up; every rank decides alike from the statuses the per-step
exchange gathered whether a due save is taken; a failed attempt is followed by another in the store the rank
holds then (a restarted tmd's), and saves resume."""
from __future__ import annotations

import contextlib
import datetime
import threading
import time

import pytest
import torch.distributed as dist

from tmd import protocol as p
from worker import checkpointing
from worker.checkpointing import BUILDING, FAILED, READY, agree

pytestmark = pytest.mark.timeout(30)


class DeadStore(dist.Store):
    """The store of a tmd killed with kill -9: nothing it is asked ever comes back (until :meth:`release`, which
    lets the waiting threads fail, as their timeout would)."""

    def __init__(self) -> None:
        super().__init__()
        self.released = threading.Event()

    def release(self) -> None:
        self.released.set()

    def _block(self):
        self.released.wait()
        raise dist.DistStoreError("the store is gone")

    def set(self, key, value) -> None:
        pass

    def get(self, key):
        self._block()

    def wait(self, keys, timeout=None) -> None:
        self._block()

    def check(self, keys) -> bool:
        return False

    def add(self, key, value) -> int:
        self._block()

    def set_timeout(self, timeout) -> None:
        pass

    @property
    def timeout(self):
        return datetime.timedelta(seconds=3600)


def fake_saver(saved: list):
    class Saver:  # worker.checkpoint.Checkpointer's part used here
        rank = 0

        def __init__(self, root, job_id, *, process_group, **kwargs) -> None:
            self.group = process_group

        def save(self, step, *args) -> None:
            saved.append((self.group.rank(), step))

        def wait(self) -> None:
            pass

    return Saver


def test_agree_takes_a_save_only_when_every_rank_built_the_same_attempt_of_this_generation():
    assert agree([[3, 0, READY], [3, 0, READY]], 3) == (0, 0)
    assert agree([[3, 0, READY], [3, 0, BUILDING]], 3) == (None, 0)  # wait for it
    assert agree([[3, 0, READY], [3, 0, FAILED]], 3) == (None, 1)  # one rank's failure: every rank tries again
    assert agree([[3, 1, BUILDING], [3, 0, FAILED]], 3) == (None, 1)  # (a rank behind catches up)
    assert agree([[3, 2, FAILED], [3, 2, BUILDING]], 3) == (None, 3)
    assert agree([[3, 0, READY], None], 3) == (None, 0)  # a rank that published nothing
    assert agree([[3, 0, READY], [2, 0, READY]], 3) == (None, 0)  # another generation's status does not count
    assert agree([[2, 0, READY], [2, 0, READY]], 3) == (None, 0)


def test_a_store_that_never_answers_holds_no_step_up_and_saves_resume_in_the_next_store(tmp_path, monkeypatch):
    """tmd killed as the generation's saver group is built (its store never answers), then resumed with a new
    store: no step waits on the dead store (it waited GROUP_BUILD_TIMEOUT_S = 60 s on the training thread, and no
    save was taken for the rest of the generation), the due saves meanwhile are skipped alike on both ranks and
    reported once, and saves resume, on both ranks at the same steps, once the ranks hold the new store."""
    monkeypatch.setattr(checkpointing, "RETRY_DELAY_S", 0.0)
    saved, warned = [], []
    monkeypatch.setattr(checkpointing.checkpoint, "Checkpointer", fake_saver(saved))
    dead, live = DeadStore(), dist.HashStore()
    stores = [dead, dead]  # the store each rank holds (worker.groups.GroupManager.store)
    tiers = [checkpointing.SessionCheckpoints(
        checkpointing.Settings(root=str(tmp_path), every=5, job_id="j"), lambda r=r: stores[r], "127.0.0.1",
        lambda code, message, r=r: warned.append((r, code, message)), contextlib.nullcontext) for r in range(2)]
    try:
        generation, longest, step = 4, 0.0, 0
        for step in range(1, 61):
            if step == 8:
                stores[0] = live  # tmd resumed: its Reregister reaches rank 0 ...
            if step == 10:
                stores[1] = live  # ... and rank 1 two steps later
            began = time.monotonic()
            agreed = [tier.status(r, 2, generation) for r, tier in enumerate(tiers)]  # the step's exchange
            for r, tier in enumerate(tiers):
                tier.after_commit(step, r, 2, generation, {}, {}, agreed)
            longest = max(longest, time.monotonic() - began)
            if len(saved) >= 4:
                break
            time.sleep(0.05)
        assert longest < 1.0  # never held up by the dead store
        assert [(r, code) for r, code, _ in warned] == [(0, p.WarningCode.CHECKPOINT_FAILED)]  # once, by rank 0
        assert warned[0][2].startswith("checkpoint at step 5 not saved: the saver group of generation 4 is not "
                                       "built yet on every rank (attempt:state by rank ['0:building', '0:building'])")
        steps = sorted({s for _, s in saved})
        assert len(steps) == 2 and all(s % 5 == 0 and s > 10 for s in steps)  # saves resumed
        assert sorted(saved) == sorted((r, s) for r in range(2) for s in steps)  # both ranks at the same steps
        assert tiers[0]._build.store is live and tiers[0]._build.attempt >= 1
    finally:
        dead.release()


def test_a_new_generation_starts_its_own_build_at_its_first_step(tmp_path, monkeypatch):
    started = []
    monkeypatch.setattr(checkpointing._Build, "start",
                        lambda self, store, delay: started.append((self.prefix, delay)) or self)
    tier = checkpointing.SessionCheckpoints(
        checkpointing.Settings(root=str(tmp_path), every=5, job_id="j"), dist.HashStore, "127.0.0.1",
        lambda code, message: None, contextlib.nullcontext)
    assert tier.status(0, 2, 0) == [0, 0, BUILDING] and tier.status(0, 2, 0) == [0, 0, BUILDING]
    tier.after_commit(1, 0, 2, 0, {}, {}, [[0, 0, BUILDING], [0, 0, FAILED]])  # rank 1 failed: every rank again
    assert tier.status(0, 2, 1) == [1, 0, BUILDING]  # a migration, a recovery: the new generation's own group
    assert started == [("tm/ckpt/g0/a0", 0.0), ("tm/ckpt/g0/a1", checkpointing.RETRY_DELAY_S),
                       ("tm/ckpt/g1/a0", 0.0)]
    assert checkpointing.SessionCheckpoints(checkpointing.Settings(root=str(tmp_path)), dist.HashStore, None,
                                            None, contextlib.nullcontext).status(0, 2, 0) is None  # no saves


def test_without_an_exchange_a_failed_build_skips_one_save_and_the_next_due_save_tries_again(tmp_path, monkeypatch):
    """No managed optimizer, no per-step exchange: the group is built at a due save on the training thread,
    bounded by GROUP_BUILD_TIMEOUT_S; a build that failed is tried again at the next due save (it disabled saves
    for the rest of the generation)."""
    monkeypatch.setattr(checkpointing, "GROUP_BUILD_TIMEOUT_S", 0.5)
    warned = []
    store = dist.HashStore()  # rank 1 of 2 never builds its side
    tier = checkpointing.SessionCheckpoints(
        checkpointing.Settings(root=str(tmp_path), every=5, job_id="j"), lambda: store, "127.0.0.1",
        lambda code, message: warned.append((code, message)), contextlib.nullcontext)
    began = time.monotonic()
    for step in range(1, 11):
        tier.after_commit(step, 0, 2, 3, {}, {})
    assert time.monotonic() - began < 10
    assert [code for code, _ in warned] == [p.WarningCode.CHECKPOINT_FAILED] * 2
    assert warned[0][1].startswith("checkpoint at step 5 not saved: the saver group of generation 3 was not built "
                                   "within 0.5 s")
    assert warned[1][1].startswith("checkpoint at step 10 not saved")

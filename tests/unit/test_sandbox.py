"""worker.sandbox: a joiner replaying a group recorded over other ranks (its script created its groups in another
order than the job's) is refused with a clear error before any op is replayed."""
from __future__ import annotations

import pytest
import torch

from tmd.protocol.layout import recording_path
from worker import backend as mb
from worker import sandbox


def _record(tmp_path, ranks):
    path = recording_path(str(tmp_path), 1, "pg1")
    torch.save({"version": sandbox.FORMAT_VERSION, "rank": 1, "group": "pg1", "ranks": ranks,
                "entries": [("allreduce", [torch.ones(2)])]}, path)


def test_a_group_recorded_over_other_ranks_is_refused(tmp_path):
    _record(tmp_path, [0, 2])
    mover = mb.MoverBackend(0, 2, None)
    with pytest.raises(ValueError, match=r"created over ranks \[0, 2\] by the job but over \[0, 1\] here"):
        sandbox.start_replay(mover, str(tmp_path), 1, "pg1", wait_s=0, ranks=[0, 1])
    assert mover.replay_remaining == 0  # nothing loaded


def test_the_same_ranks_replay(tmp_path):
    _record(tmp_path, [0, 2])
    mover = mb.MoverBackend(0, 2, None)
    assert sandbox.start_replay(mover, str(tmp_path), 1, "pg1", wait_s=0, ranks=[0, 2]) == 1
    assert mover.replay_remaining == 1

"""worker.sandbox: a joiner replaying a group recorded over other ranks (its script created its groups in another
order than the job's) is refused with a clear error before any op is replayed; the record of where each recorded
step began survives the file, and decides whether one shadow iteration is enough."""
from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from tmd.protocol.layout import recorded_groups, recording_path
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
    loaded = sandbox.start_replay(mover, str(tmp_path), 1, "pg1", wait_s=0, ranks=[0, 2])
    assert (loaded.ops, loaded.step_starts) == (1, [])  # written without step starts: no shortcut for it
    assert loaded.signatures == [("allreduce", (("torch.float32", (2,)),))]
    assert mover.replay_remaining == 1


def _op(n=2, op="allreduce"):
    return op, [torch.ones(n)]


def _recording(tmp_path, group, entries, starts, rank=1):
    torch.save({"version": sandbox.FORMAT_VERSION, "rank": rank, "group": group, "ranks": [0, 1],
                "entries": entries, "step_starts": starts}, recording_path(str(tmp_path), rank, group))
    return sandbox.start_replay(mb.MoverBackend(0, 2, None), str(tmp_path), rank, group, wait_s=0)


def test_the_recorded_step_starts_are_written_with_the_recording(tmp_path):
    gloo = dist.ProcessGroupGloo(dist.PrefixStore("sandbox", dist.HashStore()), 0, 1, datetime.timedelta(seconds=10))
    mover = mb.MoverBackend(0, 1, gloo)
    mover.set_mode("record")
    starts = []
    for step in range(3):  # what Session does at each boundary while the job records
        starts.append(mover.recorded_ops)
        mover.allreduce([torch.ones(3)]).wait()
        if step == 1:
            mover.broadcast([torch.ones(2)]).wait()
    assert starts == [0, 1, 3] and mover.recorded_ops == 4
    sandbox.save_recordings_async({"world": mover}, str(tmp_path), 0, {"world": [0]}, {"world": starts}).join()
    assert mover.recorded_ops == 0 and mover.mode == "live"
    loaded = sandbox.start_replay(mb.MoverBackend(0, 1, None), str(tmp_path), 0, "world", wait_s=0)
    assert (loaded.ops, loaded.step_starts) == (4, [0, 1, 3])
    assert [op for op, _ in loaded.signatures] == ["allreduce", "allreduce", "broadcast", "allreduce"]
    assert recorded_groups(str(tmp_path), 0) == {"world"} and recorded_groups(str(tmp_path), 1) == set()
    assert recorded_groups(str(tmp_path / "absent"), 0) == set()


def test_step_starts_that_do_not_fit_the_ops_are_refused(tmp_path):
    with pytest.raises(ValueError, match="do not fit its 1 ops"):
        _recording(tmp_path, "world", [_op()], [0, 2])
    with pytest.raises(ValueError, match="do not fit"):
        _recording(tmp_path, "world", [_op(), _op()], [1, 0])


def _steady(recs, positions, recorded=None):
    return sandbox.unsteady_after_first(recs, positions, set(recs) if recorded is None else recorded)


def test_one_shadow_iteration_is_enough_when_step_1_issues_what_step_2_does(tmp_path):
    # set-up: 1 op; step 0: 3 ops (a one-time broadcast first); steps 1 and 2: the same 2 ops
    entries = [_op(4, "broadcast"), _op(4, "broadcast"), _op(), _op(8), _op(), _op(8), _op(), _op(8)]
    rec = _recording(tmp_path, "world", entries, [1, 4, 6])
    assert _steady({"world": rec}, {"world": 4}) == ""
    # the joiner's first iteration replayed less than the job's step 0
    assert "replay at op 3, step 1 is ops 4..5" in _steady({"world": rec}, {"world": 3})
    # with a fourth recorded step, step 2 ends where step 3 begins
    rec4 = _recording(tmp_path, "world", entries + [_op(), _op(8)], [1, 4, 6, 8])
    assert _steady({"world": rec4}, {"world": 4}) == ""


def test_a_one_time_collective_in_step_1_needs_another_shadow_iteration(tmp_path):
    # DDP's regrouping (a broadcast at the start of step 1), or a collective of the script's own at step 1
    entries = [_op(), _op(8), _op(3, "broadcast"), _op(), _op(8), _op(), _op(8)]
    rec = _recording(tmp_path, "world", entries, [0, 2, 5])
    assert "step 1 issued other collectives (3 ops from op 2) than step 2 (2)" in _steady({"world": rec}, {"world": 2})
    # replayed past it (worker.ddp_regroup.regroup_ddp_buckets consumed the broadcast): the rest is steady
    assert _steady({"world": rec}, {"world": 3}) == ""
    # same ops, other shapes: another collective
    other = [_op(), _op(8), _op(), _op(9), _op(), _op(8)]
    assert "other collectives" in _steady({"world": _recording(tmp_path, "world", other, [0, 2, 4])}, {"world": 2})


def test_too_few_recorded_steps_or_a_group_created_later_need_another_shadow_iteration(tmp_path):
    entries = [_op(), _op(), _op()]
    two = _recording(tmp_path, "world", entries, [0, 1])
    assert "2 recorded step(s), 3 needed" in _steady({"world": two}, {"world": 1})
    old = _recording(tmp_path, "world", entries, [])
    assert "0 recorded step(s)" in _steady({"world": old}, {"world": 1})
    three = _recording(tmp_path, "world", entries, [0, 1, 2])
    assert _steady({"world": three}, {"world": 1}) == ""
    assert "group(s) pg3 recorded but not created" in _steady({"world": three}, {"world": 1}, {"world", "pg3"})
    assert "group pg2 is not replayed" in _steady({"world": three, "pg2": None}, {"world": 1, "pg2": 0})


def _from_start(recs, positions, recorded=None, regroup=None):
    return sandbox.unsteady_from_start(recs, positions, set(recs) if recorded is None else recorded, regroup, 2)


def test_a_replacement_runs_no_shadow_iteration_when_steps_0_1_and_2_are_alike(tmp_path):
    # set-up: 1 op; steps 0, 1 and 2: the same 2 ops
    entries = [_op(4, "broadcast")] + [_op(), _op(8)] * 3
    rec = _recording(tmp_path, "world", entries, [1, 3, 5])
    assert _from_start({"world": rec}, {"world": 1}) == ""
    # the script's set-up replayed other ops than the job's: its first step would not be the job's
    assert "replay at op 0 after the set-up, the job's step 0 began at 1" in _from_start({"world": rec}, {"world": 0})
    # a collective of step 0 only (a statistic the first iteration of a process computes)
    once = [_op(4, "broadcast"), _op(), _op(3, "broadcast"), _op(8)] + [_op(), _op(8)] * 2
    rec = _recording(tmp_path, "world", once, [1, 4, 6])
    assert "step 0 issued other collectives (3 ops) than step 2 (2)" in _from_start({"world": rec}, {"world": 1})


def test_ddp_s_first_bucket_layout_and_its_regrouping_are_allowed_for_its_own_group_only(tmp_path):
    # DDP: step 0 reduces one bucket of 12; step 1 begins with the regrouping's two broadcasts, then reduces the
    # regrouped buckets of 4 and 8 (torch's Reducer::rebuild_buckets), as step 2 does; the rank-state exchange
    # (an allgather) follows each step's reduction
    gather = ("allgather", [torch.ones(1)])
    entries = [_op(4, "broadcast"), _op(12), gather, _op(5, "broadcast"), _op(2, "broadcast"), _op(4), _op(8),
               gather, _op(4), _op(8), gather]
    rec = _recording(tmp_path, "world", entries, [1, 3, 8])
    assert _from_start({"world": rec}, {"world": 1}, regroup="world") == ""
    assert "step 0 issued other collectives (2 ops) than step 2 (3)" in _from_start({"world": rec}, {"world": 1})
    assert "is not one of this rank's groups" in _from_start({"world": rec}, {"world": 1}, regroup="pg2")
    # the buckets of step 0 reduced less than step 2's: not DDP's layout alone
    short = entries[:1] + [_op(11)] + entries[2:]
    rec = _recording(tmp_path, "world", short, [1, 3, 8])
    assert "step 0 issued other" in _from_start({"world": rec}, {"world": 1}, regroup="world")
    # step 1 begins with something else than the regrouping's broadcasts (a collective of the script's own)
    other = entries[:3] + [_op(5, "allgather"), _op(2, "broadcast")] + entries[5:]
    rec = _recording(tmp_path, "world", other, [1, 3, 8])
    assert "step 1 issued other collectives (5 ops, 2 of them regrouping DDP) than step 2 (3)" in \
        _from_start({"world": rec}, {"world": 1}, regroup="world")


def test_a_replacement_s_missing_groups_or_short_recordings_need_a_shadow_iteration(tmp_path):
    entries = [_op(), _op(), _op()]
    three = _recording(tmp_path, "world", entries, [0, 1, 2])
    assert _from_start({"world": three}, {"world": 0}) == ""
    two = _recording(tmp_path, "world", entries, [0, 1])
    assert "2 recorded step(s), 3 needed" in _from_start({"world": two}, {"world": 0})
    assert "pg3 recorded but not created before the first step" in \
        _from_start({"world": three}, {"world": 0}, {"world", "pg3"})
    assert "group pg2 is not replayed" in _from_start({"world": three, "pg2": None}, {"world": 0, "pg2": 0})


def test_a_static_graph_s_regrouping_in_step_2_needs_a_third_shadow_iteration(tmp_path):
    # DDP(static_graph=True), as recorded by the job (tests' outside review r05): steps 0 and 1 reduce their
    # gradients, step 2 begins with the regrouping's two broadcasts, then reduces them in the regrouped buckets
    gather, used = ("allgather", [torch.ones(1)]), ("allreduce", [torch.ones(4, dtype=torch.int32)])
    entries = [_op(4, "broadcast"), used, _op(12), gather, _op(12), gather,
               _op(5, "broadcast"), _op(2, "broadcast"), _op(4), _op(8), gather]
    rec = _recording(tmp_path, "world", entries, [1, 4, 6])
    assert sandbox.new_ops_at({"world": rec}, 2) == \
        "group world: the job's step 2 issued 2 collective(s) (broadcast) that its step 1 did not"
    assert sandbox.new_ops_at({"world": rec}, 1) == ""  # step 1 did less than step 0: nothing new
    assert sandbox.new_ops_at({"world": rec}, 3) == ""  # no step 3 recorded
    # plain DDP: the regrouping's broadcasts in step 1, step 2 reduces the same gradients: two are enough
    plain = [_op(4, "broadcast"), _op(12), gather, _op(5, "broadcast"), _op(2, "broadcast"), _op(4), _op(8),
             gather, _op(4), _op(8), gather]
    assert sandbox.new_ops_at({"world": _recording(tmp_path, "world", plain, [1, 3, 8])}, 2) == ""
    assert sandbox.new_ops_at({"world": None}, 2) == ""


def test_replay_seeks_within_the_recording_only(tmp_path):
    mover = mb.MoverBackend(0, 1, None)
    mover.load_recording([("allreduce", [torch.full((2,), float(i))]) for i in range(3)])
    mover.set_mode("replay")
    mover.seek_replay(2)
    assert (mover.replay_position, mover.replay_remaining) == (2, 1)
    out = torch.zeros(2)
    mover.allreduce([out]).wait()
    assert out.tolist() == [2.0, 2.0]  # the op seeked to
    mover.seek_replay(0)
    assert mover.replay_position == 0
    with pytest.raises(RuntimeError, match="outside the recording"):
        mover.seek_replay(4)
    with pytest.raises(RuntimeError, match="outside the recording"):
        mover.seek_replay(-1)
    assert mover.replay_position == 0

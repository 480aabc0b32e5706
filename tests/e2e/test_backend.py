"""The mover Backend (csrc/, worker.backend): swap under DDP, record/replay, abort, counters.

Multi-rank tests start real processes (world size 2, forked from a fork server that imported torch once) that meet
on a TCPStore hosted by the test process.
"""
from __future__ import annotations

import datetime
import hashlib
import os
import re
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.support.forked import forkserver
from worker import backend as mb

HOST = "127.0.0.1"
GLOO_TIMEOUT_S = 30.0


# --- harness -------------------------------------------------------------------------------------------------
def _entry(rank: int, fn, world_size: int, port: int, out_dir: str, args: tuple) -> None:
    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # the plain gloo reference group binds to loopback too
    store = dist.TCPStore(HOST, port, world_size, False, timeout=datetime.timedelta(seconds=30))
    result = fn(rank, world_size, store, *args)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    if dist.is_initialized():
        dist.destroy_process_group()


def run_ranks(fn, out_dir, *args, world_size: int = 2, timeout_s: float = 40.0) -> list:
    """Run ``fn(rank, world_size, store, *args)`` in ``world_size`` spawned processes; return their results.
    A child's exception is re-raised here (with its traceback) and the other children are killed."""
    store = dist.TCPStore(HOST, 0, None, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
    ctx = mp.start_processes(_entry, args=(fn, world_size, store.port, str(out_dir), args), nprocs=world_size,
                             join=False, start_method=forkserver(__name__))
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks still running after {timeout_s:.0f} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=True) for r in range(world_size)]


def gloo(store, prefix: str, rank: int, size: int):
    return mb.build_gloo(store, prefix, rank, size, GLOO_TIMEOUT_S, HOST)


def sha256(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


# --- 1. swap under DDP -----------------------------------------------------------------------------------------
STEPS, BUILD_AT, SWAP_AT = 8, 2, 5


def _train(rank: int, before_step=lambda step: None) -> list:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        before_step(step)
        g = torch.Generator().manual_seed(1000 * rank + step)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _ddp_swap(rank: int, ws: int, store) -> dict:
    import torch.distributed._functional_collectives as funcol

    dist.init_process_group("gloo", store=dist.PrefixStore("ref", store), rank=rank, world_size=ws)
    reference = _train(rank)
    dist.destroy_process_group()

    first = gloo(store, "tm/g0/", rank, ws)
    mover = mb.init_mover_world(dist.PrefixStore("mover", store), rank, ws, first)
    assert mb.mover_of() is mover and dist.get_backend() == "tmover" and mover.inner is first
    builder: list[threading.Thread] = []
    built: list = []
    errors: list[BaseException] = []

    def build_and_stage() -> None:  # phase 1, on a background thread while training goes on
        try:
            built.append(gloo(store, "tm/g1/", rank, ws))
            mover.stage(built[0])
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def before_step(step: int) -> None:
        if step == BUILD_AT:
            builder.append(threading.Thread(target=build_and_stage))
            builder[0].start()
        elif step == SWAP_AT:
            builder[0].join()
            assert not errors, errors
            assert mover.commit() == 1  # phase 2, between two iterations

    issued_before = mover.counters()["ops_issued"]
    swapped = _train(rank, before_step)
    assert mover.generation == 1 and not mover.has_staged() and mover.inner is built[0]
    del first, built  # the retired inner is destroyed on a C++ thread once this was its last reference

    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t)
    f = funcol.all_reduce(torch.full((3,), float(rank + 1)), "sum", dist.group.WORLD)
    f = funcol.wait_tensor(f)
    total = float(ws * (ws + 1) // 2)
    counters = mover.counters()
    return {"reference": sha256(reference), "swapped": sha256(swapped),
            "equal": all(torch.equal(a, b) for a, b in zip(reference, swapped)),
            "all_reduce_ok": bool(torch.all(t == total)), "funcol_ok": bool(torch.all(f == total)),
            "ops": counters["ops_issued"] - issued_before, "failed": counters["ops_failed"]}


@pytest.mark.timeout(90)
def test_swap_under_ddp_keeps_results_bit_identical(tmp_path):
    results = run_ranks(_ddp_swap, tmp_path, timeout_s=80)
    for r in results:
        assert r["equal"] and r["reference"] == r["swapped"], r
        assert r["all_reduce_ok"] and r["funcol_ok"], r
        assert r["ops"] >= STEPS + 2 and r["failed"] == 0, r  # DDP's allreduces really went through the mover
    assert results[0]["swapped"] == results[1]["swapped"]  # DDP replicas agree


# --- 2. record, then replay --------------------------------------------------------------------------------------
def _collectives(rank: int, ws: int, replaying: bool) -> list:
    """A fixed sequence of different collectives through the default group; returns every output."""
    g = torch.Generator().manual_seed(rank)
    outs = []
    t = torch.randn(6, generator=g)
    dist.all_reduce(t)
    outs.append(t)
    b = torch.randn(5, generator=g, dtype=torch.float64)
    dist.broadcast(b, src=0)
    outs.append(b)
    gathered = [torch.empty(3, dtype=torch.int64) for _ in range(ws)]
    dist.all_gather(gathered, torch.randint(0, 1000, (3,), generator=g))
    outs += gathered
    flat = torch.empty(4 * ws)
    dist.all_gather_into_tensor(flat, torch.randn(4, generator=g))
    outs.append(flat)
    shard = torch.empty(2)
    dist.reduce_scatter_tensor(shard, torch.randn(2 * ws, generator=g))
    outs.append(shard)
    if rank == 0:
        send = dist.isend(torch.randn(3, generator=g), dst=1)
        assert send.is_completed() or not replaying  # replay: sends complete at once
        send.wait()
    elif rank == 1:
        r = torch.empty(3)
        dist.recv(r, src=0)
        outs.append(r)
    barrier = dist.barrier(async_op=True)
    assert barrier.is_completed() or not replaying  # replay: barriers complete at once
    barrier.wait()
    return outs


def _record_replay(rank: int, ws: int, store) -> dict:
    mover = mb.init_mover_world(store, rank, ws, gloo(store, "rec/", rank, ws), mode="record")
    live = [t.clone() for t in _collectives(rank, ws, replaying=False)]
    live_ddp = _train(rank)  # DDP steps too: its comm hook reads the replayed futures
    mover.set_mode("live")
    recording = mover.take_recording()
    dist.destroy_process_group()

    replayer = mb.init_mover_world(dist.PrefixStore("replay", store), rank, ws, None, mode="replay")
    assert replayer is not mover and replayer.inner is None
    replayer.load_recording(recording)
    replayed = _collectives(rank, ws, replaying=True)
    replayed_ddp = _train(rank)
    return {"ops": [op for op, _ in recording], "remaining": replayer.replay_remaining,
            "live": live + live_ddp, "replayed": replayed + replayed_ddp}


@pytest.mark.timeout(60)
def test_record_then_replay_reproduces_outputs_exactly(tmp_path):
    results = run_ranks(_record_replay, tmp_path)
    expected_ops = ["allreduce", "broadcast", "allgather", "_allgather_base", "_reduce_scatter_base"]
    assert results[0]["ops"][:5] == expected_ops  # send and barrier are not recorded
    assert results[1]["ops"][:6] == expected_ops + ["recv"]
    assert results[0]["ops"].count("allreduce") >= 1 + STEPS  # then DDP's
    for r in results:
        assert r["remaining"] == 0
        assert len(r["live"]) == len(r["replayed"])
        for a, b in zip(r["live"], r["replayed"]):
            assert a.dtype == b.dtype and a.shape == b.shape
            assert a.numpy().tobytes() == b.numpy().tobytes()
    assert torch.equal(results[0]["live"][0], results[1]["live"][0])  # a real allreduce happened


# --- 3. divergence ---------------------------------------------------------------------------------------------
@pytest.mark.timeout(30)
def test_diverging_replay_raises_clearly():
    mover = mb.MoverBackend(0, 2)
    mover.load_recording([("allreduce", [torch.ones(1024)]),
                          ("broadcast", [torch.zeros(2, 3, dtype=torch.float64)])])
    mover.set_mode("replay")
    assert (mover.replay_position, mover.replay_remaining) == (0, 2)

    msg = "replay diverged at op #0: recorded allreduce[float32(1024)] but got broadcast[float32(512)]"
    with pytest.raises(RuntimeError, match=re.escape(msg)):
        mover.broadcast(torch.zeros(512), 0)
    assert mover.replay_position == 0  # a diverging op consumes nothing

    x = torch.zeros(1024)
    mover.allreduce([x]).wait()
    assert torch.equal(x, torch.ones(1024)) and mover.replay_position == 1
    assert mover.barrier().is_completed() and mover.send([x], 1, 0).is_completed()
    assert mover.replay_position == 1  # barrier and send consume no record entry

    msg = "replay diverged at op #1: recorded broadcast[float64(2, 3)] but got broadcast[float64(3, 2)]"
    with pytest.raises(RuntimeError, match=re.escape(msg)):
        mover.broadcast(torch.zeros(3, 2, dtype=torch.float64), 0)
    with pytest.raises(RuntimeError, match=re.escape("but got broadcast[float32(2, 3)]")):
        mover.broadcast(torch.zeros(2, 3), 0)  # same shape, other dtype
    mover.broadcast(torch.ones(2, 3, dtype=torch.float64), 0).wait()
    with pytest.raises(RuntimeError, match=re.escape("replay diverged at op #2: recording exhausted")):
        mover.allreduce([x])
    c = mover.counters()
    assert (c["ops_completed"], c["ops_failed"]) == (4, 4)


@pytest.mark.timeout(30)
def test_bypass_completes_barrier_and_p2p_at_once():
    mover = mb.MoverBackend(0, 2)  # no inner: anything forwarded would raise
    mover.set_mode("bypass")
    t = torch.full((3,), 7.0)
    assert mover.barrier().is_completed()
    assert mover.send([t], 1, 0).is_completed()
    assert mover.recv([t], 1, 0).is_completed() and torch.equal(t, torch.full((3,), 7.0))
    with pytest.raises(RuntimeError, match="no inner backend"):
        mover.allreduce([t])


# --- 4. abort ----------------------------------------------------------------------------------------------------
def _abort(rank: int, ws: int, store) -> dict:
    mover = mb.MoverBackend(rank, ws, gloo(store, "ab/g0/", rank, ws))
    out = {}
    if rank == 0:
        work = mover.allreduce([torch.ones(4)])  # rank 1 never joins this one
        fut = work.get_future()
        assert mover.counters()["pending"] == 1
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="did not complete within 300 ms"):
            work.wait(datetime.timedelta(milliseconds=300))  # the timeout is honoured
        out["timeout_s"] = time.monotonic() - started
        issued = threading.Event()
        aborted = {}

        def aborter() -> None:
            issued.wait()
            time.sleep(0.2)  # let the main thread block in wait()
            aborted["at"] = time.monotonic()
            aborted["count"] = mover.abort("test-reason")

        thread = threading.Thread(target=aborter)
        thread.start()
        issued.set()
        with pytest.raises(RuntimeError, match="test-reason"):
            work.wait()
        raised_at = time.monotonic()
        thread.join()
        out["release_s"] = raised_at - aborted["at"]
        out["count"] = aborted["count"]
        with pytest.raises(RuntimeError, match="test-reason"):
            fut.wait()
        assert mover.aborted
        with pytest.raises(RuntimeError, match="mover backend aborted: test-reason"):
            mover.allreduce([torch.ones(4)])
        c = mover.counters()
        out["pending"], out["failed"] = c["pending"], c["ops_failed"]
        store.set("rank0-aborted", "1")
    else:
        store.wait(["rank0-aborted"])
    mover.stage(gloo(store, "ab/g1/", rank, ws))
    out["generation"] = mover.commit()
    out["aborted_after_commit"] = mover.aborted
    t = torch.full((2,), float(rank + 1))
    mover.allreduce([t]).wait()
    out["sum"] = t.tolist()
    return out


@pytest.mark.timeout(60)
def test_abort_releases_blocked_wait(tmp_path):
    r0, r1 = run_ranks(_abort, tmp_path)
    assert r0["release_s"] < 1.0, r0
    assert 0.3 <= r0["timeout_s"] < 1.3, r0
    assert r0["count"] == 1 and r0["pending"] == 0 and r0["failed"] == 1
    for r in (r0, r1):
        assert r["generation"] == 1 and not r["aborted_after_commit"]
        assert r["sum"] == [3.0, 3.0]  # the committed inner works again


def _fail(rank: int, ws: int, store) -> dict:
    mover = mb.MoverBackend(rank, ws, gloo(store, "fl/g0/", rank, ws))
    mover.tolerant = True
    out = {}
    if rank == 0:
        t = torch.ones(4)
        work = mover.allreduce([t])  # rank 1 never joins this one: blocked as on a lost peer
        threading.Timer(0.2, lambda: out.update(released=mover.fail("peer lost"))).start()
        work.wait()  # returns, no error: the step goes on and is refused at the optimizer
        out["after_fail"] = t.tolist()
        out["failure"] = mover.failure
        u = torch.ones(2)
        mover.allreduce([u]).wait()  # completes at once, without the network
        out["skipped"], out["later"] = mover.counters()["ops_skipped"], u.tolist()
    store.set(f"rank{rank}-ready", "1")
    store.wait(["rank0-ready", "rank1-ready"])
    mover.stage(gloo(store, "fl/g1/", rank, ws))
    mover.commit()  # clears the latch; rank 1 drops its old inner: rank 0's abandoned op now fails, late
    if rank == 0:
        out["drained"] = mb.wait_for_background(20.0)
    store.set(f"rank{rank}-drained", "1")
    store.wait(["rank0-drained", "rank1-drained"])
    out["failure_after_commit"] = mover.failure  # that late error of generation 0 latches nothing
    t = torch.full((2,), float(rank + 1))
    mover.allreduce([t]).wait()
    out["sum"] = t.tolist()
    return out


@pytest.mark.timeout(60)
def test_fail_latch_releases_blocked_op_and_skips_until_commit(tmp_path):
    r0, r1 = run_ranks(_fail, tmp_path)
    assert r0["released"] == 1 and r0["after_fail"] == [1.0] * 4 and r0["failure"] == "peer lost"
    assert r0["skipped"] == 1 and r0["later"] == [1.0, 1.0]
    assert r0["drained"]
    for r in (r0, r1):
        assert r["failure_after_commit"] is None and r["sum"] == [3.0, 3.0]


# --- 5. counters, stage checks -------------------------------------------------------------------------------------
@pytest.mark.timeout(30)
def test_counters_and_stage_checks():
    store = dist.HashStore()
    mover = mb.MoverBackend(0, 1, gloo(store, "c/g0/", 0, 1))
    c = mover.counters()
    assert (c["ops_issued"], c["ops_completed"], c["busy_s"], c["last_op_start_s"], c["generation"], c["mode"]) \
        == (0, 0, 0.0, 0.0, 0, "live")
    before = time.time()
    for _ in range(5):
        mover.allreduce([torch.ones(10_000)]).wait()
    mover.barrier().wait()
    c = mover.counters()
    assert (c["ops_issued"], c["ops_completed"], c["ops_failed"], c["pending"]) == (6, 6, 0, 0)
    assert c["busy_s"] > 0 and c["blocked_s"] > 0
    assert before <= c["last_op_start_s"] <= c["last_op_end_s"] <= time.time()

    with pytest.raises(ValueError, match="rank 0 of 1"):
        mb.MoverBackend(0, 2).stage(gloo(store, "c/g1/", 0, 1))
    with pytest.raises(ValueError):
        mb.MoverBackend(1, 2, gloo(store, "c/g2/", 0, 1))
    with pytest.raises(RuntimeError, match="nothing staged"):
        mover.commit()
    with pytest.raises(ValueError, match="unknown mover mode"):
        mover.set_mode("fast")

    mover.stage(gloo(store, "c/g3/", 0, 1))
    assert mover.has_staged() and mover.discard_staged() and not mover.discard_staged()
    mover.stage(gloo(store, "c/g4/", 0, 1))
    assert mover.commit() == 1 and mover.generation == 1 and mover.counters()["generation"] == 1
    t = torch.ones(3)
    mover.allreduce([t]).wait()
    assert mover.counters()["ops_completed"] == 7


@pytest.mark.timeout(60)
def test_counters_from_another_thread_never_deadlock_with_replay():
    """The agent thread reads counters() (GIL held by the caller) while the training thread replays ops and
    drops Python-owned tensors inside the backend (GIL released). Waiting for the backend's mutex with the GIL
    held once deadlocked a joiner; every binding must release the GIL before it locks."""
    mover = mb.MoverBackend(0, 2)
    stop = threading.Event()
    reads = [0]

    def poll() -> None:
        while not stop.is_set():
            mover.counters()
            _ = (mover.mode, mover.generation, mover.replay_position, mover.aborted, mover.has_staged())
            reads[0] += 1

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        for _ in range(30):
            mover.load_recording([("allreduce", [torch.randn(64)]) for _ in range(50)])
            mover.set_mode("replay")
            for _ in range(50):
                mover.allreduce([torch.empty(64)]).wait()  # the output tensor dies right away
            mover.load_recording([])  # drops the recorded tensors (Python-created)
    finally:
        stop.set()
        poller.join(timeout=10)
    assert not poller.is_alive() and reads[0] > 0
    assert mover.counters()["ops_completed"] == 30 * 50


@pytest.mark.timeout(10)
def test_inner_backend_choice(monkeypatch):
    monkeypatch.delenv("TM_INNER_BACKEND", raising=False)
    assert mb.inner_kind() == ("nccl" if torch.cuda.is_available() else "gloo")
    monkeypatch.setenv("TM_INNER_BACKEND", "gloo")
    assert mb.inner_kind() == "gloo"
    monkeypatch.setenv("TM_INNER_BACKEND", "mpi")
    with pytest.raises(ValueError, match="TM_INNER_BACKEND must be gloo or nccl"):
        mb.inner_kind()

"""Sharded state (DTensors) moves leaver -> joiner exactly: worker.transfer with FSDP2 and tensor parallel.

One start of 4 gloo ranks (1 thread each, a TCPStore hosted by the test process; forked from a fork server that
imported torch once) runs both layouts in turn:
``fsdp`` (fully_shard over a 1-D mesh of 4) and ``tp_fsdp`` (ColwiseParallel/RowwiseParallel over "tp", then
fully_shard over "dp" of a (2, 2) mesh). In each, every rank trains a model A and a differently seeded model B two
steps with AdamW, then:

1. across processes: rank 1 sends A's model and optimizer state to rank 3 over a 2-rank gloo group
   (``dist.new_group([1, 3], backend="gloo")``); rank 3 loads it into B. Rank 3's local shards of B must then be
   byte-identical (sha256) to rank 1's of A, and one more training step runs on every rank;
2. at the same mesh coordinate (what a joiner is: a new process at the leaver's rank): each rank sends A's state
   over an in-process 2-rank gloo pair to a freshly built model J whose optimizer never stepped, loads it, checks
   every local shard equal, then trains A and J one more step on the same data: still bit-identical;
3. refusals: a receiver whose optimizer's parameters have other placements (fsdp: Shard(1)) or another shape
   (tp_fsdp: a wider hidden layer) raises TransferRefused, a model with other keys raises KeyError, and neither
   changes a byte of the receiver's model or optimizer.

Send, receive and load run inside CommDebugMode: no collective may be issued (the transfer group's own send/recv
are the only communication).
"""
from __future__ import annotations

import concurrent.futures as cf
import datetime
import gc
import hashlib
import json
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.support.forked import forkserver

HOST = "127.0.0.1"
WORLD = 4
LAYOUTS = ("fsdp", "tp_fsdp")
TIMEOUT = datetime.timedelta(seconds=60)

pytestmark = pytest.mark.timeout(150)


# --- what every rank runs -------------------------------------------------------------------------------------
def _build(layout: str, mesh, seed: int, hidden: int = 16, shard_dim: int = 0, extra_layer: bool = False):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(seed)
    layers = [torch.nn.Linear(8, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 8)]
    if extra_layer:
        layers.append(torch.nn.Linear(8, 8))
    model = torch.nn.Sequential(*layers)
    if layout == "fsdp":
        fully_shard(model, mesh=mesh, shard_placement_fn=lambda param: Shard(shard_dim if param.ndim > 1 else 0))
    else:
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _train_step(model, opt, dp: int, k: int) -> float:
    g = torch.Generator().manual_seed(1000 * k + dp)  # data: a function of the step and the dp coordinate
    loss = model(torch.randn(4, 8, generator=g)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _hashes(objects: dict) -> dict:
    """sha256 of every tensor's bytes in the objects' state_dicts (a DTensor's local shard), by path."""
    from torch.distributed.tensor import DTensor

    out = {}

    def walk(node, path):
        if isinstance(node, torch.Tensor):
            t = node.to_local() if isinstance(node, DTensor) else node
            out[path] = hashlib.sha256(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()
        elif isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{path}/{k}")
        elif isinstance(node, (list, tuple)):
            for i, v in enumerate(node):
                walk(v, f"{path}/{i}")

    for name, obj in objects.items():
        walk(obj.state_dict(), name)
    return out


def _no_collectives(fn):
    """fn()'s result and the collectives it issued (CommDebugMode; a transfer group's send/recv left out)."""
    from torch.distributed.tensor.debug import CommDebugMode

    with CommDebugMode() as comm:
        result = fn()
    issued = {str(op): n for op, n in comm.get_comm_counts().items() if not str(op).startswith(("c10d.send",
                                                                                                 "c10d.recv"))}
    return result, issued


def _pair():
    """The two ends (rank 0, rank 1) of a gloo group inside this process, on two threads."""
    store = dist.HashStore()
    with cf.ThreadPoolExecutor(2) as ex:
        return list(ex.map(lambda r: dist.ProcessGroupGloo(store, r, 2, TIMEOUT), [0, 1]))


def _move_in_process(src: dict, dst: dict) -> tuple[dict, Exception | None]:
    """Send ``src``'s state to ``dst`` over an in-process pair and load it; (collectives issued, error)."""
    from worker import transfer

    a, b = _pair()
    with cf.ThreadPoolExecutor(1) as ex:
        sent = ex.submit(transfer.send_state, a, src, {"step": 2})
        states, extra, _, _ = transfer.recv_state(b, 0, transfer.pretouch(transfer.plan_buffers(dst)))
        sent.result()
    assert extra == {"step": 2}
    try:
        _, issued = _no_collectives(lambda: transfer.load_state(dst, states))
    except (KeyError, transfer.TransferRefused) as e:
        return {}, e
    return issued, None


def _layout_run(layout: str, rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from worker import misuse, rank_state, transfer

    if layout == "fsdp":
        mesh = init_device_mesh("cpu", (WORLD,))
        dp = rank
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dp = mesh["dp"].get_local_rank()
    gc.collect()  # the previous layout's modules: misuse.check scans the garbage collector's objects
    out: dict = {}
    model_a, opt_a = _build(layout, mesh, seed=0)
    model_b, opt_b = _build(layout, mesh, seed=1)
    for k in range(2):
        _train_step(model_a, opt_a, dp, k)
        _train_step(model_b, opt_b, dp, 100 + k)
    a = {"model": model_a, "optimizer": opt_a}
    b = {"model": model_b, "optimizer": opt_b}
    out["misuse"] = repr(misuse.check(a | {"model_b": model_b}))

    # 1. rank 1 -> rank 3 across processes (equal local shapes: the layouts shard evenly)
    pg = dist.new_group([1, 3], backend="gloo", timeout=TIMEOUT)
    out["a_sent"] = _hashes(a)
    if rank == 1:
        _, out["send_collectives"] = _no_collectives(lambda: transfer.send_state(pg, a, {"step": 2}, dst=1))
    elif rank == 3:
        out["b_before"] = _hashes(b)
        states, extra, moved, _ = transfer.recv_state(pg, 0, transfer.pretouch(transfer.plan_buffers(b)))
        out["shards"] = sorted(f"{k}:{v.describe()}" for k, v in states["model"].items()
                               if isinstance(v, transfer.ReceivedShard))
        _, out["load_collectives"] = _no_collectives(lambda: transfer.load_state(b, states))
        out["b_loaded"] = _hashes(b)
    out["next_loss"] = [_train_step(model_a, opt_a, dp, 2), _train_step(model_b, opt_b, dp, 102)]

    # 2. same coordinate: A -> a fresh J (its optimizer has no state yet), then one more step on both
    model_j, opt_j = _build(layout, mesh, seed=7)
    j = {"model": model_j, "optimizer": opt_j}
    out["fresh_optimizer_state"] = len(opt_j.state)
    out["j_collectives"], error = _move_in_process(a, j)
    out["j_error"] = repr(error)
    out["a_moved"], out["j_loaded"] = _hashes(a), _hashes(j)
    out["fingerprints"], out["fingerprint_collectives"] = _no_collectives(
        lambda: [rank_state.fingerprint(a, [opt_a]).hex(), rank_state.fingerprint(j, [opt_j]).hex()])
    out["loss_a_j"] = [_train_step(model_a, opt_a, dp, 3), _train_step(model_j, opt_j, dp, 3)]
    out["a_after"], out["j_after"] = _hashes(a), _hashes(j)

    # 3. refusals: other placements or shape (in the optimizer: the model alone would load), other keys
    if layout == "fsdp":
        model_c, opt_c = _build(layout, mesh, seed=1, shard_dim=1)
    else:
        model_c, opt_c = _build(layout, mesh, seed=1, hidden=32)
    _train_step(model_c, opt_c, dp, 0)
    model_k, opt_k = _build(layout, mesh, seed=1, extra_layer=True)
    before = _hashes(b) | _hashes({"opt_c": opt_c}) | _hashes({"model_k": model_k})
    _, error = _move_in_process(a, {"model": model_b, "optimizer": opt_c})
    out["refused_layout"] = f"{type(error).__name__}: {error}"
    _, error = _move_in_process(a, {"model": model_k, "optimizer": opt_b})
    out["refused_keys"] = f"{type(error).__name__}: {error}"
    out["refused_untouched"] = before == _hashes(b) | _hashes({"opt_c": opt_c}) | _hashes({"model_k": model_k})
    out["final_loss"] = _train_step(model_b, opt_b, dp, 4)
    return out


def _entry(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    store = dist.TCPStore(HOST, port, WORLD, False, timeout=TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=TIMEOUT)
    results = {layout: _layout_run(layout, rank) for layout in LAYOUTS}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """Every rank's results (by layout), from one spawn of 4 ranks."""
    out_dir = tmp_path_factory.mktemp("sharded")
    store = dist.TCPStore(HOST, 0, None, True, timeout=TIMEOUT, wait_for_workers=False)
    ctx = mp.start_processes(_entry, args=(store.port, str(out_dir)), nprocs=WORLD, join=False,
                             start_method=forkserver(__name__))
    deadline = time.monotonic() + 120
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError("ranks still running after 120 s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    results = []
    for r in range(WORLD):
        with open(out_dir / f"rank{r}.json") as f:
            results.append(json.load(f))
    return results


@pytest.mark.parametrize("layout", LAYOUTS)
def test_leaver_shards_load_bit_identically_on_another_process(ranks, layout):
    sender, receiver = ranks[1][layout], ranks[3][layout]
    assert sender["send_collectives"] == {} and receiver["load_collectives"] == {}
    assert receiver["shards"], "the model's DTensors travelled as shards"
    assert receiver["b_before"] != sender["a_sent"]
    assert receiver["b_loaded"] == sender["a_sent"]  # every local shard of model and optimizer, byte for byte
    assert all(r[layout]["misuse"] == "None" for r in ranks)
    assert all(torch.tensor(r[layout]["next_loss"]).isfinite().all() for r in ranks)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_joiner_at_the_same_coordinate_continues_bit_identically(ranks, layout):
    for r in ranks:
        run = r[layout]
        assert run["j_error"] == "None" and run["j_collectives"] == {}
        assert run["fresh_optimizer_state"] == 0  # the joiner's optimizer state came from the leaver's
        assert run["j_loaded"] == run["a_moved"]
        fp_a, fp_j = run["fingerprints"]
        assert fp_a == fp_j and run["fingerprint_collectives"] == {}
        assert run["loss_a_j"][0] == run["loss_a_j"][1]
        assert run["j_after"] == run["a_after"]
    assert len({r[layout]["fingerprints"][0] for r in ranks}) == WORLD  # each rank's own shards


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mismatched_layout_or_keys_are_refused_untouched(ranks, layout):
    for r in ranks:
        run = r[layout]
        assert run["refused_layout"].startswith("TransferRefused: optimizer: state/0/exp_avg differs"), \
            run["refused_layout"]
        assert ("['S(1)']" if layout == "fsdp" else "global [32, 8]") in run["refused_layout"]
        assert run["refused_keys"].startswith("KeyError")
        assert "only the joiner's has [3.bias, 3.weight]" in run["refused_keys"]
        assert run["refused_untouched"]
        assert torch.tensor(run["final_loss"]).isfinite()

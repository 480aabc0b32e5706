"""The GPU check: the CUDA paths written but never run, exercised in one short run. Prints one JSON line.

    bash scripts/gpu-check.sh              # sets up .venv when missing, then runs this module
    python -m benchmarks.gpu_check [--device cuda|cpu] [--only NAME,...] [--budget-s 270]

Made for the day a single GPU is lent: one device, so an NCCL communicator holds one rank, and every multi-rank check
puts its ranks on the same GPU over gloo. Each check is a function of the device it runs on; on a machine without
CUDA the run (``--device`` defaulting to ``auto``) exits 0 and says ``"mode": "skipped"``, and the unit tests run the
same functions with ``device=cpu`` so their logic runs everywhere.

The checks (each reported as ``{"result": "pass" | "fail" | "error", "reason": str, "s": seconds, ...figures}``;
``fail``: the check ran and its outcome was wrong; ``error``: it raised or timed out; one check's failure does not
stop the others):

- ``mover_gloo``: 2 processes on the device, a mover-backed default group (worker.backend.init_mover_world) over
  gloo; all_reduce, broadcast and all_gather of device tensors give the expected values.
- ``nccl_world``: 1 process, ``TM_INNER_BACKEND=nccl`` (gloo on the CPU): a 1-rank mover world over
  worker.backend.build_inner; an all_reduce of a device tensor.
- ``mesh_group``: in that world, ``init_device_mesh(device, (1, 1))`` with the backend named for each dimension (or
  over one rank the mesh would take the default group): each dimension's group comes through the tmover creator to a group factory building an inner of :func:`worker.backend.inner_kind` (NCCL on a GPU); an all_reduce
  over each dimension.
- ``dtensor_snapshot``: in that world, an FSDP2 model on a 1-rank mesh of the device: worker.snapshot.host_copy puts
  every local shard on the host, the model is changed, worker.transfer.load_state puts the copy back: equal to the
  original, on the device, as DTensors.
- ``rng``: worker.rank_state capture, encode, decode and restore of the CPU and CUDA RNGs: the draws after restore
  repeat the draws after capture; on CUDA the capture holds one state per device.
- ``transfer``: worker.transfer.send_state / recv_state of a GPT's model and AdamW state on the device, between two
  threads of a 2-rank gloo group; every received tensor equals the sent one; ``gb_s`` = payload bytes / receive
  seconds (1e9 bytes/s).
- ``migration``: a 2-rank job (2 nodes x 1 rank, examples.train_gpt ``--device``, ranks sharing the device over
  gloo) with one standby, n2 migrated to s1 at step 6 (tmctl.localjob): every rank's final state sha256 equals
  an uninterrupted run's.

The line also holds ``setup`` (what scripts/gpu-check.sh did first, when it ran this), ``mode`` (``ran`` or ``skipped``), ``device`` (name), ``torch``, ``torch_cuda``
(``torch.version.cuda``), ``ok`` (every check passed) and ``s`` (total seconds). Exit code: 0 when skipped or every
check passed, 1 otherwise.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import datetime
import json
import os
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HOST = "127.0.0.1"
CHILD_TIMEOUT_S = 90.0  # one spawned check's processes, start-up included
MIGRATION_STEPS = 24
MIGRATE_AT = 6  # after the 3 recorded steps
MIN_LEFT_S = 20.0  # a check is not started with less than this left of the budget
MIGRATION_PAD_S = 0.5  # the migrated job's steps last at least this long (numerics unchanged): its standby warms


_deadline = {"at": float("inf")}  # time.monotonic() by which every check must be done (main's --budget-s)


def left_s(cap: float) -> float:
    """Seconds a step may take: ``cap``, or less where the budget ends sooner (at least 1)."""
    return max(1.0, min(cap, _deadline["at"] - time.monotonic()))


class CheckFailed(AssertionError):
    """A check ran and its outcome was wrong (reported as ``fail``; any other exception is ``error``)."""


def expect(cond: bool, why: str) -> None:
    if not cond:
        raise CheckFailed(why)


def device_of(name: str) -> torch.device:
    """``cpu``, ``cuda`` (the current CUDA device) or ``cuda:<i>``."""
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


# --- spawned processes -------------------------------------------------------------------------------------------
def _child(rank: int, fn: Callable, size: int, port: int, out: str, device: str) -> None:
    torch.set_num_threads(1)
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    store = dist.TCPStore(HOST, port, size, False, timeout=datetime.timedelta(seconds=30))
    result = fn(rank, size, store, torch.device(device))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    if dist.is_initialized():
        dist.destroy_process_group()


def spawn(fn: Callable, size: int, device: torch.device, timeout_s: Optional[float] = None) -> list[Any]:
    """Run ``fn(rank, size, store, device) -> JSON value`` in ``size`` spawned processes meeting on a TCPStore hosted
    here; returns their results by rank. Raises RuntimeError when a process fails, TimeoutError after
    ``timeout_s`` seconds (default: CHILD_TIMEOUT_S or what is left of the budget; its processes killed)."""
    timeout_s = left_s(CHILD_TIMEOUT_S) if timeout_s is None else timeout_s
    store = dist.TCPStore(HOST, 0, None, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
    with tempfile.TemporaryDirectory(prefix="tm-gpu-check-") as out:
        ctx = mp.start_processes(_child, args=(fn, size, store.port, out, str(device)), nprocs=size, join=False,
                                 start_method="spawn")
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=0.5):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{size} processes still running after {timeout_s:.0f} s")
        except mp.ProcessRaisedException as e:  # the child's traceback: keep its last line
            raise RuntimeError(str(e).strip().splitlines()[-1]) from None
        finally:
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.kill()
        results = []
        for r in range(size):
            with open(os.path.join(out, f"rank{r}.json")) as f:
                results.append(json.load(f))
    return results


# --- mover_gloo --------------------------------------------------------------------------------------------------
def _mover_gloo_rank(rank: int, size: int, store, device: torch.device) -> dict:
    from worker import backend as mb

    mb.init_mover_world(store, rank, size, mb.build_gloo(store, "gpu-check/gloo", rank, size, 30.0, HOST))
    t = torch.full((4,), float(rank + 1), device=device)
    dist.all_reduce(t)
    b = torch.full((3,), float(rank), device=device) + (7 if rank == 0 else 0)
    dist.broadcast(b, 0)
    outs = [torch.empty(2, device=device) for _ in range(size)]
    dist.all_gather(outs, torch.full((2,), float(10 * rank), device=device))
    return {"all_reduce": t.cpu().tolist(), "broadcast": b.cpu().tolist(), "all_gather": [o.cpu().tolist() for o in outs],
            "device": str(t.device)}


def check_mover_gloo(device: torch.device) -> dict:
    results = spawn(_mover_gloo_rank, 2, device)
    for r, res in enumerate(results):
        expect(res["all_reduce"] == [3.0] * 4, f"rank {r}: all_reduce gave {res['all_reduce']}, not [3.0] * 4")
        expect(res["broadcast"] == [7.0] * 3, f"rank {r}: broadcast gave {res['broadcast']}, not [7.0] * 3")
        expect(res["all_gather"] == [[0.0, 0.0], [10.0, 10.0]], f"rank {r}: all_gather gave {res['all_gather']}")
        expect(res["device"] == str(device), f"rank {r}: the result lives on {res['device']}, not {device}")
    return {"ranks": 2}


# --- nccl_world, mesh_group, dtensor_snapshot: one 1-rank world ------------------------------------------------
def _solo_rank(rank: int, size: int, store, device: torch.device) -> dict:
    """The three 1-rank checks in one world (built once); each caught on its own."""
    os.environ["TM_INNER_BACKEND"] = "nccl" if device.type == "cuda" else "gloo"
    from worker import backend as mb

    out: dict[str, dict] = {}

    def world() -> dict:
        mb.init_mover_world(store, rank, size, mb.build_inner(store, "gpu-check/solo", rank, size, 30.0, HOST))
        t = torch.full((5,), 2.0, device=device)
        dist.all_reduce(t)
        expect(t.cpu().tolist() == [2.0] * 5, f"1-rank all_reduce gave {t.cpu().tolist()}")
        return {"inner": mb.inner_kind()}

    def mesh() -> dict:
        from torch.distributed.device_mesh import init_device_mesh

        built: list[str] = []

        def factory(name: str, ranks: list[int], group_rank: int, group_size: int):
            inner = mb.build_inner(store, f"gpu-check/mesh/{name}", group_rank, group_size, 30.0, HOST)
            built.append(name)
            mover = mb.MoverBackend(group_rank, group_size, inner)
            mover.set_mode("live")
            return mover

        mb.set_group_factory(factory)
        try:
            # Over one rank every dimension is the whole world, which a mesh takes as the default group: naming the
            # backend makes it create each dimension's group, as it does on a mesh larger than one dimension's size.
            m = init_device_mesh(device.type, (1, 1), mesh_dim_names=("dp", "tp"),
                                 backend_override={"dp": mb.BACKEND_NAME, "tp": mb.BACKEND_NAME})
            for dim in ("dp", "tp"):
                t = torch.full((3,), 4.0, device=device)
                dist.all_reduce(t, group=m.get_group(dim))
                expect(t.cpu().tolist() == [4.0] * 3, f"all_reduce over the mesh's {dim} gave {t.cpu().tolist()}")
                mb.mover_of(m.get_group(dim))  # TypeError if the dimension's group is not a mover
        finally:
            mb.set_group_factory(None)
        expect(len(built) >= 1, "init_device_mesh built no group through the tmover creator")
        return {"groups_built": len(built), "inner": mb.inner_kind()}

    def snapshot() -> dict:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import DTensor

        from worker import snapshot as snap, transfer

        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8)).to(device)
        fully_shard(model, mesh=init_device_mesh(device.type, (1,)))
        before = {k: v.to_local().detach().cpu().clone() for k, v in model.state_dict().items()}
        copy = snap.host_copy({"model": model})
        shards = [v for v in copy["model"].values() if isinstance(v, transfer.ReceivedShard)]
        expect(len(shards) == len(before), f"{len(shards)} of {len(before)} entries held as shards")
        expect(all(s.local.device.type == "cpu" for s in shards), "a snapshot shard is not in host memory")
        with torch.no_grad():
            for q in model.parameters():
                q.add_(1.0)
        transfer.load_state({"model": model}, copy)
        after = model.state_dict()
        for k, v in after.items():
            expect(isinstance(v, DTensor), f"{k} is no longer a DTensor after load_state")
            expect(v.to_local().device.type == device.type, f"{k} came back on {v.to_local().device}")
            expect(torch.equal(v.to_local().cpu(), before[k]), f"{k} differs after the snapshot came back")
        return {"tensors": len(after), "bytes": sum(s.local.numel() * s.local.element_size() for s in shards)}

    for name, fn in (("nccl_world", world), ("mesh_group", mesh), ("dtensor_snapshot", snapshot)):
        out[name] = _run_one(fn)
        if name == "nccl_world" and out[name]["result"] != "pass":
            out["mesh_group"] = out["dtensor_snapshot"] = {"result": "error", "reason": "no 1-rank world"}
            break
    return out


def solo_checks(device: torch.device) -> dict[str, dict]:
    """``nccl_world``, ``mesh_group`` and ``dtensor_snapshot``, in one spawned 1-rank process."""
    return spawn(_solo_rank, 1, device)[0]


# --- rng ---------------------------------------------------------------------------------------------------------
def check_rng(device: torch.device) -> dict:
    from worker import rank_state

    torch.manual_seed(1234)
    if device.type == "cuda":
        torch.cuda.init()
    state = rank_state.capture({})
    first = [torch.rand(6, device=device).cpu(), torch.rand(3).clone()]
    torch.manual_seed(99)  # move every stream away
    rank_state.restore(rank_state.deserialize(rank_state.encode(state)), {})
    again = [torch.rand(6, device=device).cpu(), torch.rand(3).clone()]
    expect(all(torch.equal(a, b) for a, b in zip(first, again)), "draws after restore differ from draws after capture")
    cuda_states = len(state["cuda_rng"])
    if device.type == "cuda":
        expect(cuda_states == torch.cuda.device_count(), f"{cuda_states} CUDA RNG states captured for "
                                                         f"{torch.cuda.device_count()} devices")
    return {"cuda_rng_states": cuda_states}


# --- transfer ----------------------------------------------------------------------------------------------------
def _gpt_state(device: torch.device, large: bool, seed: int) -> dict[str, Any]:
    from examples.gpt import GPT, GPTConfig

    torch.manual_seed(seed)
    model = GPT(GPTConfig(d_model=512, n_layer=11, n_head=8) if large else GPTConfig.tiny()).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for q in model.parameters():
        q.grad = torch.full_like(q, 1e-3 * (seed + 1))
    opt.step()
    opt.zero_grad(set_to_none=True)
    return {"model": model, "optimizer": opt}


def check_transfer(device: torch.device, large: bool | None = None) -> dict:
    """``large``: a ~35 M-parameter GPT (default on CUDA) or the tiny one (default on the CPU)."""
    from benchmarks.transfer import tensors_of
    from worker import transfer

    large = device.type == "cuda" if large is None else large
    src, dst = _gpt_state(device, large, 0), _gpt_state(device, large, 1)
    store, timeout = dist.HashStore(), datetime.timedelta(seconds=60)
    with cf.ThreadPoolExecutor(2) as ex:
        a, b = ex.map(lambda r: dist.ProcessGroupGloo(dist.PrefixStore("gpu-check/transfer", store), r, 2, timeout),
                      [0, 1])
        sent = ex.submit(transfer.send_state, a, src, {"step": 3})
        states, extra, nbytes, seconds = transfer.recv_state(b, 0)
        sent.result(timeout=left_s(120))
    transfer.load_state(dst, states)
    expect(extra == {"step": 3}, f"extra arrived as {extra}")
    ours, theirs = tensors_of(src), tensors_of(dst)
    expect(len(ours) == len(theirs), f"{len(theirs)} tensors arrived for {len(ours)} sent")
    for i, (x, y) in enumerate(zip(ours, theirs)):
        expect(x.device == y.device and torch.equal(x, y), f"tensor {i} differs after the transfer")
    payload = sum(t.numel() * t.element_size() for t in ours)
    return {"payload_bytes": payload, "bytes_moved": nbytes, "seconds": round(seconds, 4),
            "gb_s": round(payload / seconds / 1e9, 3) if seconds > 0 else None}


# --- migration ---------------------------------------------------------------------------------------------------
def migration_commands(run_dir: str, device: torch.device, standbys: int) -> list[str]:
    """``tmd local`` for the migration check's 2-node x 1-rank job of examples.train_gpt on ``device``; with
    standbys, its steps padded to MIGRATION_PAD_S (so the standby is warm before the job ends)."""
    from tmctl import localjob as job

    pad = ("--min-step-time-s", str(MIGRATION_PAD_S)) if standbys else ()
    return job.tmd_command(run_dir, standbys, MIGRATION_STEPS, True, True, ("--device", device.type, *pad),
                           nodes=2, ranks_per_node=1)


def check_migration(device: torch.device) -> dict:
    import subprocess

    from tmctl import localjob as job

    env = {**os.environ, "TM_INNER_BACKEND": "gloo"}
    with tempfile.TemporaryDirectory(prefix="tm-gpu-check-ref-") as ref_dir, \
            tempfile.TemporaryDirectory(prefix="tm-gpu-check-mig-") as run_dir:
        subprocess.run(migration_commands(ref_dir, device, 0), check=True, timeout=left_s(120), env=env,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        reference = job.final_hashes(ref_dir)
        expect(sorted(reference) == [0, 1], f"the uninterrupted run left final states of ranks {sorted(reference)}")
        proc = subprocess.Popen(migration_commands(run_dir, device, 1), env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        try:
            with contextlib.redirect_stdout(sys.stderr):  # its progress lines: stdout holds the one JSON line
                m = job.migrate_when_ready(job.job_client(run_dir, proc), proc, MIGRATE_AT, "n2", "s1")
            code = proc.wait(timeout=left_s(120))
        finally:
            job.end_job(proc)
        expect(m["state"] == "committed", f"the migration ended {m['state']} ({m.get('reason')})")
        expect(code == 0, f"the migrated job exited {code}")
        hashes = job.final_hashes(run_dir)
    expect(hashes == reference, f"final states differ from the uninterrupted run's: {hashes} vs {reference}")
    return {"steps": MIGRATION_STEPS, "downtime_s": m.get("downtime_s")}


# --- the run -----------------------------------------------------------------------------------------------------
def _run_one(fn: Callable[[], dict]) -> dict:
    start = time.perf_counter()
    try:
        res = {"result": "pass", "reason": "", **(fn() or {})}
    except Exception as e:  # noqa: BLE001 - every outcome is this check's, reported, never fatal
        res = outcome_of(e)
    res["s"] = round(time.perf_counter() - start, 2)
    return res


def outcome_of(e: Exception) -> dict:
    """A check's outcome for the exception it raised: ``fail`` for CheckFailed, else ``error`` with where."""
    if isinstance(e, CheckFailed):
        return {"result": "fail", "reason": str(e)}
    where = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
    at = f" (at {os.path.basename(where.filename)}:{where.lineno})" if where else ""
    return {"result": "error", "reason": f"{type(e).__name__}: {str(e).strip()[:300]}{at}"}


CHECKS = ("mover_gloo", "nccl_world", "mesh_group", "dtensor_snapshot", "rng", "transfer", "migration")
SOLO = ("nccl_world", "mesh_group", "dtensor_snapshot")


def run_checks(device: torch.device, only: tuple[str, ...] = CHECKS) -> dict[str, dict]:
    """Every check of ``only`` on ``device`` (CHECKS' order), each one's outcome by name; never raises for a
    check's outcome. Raises ValueError for an unknown name."""
    unknown = set(only) - set(CHECKS)
    if unknown:
        raise ValueError(f"unknown checks {sorted(unknown)}; known: {', '.join(CHECKS)}")
    single = {"mover_gloo": check_mover_gloo, "rng": check_rng, "transfer": check_transfer,
              "migration": check_migration}
    out: dict[str, dict] = {}
    for name in CHECKS:
        if name not in only or name in out:
            continue
        if _deadline["at"] - time.monotonic() < MIN_LEFT_S:
            out[name] = {"result": "error", "reason": "not started: the time budget was spent", "s": 0.0}
            continue
        if name in SOLO:  # one spawned process runs the three
            start = time.perf_counter()
            try:
                solo = solo_checks(device)
            except Exception as e:  # noqa: BLE001 - the process itself failed: each of the three says so
                solo = {s: {**outcome_of(e), "s": round(time.perf_counter() - start, 2)} for s in SOLO}
            out.update({s: solo[s] for s in SOLO if s in only})
        else:
            out[name] = _run_one(lambda fn=single[name]: fn(device))
    return out


def report(mode: str, device: str, checks: dict[str, dict], seconds: float, reason: str = "") -> dict:
    """The JSON line: ``mode``, ``device``, versions, ``ok``, ``s`` and every check's outcome."""
    line = {"gpu_check": 1, "mode": mode, "device": device, "torch": torch.__version__,
            "torch_cuda": torch.version.cuda, "ok": all(c["result"] == "pass" for c in checks.values()),
            "s": round(seconds, 2), "checks": checks}
    if reason:
        line["reason"] = reason
    if os.environ.get("TM_GPU_CHECK_SETUP"):
        line["setup"] = os.environ["TM_GPU_CHECK_SETUP"]  # what scripts/gpu-check.sh did first
    return line


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto", help="auto (cuda where available, else skip), cuda[:i] or cpu")
    ap.add_argument("--only", default=",".join(CHECKS), help=f"comma-separated subset of {','.join(CHECKS)}")
    ap.add_argument("--budget-s", type=float, default=270.0,
                    help="every check done within this many seconds (a check not started in time is an error)")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    _deadline["at"] = time.monotonic() + args.budget_s
    only = tuple(c for c in args.only.split(",") if c)
    if args.device == "auto" and not torch.cuda.is_available():
        why = (f"no CUDA device (torch {torch.__version__}, built with CUDA {torch.version.cuda})"
               if torch.version.cuda else f"torch {torch.__version__} is a CPU build")
        print(json.dumps(report("skipped", "none", {}, time.perf_counter() - start, why)), flush=True)
        return 0
    try:
        device = device_of("cuda" if args.device == "auto" else args.device)
        checks = run_checks(device, only)
    except (ValueError, RuntimeError) as e:
        print(f"gpu_check: {e}", file=sys.stderr)
        return 2
    line = report("ran", torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", checks,
                  time.perf_counter() - start)
    print(json.dumps(line), flush=True)
    return 0 if line["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""What a checkpoint costs the training ranks: worker.checkpoint's asynchronous checkpoint vs a synchronous
``dcp.save`` vs ``dcp.async_save`` as torchtitan calls it, on the demo GPT (examples/gpt.py) with DDP.

``world`` ranks (gloo, CPU, one thread each) train the job of ``examples/train_gpt.py`` (same model, data,
AdamW) without the runtime. Each mode runs ``steps`` steps, checkpointing after every ``every``-th step into a
directory of its own, in this order on the same processes:

* ``none``: no checkpoint (the step time baseline);
* ``dcp_sync``: ``dcp.save({"model": get_model_state_dict, "optimizer": get_optimizer_state_dict})`` in the
  training loop;
* ``dcp_async_torchtitan``: torchtitan's ``async`` mode: wait for the previous save's future, then
  ``dcp.async_save(state, checkpoint_id=..., process_group=<a gloo group of its own>)``;
* ``trainmover``: ``worker.checkpoint.Checkpointer.save`` (kept host staging buffers, a background thread, a
  checksummed manifest; also saves the rank-local data stream and the RNG).

Per mode: ``stall_s`` the time the checkpoint call holds the training loop (the slowest rank, per checkpoint:
median, mean, max; the first save of a mode included), ``interference_s`` the extra step time over the
baseline's median in the ``every`` steps after a save (the background write competing for the CPU cores, which
on a GPU machine it does not share with the step; noise on a loaded machine can make it negative),
``amortised_at_50`` = median stall / (50 x the baseline's median step time), the fraction of step time the
training loop is held checkpointing every 50 steps, and ``amortised_at_50_with_interference`` the same with the
median interference added. ``trainmover`` also
reports ``load_s``: Checkpointer.load of its newest checkpoint (verify every file's sha256, dcp.load, restore),
the slowest rank.

``restart`` (the demo GPT, DDP, ``--restart-world`` ranks on 2 nodes): the time from a failure to the end of the
first step after the restart from the checkpoint,

* ``trainmover``: a ``tmd local`` job of examples/train_gpt with ``--checkpoint-dir`` whose every active process
  is killed (kill -9) ``--restarts`` times, each time right after a checkpoint committed: ``restart_s`` from the
  kill to the end of the first step after it (the slowest rank), split into ``detect_s`` (to tmd's
  ``job_restarting``), ``relaunch_s`` (to every rank registered again) and ``resume_s`` (loading the checkpoint,
  the first step); the median over the restarts. The script has no checkpoint code.
* ``cold_torchrun_dcp``: benchmarks.cold_restart (the same job without the runtime: ``dcp.save``, the processes
  exit, fresh processes rendezvous, rebuild, warm DDP up, ``dcp.load``): ``restart_s + warmup_s + load_s +
  first_step_s``, from the end of its save (a clean exit, no failure to detect) to the end of the first step.
  ``dcp.save`` and ``dcp.async_save`` restart alike (the same files, the same load).

Targets (issue 31): stall <= 0.25x dcp_sync's, amortised <= 2 %, ``restart.trainmover`` faster than
``restart.cold_torchrun_dcp``.

    python -m benchmarks.checkpoint [--world 2] [--steps 20] [--every 5] [--tiny] [--dir /tmp/tm-ckpt-bench]
                                    [--restart-world 4] [--restarts 2] [--results-dir /tmp/tm-bench]

Prints one JSON object; saves it as ``<results-dir>/checkpoint.json`` (benchmarks.report.save, with the machine).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODES = ("none", "dcp_sync", "dcp_async_torchtitan", "trainmover")


def build(job: str, tiny: bool, rank: int, world: int):
    """The job's (model to train, optimizer, LR scheduler or None, data stream, loss function): ``gpt`` as
    examples/train_gpt.py (DDP), ``llama`` as examples/train_llama.py with ``--tp 2`` and FSDP2 over the rest (TP x FSDP2)."""
    from examples.data import ShakespeareStream

    torch.manual_seed(0)
    if job == "gpt":
        from examples.gpt import GPT, GPTConfig, loss

        cfg = GPTConfig.tiny() if tiny else GPTConfig()
        model = torch.nn.parallel.DistributedDataParallel(GPT(cfg))
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
        data = ShakespeareStream(rank, batch_size=4 if tiny else 8, context=cfg.context, seed=0)
        return model, opt, None, data, loss
    from examples import train_llama as tl
    from examples.llama import Transformer, loss

    args = argparse.Namespace(pp=1, dp_replicate=1, dp_shard=-1, tp=2, tiny=tiny, tie_embeddings=False)
    cfg = tl.model_config(args)
    model = Transformer(cfg)
    layout = tl.build_layout(args, world, "cpu")
    model = tl.parallelize(model, layout, cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, tl.lr_lambda(10, 10_000))
    data = ShakespeareStream(layout.dp_index, batch_size=4 if tiny else 8, context=cfg.max_seq_len, seed=0)
    return model, opt, sched, data, loss


def _rank_main(rank: int, world: int, init: str, args: argparse.Namespace, out: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    from worker.checkpoint import Checkpointer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    model, opt, sched, data, lm_loss = build(args.job, args.tiny, rank, world)
    replicated = {"model": model, "optimizer": opt, **({"scheduler": sched} if sched is not None else {})}

    def dcp_state() -> dict:
        state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt)}
        if sched is not None:
            state["scheduler"] = sched.state_dict()
        return state

    titan_pg = dist.new_group(backend="gloo")
    tm = Checkpointer(os.path.join(args.dir, args.job, "trainmover"), "bench", keep=2)
    titan_future = None

    def checkpoint(mode: str, step: int) -> None:
        nonlocal titan_future
        path = os.path.join(args.dir, args.job, mode, f"step-{step}")
        if mode == "dcp_sync":
            dcp.save(dcp_state(), checkpoint_id=path)
        elif mode == "dcp_async_torchtitan":
            if titan_future is not None:
                titan_future.result()
            titan_future = dcp.async_save(dcp_state(), checkpoint_id=path, process_group=titan_pg)
        elif mode == "trainmover":
            tm.save(step, replicated, {"data": data})

    times: dict = {}
    step = 0
    for mode in MODES:
        steps, stalls = [], []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            x, y = data.batch(step)
            lm_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if sched is not None:
                sched.step()
            step += 1
            t1 = time.perf_counter()
            steps.append(t1 - t0)
            if mode != "none" and step % args.every == 0:
                checkpoint(mode, step)
                stalls.append(time.perf_counter() - t1)
        times[mode] = {"steps": steps, "stalls": stalls}
    if titan_future is not None:
        titan_future.result()
    final = tm.close()
    dist.barrier()
    t0 = time.perf_counter()
    loaded = tm.load(replicated, {"data": data})
    times["load"] = {"s": time.perf_counter() - t0, "step": loaded, "save_error": final.error if final else None}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(times, f)
    dist.destroy_process_group()


def _newest_bytes(path: str) -> int:
    """The bytes of the newest checkpoint (the newest ``step-*`` directory) under ``path``."""
    newest = max((n for n in os.listdir(path) if n.startswith("step-")), key=lambda n: int(n.split("-")[1]))
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(os.path.join(path, newest)) for f in fs)


def summarise(ranks: list[dict], every: int) -> dict:
    """The per-mode figures (see the module docstring) from every rank's timings."""
    base = statistics.median(t for r in ranks for t in r["none"]["steps"][1:])
    result: dict = {"baseline_step_s": base, "modes": {}}
    for mode in MODES[1:]:
        stalls = [max(r[mode]["stalls"][i] for r in ranks) for i in range(len(ranks[0][mode]["stalls"]))]
        # the steps after each save up to the next one (the background write runs then), slowest rank
        steps = [max(r[mode]["steps"][i] for r in ranks) for i in range(len(ranks[0][mode]["steps"]))]
        after = [sum(t - base for t in steps[k:k + every]) for k in range(every, len(steps), every)]
        interference = statistics.median(after) if after else 0.0
        stall = statistics.median(stalls)
        result["modes"][mode] = {
            "checkpoints": len(stalls), "stall_s": {"median": stall, "mean": statistics.mean(stalls),
                                                    "max": max(stalls), "all": stalls},
            "interference_s": interference, "amortised_at_50": stall / (50 * base),
            "amortised_at_50_with_interference": (stall + interference) / (50 * base)}
    sync = result["modes"]["dcp_sync"]["stall_s"]["median"]
    for mode in MODES[1:]:
        result["modes"][mode]["stall_vs_sync"] = result["modes"][mode]["stall_s"]["median"] / sync
    tm = result["modes"]["trainmover"]
    result["load_s"] = max(r["load"]["s"] for r in ranks)
    result["loaded_step"] = ranks[0]["load"]["step"]
    result["met"] = {"stall_le_0.25x_sync": tm["stall_vs_sync"] <= 0.25,
                     "amortised_le_2pct": tm["amortised_at_50"] <= 0.02}
    return result


def tier_restart(run_dir: str, world: int, tiny: bool, every: int, restarts: int) -> dict:
    """The ``trainmover`` restart figures (see the module docstring) of one ``tmd local`` job in ``run_dir``."""
    from benchmarks.chaos import step_ends
    from tmctl.localjob import Job, wait_until
    from tmd import protocol as p

    job = Job(os.path.join(run_dir, "job"), 0, every * (2 * restarts + 3), "--min-step-time-s", "0.1", tiny=tiny,
              ranks_per_node=world // 2, tmd_args=("--checkpoint-dir", os.path.join(run_dir, "ckpt"),
                                                   "--checkpoint-every", str(every)))

    def after(seq: int, name: str):
        return [e for e in job.events(name) if e["seq"] > seq]

    def active_pids():
        try:
            st = job.status()
        except Exception:  # noqa: BLE001 - tmd is between two daemons (a restart): ask again
            return None
        return [int(pid) for n in st.nodes if n["role"] == p.NodeRole.ACTIVE for pid in n["pids"].values()] \
            if isinstance(st, p.StatusReply) and (st.recovery or {}).get("state") not in ("halting", "recovering") \
            else None

    runs, seq = [], 0
    try:
        for _ in range(restarts):
            wait_until(lambda: after(seq, "checkpoint_committed"), 300, "a checkpoint", poll_s=0.02)
            pids = wait_until(lambda: (lambda ps: ps if ps and len(ps) == world else None)(active_pids()), 120,
                              "every rank training")
            killed = time.time()
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            restart = wait_until(lambda: after(seq, "job_restarting"), 300, "the restart", poll_s=0.02)[0]
            first = wait_until(lambda: [ts for ts, _ in step_ends(job.events()).values() if ts > restart["ts"]], 300,
                               "a step after the restart", poll_s=0.05)
            registered = [e["ts"] for e in after(restart["seq"], "worker_registered")]
            runs.append({"step": restart["step"], "detect_s": restart["ts"] - killed,
                         "relaunch_s": max(registered) - restart["ts"], "resume_s": min(first) - max(registered),
                         "restart_s": min(first) - killed, "work_lost_s": restart["work_lost_s"]})
            seq = restart["seq"]
        rc = job.finish(timeout_s=600)
    finally:
        job.close()
    median = {k: statistics.median(r[k] for r in runs) for k in ("detect_s", "relaunch_s", "resume_s", "restart_s")}
    return {"restarts": runs, **median, "exit_code": rc}


def restart_figures(world: int, tiny: bool, every: int, restarts: int) -> dict:
    """``restart``: this project's and the cold baseline's (see the module docstring), and whether it is faster."""
    from benchmarks.cold_restart import run_cold_restart

    run_dir = tempfile.mkdtemp(prefix="tm-ckpt-restart-")
    try:
        tm = tier_restart(run_dir, world, tiny, every, restarts)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    cold = run_cold_restart(world, 2 * every, every, tiny)
    cold["restart_to_first_step_s"] = cold["restart_s"] + cold["warmup_s"] + cold["load_s"] + cold["first_step_s"]
    return {"world": world, "trainmover": tm, "cold_torchrun_dcp": cold,
            "faster_than_cold": tm["restart_s"] < cold["restart_to_first_step_s"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20, help="steps per mode")
    ap.add_argument("--every", type=int, default=5, help="a checkpoint after every N-th step (stall measurement)")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--jobs", default="gpt,llama", help="gpt (DDP), llama (TP 2 x FSDP2), comma-separated")
    ap.add_argument("--llama-world", type=int, default=4, help="ranks of the llama job (TP 2 x FSDP2 world/2)")
    ap.add_argument("--restart-world", type=int, default=4, help="ranks of the restart jobs (2 nodes; 0: none)")
    ap.add_argument("--restarts", type=int, default=2, help="restarts of the tmd job (the median is reported)")
    ap.add_argument("--dir", default=None, help="where the checkpoints go (default a fresh temporary dir)")
    ap.add_argument("--results-dir", default="/tmp/tm-bench", help="where checkpoint.json goes")
    args = ap.parse_args(argv)
    own = args.dir is None
    args.dir = args.dir or tempfile.mkdtemp(prefix="tm-ckpt-bench-")
    result: dict = {"benchmark": "checkpoint", "steps_per_mode": args.steps, "every": args.every, "jobs": {}}
    for job in args.jobs.split(","):
        args.job = job
        world = args.world if job == "gpt" else args.llama_world
        out = tempfile.mkdtemp(prefix="tm-ckpt-times-")
        store = os.path.join(out, "store")  # the FileStore removes it once every rank is done
        mp.spawn(_rank_main, args=(world, f"file://{store}", args, out), nprocs=world, join=True)
        ranks = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(world)]
        shutil.rmtree(out, ignore_errors=True)
        result["jobs"][job] = {
            "model": f"{job}-tiny" if args.tiny else f"{job}-demo",
            "parallelism": "ddp" if job == "gpt" else f"tp 2 x fsdp2 {world // 2}", "world": world,
            "checkpoint_bytes": {m: _newest_bytes(os.path.join(args.dir, job, m)) for m in MODES[1:]},
            "save_error": ranks[0]["load"]["save_error"], **summarise(ranks, args.every)}
    if own:
        shutil.rmtree(args.dir, ignore_errors=True)
    if args.restart_world:
        result["restart"] = restart_figures(args.restart_world, args.tiny, args.every, args.restarts)
    result["targets"] = {"stall_vs_sync_max": 0.25, "amortised_at_50_max": 0.02,
                         "restart": "faster than a cold torchrun + DCP restart"}
    result["met"] = {**{f"{job}.{k}": v for job, r in result["jobs"].items() for k, v in r.pop("met").items()},
                     **({"restart_faster_than_cold": result["restart"]["faster_than_cold"]}
                        if "restart" in result else {})}
    print(json.dumps(result, indent=1))
    from benchmarks import report

    report.save("checkpoint", result, results_dir=args.results_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Checkpoint-restart baseline: what replacing a node costs without TrainMover.

The job is the same as ``examples/train_gpt.py`` (same model, data, optimizer,
DDP and seed) but runs on a plain gloo default group, without the runtime:

1. ``world`` fresh processes train steps ``0 .. restart_at-1``;
2. every rank saves model + optimizer + data position with
   ``torch.distributed.checkpoint`` (DCP) into a temporary directory, and the
   processes exit ("stop the job");
3. the launcher starts ``world`` fresh processes ("restart with the node
   replaced") on a new rendezvous port; they rebuild the model, warm DDP up
   with one throw-away forward/backward (so its gradient buckets match the
   uninterrupted run's, see ``_rank_main``), load the checkpoint and train
   steps ``restart_at .. steps-1``.

Every rank records wall-clock timestamps (``time.time()``, seconds) of each step
end and of the checkpoint / restart / load phases. The launcher prints one JSON
object as the last stdout line::

    {"world", "steps", "restart_at", "tiny", "median_step_s", "downtime_s", "checkpoint_s",
     "restart_s", "warmup_s", "load_s", "first_step_s", "checkpoint_bytes", "state_sha256",
     "ranks_agree", "final_loss"}   (+ "reference_sha256", "bit_identical",
                                       "reference_median_step_s" with --verify)

* ``median_step_s``: median step time of steady-state steps (rank 0; the first step of
  each process is excluded);
* ``checkpoint_s``: ``dcp.save`` time (slowest rank);
* ``restart_s``: from the end of the checkpoint (last rank) until every new process has
  started, joined the process group and rebuilt model + optimizer (process exit,
  spawn, Python/torch import, rendezvous);
* ``warmup_s``: the DDP warm-up forward/backward (slowest rank);
* ``load_s``: ``dcp.load`` + ``set_state_dict`` time (slowest rank);
* ``first_step_s``: duration of step ``restart_at`` on the new processes;
* ``downtime_s``: (end of step ``restart_at`` on the new processes) - (end of step
  ``restart_at - 1`` on the old processes) - ``median_step_s``, both ends taken on the
  last rank to get there: the training time lost to the restart.

``--verify`` also runs the job uninterrupted and reports ``bit_identical``: whether
the final state hash (``examples.state_hash.final_state_hash``) matches.

Usage::

    python -m benchmarks.cold_restart --world 4 --steps 30 --restart-at 15 [--tiny] [--verify]
"""

from __future__ import annotations

import time

_T_PROCESS = time.time()  # as early as possible: start of this interpreter's module code

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from typing import Any  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

__all__ = ["run_cold_restart", "run_job", "main"]


# --------------------------------------------------------------------------------------------------
# Rank side: one training process
# --------------------------------------------------------------------------------------------------


def _rank_main(args: argparse.Namespace) -> None:
    """Train steps [args.start_step, args.stop_step) on one rank; optionally load/save a DCP checkpoint.

    Writes ``<args.out>/rank<r>.json`` with the timestamps (seconds since the epoch) and final state.
    """
    import torch

    torch.set_num_threads(1)
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from examples.data import ShakespeareStream
    from examples.gpt import GPT, GPTConfig, loss as lm_loss
    from examples.state_hash import final_state_hash

    rec: dict[str, Any] = {"rank": args.rank, "t_process": _T_PROCESS, "t_imported": time.time()}
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank, world_size=args.world
    )
    rank = dist.get_rank()

    cfg = GPTConfig.tiny() if args.tiny else GPTConfig()
    torch.manual_seed(args.seed)  # identical initial weights on every rank (as in train_gpt.py)
    model = torch.nn.parallel.DistributedDataParallel(GPT(cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    data = ShakespeareStream(rank, batch_size=args.batch_size, context=cfg.context, seed=args.seed)
    dist.barrier()
    rec["t_ready"] = time.time()

    if args.load:
        # DDP warm-up. A fresh DDP reduces its first backward in one bucket holding every parameter and
        # re-buckets at the next forward by the order gradients became ready. An uninterrupted run did that
        # re-bucketing at step 1, so without the warm-up, step `restart_at` would reduce with a different
        # bucket layout; with gloo's ring allreduce (world >= 3) the float summation order depends on an
        # element's offset in the bucket, so the result would not be bit-identical. One throw-away
        # forward/backward (gradients discarded, no optimizer step, before the weights are loaded) records
        # the ready order, so the first real step already uses the uninterrupted run's layout.
        rec["warmup_start"] = time.time()
        dummy = torch.zeros(args.batch_size, cfg.context, dtype=torch.long)
        lm_loss(model(dummy), dummy).backward()
        opt.zero_grad(set_to_none=True)  # get_state_dict() below needs grad-free params to init optimizer state
        rec["warmup_end"] = time.time()

        rec["load_start"] = time.time()
        msd, osd = get_state_dict(model, opt)
        # The data position differs per rank: key it by rank so DCP does not deduplicate it.
        state = {"model": msd, "optim": osd, "data": {f"rank{rank}": data.state_dict()}}
        dcp.load(state, checkpoint_id=args.load)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        data.load_state_dict(state["data"][f"rank{rank}"])
        dist.barrier()
        rec["load_end"] = time.time()
        if data.next_step != args.start_step:
            raise RuntimeError(f"checkpoint is at step {data.next_step}, expected {args.start_step}")

    step_end: dict[int, float] = {}
    rec["t_train_start"] = time.time()
    loss_value = None
    for step in range(args.start_step, args.stop_step):
        x, y = data.batch(step)
        loss = lm_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss_value = loss.item()
        step_end[step] = time.time()
        if rank == 0 and args.log_every and (step + 1) % args.log_every == 0:
            print(f"[rank0] step {step + 1}/{args.stop_step} loss {loss_value:.4f}", file=sys.stderr, flush=True)
    rec["step_end"] = step_end
    rec["loss"] = loss_value

    if args.save:
        dist.barrier()
        rec["ckpt_start"] = time.time()
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd, "data": {f"rank{rank}": data.state_dict()}}, checkpoint_id=args.save)
        dist.barrier()
        rec["ckpt_end"] = time.time()

    rec["state_sha256"] = final_state_hash(model, opt)
    rec["next_step"] = data.next_step
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(rec, f)
    dist.barrier()  # nobody exits (rank 0 hosts the TCPStore) while another rank still needs the group
    # Skip interpreter teardown: destroying ProcessGroupGloo from a finalizing interpreter can deadlock
    # (its destructor joins a gloo thread that waits for the GIL) or abort ("terminate called ...").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# --------------------------------------------------------------------------------------------------
# Launcher side
# --------------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(
    world: int,
    start_step: int,
    stop_step: int,
    out_dir: str,
    *,
    tiny: bool = False,
    seed: int = 0,
    batch_size: int | None = None,
    save: str | None = None,
    load: str | None = None,
    log_every: int = 0,
    timeout_s: float = 1800.0,
) -> tuple[list[dict[str, Any]], float]:
    """Run ``world`` rank processes for steps [start_step, stop_step) and wait for all to exit.

    Returns (per-rank records sorted by rank, wall time in seconds at which the last process exited).
    Raises RuntimeError (with the log tail) if any rank fails or the job exceeds ``timeout_s`` seconds.
    """
    os.makedirs(out_dir, exist_ok=True)
    if batch_size is None:
        batch_size = 4 if tiny else 8
    port = _free_port()
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["OMP_NUM_THREADS"] = "1"
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    procs: list[tuple[subprocess.Popen, str]] = []
    for r in range(world):
        cmd = [
            sys.executable, "-m", "benchmarks.cold_restart", "--rank-main",
            "--rank", str(r), "--world", str(world), "--port", str(port),
            "--start-step", str(start_step), "--stop-step", str(stop_step),
            "--seed", str(seed), "--batch-size", str(batch_size), "--out", out_dir,
            "--log-every", str(log_every),
        ]  # fmt: skip
        if tiny:
            cmd.append("--tiny")
        if save:
            cmd += ["--save", save]
        if load:
            cmd += ["--load", load]
        log_path = os.path.join(out_dir, f"rank{r}.log")
        with open(log_path, "w") as log:
            p = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        procs.append((p, log_path))

    deadline = time.time() + timeout_s
    failed: list[str] = []
    try:
        while any(p.poll() is None for p, _ in procs):
            if time.time() > deadline:
                failed.append(f"timeout after {timeout_s:.0f} s")
                break
            if any(p.returncode not in (None, 0) for p, _ in procs):
                break  # one rank died: the others would hang in a collective
            time.sleep(0.005)
        t_exit = time.time()
        for r, (p, log_path) in enumerate(procs):
            if p.returncode not in (None, 0):
                with open(log_path) as f:
                    failed.append(f"rank {r} exited with {p.returncode}:\n{f.read()[-3000:]}")
    finally:
        for p, _ in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait()
    if failed:
        raise RuntimeError("cold-restart job failed: " + "\n".join(failed))
    if log_every:
        with open(procs[0][1]) as f:
            sys.stderr.write(f.read())
    recs = []
    for r in range(world):
        with open(os.path.join(out_dir, f"rank{r}.json")) as f:
            rec = json.load(f)
        rec["step_end"] = {int(k): v for k, v in rec["step_end"].items()}
        recs.append(rec)
    return recs, t_exit


def _step_durations(rec: dict[str, Any]) -> dict[int, float]:
    """Duration (seconds) of every step but the process's first one, from consecutive step-end times."""
    ends = rec["step_end"]
    return {s: ends[s] - ends[s - 1] for s in sorted(ends) if s - 1 in ends}


def run_cold_restart(
    world: int,
    steps: int,
    restart_at: int,
    tiny: bool = False,
    *,
    verify: bool = False,
    seed: int = 0,
    batch_size: int | None = None,
    log_every: int = 0,
    workdir: str | None = None,
    keep: bool = False,
) -> dict[str, Any]:
    """Run the checkpoint-restart baseline and return its report (all times in seconds).

    Keys: see the module docstring. ``state_sha256`` is rank 0's final state hash; ``ranks_agree``
    says all ranks ended with the same hash. With ``verify`` the uninterrupted job runs too, and
    ``bit_identical`` is true when its hash equals ``state_sha256``.
    """
    if not 1 <= restart_at < steps:
        raise ValueError(f"need 1 <= restart_at < steps, got restart_at={restart_at}, steps={steps}")
    tmp = tempfile.mkdtemp(prefix="cold_restart_", dir=workdir)
    try:
        ckpt = os.path.join(tmp, "ckpt")
        common = dict(tiny=tiny, seed=seed, batch_size=batch_size, log_every=log_every)
        old, _ = run_job(world, 0, restart_at, os.path.join(tmp, "before"), save=ckpt, **common)
        new, _ = run_job(world, restart_at, steps, os.path.join(tmp, "after"), load=ckpt, **common)

        durations = list(_step_durations(old[0]).values()) + list(_step_durations(new[0]).values())
        median_step = statistics.median(durations) if durations else float("nan")
        last_old_step_end = max(r["step_end"][restart_at - 1] for r in old)
        first_new_step_end = max(r["step_end"][restart_at] for r in new)
        ckpt_end = max(r["ckpt_end"] for r in old)
        report: dict[str, Any] = {
            "world": world,
            "steps": steps,
            "restart_at": restart_at,
            "tiny": tiny,
            "median_step_s": median_step,
            "downtime_s": first_new_step_end - last_old_step_end - median_step,
            "checkpoint_s": max(r["ckpt_end"] - r["ckpt_start"] for r in old),
            "restart_s": max(r["t_ready"] for r in new) - ckpt_end,
            "warmup_s": max(r["warmup_end"] - r["warmup_start"] for r in new),
            "load_s": max(r["load_end"] - r["load_start"] for r in new),
            "first_step_s": first_new_step_end - max(r["load_end"] for r in new),
            "checkpoint_bytes": sum(
                os.path.getsize(os.path.join(ckpt, f)) for f in os.listdir(ckpt)
            ),
            "state_sha256": new[0]["state_sha256"],
            "ranks_agree": len({r["state_sha256"] for r in new}) == 1,
            "final_loss": new[0]["loss"],
        }
        if verify:
            ref, _ = run_job(world, 0, steps, os.path.join(tmp, "reference"), **common)
            report["reference_sha256"] = ref[0]["state_sha256"]
            report["bit_identical"] = report["ranks_agree"] and ref[0]["state_sha256"] == report["state_sha256"]
            ref_durations = list(_step_durations(ref[0]).values())
            report["reference_median_step_s"] = statistics.median(ref_durations) if ref_durations else None
        return report
    finally:
        if keep:
            print(f"kept working directory {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Checkpoint-restart baseline (DCP save, kill, relaunch, load).")
    p.add_argument("--world", type=int, default=4, help="number of ranks")
    p.add_argument("--steps", type=int, default=30, help="total training steps")
    p.add_argument("--restart-at", type=int, default=15, help="steps completed before the restart")
    p.add_argument("--tiny", action="store_true", help="tiny model (d_model 32, 1 layer, context 32, batch 4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=None, help="per-rank batch (default 8; 4 with --tiny)")
    p.add_argument("--verify", action="store_true", help="also run uninterrupted and report bit_identical")
    p.add_argument("--log-every", type=int, default=0, help="echo rank 0's loss every N steps (stderr)")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory (checkpoint, logs)")
    # Internal: one rank process (spawned by the launcher).
    p.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--start-step", type=int, help=argparse.SUPPRESS)
    p.add_argument("--stop-step", type=int, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--save", help=argparse.SUPPRESS)
    p.add_argument("--load", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.rank_main:
        _rank_main(args)
        return
    report = run_cold_restart(
        args.world,
        args.steps,
        args.restart_at,
        args.tiny,
        verify=args.verify,
        seed=args.seed,
        batch_size=args.batch_size,
        log_every=args.log_every,
        keep=args.keep,
    )
    print(json.dumps(report), flush=True)
    from benchmarks import report as results  # here, not at the top: rank processes start from this module

    results.save("cold_restart", report)  # no tmd journal: the JSON only


if __name__ == "__main__":
    main()

"""One rank of the torchrun + torch.distributed.checkpoint peer of benchmarks/peers.py, run by torchrun as a script.

The demo workload (examples/gpt.py's GPT under torch's DDP on a gloo default group, AdamW lr 3e-4 wd 0.1,
ShakespeareStream batches keyed by (seed, rank, step), ``torch.manual_seed(seed)`` before the model) with a DCP
checkpoint of model + optimizer + data position after **every** step: ``<ckpt>/step_<n>`` (n: the next step to run),
then a barrier, then rank 0 points ``<ckpt>/latest`` at it (atomic rename) and removes the one before. torchrun
(``--max-restarts``) restarts every rank when one dies; a started rank that finds ``latest`` warms DDP up with one
throw-away forward/backward (as benchmarks/cold_restart.py does, so that its first real step uses the bucket layout
of an uninterrupted run), loads the checkpoint and goes on from there.

Every step appends JSON lines to ``<log_dir>/rank<r>.jsonl`` (flushed at once; a restarted rank appends)::

    {"event": "start", "step", "ts", "pid"}                 before the forward pass (ts: time.time(), epoch s)
    {"event": "end", "step", "ts", "pid", "participants"}  after optimizer.step (participants: the world size)
    {"event": "saved", "step", "ts", "pid", "save_s"}       after the checkpoint of the step and the barrier

plus ``{"event": "loaded", "next_step", "ts", "pid", "load_s"}`` after a restart's load; at the end
``<out_dir>/rank<r>.json`` gets ``{"rank", "state_sha256", "steps"}``.

    torchrun --nproc-per-node 4 --max-restarts 1 benchmarks/peers/dcp_worker.py --steps N --ckpt DIR
             --log-dir DIR --out-dir DIR [--tiny]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from datetime import timedelta

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from examples.data import ShakespeareStream  # noqa: E402
from examples.gpt import GPT, GPTConfig, loss as lm_loss  # noqa: E402
from examples.state_hash import final_state_hash  # noqa: E402


def read_latest(ckpt: str) -> int | None:
    """The next step of the newest complete checkpoint in ``ckpt``, or None."""
    try:
        with open(os.path.join(ckpt, "latest")) as f:
            return int(f.read().strip())
    except FileNotFoundError:
        return None


def write_latest(ckpt: str, next_step: int) -> None:
    tmp = os.path.join(ckpt, f"latest.tmp.{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(str(next_step))
    os.replace(tmp, os.path.join(ckpt, "latest"))


def attempt_store(rank: int, world: int):
    """torchrun's store (MASTER_ADDR:MASTER_PORT), under a prefix of its own per restart: torchrun keeps one store
    across restarts, and the plain env:// rendezvous then hands a restarted group the gloo addresses of the dead
    attempt's processes ("Gloo connectFullMesh failed ... Connection refused")."""
    from torch.distributed import PrefixStore, TCPStore

    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)  # the agent hosts the store
    store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                     is_master=not agent and rank == 0, timeout=timedelta(seconds=300), multi_tenant=True)
    return PrefixStore(f"peers/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--log-dir", required=True)
    ap.add_argument("--out-dir", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", store=attempt_store(rank, world), rank=rank, world_size=world)
    log = open(os.path.join(args.log_dir, f"rank{rank}.jsonl"), "a", buffering=1)

    def record(**kw) -> None:
        log.write(json.dumps({**kw, "pid": os.getpid()}) + "\n")

    cfg = GPTConfig.tiny() if args.tiny else GPTConfig()
    batch_size = 4 if args.tiny else 8
    torch.manual_seed(args.seed)
    model = torch.nn.parallel.DistributedDataParallel(GPT(cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    data = ShakespeareStream(rank, batch_size=batch_size, context=cfg.context, seed=args.seed)
    os.makedirs(args.ckpt, exist_ok=True)
    dist.barrier()  # every rank read the same `latest` only once all are up (rank 0 may still be writing it)
    start = read_latest(args.ckpt) or 0
    dist.barrier()

    if start:
        dummy = torch.zeros(batch_size, cfg.context, dtype=torch.long)  # DDP warm-up: see the module docstring
        lm_loss(model(dummy), dummy).backward()
        opt.zero_grad(set_to_none=True)
        t0 = time.time()
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd, "data": {f"rank{rank}": data.state_dict()}}
        dcp.load(state, checkpoint_id=os.path.join(args.ckpt, f"step_{start}"))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        data.load_state_dict(state["data"][f"rank{rank}"])
        dist.barrier()
        record(event="loaded", next_step=start, ts=time.time(), load_s=time.time() - t0)

    for step in range(start, args.steps):
        record(event="start", step=step, ts=time.time())
        x, y = data.batch(step)
        loss = lm_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        record(event="end", step=step, ts=time.time(), participants=world)
        t0 = time.time()
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd, "data": {f"rank{rank}": data.state_dict()}},
                 checkpoint_id=os.path.join(args.ckpt, f"step_{step + 1}"))
        dist.barrier()
        if rank == 0:
            write_latest(args.ckpt, step + 1)
            shutil.rmtree(os.path.join(args.ckpt, f"step_{step}"), ignore_errors=True)
        record(event="saved", step=step, ts=time.time(), save_s=time.time() - t0)

    with open(os.path.join(args.out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "state_sha256": final_state_hash(model, opt), "steps": data.next_step}, f)
    dist.barrier()
    log.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown (gloo threads)


if __name__ == "__main__":
    main()

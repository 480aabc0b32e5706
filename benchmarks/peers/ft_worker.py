"""One torchft replica group (one rank, one thread) of the peers benchmark (benchmarks/peers.py), run as a script.

The demo workload (examples/gpt.py's GPT, AdamW lr 3e-4 wd 0.1, ShakespeareStream batches keyed by (seed, rank,
step), ``torch.manual_seed(seed)`` before the model) under torchft's Manager, in torchft's DDP training loop:
``start_quorum`` before the forward pass, the gradients averaged over the participating replicas by
``Manager.allreduce`` (gloo; one flat buffer, the gradients in parameter order), ``should_commit`` before
``optimizer.step``. Not ``torchft.DistributedDataParallel``: in torchft 0.2.0 its comm hook asserts
(``assert fut._fut`` in torchft/ddp.py) when the all-reduce fails because a peer died, which kills every survivor;
``Manager.allreduce`` reports the error to the Manager instead, so that ``should_commit`` says no, as intended. A
replica that joins late (the replacement of a killed one, ``--replacement``) heals from a live replica through
torchft's HTTP checkpoint transport. The step counter is
torchft's (``manager.current_step()``): it advances only on a committed step, so a step whose commit failed is
computed again with the same batch.

Every step appends a JSON line to ``--log`` (flushed at once, so a killed replica leaves what it did)::

    {"event": "start", "step", "ts", "pid"}          before the forward pass (ts: time.time(), epoch s)
    {"event": "end", "step", "ts", "committed", "participants", "participating"}
                                                     after should_commit (and optimizer.step when committed);
                                                     ``step`` is the step committed (or the one attempted)

and at the end ``--out`` gets ``{"replica", "state_sha256", "steps"}`` (examples.state_hash.final_state_hash).

    python benchmarks/peers/ft_worker.py --replica R --replicas 4 --steps N --lighthouse ADDR --store HOST:PORT
                                         --log PATH --out PATH [--sync] [--replacement] [--tiny]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from examples.data import ShakespeareStream  # noqa: E402
from examples.gpt import GPT, GPTConfig, loss as lm_loss  # noqa: E402
from examples.state_hash import final_state_hash  # noqa: E402

# As torchft's own example (train_ddp.py): a survivor whose all-reduce waits on a dead replica's neighbour, not on
# the dead replica itself, sees no closed connection and learns of the failure only at this timeout (torchft's
# default, 60 s, makes the whole job wait that long for the straggling survivor at the next quorum).
PG_TIMEOUT_S = 5
MANAGER_TIMEOUT_S = 30
READY_KEY = "ready"  # the launcher's store: replicas that are up (their Manager heartbeats the lighthouse)
DONE_KEY = "done"  # ... replicas that finished training


def wait_count(store, key: str, n: int) -> None:
    """Block until the counter ``key`` of ``store`` reaches ``n``."""
    while store.add(key, 0) < n:
        time.sleep(0.01)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--replica", type=int, required=True)
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--min-replicas", type=int, default=3)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--lighthouse", required=True)
    ap.add_argument("--store", required=True, help="HOST:PORT of the launcher's TCPStore")
    ap.add_argument("--log", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--sync", action="store_true", help="use_async_quorum=False")
    ap.add_argument("--replacement", action="store_true", help="started after a kill: no start barrier")
    args = ap.parse_args()
    torch.set_num_threads(1)

    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo

    host, port = args.store.rsplit(":", 1)
    launcher = TCPStore(host, int(port), is_master=False, wait_for_workers=False)
    group_store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # this replica group's own

    cfg = GPTConfig.tiny() if args.tiny else GPTConfig()
    torch.manual_seed(args.seed)  # identical initial weights on every replica (so init_sync=False)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    data = ShakespeareStream(args.replica, batch_size=4 if args.tiny else 8, context=cfg.context, seed=args.seed)

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    def load_state_dict(sd: dict) -> None:
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=PG_TIMEOUT_S)),
        load_state_dict=load_state_dict, state_dict=state_dict,
        min_replica_size=args.min_replicas, use_async_quorum=not args.sync, rank=0, world_size=1,
        store_addr="127.0.0.1", store_port=group_store.port, lighthouse_addr=args.lighthouse,
        replica_id=f"peers_ft_{args.replica}", hostname="127.0.0.1", init_sync=False,
        timeout=timedelta(seconds=MANAGER_TIMEOUT_S),
    )
    params = list(model.parameters())
    if not args.replacement:  # every replica heartbeats before the first quorum: all 4 are in it
        launcher.add(READY_KEY, 1)
        wait_count(launcher, READY_KEY, args.replicas)

    log = open(args.log, "a", buffering=1)

    def record(**kw) -> None:
        log.write(json.dumps(kw) + "\n")

    while manager.current_step() < args.steps:
        manager.start_quorum()  # sync quorum: blocks here (and heals a joiner) before the forward pass
        opt.zero_grad(set_to_none=True)
        step = manager.current_step()
        record(event="start", step=step, ts=time.time(), pid=os.getpid())
        x, y = data.batch(step)
        loss = lm_loss(model(x), y)
        loss.backward()
        flat = torch.cat([q.grad.reshape(-1) for q in params])
        manager.allreduce(flat).wait()  # averaged over the participants; zeros from a healing replica
        offset = 0
        for q in params:
            q.grad.copy_(flat[offset:offset + q.numel()].view_as(q))
            offset += q.numel()
        committed = manager.should_commit()  # heals a joiner of the async quorum (its step counter jumps)
        if committed:
            opt.step()
        record(event="end", step=manager.current_step() - 1 if committed else step, ts=time.time(),
               committed=committed, participants=manager.num_participants(),
               participating=manager.is_participating())

    with open(args.out, "w") as f:
        json.dump({"replica": args.replica, "state_sha256": final_state_hash(model, opt),
                   "steps": manager.current_step()}, f)
    launcher.add(DONE_KEY, 1)
    wait_count(launcher, DONE_KEY, args.replicas)  # nobody leaves while a peer may still need it to heal
    log.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown (gloo / torchft threads)


if __name__ == "__main__":
    main()

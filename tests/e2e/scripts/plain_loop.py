"""A small DDP job in the README's plain loop (``for step in session.steps(n)``, catching ``worker.StepAborted``), for
tests/e2e/test_varied_script.py: a model wrapped in ``DistributedDataParallel(static_graph=True)``, which regroups
its gradient buckets with two broadcasts in a process's third iteration (a failure's replacement must replay it in
a third shadow iteration). Writes ``<run_dir>/final/rank<R>.json`` like examples/train_gpt.py.

    python tests/e2e/scripts/plain_loop.py --steps 20 [--fault NODE:STEP] [--step-time-s S] [--gather-objects]

``--gather-objects``: every step, after the backward pass, ``dist.all_gather_object`` of each rank's loss (checked:
one entry per rank, in rank order), as scripts log a metric: once a peer died, it must raise ``StepAborted``
(worker.object_collectives), not unpickle what a latched collective left (``EOFError``).

``--fault NODE:STEP``: every process started on NODE (``TM_NODE``) kills itself with SIGKILL in STEP, after its
backward pass and before the object all-gather and the optimizer's step; not in shadow iterations, not on a
replacement.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import time

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--fault", default="", metavar="NODE:STEP")
    ap.add_argument("--step-time-s", type=float, default=0.0, help="pad each step to at least this (seconds)")
    ap.add_argument("--gather-objects", action="store_true", help="all_gather_object every step")
    args = ap.parse_args()

    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import worker
    from tests.e2e.scripts.varied import flatten

    torch.set_num_threads(1)
    started_on = os.environ.get("TM_NODE", "")
    fault_node, _, fault_step = args.fault.partition(":")
    torch.manual_seed(21)
    net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    session = worker.init()
    model = DDP(net, static_graph=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    session.manage(model=model, optimizer=opt)
    for step in session.steps(args.steps):
        t0 = time.perf_counter()
        try:
            g = torch.Generator().manual_seed(step * 73 + session.rank)
            x = torch.randn(16, 8, generator=g)
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), x[:, :1].tanh())
            loss.backward()
            if args.fault and started_on == fault_node and step == int(fault_step) and not session.is_shadow:
                os.kill(os.getpid(), signal.SIGKILL)
            if args.gather_objects:
                losses = [None] * session.world_size
                torch.distributed.all_gather_object(losses, {"rank": session.rank, "loss": loss.item()})
                assert [o["rank"] for o in losses] == list(range(session.world_size)), losses
            opt.step()
        except worker.StepAborted:
            continue  # a peer failed: the runtime recovers and yields this step again
        if not session.is_shadow and time.perf_counter() - t0 < args.step_time_s:
            time.sleep(args.step_time_s - (time.perf_counter() - t0))

    digest = hashlib.sha256()
    for name, obj in (("model", net), ("optimizer", opt)):
        for key, value in sorted(flatten(obj.state_dict(), name).items()):
            digest.update(key.encode())
            digest.update(value.numpy().tobytes() if isinstance(value, torch.Tensor) else repr(value).encode())
    os.makedirs(os.path.join(session.run_dir, "final"), exist_ok=True)
    with open(os.path.join(session.run_dir, "final", f"rank{session.rank}.json"), "w") as f:
        json.dump({"rank": session.rank, "steps": args.steps, "state_sha256": digest.hexdigest()}, f)
    session.finish(digest.hexdigest())


if __name__ == "__main__":
    main()

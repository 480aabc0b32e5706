"""A data-parallel job written the way many scripts are, not the way examples/train_gpt.py is, for
tests/e2e/test_varied_script.py: an MLP with dropout and a normalisation layer, a module whose buffers every forward
pass changes identically on every rank (a forward counter and a running average of its input's mean over the
whole batch: what SyncBatchNorm's statistics are), DDP, per-rank seeds, SGD with momentum and a OneCycle schedule
(managed), gradient clipping, the plain ``for step in session.steps(n)`` loop that catches ``worker.StepAborted``,
and ``zero_grad()`` after ``optimizer.step()``. Each step's batch is drawn by a managed rank-local loader (whose count of
batches served, and the list of their steps, which grows every step, enter the final hash) from a generator seeded
by (seed, rank, step); a replicated ``progress`` object counts the job's samples as they are drawn (before the
update), and the output layer's ``MultiStepLR`` holds a ``collections.Counter``. Writes
``<run_dir>/final/rank<R>.json`` like examples/train_gpt.py.

    python tests/e2e/scripts/varied.py --steps 30 [--norm layer|batch] [--fault NODE:STEP] [--step-time-s S]
                                       [--stats-from STEP] [--calibrate-once] [--calibrate-first]
                                       [--overflow-at STEP,STEP]

Two optimizers (the output layer's AdamW, the body's SGD) and two micro-batches per step (the first under DDP's
``no_sync()``, ``--accumulate``). Mixed precision as GPU scripts do it: the forward pass under ``torch.autocast``
(bfloat16 on the CPU) and a managed ``torch.amp.GradScaler`` (``scale``, ``unscale_`` before clipping, ``step``,
``update``).

``--norm batch``: BatchNorm1d, whose running statistics are each rank's own (DDP broadcasts rank 0's at every
forward, then each rank updates them with its batch): no two ranks hold the same state, so a failure is recovered
by rolling back to a buddy snapshot. ``layer`` (default): LayerNorm; the ranks are replicas of each other.

``--stats-from STEP``: the running average starts only at STEP (a statistic with a warm-up period; the counter
counts from the start): a buffer that no step before STEP changes.

``--calibrate-once``: each process, in its own second iteration (whatever step that is: a joiner's shadow
iterations count), all-reduces a calibration statistic once, as a lazily initialised module would (DDP's regrouping
of its buckets is torch's own such collective): a joiner must run that iteration in its sandbox, not live.
``--calibrate-first``: the same in each process's own first iteration: a failure's replacement must run one shadow
iteration (it runs none where the job's first steps are alike).

``--overflow-at STEP,...``: in those steps the loss is scaled to infinity, so the GradScaler finds non-finite
gradients on every rank, skips both optimizers' updates (no ``optimizer.step()`` call: the step still counts as
committed) and lowers its scale. Before 2026-11-29 a kill in the step after one (``--fault NODE:STEP+1``) left the
replacements on their senders' RNG and without their loaders' state.

``--fault NODE:STEP``: every process started on NODE (``TM_NODE``) kills itself with SIGKILL in STEP, after the
last micro-batch's forward pass (the buffers changed, the first micro-batch's gradients accumulated) and before its
backward; not in shadow iterations, not on a replacement.
"""
from __future__ import annotations

import argparse
import contextlib
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
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fault", default="", metavar="NODE:STEP")
    ap.add_argument("--norm", choices=("layer", "batch"), default="layer")
    ap.add_argument("--accumulate", type=int, default=2, help="micro-batches per step (all but the last in no_sync)")
    ap.add_argument("--step-time-s", type=float, default=0.0, help="pad each step to at least this (seconds)")
    ap.add_argument("--stats-from", type=int, default=0, help="the step at which the running average starts")
    ap.add_argument("--calibrate-once", action="store_true",
                    help="a collective in each process's own second iteration only")
    ap.add_argument("--calibrate-first", action="store_true",
                    help="a collective in each process's own first iteration only")
    ap.add_argument("--overflow-at", default="", metavar="STEP,STEP",
                    help="steps whose gradients overflow: the GradScaler skips their updates")
    args = ap.parse_args()
    overflow = {int(s) for s in args.overflow_at.split(",") if s}

    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import worker

    torch.set_num_threads(1)
    started_on = os.environ.get("TM_NODE", "")
    session = worker.init()
    # torchrun's variables are set for scripts that read them (a joiner's: the rank it took over)
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"]) == (str(session.rank), str(session.world_size)), os.environ
    assert os.environ["LOCAL_RANK"] == os.environ["TM_LOCAL_RANK"]

    class GlobalStats(torch.nn.Module):
        """Counts forward passes and keeps a running average of the batch mean over every rank (one all-reduce
        per forward): buffers that change in every forward pass, identically on every rank."""

        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
            self.register_buffer("running_mean", torch.zeros(16))
            self.averaging = True  # off: the running average stays as it is (the all-reduce runs all the same)

        def forward(self, x):
            if self.training:
                with torch.no_grad():
                    mean = x.mean(0)
                    torch.distributed.all_reduce(mean)
                    if self.averaging:
                        self.running_mean.mul_(0.9).add_(mean / torch.distributed.get_world_size(), alpha=0.1)
                    self.calls += 1
            return x - self.running_mean

    torch.manual_seed(args.seed)
    norm = torch.nn.BatchNorm1d if args.norm == "batch" else torch.nn.LayerNorm
    model = DDP(torch.nn.Sequential(
        GlobalStats(), torch.nn.Linear(16, 64), norm(64), torch.nn.ReLU(), torch.nn.Dropout(0.1),
        torch.nn.Linear(64, 64), norm(64), torch.nn.ReLU(), torch.nn.Linear(64, 4)))
    head = model.module[-1]  # the output layer has its own optimizer (AdamW); the body SGD with a OneCycle schedule
    body = [p for p in model.parameters() if all(p is not q for q in head.parameters())]
    opt = torch.optim.SGD(body, lr=0.05, momentum=0.9, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.2, total_steps=args.steps)
    head_opt = torch.optim.AdamW(head.parameters(), lr=0.01)
    # MultiStepLR's state holds a collections.Counter (its milestones): it must move and come back as one
    head_sched = torch.optim.lr_scheduler.MultiStepLR(head_opt, milestones=[5, 5, 25], gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=3)

    class Progress:
        """Samples seen by the whole job, counted as each micro-batch is drawn (before the optimizer's update):
        replicated state that a redone step must not count twice."""

        def __init__(self) -> None:
            self.samples = 0

        def state_dict(self) -> dict:
            return {"samples": self.samples}

        def load_state_dict(self, state: dict) -> None:
            self.samples = int(state["samples"])

    progress = Progress()
    session.manage(model=model, optimizer=opt, scheduler=sched, head_optimizer=head_opt, head_scheduler=head_sched,
                   scaler=scaler, progress=progress)

    class Loader:
        """This rank's micro-batches, drawn from a generator seeded by (seed, rank, step), and the count of those
        served: a position that every draw moves (as a stateful data loader's does), rank-local state."""

        def __init__(self) -> None:
            self.served = 0
            self.steps: list[int] = []  # the step of every batch served: a state that grows every step

        def draw(self, g: torch.Generator, step: int) -> tuple:
            self.served += 1
            self.steps.append(step)
            progress.samples += 32 * session.world_size
            x = torch.randn(32, 16, generator=g)
            return x, x @ target + 0.1 * torch.randn(32, 4, generator=g)

        def state_dict(self) -> dict:
            return {"served": self.served, "steps": list(self.steps)}

        def load_state_dict(self, state: dict) -> None:
            self.served, self.steps = int(state["served"]), list(state["steps"])

    loader = Loader()
    session.manage(rank_local=True, data=loader)
    torch.manual_seed(args.seed + 1000 + session.rank)  # per-rank dropout masks: each rank its own stream
    fault_node, _, fault_step = args.fault.partition(":")
    target = torch.randn(16, 4, generator=torch.Generator().manual_seed(args.seed))

    iterations = 0  # this process's own (a joiner's shadow iterations included)
    for step in session.steps(args.steps):
        t0 = time.perf_counter()
        iterations += 1
        model.module[0].averaging = step >= args.stats_from
        try:
            g = torch.Generator().manual_seed(args.seed * 1_000_003 + session.rank * 10_007 + step)
            for micro in range(args.accumulate):  # gradients accumulate locally; only the last backward syncs
                x, y = loader.draw(g, step)
                last = micro == args.accumulate - 1
                with contextlib.nullcontext() if last else model.no_sync():
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        out = model(x)
                    loss = torch.nn.functional.mse_loss(out.float(), y) / args.accumulate
                    if step in overflow:
                        loss = loss * float("inf")  # non-finite gradients: scaler.step skips the update
                    if last and args.fault and started_on == fault_node and step == int(fault_step) \
                            and not session.is_shadow:
                        os.kill(os.getpid(), signal.SIGKILL)
                    scaler.scale(loss).backward()
            if (args.calibrate_once and iterations == 2) or (args.calibrate_first and iterations == 1):
                torch.distributed.all_reduce(torch.ones(5))  # its value is not used: only the collective matters
            scaler.unscale_(opt)
            scaler.unscale_(head_opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.step(head_opt)
            scaler.update()
            sched.step()
            head_sched.step()
            opt.zero_grad()
            head_opt.zero_grad()
        except worker.StepAborted:
            continue  # a peer failed: the runtime recovers and yields this step again
        if not session.is_shadow and time.perf_counter() - t0 < args.step_time_s:
            time.sleep(args.step_time_s - (time.perf_counter() - t0))

    digest = hashlib.sha256()  # the model's parameters and buffers (BatchNorm's statistics), the optimizer's state
    for name, obj in (("model", model.module), ("optimizer", opt), ("head_optimizer", head_opt)):
        for key, value in sorted(flatten(obj.state_dict(), name).items()):
            digest.update(key.encode())
            digest.update(value.numpy().tobytes() if isinstance(value, torch.Tensor) else repr(value).encode())
    digest.update(f"served={loader.served}".encode())  # the loader's position: as many draws as the reference's
    digest.update(f"steps={loader.steps} samples={progress.samples}".encode())
    digest.update(f"head_scheduler={sorted(head_sched.state_dict().items())!r}".encode())  # its Counter's type too
    digest.update(type(head_sched.milestones).__name__.encode())
    os.makedirs(os.path.join(session.run_dir, "final"), exist_ok=True)
    with open(os.path.join(session.run_dir, "final", f"rank{session.rank}.json"), "w") as f:
        json.dump({"rank": session.rank, "steps": args.steps, "state_sha256": digest.hexdigest(),
                   "lr": sched.get_last_lr()[0]}, f)
    session.finish(digest.hexdigest())


def flatten(value, prefix: str) -> dict:
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            out.update(flatten(v, f"{prefix}.{k}"))
        return out
    if isinstance(value, (list, tuple)):
        out = {}
        for i, v in enumerate(value):
            out.update(flatten(v, f"{prefix}.{i}"))
        return out
    return {prefix: value}


if __name__ == "__main__":
    main()

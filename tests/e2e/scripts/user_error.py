"""A tiny data-parallel job (a DDP linear model) for tests/e2e/test_user_errors.py, with the user's mistakes on
demand: die before ``worker.init()`` on one process, raise in a step on one rank, never manage the model, or train
in a plain ``session.steps()`` loop that does not catch ``StepAborted`` while one rank is killed in a step; and a
straggler on demand (``--slow-rank``).

    python tests/e2e/scripts/user_error.py --steps 20 [--die NODE/LOCAL_RANK:CODE] [--raise-at STEP --raise-rank R]
                                           [--unmanaged] [--step-time-s S] [--uncaught-at STEP --kill-rank R]
                                           [--slow-rank R --slow-s S]
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--die", default="", metavar="NODE/LOCAL_RANK:CODE", help="exit with CODE before init there")
    ap.add_argument("--raise-at", type=int, default=-1, help="raise ValueError in this step ...")
    ap.add_argument("--raise-rank", type=int, default=-1, help="... on this rank")
    ap.add_argument("--unmanaged", action="store_true", help="never give the model to session.manage")
    ap.add_argument("--step-time-s", type=float, default=0.05, help="pad each step to about this long (seconds)")
    ap.add_argument("--uncaught-at", type=int, default=-1, help="a plain steps() loop that does not catch "
                                                                 "StepAborted; SIGKILL --kill-rank in this step ...")
    ap.add_argument("--kill-rank", type=int, default=-1, help="... after its forward pass (a node failure)")
    ap.add_argument("--slow-rank", type=int, default=-1, help="a straggler: this rank sleeps --slow-s more ...")
    ap.add_argument("--slow-s", type=float, default=0.05, help="... in every step (seconds)")
    args = ap.parse_args()
    if args.die:
        where, code = args.die.split(":")
        if where == f"{os.environ.get('TM_NODE')}/{os.environ.get('TM_LOCAL_RANK')}":
            print(f"user_error.py: a mistake before worker.init(), exiting with code {code}", flush=True)
            sys.exit(int(code))

    import torch

    import worker

    torch.set_num_threads(1)
    session = worker.init()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    if not args.unmanaged:
        session.manage(model=model, optimizer=opt)

    def train_step(step: int) -> None:
        if step == args.raise_at and session.rank == args.raise_rank and not session.is_shadow:
            raise ValueError(f"a bad batch at step {step}")
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1000 * step + session.rank))
        loss = model(x).pow(2).mean()
        if step == args.uncaught_at and session.rank == args.kill_rank and not session.is_shadow:
            os.kill(os.getpid(), signal.SIGKILL)  # its peers are in this step's backward all-reduce, or soon
        opt.zero_grad()
        loss.backward()
        opt.step()
        if not session.is_shadow:
            time.sleep(args.step_time_s + (args.slow_s if session.rank == args.slow_rank else 0.0))

    if args.uncaught_at >= 0:
        for step in session.steps(args.steps):
            train_step(step)  # the mistake: a peer failure's StepAborted is not caught
    else:
        session.run(train_step, args.steps)
    session.finish()


if __name__ == "__main__":
    main()

"""One rank of a tiny gloo job for tests/unit/test_checkpoint.py: trains, checkpoints with worker.checkpoint, and
writes what it ended with to ``<out>/rank<r>.json``.

    python tests/unit/checkpoint_job.py --rank R --world W --store FILE --root DIR --out DIR --total N
        [--every E] [--keep K] [--stop S] [--resume] [--resume-from DIR] [--model ddp|fsdp]
        [--job-id ID] [--kill-in-commit STEP] [--disk-full-at STEP]

The model uses dropout (the CPU RNG), the optimizer is AdamW, the scheduler a StepLR, and each rank has a
rank-local data sampler (a torch.Generator). ``--stop S`` ends the process after step S (the job "crashes");
``--kill-in-commit STEP`` SIGKILLs rank 0 as it is about to write the manifest of STEP; ``--disk-full-at STEP``
limits every file this rank writes to 64 bytes while STEP is saved (writes fail with EFBIG, as on a full disk).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import signal
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from worker import checkpoint  # noqa: E402


class Sampler:
    """A rank-local data source: a generator seeded from the rank."""

    def __init__(self, rank: int) -> None:
        self.gen = torch.Generator().manual_seed(1000 + rank)
        self.served = 0

    def batch(self) -> torch.Tensor:
        self.served += 1
        return torch.randn(4, 8, generator=self.gen)

    def state_dict(self) -> dict:
        return {"gen": self.gen.get_state(), "served": self.served}

    def load_state_dict(self, state: dict) -> None:
        self.gen.set_state(state["gen"])
        self.served = state["served"]


def digest(*values) -> str:
    h = hashlib.sha256()

    def walk(v):
        if isinstance(v, torch.Tensor):
            v = v._local_tensor if hasattr(v, "_local_tensor") else v
            h.update(f"{v.dtype}{tuple(v.shape)}".encode())
            h.update(v.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes() if v.numel() else b"")
        elif isinstance(v, dict):
            for k in sorted(v, key=repr):
                h.update(repr(k).encode())
                walk(v[k])
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)
        else:
            h.update(repr(v).encode())

    for v in values:
        walk(v)
    return h.hexdigest()


def main() -> None:
    p = argparse.ArgumentParser()
    for name in ("--rank", "--world", "--total", "--every", "--keep", "--stop", "--kill-in-commit", "--disk-full-at"):
        p.add_argument(name, type=int, default=None)
    for name in ("--store", "--root", "--out", "--resume-from", "--job-id"):
        p.add_argument(name, default=None)
    p.add_argument("--model", default="ddp")
    p.add_argument("--resume", action="store_true")
    a = p.parse_args()
    dist.init_process_group("gloo", store=dist.FileStore(a.store, a.world), rank=a.rank, world_size=a.world)
    out = {"rank": a.rank, "errors": [], "refused": []}
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.3), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    if a.model == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        model = fully_shard(net, mesh=init_device_mesh("cpu", (a.world,)))
    else:
        model = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    torch.manual_seed(1 + a.rank)  # the dropout masks differ per rank: rank-local RNG state
    sampler = Sampler(a.rank)
    replicated, local = {"model": model, "optimizer": opt, "scheduler": sched}, {"sampler": sampler}
    try:
        ckpt = checkpoint.Checkpointer(a.root, a.job_id or "job-a", keep=a.keep or 2,
                                       on_error=lambda step, msg: out["errors"].append(msg))
        start = 0
        if a.resume or a.resume_from:
            start = ckpt.load(replicated, local, source=a.resume_from) or 0
            out["refused"] = ckpt.refused
        out["loaded"] = start
    except checkpoint.CheckpointError as e:
        out["refusal"] = str(e)
        json.dump(out, open(os.path.join(a.out, f"rank{a.rank}.json"), "w"))
        return
    if a.kill_in_commit is not None and a.rank == 0:
        commit = ckpt._commit

        def dying_commit(path, step, state):
            if step == a.kill_in_commit:
                os.kill(os.getpid(), signal.SIGKILL)
            commit(path, step, state)

        ckpt._commit = dying_commit
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    for step in range(start, a.total):
        loss = model(sampler.batch()).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        done = step + 1
        if a.every and done % a.every == 0:
            full = a.disk_full_at == done
            if full:
                ckpt.wait()
                resource.setrlimit(resource.RLIMIT_FSIZE, (64, resource.RLIM_INFINITY))
            ckpt.save(done, replicated, local)
            if full:
                ckpt.wait()
                resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        if a.stop == done:
            break
    ckpt.close()
    out["step"] = done if a.total > start else start
    out["hash"] = digest(model.state_dict(), opt.state_dict(), sched.state_dict(), sampler.state_dict(),
                         torch.get_rng_state())
    if a.model == "ddp" and a.rank == 0:
        torch.save({"model": net.state_dict(), "exp_avg": opt.state_dict()["state"][0]["exp_avg"]},
                   os.path.join(a.out, "final.pt"))
    json.dump(out, open(os.path.join(a.out, f"rank{a.rank}.json"), "w"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""CPU cost of a planned migration's tail at the switch step, by the number of tensors. Prints one JSON object.

    python -m benchmarks.tail [--sizes demo,100,300,1000] [--reps 40] [--no-save]

With pre-copy and optimizer replay (worker.precopy), the switch step moves only a tail: what the joiner's replay
did not make identical. The tail is on the critical path of every planned migration (issue 12, target 1: switch
stall <= 20 ms), and its cost grows with the number of tensors in the managed state_dicts, not their bytes; this
measures that cost on its own.

Two processes on this host (``torch.multiprocessing``, spawn) hold a 2-rank gloo group built like the job's
(worker.backend.build_gloo, bound to 127.0.0.1) and identical managed objects: a model and its AdamW after one
step. ``demo`` is the demo GPT (examples.gpt.GPTConfig()); a number N is a stack of N / 2 ``Linear(64, 64)``
layers, N parameter tensors (a 7B Llama has 291). AdamW adds ``step``, ``exp_avg`` and ``exp_avg_sq`` per
parameter, so the tail covers 4 N tensors. Rank 0 is the leaver: a real ``Precopy`` whose replay tracked the
optimizer, so every tensor is kept. Per repetition it builds the tail and sends it (``Precopy._tail_state``,
worker.transfer.send_state); rank 1, the joiner, receives it and loads it (recv_state, precopy.load_tail). Two
cases, alternated:

- ``same``: nothing changed since the replay (the demo's case): the joiner loads nothing;
- ``lr``: the leaver's learning rate changed after its last replayed step (a scheduler), so the joiner loads its
  optimizer (its own tensors, by reference).

Each end's CPU time is ``time.thread_time`` around its part, in ms. The figure is the median over ``reps``
repetitions, after one warm-up. ``us_per_tensor`` is the slower end's median over the tail's tensor count.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch

CASES = ("same", "lr")


def parameters(size: str) -> int:
    """The parameter count ``size`` names (0 for ``demo``). Raises ValueError for anything but ``demo`` or an even
    count >= 2."""
    if size == "demo":
        return 0
    if not size.isdigit() or int(size) < 2 or int(size) % 2:
        raise ValueError(f"size {size!r}: an even parameter count >= 2, or 'demo'")
    return int(size)


def build(size: str) -> dict[str, Any]:
    """The managed objects of either end for ``size`` (``demo`` or a parameter count), the same on both. Raises
    ValueError for a size :func:`parameters` refuses."""
    n = parameters(size)
    torch.manual_seed(0)
    if n:
        model: torch.nn.Module = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(n // 2)])
    else:
        from examples.gpt import GPT, GPTConfig

        model = GPT(GPTConfig())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for q in model.parameters():
        q.grad = torch.full_like(q, 1e-3)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return {"model": model, "optimizer": opt}


def tail_tensors(objects: dict[str, Any]) -> int:
    """How many tensors a tail of ``objects`` covers (every state_dict's)."""
    from worker import precopy

    return sum(isinstance(leaf, torch.Tensor) for obj in objects.values()
               for leaf in precopy.flatten(obj.state_dict())[0])


def summarize(tensors: int, leaver_s: list[float], joiner_s: list[float]) -> dict:
    """Medians of one case in ms, and the slower end's microseconds per tensor."""
    leaver, joiner = statistics.median(leaver_s) * 1e3, statistics.median(joiner_s) * 1e3
    return {"leaver_cpu_ms": round(leaver, 3), "joiner_cpu_ms": round(joiner, 3),
            "us_per_tensor": round(max(leaver, joiner) * 1e3 / tensors, 2) if tensors else None}


def _measure(rank: int, pg: Any, keys: Any, size: str, reps: int) -> dict:
    from worker import precopy, transfer

    objects = build(size)
    opt = objects["optimizer"]
    pc = precopy.Precopy(pg, 0, objects, keys) if rank == 0 else None
    if pc is not None:
        for name, o in pc.optimizers.items():
            pc._track(name, o)  # what the post-hook of a replayed step records
    times: dict[str, list[float]] = {case: [] for case in CASES}
    for rep in range(reps + 1):  # the first repetition warms up and is dropped
        for case in CASES:
            lr = 1e-3 if case == "same" else 1e-3 / (rep + 2)
            pg.barrier().wait()
            c0 = time.thread_time()
            if pc is not None:
                opt.param_groups[0]["lr"] = lr
                tail = {name: precopy._Fixed(pc._tail_state(name, obj)) for name, obj in objects.items()}
                transfer.send_state(pg, tail, {"kind": precopy.Kind.TAIL.value, "lr": lr}, keys=keys)
            else:
                states, extra, _, _ = transfer.recv_state(pg, 0, keys=keys)
                precopy.load_tail(objects, states)
            spent = time.thread_time() - c0
            if pc is None:
                assert opt.param_groups[0]["lr"] == extra["lr"], "the joiner did not take the leaver's lr"
                opt.param_groups[0]["lr"] = 1e-3  # as the leaver's own: the next ``same`` loads nothing
            if rep:
                times[case].append(spent)
    return {"tensors": tail_tensors(objects), "kept": pc.kept // (2 * (reps + 1)) if pc else None, "times": times}


def run(sizes: list[str], reps: int) -> dict:
    """Measure every size in ``sizes`` over ``reps`` timed repetitions per case, each size in two fresh processes
    (what an earlier size left in a process's heap would otherwise slow the next). Returns the result object."""
    from benchmarks import pair

    out = {}
    for size in sizes:
        results = pair.run(_measure, size, reps, name="bench-tail")
        leaver, joiner = results[0], results[1]
        out[size] = {"tensors": leaver["tensors"], "kept": leaver["kept"],
                     **{case: summarize(leaver["tensors"], leaver["times"][case], joiner["times"][case])
                        for case in CASES}}
    return {"benchmark": "tail", "reps": reps, "sizes": out}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="demo,100,300,1000",
                    help="comma-separated: 'demo' or an even number of parameter tensors")
    ap.add_argument("--reps", type=int, default=40, help="timed repetitions per case (median)")
    ap.add_argument("--no-save", action="store_true", help="print only; do not write benchmarks/results")
    args = ap.parse_args(argv)
    sizes = [s for s in args.sizes.split(",") if s]
    for size in sizes:
        try:
            parameters(size)
        except ValueError as e:
            ap.error(str(e))
    result = run(sizes, args.reps)
    print(json.dumps(result, indent=1))
    if not args.no_save:
        from benchmarks import report

        report.save("tail", result, [])
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Data-parallel byte-level GPT training on Shakespeare, run on every rank under the TrainMover runtime.

Launched by the runtime on each node (active ranks and standbys alike)::

    python examples/train_gpt.py --steps 40 [--batch-size 8] [--seed 0] [--tiny] [--log-every 5]
                                 [--dropout P] [--seed-mode shared|per-rank|per-step] [--device cpu|cuda]

``worker.init()`` blocks on a standby until it is assigned a rank, then installs
the default process group. ``session.manage(...)`` hands the model, optimizer
and data stream to the runtime, which can move this rank's state to a joiner
between steps; ``session.run(train_step, n)`` calls ``train_step(step)`` for the
steps this process should run (a joiner starts at the step where the leaver
stopped; after a peer failure the interrupted step is redone).

At the end each rank writes ``<run_dir>/final/rank<r>.json`` with
``{"rank", "steps", "state_sha256", "loss", "rng_sha256"}`` (``rng_sha256``: the CPU RNG state's) and reports the
state hash via
``session.finish``. The hash is identical with and without migrations.
"""

from __future__ import annotations

import argparse
import enum
import hashlib
import json
import os
import sys
import time

import torch

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from examples import pacing  # noqa: E402
from examples.data import ShakespeareStream, load_corpus  # noqa: E402
from examples.gpt import GPT, GPTConfig, loss as lm_loss  # noqa: E402
from examples.state_hash import final_state_hash  # noqa: E402


class SeedMode(enum.StrEnum):
    """How the global RNG (dropout masks) is seeded: ``shared`` (``--seed`` before the model is built, the same
    stream on every rank), ``per-rank`` (``torch.manual_seed(seed + rank)`` after ``worker.init()``) or
    ``per-step`` (reseeded from (seed, rank, step) at the start of every step)."""

    SHARED = "shared"
    PER_RANK = "per-rank"
    PER_STEP = "per-step"


def step_seed(seed: int, rank: int, step: int) -> int:
    """The ``per-step`` seed of ``rank`` at ``step`` (63 bits, stable across processes)."""
    digest = hashlib.sha256(f"train_gpt/{seed}/{rank}/{step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class FaultPhase(enum.StrEnum):
    """When a ``--fault`` fires within its step: before backward, half-way through the backward pass (as the
    gradient of the middle parameter is computed), as the optimizer update starts, or after the step."""

    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"
    BETWEEN = "between"


def parse_faults(parser: argparse.ArgumentParser, specs: list[str]) -> dict[tuple[str, int], FaultPhase]:
    """``--fault NODE:STEP:PHASE`` values as {(node, step): phase}; a bad phase is the parser's error (exit 2)."""
    faults = {}
    for f in specs:
        node, step, phase = f.split(":")
        if phase not in tuple(FaultPhase):
            parser.error(f"--fault phase must be one of {', '.join(FaultPhase)}, not {phase!r}")
        faults[(node, int(step))] = FaultPhase(phase)
    return faults


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40, help="total optimizer steps of the job")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per rank per step (default 8; 4 with --tiny)")
    p.add_argument("--seed", type=int, default=0, help="model-init and data seed")
    p.add_argument("--tiny", action="store_true", help="d_model 32, 1 layer, 2 heads, context 32, batch 4")
    p.add_argument("--dropout", type=float, default=0.0,
                   help="dropout probability on every block's output (randomness in the step; default 0: none)")
    p.add_argument("--seed-mode", choices=tuple(SeedMode), default=SeedMode.SHARED,
                   help="shared: one RNG stream on every rank; per-rank: manual_seed(seed + rank) after init; "
                        "per-step: reseed from (seed, rank, step) every step")
    p.add_argument("--unmanaged-model", action="store_true",
                   help="misuse, for tests: do not manage the model and do not wrap it in DDP (gradients averaged "
                        "by hand), so only the runtime's replica check can see that a joiner keeps a fresh model")
    p.add_argument("--log-every", type=int, default=5, help="print rank 0's loss every N steps")
    p.add_argument("--group-size", type=int, default=0,
                   help="also make subgroups of this many consecutive ranks (e.g. one per node) and average the "
                        "loss over them each step: a subgroup collective that migrations must keep working")
    p.add_argument("--slow-rank", type=int, default=-1, help="make this rank a straggler (for tests and demos)")
    p.add_argument("--slow-s", type=float, default=0.05, help="seconds the --slow-rank sleeps in every step")
    p.add_argument("--slow-steps", type=str, default="",
                   help="comma-separated steps in which --slow-rank sleeps --slow-s (default: every step)")
    p.add_argument("--fault", action="append", default=[], metavar="NODE:STEP:PHASE",
                   help="fault injection for tests: at STEP, kill -9 every rank process of NODE (TM_NODE) during "
                        "PHASE: forward (before backward), backward (half-way through it), optimizer (as the update "
                        "starts) or between (after the step); repeatable. Only the processes started on NODE fire "
                        "it, not their replacements")
    p.add_argument("--zero-grad", choices=("before-backward", "after-step"), default="before-backward",
                   help="where the step clears the gradients (set to None): before the backward pass, or after the "
                        "optimizer step (the other common pattern; identical numerics)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the model, optimizer state and batches live: cpu, or cuda (cuda:<LOCAL_RANK modulo the "
                        "visible devices>, so ranks may share one GPU; over gloo set TM_INNER_BACKEND=gloo)")
    pacing.add_arguments(p)
    args = p.parse_args(argv)
    args.slow_steps = {int(s) for s in args.slow_steps.split(",") if s}
    args.fault = parse_faults(p, args.fault)
    args.seed_mode = SeedMode(args.seed_mode)
    if args.batch_size is None:
        args.batch_size = 4 if args.tiny else 8
    return args


def model_config(tiny: bool) -> GPTConfig:
    """The demo model (``tiny=False``) or the fast-test model (``tiny=True``)."""
    return GPTConfig.tiny() if tiny else GPTConfig()


def rank_device(kind: str) -> torch.device:
    """This rank's device for ``--device kind``: the CPU, or ``cuda:<LOCAL_RANK % visible devices>`` (made the
    current device). Raises RuntimeError for cuda where CUDA is not available."""
    if kind == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("--device cuda: CUDA is not available here")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def rng_sha256() -> str:
    """sha256 of this process's CPU RNG state (what the next dropout mask is drawn from)."""
    return hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()


def write_final(run_dir: str, rank: int, steps: int, state_sha256: str, loss: float | None,
                rng: str | None = None) -> str:
    """Atomically write ``<run_dir>/final/rank<rank>.json`` (``rng``: :func:`rng_sha256`, or None); returns its
    path."""
    final_dir = os.path.join(run_dir, "final")
    os.makedirs(final_dir, exist_ok=True)
    path = os.path.join(final_dir, f"rank{rank}.json")
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"rank": rank, "steps": steps, "state_sha256": state_sha256, "loss": loss, "rng_sha256": rng}, f)
    os.replace(tmp, path)
    return path


def kill_node() -> None:
    """kill -9 every rank process of this node (same TM_NODE and TM_RUN_DIR), this one last."""
    import psutil

    me = psutil.Process()
    mine = {k: os.environ.get(k) for k in ("TM_NODE", "TM_RUN_DIR")}
    for proc in psutil.process_iter():
        try:
            if proc.pid != me.pid and {k: proc.environ().get(k) for k in mine} == mine:
                proc.kill()
        except psutil.Error:
            pass
    me.kill()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)

    import worker  # the TrainMover runtime; imported here so this module can be imported without it

    # Rank-independent set-up goes before init(): a standby does it while it waits, so it is warm when promoted.
    cfg = model_config(args.tiny)
    torch.manual_seed(args.seed)  # identical initial weights on every rank
    gpt = GPT(cfg)
    load_corpus()

    if args.dropout > 0:  # dropout on each block's output: draws from the global CPU RNG every step
        for block in gpt.blocks:
            block.register_forward_hook(lambda mod, inp, out: torch.nn.functional.dropout(out, args.dropout,
                                                                                          mod.training))

    session = worker.init()  # standbys block here until they are given a rank
    device = rank_device(args.device)
    gpt.to(device)
    if args.seed_mode == SeedMode.PER_RANK:
        torch.manual_seed(args.seed + session.rank)  # each rank its own stream: the runtime keeps each rank's RNG
    model = gpt if args.unmanaged_model else torch.nn.parallel.DistributedDataParallel(gpt)  # backend "tmover"
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    data = ShakespeareStream(session.rank, batch_size=args.batch_size, context=cfg.context, seed=args.seed)
    if args.unmanaged_model:
        session.manage(optimizer=opt)  # the mistake: the model's parameters move with nobody
    else:
        session.manage(model=model, optimizer=opt)  # identical on every data-parallel replica
    session.manage(rank_local=True, data=data)  # this rank's shard; batches are a function of the step
    subgroup = None
    if args.group_size:
        for first in range(0, session.world_size, args.group_size):  # every process makes every group, in order
            pg = session.new_group(list(range(first, min(first + args.group_size, session.world_size))))
            subgroup = pg if pg is not None else subgroup

    last = {"loss": None, "step": -1}
    t_log = time.perf_counter()

    def fault(step: int, phase: FaultPhase) -> None:
        if args.fault.get((os.environ.get("TM_NODE"), step)) == phase and not session.is_shadow:
            kill_node()

    opt.register_step_pre_hook(lambda *_: fault(last["step"] + 1, FaultPhase.OPTIMIZER))

    pacer = pacing.Pacer.from_args(args)

    def train_step(step: int) -> None:
        nonlocal t_log
        t_step = time.perf_counter()
        if args.seed_mode == SeedMode.PER_STEP:
            torch.manual_seed(step_seed(args.seed, session.rank, step))
        x, y = (t.to(device) for t in data.batch(step))  # int64 [B, T] each
        loss = lm_loss(model(x), y)
        fault(step, FaultPhase.FORWARD)
        if args.zero_grad == "before-backward":
            opt.zero_grad(set_to_none=True)
        if args.fault.get((os.environ.get("TM_NODE"), step)) == FaultPhase.BACKWARD:
            params = [q for q in model.parameters() if q.requires_grad]
            params[len(params) // 2].register_hook(lambda grad: fault(step, FaultPhase.BACKWARD))  # it dies there
        loss.backward()
        if args.unmanaged_model:  # what DDP would do: average the gradients
            for param in model.parameters():
                torch.distributed.all_reduce(param.grad)
                param.grad /= session.world_size
        opt.step()  # refused (StepAborted) if a collective of this step failed: the runtime redoes the step
        if args.zero_grad == "after-step":  # an interrupted step leaves its own gradients: the runtime clears them
            opt.zero_grad(set_to_none=True)
        if subgroup is not None:  # the loss averaged over this rank's subgroup (logging only)
            group_loss = loss.detach().clone()
            torch.distributed.all_reduce(group_loss, group=subgroup)
            loss = group_loss / torch.distributed.get_world_size(subgroup)
        last["loss"], last["step"] = loss.item(), step
        if session.rank == args.slow_rank and not session.is_shadow and (not args.slow_steps or step in args.slow_steps):
            time.sleep(args.slow_s)  # arrives late at the next step's collectives: its peers wait for it
        pacer.pad(t_step, session.is_shadow)
        if session.rank == 0 and not session.is_shadow and (step + 1) % args.log_every == 0:
            now = time.perf_counter()
            print(
                f"step {step + 1:5d}/{args.steps}  loss {last['loss']:.4f}  "
                f"{(now - t_log) / args.log_every:.3f} s/step",
                flush=True,
            )
            t_log = now
        fault(step, FaultPhase.BETWEEN)

    session.run(train_step, args.steps)  # recovers from peer failures in process and redoes the step
    last_loss, last_step = last["loss"], last["step"]

    digest = final_state_hash(model, opt)
    if not session.is_shadow:
        # data.next_step counts the job's completed steps, including those a leaver ran before handing over.
        write_final(session.run_dir, session.rank, max(data.next_step, last_step + 1), digest, last_loss,
                    rng_sha256())
    session.finish(digest)


if __name__ == "__main__":
    main()

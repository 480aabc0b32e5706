"""Hybrid-parallel (FSDP2 / HSDP / tensor / pipeline parallel) byte-level Llama training on Shakespeare, written
the way torchtitan users write it, run on every rank under the TrainMover runtime.

Launched by the runtime on each node (active ranks and standbys alike)::

    python -m examples.train_llama --steps 40 [--tiny] [--dp-replicate R] [--dp-shard S] [--tp T] [--pp P]
                                   [--seed 0] [--log-every 5] [--fault NODE:STEP:PHASE] [--min-step-time-s X]

The layout is ONE ``init_device_mesh(device, shape, mesh_dim_names=...)`` with the dims in torchtitan's order
``("pp", "dp_replicate", "dp_shard", "tp")``, keeping only the dims larger than 1; the world size must equal
their product (``--dp-shard -1``, the default, takes what is left). With 2 ranks per node, consecutive ranks share
a node, so the innermost dim is in-node: ``--tp 2 --dp-shard 2`` is TP in node x FSDP across nodes,
``--dp-replicate 2 --dp-shard 2`` is HSDP with replicas across nodes, ``--pp 2 --dp-shard 2`` puts the pipeline
stages on different nodes. Parallelization, in torchtitan's order:

* PP (``--pp``): the model is built whole (same seed everywhere), then each stage keeps a contiguous run of
  ``layers`` (stage 0 also the embeddings, the last stage also ``norm`` and ``output``); a ``PipelineStage`` over
  ``mesh["pp"].get_group()`` and a ``Schedule1F1B`` (or ``ScheduleGPipe``, ``--pp-schedule gpipe``) with
  ``--microbatches`` microbatches and the cross-entropy loss.
* TP (``--tp``): ``parallelize_module`` over ``mesh["tp"]`` with ``ColwiseParallel`` on attention ``wq/wk/wv`` and
  MLP ``w1/w3``, ``RowwiseParallel`` on ``wo`` and ``w2`` (no sequence or loss parallelism); ``n_heads`` and
  ``n_kv_heads`` must divide by ``tp``. Weights are split locally (``src_data_rank=None``): every rank built the
  same weights from the seed, so set-up needs no communication.
* FSDP2 / HSDP (``--dp-shard`` > 1): ``fully_shard`` on every block and on the root, over ``mesh["dp_shard"]``
  (FSDP) or the 2-D ``mesh["dp_replicate", "dp_shard"]`` (HSDP).
* Replication only (``--dp-replicate`` > 1, ``--dp-shard`` 1): ``DistributedDataParallel`` over
  ``mesh["dp_replicate"].get_group()`` (``find_unused_parameters=True`` under PP, whose several microbatch
  backwards per step break DDP's bucket rebuild; tensor parallelism cannot be combined with it here: use HSDP).

AdamW (``--lr``, weight decay 0.1, betas 0.9/0.95) with a ``LambdaLR`` schedule (linear warm-up over
``--warmup-steps``, then cosine to 10% of ``--lr``); gradient-norm clipping with ``--max-norm`` (0: off). The
batch of data-parallel index ``d = replicate_index * dp_shard + shard_index`` at step ``s`` is a pure function of
``(seed, d, s)`` (``examples.data.ShakespeareStream(d)``), so every TP/PP peer of a data-parallel rank sees the
same batch and a redone step sees the same data. Rank 0 prints the loss every ``--log-every`` steps (under PP the
last stage's loss is summed over the pipeline group so that every rank has it).

At the end each rank writes ``<run_dir>/final/rank<r>.json`` with ``{"rank", "steps", "state_sha256", "loss",
"rng_sha256"}`` (the hash covers this rank's LOCAL shards of the model and optimizer state, see
``examples.state_hash``; ``rng_sha256`` the CPU RNG state's) and reports the hash via ``session.finish``.

Without the runtime (``--plain``, or ``TM_PLAIN=1``): the default process group is a plain gloo group built from
torchrun-style environment variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) and a minimal
stand-in session runs the steps; the final JSON goes under ``--run-dir`` (or ``TM_RUN_DIR``). Used by
``tests/e2e/test_llama_layouts.py`` and for runs under ``torchrun``. ``--fault`` is ignored there.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from examples import pacing  # noqa: E402
from examples.data import ShakespeareStream, load_corpus  # noqa: E402
from examples.llama import LlamaConfig, Transformer, loss as lm_loss  # noqa: E402
from examples.state_hash import final_state_hash  # noqa: E402
from examples.train_gpt import FaultPhase, kill_node, parse_faults, rng_sha256, write_final  # noqa: E402

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")  # torchtitan's order, outermost first


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40, help="total optimizer steps of the job")
    p.add_argument("--batch-size", type=int, default=None,
                   help="sequences per data-parallel rank per step (default 8; 4 with --tiny)")
    p.add_argument("--seed", type=int, default=0, help="model-init and data seed")
    p.add_argument("--tiny", action="store_true", help="dim 32, 2 layers, 4 heads, 2 kv heads, sequence 32, batch 4")
    p.add_argument("--tie-embeddings", action="store_true", help="share the embedding and output weights (no --pp)")
    p.add_argument("--dp-replicate", type=int, default=1, help="data-parallel replicas (DDP, or HSDP's outer dim)")
    p.add_argument("--dp-shard", type=int, default=-1,
                   help="FSDP2 shard degree; -1 (default): world size / (pp * dp_replicate * tp)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (innermost mesh dim)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (outermost mesh dim)")
    p.add_argument("--pp-schedule", choices=("1f1b", "gpipe"), default="1f1b", help="pipeline schedule")
    p.add_argument("--microbatches", type=int, default=2, help="pipeline microbatches per step (divide the batch)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak AdamW learning rate")
    p.add_argument("--warmup-steps", type=int, default=None, help="linear warm-up steps (default: steps // 10)")
    p.add_argument("--max-norm", type=float, default=1.0, help="clip the gradient norm to this (0: no clipping)")
    p.add_argument("--log-every", type=int, default=5, help="print rank 0's loss every N steps")
    p.add_argument("--fault", action="append", default=[], metavar="NODE:STEP:PHASE",
                   help="fault injection for tests: at STEP, kill -9 every rank process of NODE (TM_NODE) during "
                        "PHASE: forward (after the forward, or after the whole pipeline schedule under --pp), "
                        "optimizer (as the update starts) or between (after the step); repeatable")
    pacing.add_arguments(p)
    p.add_argument("--plain", action="store_true", default=os.environ.get("TM_PLAIN") == "1",
                   help="no runtime: plain gloo default group from RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT")
    p.add_argument("--run-dir", default=os.environ.get("TM_RUN_DIR", ""), help="--plain only: where final/ goes")
    args = p.parse_args(argv)
    args.fault = parse_faults(p, args.fault)
    if args.batch_size is None:
        args.batch_size = 4 if args.tiny else 8
    if args.warmup_steps is None:
        args.warmup_steps = args.steps // 10
    for name in ("dp_replicate", "tp", "pp", "microbatches"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.pp > 1 and args.batch_size % args.microbatches:
        p.error(f"--batch-size {args.batch_size} must divide by --microbatches {args.microbatches}")
    if args.pp > 1 and args.tie_embeddings:
        p.error("--tie-embeddings cannot be split over pipeline stages (--pp > 1)")
    if args.plain and not args.run_dir:
        p.error("--plain needs --run-dir (or TM_RUN_DIR)")
    return args


def model_config(args: argparse.Namespace) -> LlamaConfig:
    """The demo model, or the ``--tiny`` test model; ``--tie-embeddings`` applied."""
    cfg = LlamaConfig.tiny() if args.tiny else LlamaConfig()
    cfg.tie_embeddings = args.tie_embeddings
    return cfg


@dataclass
class Layout:
    """The parallel layout of this job: degrees (``--dp-shard -1`` resolved), the mesh (None on one rank) and this
    rank's coordinate along each dim (0 along dims of size 1)."""

    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int
    mesh: Any  # torch.distributed.device_mesh.DeviceMesh | None
    coord: dict[str, int]

    @property
    def dp_index(self) -> int:
        """This rank's data-parallel index: ``replicate_index * dp_shard + shard_index``."""
        return self.coord["dp_replicate"] * self.dp_shard + self.coord["dp_shard"]

    def size(self, dim: str) -> int:
        return getattr(self, dim)


def build_layout(args: argparse.Namespace, world_size: int, device_type: str) -> Layout:
    """The mesh over ``world_size`` ranks from ``--pp/--dp-replicate/--dp-shard/--tp`` (one ``init_device_mesh``,
    dims of size 1 left out). Raises ValueError when the world size is not the product of the degrees."""
    rest = args.pp * args.dp_replicate * args.tp
    dp_shard = args.dp_shard
    if dp_shard == -1:
        if world_size % rest:
            raise ValueError(f"world size {world_size} is not divisible by pp {args.pp} x dp_replicate "
                             f"{args.dp_replicate} x tp {args.tp}")
        dp_shard = world_size // rest
    if dp_shard < 1 or rest * dp_shard != world_size:
        raise ValueError(f"world size {world_size} != pp {args.pp} x dp_replicate {args.dp_replicate} x dp_shard "
                         f"{dp_shard} x tp {args.tp} = {rest * dp_shard}")
    sizes = {"pp": args.pp, "dp_replicate": args.dp_replicate, "dp_shard": dp_shard, "tp": args.tp}
    names = tuple(d for d in MESH_DIMS if sizes[d] > 1)
    mesh = None
    coord = {d: 0 for d in MESH_DIMS}
    if names:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device_type, tuple(sizes[d] for d in names), mesh_dim_names=names)
        for d in names:
            coord[d] = mesh.get_local_rank(d)
    return Layout(pp=args.pp, dp_replicate=args.dp_replicate, dp_shard=dp_shard, tp=args.tp, mesh=mesh,
                  coord=coord)


def stage_layers(n_layers: int, pp: int, stage: int) -> range:
    """The block indices of pipeline ``stage`` of ``pp``: contiguous, the first stages one longer when uneven.
    Raises ValueError when there are fewer blocks than stages."""
    if n_layers < pp:
        raise ValueError(f"{n_layers} layers cannot fill {pp} pipeline stages")
    base, extra = divmod(n_layers, pp)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


def split_stage(model: Transformer, pp: int, stage: int) -> Transformer:
    """Keep only pipeline ``stage``'s part of ``model`` (in place; returns it): its blocks (names unchanged), the
    embeddings on stage 0, ``norm`` and ``output`` on the last stage."""
    keep = {str(i) for i in stage_layers(len(model.layers), pp, stage)}
    for name in list(model.layers.keys()):
        if name not in keep:
            del model.layers[name]
    if stage != 0:
        model.tok_embeddings = None
    if stage != pp - 1:
        model.norm = None
        model.output = None
    return model


def apply_tp(model: Transformer, tp_mesh: Any, cfg: LlamaConfig) -> None:
    """Tensor parallelism on every block: column-wise wq/wk/wv/w1/w3, row-wise wo/w2. Raises ValueError when the
    head counts do not divide by the TP degree."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = tp_mesh.size()
    if cfg.n_heads % tp or cfg.n_kv_heads % tp:
        raise ValueError(f"n_heads {cfg.n_heads} and n_kv_heads {cfg.n_kv_heads} must divide by tp {tp}")
    plan = {
        "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(),
        "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(),
    }
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, plan, src_data_rank=None)  # same weights everywhere: split locally


def apply_fsdp(model: Transformer, dp_mesh: Any) -> None:
    """FSDP2 on every block, then on the root (1-D mesh: FSDP; 2-D (replicate, shard) mesh: HSDP)."""
    from torch.distributed.fsdp import fully_shard

    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)


def parallelize(model: Transformer, layout: Layout, cfg: LlamaConfig) -> torch.nn.Module:
    """Apply TP, then FSDP2/HSDP or DDP, to ``model`` (already this rank's pipeline stage); returns the module to
    train (the DDP wrapper when replication only, else ``model`` itself)."""
    mesh = layout.mesh
    if layout.tp > 1:
        apply_tp(model, mesh["tp"], cfg)
    if layout.dp_shard > 1:
        apply_fsdp(model, mesh["dp_replicate", "dp_shard"] if layout.dp_replicate > 1 else mesh["dp_shard"])
    elif layout.dp_replicate > 1:
        if layout.tp > 1:
            raise ValueError("--dp-replicate with --tp needs --dp-shard > 1 (HSDP); DDP here is data-parallel only")
        # Under PP the stage runs several microbatch backwards per step; DDP's one-time bucket rebuild after the
        # first step counts every microbatch's hooks and fails (an internal assert); find_unused_parameters=True
        # keeps the initial buckets.
        return torch.nn.parallel.DistributedDataParallel(model, process_group=mesh["dp_replicate"].get_group(),
                                                         find_unused_parameters=layout.pp > 1)
    return model


def lr_lambda(warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """The LR multiplier at a scheduler step: linear warm-up to 1 over ``warmup_steps``, then cosine decay to 0.1
    at ``total_steps``."""
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return factor


class PlainSession:
    """The part of ``worker.Session`` this script uses, without the runtime (``--plain``): a plain gloo default
    process group from torchrun-style environment variables; ``manage`` is a no-op and ``run`` a plain loop."""

    is_shadow = False

    def __init__(self, run_dir: str) -> None:
        dist.init_process_group("gloo")
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.run_dir = run_dir

    def manage(self, rank_local: bool = False, **objects: Any) -> None:
        pass

    def run(self, step_fn: Callable[[int], Any], total: int) -> None:
        for step in range(total):
            step_fn(step)

    def finish(self, note: Optional[str] = None) -> None:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    device_type = "cuda" if torch.cuda.is_available() else "cpu"

    # Rank-independent set-up before init(): a standby does it while it waits, so it is warm when promoted.
    cfg = model_config(args)
    torch.manual_seed(args.seed)  # identical initial weights on every rank (HSDP replicas, TP/PP peers)
    model = Transformer(cfg)
    load_corpus()

    if args.plain:
        session: Any = PlainSession(args.run_dir)
    else:
        import worker  # the TrainMover runtime; imported here so this module can be imported without it

        session = worker.init()  # standbys block here until they are given a rank; backend "tmover"
    world_size = dist.get_world_size()
    layout = build_layout(args, world_size, device_type)
    device = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    model.to(device)

    stage_index = layout.coord["pp"]
    first_stage, last_stage = stage_index == 0, stage_index == layout.pp - 1
    if layout.pp > 1:
        split_stage(model, layout.pp, stage_index)
    trained = parallelize(model, layout, cfg)

    schedule, pp_group = None, None
    if layout.pp > 1:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        pp_group = layout.mesh["pp"].get_group()
        stage = PipelineStage(trained, stage_index, layout.pp, device, group=pp_group)
        kind = Schedule1F1B if args.pp_schedule == "1f1b" else ScheduleGPipe
        schedule = kind(stage, n_microbatches=args.microbatches, loss_fn=lm_loss)

    opt = torch.optim.AdamW(trained.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(args.warmup_steps, args.steps))
    data = ShakespeareStream(layout.dp_index, batch_size=args.batch_size, context=cfg.max_seq_len, seed=args.seed)
    session.manage(model=trained, optimizer=opt, scheduler=sched)
    session.manage(rank_local=True, data=data)  # batches are a function of (step, data-parallel index)

    last = {"loss": None, "step": -1}
    t_log = time.perf_counter()

    def fault(step: int, phase: FaultPhase) -> None:
        if args.fault.get((os.environ.get("TM_NODE"), step)) == phase and not session.is_shadow:
            kill_node()

    if not args.plain:
        opt.register_step_pre_hook(lambda *_: fault(last["step"] + 1, FaultPhase.OPTIMIZER))

    def forward_backward(x: torch.Tensor, y: torch.Tensor, step: int) -> torch.Tensor:
        """One step's gradients; returns the (detached) loss of this data-parallel rank's batch."""
        if schedule is None:
            loss = lm_loss(trained(x), y)
            fault(step, FaultPhase.FORWARD)
            loss.backward()
            return loss.detach()
        losses: list[torch.Tensor] = []
        if first_stage:
            schedule.step(x, target=y if last_stage else None, losses=losses)
        else:
            schedule.step(target=y if last_stage else None, losses=losses)
        fault(step, FaultPhase.FORWARD)
        loss = torch.stack(losses).mean().detach() if last_stage else torch.zeros((), device=device)
        dist.all_reduce(loss, group=pp_group)  # every stage gets the last stage's loss (logging only)
        return loss

    pacer = pacing.Pacer.from_args(args)

    def train_step(step: int) -> None:
        nonlocal t_log
        t_step = time.perf_counter()
        x, y = data.batch(step)  # int64 [B, T] each
        x, y = x.to(device), y.to(device)
        opt.zero_grad(set_to_none=True)
        loss = forward_backward(x, y, step)
        if args.max_norm > 0:
            clip_grad_norm(trained, args.max_norm, pp_group)
        opt.step()  # refused (StepAborted) if a collective of this step failed: the runtime redoes the step
        sched.step()
        last["loss"], last["step"] = loss.item(), step
        pacer.pad(t_step, session.is_shadow)
        if session.rank == 0 and not session.is_shadow and (step + 1) % args.log_every == 0:
            now = time.perf_counter()
            print(f"step {step + 1:5d}/{args.steps}  loss {last['loss']:.4f}  "
                  f"{(now - t_log) / args.log_every:.3f} s/step", flush=True)
            t_log = now
        fault(step, FaultPhase.BETWEEN)

    session.run(train_step, args.steps)  # recovers from peer failures in process and redoes the step

    digest = final_state_hash(trained, opt)
    if not session.is_shadow:
        # data.next_step counts the job's completed steps, including those a leaver ran before handing over.
        write_final(session.run_dir, session.rank, max(data.next_step, last["step"] + 1), digest, last["loss"],
                    rng_sha256())
    session.finish(digest)


def clip_grad_norm(model: torch.nn.Module, max_norm: float, pp_group: Any) -> torch.Tensor:
    """Scale the gradients so that their global 2-norm is at most ``max_norm``; returns that norm before clipping
    (float32 scalar, the same on every rank). ``torch.nn.utils.clip_grad_norm_`` cannot stack the norms of DTensors
    on different meshes (FSDP2 x TP puts TP weights on the 2-D mesh, the rest on the dp mesh), so the norm is taken
    per mesh (``get_total_norm``, then ``full_tensor()``: one reduction per mesh dim), the squares summed, and under
    PP summed over the pipeline group as well (torchtitan's way)."""
    from torch.distributed.tensor import DTensor

    by_mesh: dict[int, list[torch.nn.Parameter]] = {}  # id(mesh) (0: plain tensors) -> params, in model order
    for p in model.parameters():
        if p.grad is not None:
            by_mesh.setdefault(id(p.grad.device_mesh) if isinstance(p.grad, DTensor) else 0, []).append(p)
    squares = []
    for params in by_mesh.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0, foreach=True)
        squares.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).float() ** 2)
    total_sq = torch.stack(squares).sum()
    if pp_group is not None:
        dist.all_reduce(total_sq, group=pp_group)
    total = total_sq.sqrt()
    for params in by_mesh.values():  # one mesh at a time: foreach ops cannot mix meshes either
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
    return total


if __name__ == "__main__":
    main()

"""torchtitan's own Trainer, with or without the runtime, writing each rank's final state hash: the driver of the
torchtitan tests and benchmark. A user needs none of this: ``python -m worker.integrations.torchtitan`` is the
entry point (docs/torchtitan.md).

    tmd local ... -- python -m examples.torchtitan.train [--fault NODE:STEP:PHASE] [--min-step-time-s X] [--steps N] \\
        --module examples.torchtitan.config --config llama3_tiny --dataloader.dataset-path DIR [torchtitan flags]
    torchrun --nproc-per-node 4 -m examples.torchtitan.train --plain --run-dir RUN ... (the same torchtitan flags)

Under the runtime it is ``worker.integrations.torchtitan.main``; with ``--plain`` (or ``TM_PLAIN=1``) it is
torchtitan's ``torchtitan.train.main`` (``config.build()``, its own ``Trainer.train`` loop, its own gloo default
group from torchrun's environment), with the same CPU shims. Either way each active rank ends by writing
``<run_dir>/final/rank<r>.json`` (examples.train_gpt.write_final) with the sha256 of its local shards of model part 0
and of the (first) torch optimizer of torchtitan's ``OptimizersContainer`` (examples.state_hash).

torchtitan's ``--dump-folder`` (its checkpoints, traces and metrics) defaults to ``<run_dir>/titan``.

``--fault NODE:STEP:PHASE`` (runtime only, repeatable): at torchtitan step STEP + 1 (the runtime's step STEP), the
processes of node NODE kill -9 their node during PHASE: ``forward`` (after the model's forward), ``optimizer`` (as
the update starts) or ``between`` (after the step). ``--min-step-time-s`` pads each step (numerics unchanged) so
that a migration has time to happen on a fast host.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from examples import pacing  # noqa: E402
from examples.state_hash import final_state_hash  # noqa: E402
from examples.train_gpt import FaultPhase, kill_node, parse_faults, write_final  # noqa: E402
from worker.integrations import torchtitan_cpu  # noqa: E402


# the dataset is a local folder (examples.torchtitan.make_data): never ask the Hugging Face hub
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    """This driver's flags, and the rest (torchtitan's)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plain", action="store_true", default=os.environ.get("TM_PLAIN") == "1",
                   help="no runtime: torchtitan's own main under torchrun")
    p.add_argument("--run-dir", default=os.environ.get("TM_RUN_DIR", ""), help="where final/ goes")
    p.add_argument("--fault", action="append", default=[], metavar="NODE:STEP:PHASE",
                   help="kill -9 NODE's processes at STEP during PHASE (forward, optimizer or between)")
    pacing.add_arguments(p)
    p.add_argument("--steps", type=int, default=None, help="the same as torchtitan's --training.steps")
    args, rest = p.parse_known_args(argv)
    if args.steps is not None:
        rest += ["--training.steps", str(args.steps)]
    args.fault = parse_faults(p, args.fault)
    if FaultPhase.BACKWARD in args.fault.values():
        p.error("--fault: the backward phase is not supported here (forward, optimizer or between)")
    if not args.run_dir:
        p.error("--run-dir (or TM_RUN_DIR) is needed")
    if not any(a == "--dump-folder" or a.startswith("--dump-folder=") for a in rest):
        rest += ["--dump-folder", os.path.join(args.run_dir, "titan")]  # torchtitan's outputs: not the cwd
    return args, rest


def state_digest(trainer: Any) -> str:
    """sha256 of this rank's local shards of model part 0 (its parameters and buffers as held: no collective) and
    of the first torch optimizer."""
    from worker.integrations.torchtitan import RawState

    optimizers = getattr(trainer.optimizers, "optimizers", [trainer.optimizers])
    return final_state_hash(RawState(trainer.model_parts[0]), optimizers[0])


def write_digest(trainer: Any, run_dir: str) -> str:
    import torch.distributed as dist

    digest = state_digest(trainer)
    write_final(run_dir, dist.get_rank(), trainer.step, digest, None)
    return digest


def plain(args: argparse.Namespace, rest: list[str]) -> None:
    """torchtitan's ``torchtitan.train.main``, without the seed-checkpoint and local-tensor branches, plus the hash."""
    import torch.distributed as dist
    from torchtitan.config import ConfigManager
    from torchtitan.tools.logging import init_logger

    init_logger()
    config = ConfigManager().parse_args(rest)
    trainer = config.build()
    try:
        trainer.train()
        write_digest(trainer, args.run_dir)
    finally:
        trainer.close()
    if dist.is_initialized():
        dist.destroy_process_group()


def mover(args: argparse.Namespace, rest: list[str]) -> None:
    from worker.integrations import torchtitan as integration

    pacer = pacing.Pacer.from_args(args)

    def with_faults(cls: type) -> type:
        """The integration's trainer class, plus --fault and --min-step-time-s (examples.pacing)."""
        class Faulty(cls):  # type: ignore[valid-type, misc]
            def manage_state(self, start_step: int) -> Any:
                out = super().manage_state(start_step)
                node = os.environ.get("TM_NODE")

                def fault(phase: FaultPhase) -> None:
                    if args.fault.get((node, self.step - 1)) == phase and not self.session.is_shadow:
                        kill_node()

                phases = set(args.fault.values())  # hooks only where a fault is due (a step hook changes the path)
                if FaultPhase.FORWARD in phases:
                    for model in self.model_parts:
                        model.register_forward_hook(lambda *_: fault(FaultPhase.FORWARD))
                if FaultPhase.OPTIMIZER in phases:
                    for opt in getattr(self.optimizers, "optimizers", [self.optimizers]):
                        opt.register_step_pre_hook(lambda *_: fault(FaultPhase.OPTIMIZER))
                self._fault = fault
                return out

            def train_step(self, data_iterator: Any) -> None:
                t0 = time.perf_counter()
                super().train_step(data_iterator)
                pacer.pad(t0, self.session.is_shadow)
                self._fault(FaultPhase.BETWEEN)

        return cls if not args.fault and not args.min_step_time_s else Faulty

    integration.main(rest, on_finish=lambda trainer: write_digest(trainer, args.run_dir), extend=with_faults)


def main(argv: list[str] | None = None) -> None:
    args, rest = parse_args(argv)
    torchtitan_cpu.apply()
    (plain if args.plain else mover)(args, rest)


if __name__ == "__main__":
    main()

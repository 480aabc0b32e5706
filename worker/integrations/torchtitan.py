"""torchtitan's own ``Trainer`` under the TrainMover runtime (``tmd local`` / ``tmd slurm``), unedited.

The command is torchtitan's, with the module name changed (no line of code)::

    tmd local --nodes 2 --ranks-per-node 2 --standbys 1 -- \\
        python -m worker.integrations.torchtitan --module torchtitan.models.llama3 --config llama3_debugmodel ...

(instead of ``torchrun ... -m torchtitan.train --module ... --config ...``). An entry point of one's own replaces
``config.build()`` by ``mover_trainer(config)`` (one import, one line); ``trainer.train()`` then runs under the
runtime. Tested with torchtitan 0.3.0 and torch 2.13.0 (``pip install -e .[torchtitan]``).

What the integration does, on a subclass of the config's own trainer class (``Trainer``, or a subclass of it):

* ``init_distributed``: ``worker.init()`` (a standby blocks there until it is given a rank), so the default process
  group is the mover's world; torchtitan's ``dist_utils.init_distributed`` would return early on it anyway.
  The ``ParallelDims`` are torchtitan's, from ``--parallelism.*``; every mesh is built from mover groups.
* ``train``: torchtitan's loop with the runtime's step boundary: ``checkpointer.load`` (not on a joiner, nor
  where the runtime resumes from its own checkpoint: :func:`loads_torchtitan_checkpoint`), then
  ``session.run`` over the steps, each one ``train_step`` (torchtitan's, unchanged) and ``checkpointer.save``. A
  joiner's shadow iterations save nothing. After a failure the interrupted step is redone from the same data.
* the state that moves with a rank is what torchtitan's ``CheckpointManager`` lists in its ``states``: the model
  parts (their parameters and buffers as held, :class:`RawState`: without the state_dict hooks), each optimizer
  of the ``OptimizersContainer`` and the ``LRSchedulersContainer`` (replicated state); the dataloader's position
  and ``train_state`` (``ntokens_seen``, the first step) as rank-local state. The dataloader's position is its
  ``StatefulDataLoader`` state as JSON text (torchtitan's own ``state_dict`` pickles it, and nothing received
  from a peer is unpickled here); after it is loaded the data iterator is made anew, so the next batch is the one
  that state points to.
* on a host without an accelerator, the CPU shims of :mod:`worker.integrations.torchtitan_cpu` (gloo-compatible
  FSDP reductions, dense flex attention...), installed before torchtitan is imported.

Sources: torchtitan 0.3.0 ``torchtitan/trainer.py`` (``Trainer.init_distributed``, ``train``, ``train_step``),
``torchtitan/train.py`` (``main``), ``torchtitan/experiments/torchft/trainer.py`` (the same override of
``init_distributed``).
"""
from __future__ import annotations

import json
import os
import sys
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from worker.integrations import torchtitan_cpu

__all__ = ["mover_trainer", "mover_trainer_class", "main", "RawState", "loads_torchtitan_checkpoint"]

#: the flags torchtitan's ConfigManager needs (the config registry's module and function); every other flag is
#: torchtitan's own (tyro, from the config's fields)
REQUIRED_FLAGS = ("--module", "--config")


class RawState(torch.nn.Module):
    """A model part's state as the runtime manages it: every parameter and persistent buffer by name (``model.``
    and the name in the model, as ``named_parameters()`` gives it), as the module holds it (FSDP2 / TP: this rank's
    DTensor shard), bypassing the modules' state_dict hooks.

    torchtitan's own ``state_dict`` runs hooks that issue collectives (``FusedQKVLinear`` gathers ``wqkv`` to
    Replicate and splits it into ``wq``/``wk``/``wv``, for checkpoint interoperability); the runtime reads a
    managed state on one rank alone (a leaver sending, a snapshot), so it must read without collectives, and
    write into the parameters themselves. ``parameters()``/``named_buffers()`` are the model's (it is this
    module's only child, ``model``)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def _tensors(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for prefix, module in self.model.named_modules(prefix="model"):  # the names named_parameters() gives
            dot = prefix + "."
            for name, param in module._parameters.items():
                if param is not None:
                    out.setdefault(dot + name, param)
            for name, buf in module._buffers.items():
                if buf is not None and name not in module._non_persistent_buffers_set:
                    out.setdefault(dot + name, buf)
        return out

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:  # type: ignore[override]
        """{name: the parameter or buffer itself} (not detached copies: the runtime copies what it keeps)."""
        return {k: v.detach() for k, v in self._tensors().items()}

    def load_state_dict(self, state_dict: Any, strict: bool = True,  # type: ignore[override]
                        assign: bool = False) -> Any:
        """Copy ``state_dict``'s tensors into the parameters and buffers of the same names (no collective: a
        DTensor into a DTensor of the same layout). The arguments are ``nn.Module``'s (``set_model_state_dict``,
        which the runtime's checkpoints load with, passes them by name). Raises KeyError for an unknown name, and
        with ``strict`` for a missing one; nothing is copied then."""
        own = self._tensors()
        unknown, missing = set(state_dict) - set(own), (set(own) - set(state_dict)) if strict else set()
        if unknown or missing:
            raise KeyError(f"model state: unknown keys {sorted(unknown)[:5]}, missing keys {sorted(missing)[:5]}")
        with torch.no_grad():
            for k, v in state_dict.items():
                own[k].copy_(v)
        return torch.nn.modules.module._IncompatibleKeys([], [])


class DataPosition:
    """The dataloader's position as rank-local managed state: ``state_dict()`` is ``{"json": text}``, the
    ``StatefulDataLoader`` state (plain data: dicts, lists, ints, strings) as JSON text. One string, not the nested
    lists themselves: their lengths (the token buffers) change from step to step, and a planned migration's tail
    needs a state whose structure stays put (worker.precopy). JSON, not torchtitan's own pickled ``state_dict``:
    nothing received from a peer is unpickled. ``load_state_dict`` rewinds the loader to it and drops the data
    iterator, which :meth:`iterator` then makes anew from the loaded position. Raises ValueError on a state that is
    not such JSON."""

    def __init__(self, trainer: Any) -> None:
        self._trainer = trainer
        self._iterator: Optional[Any] = None

    def state_dict(self) -> dict[str, str]:
        from torchdata.stateful_dataloader import StatefulDataLoader

        return {"json": json.dumps(StatefulDataLoader.state_dict(self._trainer.dataloader))}

    def load_state_dict(self, state: dict[str, str]) -> None:
        from torchdata.stateful_dataloader import StatefulDataLoader

        if not isinstance(state, dict) or not isinstance(state.get("json"), str):
            raise ValueError("dataloader position: expected {'json': text}")
        StatefulDataLoader.load_state_dict(self._trainer.dataloader, json.loads(state["json"]))
        self._iterator = None

    def iterator(self) -> Any:
        """The trainer's batch generator over the dataloader, from its current (or just loaded) position."""
        if self._iterator is None:
            self._iterator = self._trainer.batch_generator(self._trainer.dataloader)
        return self._iterator


class TrainState:
    """torchtitan's ``train_state`` as rank-local managed state: ``ntokens_seen`` and the step the job started
    from (a loaded checkpoint's, else 0), which a joiner takes from its leaver with the rest."""

    def __init__(self, trainer: Any, start_step: int) -> None:
        self._trainer = trainer
        self.start_step = start_step

    def state_dict(self) -> dict[str, int]:
        return {"start_step": self.start_step, "ntokens_seen": int(self._trainer.ntokens_seen)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.start_step = int(state["start_step"])
        self._trainer.ntokens_seen = int(state["ntokens_seen"])


def loads_torchtitan_checkpoint(role: Any, env: Optional[dict] = None) -> bool:
    """Whether torchtitan's own ``checkpointer.load`` runs at the start of ``train()`` on this process: not on a
    joiner (a migration's or a failure's: its state comes from its leaver or a replica, and the load's collectives
    are not in the recording its shadow iterations replay), and not where tmd starts the ranks from the runtime's
    own checkpoint (``TM_RESUME_FROM`` in ``env``, default ``os.environ``: ``--resume-from``, or tmd's restart
    after a failure in-memory recovery could not repair); that checkpoint is the state the job continues from,
    and the two would otherwise load one over the other."""
    from tmd.protocol import WorkerRole
    from worker.checkpointing import Settings

    return role != WorkerRole.JOINER and Settings.from_env(env).resume_from is None


def _inner_optimizers(optimizers: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizers an ``OptimizersContainer`` steps (its ``optimizers`` list), else ``[optimizers]``."""
    inner = getattr(optimizers, "optimizers", None)
    return list(inner) if inner is not None else [optimizers]


def mover_trainer_class(base: type) -> type:
    """A subclass of torchtitan's ``base`` trainer class (``torchtitan.trainer.Trainer`` or a subclass) whose
    process group, step loop and state are the runtime's (see the module's docstring)."""

    class MoverTrainer(base):  # type: ignore[valid-type, misc]
        session: Any

        def init_distributed(self) -> Any:
            import worker
            from torchtitan.distributed import ParallelDims

            self.session = worker.init()  # standbys block here until they are given a rank
            # what torchtitan's init_distributed does besides creating the group (spmd_types' mesh stack, AC)
            torch.autograd.set_multithreading_enabled(False)
            return ParallelDims.from_config(self.config.parallelism, dist.get_world_size())

        def manage_state(self, start_step: int) -> tuple[DataPosition, TrainState]:
            """Hand the runtime what torchtitan's checkpointer lists in its ``states``."""
            session = self.session
            parts = self.model_parts
            session.manage(**{("model" if len(parts) == 1 else f"model{i}"): RawState(m)
                              for i, m in enumerate(parts)})
            inner = _inner_optimizers(self.optimizers)
            session.manage(**{("optimizer" if len(inner) == 1 else f"optimizer{i}"): o for i, o in enumerate(inner)})
            session.manage(lr_schedulers=self.lr_schedulers)
            data, state = DataPosition(self), TrainState(self, start_step)
            session.manage(rank_local=True, dataloader=data, train_state=state)
            return data, state

        def train(self) -> None:
            config, session = self.config, self.session
            if loads_torchtitan_checkpoint(session.role):
                self.checkpointer.load(step=config.checkpoint.load_step)
            data, state = self.manage_state(self.step)
            total = config.training.steps

            def step_fn(step: int) -> None:
                self.step = state.start_step + step + 1
                self.gc_handler.run(self.step)
                self.train_step(data.iterator())
                if not session.is_shadow:
                    self.checkpointer.save(self.step, last_step=self.step == total)

            session.run(step_fn, total - state.start_step)

    MoverTrainer.__name__ = MoverTrainer.__qualname__ = f"Mover{base.__name__}"
    return MoverTrainer


def mover_trainer(config: Any, extend: Optional[Callable[[type], type]] = None) -> Any:
    """``config.build()`` under the runtime: the trainer of ``config``'s own class (``config._owner``), made a
    :func:`mover_trainer_class` (then passed through ``extend``, which may subclass it further). Sets
    ``LOCAL_RANK`` from ``TM_LOCAL_RANK`` when unset (torchtitan picks its device before the process group exists).
    Raises TypeError when the config's owner is not a trainer class."""
    owner = getattr(type(config), "_owner", None)
    if not isinstance(owner, type) or not hasattr(owner, "init_distributed"):
        raise TypeError(f"{type(config).__name__} does not build a torchtitan Trainer (owner {owner!r})")
    os.environ.setdefault("LOCAL_RANK", os.environ.get("TM_LOCAL_RANK", "0"))
    cls = mover_trainer_class(owner)
    return (extend(cls) if extend is not None else cls)(config=config)


def main(argv: Optional[list[str]] = None, on_finish: Optional[Callable[[Any], Optional[str]]] = None,
         extend: Optional[Callable[[type], type]] = None) -> None:
    """torchtitan's ``torchtitan.train.main`` under the runtime: parse ``argv`` (torchtitan's flags, default
    ``sys.argv[1:]``) with torchtitan's ``ConfigManager``, build the trainer with :func:`mover_trainer`, train,
    close. ``extend`` as for :func:`mover_trainer`. Exits (SystemExit, a one-line message) when ``--module`` or
    ``--config`` is missing, before anything starts. ``on_finish(trainer)``, on active ranks after the last step,
    may return a note (a final state hash) for ``session.finish``."""
    argv = sys.argv[1:] if argv is None else argv
    if missing := [f for f in REQUIRED_FLAGS if not any(a == f or a.startswith(f + "=") for a in argv)]:
        raise SystemExit(f"worker.integrations.torchtitan: missing {' and '.join(missing)} (torchtitan's config "
                         "registry, e.g. --module torchtitan.models.llama3 --config llama3_debugmodel)")
    torchtitan_cpu.apply()
    from torchtitan.config import ConfigManager
    from torchtitan.tools.logging import init_logger

    init_logger()
    config = ConfigManager().parse_args(argv)
    trainer = mover_trainer(config, extend)
    try:
        trainer.train()
        note = on_finish(trainer) if on_finish is not None and not trainer.session.is_shadow else None
    finally:
        trainer.close()
    trainer.session.finish(note)


if __name__ == "__main__":
    main()

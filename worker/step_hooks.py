"""The one ordered pipeline of a managed optimizer's step hooks: which part of the runtime acts when, around every
managed optimizer's ``step()``, stated here only.

Before the update (torch's step pre-hooks)::

    1. exchange   the per-step exchange, by the first managed optimizer of a step that is not void already
                  (worker.step_exchange: fingerprints, rank states, snapshot agreement; two collectives; a step
                  in which no managed optimizer steps runs it at its end instead: worker.session _close_step)
    2. refuse     StepAborted when the step is void (a latched collective, the exchange's own included, or tmd's
                  halt: worker.step_ledger): nothing below runs and nothing is updated
       ...        the script's own pre-hooks
    3. pre-copy   a leaver's gradients queued for its joiner's replay (worker.precopy; only while a pre-copy runs)

After the update (torch's step post-hooks)::

    1. pre-copy   wait until those gradients are packed, note the version counters the update left
    2. commit     the ledger notes the update; once every managed optimizer stepped, the step is committed
    3. keep       the exchange keeps its copy of every rank's state as that of the committed step
       ...        the script's own post-hooks

Why this order. The refusal comes before the pre-copy, so a void update never reaches the joiner's replay (a
replayed step the leaver did not apply would make the joiner diverge), and after the exchange, whose collectives
may latch the failure themselves. The pre-copy's pre-hook runs after every other pre-hook (it sends what they
changed, and the arguments they passed on) and its post-hook before every other post-hook (what they change later
shows in the version counters: see worker.precopy); the pre-copy's own post-hook comes before the commit mark,
which it does not touch. 1-2 before the update and 1-3 after it are placed first among the optimizer's hooks
(``move_to_end(last=False)``), so the script's hooks run after them whenever the script registered its own: a
refused update runs none of the script's pre-hooks after the refusal, and an applied update is marked committed
before a script's post-hook can raise.

One :class:`StepHooks` per process, owned by worker.session; a standalone worker.precopy.Precopy (tests) makes
its own.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import torch

Before = Callable[[torch.optim.Optimizer, tuple, dict], None]  # a pre-copy's hooks: torch's hook signature
After = Before


class StepHooks:
    """The pipeline (see the module docstring). ``exchange()``, ``refuse()``, ``commit(optimizer)``, ``keep()``:
    the stages of the step exchange and the step ledger (None: that stage does nothing). Training thread only."""

    def __init__(self, exchange: Optional[Callable[[], None]] = None, refuse: Optional[Callable[[], None]] = None,
                 commit: Optional[Callable[[torch.optim.Optimizer], None]] = None,
                 keep: Optional[Callable[[], None]] = None) -> None:
        self.exchange, self.refuse, self.commit, self.keep = exchange, refuse, commit, keep
        self._first: dict[int, tuple[Any, Any]] = {}  # id(optimizer) -> handles of its first pre- and post-hook
        self._precopy: dict[int, tuple[Before, After, Any]] = {}  # id(optimizer) -> (before, after, last pre-hook)
        self._disarmed = False

    @contextlib.contextmanager
    def disarmed(self) -> Iterator[None]:
        """Within: no stage runs around a managed optimizer's ``step()`` (a step that is not a training step:
        DCP's ``get_optimizer_state_dict`` creating a fresh optimizer's state with lr 0, worker.checkpointing)."""
        self._disarmed = True
        try:
            yield
        finally:
            self._disarmed = False

    def add(self, opt: torch.optim.Optimizer) -> None:
        """Hook ``opt``: its first pre-hook and first post-hook (once per optimizer)."""
        if id(opt) in self._first:
            return
        pre, post = opt.register_step_pre_hook(self._before), opt.register_step_post_hook(self._after)
        opt._optimizer_step_pre_hooks.move_to_end(pre.id, last=False)
        opt._optimizer_step_post_hooks.move_to_end(post.id, last=False)
        self._first[id(opt)] = (pre, post)

    def attach_precopy(self, opt: torch.optim.Optimizer, before: Before, after: After) -> None:
        """A leaver's pre-copy starts: run ``before`` as ``opt``'s last pre-hook and ``after`` first after the
        update, until :meth:`detach_precopy`."""
        self.add(opt)
        self.detach_precopy(opt)
        self._precopy[id(opt)] = (before, after, opt.register_step_pre_hook(self._last_before))

    def detach_precopy(self, opt: torch.optim.Optimizer) -> None:
        """The pre-copy ended (the switch step, or an abort): its stages leave ``opt``'s hooks."""
        attached = self._precopy.pop(id(opt), None)
        if attached is not None:
            attached[2].remove()

    def precopy_in_place(self, opt: torch.optim.Optimizer) -> bool:
        """Whether the pre-copy's stages still run last before and first after ``opt``'s update (False once the
        script registered a step pre-hook after the pre-copy was attached)."""
        attached, first = self._precopy.get(id(opt)), self._first.get(id(opt))
        return attached is not None and first is not None \
            and next(reversed(opt._optimizer_step_pre_hooks)) == attached[2].id \
            and next(iter(opt._optimizer_step_post_hooks)) == first[1].id

    def _before(self, opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if self._disarmed:
            return
        if self.exchange is not None:
            self.exchange()
        if self.refuse is not None:
            self.refuse()

    def _last_before(self, opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        attached = self._precopy.get(id(opt))
        if attached is not None:
            attached[0](opt, args, kwargs)

    def _after(self, opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if self._disarmed:
            return
        attached = self._precopy.get(id(opt))
        if attached is not None:
            attached[1](opt, args, kwargs)
        if self.commit is not None:
            self.commit(opt)
        if self.keep is not None:
            self.keep()

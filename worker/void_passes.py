"""The void-pass stopper: a survivor's DDP forward and backward passes stop once their step is void.

Once the failure is known (tmd's Halt, a latched collective), the rest of the step's compute is void: its update
will be refused (worker.step_ledger). So the next module of a managed DDP model to run (a forward pre-hook), or the
next of its parameters to get its gradient (a gradient hook), raises StepAborted instead of computing the rest
(off with ``TM_STOP_VOID_PASSES=0``). A backward pass stopped half-way leaves DDP's reducer expecting the rest of
it, so every party of the recovery resets its reducer (:meth:`VoidPassStopper.reset_reducers`, as torch's own
``DistributedDataParallel._update_process_group`` does), which regroups its gradient buckets once more after the
redone step, in the same assignment (a collective of all, like a job's first step). The same gradient hooks run
what worker.groups arms for the next backward pass (:meth:`VoidPassStopper.at_next_backward`).
"""
from __future__ import annotations

import os
import sys
from typing import Any, Callable, Optional

import torch

from tmd import protocol as p
from worker.control import Control, Stage
from worker.step_ledger import StepAborted, failure

STOP_VOID_PASSES_ENV = "TM_STOP_VOID_PASSES"  # "0": a survivor's forward and backward passes run to their end
STOP_VOID_PASSES_OLD_ENV = "TM_ABORT_IN_FORWARD"  # its earlier name (forward passes only then), still read


def _stopping_void_passes() -> bool:
    """Whether a DDP model's forward and backward passes stop once their step is void (env
    ``TM_STOP_VOID_PASSES``, default on; "0" turns it off)."""
    return os.environ.get(STOP_VOID_PASSES_ENV, os.environ.get(STOP_VOID_PASSES_OLD_ENV)) != "0"


def _stoppable(obj: Any) -> bool:
    """Whether ``obj`` is a DDP model whose forward pass may stop half-way (StepAborted from a module's forward
    pre-hook): DDP keeps no per-iteration state across an exception raised before its backward. Not when it holds
    FSDP2 modules or DTensor parameters (their hooks would leave parameters unsharded), not with
    ``static_graph=True``, nor once ``torch.distributed.pipelining`` is in use (a schedule's step keeps
    per-microbatch state)."""
    if not isinstance(obj, torch.nn.parallel.DistributedDataParallel) or "torch.distributed.pipelining" in sys.modules \
            or getattr(obj, "static_graph", False):  # a static graph's reducer counts iterations: not tried
        return False
    if any(type(t) not in (torch.Tensor, torch.nn.Parameter) for t in obj.parameters()):
        return False
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # an older torch without FSDP2
        return True
    return not any(isinstance(m, FSDPModule) for m in obj.modules())


def _backward_stoppable(obj: Any) -> bool:
    """Whether ``obj`` is a :func:`_stoppable` DDP model whose backward pass may stop half-way too (StepAborted
    from a parameter's gradient hook): only with torch's C++ reducer, whose ``_reset_state()`` lets the next
    forward run although that backward never finished (no Python reducer, no delayed all-reduce, no Join)."""
    return _stoppable(obj) and hasattr(getattr(obj, "reducer", None), "_reset_state") \
        and not getattr(obj, "_use_python_reducer", False) and not getattr(obj, "_delay_all_reduce_all_params", False) \
        and not obj._join_config.enable


class VoidPassStopper:
    """The forward and gradient hooks of the managed DDP models, and their reducers' reset (see the module
    docstring). ``in_step``: between the ledger's begin and the step's end (worker.session): only then is a pass
    stopped. Hooks run on the training thread (forward; backward on CPU) or autograd's device thread (backward
    on CUDA)."""

    def __init__(self, control: Control) -> None:
        self.control = control
        self.in_step = False  # between begin and the step's end (Session.steps): a pass may be stopped
        self._hooked: set[int] = set()  # ids of the modules (parameters) that have the forward (gradient) hook
        self._resettable: list[Any] = []  # the managed DDP models whose backward pass may stop: reset_reducers
        self._stoppable: list[Any] = []  # the managed DDP models whose forward pass may stop: reset_reducers too
        self._at_backward: Optional[Callable[[], None]] = None  # see at_next_backward

    def hook(self, objects: dict[str, Any]) -> None:
        """Give every module of each managed DDP model in ``objects`` the forward pre-hook, and every trained
        parameter the gradient hook where its backward pass may stop too (once each)."""
        for obj in objects.values():
            if not (_stoppable(obj) and _stopping_void_passes()):
                continue
            if not any(obj is m for m in self._stoppable):
                self._stoppable.append(obj)
            for module in obj.module.modules():
                if id(module) not in self._hooked:
                    self._hooked.add(id(module))
                    module.register_forward_pre_hook(self.abort_forward)
            if _backward_stoppable(obj):
                if not any(obj is m for m in self._resettable):
                    self._resettable.append(obj)
                for param in obj.module.parameters():
                    if param.requires_grad and id(param) not in self._hooked:
                        self._hooked.add(id(param))
                        param.register_hook(self.abort_backward)

    def abort_forward(self, module: torch.nn.Module, args: Any) -> None:
        """A managed DDP model's module is about to run: raise StepAborted if this step is void already (a
        halt, a latched collective), so that the survivor halts without computing the rest of the step."""
        self._abort_if_void("forward")

    def abort_backward(self, grad: torch.Tensor) -> None:
        """A gradient of a managed DDP model's parameter was computed: raise StepAborted (out of
        ``backward()``) if this step is void already. The reducer is left half-way through the backward pass;
        every party resets it (:meth:`reset_reducers`). Otherwise run what :meth:`at_next_backward` armed."""
        self._abort_if_void("backward")
        if self._at_backward is not None:
            fn, self._at_backward = self._at_backward, None
            fn()

    def at_next_backward(self, fn: Callable[[], None]) -> bool:
        """Arm ``fn`` to run once, when the first gradient of a managed DDP model's parameter is computed in a
        step that is not void (on the thread that runs the gradient hooks: the training thread on CPU, autograd's
        device thread on CUDA). Returns False, arming nothing, where no managed model has these gradient hooks
        (see :meth:`hook`: not FSDP2, DTensor or pipelined models, nor with ``TM_STOP_VOID_PASSES=0``). A later
        call replaces what was armed; ``fn`` must tolerate running after its moment passed."""
        if not self._resettable:
            return False
        self._at_backward = fn
        return True

    def _abort_if_void(self, where: str) -> None:
        if self.in_step and self.control.stage == Stage.TRAINING and self.control.role == p.WorkerRole.ACTIVE:
            why = failure(self.control)
            if why:
                message = f"rank {self.control.rank} step {self.control.step}: {where} pass stopped, {why}"
                print(f"[worker] {message}", flush=True)
                raise StepAborted(message)

    def reset_reducers(self) -> None:
        """Every party of a recovery, as it swaps the new groups in: reset the reducer of every managed DDP model
        whose backward pass may stop half-way (those :meth:`hook` hooked; torch's ``Reducer._reset_state``: the
        next forward may run although a backward did not finish). The reset also makes DDP regroup its gradient
        buckets once more after the redone step, as after a job's first step: the same assignment (the gradients'
        order is the model's), broadcast from rank 0 in the next step's forward. So every party resets, whether its
        own step stopped in the forward, the backward or the optimizer, and that broadcast is a collective of all.

        Every managed DDP model whose forward pass may stop also gets ``require_forward_param_sync`` back to True,
        a fresh DDP model's value and a synced forward's: DDP broadcasts its buffers at a forward's start when the
        *previous* forward synced, and a forward stopped half-way never set that flag. A survivor stopped in the
        synced micro-batch's forward after a ``no_sync()`` one kept False, a replacement had True, and the redone
        step's first forward broadcast on one side only: every rank hung there until gloo's timeout, and again
        after (tests/e2e/test_varied_script.py, once in two runs)."""
        for ddp in self._resettable:
            ddp.reducer._reset_state()
            ddp._has_rebuilt_buckets = False
        for ddp in self._stoppable:
            ddp.require_forward_param_sync = True

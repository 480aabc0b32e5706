"""The step ledger: what a step attempt began from, what it committed, and putting back what a void attempt changed.

A step commits when every managed optimizer applied its update, or, at the step's end (worker.session
``_close_step``), when the step made no update or not every managed optimizer's (a GradScaler's overflow skip, a
skipped batch, no managed optimizer at all) and its per-step exchange completed with no failure known
(:meth:`StepLedger.commit_without_update`). A step whose update is refused (:class:`StepAborted`: a collective of
the step failed, or tmd halted the job for a failure) committed nothing, but its forward and backward passes ran,
and they change state too. So as every attempt begins (:meth:`StepLedger.begin`) the ledger notes what a survivor
that does not commit the attempt must put back before it sends its state to anyone or redoes the step:

- *Buffers.* A forward pass updates running statistics (SyncBatchNorm's, identical on every replica; BatchNorm's,
  each rank its own), counters, running averages. Redone, the step would count its batch twice. Every buffer of
  the managed modules (a DTensor's local shard: worker.dtensor) is copied as every step begins, into the same copy
  each time (an asynchronous device copy on a GPU), and :meth:`StepLedger.restore_buffers` puts them back.
  Copying only the buffers that change would first need to find them: version counters miss BatchNorm's running
  statistics (its kernel bumps none), and comparing values costs more than the copy (``torch.equal`` of a 4 MB
  causal mask: 0.7 ms against 0.1 ms for ``copy_`` on one core here) and, on a GPU, synchronises with the device
  for every buffer at every step. Memory: one copy of every buffer, a constant mask or rotary table included.
  Buffers are looked up by name each time, so one that the forward pass replaces (``self.avg = 0.9 * self.avg +
  ...``) is covered too.
- *Gradients.* The backward pass accumulated this rank's own, never averaged, gradients into ``.grad``. A script
  that zeroes them *after* ``optimizer.step()`` (not before the backward) would add those to the redone step's. So
  the ledger notes which trained parameters (those of the managed optimizers and modules) have no ``.grad``, and
  :meth:`StepLedger.restore_gradients` puts every one back: ``None`` where there was none, else zeroed in place
  (``zero_grad(set_to_none=False)``'s state). Gradients are not part of a rank's transferred state: a script must
  not carry them from one step to the next.
- *Rank-local objects.* Drawing a batch may move a data loader's own position (a count of batches served, an
  iterator's index), and a survivor drew the interrupted step's batches. The ledger keeps a copy of every
  ``rank_local`` object's state_dict (``copy.deepcopy``: plain data, a few KB; 2 us for the demo's stream), and
  :meth:`StepLedger.restore_objects` loads it back, so the redone step draws from where the attempt began. (A
  replacement gets the lost rank's from a replica's exchanged copy: worker.step_exchange.)
- *Other replicated objects.* A replicated managed object that is neither a module, an optimizer nor a GradScaler
  (an LR scheduler, a count of samples seen) may change before ``optimizer.step()``: a script that counts its
  samples as it draws them would count the interrupted step's twice once the step is redone. The ledger keeps a
  copy of each one's state_dict too (``copy.deepcopy``, as for rank-local objects; keep large tensors in modules)
  and :meth:`StepLedger.restore_objects` loads it back with the rank-local ones.
- *A GradScaler's bookkeeping.* ``scaler.unscale_(opt)`` marks the optimizer as unscaled until ``scaler.update()``,
  which the refused ``scaler.step(opt)`` never reached; a managed ``torch.amp.GradScaler`` forgets that mark
  (:meth:`StepLedger.restore_grad_scalers`). In a step that makes no update (an overflow: ``scaler.step`` skips
  ``optimizer.step()``, so nothing is refused) ``update()`` does run, and backs the scale off, before a failure
  can be noticed at the step's end (its exchange: worker.session ``_close_step``); so each managed GradScaler's
  scale and growth tracker (two one-element tensors) are copied as every attempt begins, into the same copies each
  time (an asynchronous device copy on a GPU: nothing is read), and :meth:`StepLedger.restore_grad_scaler_scales`
  puts them back, so the redone step backs off once.
- *The RNG* as the attempt began (:attr:`StepLedger.rng_snapshot`): the redone step draws the same numbers.
- *An optimizer step given a closure* (``torch.optim.LBFGS``): its forward and backward passes and their
  collectives run inside ``step()``, after the step hooks' refusal, and move the parameters and the optimizer's
  state before a failure among them can stop the step. A managed optimizer's step that gets a closure therefore
  copies its parameters (local shards) and a deep copy of its state_dict first (:meth:`StepLedger.before_closure_step`,
  a pre-hook after worker.step_hooks' pipeline), its ``commit`` is refused (StepAborted) when a failure latched
  during the step, and :meth:`StepLedger.restore_closure_steps` puts both back. Memory: one more copy of those
  parameters and that state while such a step runs. Without it, a survivor that did not commit sent or kept
  parameters its aborted closure had moved (outside review s17: ``state_mismatch`` after the recovery).

The ledger is the training thread's own; its ``refuse`` and ``commit`` are stages of worker.step_hooks.
"""
from __future__ import annotations

import copy
from typing import Any, Optional

import torch

from tmd import protocol as p
from worker.control import Control
from worker.dtensor import local_shard


class StepAborted(RuntimeError):
    """Raised by a managed optimizer's ``step()`` when a collective of this step failed or tmd halted the job
    for a failure: the update is refused (nothing is modified) and :meth:`Session.run` redoes the step after
    recovery, with the same data, so the trajectory stays bit-identical. Also raised out of a managed DDP model's
    forward pass (by the next module to run) or out of ``loss.backward()`` (by the next parameter to get its
    gradient) once the failure is known (worker.void_passes): then the rest of the step is not computed."""


def failure(control: Control) -> Optional[str]:
    """Why the current step cannot commit (tmd's halt, or a collective failure latched by this rank's movers while
    it is active), or None."""
    halted = control.halt_reason()
    if halted is not None:
        return halted
    groups = control.groups
    return groups.failure() if groups is not None and control.role == p.WorkerRole.ACTIVE else None


def copied_object(obj: Any) -> bool:
    """Whether the ledger copies replicated object ``obj``'s state_dict as each attempt begins: not a module (its
    parameters change only in the update, its buffers are copied as buffers), not an optimizer (it changes only in
    its refused step), not a GradScaler (its scale changes only in ``update()``, and reading it syncs a GPU)."""
    return not isinstance(obj, (torch.nn.Module, torch.optim.Optimizer, torch.amp.GradScaler))


def params_of(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The parameters ``optimizer`` updates, group by group, in its order."""
    return [q for group in optimizer.param_groups for q in group["params"]]


def _fits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype


class StepLedger:
    """The managed objects, the last committed step and the begin-of-attempt copies (see the module docstring).
    Training thread only."""

    def __init__(self, control: Control) -> None:
        self.control = control
        self.replicated: dict[str, Any] = {}  # state identical on every data-parallel replica
        self.local: dict[str, Any] = {}  # rank-local state (e.g. this rank's data sampler)
        self.optimizers: list[torch.optim.Optimizer] = []
        self.stepped: set[int] = set()  # ids of the managed optimizers that stepped in this attempt
        self.committed_step = -1  # last step this process committed (its updates applied, or none made)
        self.rng_snapshot: Optional[torch.Tensor] = None  # CPU RNG at the start of the current attempt
        self.trained: list[torch.Tensor] = []  # the managed optimizers' and modules' parameters, once each
        self.no_grad_at_begin: list[bool] = []  # per trained parameter: ``.grad`` was None as the attempt began
        # (managed object's name, buffer name) -> that buffer's value as the attempt began (a local copy)
        self.buffer_copies: dict[tuple[str, str], torch.Tensor] = {}
        self.copied_at = -1  # the step whose begin() took ``buffer_copies`` and ``local_copies``
        self.local_copies: dict[str, Any] = {}  # the rank-local objects' state_dicts as the attempt began
        self.object_copies: dict[str, Any] = {}  # the other replicated objects' (copied_object), likewise
        self.closure_at = -1  # the step whose closure_copies were taken
        # (optimizer, its parameters' local shards, a deep copy of its state_dict) as its closure step began
        self.closure_copies: list[tuple[torch.optim.Optimizer, list[torch.Tensor], dict]] = []
        # a managed GradScaler's name -> its (scale, growth tracker) as the attempt began (None: not initialised yet)
        self.scale_copies: dict[str, Optional[tuple[torch.Tensor, torch.Tensor]]] = {}

    def manage(self, objects: dict[str, Any], rank_local: bool) -> list[torch.optim.Optimizer]:
        """Track ``objects``: replicated unless ``rank_local``. Returns the optimizers among them not managed
        before (the caller hooks them: worker.step_hooks)."""
        (self.local if rank_local else self.replicated).update(objects)
        new = []
        for obj in objects.values():
            if isinstance(obj, torch.optim.Optimizer) and obj not in self.optimizers:
                self.optimizers.append(obj)
                new.append(obj)
        self.trained = self._trained_parameters()
        self.buffer_copies = {}
        return new

    def _trained_parameters(self) -> list[torch.Tensor]:
        found: dict[int, torch.Tensor] = {}
        for opt in self.optimizers:
            for group in opt.param_groups:
                for param in group["params"]:
                    found.setdefault(id(param), param)
        for _, obj in self.managed():
            if isinstance(obj, torch.nn.Module):
                for param in obj.parameters():
                    if param.requires_grad:
                        found.setdefault(id(param), param)
        return list(found.values())

    def managed(self) -> list[tuple[str, Any]]:
        """Every managed object by name, replicated and rank-local."""
        return list(self.replicated.items()) + list(self.local.items())

    def _buffers(self) -> dict[tuple[str, str], torch.Tensor]:
        """The managed modules' buffers as they are now, each as its local shard (looked up by name every time:
        a forward pass may replace a buffer, ``self.avg = 0.9 * self.avg + ...``, rather than change it)."""
        found = {}
        for name, obj in self.managed():
            if isinstance(obj, torch.nn.Module):
                for key, buf in obj.named_buffers():
                    found[(name, key)] = local_shard(buf)
        return found

    # --- an attempt ----------------------------------------------------------------------------------------------
    def begin(self, step: int) -> None:
        """An attempt of ``step`` begins: no optimizer stepped yet; note the RNG, which trained parameters have no
        gradient, and copy every buffer and every rank-local object's state_dict."""
        self.stepped.clear()
        self.rng_snapshot = torch.get_rng_state()
        self.no_grad_at_begin = [param.grad is None for param in self.trained]
        copies = {}  # only the buffers there now: a deleted one's copy goes
        with torch.no_grad():
            for k, buf in self._buffers().items():
                saved = self.buffer_copies.get(k)
                if saved is None or not _fits(saved, buf):
                    saved = buf.detach().clone()
                else:
                    saved.copy_(buf)
                copies[k] = saved
        self.buffer_copies = copies
        self.scale_copies = self._copy_scales()
        self.local_copies = {name: copy.deepcopy(obj.state_dict()) for name, obj in self.local.items()}
        self.object_copies = {name: copy.deepcopy(obj.state_dict()) for name, obj in self.replicated.items()
                              if copied_object(obj)}
        self.copied_at = step

    def _scalers(self) -> list[tuple[str, torch.amp.GradScaler]]:
        return [(name, obj) for name, obj in self.managed() if isinstance(obj, torch.amp.GradScaler)]

    def _copy_scales(self) -> dict[str, Optional[tuple[torch.Tensor, torch.Tensor]]]:
        """Each managed GradScaler's scale and growth tracker now, into the copies of the last attempt where they
        fit (None for a scaler whose first ``scale()`` has not run: no tensors yet)."""
        copies: dict[str, Optional[tuple[torch.Tensor, torch.Tensor]]] = {}
        with torch.no_grad():
            for name, scaler in self._scalers():
                now = (getattr(scaler, "_scale", None), getattr(scaler, "_growth_tracker", None))
                if now[0] is None or now[1] is None:
                    copies[name] = None
                    continue
                saved = self.scale_copies.get(name)
                if saved is None or not all(_fits(a, b) for a, b in zip(saved, now)):
                    saved = (now[0].detach().clone(), now[1].detach().clone())
                else:
                    saved[0].copy_(now[0])
                    saved[1].copy_(now[1])
                copies[name] = saved
        return copies

    def refuse(self) -> None:
        """Step hook stage ``refuse``: raise StepAborted when the current step cannot commit."""
        why = failure(self.control)
        if why:
            raise StepAborted(f"rank {self.control.rank} step {self.control.step}: update refused, {why}")

    def before_closure_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        """A managed optimizer's step pre-hook, after worker.step_hooks' pipeline: a step given a closure copies
        the optimizer's parameters and state first (see the module docstring)."""
        # torch passes step()'s own args with the optimizer first: (optimizer, closure?)
        if kwargs.get("closure", args[1] if len(args) > 1 else None) is None:
            return
        step = self.control.step
        if self.closure_at != step:
            self.closure_copies, self.closure_at = [], step
        with torch.no_grad():
            params = [local_shard(q).detach().clone() for q in params_of(optimizer)]
        self.closure_copies.append((optimizer, params, copy.deepcopy(optimizer.state_dict())))

    def restore_closure_steps(self, step: int) -> None:
        """Put back the parameters and state of the optimizers whose closure step ``step`` began (a survivor that
        did not commit it)."""
        if self.closure_at != step:
            return
        with torch.no_grad():
            for optimizer, params, state in self.closure_copies:
                for q, saved in zip(params_of(optimizer), params):
                    local_shard(q).copy_(saved)
                optimizer.load_state_dict(copy.deepcopy(state))
        self.closure_copies, self.closure_at = [], -1

    def commit(self, optimizer: torch.optim.Optimizer) -> None:
        """Step hook stage ``commit``: ``optimizer`` applied its update; once every managed optimizer did, the
        current step is committed. Raises StepAborted instead when the update ran a closure (its collectives
        inside ``step()``) and a failure latched meanwhile: its update is void."""
        if self.closure_at == self.control.step and any(o is optimizer for o, _, _ in self.closure_copies):
            why = failure(self.control)
            if why:
                raise StepAborted(f"rank {self.control.rank} step {self.control.step}: update void (a collective "
                                  f"of its closure failed), {why}")
        self.stepped.add(id(optimizer))
        if len(self.stepped) == len(self.optimizers):
            self.committed_step = self.control.step

    def commit_without_update(self) -> None:
        """The step's end (worker.session ``_close_step``): the current step is committed although not every
        managed optimizer applied an update in it; its exchange ran and no failure is known."""
        self.committed_step = self.control.step

    def committed(self, step: int) -> bool:
        """After a failure noticed in ``step``: did this rank commit that step anyway (every managed optimizer
        stepped, or the step made no update and its exchange completed at its end)?"""
        return self.committed_step == step

    # --- putting back what a void attempt changed ----------------------------------------------------------------
    def restore_objects(self) -> None:
        """Put the rank-local objects and the other replicated objects (:func:`copied_object`) back as the
        interrupted attempt began (a survivor that did not commit it)."""
        for name, state in self.local_copies.items():
            self.local[name].load_state_dict(copy.deepcopy(state))
        for name, state in self.object_copies.items():
            self.replicated[name].load_state_dict(copy.deepcopy(state))

    def restore_buffers(self) -> None:
        """Put the managed modules' buffers back as the interrupted attempt began (a survivor that did not
        commit it; see the module docstring)."""
        now = self._buffers()
        with torch.no_grad():
            for k, saved in self.buffer_copies.items():
                buf = now.get(k)
                if buf is not None and _fits(buf, saved):
                    buf.copy_(saved)

    def restore_grad_scaler_scales(self) -> None:
        """Put each managed GradScaler's scale and growth tracker back as the interrupted attempt began (a survivor
        that did not commit it: an overflow step's ``update()`` ran; see the module docstring). A scaler that had
        none then is made to initialise them again at its next ``scale()``."""
        with torch.no_grad():
            for name, scaler in self._scalers():
                if name not in self.scale_copies:
                    continue
                saved = self.scale_copies[name]
                if saved is None:
                    scaler._scale, scaler._growth_tracker = None, None
                elif scaler._scale is not None and scaler._growth_tracker is not None \
                        and _fits(scaler._scale, saved[0]) and _fits(scaler._growth_tracker, saved[1]):
                    scaler._scale.copy_(saved[0])
                    scaler._growth_tracker.copy_(saved[1])
                else:
                    scaler._scale, scaler._growth_tracker = saved[0].clone(), saved[1].clone()

    def restore_grad_scalers(self) -> None:
        """A managed ``torch.amp.GradScaler`` forgets which optimizers the interrupted step unscaled, as its
        ``update()`` would have at the step's end (the refused ``scaler.step`` never got there): the redone step's
        ``unscale_`` would otherwise raise "unscale_() has already been called on this optimizer". Its scale
        and growth tracker change only in ``update()``, so they are those of the step's start already."""
        for _, obj in self.managed():
            states = getattr(obj, "_per_optimizer_states", None) if isinstance(obj, torch.amp.GradScaler) else None
            if states is not None and hasattr(states, "default_factory"):
                obj._per_optimizer_states = type(states)(states.default_factory)

    def restore_gradients(self) -> None:
        """Put every trained parameter's ``.grad`` back as the interrupted attempt began (see the module
        docstring): None where it was None, else zeroed in place."""
        with torch.no_grad():
            for param, had_none in zip(self.trained, self.no_grad_at_begin):
                if had_none:
                    param.grad = None
                elif param.grad is not None:
                    param.grad.zero_()

"""Failure recovery on the rank side: the survivor's halt, plan and carry-out, and the replacement's take-over.

When a peer dies, hangs or is cut off, a collective of the current step fails (the movers are tolerant: the
failure is latched and the op completes with its outputs untouched) or tmd's ``Halt`` fails every mover at once.
Then, on every survivor:

1. the step's optimizer update is refused (:class:`StepAborted`, raised by a managed optimizer's pre-hook), so
   the rank has committed either the step (``done``) or the one before it. A DDP model's forward and backward
   passes stop early too: once the failure is known (tmd's Halt, a latched collective), the next of its modules
   to run (a forward pre-hook), or the next of its parameters to get its gradient (a gradient hook), raises
   StepAborted instead of computing the rest of a step that is void (:meth:`Recovery.manage`; off with
   ``TM_STOP_VOID_PASSES=0``). A backward pass stopped half-way leaves DDP's reducer expecting the rest of it, so
   every party of the recovery resets its reducer (:meth:`Recovery._reset_reducers`, as torch's own
   ``DistributedDataParallel._update_process_group`` does), which regroups its gradient buckets once more after
   the redone step, in the same assignment (a collective of all, like a job's first step);
2. at the step boundary it reports ``collective_failed`` (if it saw the failure before tmd said anything) and,
   once tmd's Halt is there, ``halted`` with its last committed step;
3. it waits for tmd's ``Recover`` plan, then carries it out on a helper thread (:meth:`Recovery.recover`): send
   its replicated state to the ranks the plan names, receive it if it is one step behind, build generation
   ``plan.generation`` of every group, load what it received, restore the RNG and swap the groups in; it reports
   ``recovered`` and redoes the interrupted step with the same data.

A replacement (a standby given a lost rank) runs at most ``REPLACEMENT_SHADOW_STEPS`` shadow iterations: its warm-up
is on the failure's critical path; one only, when the second would do what the job's later steps do (DDP's one-time
regrouping done by :func:`regroup_ddp_buckets`, the job's recorded steps 1 and 2 alike: worker.sandbox; a
migration's joiner takes the same shortcut). tmd sends the plan once every
survivor halted, without waiting for that warm-up, and the replacement carries its part out (receive the
replicated state from a replica, build the next generation of every group) on a helper thread during the shadow
iterations (:meth:`Recovery.prefetch`); after them it reports ``warmed``, loads what it received and swaps the groups
in (:meth:`Recovery.replace`). A newer Halt while a plan is carried out abandons it (nothing it received is loaded) and the rank halts again under the new incident.

**Each rank's own state.** In the first managed optimizer's step pre-hook of every step (only when the step is not
already failing), every rank serialises its rank state (CPU and CUDA RNG, the ``rank_local`` managed objects;
worker.rank_state) and the world group all-gathers them (two tiny collectives through the mover: a failure latches
and the step is refused like any other). A rank that commits step S therefore holds every rank's state as of the
end of S's compute, which is the state at the start of S + 1 (assumed: no RNG draws between the optimizer step and
the start of the next step; rank-local state_dicts are plain data). Only the latest committed step's copy is kept
(``world_size`` x a few KB of host memory). In a recovery every receiver (a replacement, or a survivor one step
behind) gets, with the replicated state from its sender, *its own* rank state from the sender's copy and loads it;
survivors that committed keep their own. During a joiner's shadow iterations the exchange is replayed like any
collective.

**Replica classes and the fingerprint check.** The same exchange carries a fingerprint of the replicated state
(worker.rank_state; a DTensor's local shard). At the job's first step every rank sends one, and the ranks whose
fingerprints are equal form a *replica class*: ranks holding bit-identical state (every rank under DDP; the same
shard coordinate along HSDP's replicate dimension; a pipeline stage's data-parallel copies). Each rank reports its
class to tmd (``ReplicaReport``), which recovers a lost rank only from a survivor of its class. A joiner learns the
classes from its recording of that step. After a migration or recovery, at the first step after it, every rank
compares its fingerprint with its class's; a mismatch fails the job (``RankFailed(STATE_MISMATCH)``, exit
``FAILED``). Only then is a fingerprint computed (~10 ms on the demo GPT); ``VERIFY_EVERY_STEP`` compares at every
step.

**What an interrupted step changed.** The optimizer update is refused, but a survivor's forward and backward
ran, and they change state too:

- *Buffers.* A forward pass updates running statistics (SyncBatchNorm's, identical on every replica; BatchNorm's,
  each rank its own), counters, running averages. Redone, the step would count its batch twice. So
  :meth:`Recovery.begin_step` keeps a copy of the managed modules' buffers, and a survivor that did not commit the
  step puts them back as soon as it halts, before it sends its state to anyone. Every buffer (a DTensor's local
  shard) is copied as every step begins, into the same copy each time (an asynchronous device copy on a GPU).
  Copying only the buffers that change would first need to find them: version counters miss BatchNorm's running
  statistics (its kernel bumps none), and comparing values costs more than the copy (``torch.equal`` of a 4 MB
  causal mask: 0.7 ms against 0.1 ms for ``copy_`` on one core here) and, on a GPU, synchronises with the device
  for every buffer at every step. Memory: one copy of every buffer, a constant mask or rotary table included.
  Buffers are looked up by name each time, so one that the forward pass replaces (``self.avg = 0.9 * self.avg +
  ...``) is covered too.
- *Gradients.* The backward pass accumulated this rank's own, never averaged, gradients into ``.grad``. A script
  that zeroes them *after* ``optimizer.step()`` (not before the backward) would add those to the redone step's. So
  :meth:`Recovery.begin_step` notes which trained parameters (those of the managed optimizers and modules) have no
  ``.grad``, and a survivor's recovery puts every one back: ``None`` where there was none, else zeroed in place
  (``zero_grad(set_to_none=False)``'s state). Gradients are not part of a rank's transferred state: a script must
  not carry them from one step to the next.
- *Rank-local objects.* Drawing a batch may move a data loader's own position (a count of batches served, an
  iterator's index), and a survivor drew the interrupted step's batches. :meth:`Recovery.begin_step` keeps a copy
  of every ``rank_local`` object's state_dict (``copy.deepcopy``: plain data, a few KB; 2 us for the demo's
  stream), and a survivor that did not commit the step loads it back as soon as it halts, so the redone step
  draws from where the attempt began. (A replacement gets the lost rank's from a replica's exchanged copy, below.)
- *A GradScaler's bookkeeping.* ``scaler.unscale_(opt)`` marks the optimizer as unscaled until ``scaler.update()``,
  which the refused ``scaler.step(opt)`` never reached; a managed ``torch.amp.GradScaler`` forgets that mark
  (:meth:`Recovery.restore_grad_scalers`).

The step ledger (which managed optimizers stepped, the last committed step, the RNG at the start of the
attempt, the exchanged rank states, which parameters had no gradient) is the training thread's own; what the
agent thread delivers (halt, plan) is read from :class:`worker.control.Control`.
"""
from __future__ import annotations

import copy
import json
import logging
import os
import struct
import sys
import threading
import time
import weakref
from typing import Any, Callable, NamedTuple, Optional

import torch

from tmd import protocol as p
from worker import backend as mb
from worker import rank_state, transfer
from worker.snapshot import Snapshot, Snapshots, round_id
from worker.control import Attempt, Control, Stage
from worker.exit import exit_process
from worker.dtensor import local_shard  # a DTensor op may communicate: copy its local shard
from worker.reports import Reporter

log = logging.getLogger("worker.recovery")

RECOVERY_TIMEOUT_S = 600.0  # a halted rank that hears nothing from tmd this long (seconds) exits with an error
# Shadow iterations a failure's replacement or a guard runs at most (at most the job's record_steps; a planned
# migration's joiner runs up to record_steps, in the background, with the same one-iteration shortcut). The
# replacement's warm-up is on the failure's critical path, so it runs the fewest that leave its process doing what
# the survivors do at the redone step: none when the job's recorded steps 0, 1 and 2 issued the same collectives
# (DDP's bucket layout and regrouping aside; worker.session's _no_shadow_iteration_needed), else one when
# regroup_ddp_buckets can do DDP's regrouping itself after it and the recorded steps 1 and 2 are alike
# (_one_shadow_iteration_enough), else two, because DDP regroups its gradient buckets in the forward of a process's
# second iteration with a broadcast from rank 0 (a replacement that skipped it would make that broadcast live, where
# the survivors make none). What the skipped iterations would warm (the allocator, lazily built optimizer state)
# the redone step warms at a small cost.
REPLACEMENT_SHADOW_STEPS = 2
# Compare the replicas' fingerprints at every step, not only at the first step after a migration or recovery. Off:
# a fingerprint costs ~10 ms on the demo GPT (~3 % of its step on this machine).
VERIFY_EVERY_STEP = False
NO_FINGERPRINT = bytes(32)  # sent in place of a fingerprint by a rank that does not verify this step


# Every DistributedDataParallel built in this process since track_ddp_modules() (weak: a dropped model goes)
_ddp_modules: weakref.WeakSet = weakref.WeakSet()
_ddp_hook: Any = None  # the handle of track_ddp_modules' hook, once registered


def _note_ddp(parent: torch.nn.Module, name: str, child: Any) -> None:
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(parent, DistributedDataParallel):
        _ddp_modules.add(parent)


def track_ddp_modules() -> None:
    """From now on, keep every DistributedDataParallel this process builds in a weak set (torch's global
    module-registration hook, ``torch.nn.modules.module.register_module_module_registration_hook``: DDP's
    ``__init__`` assigns its ``module``), so that :func:`regroup_ddp_buckets` finds them without a scan of every
    object (``gc.get_objects()``: ~0.1 s for the demo GPT's ~290,000 objects on this 2-core machine, on a
    failure's critical path for a replacement). Called by a joiner before its script builds anything; once."""
    global _ddp_hook
    if _ddp_hook is None:
        _ddp_hook = torch.nn.modules.module.register_module_module_registration_hook(_note_ddp)


# The collectives of DDP's regrouping (torch's ``Reducer::sync_bucket_indices``, reducer.cpp): two broadcasts from rank
# 0 on the DDP's process group, the bucket indices with their count (int32, [parameters + 1]), then the bucket
# sizes (int32, [buckets]).
REGROUP_OPS = 2


def ddp_to_regroup() -> tuple[bool, Optional[Any]]:
    """What :func:`regroup_ddp_buckets` would regroup: ``(True, None)`` when no DistributedDataParallel built since
    :func:`track_ddp_modules` has a regrouping ahead (none built, or each regrouped already or searching for
    unused parameters, which never regroups), ``(True, ddp)`` for the one that has, with the plain C++ reducer (no
    static graph, no Join), and ``(False, None)`` otherwise (several, whose order in the recording is the
    script's, or one of another kind): the joiner then lets its iterations do it."""
    pending = [o for o in _ddp_modules if not getattr(o, "_has_rebuilt_buckets", True)
               and not o.find_unused_parameters]
    if not pending:
        return True, None
    ddp = pending[0]
    if len(pending) > 1 or ddp.static_graph or getattr(ddp, "_use_python_reducer", False) or \
            getattr(ddp, "_delay_all_reduce_all_params", False) or ddp._join_config.enable:
        return False, None
    return True, ddp


def regroup_ddp_buckets(before_first: bool = False) -> bool:
    """A joiner after its first shadow iteration: do what the forward of its second iteration would do
    first, DDP's one-time regrouping of its gradient buckets (torch's ``Reducer::rebuild_buckets``: the bucket
    assignment of the first backward pass's gradient order, broadcast from rank 0; replayed here from the
    recording like any shadow collective), without that iteration's compute (one step of the failure's
    critical path). Returns True when it regrouped the DistributedDataParallel :func:`ddp_to_regroup` names.
    Returns False otherwise (none, or one it cannot regroup; a regrouping whose broadcast is not the next recorded
    op, which the replay refuses without consuming it): a second iteration, if the caller runs one, does it the
    usual way.

    ``before_first``: a failure's replacement that runs no shadow iteration at all (its replay moved to the
    recorded step 1 first). No backward pass gave the gradients' order, so every parameter is pushed in index
    order (``Reducer._push_all_rebuilt_params``, what a static graph does): that order only shapes rank 0's
    proposal, and every rank adopts the assignment rank 0 broadcast, here the recorded one. A refusal then raises
    RuntimeError instead (the pushed order cannot be taken back, so no iteration may follow)."""
    _, ddp = ddp_to_regroup()
    if ddp is None:
        return False
    if before_first:
        ddp.reducer._push_all_rebuilt_params()
    try:
        rebuilt = ddp.reducer._rebuild_buckets()
    except RuntimeError as e:  # the replay refused it (the script's own collective comes first): no harm done
        if before_first:
            raise
        log.info("DDP buckets not regrouped after the first shadow iteration (%s): running a second one", e)
        return False
    if rebuilt:
        ddp._has_rebuilt_buckets = True
    return rebuilt


def pack(fingerprint: bytes, meta: dict, state: bytes) -> bytes:
    """One rank's part of the per-step exchange: its fingerprint (32 bytes), a small JSON ``meta`` (node, nonce,
    snapshot agreement) prefixed by its length (4 bytes, big-endian), then its rank state."""
    encoded = json.dumps(meta, separators=(",", ":")).encode()
    return fingerprint + struct.pack(">I", len(encoded)) + encoded + state


def unpack(blob: bytes) -> tuple[bytes, dict, bytes]:
    """(fingerprint, meta, rank state) of a :func:`pack` blob."""
    at = rank_state.FINGERPRINT_BYTES
    (n,) = struct.unpack(">I", blob[at:at + 4])
    return blob[:at], json.loads(blob[at + 4:at + 4 + n]), blob[at + 4 + n:]


STOP_VOID_PASSES_ENV = "TM_STOP_VOID_PASSES"  # "0": a survivor's forward and backward passes run to their end
STOP_VOID_PASSES_OLD_ENV = "TM_ABORT_IN_FORWARD"  # its earlier name (forward passes only then), still read


def _stopping_void_passes() -> bool:
    """Whether a DDP model's forward and backward passes stop once their step is void (env
    ``TM_STOP_VOID_PASSES``, default on; "0" turns it off)."""
    return os.environ.get(STOP_VOID_PASSES_ENV, os.environ.get(STOP_VOID_PASSES_OLD_ENV)) != "0"


class StepAborted(RuntimeError):
    """Raised by a managed optimizer's ``step()`` when a collective of this step failed or tmd halted the job
    for a failure: the update is refused (nothing is modified) and :meth:`Session.run` redoes the step after
    recovery, with the same data, so the trajectory stays bit-identical. Also raised out of a managed DDP model's
    forward pass (by the next module to run) or out of ``loss.backward()`` (by the next parameter to get its
    gradient) once the failure is known (see :meth:`Recovery.manage`): then the rest of the step is not
    computed."""


class _Superseded(Exception):
    """A newer Halt arrived while a recovery plan was being carried out."""


class _Launched(NamedTuple):
    """A recovery plan being carried out on a helper thread: its ``attempt`` and the ``result`` dict the helper
    fills (``received``, ``built``, ``moved``, ``seconds``, or ``error``)."""

    attempt: Attempt
    result: dict


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


def _fits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype


class Recovery:
    """This rank's part in failure recovery (see the module docstring). Training thread only, apart from the
    helper thread of :meth:`recover` / :meth:`replace` / :meth:`prefetch`, which the training thread waits for,
    and the thread :meth:`prefetch` starts to watch for the plan."""

    def __init__(self, control: Control, reports: Reporter, fail: Callable[[p.FailureKind, str], None]) -> None:
        """``fail(kind, error)``: report that the job must fail and end this process (never returns)."""
        self.control = control
        self.reports = reports
        self.fail = fail
        self.replicated: dict[str, Any] = {}  # state identical on every data-parallel replica
        self.local: dict[str, Any] = {}  # rank-local state (e.g. this rank's data sampler)
        self.exchanged: Optional[tuple[int, list[bytes]]] = None  # (step, every rank's state) of this attempt
        self.kept: Optional[tuple[int, list[bytes]]] = None  # the same, of the latest committed step
        self.verify_next = False  # compare the replicas' fingerprints at the next exchange
        # rank -> the ranks whose replicated state is bit-identical to it (its replica class), learned at the first
        # exchange where every rank sent a fingerprint (the job's first step); None until then
        self.classes: Optional[dict[int, list[int]]] = None
        self.node = ""  # this process's node name (published in the exchange: snapshot pairing)
        self.snapshots: Optional[Snapshots] = None  # buddy snapshots (Session.attach_snapshots), off if None
        self._snapshot_reported = False
        self._snapshot_round: Optional[tuple[int, str]] = None  # (step, round id): taken as the next step starts
        self.optimizers: list[torch.optim.Optimizer] = []
        self.stepped: set[int] = set()  # ids of the managed optimizers that stepped in this attempt
        self.committed_step = -1  # last step whose optimizer update this process applied
        self.step_raised = False  # set by Session.run(): the step function raised
        self.rng_snapshot: Optional[torch.Tensor] = None  # CPU RNG at the start of the current attempt
        self.trained: list[torch.Tensor] = []  # the managed optimizers' and modules' parameters, once each
        self.no_grad_at_begin: list[bool] = []  # per trained parameter: ``.grad`` was None as the attempt began
        # (managed object's name, buffer name) -> that buffer's value as the attempt began (a local copy)
        self.buffer_copies: dict[tuple[str, str], torch.Tensor] = {}
        self._copied_at = -1  # the step whose begin_step took ``buffer_copies`` and ``local_copies``
        self.local_copies: dict[str, Any] = {}  # the rank-local objects' state_dicts as the attempt began
        # (step, rank_state.capture) as this rank's exchange of ``step`` took it (live steps only)
        self._at_update: Optional[tuple[int, dict[str, Any]]] = None
        self._warned_after_update = False
        self.in_step = False  # between begin_step and the step's end (Session.steps): a forward may be stopped
        self._hooked: set[int] = set()  # ids of the modules (parameters) that have the forward (gradient) hook
        self._resettable: list[Any] = []  # the managed DDP models whose backward pass may stop: _reset_reducers
        self._at_backward: Optional[Callable[[], None]] = None  # see at_next_backward
        self._prefetched: Optional[_Launched] = None  # a replacement's plan carried out during its shadow iterations
        self._prefetch_lock = threading.Lock()
        self._prefetch_open = False  # prefetch() watches for the plan until replace() takes over

    # --- the step ledger (training thread) -----------------------------------------------------------------------
    def manage(self, objects: dict[str, Any], rank_local: bool) -> None:
        """Track ``objects``: replicated unless ``rank_local``; managed optimizers get the step hooks."""
        (self.local if rank_local else self.replicated).update(objects)
        for obj in objects.values():
            if isinstance(obj, torch.optim.Optimizer) and obj not in self.optimizers:
                self.optimizers.append(obj)
                obj.register_step_pre_hook(self._before_optimizer_step)
                obj.register_step_post_hook(self._after_optimizer_step)
            if _stoppable(obj) and _stopping_void_passes():
                for module in obj.module.modules():
                    if id(module) not in self._hooked:
                        self._hooked.add(id(module))
                        module.register_forward_pre_hook(self._abort_forward)
                if _backward_stoppable(obj):
                    if not any(obj is m for m in self._resettable):
                        self._resettable.append(obj)
                    for param in obj.module.parameters():
                        if param.requires_grad and id(param) not in self._hooked:
                            self._hooked.add(id(param))
                            param.register_hook(self._abort_backward)
        self.trained = self._trained_parameters()
        self.buffer_copies = {}

    def _trained_parameters(self) -> list[torch.Tensor]:
        found: dict[int, torch.Tensor] = {}
        for opt in self.optimizers:
            for group in opt.param_groups:
                for param in group["params"]:
                    found.setdefault(id(param), param)
        for _, obj in self._managed():
            if isinstance(obj, torch.nn.Module):
                for param in obj.parameters():
                    if param.requires_grad:
                        found.setdefault(id(param), param)
        return list(found.values())

    def _managed(self) -> list[tuple[str, Any]]:
        """Every managed object by name, replicated and rank-local."""
        return list(self.replicated.items()) + list(self.local.items())

    def _buffers(self) -> dict[tuple[str, str], torch.Tensor]:
        """The managed modules' buffers as they are now, each as its local tensor (looked up by name every time:
        a forward pass may replace a buffer, ``self.avg = 0.9 * self.avg + ...``, rather than change it)."""
        found = {}
        for name, obj in self._managed():
            if isinstance(obj, torch.nn.Module):
                for key, buf in obj.named_buffers():
                    found[(name, key)] = local_shard(buf)
        return found

    def _copy_at_begin(self, step: int) -> None:
        """As an attempt of ``step`` begins: copy every buffer and every rank-local object's state_dict (see the
        module docstring)."""
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
        self.local_copies = {name: copy.deepcopy(obj.state_dict()) for name, obj in self.local.items()}
        self._copied_at = step

    def restore_local(self) -> None:
        """Put the rank-local objects back as the interrupted attempt began (a survivor that did not commit it)."""
        for name, state in self.local_copies.items():
            self.local[name].load_state_dict(copy.deepcopy(state))

    def restore_buffers(self) -> None:
        """Put the managed modules' buffers back as the interrupted attempt began (a survivor that did not
        commit it; see the module docstring)."""
        now = self._buffers()
        with torch.no_grad():
            for k, saved in self.buffer_copies.items():
                buf = now.get(k)
                if buf is not None and _fits(buf, saved):
                    buf.copy_(saved)

    def restore_grad_scalers(self) -> None:
        """A managed ``torch.amp.GradScaler`` forgets which optimizers the interrupted step unscaled, as its
        ``update()`` would have at the step's end (the refused ``scaler.step`` never got there): the redone step's
        ``unscale_`` would otherwise raise "unscale_() has already been called on this optimizer". Its scale
        and growth tracker change only in ``update()``, so they are those of the step's start already."""
        for _, obj in self._managed():
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

    def _abort_forward(self, module: torch.nn.Module, args: Any) -> None:
        """A managed DDP model's module is about to run: raise StepAborted if this step is void already (a
        halt, a latched collective), so that the survivor halts without computing the rest of the step."""
        self._abort_if_void("forward")

    def _abort_backward(self, grad: torch.Tensor) -> None:
        """A gradient of a managed DDP model's parameter was computed: raise StepAborted (out of
        ``backward()``) if this step is void already. The reducer is left half-way through the backward pass;
        every party resets it in :meth:`_complete`. Otherwise run what :meth:`at_next_backward` armed."""
        self._abort_if_void("backward")
        if self._at_backward is not None:
            fn, self._at_backward = self._at_backward, None
            fn()

    def at_next_backward(self, fn: Callable[[], None]) -> bool:
        """Arm ``fn`` to run once, when the first gradient of a managed DDP model's parameter is computed in a
        step that is not void (on the thread that runs the gradient hooks: the training thread on CPU, autograd's
        device thread on CUDA). Returns False, arming nothing, where no managed model has these gradient hooks
        (see :meth:`manage`: not FSDP2, DTensor or pipelined models, nor with ``TM_STOP_VOID_PASSES=0``). A later
        call replaces what was armed; ``fn`` must tolerate running after its moment passed."""
        if not self._resettable:
            return False
        self._at_backward = fn
        return True

    def _abort_if_void(self, where: str) -> None:
        if self.in_step and self.control.stage == Stage.TRAINING and self.control.role == p.WorkerRole.ACTIVE:
            why = self.failure()
            if why:
                message = f"rank {self.control.rank} step {self.control.step}: {where} pass stopped, {why}"
                print(f"[worker] {message}", flush=True)
                raise StepAborted(message)

    def _reset_reducers(self) -> None:
        """Every party of a recovery, as it swaps the new groups in: reset the reducer of every managed DDP model
        whose backward pass may stop half-way (those :meth:`manage` hooked; torch's ``Reducer._reset_state``: the
        next forward may run although a backward did not finish). The reset also makes DDP regroup its gradient
        buckets once more after the redone step, as after a job's first step: the same assignment (the gradients'
        order is the model's), broadcast from rank 0 in the next step's forward. So every party resets, whether its own step
        stopped in the forward, the backward or the optimizer, and that broadcast is a collective of all."""
        for ddp in self._resettable:
            ddp.reducer._reset_state()
            ddp._has_rebuilt_buckets = False

    def failure(self) -> Optional[str]:
        """Why the current step cannot commit (a latched collective failure, or tmd's halt), or None."""
        halted = self.control.halt_reason()
        if halted is not None:
            return halted
        groups = self.control.groups
        return groups.failure() if groups is not None and self.control.role == p.WorkerRole.ACTIVE else None

    def _before_optimizer_step(self, optimizer, args, kwargs) -> None:
        why = self.failure()
        # first managed optimizer of the step (shadow iterations do not call begin_step: compare the step)
        if not why and (self.exchanged is None or self.exchanged[0] != self.control.step):
            self._exchange()
            why = self.failure()  # the exchange's collectives may have latched a failure
        if why:
            raise StepAborted(f"rank {self.control.rank} step {self.control.step}: update refused, {why}")

    def _after_optimizer_step(self, optimizer, args, kwargs) -> None:
        self.stepped.add(id(optimizer))
        if len(self.stepped) == len(self.optimizers):
            self.committed_step = self.control.step
            if self.exchanged is not None and self.exchanged[0] == self.committed_step:
                self.kept = self.exchanged

    def _exchange(self) -> None:
        """All-gather every rank's fingerprint (32 bytes), meta and rank state; learn the replica classes from the
        first exchange with every fingerprint; compare the fingerprints within each class if due; agree on buddy
        snapshots (worker.snapshot)."""
        step = self.control.step
        # Replayed in shadow iterations: the recorded fingerprints are the leaver's peers', nothing to compare.
        verifying = (self.verify_next or VERIFY_EVERY_STEP or self.classes is None) \
            and self.control.stage != Stage.SHADOW and self.control.role == p.WorkerRole.ACTIVE
        fp = rank_state.fingerprint(self.replicated, self.optimizers) if verifying else NO_FINGERPRINT
        snaps = self.snapshots
        meta = {"node": self.node, "nonce": os.urandom(8).hex(),
                "held": snaps.held() if snaps else [], "want": bool(snaps and snaps.want)}
        state = rank_state.capture(self.local)
        if self.control.stage != Stage.SHADOW and self.control.role == p.WorkerRole.ACTIVE:
            self._at_update = (step, state)
        gathered = rank_state.all_gather_bytes(pack(fp, meta, rank_state.encode(state)))
        if self.failure() is not None:
            return  # outputs untouched by a failed collective: keep nothing
        self.exchanged = (step, gathered)
        parts = [unpack(g) for g in gathered]
        prints = {r: part[0] for r, part in enumerate(parts)}
        if self.classes is None and NO_FINGERPRINT not in prints.values():
            self._learn_classes(prints, {r: part[1]["node"] for r, part in enumerate(parts)})
        if verifying:
            self.verify_next = False
            self._verify(step, {r: f for r, f in prints.items() if f != NO_FINGERPRINT})  # others: not due
        self._snapshot_round = None
        if snaps is not None and snaps.enabled and self.control.stage != Stage.SHADOW:
            metas = [part[1] for part in parts]
            snaps.prune([m["held"] for m in metas])
            if snaps.due(step, [m["want"] for m in metas]):
                self._snapshot_round = (step, round_id([m["nonce"] for m in metas]))

    def _learn_classes(self, prints: dict[int, bytes], node_of: dict[int, str]) -> None:
        """Replica classes from every rank's fingerprint (a joiner learns them from its recording), and whether
        buddy snapshots are on (from the classes and every rank's node); an active rank reports its own class
        to tmd (``ReplicaReport``)."""
        by_print: dict[bytes, list[int]] = {}
        for r, f in sorted(prints.items()):
            by_print.setdefault(f, []).append(r)
        self.classes = {r: by_print[f] for r, f in prints.items()}
        if self.snapshots is not None:
            self.snapshots.configure(node_of, self.classes)
        if self.control.stage != Stage.SHADOW and self.control.role == p.WorkerRole.ACTIVE:
            self.reports.replicas(self.classes[self.control.rank])

    def _verify(self, step: int, prints: dict[int, bytes]) -> None:
        """Fail the job (STATE_MISMATCH) when this rank's fingerprint differs from another verifying rank of its
        replica class (every rank is one class while the classes are unknown)."""
        rank = self.control.rank
        mine = prints[rank]
        peers = self.classes.get(rank, list(prints)) if self.classes else list(prints)
        other = [r for r in peers if r in prints and prints[r] != mine]
        if other:
            agree = [r for r in peers if r in prints and prints[r] == mine]
            self.fail(p.FailureKind.STATE_MISMATCH,
                      f"managed state differs between data-parallel replicas at step {step}: ranks "
                      f"{agree} agree with rank {rank}, ranks {other} differ")

    def own_state(self, rank: int, step: int) -> Optional[bytes]:
        """Rank ``rank``'s state (worker.rank_state bytes) at the start of step ``step + 1``, from the copy kept
        at committed step ``step``; None when no such copy is kept (no managed optimizer, or another step)."""
        if self.kept is None or self.kept[0] != step or not 0 <= rank < len(self.kept[1]):
            return None
        return unpack(self.kept[1][rank])[2]

    def begin_step(self) -> None:
        """A step attempt starts: take the buddy snapshot due at the step just committed (here, not after the
        optimizer: what steps after it, an LR scheduler, belongs to the state step + 1 starts from); no optimizer
        stepped yet; remember the RNG to redo it with."""
        due, self._snapshot_round = self._snapshot_round, None
        if due is not None and due[0] == self.committed_step and self.kept is not None and self.kept[0] == due[0]:
            self.snapshots.take(due[0], self.replicated, self.own_state(self.control.rank, due[0]), due[1])
            if not self._snapshot_reported:  # its cost, once per process: host bytes and the copy's seconds
                self._snapshot_reported = True
                self.reports.snapshot(due[0], self.snapshots.bytes_per_copy, self.snapshots.take_s)
        self.in_step = True
        self.stepped.clear()
        self.exchanged = None
        self.rng_snapshot = torch.get_rng_state()
        self.no_grad_at_begin = [param.grad is None for param in self.trained]
        self._copy_at_begin(self.control.step)
        self._check_after_update()

    def _check_after_update(self) -> None:
        """As a step begins, after the step before it committed here with its exchange: warn once per process
        (``RankWarning(state_after_update)``, the log, stderr) when the RNG or a rank-local object changed since
        that exchange, i.e. between the optimizer update and now. The exchanged copy is what a failure's
        replacement resumes from, so such a change would be missing there (the survivors put back what they hold
        as the attempt began). Costs one RNG read and a comparison of the rank-local state_dicts (microseconds)."""
        at, self._at_update = self._at_update, None
        step = self.control.step
        if at is None or self._warned_after_update or at[0] != step - 1 or self.committed_step != at[0]:
            return
        then = at[1]
        now_cpu, now_cuda = rank_state.rng_states()
        changed = [] if torch.equal(then["cpu_rng"], now_cpu) else ["the CPU RNG"]
        if not rank_state.same(then["cuda_rng"], now_cuda):
            changed.append("a CUDA RNG")
        changed += [f"rank-local object {name!r}" for name, state in then["local"].items()
                    if not rank_state.same(state, self.local_copies[name])]
        if not changed:
            return
        self._warned_after_update = True
        message = (f"{' and '.join(changed)} changed between step {at[0]}'s optimizer update and step {step}'s "
                   "start: a failure's replacement would resume without that change. Draw random numbers and "
                   "move rank-local objects (data position) before optimizer.step().")
        log.warning("rank %d: %s", self.control.rank, message)
        print(f"[worker] WARNING rank {self.control.rank} ({p.WarningCode.STATE_AFTER_UPDATE.value}): {message}",
              file=sys.stderr, flush=True)
        self.reports.warning(p.WarningCode.STATE_AFTER_UPDATE, message)

    def committed(self, step: int) -> bool:
        """After a failure noticed in ``step``: did this rank commit that step anyway (every managed optimizer
        stepped; without managed optimizers, the step function returned)?"""
        return self.committed_step == step if self.optimizers else not self.step_raised

    # --- survivor --------------------------------------------------------------------------------------------------
    def recover(self, attempted: int, done: bool) -> int:
        """Survivor: after a failure noticed in step ``attempted`` (``done``: that step committed here anyway),
        halt, follow tmd's recovery plan and return the step to resume at. Exits the process (ExitCode.FAILED)
        after ``RECOVERY_TIMEOUT_S`` seconds without word from tmd."""
        committed = attempted if done else attempted - 1
        rng_next = torch.get_rng_state() if done else self.rng_snapshot  # RNG at the start of committed + 1
        if not done and self._copied_at == attempted:  # before this rank's state is sent to anyone
            self.restore_buffers()
            self.restore_local()
        self.control.enter(Stage.HALTED)
        if self.control.halt is None:  # we saw it first (a peer's socket closed): a detection signal for tmd
            self.reports.report(0, p.RecoveryPhase.COLLECTIVE_FAILED, ok=False, error=self.failure() or "",
                                step=committed)
        while True:
            self._wait(lambda: self.control.halt is not None, "a halt")
            halt = self.control.halt
            self.reports.report(halt.incident_id, p.RecoveryPhase.HALTED, step=committed,
                                snapshots=self.snapshots.held() if self.snapshots else ())
            self._wait(lambda: self.control.halt is not halt or (
                self.control.plan is not None and self.control.plan.incident_id == halt.incident_id),
                "a recovery plan")
            if self.control.halt is not halt:
                continue  # superseded by a newer failure: halt again under its id
            try:
                self.control.enter(Stage.RECOVERING)
                resume = self._carry_out(self.control.plan, committed, rng_next)
            except _Superseded:
                self.control.enter(Stage.HALTED)
                continue
            except Exception as e:  # noqa: BLE001 - reported; tmd decides (a new incident or the job fails)
                self.control.enter(Stage.HALTED)
                log.exception("recovery %d failed", halt.incident_id)
                self.reports.report(halt.incident_id, p.RecoveryPhase.RECOVERED, ok=False, error=e, step=committed)
                self._wait(lambda: self.control.halt is not halt, "a new plan after a failed recovery")
                continue
            self.control.enter(Stage.TRAINING)
            return resume

    # --- replacement -------------------------------------------------------------------------------------------------
    def prefetch(self) -> None:
        """Replacement of a failed rank, called before its shadow iterations: as soon as tmd's plan comes (tmd
        sends it once every survivor halted, without waiting for this warm-up), carry out this rank's part of it
        (receive the replicated state, build the next generation of every group) on a helper thread while the
        training thread runs the shadow iterations. :meth:`replace` then only loads what came and swaps the
        groups in. A plan that would have this rank send its live state (it is being trained in the sandbox) is
        left to :meth:`replace`."""

        def watch() -> None:
            if not self.control.wait_until(lambda: self.control.plan is not None or not self._prefetch_open,
                                           RECOVERY_TIMEOUT_S):
                return
            with self._prefetch_lock:  # replace() closes the prefetch under this lock: one attempt per plan
                plan = self.control.plan
                if not self._prefetch_open or plan is None:
                    return
                if any(s == self.control.rank for s, _ in plan.sends) and plan.rollback_step < 0:
                    return  # a sender of live state: after the shadow iterations (never in plans tmd makes today)
                try:
                    self._prefetched = self._launch(plan, None, None)
                except Exception as e:  # noqa: BLE001 - replace() checks the plan again and reports the error
                    log.warning("not prefetching recovery %d: %s", plan.incident_id, e)

        with self._prefetch_lock:
            self._prefetched, self._prefetch_open = None, True
        threading.Thread(target=watch, daemon=True, name="tm-recover-prefetch").start()

    def _take_prefetched(self, plan: p.Recover) -> Optional[_Launched]:
        """Close the prefetch; return its attempt if it carries out ``plan`` (None otherwise). A stale one (an
        older plan) is cancelled here, and what it built released once it finished."""
        with self._prefetch_lock:
            launched, self._prefetched, self._prefetch_open = self._prefetched, None, False
        if launched is None or launched.attempt.plan is plan:
            return launched
        _, done = self.control.await_attempt(launched.attempt, 0.0)  # cancels it: a helper still running releases
        for inner in launched.result.get("built", {}).values() if done else ():
            mb.release_in_background(inner)
        return None

    def guard(self, shadow_steps: int) -> int:
        """A guard (tmd.guards) after its ``shadow_steps`` shadow iterations: report warmed (as incident 0), then
        wait, with no deadline, until it is taken: returns 0 for the plan of a recovery that adopts it (then
        :meth:`replace`), else the id of the planned migration whose joiner it is (a Prepare came). tmd releases a
        guard it does not need: the process exits then."""
        control = self.control
        self.reports.report(0, p.RecoveryPhase.WARMED, step=-1, shadow_steps=shadow_steps)
        control.wait_until(lambda: control.plan is not None or control.migration_role == p.MigrationRole.JOINER)
        return 0 if control.plan is not None else control.migration_id

    def replace(self, incident_id: int, shadow_steps: int = 0) -> int:
        """Joiner replacing a failed rank: report warmed (with the ``shadow_steps`` it ran), wait for the plan,
        receive state (or take what :meth:`prefetch` received), return the step to resume at. ``incident_id`` 0: a
        migration's joiner whose leaver died, or an adopted guard (tmd knows it is warm). Exits the process (ExitCode.FAILED) when the recovery fails (a fresh
        standby takes over) or after ``RECOVERY_TIMEOUT_S`` seconds without a plan."""
        self.control.enter(Stage.RECOVERING)
        if incident_id:
            self.reports.report(incident_id, p.RecoveryPhase.WARMED, step=-1, shadow_steps=shadow_steps)
        while True:
            self._wait(lambda: self.control.plan is not None, "a recovery plan")
            plan = self.control.plan
            try:
                launched = self._take_prefetched(plan) or self._launch(plan, None, None)
                resume = self._complete(launched, None)
            except _Superseded:
                continue
            except Exception as e:  # noqa: BLE001 - a fresh standby takes over; this process is thrown away
                log.exception("recovery %d failed", plan.incident_id)
                self.reports.report(plan.incident_id, p.RecoveryPhase.RECOVERED, ok=False, error=e)
                exit_process(p.ExitCode.FAILED, f"replacement for rank {self.control.rank}: recovery "
                                                f"{plan.incident_id} failed: {type(e).__name__}: {e}")
            groups = self.control.groups
            groups.set_mode(p.MoverMode.LIVE)
            groups.set_tolerant()
            self.control.become_active()
            return resume

    def _wait(self, ready: Callable[[], bool], what: str) -> None:
        if not self.control.wait_until(ready, RECOVERY_TIMEOUT_S):
            exit_process(p.ExitCode.FAILED, f"rank {self.control.rank}: no word from tmd for "
                                            f"{RECOVERY_TIMEOUT_S:.0f} s while waiting for {what}")

    def _carry_out(self, plan: p.Recover, committed: Optional[int], rng_next: Optional[torch.Tensor]) -> int:
        """Carry out ``plan`` (survivor: ``committed`` is its last committed step, ``rng_next`` its RNG at the
        start of the next one) and return the step to resume at (:meth:`_launch`, then :meth:`_complete`)."""
        resume = self._complete(self._launch(plan, committed, rng_next), rng_next)
        self.restore_gradients()
        self.restore_grad_scalers()
        return resume

    def _launch(self, plan: p.Recover, committed: Optional[int], rng_next: Optional[torch.Tensor]) -> _Launched:
        """Start carrying out ``plan`` on a helper thread (a dead peer can block a rendezvous or a transfer for
        the gloo timeout): send what the plan names, receive this rank's state, build the next generation of
        every group. Raises RuntimeError when the plan does not fit this rank (nothing started then)."""
        rank = self.control.rank
        incident = plan.incident_id
        rollback = plan.rollback_step >= 0
        receive_from = next((s for s, d in plan.sends if d == rank), None)
        send_to = sorted(d for s, d in plan.sends if s == rank)
        if rollback and committed is not None and receive_from is None:
            if self.snapshots is None or plan.rollback_step not in self.snapshots.held():
                raise RuntimeError(f"plan rolls back to step {plan.rollback_step}, but this rank holds no "
                                   "complete snapshot of it")
        elif receive_from is None and committed != plan.resume_step - 1:
            raise RuntimeError(f"plan resumes at step {plan.resume_step}, but this rank committed {committed} "
                               "and is sent no state")
        result: dict[str, Any] = {}
        groups = self.control.groups
        timeout_s, host = groups.timeout_s, groups.host
        attempt = Attempt(self.control.halt, plan)

        def payload(dst: int) -> tuple[dict[str, Any], dict]:
            """What this rank sends ``dst``: its live replicated state and the copy it kept of ``dst``'s rank
            state, or (rolling back) the snapshot it keeps of ``dst``."""
            if rollback:
                snap = self.snapshots.kept_copy(plan.rollback_step)  # KeyError: not held (tmd checked it is)
                return self.snapshots.frozen(snap), {"step": plan.resume_step, "rng": None,
                                                     "rank_state": snap.rank_state}
            return self.replicated, {"step": plan.resume_step, "rng": rng_next,
                                     "rank_state": self.own_state(dst, plan.resume_step - 1)}

        def work() -> None:
            started = time.perf_counter()
            try:
                # A store connection of this attempt's own: a TCPStore client runs one operation at a time, and
                # an abandoned prepare or an earlier attempt may still be blocked in a rendezvous with a lost
                # peer on another. One thread, one order on every rank (transfer groups by receiver, then the
                # groups), so the rendezvous of this attempt never wait on one another.
                store = groups.connect_store()
                moved = 0  # bytes received here (senders do not count them twice)
                for dst in send_to:
                    pg = mb.build_inner(store, p.layout.recovery_prefix(plan.generation, dst), 0, 2, timeout_s, host)
                    objects, extra = payload(dst)
                    transfer.send_state(pg, objects, extra)
                    mb.release_in_background(pg)
                    pg = None
                if receive_from is not None:
                    pg = mb.build_inner(store, p.layout.recovery_prefix(plan.generation, rank), 1, 2, timeout_s, host)
                    states, extra, n, _ = transfer.recv_state(pg, 0)
                    mb.release_in_background(pg)
                    pg = None
                    moved += n
                    result["received"] = (states, extra)
                result.update(built=groups.build_all(plan.generation, store), moved=moved,
                              seconds=time.perf_counter() - started)
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                result["error"] = e
            finally:
                # The waiting thread decides under the same lock: one of us drops what was built.
                if self.control.finish_attempt(attempt):
                    for inner in result.get("built", {}).values():
                        mb.release_in_background(inner)

        threading.Thread(target=work, daemon=True, name=f"tm-recover-{incident}").start()
        return _Launched(attempt, result)

    def _complete(self, launched: _Launched, rng_next: Optional[torch.Tensor]) -> int:
        """Wait for the helper of :meth:`_launch` while watching for a newer halt or plan (then its work is
        abandoned and nothing it received is loaded), load what it received, swap the groups in and report
        ``recovered``. Returns the step to resume at. Raises _Superseded or the helper's error."""
        attempt, result = launched.attempt, launched.result
        plan = attempt.plan
        rank = self.control.rank
        incident = plan.incident_id
        rollback = plan.rollback_step >= 0
        groups = self.control.groups
        newer, done = self.control.await_attempt(attempt, RECOVERY_TIMEOUT_S)
        if newer or not done:
            for inner in result.get("built", {}).values() if done else ():
                mb.release_in_background(inner)
            raise _Superseded() if newer else RuntimeError("recovery timed out")
        # The helper can no longer touch anything: load what it received and swap the groups in.
        if "error" in result:
            raise result["error"]
        if "received" in result:
            states, extra = result["received"]
            transfer.load_state(self.replicated, states)  # KeyError if the sets of objects differ
            rng_next = extra["rng"]  # the sender's RNG: only where the sender kept no copy of this rank's state
            if extra.get("rank_state") is not None:
                rank_state.restore(rank_state.deserialize(extra["rank_state"]), self.local)
                rng_next = None
            if rollback and self.snapshots is not None:  # hold what came as this rank's snapshot of that step
                live = {name: obj.state_dict() for name, obj in self.replicated.items()}  # adopt() copies it
                self.snapshots.adopt(Snapshot(plan.rollback_step, live, extra["rank_state"]))
        elif rollback:
            own = self.snapshots.own_copy(plan.rollback_step)
            transfer.load_state(self.replicated, own.states)
            rank_state.restore(rank_state.deserialize(own.rank_state), self.local)
            rng_next = None
        if rollback:
            self.kept = self.exchanged = None  # rank-state copies of steps that are redone
        self._snapshot_round = None  # a round of the interrupted step: the ranks resume with a fresh one (want)
        groups.install(result["built"])
        self._reset_reducers()
        if rng_next is not None:
            torch.set_rng_state(rng_next)
        self.control.recovered(attempt)
        self.committed_step = plan.resume_step - 1
        self.verify_next = True
        if self.snapshots is not None:
            self.snapshots.want = True  # a fresh round once the job trains again (the lost node's copies are gone)
        self.reports.report(incident, p.RecoveryPhase.RECOVERED, step=plan.resume_step - 1,
                            bytes_moved=result["moved"], seconds=result["seconds"])
        print(f"[worker] rank {rank} recovered from incident {incident}: resuming at step "
              f"{plan.resume_step} (generation {plan.generation})", flush=True)
        return plan.resume_step

"""Pre-copy with optimizer replay: a planned migration whose switch step moves only what the joiner cannot
compute itself.

In TrainMover (arXiv 2412.12636, section 5) the leaver sends its whole state at the switch step S while the
stayers wait for it (0.1-0.2 s for the demo GPT's 80 MB here). Here the leaver sends it earlier, while training
goes on, and the joiner then follows the leaver's optimizer steps, so at S only a small tail moves:

1. **Pre-copy** (leaver, at the step boundary b = S - 1, worker.migration ``PRECOPY_LEAD_STEPS``; tmd arms S at
   least three steps ahead): the training thread takes every managed object's state_dict (references, no copy; FSDP2 must not be
   asked from another thread while its forward runs), then a sender thread packs those tensors with
   :func:`worker.transfer.send_state` (a copy, during the forward and backward passes, which change no parameter
   or optimizer state) and sends them. The joiner loads them.
2. **Optimizer replay** (every managed optimizer step of steps b .. S-1): the leaver's step pre-hook waits for
   the pre-copy's packing, checks that the optimizer's parameters and state are exactly what the joiner holds
   (torch's per-tensor version counters: unchanged since sent or last replayed), and queues the step's gradients
   (what the optimizer reads: after DDP's all-reduce, after clipping). Its post-hook waits until they are packed,
   so a ``zero_grad`` after the step cannot tear them (at most ``PACK_TIMEOUT_S``: a sender still busy with an
   earlier message turns that optimizer's replay off instead of stalling training). In the last step before S
   (:meth:`Precopy.last_step`) nothing is packed: the sender reads the gradients in place and the post-hook waits
   until they are sent (at most ``DELIVERY_TIMEOUT_S``: turning replay off there would only put the whole
   optimizer state in the tail). The joiner's replay of that step is what the stayers wait for at S, and the copy
   cost it ~15-25 ms on a busy 2-core host; the leaver's own lateness in its last step delays nobody. But a
   sender that has not begun that send within ``PACK_TIMEOUT_S`` (still busy with an earlier message: the joiner
   is slow to take it) sends a copy the post-hook makes instead, so the leaver never waits on a joiner that has
   not reached that message (:meth:`_Job.copy_unless_started`). The joiner receives them into buffers it touched
   at the end of its warm-up (:func:`gradient_buffers`), sets them as its parameters' ``.grad`` and runs the same
   optimizer's step function with hooks bypassed: the same inputs, code and thread count give bit-identical
   outputs.
3. **Tail** (leaver, at the boundary before S; built while the last gradients are still sent): every managed
   object's state_dict again, flattened (:func:`flatten`), as its structure (compact JSON text of its containers,
   keys and tensors' dtypes and shapes) and its leaf count, and by value only what the joiner's replay did not
   make identical: every tensor not owned by a replayed optimizer (buffers, an EMA copy: always, because a change
   through ``.data`` bumps no version counter), optimizer tensors changed outside a replayed step, the non-tensor
   values (learning rates, a scheduler's or sampler's position) and the RNG state. A tensor the replay made
   identical has no entry in the header but its place in the structure: the tail's CPU is ~3.5 us per tensor at
   the slower end (``python -m benchmarks.tail``; ~27 us with a per-tensor reference). The joiner flattens its
   own state_dicts; where the structure is its own it loads only the objects whose leaves differ
   (:func:`load_tail`). Where it is not (plain values change shape from step to step: a history list the leaver
   appended to since the pre-copy, a dict of other keys), the object's state is made from the leaver's structure
   (:func:`rebuild`: its values, its sent tensors, and for each kept tensor the joiner's own at the same path, of
   the same dtype and shape) and loaded whole. Tensors must keep their dtypes and shapes: the joiner checks that
   right after loading the pre-copy (:func:`check_tensors`), before it reports ``transferred``, so a joiner
   whose tensors differ from the leaver's is refused while the migration can still abort.

Only ``torch.optim`` optimizers are replayed (a third-party optimizer's step may issue collectives), and only
when their parameters and gradients are dense tensors, or DTensors (FSDP2, tensor parallel) whose local shards
are and whose gradients have their parameters' placements, and their step takes no closure; otherwise their
tensors travel in the tail: the old cost, still exact. A DTensor optimizer's step is elementwise on the local
shards, which the joiner replays without communicating (its sandbox would answer a collective with recorded
values): the leaver counts the collectives its job's groups issue during each step (``ops_issued``) and turns
replay off for an optimizer whose step issued any. The script's own step hooks may stay:
the pre-hook here runs after every other pre-hook (it sees what they changed, and the arguments they passed on)
and the post-hook here before every other post-hook (what they change afterwards shows in the version counters
at the tail); a hook registered after the pre-copy started turns replay off. One change is invisible to version
counters: an in-place write through ``.data`` to an optimizer's parameter or state outside its step (in the
loop or in a hook). The replica check after every switch (worker.step_exchange ``verify_next``) compares the
joiner's state with a data-parallel replica's and fails the job (``state_mismatch``) if they differ.

Wire: each message is one worker.transfer message over the migration's 2-rank transfer group (leaver rank 0);
``extra["kind"]`` says which (:class:`Kind`). Without a pre-copy (the switch step came too soon, or the sender
failed) the leaver sends one ``full`` message at S, the original protocol.
"""
from __future__ import annotations

import collections
import dataclasses
import datetime
import enum
import hashlib
import json
import logging
import queue
import threading
import time
from typing import Any, Callable, Optional, Sequence

import torch

from worker import datapath, transfer
from worker.dtensor import is_dtensor, local_shard
from worker.step_hooks import StepHooks
from worker.step_ledger import params_of
from worker.transfer import TransferRefused

log = logging.getLogger("worker.precopy")

LEAVER, JOINER = 0, 1  # ranks in a migration's 2-rank transfer group
# the joiner's 1-byte confirmation that it loaded the tail: a tag no transfer message uses (worker.transfer's
# 0 and 1, worker.datapath's reply 1 and chunks FIRST_CHUNK_TAG .. FIRST_CHUNK_TAG + MAX_CHUNKS - 1)
DELIVERED_TAG = datapath.FIRST_CHUNK_TAG + datapath.MAX_CHUNKS
DELIVERY_TIMEOUT_S = 60.0  # a leaver waits this long for the joiner's confirmation that it loaded the tail
CONFIRM_TIMEOUT_S = 5.0  # a joiner waits this long for the leaver to take that confirmation
PACK_TIMEOUT_S = 2.0  # a post-hook waits this long for its gradients to be packed, then stops replaying that optimizer
#                       (in the last step: for their send to begin, then has a copy sent)


class Kind(enum.StrEnum):
    """What a transfer message of a migration carries (``extra["kind"]``)."""
    FULL = "full"  # the whole state at the switch step (no pre-copy)
    PRECOPY = "precopy"  # the whole state at an earlier boundary
    GRADS = "grads"  # one optimizer step's gradients, to replay
    TAIL = "tail"  # at the switch step: what the replay does not give the joiner


def replayable_class(obj: Any) -> bool:
    """Whether ``obj`` is an optimizer whose step the joiner may run itself: one of ``torch.optim``'s own
    (their steps issue no collective; a hooked class ``step`` exposes the unhooked function)."""
    return isinstance(obj, torch.optim.Optimizer) and type(obj).__module__.startswith("torch.optim.") \
        and getattr(type(obj).step, "__wrapped__", None) is not None


def flatten(state: Any) -> tuple[list, str]:
    """``state`` (a state_dict) as (its leaves, its structure). The leaves: every tensor and every other value that
    is not a mapping, list or tuple, depth first (a mapping's values in its order, a sequence's items in order).
    The structure: a prefix code of the containers, as compact JSON text (a list): each node is its tag (``"d"`` a
    dict or other mapping, ``"o"`` an OrderedDict, ``"c"`` a collections.Counter, ``"l"`` a list, ``"t"`` a tuple,
    ``"v"`` a leaf that is not a tensor, or a tensor's dtype, ``"torch.float32"``, then its number of dimensions and
    its sizes); a container's tag is followed by its length and its items (a mapping's as key, then value; a key
    that is not a str or int as worker.transfer encodes it). Two states of the same structure differ at most in
    their leaves' values; a mapping's ``_metadata`` is not part of it. :func:`rebuild` makes a state from a
    structure and leaves. Raises TypeError for a mapping key worker.transfer cannot encode."""
    leaves: list = []
    spec: list = []

    def walk(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            spec.append(str(value.dtype))
            spec.append(value.dim())
            spec.extend(value.shape)
            leaves.append(value)
        elif isinstance(value, dict):
            kind = type(value)
            spec.append("o" if kind is collections.OrderedDict else "c" if kind is collections.Counter else "d")
            spec.append(len(value))
            for k, v in value.items():
                spec.append(k if type(k) is str or type(k) is int else transfer.encode(k, _no_tensor_key))
                walk(v)
        elif type(value) is list or type(value) is tuple:
            spec.append("l" if type(value) is list else "t")
            spec.append(len(value))
            for v in value:
                walk(v)
        else:
            spec.append("v")
            leaves.append(value)

    walk(state)
    return leaves, json.dumps(spec, separators=(",", ":"))


def _no_tensor_key(t: torch.Tensor) -> Any:
    raise TypeError("a tensor as a state_dict key")


def unflatten(state: Any, leaves: list) -> Any:
    """``state`` with its leaves (:func:`flatten`'s) replaced by ``leaves``, in order. Containers are rebuilt: a
    dict or OrderedDict as its own type (another mapping as a dict) with its ``_metadata``, a list or tuple as
    itself."""
    it = iter(leaves)

    def walk(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return next(it)
        if isinstance(value, dict):
            out = type(value)() if type(value) in transfer.MAPPINGS else {}
            for k, v in value.items():
                out[k] = walk(v)
            metadata = getattr(value, "_metadata", None)
            if metadata is not None:
                out._metadata = metadata  # type: ignore[attr-defined]
            return out
        if type(value) is list or type(value) is tuple:
            return type(value)(walk(v) for v in value)
        return next(it)

    return walk(state)


def _key(t: torch.Tensor) -> tuple:
    """Where a tensor's values live: a state_dict's detached view of a parameter has the parameter's key (its
    first element's address, shape, strides, dtype and device; a DTensor's local shard's)."""
    t = local_shard(t)
    return t.data_ptr(), t.shape, t.stride(), t.dtype, t.device


def _optimizer_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """An optimizer's parameters and every tensor of its per-parameter state."""
    out = params_of(opt)
    for p in list(out):
        for v in opt.state.get(p, {}).values():
            if isinstance(v, torch.Tensor):
                out.append(v)
    return out


def _plain(t: Any) -> bool:
    """A dense tensor, or a DTensor whose local shard is one: what replay tracks and moves."""
    if is_dtensor(t):
        t = local_shard(t)
    return type(t) in (torch.Tensor, torch.nn.Parameter) and t.layout == torch.strided


def _version(t: torch.Tensor) -> Any:
    """``t``'s version counter; a DTensor's with its local shard's (an in-place op on the DTensor bumps the first,
    one on its local shard the second)."""
    return (t._version, local_shard(t)._version) if is_dtensor(t) else t._version


def _placed(t: torch.Tensor) -> Any:
    """A DTensor's mesh and placements (None for a plain tensor)."""
    return (t.device_mesh, tuple(t.placements)) if is_dtensor(t) else None


@dataclasses.dataclass
class _Seen:
    tensor: torch.Tensor  # held, so its memory cannot hold another tensor while tracked
    version: Any  # _version()
    owner: str  # the managed optimizer's name


class _Fixed:
    """A state that is already a state_dict (what send_state asks ``state_dict()`` of)."""

    def __init__(self, state: Any) -> None:
        self.state = state

    def state_dict(self) -> Any:
        return self.state

    def load_state_dict(self, state: Any) -> None:  # never loaded: only sent
        raise NotImplementedError


@dataclasses.dataclass
class _Job:
    run: Callable[["_Job"], None]  # sends; sets ``packed`` once the tensors it reads may change
    packed: threading.Event = dataclasses.field(default_factory=threading.Event)
    in_place: bool = False  # the tensors are sent unpacked: ``packed`` is set once they are sent
    tensors: list = dataclasses.field(default_factory=list)  # what a gradient job sends (see Precopy._after_step)
    started: bool = False  # the sender thread began to run it (under ``lock``)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def copy_unless_started(self) -> bool:
        """An in-place job the sender has not begun yet sends private copies of its tensors instead, so that the
        caller may change the originals from now on. Returns False (nothing copied) once the sender began."""
        with self.lock:
            if self.started:
                return False
            self.tensors = [t.detach().clone() if isinstance(t, torch.Tensor) else t for t in self.tensors]
            return True

    def begin(self) -> None:
        """The sender thread is about to run it: from now on its tensors are read as they are."""
        with self.lock:
            self.started = True


class Precopy:
    """The leaver's side (see the module docstring): :meth:`start` at a boundary before the switch step,
    :meth:`finish` at it, :meth:`cancel` when the migration was aborted first. ``objects``: the managed objects
    by name; ``keys``: the job's keys (default: env ``TM_KEYS``); ``ops_issued()``: how many collectives the job's
    process groups issued so far (worker.groups.GroupManager.ops_issued; None: no DTensor optimizer is replayed,
    since a step that communicates could not be told from one that does not); ``hooks``: the session's pipeline of
    optimizer step hooks, where the pre-copy's take their place (worker.step_hooks; default: one of its own)."""

    def __init__(self, pg: Any, migration_id: int, objects: dict[str, Any], keys: Any = None,
                 ops_issued: Optional[Callable[[], int]] = None, hooks: Optional[StepHooks] = None) -> None:
        self.pg = pg
        self.migration_id = migration_id
        self.objects = objects
        self.keys = keys
        self.step: Optional[int] = None  # the boundary the pre-copy was taken at (set by start)
        self.off: dict[str, str] = {}  # optimizer name -> why its tensors travel in the tail
        self.ops_issued = ops_issued
        self._ops_before: Optional[int] = None  # ops_issued() as the current step's update began
        self.optimizers = {}
        for name, o in objects.items():
            if isinstance(o, torch.optim.Optimizer):
                why = "" if replayable_class(o) else "not one of torch.optim's optimizers"
                why = why or ("" if all(_plain(p) for p in params_of(o)) else "its parameters are not dense tensors "
                                                                            "or DTensors of dense shards")
                why = why or ("" if ops_issued is not None or not any(map(is_dtensor, params_of(o)))
                              else "its parameters are DTensors and no count of collectives is available")
                if why:
                    self._turn_off(name, why)
                else:
                    self.optimizers[name] = o
        self._names = {id(o): name for name, o in self.optimizers.items()}
        self.seen: dict[tuple, _Seen] = {}
        self.replayed: dict[str, int] = {name: 0 for name in self.optimizers}  # steps queued for replay
        self.moved = 0  # bytes
        self.kept = 0  # tensors the tail sent as references
        self.sent = 0  # tensors the tail sent by value
        self.error: Optional[BaseException] = None
        self._snapshot = _Job(lambda job: None)  # the pre-copy's (set by start)
        self._grads: Optional[_Job] = None  # the current step's
        self._jobs: queue.Queue = queue.Queue()
        self._pipeline = hooks if hooks is not None else StepHooks()
        self._hooked = False  # the pre-copy's stages are in the pipeline (start .. finish or cancel)
        self.in_place = False  # send gradients unpacked (the last step before the switch; see last_step)
        self._thread = threading.Thread(target=self._run, name="tm-precopy", daemon=True)
        self._delivery: Any = None  # the pending receive of the joiner's confirmation (see delivered())

    # --- the training thread ---------------------------------------------------------------------------------------
    def start(self, step: int) -> None:
        """At the boundary before ``step`` (< the switch step): queue the pre-copy and hook the optimizers."""
        self.step = step
        for opt in self.optimizers.values():  # last before the update, first after it: see the module docstring
            self._pipeline.attach_precopy(opt, self._before_step, self._after_step)
        self._hooked = True
        for name, opt in self.optimizers.items():  # before packing: a change during it shows in the versions
            self._track(name, opt)
        # state_dict() here, on the training thread (FSDP2's switches its module between sharded and unsharded
        # parameters: not while the forward pass runs); the sender thread packs the tensors it references
        states = {name: _Fixed(obj.state_dict()) for name, obj in self.objects.items()}
        self._snapshot = _Job(lambda job: self._send_state(job, states))
        self._thread.start()
        self._jobs.put(self._snapshot)

    def last_step(self) -> None:
        """At the boundary before the last step before the switch step: from now on each optimizer step's
        gradients are sent as they are, not packed first, and its post-hook waits until they are sent (at most
        ``DELIVERY_TIMEOUT_S`` seconds, then that optimizer is not replayed), unless the sender has not begun
        that send within ``PACK_TIMEOUT_S`` seconds: the post-hook then copies them, the copy is sent and the
        post-hook returns. Earlier steps pack them, so that the leaver goes on training while they travel."""
        self.in_place = True

    def finish(self, step: int, rng: torch.Tensor) -> tuple[int, float]:
        """At the boundary before the switch step ``step``: wait for what is queued, send the tail (with
        ``rng``, the CPU RNG state). Returns (bytes moved in all, seconds this call took: the stayers' wait).
        Raises what the sender thread or the send raised (RuntimeError when the joiner died)."""
        t0 = time.perf_counter()
        self._unhook()
        try:
            # Built while the sender may still be sending the last gradients (the joiner replays them meanwhile):
            # the versions compared were taken by the post-hooks, all run by now, and nothing here changes a tensor.
            tail = {name: _Fixed(self._tail_state(name, obj)) for name, obj in self.objects.items()}
            self._jobs.join()
            if self.error is not None:
                raise self.error
            moved, _ = transfer.send_state(self.pg, tail, {"kind": Kind.TAIL.value, "step": step, "rng": rng},
                                           keys=self.keys)
            self.moved += moved
            self._delivery = self.pg.recv([torch.zeros(1, dtype=torch.uint8)], JOINER, DELIVERED_TAG)  # delivered()
        finally:
            self._jobs.put(None)
        log.info("pre-copy of migration %d: tail of %d bytes in %.1f ms (%d tensors kept, %d sent; not replayed: "
                 "%s)", self.migration_id, moved, (time.perf_counter() - t0) * 1e3, self.kept, self.sent,
                 self.off or "none")
        return self.moved, time.perf_counter() - t0

    def delivered(self, timeout_s: float = DELIVERY_TIMEOUT_S) -> None:
        """After :meth:`finish`: block until the joiner says it loaded the tail (a 1-byte message it sends once
        loaded), at most ``timeout_s`` seconds. A leaver calls this before it exits: the commit may be decided
        before the tail left (worker.migration), and a process that exits while its last bytes are still in
        flight can lose them. Raises RuntimeError when the joiner died or did not answer in time."""
        if self._delivery is None:
            raise RuntimeError("no tail was sent")
        if not self._delivery.wait(datetime.timedelta(seconds=timeout_s)):
            raise RuntimeError(f"the joiner did not confirm the tail within {timeout_s:.0f} s")

    def cancel(self) -> None:
        """The migration ended without a switch (aborted): unhook; the sender thread stops on its own (a send to
        a joiner that exited fails)."""
        self._unhook()
        self._jobs.put(None)

    def _unhook(self) -> None:
        if self._hooked:
            for opt in self.optimizers.values():
                self._pipeline.detach_precopy(opt)
        self._hooked = False

    def _before_step(self, opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        name = self._names[id(opt)]
        self._snapshot.packed.wait()  # normally long done: the forward and backward passes ran since
        self._grads = None
        if name in self.off or self.error is not None:
            return
        why = self._unreplayable(name, opt, args, kwargs)
        if why:
            self._turn_off(name, why)
            return
        grads = [p.grad for p in params_of(opt)]
        groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]  # a scheduler's lr...
        job = self._grads = _Job(lambda job: self._send_grads(job, name, groups), in_place=self.in_place,
                                 tensors=grads)
        self.replayed[name] += 1
        self._jobs.put(job)
        self._ops_before = self.ops_issued() if self.ops_issued is not None else None

    def _after_step(self, opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        name = self._names[id(opt)]
        job, self._grads = self._grads, None
        if job is None:
            return
        # Once the gradients are copied the script may zero them. The sender packs them right away unless it is
        # still sending something earlier (a slow link, a stopped joiner): then stop replaying (the tail sends that
        # optimizer's tensors by value), never stall here. In the last step, wait until they are sent, as long
        # as their send goes on; one the sender has not begun within PACK_TIMEOUT_S sends a copy made here.
        if job.in_place:
            sent = job.packed.wait(PACK_TIMEOUT_S) or job.copy_unless_started() \
                or job.packed.wait(DELIVERY_TIMEOUT_S - PACK_TIMEOUT_S)
            if not sent:
                self._turn_off(name, f"its gradients' send took over {DELIVERY_TIMEOUT_S:.0f} s")
        elif not job.packed.wait(PACK_TIMEOUT_S):
            self._turn_off(name, f"its gradients were not packed within {PACK_TIMEOUT_S:.0f} s (the sender is "
                                 "behind)")
        if self._ops_before is not None and self.ops_issued() != self._ops_before:  # the joiner's replay of this
            self._turn_off(name, "its step issued collectives")  # step would have had them answered from records
        if name not in self.off:
            self._track(name, opt)

    def _turn_off(self, name: str, why: str) -> None:
        self.off[name] = why
        log.warning("migration %d: optimizer %r is not replayed by the joiner (%s): its tensors move at the switch "
                    "step", self.migration_id, name, why)

    def _unreplayable(self, name: str, opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> str:
        if any(a is not None for a in args[1:]) or any(v is not None for v in kwargs.values()):  # args[0]: opt
            return "its step takes a closure"
        if not self._pipeline.precopy_in_place(opt):
            return "a step hook was registered after the pre-copy started"
        for p in params_of(opt):
            if not _plain(p) or (p.grad is not None and (not _plain(p.grad) or p.grad.shape != p.shape
                                                          or _placed(p.grad) != _placed(p))):
                return "a parameter or gradient is not a dense tensor, or a gradient is placed unlike its parameter"
        for t in _optimizer_tensors(opt):
            seen = self.seen.get(_key(t)) if _plain(t) else None
            if seen is None or seen.owner != name or seen.version != _version(t):
                return "its parameters or state changed outside its step"
        return ""

    def _track(self, name: str, opt: torch.optim.Optimizer) -> None:
        for t in _optimizer_tensors(opt):
            if _plain(t):  # (another tensor subclass would make the next check fail: replay then turns off)
                self.seen[_key(t)] = _Seen(t, _version(t), name)

    def _tail_state(self, name: str, obj: Any) -> dict:
        """``obj``'s state_dict as a tail (see :func:`load_tail`): its structure (:func:`flatten`) and leaf count, and by
        value only the leaves that the joiner's replay did not make identical: the tensors at positions ``sent``
        among the leaves, and every leaf that is not a tensor (``values``, in order)."""
        leaves, structure = flatten(obj.state_dict())
        sent, values = [], []
        for at, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor):
                seen = self.seen.get(_key(leaf)) if _plain(leaf) else None
                if seen is not None and seen.owner not in self.off and seen.version == _version(leaf):
                    self.kept += 1
                    continue
                self.sent += 1
                sent.append(at)
            values.append(leaf)
        return {"structure": structure, "leaves": len(leaves), "sent": sent, "values": values}

    # --- the sender thread -----------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                if self.error is None:
                    job.begin()
                    job.run(job)
            except BaseException as e:  # noqa: BLE001 - finish() raises it on the training thread
                self.error = e
                log.warning("pre-copy of migration %d failed: %s: %s", self.migration_id, type(e).__name__, e)
            finally:
                if job is not None:
                    job.packed.set()
                self._jobs.task_done()

    def _send_state(self, job: _Job, states: dict[str, _Fixed]) -> None:
        moved, _ = transfer.send_state(self.pg, states, {"kind": Kind.PRECOPY.value, "step": self.step},
                                       keys=self.keys, on_packed=job.packed.set)
        self.moved += moved

    def _send_grads(self, job: _Job, name: str, groups: list) -> None:
        # in place: ``packed`` is set once sent (by _run)
        moved, _ = transfer.send_state(self.pg, {"grads": _Fixed({"grads": job.tensors, "groups": groups})},
                                       {"kind": Kind.GRADS.value, "optimizer": name}, keys=self.keys,
                                       on_packed=None if job.in_place else job.packed.set)
        self.moved += moved


# --- the joiner ----------------------------------------------------------------------------------------------------
_TAIL_FIELDS = {"structure", "leaves", "sent", "values"}


def load_tail(objects: dict[str, Any], states: dict[str, Any]) -> None:
    """Load a tail (as received: each managed object's ``{"structure", "leaves", "sent", "values"}``, see
    ``Precopy._tail_state``) into the joiner's ``objects``. An object whose own state_dict has the leaver's structure
    (:func:`flatten`'s, tensors' dtypes and shapes included) and leaf count keeps its tensors but at the ``sent``
    positions, which take the received tensors, and its other leaves take the received values; another is loaded
    whole from the leaver's structure (:func:`rebuild`).
    An object whose leaves all stay as they are is not loaded at all (the demo's case). An optimizer whose changes
    all lie in its parameter groups' hyperparameters (a scheduler's learning rate: the usual case) has them set as
    a replayed step sets them, without a ``load_state_dict`` (which copies every group and visits every state
    tensor). Everything is checked before the first object is loaded: raises KeyError if the sets of objects
    differ, TransferRefused for a tail of another structure or a malformed one, and what
    :func:`worker.transfer.load_state` raises."""
    if set(states) != set(objects):
        raise KeyError(f"managed objects differ: local {sorted(objects)}, received {sorted(states)}")
    loads, hyperparameters = [], []
    for name, obj in objects.items():
        own = obj.state_dict()
        leaves, structure = flatten(own)
        tail = states[name]
        if type(tail) is not dict or set(tail) != _TAIL_FIELDS:
            raise TransferRefused(f"{name}: malformed tail {transfer._short(tail)}")
        if type(tail["structure"]) is not str or type(tail["leaves"]) is not int or tail["structure"] != structure \
                or tail["leaves"] != len(leaves):
            # Not the joiner's structure (a list that grew on the leaver since the pre-copy, a dict with other
            # keys): the state is made from the leaver's structure and loaded whole.
            loads.append((name, obj, own, rebuild(name, tail, own)))
            continue
        changed = _tail_leaves(name, tail, leaves)
        if changed is None:
            continue
        new, first = changed
        groups = _changed_groups(obj, own, new, first)
        if groups is not None:
            hyperparameters.append((obj, groups))
        else:
            loads.append((name, obj, own, unflatten(own, new)))
    for obj, groups in hyperparameters:
        _set_hyperparameters(obj, groups)
    for name, obj, own, state in loads:
        if isinstance(obj, torch.nn.Module) and isinstance(state, dict):
            placed = transfer.place_shards(name, obj, state)  # the same keys as own's (else KeyError)
            obj.load_state_dict({k: v for k, v in placed.items() if v is not own[k]}, strict=False)
        else:
            transfer.load_state({name: obj}, {name: state})


def _tensor_layout(state: Any, path: tuple = (), out: Optional[dict] = None) -> dict:
    """{path: (dtype, shape)} of every tensor in ``state`` (a DTensor's or received shard's global shape)."""
    out = {} if out is None else out
    if isinstance(state, transfer.ReceivedShard):
        out[path] = (state.local.dtype, tuple(state.shape))
    elif isinstance(state, torch.Tensor):
        out[path] = (state.dtype, tuple(state.shape))
    elif isinstance(state, dict):
        for k, v in state.items():
            _tensor_layout(v, path + (k,), out)
    elif isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            _tensor_layout(v, path + (i,), out)
    return out


def check_tensors(objects: dict[str, Any], states: dict[str, Any]) -> None:
    """After a joiner loaded the leaver's ``states`` into ``objects``: every tensor the leaver sent must stand at
    the same path of the object's own state_dict with the same dtype and shape (a module's load_state_dict casts
    another dtype silently; a custom object may keep its own tensors). Called before the joiner reports
    ``transferred``, so such a joiner is refused while the migration can still abort; the tail then never has to
    refuse a state for its tensors (:func:`rebuild`). Raises TransferRefused."""
    for name, obj in objects.items():
        mine = _tensor_layout(obj.state_dict())
        for path, theirs in _tensor_layout(states[name]).items():
            if mine.get(path) != theirs:
                here = "none" if path not in mine else f"{mine[path][0]} {list(mine[path][1])}"
                raise TransferRefused(f"{name}: the tensor at {_path(path)} is {theirs[0]} {list(theirs[1])} on "
                                      f"the leaver, {here} on this joiner after loading it; state refused")


def _set_hyperparameters(opt: torch.optim.Optimizer, groups: list) -> None:
    """Set each of ``opt``'s parameter groups' values to ``groups``' (one dict per group; its ``params``, where
    present, are left as they are): what a replayed step and a tail's new learning rate both do."""
    for new, group in zip(groups, opt.param_groups):
        group.update((k, v) for k, v in new.items() if k != "params")


def _changed_groups(obj: Any, own: Any, new: list, first: int) -> Optional[list]:
    """Optimizer ``obj``'s parameter groups as its state_dict ``own`` with ``new`` leaves holds them, when every
    changed leaf (from position ``first``) lies in those groups and their parameter lists are as they were; else
    None (the optimizer is then loaded whole)."""
    if not isinstance(obj, torch.optim.Optimizer) or type(own) is not dict or list(own) != ["state", "param_groups"]:
        return None
    at = len(new) - len(flatten(own["param_groups"])[0])  # param_groups' leaves come last
    if first < at:
        return None
    groups = unflatten(own["param_groups"], new[at:])
    if any(type(g) is not dict or g.get("params") != o.get("params") for g, o in zip(groups, own["param_groups"])):
        return None
    return groups


def _tail_leaves(name: str, tail: dict, leaves: list) -> Optional[tuple[list, int]]:
    """The leaves object ``name`` takes from its ``tail``, whose structure is its own (its own ``leaves`` where kept),
    and the position of the first that differs from its own, or None when they are all its own already. Raises
    TransferRefused."""
    sent, values = _sent_and_values(name, tail, len(leaves))
    if any(not isinstance(leaves[at], torch.Tensor) for at in sent):
        raise TransferRefused(f"{name}: bad positions of sent tensors {transfer._short(sent)} in the tail")
    sent_at = set(sent)
    new, given, first = [], iter(values), None
    for at, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor) and at not in sent_at:
            new.append(leaf)  # kept: the replay made it identical
            continue
        value = _given(name, given, values, isinstance(leaf, torch.Tensor))
        if isinstance(leaf, torch.Tensor) and (tuple(value.shape) != tuple(leaf.shape) or (
                value.local if isinstance(value, transfer.ReceivedShard) else value).dtype != leaf.dtype):
            raise TransferRefused(f"{name}: a sent tensor of another dtype or shape than this joiner's at leaf {at}")
        if first is None and not _same(value, leaf):
            first = at
        new.append(value)
    if next(given, given) is not given:
        raise TransferRefused(f"{name}: the tail carries {len(values)} values, more than its structure holds")
    return None if first is None else (new, first)


def _sent_and_values(name: str, tail: dict, leaves: int) -> tuple[list, list]:
    """A tail's ``sent`` positions (increasing, below ``leaves``) and its ``values``, checked. Raises
    TransferRefused."""
    sent, values = tail["sent"], tail["values"]
    if type(sent) is not list or type(values) is not list or any(
            type(at) is not int or not 0 <= at < leaves or (i and at <= sent[i - 1]) for i, at in enumerate(sent)):
        raise TransferRefused(f"{name}: bad positions of sent tensors {transfer._short(sent)} in the tail")
    return sent, values


def _given(name: str, given: Any, values: list, tensor: bool) -> Any:
    """The tail's next value (``given``: an iterator over ``values``), a tensor (or received shard) if ``tensor``,
    else a leaf that is neither. Raises TransferRefused."""
    value = next(given, given)
    if value is given:
        raise TransferRefused(f"{name}: the tail carries {len(values)} values, fewer than its structure holds")
    if tensor != isinstance(value, (torch.Tensor, transfer.ReceivedShard)):
        raise TransferRefused(f"{name}: a tensor where the tail's structure holds a value, or the reverse")
    if isinstance(value, (dict, list, tuple)):  # flatten never leaves a container as a leaf
        raise TransferRefused(f"{name}: a container {transfer._short(value)} where a leaf belongs")
    return value


def rebuild(name: str, tail: dict, own: Any) -> Any:
    """Object ``name``'s state as the leaver's ``tail`` describes it, when its structure is not this joiner's
    ``own`` state_dict's (plain values may change shape from step to step: a history list that grows, a dict of
    other keys): the containers of the tail's structure (:func:`flatten`), its values, its sent tensors, and for
    every tensor the leaver did not send (the replay made it identical), this joiner's own tensor at the same
    path, which must be of the dtype and shape the structure gives. An OrderedDict takes the ``_metadata`` of
    this joiner's at the same path. Raises TransferRefused, with nothing loaded."""
    try:
        spec = json.loads(tail["structure"]) if type(tail["structure"]) is str else None
    except ValueError:
        spec = None
    if type(spec) is not list or type(tail["leaves"]) is not int:
        raise TransferRefused(f"{name}: malformed structure in the tail")
    sent, values = _sent_and_values(name, tail, tail["leaves"])
    sent_at, given, at, leaf = set(sent), iter(values), 0, 0

    def item() -> Any:
        nonlocal at
        if at >= len(spec):
            raise TransferRefused(f"{name}: the tail's structure ends early")
        at += 1
        return spec[at - 1]

    def count() -> int:
        n = item()
        if type(n) is not int or n < 0:
            raise TransferRefused(f"{name}: bad length {transfer._short(n)} in the tail's structure")
        return n

    def walk(mine: Any, path: tuple, depth: int) -> Any:
        nonlocal leaf
        if depth > transfer.MAX_DEPTH:
            raise TransferRefused(f"{name}: the tail's structure is nested deeper than {transfer.MAX_DEPTH} levels")
        tag = item()
        if tag in ("d", "o", "c"):
            out = {} if tag == "d" else collections.OrderedDict() if tag == "o" else collections.Counter()
            for _ in range(count()):
                key = item()
                if type(key) not in (str, int):
                    key = transfer.decode(key, transfer._no_tensor)
                    try:
                        hash(key)
                    except TypeError:
                        raise TransferRefused(f"{name}: bad key {transfer._short(key)} in the tail's structure") \
                            from None
                out[key] = walk(mine.get(key) if isinstance(mine, dict) else None, path + (key,), depth + 1)
            if tag == "o" and getattr(mine, "_metadata", None) is not None:
                out._metadata = mine._metadata  # type: ignore[attr-defined]
            return out
        if tag in ("l", "t"):
            items = [walk(mine[i] if type(mine) in (list, tuple) and i < len(mine) else None, path + (i,), depth + 1)
                     for i in range(count())]
            return items if tag == "l" else tuple(items)
        if tag == "v":
            if leaf in sent_at:
                raise TransferRefused(f"{name}: bad positions of sent tensors {transfer._short(sent)} in the tail")
            leaf += 1
            return _given(name, given, values, False)
        if type(tag) is not str or tag.removeprefix("torch.") not in _DTYPE_NAMES:
            raise TransferRefused(f"{name}: bad node {transfer._short(tag)} in the tail's structure")
        shape = [count() for _ in range(count())]
        position, leaf = leaf, leaf + 1
        value = _given(name, given, values, True) if position in sent_at else mine
        if position not in sent_at and not isinstance(value, torch.Tensor):
            raise TransferRefused(f"{name}: the leaver kept its tensor at {_path(path)}, where this joiner holds "
                                  "none (another structure); state refused")
        dtype = value.local.dtype if isinstance(value, transfer.ReceivedShard) else value.dtype
        if str(dtype) != tag or list(value.shape) != shape:
            raise TransferRefused(f"{name}: the tensor at {_path(path)} is {tag} {shape} on the leaver, "
                                  f"{dtype} {list(value.shape)} here (another structure); state refused")
        return value

    state = walk(own, (), 0)
    if at != len(spec) or leaf != tail["leaves"] or next(given, given) is not given:
        raise TransferRefused(f"{name}: the tail's structure, leaf count and values do not agree")
    return state


_DTYPE_NAMES = {str(d).removeprefix("torch.") for d in transfer.DTYPES.values()}


def _path(path: tuple) -> str:
    return "/".join(map(str, path)) or "its top"


def _same(a: Any, b: Any) -> bool:
    """Whether leaf ``a`` is leaf ``b``: tensors by identity, other values by type and equality."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    return type(a) is type(b) and a == b


def _replay(objects: dict[str, Any], name: Any, state: Any) -> None:
    """Run managed optimizer ``name``'s step with the leaver's gradients ``state["grads"]`` (one per parameter,
    in param_groups order, None where the leaver had none; a DTensor parameter's as a worker.transfer.ReceivedShard,
    made a DTensor of the parameter's own mesh and placements) and hyperparameters ``state["groups"]`` (each param
    group's values but its parameters: what a scheduler changed since), hooks bypassed. Each parameter's ``.grad``
    is then put back as it was (the joiner's own, from its shadow iterations): a step of a script that calls
    ``zero_grad()`` after ``optimizer.step()`` would otherwise add its gradients to the replayed ones. Raises
    TransferRefused."""
    opt = objects.get(name) if type(name) is str else None
    if opt is None or not replayable_class(opt):
        raise TransferRefused(f"gradients for {name!r}, which is not a replayable managed optimizer")
    params = params_of(opt)
    grads = state.get("grads") if type(state) is dict else None
    groups = state.get("groups") if type(state) is dict else None
    if type(grads) is not list or len(grads) != len(params):
        raise TransferRefused(f"{name}: gradients for {len(params)} parameters expected")
    if type(groups) is not list or len(groups) != len(opt.param_groups) or any(
            type(new) is not dict or set(new) != set(g) - {"params"} for new, g in zip(groups, opt.param_groups)):
        raise TransferRefused(f"{name}: hyperparameters of {len(opt.param_groups)} parameter groups expected")
    grads = [_as_gradient(name, i, p, g) for i, (p, g) in enumerate(zip(params, grads))]
    own = [p.grad for p in params]  # what this joiner's own steps left there (None after a zero_grad)
    for p, g in zip(params, grads):
        p.grad = g
    _set_hyperparameters(opt, groups)
    try:
        type(opt).step.__wrapped__(opt)
    finally:  # a script that zeroes its gradients after the step must find none left by the replay
        for p, g in zip(params, own):
            p.grad = g


def _as_gradient(name: str, i: int, p: torch.Tensor, g: Any) -> Optional[torch.Tensor]:
    """The received gradient ``g`` of optimizer ``name``'s ``i``-th parameter ``p``, as ``p.grad`` takes it.
    Raises TransferRefused where it does not fit."""
    if g is None:
        return None
    if isinstance(g, transfer.ReceivedShard) and is_dtensor(p):
        if g.local.dtype != p.dtype:
            raise TransferRefused(f"{name}: gradient {i} is {g.local.dtype}, its parameter {p.dtype}")
        return transfer._wrap(g, p, ("grads", i), name)  # checks shape, placements, mesh and local shape
    if not isinstance(g, torch.Tensor) or is_dtensor(p) or g.shape != p.shape or g.dtype != p.dtype:
        raise TransferRefused(f"{name}: gradient {i} does not fit its parameter ({list(p.shape)} {p.dtype})")
    return g


def _confirm(pg: Any, timeout_s: float = CONFIRM_TIMEOUT_S) -> None:
    """Tell the leaver the tail is loaded (it may now exit; :meth:`Precopy.delivered`). Only the leaver waits
    for this: a leaver that never takes it (it failed after sending the tail) costs the joiner ``timeout_s``
    seconds at most, then a warning."""
    try:
        pg.send([torch.ones(1, dtype=torch.uint8)], LEAVER, DELIVERED_TAG).wait(datetime.timedelta(seconds=timeout_s))
    except RuntimeError as e:
        log.warning("the leaver did not take the tail's confirmation: %s", e)


def gradient_buffers(objects: dict[str, Any]) -> list[torch.Tensor]:
    """Touched receive buffers for the gradients of every replayable managed optimizer of ``objects``: for each,
    the flat buffers (one per dtype and device; a DTensor parameter's local shard) that a message of its
    parameters' gradients fills (worker.transfer.plan_buffers, with the joiner's own parameters standing for the
    leaver's gradients). Allocated (bytes: the parameters' size) and page-faulted at the end of a joiner's
    warm-up (worker.migration), so the last step's gradients, which the stayers wait for at the switch step, land
    in memory that is already mapped (6-8 ms of CPU for the demo GPT's 13 MB on this machine). A message whose
    layout differs (a parameter without a gradient, a tensor learning rate) gets fresh buffers instead."""
    out: list[torch.Tensor] = []
    for obj in objects.values():
        if isinstance(obj, torch.optim.Optimizer) and replayable_class(obj):
            out.extend(transfer.pretouch(transfer.plan_buffers({"grads": _Fixed({"grads": params_of(obj)})})))
    return out


def follow(pg: Any, objects: dict[str, Any], buffers: Optional[list[torch.Tensor]] = None,
           grad_buffers: Sequence[torch.Tensor] = (), keys: Any = None,
           on_precopy: Optional[Callable[[int, float], None]] = None) -> tuple[dict, int, float]:
    """The joiner's side: receive the leaver's messages until the last one (a ``full`` state, or a pre-copy,
    its replayed optimizer steps and the tail), loading and replaying as they come. ``buffers``: pre-touched
    receive buffers for the first message (the list is emptied once that message is loaded); ``grad_buffers``:
    for every replayed step's gradients (:func:`gradient_buffers`; a step's gradients are garbage once replayed,
    so every step uses them again).
    ``on_precopy(bytes, seconds)`` is called once a pre-copy is loaded (its size and receive time; not for a
    ``full`` state). After the tail, the leaver is told it was loaded
    (:meth:`Precopy.delivered`). Returns (the last message's extra: ``step``, ``rng``; bytes moved in all; seconds
    the last message took from its first byte). Raises TransferRefused (a message out of order, a reference or
    gradient that does not fit), the errors of worker.transfer.recv_state and load_state, and RuntimeError when
    the leaver died."""
    states, extra, moved, seconds = transfer.recv_state(pg, LEAVER, buffers, keys=keys)
    kind = extra.get("kind") if type(extra) is dict else None
    if kind not in (Kind.FULL, Kind.PRECOPY):
        raise TransferRefused(f"a migration's first message must be a full state or a pre-copy, not {kind!r}")
    transfer.load_state(objects, states)
    check_tensors(objects, states)  # before ``transferred``: a tail can no longer be refused for its tensors
    del states
    if buffers is not None:  # what was loaded by copy is garbage now: free it before the switch step, not in it
        buffers.clear()
    if kind == Kind.PRECOPY and on_precopy is not None:
        on_precopy(moved, seconds)
    while kind != Kind.FULL:
        # A gradient message's tensors are garbage once replayed; the tail's may be kept by what loads them (an
        # optimizer's load_state_dict keeps the tensors it is given), but no message follows the tail.
        states, extra, m, seconds = transfer.recv_state(pg, LEAVER, list(grad_buffers), keys=keys)
        moved += m
        kind = extra.get("kind") if type(extra) is dict else None
        if kind == Kind.GRADS:
            _replay(objects, extra.get("optimizer"), states.get("grads"))
        elif kind == Kind.TAIL:
            load_tail(objects, states)
            _confirm(pg)
            break
        else:
            raise TransferRefused(f"unexpected message {kind!r} after a pre-copy")
    return extra, moved, seconds

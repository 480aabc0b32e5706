"""Buddy snapshots: in-memory redundancy for state that has no replica on another node.

Recovery from a data-parallel replica (worker.recovery) needs a copy of a lost rank's state on another node. Pure
FSDP, tensor parallel across nodes or a pipeline stage with no data-parallel copy leave some rank's state with no
such copy. For those layouts every rank keeps, in host memory, a snapshot of its own state and a copy of one peer
node's rank's snapshot (its *buddy*: ``tmd.protocol.layout.snapshot_keepers``, a ring over the nodes), in the
manner of in-memory checkpointing (Gemini, SOSP'23; Oobleck, SOSP'23). After a failure the whole job rolls back
to the last snapshot every rank holds: each survivor restores its own copy, each lost rank's replacement receives
the copy its keeper holds, and the steps since are redone with the same data and RNG, so the final state is
bit-identical to an uninterrupted run.

**When.** Snapshots are on when tmd's ``Assign.snapshot_every`` K > 0 and, from the job's first step, some rank's
replica class lies on one node (every rank computes the same from the first exchange). A snapshot of step S is taken
as step S + 1 starts (after S committed, and after what steps after the optimizer, an LR scheduler) where
``S % K == K - 1``, at the job's last recorded step (``record_steps - 1``: a failure before that ends the job
anyway, and a failure after it then finds a snapshot without waiting for step K - 1), and after the first commit
after a migration or recovery (a rank that joined or recovered asks for one through the exchange; everyone sees
the same request). A round is decided in the per-step exchange, so a due step whose exchange did not run has its
round at the next exchange (:meth:`Snapshots.due`: every step due since the previous exchange counts); every
committed step has one (worker.session ``_close_step`` runs it at the end of a step without an update: a
GradScaler's overflow skip on exactly a due step left an unreplicated job with no snapshot to roll back to).

**Cost.** At S every rank copies its replicated managed state into host memory (a device-to-host copy; on the CPU
a memcpy, measured as the step-time overhead), then a background thread sends that copy to its keeper while
another receives its buddy's, each over a 2-rank group of the round (``layout.snapshot_prefix``): training goes
on meanwhile. Memory per rank: its own copy and one peer's, each the size of one rank's replicated state, plus a
second pair while a round completes (the previous one is kept until every rank holds the new one).

**Agreement.** Each rank publishes, in the per-step exchange (worker.step_exchange), the steps whose own copy and
buddy copy it holds; every rank drops the snapshots older than the newest step every rank holds (none while no
step is common), so the newest step every rank holds always survives, even when a round completes on some
ranks after a later one or not at all. tmd rolls back to the newest step all survivors report holding.
"""
from __future__ import annotations

import collections
import copy
import dataclasses
import hashlib
import logging
import threading
from typing import Any, Optional

import torch

from tmd import protocol as p
from worker import backend as mb
from worker import transfer
from worker.dtensor import dtensor_layout, is_dtensor, local_shard

log = logging.getLogger("worker.snapshot")

MAX_HELD = 3  # snapshots of each kind a rank holds at most (the common one and the newest ones)
ROUND_TIMEOUT_S = 120.0  # gloo timeout (seconds) of a round's 2-rank groups: a peer lost mid-round frees them


@dataclasses.dataclass
class Snapshot:
    """One rank's state at the end of committed step ``step``: ``states`` (object name -> host copy of its
    state_dict; a DTensor as a transfer.ReceivedShard, see :func:`copy_state`) and ``rank_state``
    (worker.rank_state bytes: RNG and rank-local objects at the start of ``step + 1``)."""

    step: int
    states: dict[str, Any]
    rank_state: bytes


class _Frozen:
    """A state_dict held as a value, for transfer.send_state."""

    def __init__(self, state: Any) -> None:
        self.state = state

    def state_dict(self) -> Any:
        return self.state

    def load_state_dict(self, state: Any) -> None:  # pragma: no cover - never loaded into
        raise TypeError("a snapshot is not loaded into")


def copy_state(value: Any) -> Any:
    """A host copy of a state_dict value: tensors are cloned to the CPU, a DTensor as a transfer.ReceivedShard (a
    host copy of its local shard with its layout, as a buddy's copy arrives: ``DTensor.from_local`` would move
    the shard back to its mesh's device; transfer.load_state places it, without communicating), containers
    copied, other values deep-copied."""
    if is_dtensor(value):
        shape, placements, mesh = dtensor_layout(value)
        return transfer.ReceivedShard(local_shard(value).to("cpu", copy=True), shape, placements, mesh)
    if isinstance(value, transfer.ReceivedShard):
        return dataclasses.replace(value, local=value.local.detach().to("cpu", copy=True))
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, collections.OrderedDict):
        out = collections.OrderedDict((k, copy_state(v)) for k, v in value.items())
        metadata = getattr(value, "_metadata", None)
        if metadata is not None:
            out._metadata = copy.deepcopy(metadata)
        return out
    if isinstance(value, dict):
        out = {k: copy_state(v) for k, v in value.items()}
        return collections.Counter(out) if type(value) is collections.Counter else out  # MultiStepLR's milestones
    if isinstance(value, (list, tuple)):
        return type(value)(copy_state(v) for v in value)
    return copy.deepcopy(value)


def host_copy(objects: dict[str, Any]) -> dict[str, Any]:
    """Host copies (:func:`copy_state`) of ``objects``' state_dicts now: what a snapshot holds."""
    return {name: copy_state(obj.state_dict()) for name, obj in objects.items()}


def round_id(nonces: list[str]) -> str:
    """The id of the snapshot round started at a step, from every rank's nonce of that step's exchange (the same
    list on every rank): 16 hex characters, unique per round even when a rollback redoes the step."""
    return hashlib.sha256("/".join(nonces).encode()).hexdigest()[:16]


class Snapshots:
    """This rank's buddy snapshots (see the module docstring). The training thread takes and restores; the two
    threads of a round write ``kept`` under ``lock``."""

    def __init__(self, every: int, rank: int, groups: Any, first: int = -1) -> None:
        """``every``: K in steps (0: off); ``groups``: the rank's GroupManager (store connections, host);
        ``first``: a step that takes a snapshot too (the job's last recorded step, ``record_steps - 1``: without
        it a failure before step K - 1 found no snapshot to roll back to; -1: none)."""
        self.every = every
        self.first = first
        self.rank = rank
        self.groups = groups
        self.enabled = False
        self.keeper: Optional[int] = None  # the rank that keeps this rank's snapshot
        self.buddy: Optional[int] = None  # the rank whose snapshot this rank keeps
        self.own: dict[int, Snapshot] = {}
        self.kept: dict[int, Snapshot] = {}  # copies of ``buddy``'s snapshots
        self.want = False  # ask every rank for a snapshot at the next commit (after a migration or recovery)
        self._asked = -1  # the step of the latest exchange that asked due() (rounds due since then are due next)
        self.lock = threading.Lock()
        self.bytes_per_copy = 0  # bytes of this rank's latest own copy
        self.take_s = 0.0  # seconds the latest host copy took (the step-time overhead)

    def configure(self, node_of: dict[int, str], classes: dict[int, list[int]]) -> None:
        """Decide whether snapshots are on, from every rank's node and replica class at the job's first step
        (identical on every rank): on when ``every`` > 0 and some rank's class lies on one node."""
        keepers = p.layout.snapshot_keepers(node_of)
        exposed = any(len({node_of[r] for r in classes[rank]}) == 1 for rank in classes)
        self.enabled = self.every > 0 and exposed and bool(keepers)
        if self.enabled:
            self.keeper = keepers[self.rank]
            self.buddy = next(r for r, k in keepers.items() if k == self.rank)
            log.info("rank %d: buddy snapshots every %d steps (kept by rank %d, keeping rank %d)", self.rank,
                     self.every, self.keeper, self.buddy)

    # --- agreement (the per-step exchange) -------------------------------------------------------------------------
    def latest(self) -> int:
        """The latest step whose own and buddy copy this rank holds (-1: none)."""
        held = self.held()
        return held[-1] if held else -1

    def held(self) -> list[int]:
        """Steps whose own copy and buddy copy this rank holds, ascending."""
        with self.lock:
            return sorted(set(self.own) & set(self.kept))

    def due(self, step: int, wants: list[bool]) -> bool:
        """Whether step ``step``'s exchange starts a round (taken when the step commits; ``wants``: every rank's
        request): some rank wants one, or a due step (``S % K == K - 1``, or ``first``) lies after the previous
        exchange's step and at or before ``step``, so a due step that had no exchange has its round at the next
        one. Every live rank asks at every exchange; where their previous exchanges differed (a joiner, a rank one
        step behind after a failure) some rank wants a round anyway."""
        since = self._asked + 1 if self._asked < step else step  # a redone step: only itself
        self._asked = step
        if not self.enabled:
            return False
        k = self.every
        return any(wants) or since <= self.first <= step or (step + 1) // k > since // k

    def prune(self, held: list[list[int]]) -> None:
        """Drop snapshots older than the newest step every rank holds complete (``held``: each rank's
        :meth:`held`); nothing while no step is common. That step, and so this rank's own latest, stays."""
        common = set.intersection(*(set(h) for h in held)) if held else set()
        floor = max(common, default=-1)
        with self.lock:
            for held in (self.own, self.kept):
                for step in [s for s in held if s < floor]:
                    del held[step]
                # a bound while rounds keep failing somewhere: the common step and the newest MAX_HELD - 1
                extra = [s for s in sorted(held) if s != floor][:max(0, len(held) - MAX_HELD)]
                for step in extra:
                    del held[step]

    # --- taking one --------------------------------------------------------------------------------------------
    def take(self, step: int, objects: dict[str, Any], rank_state: bytes, round_name: str) -> None:
        """Copy ``objects``' state (committed ``step``) and ``rank_state`` into host memory, then exchange with
        the keeper and the buddy in the background. A round that fails (a peer lost) just never completes."""
        import time

        t0 = time.perf_counter()
        snap = Snapshot(step, host_copy(objects), rank_state)
        self.take_s = time.perf_counter() - t0
        self.bytes_per_copy = _nbytes(snap.states) + len(rank_state)
        with self.lock:
            self.own[step] = snap
        self.want = False
        threading.Thread(target=self._send, args=(snap, round_name), daemon=True,
                         name=f"tm-snapshot-send-{step}").start()
        threading.Thread(target=self._receive, args=(step, round_name), daemon=True,
                         name=f"tm-snapshot-recv-{step}").start()

    def _send(self, snap: Snapshot, round_name: str) -> None:
        pg = None
        try:
            store = self.groups.connect_store()
            pg = mb.build_inner(store, p.layout.snapshot_prefix(round_name, self.rank, self.keeper), 0, 2,
                                ROUND_TIMEOUT_S, self.groups.host)
            transfer.send_state(pg, self.frozen(snap), {"step": snap.step, "rank_state": snap.rank_state})
        except Exception as e:  # noqa: BLE001 - the round does not complete; the previous snapshot stays
            log.warning("rank %d: snapshot %d not sent to rank %d: %s", self.rank, snap.step, self.keeper, e)
        finally:
            if pg is not None:
                mb.release_in_background(pg)

    def _receive(self, step: int, round_name: str) -> None:
        pg = None
        try:
            store = self.groups.connect_store()
            pg = mb.build_inner(store, p.layout.snapshot_prefix(round_name, self.buddy, self.rank), 1, 2,
                                ROUND_TIMEOUT_S, self.groups.host)
            states, extra, _, _ = transfer.recv_state(pg, 0)
            if extra.get("step") != step:
                raise RuntimeError(f"rank {self.buddy} sent its snapshot of step {extra.get('step')}, not {step}")
            # kept as received (a DTensor is a transfer.ReceivedShard: never placed here, off the training thread)
            # and sent on as it came to the buddy's replacement
            with self.lock:
                self.kept[step] = Snapshot(step, states, extra["rank_state"])
        except Exception as e:  # noqa: BLE001 - the round does not complete; the previous snapshot stays
            log.warning("rank %d: snapshot %d of rank %d not received: %s", self.rank, step, self.buddy, e)
        finally:
            if pg is not None:
                mb.release_in_background(pg)

    # --- rolling back ------------------------------------------------------------------------------------------
    def own_copy(self, step: int) -> Snapshot:
        """This rank's snapshot of ``step``, as a fresh copy (loading must not alias the snapshot: an optimizer
        keeps the tensors it is given). Raises KeyError when not held."""
        with self.lock:
            snap = self.own[step]
        return Snapshot(step, copy_state(snap.states), snap.rank_state)

    def kept_copy(self, step: int) -> Snapshot:
        """The buddy's snapshot of ``step``. Raises KeyError when not held."""
        with self.lock:
            return self.kept[step]

    def adopt(self, snap: Snapshot) -> None:
        """Hold ``snap`` (what a replacement received) as this rank's own snapshot of its step, and ask for a
        fresh round (this rank keeps no buddy copy yet)."""
        with self.lock:
            self.own = {snap.step: Snapshot(snap.step, copy_state(snap.states), snap.rank_state)}
            self.kept = {}
        self.want = True

    def frozen(self, snap: Snapshot) -> dict[str, Any]:
        """``snap``'s states as objects transfer.send_state takes."""
        return {name: _Frozen(s) for name, s in snap.states.items()}


def _nbytes(value: Any) -> int:
    value = local_shard(value) if isinstance(value, torch.Tensor) else value
    if isinstance(value, transfer.ReceivedShard):
        value = value.local
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_nbytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0

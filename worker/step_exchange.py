"""The per-step exchange: every rank's fingerprint, rank state and snapshot agreement, all-gathered once a step.

**Each rank's own state.** In the first managed optimizer's step pre-hook of every step (only when the step is not
already void: worker.step_hooks' stage ``exchange``), or at the end of a step in which not every managed optimizer
stepped (a GradScaler's overflow skip, a skipped batch; worker.session ``_close_step``, which then commits the step:
every committed step has its exchange), every rank serialises its rank state (CPU and CUDA RNG, the ``rank_local``
managed objects; worker.rank_state) and the world group all-gathers them (two tiny collectives through the mover: a
failure latches and the step is refused like any other). A rank that commits step S therefore holds every rank's
state as of the end of S's compute, which is the state at the start of S + 1 (assumed: no RNG draws between the
optimizer step and the start of the next step). Every managed state_dict must be plain data (worker.rank_state
``PLAIN_RULE``): a process's first exchange checks that and fails the job (``SCRIPT_ERROR``, naming the object and
the offending type) otherwise, at once rather than at the first migration or recovery. Only the latest committed
step's copy is kept (``world_size`` x a few KB of host memory). In a recovery every receiver (a replacement, or a
survivor one step behind) gets, with the replicated state from its sender, *its own* rank state from the sender's
copy (:meth:`StepExchange.own_state`) and loads it (never the sender's RNG instead: without that copy the recovery
fails); survivors that committed keep their own. During a joiner's shadow iterations the exchange is replayed like
any collective. A change to the RNG or a rank-local object after the optimizer update, which a replacement would
miss, is reported once as ``state_after_update`` (:meth:`StepExchange.begin`).

**Replica classes and the fingerprint check.** The same exchange carries a fingerprint of the replicated state
(worker.rank_state; a DTensor's local shard). At the job's first step every rank sends one, and the ranks whose
fingerprints are equal form a *replica class*: ranks holding bit-identical state (every rank under DDP; the same
shard coordinate along HSDP's replicate dimension; a pipeline stage's data-parallel copies). Each rank reports its
class to tmd (``ReplicaReport``), which recovers a lost rank only from a survivor of its class. A joiner learns the
classes from its recording of that step. After a migration or recovery, at the first step after it
(``verify_next``), every rank compares its fingerprint with its class's; a mismatch fails the job
(``RankFailed(STATE_MISMATCH)``, exit ``FAILED``). Only then is a fingerprint computed (~10 ms on the demo GPT);
``VERIFY_EVERY_STEP`` compares at every step.

**Checkpoint saver agreement.** Each rank publishes the state of its build of the checkpoint tier's saver group
(worker.checkpointing): every rank decides from the same gathered statuses whether a due save is taken.

**Snapshot agreement.** Each rank publishes the buddy snapshots it holds and whether it wants a fresh round
(worker.snapshot); the exchange prunes what not every rank holds and decides whether a round is due, which
:meth:`StepExchange.take_due_snapshot` takes as the next step begins.
"""
from __future__ import annotations

import json
import logging
import os
import struct
import sys
from typing import Any, Callable, Optional

import torch

from tmd import protocol as p
from worker import rank_state
from worker.control import Control, Stage
from worker.reports import Reporter
from worker.snapshot import Snapshots, round_id
from worker.step_ledger import StepLedger, failure

log = logging.getLogger("worker.step_exchange")

# Compare the replicas' fingerprints at every step, not only at the first step after a migration or recovery. Off:
# a fingerprint costs ~10 ms on the demo GPT (~3 % of its step on this machine).
VERIFY_EVERY_STEP = False
NO_FINGERPRINT = bytes(32)  # sent in place of a fingerprint by a rank that does not verify this step


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


class StepExchange:
    """This rank's part in the per-step exchange (see the module docstring). ``fail(kind, error)``: report that the
    job must fail and end this process (never returns). Training thread only."""

    def __init__(self, control: Control, reports: Reporter, fail: Callable[[p.FailureKind, str], None],
                 ledger: StepLedger) -> None:
        self.control = control
        self.reports = reports
        self.fail = fail
        self.ledger = ledger
        self.exchanged: Optional[tuple[int, list[bytes]]] = None  # (step, every rank's state) of this attempt
        self.kept: Optional[tuple[int, list[bytes]]] = None  # the same, of the latest committed step
        self.verify_next = False  # compare the replicas' fingerprints at the next exchange
        # rank -> the ranks whose replicated state is bit-identical to it (its replica class), learned at the first
        # exchange where every rank sent a fingerprint (the job's first step); None until then
        self.classes: Optional[dict[int, list[int]]] = None
        self.node = ""  # this process's node name (published in the exchange: snapshot pairing)
        self.snapshots: Optional[Snapshots] = None  # buddy snapshots (worker.session), off if None
        self._snapshot_reported = False
        self.snapshot_round: Optional[tuple[int, str]] = None  # (step, round id): taken as the next step starts
        # (step, rank_state.capture) as this rank's exchange of ``step`` took it (live steps only)
        self._at_update: Optional[tuple[int, dict[str, Any]]] = None
        self._warned_after_update = False
        self._plain_checked = False  # the managed state_dicts were checked for plain data (check_plain)
        # this rank's checkpoint saver status, published in every live exchange (worker.checkpointing
        # SessionCheckpoints.status); None: the job saves no checkpoints
        self.saver: Optional[Callable[[], Optional[list[int]]]] = None

    def _live(self) -> bool:
        return self.control.stage != Stage.SHADOW and self.control.role == p.WorkerRole.ACTIVE

    # --- step hook stages (worker.step_hooks) -------------------------------------------------------------------
    def before_update(self) -> None:
        """Stage ``exchange``: run the exchange once per step, in the first managed optimizer's pre-hook (or at the
        end of a step without an update: worker.session ``_close_step``), unless the step is void already (shadow
        iterations do not call begin: the step is compared)."""
        if failure(self.control) is None and (self.exchanged is None or self.exchanged[0] != self.control.step):
            self.run()

    def keep(self) -> None:
        """Stage ``keep``: once the ledger committed the step this attempt exchanged, keep that exchange."""
        if self.exchanged is not None and self.exchanged[0] == self.ledger.committed_step:
            self.kept = self.exchanged

    # --- the exchange ------------------------------------------------------------------------------------------
    def run(self) -> None:
        """All-gather every rank's fingerprint (32 bytes), meta and rank state; learn the replica classes from the
        first exchange with every fingerprint; compare the fingerprints within each class if due; agree on buddy
        snapshots (worker.snapshot)."""
        step = self.control.step
        ledger = self.ledger
        # Replayed in shadow iterations: the recorded fingerprints are the leaver's peers', nothing to compare.
        verifying = (self.verify_next or VERIFY_EVERY_STEP or self.classes is None) and self._live()
        fp = rank_state.fingerprint(ledger.replicated, ledger.optimizers) if verifying else NO_FINGERPRINT
        snaps = self.snapshots
        meta = {"node": self.node, "nonce": os.urandom(8).hex(),
                "held": snaps.held() if snaps else [], "want": bool(snaps and snaps.want)}
        if self.saver is not None:
            meta["saver"] = self.saver() if self._live() else None
        state = rank_state.capture(ledger.local)
        if not self._plain_checked and self._live():
            self.check_plain(state["local"])
        if self._live():
            self._at_update = (step, state)
        gathered = rank_state.all_gather_bytes(pack(fp, meta, rank_state.encode(state)))
        if failure(self.control) is not None:
            return  # outputs untouched by a failed collective: keep nothing
        self.exchanged = (step, gathered)
        parts = [unpack(g) for g in gathered]
        prints = {r: part[0] for r, part in enumerate(parts)}
        if self.classes is None and NO_FINGERPRINT not in prints.values():
            self.learn_classes(prints, {r: part[1]["node"] for r, part in enumerate(parts)})
        if verifying:
            self.verify_next = False
            self.verify(step, {r: f for r, f in prints.items() if f != NO_FINGERPRINT})  # others: not due
        self.snapshot_round = None
        if snaps is not None and snaps.enabled and self.control.stage != Stage.SHADOW:
            metas = [part[1] for part in parts]
            snaps.prune([m["held"] for m in metas])
            if snaps.due(step, [m["want"] for m in metas]):
                self.snapshot_round = (step, round_id([m["nonce"] for m in metas]))

    def check_plain(self, local_states: dict[str, Any]) -> None:
        """At this process's first live exchange: fail the job (SCRIPT_ERROR, naming the object, the offending type
        and the rule) when a managed state_dict holds what a migration or recovery cannot move (worker.rank_state
        check_plain), before any rank depends on moving it: a replacement would otherwise fail to load its rank
        state after a failure, or a joiner to plan its receive buffers."""
        self._plain_checked = True
        error = rank_state.check_plain(local_states, rank_local=True) or rank_state.check_plain(
            {name: obj.state_dict() for name, obj in self.ledger.replicated.items()}, rank_local=False)
        if error is not None:
            self.fail(p.FailureKind.SCRIPT_ERROR, error)

    def learn_classes(self, prints: dict[int, bytes], node_of: dict[int, str]) -> None:
        """Replica classes from every rank's fingerprint (a joiner learns them from its recording), and whether
        buddy snapshots are on (from the classes and every rank's node); an active rank reports its own class
        to tmd (``ReplicaReport``)."""
        by_print: dict[bytes, list[int]] = {}
        for r, f in sorted(prints.items()):
            by_print.setdefault(f, []).append(r)
        self.classes = {r: by_print[f] for r, f in prints.items()}
        if self.snapshots is not None:
            self.snapshots.configure(node_of, self.classes)
        if self._live():
            self.reports.replicas(self.classes[self.control.rank])

    def verify(self, step: int, prints: dict[int, bytes]) -> None:
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
        at committed step ``step``; None when no such copy is kept (the copy is of another step: a recovery's
        sender then fails rather than send its own RNG in its place)."""
        if self.kept is None or self.kept[0] != step or not 0 <= rank < len(self.kept[1]):
            return None
        return unpack(self.kept[1][rank])[2]

    def saver_statuses(self, step: int) -> Optional[list[Optional[list[int]]]]:
        """Every rank's checkpoint saver status (``meta["saver"]``, in rank order) from the exchange kept at
        committed step ``step``: the same on every rank that committed it, so what every rank decides a save by
        (worker.checkpointing.agree). None when no exchange of that step is kept (no managed optimizer)."""
        if self.saver is None or self.kept is None or self.kept[0] != step:
            return None
        return [unpack(blob)[1].get("saver") for blob in self.kept[1]]

    def after_recovery(self) -> None:
        """A recovery swapped the new groups in: the next exchange compares fingerprints (``verify_next``) and
        asks for a fresh snapshot round."""
        self.verify_next = True
        if self.snapshots is not None:
            self.snapshots.want = True  # a fresh round once the job trains again (the lost node's copies are gone)

    # --- as a step begins ----------------------------------------------------------------------------------------
    def take_due_snapshot(self) -> None:
        """Before the ledger's copies: take the buddy snapshot due at the step just committed (here, not after the
        optimizer: what steps after it, an LR scheduler, belongs to the state step + 1 starts from)."""
        due, self.snapshot_round = self.snapshot_round, None
        committed = self.ledger.committed_step
        if due is not None and due[0] == committed and self.kept is not None and self.kept[0] == due[0]:
            self.snapshots.take(due[0], self.ledger.replicated, self.own_state(self.control.rank, due[0]), due[1])
            if not self._snapshot_reported:  # its cost, once per process: host bytes and the copy's seconds
                self._snapshot_reported = True
                self.reports.snapshot(due[0], self.snapshots.bytes_per_copy, self.snapshots.take_s)

    def begin(self) -> None:
        """After the ledger's copies: nothing exchanged in this attempt yet; check what changed after the last
        update (:meth:`_check_after_update`)."""
        self.exchanged = None
        self._check_after_update()

    def _check_after_update(self) -> None:
        """As a step begins, after the step before it committed here with its exchange: warn once per process
        (``RankWarning(state_after_update)``, the log, stderr) when the RNG or a rank-local object changed since
        that exchange, i.e. between the optimizer update and now. The exchanged copy is what a failure's
        replacement resumes from, so such a change would be missing there (the survivors put back what they hold
        as the attempt began). Costs one RNG read and a comparison of the rank-local state_dicts (microseconds)."""
        at, self._at_update = self._at_update, None
        step = self.control.step
        if at is None or self._warned_after_update or at[0] != step - 1 or self.ledger.committed_step != at[0]:
            return
        then = at[1]
        now_cpu, now_cuda = rank_state.rng_states()
        changed = [] if torch.equal(then["cpu_rng"], now_cpu) else ["the CPU RNG"]
        if not rank_state.same(then["cuda_rng"], now_cuda):
            changed.append("a CUDA RNG")
        changed += [f"rank-local object {name!r}" for name, state in then["local"].items()
                    if not rank_state.same(state, self.ledger.local_copies[name])]
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

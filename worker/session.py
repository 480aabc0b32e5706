"""The rank-side runtime: the public API a training script uses, on active ranks and standbys alike.

    session = worker.init()          # role from tmd: an active rank, or a standby that waits for a rank
    model = DDP(model)               # the mover-backed world group is the default group
    session.manage(model=model, optimizer=opt, data=sampler)   # anything with state_dict/load_state_dict
    for step in session.steps(total_steps):    # iteration boundaries: switches happen here
        ...
    session.finish()

Roles in a migration (TrainMover, arXiv 2412.12636): the **leaver** hands its rank over and exits cleanly; the
**joiner** (a standby) runs shadow iterations in the sandbox, then receives the leaver's state and takes exactly its
rank, so collectives keep their order and the training trajectory stays bit-identical; the **stayers** swap the
rebuilt groups in at the switch step and use no extra memory.

This module is the API and the step loop only. The rooms behind it: worker.control (where the process stands and
tmd's commands not acted on yet: one Condition shared by the agent thread and the training thread),
worker.commands (the agent thread's handling of tmd's commands), worker.migration (joiner, leaver and stayers),
the step's rooms (worker.step_ledger: what an attempt began from and committed; worker.step_exchange: every
rank's state, replica classes, snapshot agreement; worker.void_passes: DDP's passes stopped once void;
worker.recovery: survivors and replacements after a failure), worker.step_hooks (the one ordered pipeline of
optimizer step hooks they and the pre-copy act through), worker.reports (what the rank tells tmd), worker.exit
(the one way to end the process early), worker.groups, worker.sandbox, worker.transfer.
"""
from __future__ import annotations

import faulthandler
import gc
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Any, Callable, Iterator, NoReturn, Optional, Union

import torch.distributed as dist

from tmd import protocol as p
from tmd.netif import InterfaceError
from worker import backend, misuse, object_collectives, sandbox
from worker.agent import Agent
from worker.checkpoint import CheckpointError, LayoutMismatch
from worker.checkpointing import SessionCheckpoints, Settings as CheckpointSettings
from worker.commands import Commands
from worker.control import Control, Stage
from worker.exit import exit_process

STANDBY_ORPHAN_S = 600.0  # a standby that has not reached tmd this long (seconds) exits: tmd died, no one resumed it
from worker.gpu_health import probe_from_env
from worker.groups import GroupManager
from worker.migration import DECISION_TIMEOUT_S, LeaverExit, Migration
from worker.ddp_regroup import REGROUP_OPS, ddp_to_regroup, regroup_ddp_buckets, track_ddp_modules
from worker.recovery import RECOVERY_TIMEOUT_S, REPLACEMENT_SHADOW_STEPS, Recovery
from worker.reports import Reporter
from worker.snapshot import Snapshots
from worker.step_exchange import StepExchange
from worker.step_hooks import StepHooks
from worker.step_ledger import StepAborted, StepLedger, failure
from worker.store import JobStore
from worker.void_passes import VoidPassStopper

__all__ = ["init", "Session", "StepAborted", "LeaverExit", "DECISION_TIMEOUT_S", "RECOVERY_TIMEOUT_S"]

log = logging.getLogger("worker.session")
# what a script whose StepAborted went uncaught must do (the rule of session.steps: README, docs/user-guide.md)
CATCH_STEP_ABORTED = ("In a session.steps() loop, catch worker.StepAborted and continue: the runtime recovers and "
                      "yields the step again; or use session.run(step_fn, total), which does (see session.steps in "
                      "the README and docs/user-guide.md)")
# what a script that died of another exception while a peer's failure was latched must do
CATCH_DURING_FAILURE = ("Use session.run(step_fn, total), which recovers from any exception raised while a failure is "
                        "latched, or catch it in the steps() loop (worker.StepAborted and the script's own checks of "
                        "values a failed step left stale) and continue")


def _prewarm() -> None:
    """On a standby, while it waits: import what DDP (and FSDP, torch.compile) import lazily on first use.
    ``torch._dynamo`` alone takes ~1.1 s to import on this class of machine, which would otherwise land in the
    replacement's critical path after a failure."""
    t0 = time.perf_counter()
    import torch._dynamo  # noqa: F401
    import torch.nn.parallel  # noqa: F401 (lazily imported by DDP)
    log.info("standby pre-warmed in %.2f s", time.perf_counter() - t0)


class Session:
    """One rank's handle on the runtime, made by :func:`init`. Attributes: ``rank`` (-1 before one is
    assigned), ``world_size``, ``node``, ``local_rank``, ``role`` (a :class:`tmd.protocol.WorkerRole`:
    ``active``, or ``joiner`` until the joiner took its rank over), ``run_dir``, ``is_shadow`` (true during a
    joiner's shadow iterations), ``objects`` (the managed objects by name)."""

    def __init__(self, agent: Agent, control: Control, reports: Reporter, node: str, local_rank: int,
                 run_dir: str) -> None:
        self.agent = agent
        self.node = node
        self.local_rank = local_rank
        self.run_dir = run_dir
        self.world_size = 0
        self.objects: dict[str, Any] = {}
        self._control = control
        self._reports = reports
        self._assign: Optional[p.Assign] = None
        self._groups: Optional[GroupManager] = None
        self._record_writer: Optional[threading.Thread] = None
        self._step_starts: dict[str, list[int]] = {}  # group -> ops it recorded before each recorded step
        self._ledger = StepLedger(control)
        self._exchange = StepExchange(control, reports, self._fail, self._ledger)
        self._stopper = VoidPassStopper(control)
        self._recovery = Recovery(control, reports, self._ledger, self._exchange, self._stopper)
        # the one pipeline of the managed optimizers' step hooks; the pre-copy's join it (worker.step_hooks)
        self._hooks = StepHooks(exchange=self._exchange.before_update, refuse=self._ledger.refuse,
                                commit=self._ledger.commit, keep=self._exchange.keep)
        self._failure_reported = False
        self._misuse_checked = False
        self._migration = Migration(control, reports, self.objects, agent.close, self._hooks)
        self._checkpoints: Optional[SessionCheckpoints] = None  # the checkpoint tier (worker.checkpointing)
        self._recording_kept = False  # relaunched by tmd: the run dir's recording of the job's first steps stays

    @property
    def rank(self) -> int:
        """This process's global rank (a joiner's: the leaver's or the lost rank it takes over)."""
        return self._control.rank

    @property
    def role(self) -> p.WorkerRole:
        """``active``, or ``joiner`` until the joiner took its rank over (then ``active``)."""
        return self._control.role

    @property
    def is_shadow(self) -> bool:
        """True during a joiner's shadow iterations: collectives are replayed and the results thrown away (do not
        write outputs or inject faults then)."""
        return self._control.stage == Stage.SHADOW

    # --- set-up -------------------------------------------------------------------------------------------------
    def _start(self, timeout_s: float) -> None:
        self.agent.start()
        if self.agent.standby:
            _prewarm()
        got = None
        while got is None:  # a standby waits here (warm: torch imported, registered, heartbeating) until needed
            got = self._control.wait_assigned(1.0)
            if got is None and self.agent.standby and self.agent.unreachable_s() > STANDBY_ORPHAN_S:
                exit_process(p.ExitCode.FAILED, f"a standby with no rank: tmd has been unreachable for "
                                                f"{STANDBY_ORPHAN_S:.0f} s (it died and was not resumed)")
        if isinstance(got, p.Release):  # (the agent thread normally exits first: a process without a rank)
            exit_process(got.exit_code, f"released by tmd before a rank was assigned: {got.reason}")
        a = self._assign = got
        self._control.start(a)
        self._install_excepthooks()
        self.world_size = a.world_size
        # torchrun's variables, for scripts that read them (a device, a log name): the rank this process holds
        # (a joiner's: the rank it takes over) and its index on its node
        os.environ.update(RANK=str(a.rank), WORLD_SIZE=str(a.world_size), LOCAL_RANK=str(self.local_rank))
        # Store keys go below the job's secret namespace where groups are built (worker.backend.store_prefix),
        # so every store connection (this one, a recovery's own, the one after a tmd restart) is covered.
        store = JobStore.of_job(a.store_host, a.store_port, timeout_s)  # tmd's store, over CURVE with the worker key
        groups = self._groups = GroupManager(store, a.rank, a.world_size, backend.gloo_host(a.store_host))
        groups.on_created = self._group_created
        self._control.attach(groups)
        settings = CheckpointSettings.from_env()
        if settings.active:
            self._checkpoints = checkpoints = SessionCheckpoints(settings, lambda: groups.store, groups.host,
                                                                 self._reports.warning, self._hooks.disarmed)
            if checkpoints.saving:  # every live exchange publishes this rank's saver status
                self._exchange.saver = lambda: checkpoints.status(self.rank, self.world_size, groups.world_generation)
        if settings.resume_from is not None and a.role == p.WorkerRole.ACTIVE:
            track_ddp_modules()  # before the script builds its model: its DDP is regrouped after the load
            self._recording_kept = settings.restart and os.path.exists(
                p.layout.recording_path(a.record_dir, a.rank, p.layout.WORLD_GROUP))
        self._exchange.node = self.node
        self._exchange.snapshots = Snapshots(a.snapshot_every, a.rank, groups, first=a.record_steps - 1)
        if a.role == p.WorkerRole.ACTIVE:
            recording = a.record_steps > 0 and not self._recording_kept
            groups.init_world(a.generation, p.MoverMode.RECORD if recording else p.MoverMode.LIVE, connect=True)
            groups.set_tolerant()
        else:
            track_ddp_modules()  # before the script builds its model: regroup_ddp_buckets finds its DDP there
            groups.init_world(a.generation, p.MoverMode.REPLAY, connect=False)
            groups.groups[p.layout.WORLD_GROUP].recording = sandbox.start_replay(
                groups.world, a.record_dir, a.rank, p.layout.WORLD_GROUP)
            groups.replay_dir = a.record_dir  # the script's own groups replay too (GroupManager.create_group)
            self._migration.migration_id = a.migration_id

    def new_group(self, ranks: list[int]) -> Optional[dist.ProcessGroup]:
        """``dist.new_group(ranks)``, returning None on non-members. Every group the script creates after
        :func:`init` (``dist.new_group``, ``new_subgroups``, ``init_device_mesh``, and so FSDP2, tensor parallel,
        pipelining) is backed by a mover like the world group: migrations rebuild it when it contains a
        leaver and leave it alone otherwise, recoveries rebuild it, and a joiner replays its collectives (point
        to point receives included) in the sandbox. Every process creates groups in the same order (torch's own
        rule), before the job has recorded its first ``record_steps`` steps (a joiner replays a group from
        that recording). Raises ValueError for duplicate or out-of-range ranks; on a joiner,
        FileNotFoundError when the group's recording does not appear within 60 s."""
        ranks = list(ranks)
        if len(set(ranks)) != len(ranks) or not all(0 <= r < self.world_size for r in ranks):
            raise ValueError(f"bad ranks for a process group: {ranks} (world size {self.world_size})")
        pg = dist.new_group(ranks)
        return pg if self.rank in ranks else None

    def manage(self, rank_local: bool = False, **objects: Any) -> None:
        """Hand over the state that moves with this rank: objects with ``state_dict()``/``load_state_dict()``
        (model, optimizer, LR scheduler, data sampler...). A planned migration moves all of it to the joiner.

        ``rank_local=False`` (model, optimizer, scheduler): the state is identical on every data-parallel
        replica, so after a failure a replacement (or a survivor one step behind) receives it from a replica.
        ``rank_local=True`` (a data sampler built for this rank): kept, with this rank's RNG states, by every rank
        at each step (worker.rank_state); after a failure the rank's replacement (or the rank itself, one step
        behind) gets it back from a replica's copy. Its state_dict must be plain data (tensors, numbers, strings,
        containers: it is loaded with ``torch.load(weights_only=True)``), each step's data a function of the
        step number (the redone step asks for the same step), and it must change, like the RNG, only before the
        step's optimizer update (a change after it is reported once as ``RankWarning(state_after_update)``: a
        replacement would resume without it). A survivor that did not commit an interrupted step gets it back as
        that step began.

        Managed optimizers get a step pre-hook that raises :class:`StepAborted` when a collective of the step
        failed (nothing is updated then) and a post-hook that records the step as committed.
        Raises TypeError for an object without state_dict/load_state_dict, or for a ``ZeroRedundancyOptimizer``
        (its ``state_dict()`` needs a collective, ``consolidate_state_dict()``, which a rank reading its own state
        alone cannot make: manage its inner ``.optim``, the shard this rank updates). Nothing is managed then."""
        zero = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")  # loaded if the script made one
        for name, obj in objects.items():
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise TypeError(f"managed object {name!r} has no state_dict/load_state_dict")
            if zero is not None and isinstance(obj, zero.ZeroRedundancyOptimizer):
                raise TypeError(f"managed object {name!r} is a ZeroRedundancyOptimizer, whose state_dict() needs "
                                f"a collective: manage its inner optimizer instead, session.manage({name}="
                                f"{name}.optim) (the shard of the state this rank updates)")
        self.objects.update(objects)
        for opt in self._ledger.manage(objects, rank_local):
            self._hooks.add(opt)
            opt.register_step_pre_hook(self._ledger.before_closure_step)  # after the pipeline's: not refused
        self._stopper.hook(objects)

    # --- the script's own errors ------------------------------------------------------------------------------
    def _script_error(self, exc: BaseException) -> None:
        """Report ``exc`` (raised by the training script, not caused by a peer failure) as the job's failure
        (``RankFailed(SCRIPT_ERROR)`` with its traceback) and flush the agent (up to 2 s). Once per process;
        a :class:`StepAborted` or any exception while a failure is latched is a peer failure and is not
        reported (tmd handles the node failure)."""
        if self._failure_reported or isinstance(exc, (StepAborted, KeyboardInterrupt, SystemExit)):
            return
        if failure(self._control) is not None:
            return
        self._report(p.FailureKind.SCRIPT_ERROR, exc, exc)

    def _uncaught(self, exc: BaseException, ends_process: bool = True) -> None:
        """``exc`` ends the process (or, not ``ends_process``, a thread): report it as the script's error
        (:meth:`_script_error`). A :class:`StepAborted` that got this far was not caught in the ``steps()`` loop:
        the rank's state goes with the process, and tmd would see only that a survivor died too. Reported as
        ``STEP_ABORTED_UNCAUGHT``, saying what to do, so the job fails with that reason. Another exception that
        ends the process while a peer's failure is latched (the script's own check of a value a failed collective
        left stale, say) is reported too, as ``SCRIPT_ERROR`` naming the exception and the failure: the rank is
        lost with it (it was not reported before, and the job failed as if every survivor had died)."""
        if self._failure_reported or isinstance(exc, (KeyboardInterrupt, SystemExit)):
            return
        if isinstance(exc, StepAborted):
            self._report(p.FailureKind.STEP_ABORTED_UNCAUGHT, f"{exc}. {CATCH_STEP_ABORTED}", exc)
            return
        why = failure(self._control)
        if why is not None and ends_process:
            self._report(p.FailureKind.SCRIPT_ERROR, f"{type(exc).__name__}: {exc} (raised while a peer's failure "
                                                     f"was latched: {why}; this rank is lost with it). "
                                                     f"{CATCH_DURING_FAILURE}", exc)
            return
        self._script_error(exc)

    def _report(self, kind: p.FailureKind, error: Union[str, BaseException], exc: BaseException) -> None:
        """Send ``RankFailed(kind)`` with ``error`` and ``exc``'s traceback, once per process, and flush the
        agent (up to 2 s)."""
        self._failure_reported = True
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        self._reports.failed(self._control.step, kind, error, tb)
        self.agent.close()

    def _fail(self, kind: p.FailureKind, error: str) -> NoReturn:
        """The job must fail for ``kind``: report it, flush the agent and exit (ExitCode.FAILED)."""
        self._failure_reported = True
        self._reports.failed(self._control.step, kind, error)
        self.agent.close()
        exit_process(p.ExitCode.FAILED, f"rank {self.rank}: {kind.value}: {error}")

    def _install_excepthooks(self) -> None:
        """Report an exception that would end the process (``sys.excepthook``) or a thread
        (``threading.excepthook``) as a script error, then hand it to the previous hook."""
        previous, previous_thread = sys.excepthook, threading.excepthook

        def hook(kind, exc, tb):
            try:
                self._uncaught(exc)
            finally:
                previous(kind, exc, tb)

        def thread_hook(args):
            try:
                if args.exc_value is not None:
                    self._uncaught(args.exc_value, ends_process=False)
            finally:
                previous_thread(args)

        sys.excepthook = hook
        threading.excepthook = thread_hook

    def _check_misuse(self) -> None:
        """Once, at the first step boundary on an active rank: report a job whose replicated state is not all
        managed, or whose DDP model has a stateful communication hook (worker.misuse ``check_all``); rank 0 also
        warns on stderr."""
        self._misuse_checked = True
        for found in misuse.check_all(self._ledger.replicated):
            self._warn(*found)

    def _warn(self, code: p.WarningCode, message: str) -> None:
        """Report misuse to tmd (``RankWarning``); rank 0 also prints it on stderr."""
        self._reports.warning(code, message)
        if self.rank == 0:
            print(f"[worker] WARNING ({code.value}): {message}", file=sys.stderr, flush=True)

    def _group_created(self, name: str, ranks: list[int]) -> None:
        """A process group the script created, connected live on this rank (worker.groups ``create_group``). On an
        active rank whose recording of the job's first steps is over (written, or kept from the run this one
        relaunches, without this group), a joiner could not replay the group: its sandbox would wait for a
        recording that never comes, and a joiner that never reaches the step that creates it would join without
        it (a migration committed, then the stayers' collective on it failed, and every recovery rebuilt a group
        the joiners never created). Reported as ``RankWarning(late_group)``, naming the group and the step: tmd
        refuses the job's migrations and recoveries (tmd.faults)."""
        a = self._assign
        if a is None or self._control.role != p.WorkerRole.ACTIVE:
            return
        kept_without = self._recording_kept and not os.path.exists(p.layout.recording_path(a.record_dir, a.rank, name))
        if self._record_writer is None and not kept_without:
            return  # still recording: a joiner replays it
        self._warn(p.WarningCode.LATE_GROUP,
                   f"process group {name} (ranks {ranks}) was created at step {self._control.step}, after the job "
                   f"recorded its first {a.record_steps} steps (--record-steps): a joiner cannot replay it, so "
                   "migrations and recoveries of this job are refused; create every group before the recorded "
                   "steps end (before the training loop, say)")

    # --- the training loop ----------------------------------------------------------------------------------
    def run(self, step_fn: Callable[[int], Any], total: int) -> None:
        """Run ``step_fn(step)`` for every step this process owns (see :meth:`steps`), recovering from peer
        failures in process: when a collective of a step fails (a peer died, hung or was cut off), the step's
        optimizer update is refused (:class:`StepAborted`), the survivors agree with tmd on the last committed
        step, lagging survivors and the replacement receive state from a data-parallel replica, every group is
        rebuilt, and the step is redone with the same data. ``step_fn`` must draw its data from the step number
        and do at most one update per managed optimizer. Exceptions not caused by a failure are raised;
        :class:`LeaverExit` ends a leaver's loop."""
        for step in self.steps(total):
            try:
                step_fn(step)
            except Exception as e:
                why = failure(self._control)
                if why is None:
                    self._script_error(e)
                    raise
                log.warning("rank %d step %d interrupted by a failure: %s", self.rank, step, why)

    def steps(self, total: int) -> Iterator[int]:
        """Yield the step numbers this process runs, ``0 .. total-1`` on an active rank. A joiner first yields
        its shadow steps (``is_shadow`` true: collectives replayed, results thrown away), then blocks until the
        switch step S and continues with ``S .. total-1`` in the leaver's rank. On a leaver, the loop ends by
        raising :class:`LeaverExit` (exit code 0) once its state is handed over. After a failure the loop
        recovers and yields the interrupted step again: a plain ``for`` body sees :class:`StepAborted` from the
        optimizer and should catch it and ``continue`` (what :meth:`run` does). Any other exception out of the
        body is the script's error: it is reported to tmd (``RankFailed``) before the process ends. A rank that waits in a recovery without
        word from tmd for ``RECOVERY_TIMEOUT_S`` seconds exits the process (code 1), as does a joiner whose
        state transfer failed with no recovery plan to fall back on."""
        a = self._assign
        control, recovery, exchange = self._control, self._recovery, self._exchange
        step = 0
        if control.role == p.WorkerRole.JOINER:
            # No misuse check here: the job's own ranks ran it at their first boundary (same script), and tmd
            # refuses migrations and recoveries of a job they reported. On a joiner it would be a gc scan of
            # 0.1-0.2 s (demo GPT, this 2-core machine) at its first boundary after the switch or recovery,
            # which every peer's next collective waits for.
            self._misuse_checked = True
            # A failure's replacement (its plan carried out meanwhile) or a guard (tmd.guards: warm before any
            # failure) runs at most REPLACEMENT_SHADOW_STEPS shadow iterations, a planned migration's joiner up to
            # record_steps. Every joiner stops after one where its second would do what the job's later steps do
            # (_one_shadow_iteration_enough: DDP's regrouping replayed, the recorded steps 1 and 2 alike): each
            # iteration is a step of compute, on the failure's critical path for a replacement, and taken from the
            # stayers where a standby shares their host. Demo GPT on a 2-core host, one against three shadow
            # iterations, 7 + 7 jobs alternated: joiner lag at the switch step 52 against 47 ms (median; 24-89 ms
            # either way), warm-up 2.4 against 4.1 s, the stayers' lost time per migration 1.3-1.4 against 1.9 s.
            # A replacement or guard runs more, up to record_steps, while the next recorded step issues
            # collectives the last did not (_another_shadow_iteration: DDP's static-graph regrouping in its third).
            planned = a.incident_id == 0 and not a.guard
            shadow_steps = a.record_steps if planned else min(a.record_steps, REPLACEMENT_SHADOW_STEPS)
            self._regroup_as_resumed()
            if a.incident_id != 0:
                recovery.prefetch()
                if self._no_shadow_iteration_needed():
                    shadow_steps = 0
            yield from self._migration.shadow(
                min(shadow_steps, total), report_warmed=planned, pretouch=planned,
                enough_after_one=self._one_shadow_iteration_enough,
                another=None if planned else self._another_shadow_iteration, limit=min(a.record_steps, total),
                close_step=self._close_step)
            if a.guard:  # waits until a recovery adopts it (0) or a migration of the node it guards takes it
                self._migration.drop_buffers()
                self._migration.migration_id = recovery.guard(self._migration.shadow_steps)
            if a.incident_id == 0 and self._migration.migration_id != 0:
                joined = self._migration.join()
                step = joined if joined is not None else recovery.replace(0)  # None: its leaver died
                exchange.snapshots.want = True  # the leaver's snapshots left with it: a fresh round
            else:  # a failure's replacement, or an adopted guard (incident 0: tmd knows it is warm)
                self._migration.drop_buffers()
                step = recovery.replace(a.incident_id, self._migration.shadow_steps)
            exchange.verify_next = True
        record_base = 0  # the step the job's recording starts at (a job resumed from a checkpoint: that step)
        if a.role == p.WorkerRole.ACTIVE and self._checkpoints is not None:
            try:
                step = record_base = self._checkpoints.start(self.rank, self.world_size, self._groups.world_generation,
                                                             self._ledger.replicated, self._ledger.local)
            except LayoutMismatch as e:  # another world size or model: no checkpoint of this job would do
                self._fail(p.FailureKind.SCRIPT_ERROR, str(e))
            except CheckpointError as e:  # torn, corrupted or changed since tmd chose it: tmd may fall back
                self._fail(p.FailureKind.CHECKPOINT_REFUSED, str(e))
        try:
            yield from self._loop(step, total, record_base)
        except LeaverExit:
            if self._checkpoints is not None:
                self._checkpoints.wait()  # its part of a save in flight, before it hands over and exits
            raise

    def _loop(self, step: int, total: int, record_base: int) -> Iterator[int]:
        """The step loop of :meth:`steps` from ``step``: the boundaries (switches, recording marks, due
        checkpoints), the yielded steps and the recoveries."""
        a = self._assign
        control, recovery, exchange = self._control, self._recovery, self._exchange
        first = step
        prev = None
        while step < total:
            t0 = time.perf_counter()
            if prev is not None:
                self._reports.step_time(step - 1, t0 - prev, shadow=False)
            prev = t0
            switch = control.boundary(step)
            if control.role == p.WorkerRole.ACTIVE and self._record_writer is None and not self._recording_kept and \
                    step - record_base <= a.record_steps:
                self._mark_recorded_step(step - record_base, a.record_steps, a.record_dir)
            if switch is not None:
                self._migration.switch_boundary(switch)
                exchange.verify_next = True
            elif control.migration_role == p.MigrationRole.LEAVER:
                self._migration.before_switch(step)
            if step > first and not self._misuse_checked and control.role == p.WorkerRole.ACTIVE:
                self._check_misuse()
            if exchange.saver is not None and control.role == p.WorkerRole.ACTIVE:
                exchange.saver()  # a new generation's checkpoint saver group starts building at its first boundary
            self._begin_step()
            if failure(control) is None:
                yield step
                self._stopper.in_step = False
                self._close_step()
                if failure(control) is None:
                    step += 1
                    self._groups.step_committed(self._stopper.at_next_backward)
                    if self._checkpoints is not None and control.role == p.WorkerRole.ACTIVE:
                        self._checkpoints.after_commit(step, self.rank, self.world_size, self._groups.world_generation,
                                                       self._ledger.replicated, self._ledger.local,
                                                       exchange.saver_statuses(step - 1))
                    continue
                done = self._ledger.committed(step)
            else:
                done = False  # halted before the step began
            step = recovery.recover(step, done)
            prev = None  # the recovery is downtime, not a step time
        if prev is not None:
            self._reports.step_time(step - 1, time.perf_counter() - prev, shadow=False)
        control.set_step(step)

    def _begin_step(self) -> None:
        """A step attempt starts: the buddy snapshot due at the step just committed is taken (before anything of
        the new attempt runs), passes may be stopped from now on, the ledger copies what the attempt begins from,
        and the exchange starts afresh and checks what changed after the last update against those copies."""
        self._exchange.take_due_snapshot()
        self._stopper.in_step = True
        self._ledger.begin(self._control.step)
        self._exchange.begin()

    def _close_step(self) -> None:
        """The step just yielded ended (a live or a shadow iteration). A step in which not every managed optimizer
        applied its update (a GradScaler's overflow skip, a skipped batch, no managed optimizer) still counts as
        committed in the loop, so it is committed here, its per-step exchange run now if no optimizer's pre-hook
        ran it: every committed step then has every rank's state (what a recovery's receiver loads) and its
        snapshot agreement. Under data parallelism every rank skips the same updates (the averaged gradients, so a
        GradScaler's inf check, agree), so they all run it here, at the same point of their collectives. A step
        whose updates committed it costs nothing more (no extra collective); a failure known here commits
        nothing."""
        if self._ledger.committed_step == self._control.step:
            return
        self._exchange.before_update()
        if failure(self._control) is None:
            self._ledger.commit_without_update()
            self._exchange.keep()

    def _mark_recorded_step(self, step: int, record_steps: int, record_dir: str) -> None:
        """At the boundary before ``step`` of an active rank still recording: note where that step begins in each
        group's recording (a redone step overwrites its mark); at ``record_steps``, write the recordings."""
        groups = self._groups.groups.values()
        if step < record_steps:
            for g in groups:
                starts = self._step_starts.setdefault(g.name, [])
                del starts[step:]  # a step redone after a recovery: its earlier attempt's mark goes
                starts.extend([0] * (step - len(starts)))  # a group created during an earlier step
                starts.append(g.mover.recorded_ops)
            return
        inserted = {}
        regrouped = self._checkpoints.regrouped if self._checkpoints is not None else None
        if regrouped is not None:  # resumed from a checkpoint: a joiner replays DDP's regrouping before step 0
            mover = backend.mover_of(regrouped[0])
            inserted = {g.name: regrouped[1] for g in groups if g.mover is mover}
        self._record_writer = sandbox.save_recordings_async(
            {g.name: g.mover for g in groups}, record_dir, self.rank, {g.name: g.ranks for g in groups},
            self._step_starts, inserted)

    def _recorded_groups(self) -> Optional[set[str]]:
        """Every group this rank's recordings cover (tmd.protocol.layout ``recorded_groups``), or None (logged)
        when they cannot be listed: the joiner then runs the shadow iterations it would run anyway."""
        try:
            return p.layout.recorded_groups(self._assign.record_dir, self.rank)
        except OSError as e:
            log.warning("rank %d: the shadow iterations it would run anyway (the recordings cannot be listed: %s)",
                        self.rank, e)
            return None

    def _replay_state(self) -> tuple[dict, dict]:
        """Each group's :class:`sandbox.Recording` and its mover's replay position now, by group name: the first
        two arguments of ``sandbox.unsteady_from_start`` and ``unsteady_after_first``."""
        groups = self._groups.groups.values()
        return {g.name: g.recording for g in groups}, {g.name: g.mover.replay_position for g in groups}

    def _regroup_as_resumed(self) -> None:
        """A joiner of a job resumed from a checkpoint, before any iteration: the job regrouped its DDP to the
        checkpoint's bucket layout before its first step (worker.checkpointing) and recorded every step on those
        buckets, the regrouping written at the start of its recorded step 0 (``Recording.regrouped_first``).
        Replay it now (``regroup_ddp_buckets(before_first=True)``), so that the joiner's buckets are the job's
        from its first iteration on. Nothing when the recording has none or the replay is not where it stands."""
        for g in self._groups.groups.values():
            rec = g.recording
            if rec is None or not rec.regrouped_first or g.mover.replay_position != rec.step_starts[0]:
                continue
            ok, ddp = ddp_to_regroup()
            if ddp is None or backend.mover_of(ddp.process_group) is not g.mover:
                log.info("rank %d: group %s's recording begins with a DDP regrouping this joiner cannot replay",
                         self.rank, g.name)
                return
            try:
                if not regroup_ddp_buckets(before_first=True):
                    raise RuntimeError("DDP did not regroup its buckets")
            except RuntimeError as e:  # the pushed order cannot be taken back: no iteration may follow
                exit_process(p.ExitCode.FAILED, f"joiner for rank {self.rank}: DDP's regrouping as the resumed job "
                                                f"did it: {e}")
            log.info("rank %d: DDP's buckets regrouped as the resumed job had them", self.rank)
            return

    def _no_shadow_iteration_needed(self) -> bool:
        """A failure's replacement, before any shadow iteration: whether it may run none, its first live step
        being the redone step. The shadow iteration would cost a step of compute on the failure's critical path
        (on this 2-core machine, the demo GPT's replacement's one iteration took 0.66-0.72 s of its ~0.85 s
        warm-up: 0.33 s of CPU, the rest the survivors' redone step on the same cores). What it buys is a process
        whose next step issues the collectives the survivors issue; the recording says whether a first step does
        that already (``sandbox.unsteady_from_start``: steps 0, 1 and 2 alike in every group, DDP's regrouping
        at the start of step 1 aside). Then every group's replay moves to the recorded step 1, DDP's regrouping
        is replayed (``regroup_ddp_buckets(before_first=True)``), and the result is checked as after one
        iteration. What a first step warms (the allocator, lazily built optimizer state) the redone step does,
        at a small cost (~0.05 s of CPU for the demo GPT). Exits the process (a fresh standby takes over) when
        the replay refuses the regrouping the check allowed."""
        recorded = self._recorded_groups()
        if recorded is None:
            return False
        groups = list(self._groups.groups.values())
        ok, ddp = ddp_to_regroup()
        regroup = None
        if ddp is not None:
            mover = backend.mover_of(ddp.process_group)
            regroup = next((g.name for g in groups if g.mover is mover), "(not a group of this session)")
        why = "DDP models this joiner cannot regroup" if not ok else sandbox.unsteady_from_start(
            *self._replay_state(), recorded, regroup, REGROUP_OPS)
        if why:
            log.info("rank %d: a shadow iteration before the redone step (%s)", self.rank, why)
            return False
        for g in groups:
            g.mover.seek_replay(g.recording.step_starts[1])
        try:
            if ddp is not None and not regroup_ddp_buckets(before_first=True):
                raise RuntimeError("DDP did not regroup its buckets")
        except RuntimeError as e:
            exit_process(p.ExitCode.FAILED, f"replacement for rank {self.rank}: DDP's regrouping before the first "
                                            f"step failed: {e}")
        why = sandbox.unsteady_after_first(*self._replay_state(), recorded)
        if why:
            exit_process(p.ExitCode.FAILED, f"replacement for rank {self.rank}: after DDP's regrouping: {why}")
        log.info("rank %d: no shadow iteration (the job's first steps were alike%s)", self.rank,
                 ", DDP's buckets regrouped from the recording" if ddp is not None else "")
        return True

    def _one_shadow_iteration_enough(self) -> bool:
        """A joiner after its first shadow iteration: whether its second iteration may run live, doing what every
        later step of the job does. First DDP's one-time regrouping is replayed without that iteration's compute
        (``regroup_ddp_buckets``); then the rest of the job's recorded step 1 must issue the collectives of its
        step 2 in every group, and every group the job recorded must exist here (``sandbox.unsteady_after_first``,
        which needs ``--record-steps`` >= 3). Otherwise the joiner runs more shadow iterations, as many as it
        would without this shortcut, and the reason goes to the log."""
        regrouped = regroup_ddp_buckets()
        recorded = self._recorded_groups()
        if recorded is None:
            return False
        why = sandbox.unsteady_after_first(*self._replay_state(), recorded)
        if why:
            log.info("rank %d: another shadow iteration (%s)", self.rank, why)
        else:
            log.info("rank %d: one shadow iteration is enough%s", self.rank,
                     " (DDP's buckets regrouped from the recording)" if regrouped else "")
        return not why

    def _another_shadow_iteration(self, done: int) -> bool:
        """A failure's replacement or a guard that ran its ``done`` shadow iterations (``REPLACEMENT_SHADOW_STEPS``):
        whether it must run another before its first live step, because the job's recorded step ``done`` issued
        collectives its step ``done - 1`` did not (``sandbox.new_ops_at``): DDP with ``static_graph=True``
        regroups its buckets with two broadcasts in a process's third iteration, which a replacement that went
        live after two made where the survivors made none (the redone step hung until gloo's timeout, then a
        second incident)."""
        why = sandbox.new_ops_at(self._replay_state()[0], done)
        if why:
            log.info("rank %d: shadow iteration %d (%s)", self.rank, done + 1, why)
        return bool(why)

    def finish(self, note: Optional[str] = None) -> None:
        """Report the end of training to tmd (``note``, e.g. a final state hash, goes to the log) and close:
        waits for the recording writer, flushes the agent (up to 2 s) and destroys the default process group.
        Then freezes the garbage collector's view of every object alive (``gc.freeze``): the interpreter's
        teardown then skips its cycle search over torch's and the model's objects (~1 s of CPU per rank on this
        class of machine, taken from ranks that share the host); cyclic garbage among those objects is only
        reclaimed at exit from then on."""
        if self._record_writer is not None:
            self._record_writer.join()
        if self._checkpoints is not None:
            self._checkpoints.wait()  # the last save is committed before the job reports its end
        if note:
            log.info("rank %d finished: %s", self.rank, note)
        self._control.enter(Stage.FINISHED)
        self._reports.done(self._control.step - 1, left=False)
        self.agent.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        gc.freeze()


def dump_stacks_on(signum: int) -> bool:
    """Make signal ``signum`` write every thread's Python stack to stderr (faulthandler; the process goes on),
    unless the process already handles it. Returns whether it was installed."""
    if signal.getsignal(signum) is not signal.SIG_DFL:
        return False
    faulthandler.register(signum, all_threads=True)
    return True


def init(coordinator: Optional[str] = None, store_timeout_s: float = 120.0) -> Session:
    """Join the job: register with tmd and wait for a role. On an active rank this returns at once with the
    mover-backed world group installed as the default process group (backend ``tmover``); on a standby it
    blocks until tmd hands it a leaver's rank (the joiner then starts in the sandbox), or exits the process
    when tmd releases it (with tmd's exit code). Reads ``TM_COORDINATOR``, ``TM_NODE``, ``TM_LOCAL_RANK``,
    ``TM_STANDBY``, ``TM_RUN_DIR`` from the environment (set by ``tmd local`` or the SLURM scripts), and
    ``TM_IFNAME`` (``--iface``): the network interface the data plane binds; a node without it ends the process
    at once with exit code 2 and one line naming the node and the interface (worker.backend.data_plane).
    ``store_timeout_s``: seconds a group setup waits in the job's store (worker.store) for its peers. Raises
    KeyError when ``TM_COORDINATOR`` is missing. Unless the script handles ``SIGUSR1`` itself, that signal makes the
    process write every thread's Python stack to its stderr and go on (``kill -USR1 PID``: where a stuck rank
    waits)."""
    address = coordinator or os.environ["TM_COORDINATOR"]
    dump_stacks_on(signal.SIGUSR1)
    # Under srun without TM_NODE/TM_LOCAL_RANK: SLURM's node name (hostnames may repeat) and local task id.
    node = os.environ.get("TM_NODE") or os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    local_rank = int(os.environ.get("TM_LOCAL_RANK") or os.environ.get("SLURM_LOCALID") or "0")
    standby = os.environ.get("TM_STANDBY", "0") == "1"
    run_dir = os.environ.get("TM_RUN_DIR", os.getcwd())
    try:  # the network the data plane uses (--iface): a node without that interface fails here, not in a rendezvous
        iface, data_host = backend.data_plane(node, address)
    except InterfaceError as e:
        exit_process(p.ExitCode.REFUSED, str(e))
    control = Control()
    commands: Commands
    agent = Agent(address, node, local_rank, standby, lambda m: commands.on_message(m), lambda: commands.heartbeat(),
                  iface=iface, data_host=data_host)
    reports = Reporter(agent.send, lambda: control.rank)
    commands = Commands(control, reports, agent.rejoin, probe_from_env().sample)
    session = Session(agent, control, reports, node, local_rank, run_dir)
    object_collectives.install(control)  # all_gather_object & co. raise StepAborted under a latched failure
    session._start(store_timeout_s)
    return session

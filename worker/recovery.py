"""Failure recovery on the rank side, the executor: the survivor's halt, plan and carry-out, and the replacement's
take-over (its prefetch during the shadow iterations, a guard's wait).

When a peer dies, hangs or is cut off, a collective of the current step fails (the movers are tolerant: the
failure is latched and the op completes with its outputs untouched) or tmd's ``Halt`` fails every mover at once.
Then, on every survivor:

1. the step's optimizer update is refused (StepAborted: worker.step_hooks' stage ``refuse``), so the rank has
   committed either the step (``done``) or the one before it. A DDP model's forward and backward passes stop
   early too (worker.void_passes);
2. at the step boundary (:meth:`Recovery.recover`) it puts back what the interrupted attempt changed, if it did not
   commit it (worker.step_ledger: buffers, rank-local objects), reports ``collective_failed`` (if it saw the
   failure before tmd said anything) and, once tmd's Halt is there, ``halted`` with its last committed step;
3. it waits for tmd's ``Recover`` plan, then carries it out on a helper thread: send its replicated state to the
   ranks the plan names (with the copy of their rank state it kept: worker.step_exchange; a sender without that copy
   fails the recovery rather than send its own RNG in its place), receive it if it is one step behind, build
   generation ``plan.generation`` of every group, load what it received, restore the RNG, gradients and GradScalers,
   reset the DDP reducers and swap the groups in; it reports ``recovered`` and redoes the interrupted step with the
   same data. A plan with ``rollback_step`` loads buddy snapshots instead (worker.snapshot).

A replacement (a standby given a lost rank) runs at most ``REPLACEMENT_SHADOW_STEPS`` shadow iterations: its warm-up
is on the failure's critical path; one only, when the second would do what the job's later steps do (DDP's one-time
regrouping done by worker.ddp_regroup, the job's recorded steps 1 and 2 alike: worker.sandbox; a migration's joiner
takes the same shortcut). tmd sends the plan once every survivor halted, without waiting for that warm-up, and the
replacement carries its part out (receive the replicated state from a replica, build the next generation of every
group) on a helper thread during the shadow iterations (:meth:`Recovery.prefetch`); after them it reports
``warmed``, loads what it received and swaps the groups in (:meth:`Recovery.replace`). A newer Halt while a plan is
carried out abandons it (nothing it received is loaded) and the rank halts again under the new incident.

The rooms it acts through: worker.step_ledger (what an attempt began from and committed), worker.step_exchange
(every rank's state, replica classes, snapshot agreement), worker.void_passes (DDP's hooks and reducers); what the
agent thread delivers (halt, plan) is read from :class:`worker.control.Control`.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, NamedTuple, Optional

import torch

from tmd import protocol as p
from worker import backend as mb
from worker import rank_state, transfer
from worker.control import Attempt, Control, Stage
from worker.exit import exit_process
from worker.reports import Reporter
from worker.snapshot import Snapshot
from worker.step_exchange import StepExchange
from worker.step_ledger import StepAborted, StepLedger, failure
from worker.void_passes import VoidPassStopper

__all__ = ["Recovery", "StepAborted", "RECOVERY_TIMEOUT_S", "REPLACEMENT_SHADOW_STEPS"]

log = logging.getLogger("worker.recovery")

RECOVERY_TIMEOUT_S = 600.0  # a halted rank that hears nothing from tmd this long (seconds) exits with an error
# Shadow iterations a failure's replacement or a guard runs at most (at most the job's record_steps; a planned
# migration's joiner runs up to record_steps, in the background, with the same one-iteration shortcut). The
# replacement's warm-up is on the failure's critical path, so it runs the fewest that leave its process doing what
# the survivors do at the redone step: none when the job's recorded steps 0, 1 and 2 issued the same collectives
# (DDP's bucket layout and regrouping aside; worker.session's _no_shadow_iteration_needed), else one when
# worker.ddp_regroup can do DDP's regrouping itself after it and the recorded steps 1 and 2 are alike
# (_one_shadow_iteration_enough), else two, because DDP regroups its gradient buckets in the forward of a process's
# second iteration with a broadcast from rank 0 (a replacement that skipped it would make that broadcast live, where
# the survivors make none); and one more, up to record_steps, while the next recorded step issued collectives the
# last one did not (_another_shadow_iteration: DDP with static_graph=True regroups in its third iteration). What the
# skipped iterations would warm (the allocator, lazily built optimizer state) the redone step warms at a small cost.
REPLACEMENT_SHADOW_STEPS = 2


class _Superseded(Exception):
    """A newer Halt arrived while a recovery plan was being carried out."""


class _Launched(NamedTuple):
    """A recovery plan being carried out on a helper thread: its ``attempt`` and the ``result`` dict the helper
    fills (``received``, ``built``, ``moved``, ``seconds``, or ``error``)."""

    attempt: Attempt
    result: dict


class Recovery:
    """This rank's part in failure recovery (see the module docstring). Training thread only, apart from the
    helper thread of :meth:`recover` / :meth:`replace` / :meth:`prefetch`, which the training thread waits for,
    and the thread :meth:`prefetch` starts to watch for the plan."""

    def __init__(self, control: Control, reports: Reporter, ledger: StepLedger, exchange: StepExchange,
                 stopper: VoidPassStopper) -> None:
        self.control = control
        self.reports = reports
        self.ledger = ledger
        self.exchange = exchange
        self.stopper = stopper
        self._prefetched: Optional[_Launched] = None  # a replacement's plan carried out during its shadow iterations
        self._prefetch_lock = threading.Lock()
        self._prefetch_open = False  # prefetch() watches for the plan until replace() takes over

    # --- survivor --------------------------------------------------------------------------------------------------
    def recover(self, attempted: int, done: bool) -> int:
        """Survivor: after a failure noticed in step ``attempted`` (``done``: that step committed here anyway),
        halt, follow tmd's recovery plan and return the step to resume at. Exits the process (ExitCode.FAILED)
        after ``RECOVERY_TIMEOUT_S`` seconds without word from tmd."""
        committed = attempted if done else attempted - 1
        rng_next = torch.get_rng_state() if done else self.ledger.rng_snapshot  # RNG at the start of committed + 1
        if not done and self.ledger.copied_at == attempted:  # before this rank's state is sent to anyone
            self.ledger.restore_buffers()
            self.ledger.restore_objects()
            self.ledger.restore_closure_steps(attempted)
            self.ledger.restore_grad_scaler_scales()
        self.control.enter(Stage.HALTED)
        if self.control.halt is None:  # we saw it first (a peer's socket closed): a detection signal for tmd
            self.reports.report(0, p.RecoveryPhase.COLLECTIVE_FAILED, ok=False, error=failure(self.control) or "",
                                step=committed)
        while True:
            self._wait(lambda: self.control.halt is not None, "a halt")
            halt = self.control.halt
            self.reports.report(halt.incident_id, p.RecoveryPhase.HALTED, step=committed,
                                snapshots=self.exchange.snapshots.held() if self.exchange.snapshots else ())
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
                    self._prefetched = self._launch(plan, None)
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
                launched = self._take_prefetched(plan) or self._launch(plan, None)
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
        resume = self._complete(self._launch(plan, committed), rng_next)
        self.ledger.restore_gradients()
        self.ledger.restore_grad_scalers()
        return resume

    def _launch(self, plan: p.Recover, committed: Optional[int]) -> _Launched:
        """Start carrying out ``plan`` on a helper thread (a dead peer can block a rendezvous or a transfer for
        the gloo timeout): send what the plan names, receive this rank's state, build the next generation of
        every group. Raises RuntimeError when the plan does not fit this rank (nothing started then)."""
        rank = self.control.rank
        incident = plan.incident_id
        rollback = plan.rollback_step >= 0
        receive_from = next((s for s, d in plan.sends if d == rank), None)
        send_to = sorted(d for s, d in plan.sends if s == rank)
        if rollback and committed is not None and receive_from is None:
            if self.exchange.snapshots is None or plan.rollback_step not in self.exchange.snapshots.held():
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
                snap = self.exchange.snapshots.kept_copy(plan.rollback_step)  # KeyError: not held (tmd checked it is)
                return self.exchange.snapshots.frozen(snap), {"step": plan.resume_step, "rank_state": snap.rank_state}
            own = self.exchange.own_state(dst, plan.resume_step - 1)
            if own is None:  # never the sender's RNG in its place: the receiver would silently diverge
                raise RuntimeError(f"rank {rank} keeps no rank state (RNG, rank-local objects) of rank {dst} at "
                                   f"step {plan.resume_step - 1}, the step rank {dst} resumes after")
            return self.ledger.replicated, {"step": plan.resume_step, "rank_state": own}

        def work() -> None:
            started = time.perf_counter()
            try:
                # This attempt's thread has a store connection of its own (worker.store): an abandoned prepare
                # or an earlier attempt may still be blocked in a rendezvous with a lost peer on another thread.
                # One thread, one order on every rank (transfer groups by receiver, then the
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
            if extra.get("rank_state") is None:  # never the sender's RNG and no rank-local state: a silent divergence
                raise RuntimeError(f"recovery {incident}: rank {rank} was sent no rank state of its own (RNG, "
                                   f"rank-local objects) for step {plan.resume_step}")
            transfer.load_state(self.ledger.replicated, states)  # KeyError if the sets of objects differ
            rank_state.restore(rank_state.deserialize(extra["rank_state"]), self.ledger.local)
            rng_next = None
            if rollback and self.exchange.snapshots is not None:  # hold what came as this rank's snapshot of that step
                live = {name: obj.state_dict() for name, obj in self.ledger.replicated.items()}  # adopt() copies it
                self.exchange.snapshots.adopt(Snapshot(plan.rollback_step, live, extra["rank_state"]))
        elif rollback:
            own = self.exchange.snapshots.own_copy(plan.rollback_step)
            transfer.load_state(self.ledger.replicated, own.states)
            rank_state.restore(rank_state.deserialize(own.rank_state), self.ledger.local)
            rng_next = None
        if rollback:
            self.exchange.kept = self.exchange.exchanged = None  # rank-state copies of steps that are redone
        self.exchange.snapshot_round = None  # a round of the interrupted step: the ranks resume with a fresh one (want)
        groups.install(result["built"], plan.generation)
        self.stopper.reset_reducers()
        if rng_next is not None:
            torch.set_rng_state(rng_next)
        self.control.recovered(attempt)
        self.ledger.committed_step = plan.resume_step - 1
        self.exchange.after_recovery()
        self.reports.report(incident, p.RecoveryPhase.RECOVERED, step=plan.resume_step - 1,
                            bytes_moved=result["moved"], seconds=result["seconds"])
        print(f"[worker] rank {rank} recovered from incident {incident}: resuming at step "
              f"{plan.resume_step} (generation {plan.generation})", flush=True)
        return plan.resume_step

"""Planned migration on the rank side (TrainMover, arXiv 2412.12636): the joiner's shadow iterations and join,
and the switch step of the leaver and the stayers.

- **Joiner** (a standby given the leaver's rank): :meth:`Migration.shadow` runs the script's first steps in the
  sandbox (every collective replayed from the leaver's recording, worker.sandbox) to warm up allocator, DDP and
  optimizer, then pre-touches the receive buffers and reports ``warmed``. :meth:`Migration.join` waits for the
  switch step, receives and verifies the leaver's state (worker.transfer), loads it, reports ``transferred``,
  and on tmd's commit swaps in the groups phase 1 built, reports ``committed`` and continues in the leaver's rank
  at the switch step. If the leaver dies instead, tmd sends a recovery plan: the state then comes from a replica
  (worker.recovery).
- **Leaver and stayers**: at the boundary before the switch step (:meth:`Migration.switch_boundary`) the leaver
  sends its state to the joiner; both wait for tmd's decision. On commit a stayer swaps in the staged generation
  (phase 2, between two iterations) and reports ``committed``; the leaver raises :class:`LeaverExit`. On abort
  the staged generation is dropped and training goes on in the old groups.

Phase 1 (building the next generation in the background) is worker.groups' and starts on the agent thread
(worker.commands). The migration's role, switch step and decision are read from worker.control.Control.
"""
from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from typing import Any, Callable, Iterator, Optional

import torch

from tmd import protocol as p
from worker import precopy, transfer
from worker.step_hooks import StepHooks
from worker.control import Control, Stage
from worker.exit import exit_process
from worker.reports import Reporter

log = logging.getLogger("worker.migration")

AGENT_THREAD = "tm-agent"  # worker.agent's thread name
DECISION_TIMEOUT_S = 300.0  # a party waiting at the switch step for tmd's decision gives up (keeps old groups)
PRECOPY_ENV = "TM_PRECOPY"  # "0": the leaver sends its whole state at the switch step (no pre-copy)
PRECOPY_LEAD_STEPS = 1  # the pre-copy starts at the boundary this many steps before the switch step (or later)
EARLY_COMMIT_ENV = "TM_EARLY_COMMIT"  # "0": a joiner reports ``transferred`` only once it loaded the tail at S


def flush_sent(timeout_s: float = 2.0) -> None:
    """Block until ZeroMQ has written out what the stopping agent sent (waits ``timeout_s`` seconds at most for
    the agent thread to end, then at most its socket's linger, 2 s).

    Closing a ZeroMQ socket only hands its queued messages to ZeroMQ's I/O thread; a process that then ends with
    ``os._exit`` (worker.exit) loses whatever that thread had not written yet, e.g. a leaver's ``Done`` (tmd
    journals ``rank_left`` from it). Terminating the context waits for them. Does nothing while the agent thread
    still runs: a ZeroMQ socket must not be closed from another thread. Nothing may be sent afterwards."""
    agent = next((t for t in threading.enumerate() if t.name == AGENT_THREAD), None)
    if agent is not None:
        agent.join(timeout_s)
        if agent.is_alive():
            log.warning("agent thread still running: its last messages may be lost at exit")
            return
    import zmq

    zmq.Context.instance().destroy(linger=0)  # closes the idle inproc sockets; the closed DEALER keeps its linger


class LeaverExit(SystemExit):
    """Raised out of ``session.steps()`` on a leaver after its state was handed over: the process exits 0."""

    def __init__(self) -> None:
        super().__init__(0)


class Migration:
    """This rank's part in planned migrations (see the module docstring). ``objects`` is the session's dict of
    managed objects (by reference); ``finish_agent()`` flushes and stops the agent (a leaver's last act);
    ``step_hooks``: the session's pipeline of optimizer step hooks, which a leaver's pre-copy joins."""

    def __init__(self, control: Control, reports: Reporter, objects: dict[str, Any],
                 finish_agent: Callable[[], None], step_hooks: Optional[StepHooks] = None) -> None:
        self.control = control
        self.step_hooks = step_hooks
        self.precopy: Optional[precopy.Precopy] = None  # a leaver's, between its start and the switch step
        self.reports = reports
        self.objects = objects
        self.finish_agent = finish_agent
        self.migration_id = 0  # a joiner's migration (from its Assign; 0 for a failure's replacement)
        self.prealloc: Optional[list[torch.Tensor]] = None  # a joiner's pre-touched receive buffers
        self.grad_buffers: list[torch.Tensor] = []  # and those of its replayed steps' gradients (worker.precopy)
        self.shadow_steps = 0  # shadow iterations this joiner ran

    # --- joiner ------------------------------------------------------------------------------------------------------
    def shadow(self, n: int, report_warmed: bool, pretouch: bool = True,
               enough_after_one: Optional[Callable[[], bool]] = None,
               another: Optional[Callable[[int], bool]] = None, limit: int = 0,
               close_step: Optional[Callable[[], None]] = None) -> Iterator[int]:
        """Yield the ``n`` shadow steps ``0 .. n-1`` (stage SHADOW: collectives replayed, results thrown away),
        then free the recordings, pre-touch the receive buffers, for the state and for the gradients of replayed
        optimizer steps (if ``pretouch``: a failure's replacement receives into fresh ones) and, if
        ``report_warmed``, report ``warmed``. ``enough_after_one``: called (still in SHADOW) after the first step;
        True ends the shadow iterations there. ``another(k)``: called after the ``n``-th step (``k`` steps run),
        while ``k`` < ``limit``; True runs one more (worker.sandbox ``new_ops_at``: the next recorded step issued
        collectives the last one did not). ``close_step``: called after each step, as the live loop does (the
        per-step exchange of a step without an update is replayed there, where the job recorded it)."""
        groups = self.control.groups
        self.control.enter(Stage.SHADOW)
        prev = time.perf_counter()
        step = 0
        while step < n:
            self.control.set_step(step)
            yield step
            if close_step is not None:
                close_step()
            now = time.perf_counter()
            self.reports.step_time(step, now - prev, shadow=True)
            prev = now
            self.shadow_steps = step + 1
            if step == 0 and n > 1 and enough_after_one is not None and enough_after_one():
                break
            step += 1
            if step == n < limit and another is not None and another(step):
                n += 1
        self.control.enter(Stage.JOINING)
        for g in groups.groups.values():
            g.mover.load_recording([])  # free the recordings
        if pretouch:
            self.prealloc = transfer.pretouch(transfer.plan_buffers(self.objects))
            self.grad_buffers = precopy.gradient_buffers(self.objects)
        if report_warmed:
            self.reports.report(self.migration_id, p.MigrationPhase.WARMED, shadow_steps=self.shadow_steps)

    def drop_buffers(self) -> None:
        """Free the pre-touched receive buffers (a replacement receives its state into fresh ones)."""
        self.prealloc, self.grad_buffers = None, []

    def join(self) -> Optional[int]:
        """Joiner: wait for the switch, receive and verify the leaver's state, commit, and return the switch step
        (the step to continue at). Returns None when the leaver died and tmd sent a recovery plan instead: the
        caller then follows it (worker.recovery). Exits the process (ExitCode.FAILED) when the transfer failed
        or the migration was not committed within ``DECISION_TIMEOUT_S`` seconds and no plan came."""
        mid = self.migration_id
        control = self.control
        groups = control.groups
        control.wait_until(lambda: control.switch is not None or control.plan is not None)
        if control.plan is not None:
            self.drop_buffers()
            return None
        switch = control.switch
        early: list[int] = []  # the pre-copy's bytes, once reported

        def precopied(moved: int, seconds: float) -> None:
            # A pre-copy is loaded: the rest (replayed gradients, the tail) follows step by step. Reporting
            # ``transferred`` now lets tmd decide the commit before the switch step (see the module docstring).
            early.append(moved)
            self.reports.report(mid, p.MigrationPhase.TRANSFERRED, bytes_moved=moved, seconds=seconds)

        try:
            pg = groups.transfer_group(mid, DECISION_TIMEOUT_S)
            # Load before the decision: on an abort this sandboxed process is thrown away. A state that does not
            # fit (other keys, shards of another layout) is refused here, tmd aborts and training goes on.
            early_ok = os.environ.get(EARLY_COMMIT_ENV) != "0"
            extra, moved, seconds = precopy.follow(pg, self.objects, self.prealloc, self.grad_buffers,
                                                   on_precopy=precopied if early_ok else None)
        except Exception as e:  # noqa: BLE001 - reported; tmd aborts, or falls back to a replica (after an
            # early ``transferred`` the commit may be decided already: this rank is then lost, see below)
            self.reports.report(mid, p.MigrationPhase.TRANSFERRED, ok=False, error=e)
            control.wait_until(lambda: control.decision is not None or control.plan is not None, DECISION_TIMEOUT_S)
            if control.plan is not None:
                groups.discard(mid)
                self.drop_buffers()
                return None
            exit_process(p.ExitCode.FAILED, f"joiner for rank {control.rank}: state transfer of migration {mid} "
                                            f"failed ({type(e).__name__}: {e}) and no recovery plan came")
        self.drop_buffers()
        torch.set_rng_state(extra["rng"])
        if not early:
            self.reports.report(mid, p.MigrationPhase.TRANSFERRED, bytes_moved=moved, seconds=seconds)
        control.wait_until(lambda: control.decision is not None, DECISION_TIMEOUT_S)
        decision = control.decision
        if decision is None or not decision.commit:
            exit_process(p.ExitCode.FAILED, f"joiner for rank {control.rank}: migration {mid} was "
                                            + ("not committed" if decision is not None else
                                               f"not decided within {DECISION_TIMEOUT_S:.0f} s"))
        groups.commit(mid)
        groups.set_mode(p.MoverMode.LIVE)
        groups.set_tolerant()
        control.clear_switch(mid)  # acted on here: the switch step is where this rank's steps begin
        control.become_active()
        self.reports.report(mid, p.MigrationPhase.COMMITTED, step=switch.step,
                            bytes_moved=moved - early[0] if early else 0, ready_unix_s=time.time())
        return extra["step"]

    # --- leaver and stayers ------------------------------------------------------------------------------------------
    def before_switch(self, step: int) -> None:
        """At a boundary before ``step`` that is not a switch step: a leaver whose switch step is armed at most
        ``PRECOPY_LEAD_STEPS`` ahead starts its pre-copy (worker.precopy) here, once (a later start means fewer
        optimizer steps for the joiner to replay), and tells it when ``step`` is the last before the switch step;
        one whose migration ended without a switch drops it."""
        control = self.control
        switch, pc = control.switch, self.precopy
        if pc is not None and (switch is None or switch.migration_id != pc.migration_id):
            pc.cancel()
            self.precopy = None
        if switch is None:
            return
        if self.precopy is None and 0 < switch.step - step <= PRECOPY_LEAD_STEPS \
                and control.migration_role == p.MigrationRole.LEAVER and os.environ.get(PRECOPY_ENV) != "0":
            try:
                pg = control.groups.transfer_group(switch.migration_id, 1.0)
            except RuntimeError as e:  # no transfer group: the switch step sends everything (and reports it)
                log.warning("rank %d: no pre-copy for migration %d: %s", control.rank, switch.migration_id, e)
                return
            self.precopy = precopy.Precopy(pg, switch.migration_id, self.objects,
                                           ops_issued=control.groups.ops_issued, hooks=self.step_hooks)
            self.precopy.start(step)
        if self.precopy is not None and switch.step - step == 1:
            self.precopy.last_step()

    def switch_boundary(self, switch: p.Switch) -> None:
        """At the start of the switch step: the leaver sends its state; stayers and leaver wait for the decision
        (at most ``DECISION_TIMEOUT_S`` seconds; none: keep the old groups). Raises :class:`LeaverExit` on a
        leaver whose migration committed."""
        paused = time.perf_counter()
        mid = switch.migration_id
        control = self.control
        groups = control.groups
        role = control.migration_role
        control.enter(Stage.SWITCHING)
        if role == p.MigrationRole.LEAVER:
            pc, self.precopy = self.precopy, None
            try:
                how = {}
                if pc is not None and pc.migration_id == mid:  # only the tail is left to send
                    moved, seconds = pc.finish(switch.step, torch.get_rng_state())
                    how = {"precopy_step": pc.step, "kept_tensors": pc.kept}
                else:
                    if pc is not None:
                        pc.cancel()
                    pg = groups.transfer_group(mid, DECISION_TIMEOUT_S)
                    moved, seconds = transfer.send_state(pg, self.objects, {
                        "kind": precopy.Kind.FULL.value, "step": switch.step, "rng": torch.get_rng_state()})
                self.reports.report(mid, p.MigrationPhase.SENT, bytes_moved=moved, seconds=seconds, **how)
            except Exception as e:  # noqa: BLE001 - the joiner or its group failed: tmd aborts, we go on
                self.reports.report(mid, p.MigrationPhase.SENT, ok=False, error=e)
        elif not groups.staged(mid):
            control.clear_switch(mid)
            control.enter(Stage.TRAINING)
            return  # none of this rank's groups contains a leaver: nothing to swap
        control.wait_until(lambda: control.decision is not None, DECISION_TIMEOUT_S)
        decision = control.decision
        control.clear_switch(mid)
        if decision is None or decision.migration_id != mid or not decision.commit:
            groups.discard(mid)
            control.enter(Stage.TRAINING)
            return
        if role == p.MigrationRole.LEAVER:
            pg = None  # the traceback of LeaverExit keeps this frame alive: hold no group in it
            if pc is not None and pc.migration_id == mid:
                try:  # the commit may have been decided before the tail left: exit only once it is loaded
                    pc.delivered()
                except RuntimeError as e:  # the joiner is lost: tmd treats that as its node's failure
                    log.warning("rank %d: migration %d's tail was not confirmed: %s", control.rank, mid, e)
            pc = None
            groups.finish_transfer(mid)
            control.enter(Stage.LEFT)
            self.reports.done(switch.step - 1, left=True)
            self.finish_agent()
            flush_sent()  # what is still queued goes out before os._exit (the Done too, if tmd's ack did not come)
            print(f"[worker] rank {control.rank} handed over at step {switch.step}; leaving", flush=True)
            # The script's own finally blocks still run as LeaverExit unwinds; then skip the interpreter's
            # teardown (seconds of CPU for torch, stolen from co-located ranks that train on).
            atexit.register(exit_process, p.ExitCode.OK,
                            f"rank {control.rank} left after handing over at step {switch.step} "
                            "(interpreter teardown skipped)")
            raise LeaverExit()
        groups.commit(mid)
        control.enter(Stage.TRAINING)
        self.reports.report(mid, p.MigrationPhase.COMMITTED, step=switch.step, seconds=time.perf_counter() - paused,
                            ready_unix_s=time.time())

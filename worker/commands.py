"""The agent thread's side of the worker: each command from tmd goes into :class:`worker.control.Control`.

:class:`Commands` is the ``on_message`` callback of worker.agent.Agent; it runs on the agent thread. For most
commands it only hands the message to the Control (the training thread acts on it at a step boundary). A few
must act at once, here on the agent thread, because the training thread may be blocked where it cannot look:

- ``Halt``: an active rank fails every mover (a collective blocked on a dead peer returns at once);
- ``Release`` of a standby, a joiner or a fenced process: the process exits (worker.exit) wherever it is blocked;
- ``Decide(commit=False)``: what phase 1 built for that migration is dropped, and a joiner exits (its sandboxed
  process is thrown away; tmd starts a fresh standby);
- ``Prepare``: phase 1 starts on its own background thread (worker.groups), which reports ``prepared``;
- ``Switch``: the ``armed`` answer goes out at once (tmd waits for every party's answer);
- ``Reregister`` (a restarted tmd): future groups are built in the new store, and ``Rejoin`` answers.

The heartbeat callback (:meth:`Commands.heartbeat`) also runs here.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

from tmd import protocol as p
from worker.control import Control
from worker.exit import exit_process
from worker.reports import Reporter

log = logging.getLogger("worker.commands")


class Commands:
    """Dispatches tmd's commands (agent thread). ``rejoin(rank, role, step, generation)`` sends the Rejoin;
    ``gpu_sample()`` returns the GPU probe's sample for heartbeats (``{}`` without a GPU)."""

    def __init__(self, control: Control, reports: Reporter, rejoin: Callable[[int, p.WorkerRole, int, int], None],
                 gpu_sample: Callable[[], dict]) -> None:
        self.control = control
        self.reports = reports
        self.rejoin = rejoin
        self.gpu_sample = gpu_sample
        self.handlers: dict[type, Callable[[Any], None]] = {
            p.Assign: self.control.on_assign,
            p.Release: self.on_release,
            p.Halt: self.on_halt,
            p.Reregister: self.on_reregister,
            p.Recover: self.control.on_recover,
            p.Prepare: self.on_prepare,
            p.Switch: self.on_switch,
            p.Decide: self.on_decide,
            p.DoneAck: self.reports.on_done_ack,
        }

    def on_message(self, msg: p.Message) -> None:
        """Handle one command from tmd. Messages tmd does not send to workers are logged and dropped."""
        handler = self.handlers.get(type(msg))
        if handler is None:
            log.warning("ignoring %s: not a command for a worker", msg.TYPE)
            return
        handler(msg)

    def heartbeat(self) -> p.Heartbeat:
        """The heartbeat: the step this process is on and the world mover's counters (plus ``gpu``)."""
        _, _, step, groups = self.control.rejoin_view()
        mover = groups.world if groups is not None else None
        counters = mover.counters() if mover is not None else {}
        gpu = self.gpu_sample()
        if gpu:
            counters["gpu"] = gpu
        return p.Heartbeat(step=step, counters=counters)

    def on_release(self, msg: p.Release) -> None:
        if self.control.on_release(msg):  # at once: wherever the training thread is blocked
            exit_process(msg.exit_code, f"released by tmd: {msg.reason}")

    def on_halt(self, msg: p.Halt) -> None:
        if self.control.on_halt(msg):  # at once: a collective blocked on a dead peer returns
            self.control.groups.fail_all(f"halted by tmd (incident {msg.incident_id}): {msg.reason}")

    def on_reregister(self, msg: p.Reregister) -> None:
        """A restarted tmd (``tmd resume``) re-learns the job from its workers: build future groups in its store
        (connecting may take a while: done outside the Control's lock), then answer with Rejoin."""
        groups = self.control.groups
        if groups is not None:
            groups.set_store(msg.store_host, msg.store_port)
        rank, role, step, groups = self.control.rejoin_view()
        self.rejoin(rank, role, step, groups.generation if groups is not None else -1)

    def on_prepare(self, msg: p.Prepare) -> None:
        """Phase 1 of ``msg.migration_id``: build the next generation on a background thread; it reports
        ``prepared`` when done (ok or not). Refused (``prepared`` not ok, nothing changes) while this rank has
        another migration's switch step armed: that switch step reads the role and decision a Prepare replaces
        (tmd holds a Prepare until every stayer passed the previous switch step; this guards the rank anyway)."""
        refused = self.control.on_prepare(msg)
        if refused:
            log.warning("refusing Prepare of migration %d: %s", msg.migration_id, refused)
            self.reports.report(msg.migration_id, p.MigrationPhase.PREPARED, ok=False, error=refused)
            return
        groups = self.control.groups
        if groups is None:
            log.warning("ignoring Prepare of migration %d: no rank assigned yet", msg.migration_id)
            return

        def done(ok: bool, error: str, rebuilt: list) -> None:
            self.reports.report(msg.migration_id, p.MigrationPhase.PREPARED, ok=ok, error=error, groups=rebuilt)

        groups.prepare(msg.migration_id, msg.generation, msg.role, msg.leaver_ranks, msg.transfer_prefix, done)

    def on_switch(self, msg: p.Switch) -> None:
        armed = self.control.on_switch(msg)
        self.reports.report(msg.migration_id, p.MigrationPhase.ARMED, ok=armed.accepted, error=armed.error,
                            step=armed.step)

    def on_decide(self, msg: p.Decide) -> None:
        joiner_aborted = self.control.on_decide(msg)
        if msg.commit:
            return
        if joiner_aborted is None:
            log.warning("abort of migration %d ignored: its commit was decided already (%s)", msg.migration_id,
                        msg.reason)
            return
        groups = self.control.groups
        if groups is not None:
            groups.discard(msg.migration_id)
        if joiner_aborted:  # the sandboxed process is thrown away; tmd starts a fresh standby
            exit_process(p.ExitCode.OK, f"joiner for rank {self.control.rank} aborted: {msg.reason}")

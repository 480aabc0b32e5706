"""Where this worker process stands, and the commands from tmd it has not acted on yet: :class:`Control`.

Two threads share it. The **agent thread** (worker.agent, through worker.commands) hands every command from tmd
to it and returns; the **training thread** (the script, inside ``Session.steps()``) reads it at step boundaries
and waits on it. Every field below is read and written under ONE ``threading.Condition`` (``Control._cv``, over a
re-entrant lock, so a wait predicate may read the public properties); every change a waiter may care about
notifies it. No other lock, Event or flag is shared between those threads.

Fields: ``stage`` (a :class:`Stage`), ``role`` (a :class:`tmd.protocol.WorkerRole`), ``rank``, ``step`` (the
step the training thread is on), ``groups`` (this rank's GroupManager once built), and the inbox: ``assign`` /
``release`` (tmd's answer to a standby's registration), ``migration_role`` and ``decision`` (the migration being
prepared and its outcome), ``switch`` (the armed switch step), ``halt`` and ``plan`` (the failure incident and
its recovery plan).

Stages (where the process is; worker.session, worker.migration and worker.recovery move it)::

    STANDBY   --Assign(active)------------------------------------------------> TRAINING
    STANDBY   --Assign(joiner)------------------------------------------------> JOINING
    JOINING   --shadow iterations--> SHADOW --done--------------------------> JOINING
    JOINING   --leaver's state received, migration committed-----------------> TRAINING
    JOINING   --replacement of a failed rank (or its leaver died)------------> RECOVERING
    JOINING   --a guard (tmd.guards) waits here until a recovery or a migration takes it
    TRAINING  --armed switch step reached-------------------------------------> SWITCHING
    SWITCHING --committed or aborted (stayer); aborted (leaver)---------------> TRAINING
    SWITCHING --committed (leaver: LeaverExit)--------------------------------> LEFT
    TRAINING  --a failure (latched collective error or tmd's Halt)-----------> HALTED
    HALTED    --tmd's plan for the current halt-------------------------------> RECOVERING
    RECOVERING --plan carried out---------------------------------------------> TRAINING
    RECOVERING --superseded by a newer Halt, or failed------------------------> HALTED
    TRAINING  --end of the loop (Session.finish)------------------------------> FINISHED

An armed switch step is held beside the stage (``switch``), not as a stage: tmd may arm it while the process
is in SHADOW, JOINING, TRAINING or HALTED, and it takes effect at the boundary before its step.

Rules decided here (unit-tested in tests/unit/test_worker_control.py):

- a newer ``Halt`` (higher incident id) supersedes an older one; an older one is ignored;
- a ``Switch`` for a step an active rank already reached is refused as late (a joiner is never late: it has not
  started the rank's steps yet);
- ``Decide(commit=False)`` disarms that migration's switch step, unless that migration's commit was decided
  already (a commit is final); a ``Prepare`` forgets the previous decision;
- a ``Release`` of a standby, a joiner or a fenced process (``ExitCode.FENCED``) must end the process at once.

What must happen at once on the agent thread (failing movers, exiting, starting phase 1, switching the store) is
not done here: :mod:`worker.commands` does it with what these methods return.
"""
from __future__ import annotations

import enum
import threading
from typing import Any, Callable, NamedTuple, Optional, Union

from tmd import protocol as p


class Stage(enum.StrEnum):
    """Where a worker process is (see the module docstring for the transitions)."""

    STANDBY = "standby"  # registered, warm, no rank yet
    JOINING = "joining"  # a joiner (planned migration or replacement) outside its shadow iterations
    SHADOW = "shadow"  # a joiner's shadow iterations: collectives replayed from the recording
    TRAINING = "training"  # an active rank between switch steps and failures
    SWITCHING = "switching"  # at the switch step: the leaver sends, leaver and stayers await tmd's decision
    HALTED = "halted"  # a survivor stopped at a step boundary after a failure, awaiting tmd's plan
    RECOVERING = "recovering"  # carrying out a recovery plan (survivor), or a replacement awaiting/doing one
    LEFT = "left"  # a leaver that handed its rank over
    FINISHED = "finished"  # the training loop ended; Done was sent


class Armed(NamedTuple):
    """The answer to a ``Switch``: ``accepted`` false means late (``error`` says why); ``step`` is the step the
    rank is on now (-1 on a joiner, whose steps have not begun)."""

    accepted: bool
    error: str
    step: int


class Attempt:
    """One recovery plan being carried out on a helper thread while the training thread watches for a newer
    failure. ``finished`` (the helper is done) and ``cancelled`` (the training thread gave up on it) are guarded
    by the Control's Condition: exactly one of the two threads ends up owning what the helper built."""

    def __init__(self, halt: Optional[p.Halt], plan: p.Recover) -> None:
        self.halt = halt
        self.plan = plan
        self.finished = False
        self.cancelled = False


class Control:
    """The shared state of one worker process (see the module docstring). Thread safe: every method and
    property takes the one Condition."""

    def __init__(self) -> None:
        self._cv = threading.Condition(threading.RLock())
        self._stage = Stage.STANDBY
        self._role = p.WorkerRole.STANDBY
        self._rank = -1
        self._step = -1
        self._groups: Optional[Any] = None  # worker.groups.GroupManager, once built
        self._assign: Optional[p.Assign] = None
        self._release: Optional[p.Release] = None
        self._migration_role: Optional[p.MigrationRole] = None
        self._migration_id = 0  # the migration last prepared (0: none)
        self._switch: Optional[p.Switch] = None
        self._decision: Optional[p.Decide] = None
        self._halt: Optional[p.Halt] = None
        self._plan: Optional[p.Recover] = None

    # --- read (either thread) ------------------------------------------------------------------------------------
    @property
    def stage(self) -> Stage:
        with self._cv:
            return self._stage

    @property
    def role(self) -> p.WorkerRole:
        with self._cv:
            return self._role

    @property
    def rank(self) -> int:
        with self._cv:
            return self._rank

    @property
    def step(self) -> int:
        """The step the training thread is on (-1 before training)."""
        with self._cv:
            return self._step

    @property
    def groups(self) -> Optional[Any]:
        """This rank's GroupManager, None before the rank is assigned."""
        with self._cv:
            return self._groups

    @property
    def migration_role(self) -> Optional[p.MigrationRole]:
        """This rank's part in the migration last prepared (None: none prepared)."""
        with self._cv:
            return self._migration_role

    @property
    def migration_id(self) -> int:
        """The id of the migration last prepared (0: none prepared)."""
        with self._cv:
            return self._migration_id

    @property
    def switch(self) -> Optional[p.Switch]:
        """The armed switch step, None when none is armed."""
        with self._cv:
            return self._switch

    @property
    def decision(self) -> Optional[p.Decide]:
        """tmd's decision on the migration last prepared, None until it comes."""
        with self._cv:
            return self._decision

    @property
    def halt(self) -> Optional[p.Halt]:
        """The newest failure incident not recovered from yet, or None."""
        with self._cv:
            return self._halt

    @property
    def plan(self) -> Optional[p.Recover]:
        """The recovery plan received and not carried out yet, or None."""
        with self._cv:
            return self._plan

    def halt_reason(self) -> Optional[str]:
        """``"halted by tmd: <reason>"`` while a halt is pending, else None."""
        with self._cv:
            return f"halted by tmd: {self._halt.reason}" if self._halt is not None else None

    def rejoin_view(self) -> tuple[int, p.WorkerRole, int, Optional[Any]]:
        """(rank, role, step, groups), read together: what a Rejoin reports."""
        with self._cv:
            return self._rank, self._role, self._step, self._groups

    # --- commands from tmd (agent thread) ------------------------------------------------------------------------
    def on_assign(self, msg: p.Assign) -> None:
        with self._cv:
            self._assign = msg
            self._cv.notify_all()

    def on_release(self, msg: p.Release) -> bool:
        """Keep ``msg``; returns True when the process must exit at once: a standby or a joiner holds nothing of
        value, and a fenced process (declared failed, its ranks taken over) must not touch the job again,
        wherever it is blocked."""
        with self._cv:
            self._release = msg
            self._cv.notify_all()
            return self._role in (p.WorkerRole.STANDBY, p.WorkerRole.JOINER) or msg.exit_code == p.ExitCode.FENCED

    def on_halt(self, msg: p.Halt) -> bool:
        """Keep ``msg`` unless a newer incident is already held. Returns True when this process is an active rank
        with groups: its movers must then fail at once (a collective blocked on a dead peer must return)."""
        with self._cv:
            if self._halt is None or msg.incident_id > self._halt.incident_id:
                self._halt = msg
            self._cv.notify_all()
            return self._groups is not None and self._role == p.WorkerRole.ACTIVE

    def on_recover(self, msg: p.Recover) -> None:
        with self._cv:
            self._plan = msg
            self._cv.notify_all()

    def on_prepare(self, msg: p.Prepare) -> str:
        """A new migration: remember this rank's part in it and forget the previous decision. Refused (returns
        why; nothing changes) while another migration's switch step is armed and not behind this rank: the
        training thread acts on it with that migration's role and decision. Returns "" when taken."""
        with self._cv:
            armed = self._switch
            if armed is not None and armed.migration_id != msg.migration_id and armed.step >= self._step:
                return (f"switch step {armed.step} of migration {armed.migration_id} is armed here (at step "
                        f"{self._step})")
            self._migration_role, self._migration_id = msg.role, msg.migration_id
            self._decision = None
            self._cv.notify_all()
            return ""

    def on_switch(self, msg: p.Switch) -> Armed:
        """Arm the switch step unless it is late (an active rank already at or past ``msg.step``)."""
        with self._cv:
            joiner = self._role == p.WorkerRole.JOINER
            late = not joiner and self._step >= msg.step
            if not late:
                self._switch = msg
                self._cv.notify_all()
            return Armed(not late, f"already at step {self._step}" if late else "", -1 if joiner else self._step)

    def on_decide(self, msg: p.Decide) -> Optional[bool]:
        """Keep tmd's decision; an abort disarms that migration's switch step. A commit is final: an abort of a
        migration already decided as committed is ignored (returns None; tmd never sends one, but parties past
        the switch step already run in the new groups). Otherwise returns True when this process is a joiner
        whose migration was aborted (its sandboxed process must exit at once), else False."""
        with self._cv:
            prev = self._decision
            if not msg.commit and prev is not None and prev.commit and prev.migration_id == msg.migration_id:
                return None
            self._decision = msg
            if not msg.commit and self._switch is not None and self._switch.migration_id == msg.migration_id:
                self._switch = None
            self._cv.notify_all()
            return not msg.commit and self._role == p.WorkerRole.JOINER

    # --- the training thread -------------------------------------------------------------------------------------
    def wait_assigned(self, timeout_s: Optional[float] = None) -> Union[p.Assign, p.Release, None]:
        """Block until tmd assigns a rank or releases this process, at most ``timeout_s`` seconds (None: no
        limit). Returns the Release (it wins when both came), else the Assign, or None on timeout."""
        with self._cv:
            self._cv.wait_for(lambda: self._assign is not None or self._release is not None, timeout_s)
            return self._release if self._release is not None else self._assign

    def start(self, msg: p.Assign) -> None:
        """Take the rank and role of ``msg``: an active rank starts TRAINING, a joiner JOINING."""
        with self._cv:
            self._rank = msg.rank
            self._role = msg.role
            self._stage = Stage.TRAINING if msg.role == p.WorkerRole.ACTIVE else Stage.JOINING
            self._cv.notify_all()

    def attach(self, groups: Any) -> None:
        """Publish this rank's GroupManager (the agent thread fails, discards and re-stores through it)."""
        with self._cv:
            self._groups = groups

    def enter(self, stage: Stage) -> None:
        with self._cv:
            self._stage = stage
            self._cv.notify_all()

    def set_step(self, step: int) -> None:
        with self._cv:
            self._step = step

    def boundary(self, step: int) -> Optional[p.Switch]:
        """The training thread reached the boundary before ``step``: record it and return the switch armed for
        exactly this step, or None."""
        with self._cv:
            self._step = step
            return self._switch if self._switch is not None and self._switch.step == step else None

    def clear_switch(self, migration_id: int) -> None:
        """Disarm ``migration_id``'s switch step (it was acted on)."""
        with self._cv:
            if self._switch is not None and self._switch.migration_id == migration_id:
                self._switch = None

    def become_active(self) -> None:
        """A joiner or replacement took its rank over: it is an active rank, TRAINING."""
        with self._cv:
            self._role = p.WorkerRole.ACTIVE
            self._stage = Stage.TRAINING
            self._cv.notify_all()

    def wait_until(self, ready: Callable[[], bool], timeout_s: Optional[float] = None) -> bool:
        """Block until ``ready()`` (evaluated under the Condition; it may read this object's properties) is
        true, at most ``timeout_s`` seconds (None: no limit). Returns False on timeout."""
        with self._cv:
            return self._cv.wait_for(ready, timeout_s)

    # --- a recovery attempt (the training thread and its helper thread) -----------------------------------------
    def superseded(self, attempt: Attempt) -> bool:
        """A newer halt, or another plan, arrived since ``attempt`` started."""
        with self._cv:
            return self._halt is not attempt.halt or (self._plan is not None and self._plan is not attempt.plan)

    def finish_attempt(self, attempt: Attempt) -> bool:
        """The helper thread is done with ``attempt``. Returns True when the training thread already gave up on
        it: the helper then releases what it built."""
        with self._cv:
            attempt.finished = True
            self._cv.notify_all()
            return attempt.cancelled

    def await_attempt(self, attempt: Attempt, timeout_s: float) -> tuple[bool, bool]:
        """Wait up to ``timeout_s`` seconds for the helper to finish or for a newer failure. Returns
        (superseded, finished); when superseded or not finished the attempt is cancelled under the same lock, so
        a helper still running releases what it builds itself."""
        with self._cv:
            self._cv.wait_for(lambda: attempt.finished or self.superseded(attempt), timeout_s)
            newer, done = self.superseded(attempt), attempt.finished
            if newer or not done:
                attempt.cancelled = True
            return newer, done

    def recovered(self, attempt: Attempt) -> None:
        """``attempt``'s plan was carried out: its halt (if still the newest) and the plan are done with."""
        with self._cv:
            if self._halt is attempt.halt:
                self._halt = None
            self._plan = None
            self._cv.notify_all()

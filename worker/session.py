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
"""
from __future__ import annotations

import atexit
import datetime
import logging
import os
import socket
import sys
import threading
import time
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

from tmd import protocol as p
from worker import backend as mb
from worker import sandbox, transfer
from worker.agent import Agent
from worker.gpu_health import probe_from_env
from worker.groups import GroupManager

log = logging.getLogger("worker.session")

DECISION_TIMEOUT_S = 300.0  # a party waiting at the switch step for tmd's decision gives up (keeps old groups)
RECOVERY_TIMEOUT_S = 600.0  # a halted rank that hears nothing from tmd this long exits with an error



def _exit_now(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _prewarm() -> None:
    """On a standby, while it waits: import what DDP (and FSDP, torch.compile) import lazily on first use.
    ``torch._dynamo`` alone takes ~1.1 s to import on this class of machine, which would otherwise land in the
    replacement's critical path after a failure."""
    t0 = time.perf_counter()
    import torch._dynamo  # noqa: F401
    import torch.nn.parallel  # noqa: F401
    log.info("standby pre-warmed in %.2f s", time.perf_counter() - t0)


class StepAborted(RuntimeError):
    """Raised by a managed optimizer's ``step()`` when a collective of this step failed or tmd halted the job
    for a failure: the update is refused (nothing is modified) and :meth:`Session.run` redoes the step after
    recovery, with the same data, so the trajectory stays bit-identical."""


class _Superseded(Exception):
    """A newer Halt arrived while a recovery plan was being carried out."""


class LeaverExit(SystemExit):
    """Raised out of ``session.steps()`` on a leaver after its state was handed over: the process exits 0."""

    def __init__(self) -> None:
        super().__init__(0)


class Session:
    """One rank's handle on the runtime. Attributes: ``rank``, ``world_size``, ``node``, ``local_rank``,
    ``role`` (``active`` or ``joiner``), ``run_dir``, ``is_shadow`` (true during a joiner's shadow iterations)."""

    def __init__(self, agent: Agent, node: str, local_rank: int, run_dir: str) -> None:
        self.agent = agent
        self.node = node
        self.local_rank = local_rank
        self.run_dir = run_dir
        self.rank = -1
        self.world_size = 0
        self.role = "standby"
        self.is_shadow = False
        self.objects: dict[str, Any] = {}
        self.groups: Optional[GroupManager] = None
        self._assign: Optional[p.Assign] = None
        self._assigned = threading.Event()
        self._release: Optional[p.Release] = None
        self._lock = threading.Lock()
        self._step = -1  # the step this process is running (set at each boundary)
        self._switch: Optional[p.Switch] = None
        self._switch_armed = threading.Event()
        self._migration_role = ""
        self._decision: Optional[p.Decide] = None
        self._decided = threading.Event()
        self._record_writer: Optional[threading.Thread] = None
        self._group_names: list[str] = []
        # failure recovery
        self._replicated: dict[str, Any] = {}  # state identical on every data-parallel replica
        self._optimizers: list[torch.optim.Optimizer] = []
        self._stepped: set[int] = set()  # ids of the managed optimizers that stepped in this attempt
        self._committed_step = -1  # last step whose optimizer update this process applied
        self._step_raised = False  # set by run(): the step function raised
        self._rng_snapshot: Optional[torch.Tensor] = None  # CPU RNG at the start of the current attempt
        self._cv = threading.Condition()  # guards _halt and _plan
        self._halt: Optional[p.Halt] = None
        self._plan: Optional[p.Recover] = None
        self._incident_id = 0
        self._gpu = probe_from_env()

    # --- messages from tmd (agent thread) -----------------------------------------------------------------------
    def _on_message(self, msg: p.Message) -> None:
        if isinstance(msg, p.Assign):
            self._assign = msg
            self._assigned.set()
        elif isinstance(msg, p.Release):
            self._release = msg
            self._assigned.set()
            if self.role in ("standby", "joiner") or msg.exit_code == p.ExitCode.FENCED:
                # A standby or joiner holds nothing of value; a fenced process (declared failed, its ranks
                # taken over) must not touch the job again, wherever it is blocked.
                print(f"[worker] released by tmd: {msg.reason}", flush=True)
                os._exit(msg.exit_code)
        elif isinstance(msg, p.Halt):
            with self._cv:
                if self._halt is None or msg.incident_id > self._halt.incident_id:
                    self._halt = msg
                self._cv.notify_all()
            if self.groups is not None and self.role == "active":
                self.groups.fail_all(f"halted by tmd (incident {msg.incident_id}): {msg.reason}")
        elif isinstance(msg, p.Reregister):  # a restarted tmd (tmd resume) re-learns the job from its workers
            if self.groups is not None:
                self.groups.set_store(msg.store_host, msg.store_port)
            self.agent.rejoin(self.rank, self.role, self._step, self.groups.generation if self.groups else -1)
        elif isinstance(msg, p.Recover):
            with self._cv:
                self._plan = msg
                self._cv.notify_all()
        elif isinstance(msg, p.Prepare):
            self._migration_role = msg.role
            self._decision = None
            self._decided.clear()

            def done(ok: bool, error: str, rebuilt: list) -> None:
                self._report(msg.migration_id, "prepared", ok, error, groups=rebuilt)

            self.groups.prepare(msg.migration_id, msg.generation, msg.role, msg.leaver_ranks, msg.transfer_prefix, done)
        elif isinstance(msg, p.Switch):
            with self._lock:
                late = self.role != "joiner" and self._step >= msg.step
                if not late:
                    self._switch = msg
            self._report(msg.migration_id, "armed", not late,
                         f"already at step {self._step}" if late else "", step=self._step if self.role != "joiner" else -1)
            if not late:
                with self._cv:
                    self._switch_armed.set()
                    self._cv.notify_all()
        elif isinstance(msg, p.Decide):
            self._decision = msg
            with self._cv:
                self._decided.set()
                self._cv.notify_all()
            if not msg.commit:
                with self._lock:
                    if self._switch is not None and self._switch.migration_id == msg.migration_id:
                        self._switch = None
                if self.groups is not None:
                    self.groups.discard(msg.migration_id)
                if self.role == "joiner":
                    print(f"[worker] joiner for rank {self.rank} aborted: {msg.reason}", flush=True)
                    os._exit(0)  # the sandboxed process is thrown away; tmd starts a fresh standby

    def _report(self, migration_id: int, phase: str, ok: bool = True, error: str = "", step: int = -1,
                bytes_moved: int = 0, seconds: float = 0.0, groups: Optional[list] = None) -> None:
        self.agent.send(p.PhaseDone(migration_id=migration_id, rank=self.rank, phase=phase, ok=ok, error=error, step=step, bytes_moved=bytes_moved, seconds=seconds,
                                    groups=groups or []))

    def _heartbeat(self) -> p.Heartbeat:
        mover = self.groups.world if self.groups is not None else None
        counters = mover.counters() if mover is not None else {}
        gpu = self._gpu.sample()
        if gpu:
            counters["gpu"] = gpu
        return p.Heartbeat(step=self._step, counters=counters)

    def _report_recovery(self, incident_id: int, phase: str, ok: bool = True, error: str = "",
                         committed_step: int = -1, bytes_moved: int = 0, seconds: float = 0.0) -> None:
        self.agent.send(p.RecoveryReport(incident_id=incident_id, rank=self.rank, phase=phase, ok=ok, error=error, committed_step=committed_step, bytes_moved=bytes_moved,
                                         seconds=seconds))

    # --- set-up -------------------------------------------------------------------------------------------------
    def _start(self, timeout_s: float) -> None:
        self.agent.start()
        if self.agent.standby:
            _prewarm()
        while not self._assigned.wait(1.0):
            pass  # a standby waits here (warm: torch imported, registered, heartbeating) until it is needed
        if self._release is not None:
            raise SystemExit(self._release.exit_code)
        a = self._assign
        self.rank, self.world_size, self.role = a.rank, a.world_size, a.role
        store = dist.TCPStore(a.store_host, a.store_port, is_master=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
        self.groups = GroupManager(store, a.rank, a.world_size, os.environ.get("TM_GLOO_HOST"))
        if a.role == "active":
            self.groups.init_world(a.generation, "record" if a.record_steps > 0 else "live", connect=True)
            self.groups.set_tolerant()
        else:
            self.groups.init_world(a.generation, "replay", connect=False)
            sandbox.start_replay(self.groups.world, a.record_dir, a.rank, "world")
            self._migration_id = a.migration_id
            self._incident_id = a.incident_id

    def new_group(self, ranks: list[int]) -> Optional[dist.ProcessGroup]:
        """A subgroup over global ``ranks`` (e.g. a node's tensor-parallel ranks), backed by a mover like the
        world group, so migrations rebuild it when it contains a leaver and leave it alone otherwise. Every
        process must call this in the same order before the training loop (as with ``dist.new_group``).
        Returns the ProcessGroup on members and None elsewhere. Raises ValueError for bad ranks."""
        a = self._assign
        name = f"group{len(self._group_names)}"
        self._group_names.append(name)
        joiner = self.role == "joiner"
        mode = "replay" if joiner else self.groups.world.mode  # record while the world group records
        pg = self.groups.new_group(name, ranks, a.generation, mode, connect=not joiner)
        if joiner and pg is not None:
            sandbox.start_replay(self.groups.groups[name].mover, a.record_dir, self.rank, name)
        elif pg is not None:
            self.groups.groups[name].mover.tolerant = True
        return pg

    def manage(self, rank_local: bool = False, **objects: Any) -> None:
        """Hand over the state that moves with this rank: objects with ``state_dict()``/``load_state_dict()``
        (model, optimizer, LR scheduler, data sampler...). A planned migration moves all of it to the joiner.

        ``rank_local=False`` (model, optimizer, scheduler): the state is identical on every data-parallel
        replica, so after a failure a replacement (or a survivor one step behind) receives it from a replica.
        ``rank_local=True`` (a data sampler built for this rank): not copied between ranks after a failure; it
        must make each step's data a function of the step number (the redone step asks for the same step).

        Managed optimizers get a step pre-hook that raises :class:`StepAborted` when a collective of the step
        failed (nothing is updated then) and a post-hook that records the step as committed.
        Raises TypeError for an object without state_dict/load_state_dict."""
        for name, obj in objects.items():
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise TypeError(f"managed object {name!r} has no state_dict/load_state_dict")
        self.objects.update(objects)
        if not rank_local:
            self._replicated.update(objects)
        for obj in objects.values():
            if isinstance(obj, torch.optim.Optimizer) and obj not in self._optimizers:
                self._optimizers.append(obj)
                obj.register_step_pre_hook(self._before_optimizer_step)
                obj.register_step_post_hook(self._after_optimizer_step)

    def _failure(self) -> Optional[str]:
        """Why the current step cannot commit (a latched collective failure, or tmd's halt), or None."""
        if self._halt is not None:
            return f"halted by tmd: {self._halt.reason}"
        return self.groups.failure() if self.groups is not None and self.role == "active" else None

    def _before_optimizer_step(self, optimizer, args, kwargs) -> None:
        why = self._failure()
        if why:
            raise StepAborted(f"rank {self.rank} step {self._step}: update refused, {why}")

    def _after_optimizer_step(self, optimizer, args, kwargs) -> None:
        self._stepped.add(id(optimizer))
        if len(self._stepped) == len(self._optimizers):
            self._committed_step = self._step

    # --- the training loop ----------------------------------------------------------------------------------
    def run(self, step_fn: Callable[[int], Any], total: int) -> None:
        """Run ``step_fn(step)`` for every step this process owns (see :meth:`steps`), recovering from peer
        failures in process: when a collective of a step fails (a peer died, hung or was cut off), the step's
        optimizer update is refused (:class:`StepAborted`), the survivors agree with tmd on the last committed
        step, lagging survivors and the replacement receive state from a data-parallel replica, every group is
        rebuilt, and the step is redone with the same data. ``step_fn`` must draw its data from the step number
        and do at most one update per managed optimizer. Exceptions not caused by a failure are raised."""
        for step in self.steps(total):
            self._step_raised = False
            try:
                step_fn(step)
            except Exception:
                if self._failure() is None:
                    raise
                self._step_raised = True
                log.warning("rank %d step %d interrupted by a failure: %s", self.rank, step, self._failure())

    def steps(self, total: int) -> Iterator[int]:
        """Yield the step numbers this process runs, ``0 .. total-1`` on an active rank. A joiner first yields
        its shadow steps (``is_shadow`` true: collectives replayed, results thrown away), then blocks until the
        switch step S and continues with ``S .. total-1`` in the leaver's rank. On a leaver, the loop ends by
        raising :class:`LeaverExit` (exit code 0) once its state is handed over. After a failure the loop
        recovers and yields the interrupted step again; only :meth:`run` survives a failure inside a step (a
        plain ``for`` body sees :class:`StepAborted` from the optimizer)."""
        a = self._assign
        step = 0
        if self.role == "joiner":
            yield from self._shadow(min(a.record_steps, total))
            step = self._join() if self._incident_id == 0 else self._replace(self._incident_id)
        prev = None
        while step < total:
            t0 = time.perf_counter()
            if prev is not None:
                self.agent.send(p.StepReport(rank=self.rank, step=step - 1, step_time_s=t0 - prev, shadow=False))
            prev = t0
            with self._lock:
                self._step = step
                switch = self._switch if self._switch is not None and self._switch.step == step else None
            if self.role == "active" and step == a.record_steps and self._record_writer is None:
                self._record_writer = sandbox.save_recordings_async(
                    {g.name: g.mover for g in self.groups.groups.values()}, a.record_dir, self.rank)
            if switch is not None:
                self._switch_boundary(switch)
            self._stepped.clear()
            self._rng_snapshot = torch.get_rng_state()
            if self._failure() is None:
                yield step
                if self._failure() is None:
                    step += 1
                    continue
                done = self._committed_step == step if self._optimizers else not self._step_raised
            else:
                done = False  # halted before the step began
            step = self._recover(step, done)
            prev = None  # the recovery is downtime, not a step time
        if prev is not None:
            self.agent.send(p.StepReport(rank=self.rank, step=step - 1, step_time_s=time.perf_counter() - prev, shadow=False))
        with self._lock:
            self._step = step

    # --- failure recovery ---------------------------------------------------------------------------------------
    def _recover(self, attempted: int, done: bool) -> int:
        """Survivor: after a failure noticed in step ``attempted`` (``done``: that step committed here anyway),
        halt, follow tmd's recovery plan and return the step to resume at."""
        committed = attempted if done else attempted - 1
        rng_next = torch.get_rng_state() if done else self._rng_snapshot  # RNG at the start of committed + 1
        with self._cv:
            halted = self._halt is not None
        if not halted:  # we saw it first (a peer's socket closed): a detection signal for tmd
            self._report_recovery(0, "collective_failed", False, self._failure() or "", committed)
        while True:
            self._wait_cv(lambda: self._halt is not None, "a halt")
            halt = self._halt
            self._report_recovery(halt.incident_id, "halted", committed_step=committed)
            self._wait_cv(lambda: self._halt is not halt or (
                self._plan is not None and self._plan.incident_id == halt.incident_id), "a recovery plan")
            if self._halt is not halt:
                continue  # superseded by a newer failure: halt again under its id
            try:
                return self._carry_out(self._plan, committed, rng_next)
            except _Superseded:
                continue
            except Exception as e:  # noqa: BLE001 - reported; tmd decides (a new incident or the job fails)
                log.exception("recovery %d failed", halt.incident_id)
                self._report_recovery(halt.incident_id, "recovered", False, f"{type(e).__name__}: {e}", committed)
                self._wait_cv(lambda: self._halt is not halt, "a new plan after a failed recovery")

    def _replace(self, incident_id: int) -> int:
        """Joiner replacing a failed rank: report warmed, wait for the plan, receive state, return resume step."""
        if incident_id:  # (0: a migration's joiner whose leaver died; tmd knows it is warm)
            self._report_recovery(incident_id, "warmed", committed_step=-1)
        self._prealloc = None
        while True:
            self._wait_cv(lambda: self._plan is not None, "a recovery plan")
            plan = self._plan
            try:
                resume = self._carry_out(plan, None, None)
            except _Superseded:
                continue
            except Exception as e:  # noqa: BLE001 - a fresh standby takes over; this process is thrown away
                log.exception("recovery %d failed", plan.incident_id)
                self._report_recovery(plan.incident_id, "recovered", False, f"{type(e).__name__}: {e}")
                _exit_now(1)
            self.groups.set_mode("live")
            self.groups.set_tolerant()
            self.role = "active"
            return resume

    def _wait_cv(self, ready: Callable[[], bool], what: str) -> None:
        with self._cv:
            if not self._cv.wait_for(ready, RECOVERY_TIMEOUT_S):
                print(f"[worker] rank {self.rank}: no word from tmd for {RECOVERY_TIMEOUT_S:.0f} s while "
                      f"waiting for {what}; exiting", flush=True)
                _exit_now(1)

    def _carry_out(self, plan: p.Recover, committed: Optional[int], rng_next: Optional[torch.Tensor]) -> int:
        """Carry out ``plan`` on a helper thread (a dead peer can block a rendezvous or a transfer for the
        gloo timeout) while this thread watches for a newer halt; on one, the helper's work is abandoned and
        nothing it received is loaded. Returns the step to resume at. Raises _Superseded or the helper's error."""
        incident = plan.incident_id
        receive_from = next((s for s, d in plan.sends if d == self.rank), None)
        send_to = sorted(d for s, d in plan.sends if s == self.rank)
        if receive_from is None and committed != plan.resume_step - 1:
            raise RuntimeError(f"plan resumes at step {plan.resume_step}, but this rank committed {committed} "
                               "and is sent no state")
        result: dict[str, Any] = {}
        cancelled = threading.Event()
        finished = threading.Event()
        store, timeout_s, host = self.groups.store, self.groups.timeout_s, self.groups.host

        def work() -> None:
            started = time.perf_counter()
            try:
                # One thread, one order on every rank (transfer groups by receiver, then the groups): the job's
                # TCPStore client serialises blocking waits, so two rendezvous in flight could deadlock.
                moved = 0  # bytes received here (senders do not count them twice)
                for dst in send_to:
                    pg = mb.build_inner(store, f"tm/g{plan.generation}/recover/r{dst}", 0, 2, timeout_s, host)
                    transfer.send_state(pg, self._replicated, {"step": plan.resume_step, "rng": rng_next})
                    mb.release_in_background(pg)
                    pg = None
                if receive_from is not None:
                    pg = mb.build_inner(store, f"tm/g{plan.generation}/recover/r{self.rank}", 1, 2, timeout_s, host)
                    states, extra, n, _ = transfer.recv_state(pg, 0)
                    mb.release_in_background(pg)
                    pg = None
                    moved += n
                    result["received"] = (states, extra)
                result.update(built=self.groups.build_all(plan.generation), moved=moved,
                              seconds=time.perf_counter() - started)
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                result["error"] = e
            finally:
                with self._cv:  # the waiting thread decides under the same lock: one of us drops what was built
                    finished.set()
                    orphaned = cancelled.is_set()
                    self._cv.notify_all()
                if orphaned:
                    for inner in result.get("built", {}).values():
                        mb.release_in_background(inner)

        threading.Thread(target=work, daemon=True, name=f"tm-recover-{incident}").start()
        halt = self._halt

        def superseded() -> bool:
            return self._halt is not halt or (self._plan is not None and self._plan is not plan)

        with self._cv:
            self._cv.wait_for(lambda: finished.is_set() or superseded(), RECOVERY_TIMEOUT_S)
            newer, done = superseded(), finished.is_set()
            if newer or not done:
                cancelled.set()  # a helper still running drops what it builds itself
        if newer or not done:
            for inner in result.get("built", {}).values() if done else ():
                mb.release_in_background(inner)
            raise _Superseded() if newer else RuntimeError("recovery timed out")
        # The helper can no longer touch anything: load what it received and swap the groups in.
        if "error" in result:
            raise result["error"]
        if "received" in result:
            states, extra = result["received"]
            transfer.load_state(self._replicated, states)  # KeyError if the sets of objects differ
            rng_next = extra["rng"]
        self.groups.install(result["built"])
        if rng_next is not None:
            torch.set_rng_state(rng_next)
        with self._cv:
            if self._halt is halt:
                self._halt = None
            self._plan = None
        self._committed_step = plan.resume_step - 1
        self._report_recovery(incident, "recovered", committed_step=plan.resume_step - 1,
                              bytes_moved=result["moved"], seconds=result["seconds"])
        print(f"[worker] rank {self.rank} recovered from incident {incident}: resuming at step "
              f"{plan.resume_step} (generation {plan.generation})", flush=True)
        return plan.resume_step

    def _shadow(self, n: int) -> Iterator[int]:
        self.is_shadow = True
        prev = time.perf_counter()
        for step in range(n):
            self._step = step
            yield step
            now = time.perf_counter()
            self.agent.send(p.StepReport(rank=self.rank, step=step, step_time_s=now - prev, shadow=True))
            prev = now
        self.is_shadow = False
        for g in self.groups.groups.values():
            g.mover.load_recording([])  # free the recordings
        self._prealloc = transfer.pretouch(transfer.plan_buffers(self.objects))
        if self._incident_id == 0:
            self._report(self._migration_id, "warmed")

    def _join(self) -> int:
        """Joiner: wait for the switch, receive and verify the leaver's state, commit, and return the switch step.
        If the leaver dies instead, tmd sends a recovery plan: the state then comes from a replica."""
        mid = self._migration_id
        with self._cv:
            self._cv.wait_for(lambda: self._switch_armed.is_set() or self._plan is not None)
        if self._plan is not None:
            return self._replace(0)
        switch = self._switch
        try:
            pg = self.groups.transfer_group(mid, DECISION_TIMEOUT_S)
            states, extra, moved, seconds = transfer.recv_state(pg, 0, self._prealloc)
        except Exception as e:  # noqa: BLE001 - reported; tmd aborts, or falls back to a replica
            self._report(mid, "transferred", False, f"{type(e).__name__}: {e}")
            with self._cv:
                self._cv.wait_for(lambda: self._decided.is_set() or self._plan is not None, DECISION_TIMEOUT_S)
            if self._plan is not None:
                self.groups.discard(mid)
                return self._replace(0)
            os._exit(1)
        self._prealloc = None
        # Load before the decision, off the critical path: on an abort this sandboxed process is thrown away.
        transfer.load_state(self.objects, states)
        torch.set_rng_state(extra["rng"])
        self._report(mid, "transferred", bytes_moved=moved, seconds=seconds)
        if not self._decided.wait(DECISION_TIMEOUT_S) or not self._decision.commit:
            os._exit(1)
        self.groups.commit(mid)
        self.groups.set_mode("live")
        self.groups.set_tolerant()
        self.role = "active"
        self._report(mid, "committed", step=switch.step)
        return extra["step"]

    def _switch_boundary(self, switch: p.Switch) -> None:
        """At the start of the switch step: leaver sends its state; stayers and leaver wait for the decision."""
        paused = time.perf_counter()
        mid = switch.migration_id
        role = self._migration_role
        if role == "leaver":
            try:
                pg = self.groups.transfer_group(mid, DECISION_TIMEOUT_S)
                moved, seconds = transfer.send_state(pg, self.objects,
                                                     {"step": switch.step, "rng": torch.get_rng_state()})
                self._report(mid, "sent", bytes_moved=moved, seconds=seconds)
            except Exception as e:  # noqa: BLE001 - the joiner or its group failed: tmd aborts, we go on
                self._report(mid, "sent", False, f"{type(e).__name__}: {e}")
        elif not self.groups.staged(mid):
            self._clear_switch(mid)
            return  # none of this rank's groups contains a leaver: nothing to swap
        decided = self._decided.wait(DECISION_TIMEOUT_S)
        decision = self._decision
        self._clear_switch(mid)
        if not decided or decision is None or decision.migration_id != mid or not decision.commit:
            self.groups.discard(mid)
            return
        if role == "leaver":
            pg = None  # the traceback of LeaverExit keeps this frame alive: hold no group in it
            self.groups.finish_transfer(mid)
            self.agent.send(p.Done(rank=self.rank, final_step=switch.step - 1, left=True))
            self.agent.close()
            print(f"[worker] rank {self.rank} handed over at step {switch.step}; leaving", flush=True)
            # The script's own finally blocks still run as LeaverExit unwinds; then skip the interpreter's
            # teardown (seconds of CPU for torch, stolen from co-located ranks that train on).
            atexit.register(_exit_now, 0)
            raise LeaverExit()
        self.groups.commit(mid)
        self._report(mid, "committed", step=switch.step, seconds=time.perf_counter() - paused)

    def _clear_switch(self, mid: int) -> None:
        with self._lock:
            if self._switch is not None and self._switch.migration_id == mid:
                self._switch = None
        self._switch_armed.clear()

    def finish(self, note: Optional[str] = None) -> None:
        """Report the end of training to tmd (``note``, e.g. a final state hash, goes to the log) and close."""
        if self._record_writer is not None:
            self._record_writer.join()
        if note:
            log.info("rank %d finished: %s", self.rank, note)
        self.agent.send(p.Done(rank=self.rank, final_step=self._step - 1, left=False))
        self.agent.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def init(coordinator: Optional[str] = None, store_timeout_s: float = 120.0) -> Session:
    """Join the job: register with tmd and wait for a role. On an active rank this returns at once with the
    mover-backed world group installed as the default process group (backend ``tmover``); on a standby it
    blocks until tmd hands it a leaver's rank (the joiner then starts in the sandbox), or exits the process
    when tmd releases it. Reads ``TM_COORDINATOR``, ``TM_NODE``, ``TM_LOCAL_RANK``, ``TM_STANDBY``,
    ``TM_RUN_DIR`` from the environment (set by ``tmd local`` or the SLURM scripts). Raises KeyError when
    ``TM_COORDINATOR`` is missing."""
    address = coordinator or os.environ["TM_COORDINATOR"]
    # Under srun without TM_NODE/TM_LOCAL_RANK: SLURM's node name (hostnames may repeat) and local task id.
    node = os.environ.get("TM_NODE") or os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    local_rank = int(os.environ.get("TM_LOCAL_RANK") or os.environ.get("SLURM_LOCALID") or "0")
    standby = os.environ.get("TM_STANDBY", "0") == "1"
    run_dir = os.environ.get("TM_RUN_DIR", os.getcwd())
    session: Session
    agent = Agent(address, node, local_rank, standby, lambda m: session._on_message(m), lambda: session._heartbeat())
    session = Session(agent, node, local_rank, run_dir)
    session._start(store_timeout_s)
    return session

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
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from tmd import protocol as p
from worker import sandbox, transfer
from worker.agent import Agent
from worker.groups import GroupManager

log = logging.getLogger("worker.session")

DECISION_TIMEOUT_S = 300.0  # a party waiting at the switch step for tmd's decision gives up (keeps old groups)


def _exit_now(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


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

    # --- messages from tmd (agent thread) -----------------------------------------------------------------------
    def _on_message(self, msg: p.Message) -> None:
        if isinstance(msg, p.Assign):
            self._assign = msg
            self._assigned.set()
        elif isinstance(msg, p.Release):
            self._release = msg
            self._assigned.set()
            if self.role in ("standby", "joiner"):
                log.warning("released by tmd: %s", msg.reason)
                os._exit(msg.exit_code)  # nothing of value here; may be blocked in a replay or a recv
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
                self._switch_armed.set()
        elif isinstance(msg, p.Decide):
            self._decision = msg
            self._decided.set()
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
        self.agent.send(p.PhaseDone(migration_id, self.rank, phase, ok, error, step, bytes_moved, seconds,
                                    groups or []))

    def _heartbeat(self) -> p.Heartbeat:
        mover = self.groups.world if self.groups is not None else None
        return p.Heartbeat(self._step, mover.counters() if mover is not None else {})

    # --- set-up -------------------------------------------------------------------------------------------------
    def _start(self, timeout_s: float) -> None:
        self.agent.start()
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
        else:
            self.groups.init_world(a.generation, "replay", connect=False)
            sandbox.start_replay(self.groups.world, a.record_dir, a.rank, "world")
            self._migration_id = a.migration_id

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
        return pg

    def manage(self, **objects: Any) -> None:
        """Hand over the state that moves with this rank: objects with ``state_dict()``/``load_state_dict()``
        (model, optimizer, data sampler, LR scheduler...). Raises TypeError for an object without them."""
        for name, obj in objects.items():
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise TypeError(f"managed object {name!r} has no state_dict/load_state_dict")
        self.objects.update(objects)

    # --- the training loop ----------------------------------------------------------------------------------
    def steps(self, total: int) -> Iterator[int]:
        """Yield the step numbers this process runs, ``0 .. total-1`` on an active rank. A joiner first yields
        its shadow steps (``is_shadow`` true: collectives replayed, results thrown away), then blocks until the
        switch step S and continues with ``S .. total-1`` in the leaver's rank. On a leaver, the loop ends by
        raising :class:`LeaverExit` (exit code 0) once its state is handed over."""
        a = self._assign
        step = 0
        if self.role == "joiner":
            yield from self._shadow(min(a.record_steps, total))
            step = self._join()
        prev = None
        while step < total:
            t0 = time.perf_counter()
            if prev is not None:
                self.agent.send(p.StepReport(self.rank, step - 1, t0 - prev, False))
            prev = t0
            with self._lock:
                self._step = step
                switch = self._switch if self._switch is not None and self._switch.step == step else None
            if self.role == "active" and step == a.record_steps and self._record_writer is None:
                self._record_writer = sandbox.save_recordings_async(
                    {g.name: g.mover for g in self.groups.groups.values()}, a.record_dir, self.rank)
            if switch is not None:
                self._switch_boundary(switch)
            yield step
            step += 1
        if prev is not None:
            self.agent.send(p.StepReport(self.rank, step - 1, time.perf_counter() - prev, False))
        with self._lock:
            self._step = step

    def _shadow(self, n: int) -> Iterator[int]:
        self.is_shadow = True
        prev = time.perf_counter()
        for step in range(n):
            self._step = step
            yield step
            now = time.perf_counter()
            self.agent.send(p.StepReport(self.rank, step, now - prev, True))
            prev = now
        self.is_shadow = False
        for g in self.groups.groups.values():
            g.mover.load_recording([])  # free the recordings
        self._prealloc = transfer.pretouch(transfer.plan_buffers(self.objects))
        self._report(self._migration_id, "warmed")

    def _join(self) -> int:
        """Joiner: wait for the switch, receive and verify the leaver's state, commit, and return the switch step."""
        mid = self._migration_id
        self._switch_armed.wait()
        switch = self._switch
        try:
            pg = self.groups.transfer_group(mid, DECISION_TIMEOUT_S)
            states, extra, moved, seconds = transfer.recv_state(pg, 0, self._prealloc)
        except Exception as e:  # noqa: BLE001 - reported; tmd aborts and this process is replaced
            self._report(mid, "transferred", False, f"{type(e).__name__}: {e}")
            self._decided.wait(DECISION_TIMEOUT_S)
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
            self.agent.send(p.Done(self.rank, switch.step - 1, True))
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
        self.agent.send(p.Done(self.rank, self._step - 1, False))
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

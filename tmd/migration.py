"""The migration state machine: one planned move of a node's ranks (the leavers) to a standby node (the joiners).

    requested -> warming -> prepared -> switching -> transferred -> committed
         \\___________\\__________\\___________\\____________\\-> aborted (reason)

- requested:   validated; joiners are told their ranks (Assign role=joiner).
- warming:     joiners run shadow iterations, replaying the recorded collectives (no communication).
- prepared:    phase 1 done: every party built the next generation of the groups that contain a leaver, in the
               background, while training went on. (Entered after every ``prepared`` ack.)
- switching:   a switch step S was chosen and every party armed it; at the boundary before S the leaver sends
               its state peer to peer to its joiner, and the stayers wait for the decision.
- transferred: every joiner received its state and verified the checksums.
- committed:   phase 2: every party swapped in the new groups at S; the joiners run step S in the leavers' ranks.

Any failure (a party exiting, a refused switch step, a checksum mismatch, a phase deadline) aborts: the parties
drop what they staged and training goes on with the old groups. Each transition is journalled with its time.
The flow follows TrainMover (arXiv 2412.12636), sections 4-5: two-phase delta-based group setup, sandboxed
shadow iterations, and peer-to-peer state transfer.
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Optional

from tmd import protocol as p
from tmd.journal import Journal
from tmd.protocol.vocab import NodeRole
from tmd.channel import WorkerChannel
from tmd.registry import Registry, Worker

STATES = ("requested", "warming", "prepared", "switching", "transferred", "committed")

# Seconds a migration may stay in a state before it is aborted.
DEFAULT_DEADLINES_S = {
    "warming": 300.0,
    "prepared": 60.0,
    "switching": 120.0,
    "transferred": 60.0,
}
DOWNTIME_WINDOW_STEPS = 6  # the switch step and the 5 after it


class MigrationError(Exception):
    """A request tmd refuses; ``code`` is the ErrorReply code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclasses.dataclass
class Migration:
    id: int
    source: str
    target: str
    generation: int
    leavers: dict[int, Worker]  # rank -> leaver process
    joiners: dict[int, Worker]  # rank -> joiner process (takes exactly the leaver's rank)
    stayers: dict[int, Worker]
    state: str = "requested"
    reason: str = ""
    switch_step: Optional[int] = None
    request_step: int = -1
    phases: dict[str, float] = dataclasses.field(default_factory=dict)  # state or mark -> epoch s
    acks: dict[str, set[bytes]] = dataclasses.field(default_factory=dict)  # phase -> identities that acked
    bytes_moved: int = 0
    transfer_s: float = 0.0
    rebuilt: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # "node/local_rank" -> group names
    downtime_s: Optional[float] = None
    median_step_s: Optional[float] = None
    pause_s: Optional[float] = None  # longest time a stayer stood at the switch step (seconds)
    deadline: float = math.inf  # time.monotonic()

    @property
    def finished(self) -> bool:
        return self.state in ("committed", "aborted")

    def parties(self) -> list[Worker]:
        return [*self.stayers.values(), *self.leavers.values(), *self.joiners.values()]

    def phases_s(self) -> dict[str, float]:
        """Durations in seconds: warm_up (shadow iterations), prepare (phase 1 in the background), switch_wait
        (arming until the leaver reached S), transfer (state send/recv + verify), commit (decision to joiners
        running at S), total."""
        t = self.phases
        spans = {
            "warm_up": ("warming", "prepare_started"),
            "prepare": ("prepare_started", "prepared"),
            "switch_wait": ("switching", "transfer_started"),
            "transfer": ("transfer_started", "transferred"),
            "commit": ("transferred", "committed"),
            "total": ("requested", "committed"),
        }
        return {k: round(t[b] - t[a], 6) for k, (a, b) in spans.items() if a in t and b in t}

    def to_dict(self) -> dict:
        return {
            "id": self.id,
            "source": self.source,
            "target": self.target,
            "generation": self.generation,
            "state": self.state,
            "reason": self.reason,
            "switch_step": self.switch_step,
            "ranks": sorted(self.leavers),
            "phases": dict(self.phases),
            "phases_s": self.phases_s(),
            "downtime_s": self.downtime_s,
            "median_step_s": self.median_step_s,
            "pause_s": self.pause_s,
            "bytes_moved": self.bytes_moved,
            "transfer_s": self.transfer_s,
            "rebuilt": self.rebuilt,
        }


class Migrations:
    """Drives migrations. ``send(worker, message)`` delivers a message to one worker process."""

    def __init__(
        self,
        registry: Registry,
        journal: Journal,
        channel: WorkerChannel,
        switch_slack_s: float = 0.5,
        deadlines_s: Optional[dict[str, float]] = None,
        record_steps: int = 0,
    ) -> None:
        """``switch_slack_s``: how far ahead (seconds of training) the switch step is placed, so every party
        hears of it before reaching it. ``record_steps``: migrations wait until the job has recorded them."""
        self.registry = registry
        self.journal = journal
        self.channel = channel
        self.switch_slack_s = switch_slack_s
        self.record_steps = record_steps
        self.deadlines_s = {**DEFAULT_DEADLINES_S, **(deadlines_s or {})}
        self.all: list[Migration] = []
        self.first_id = 1  # id of the first migration (a restarted tmd goes on after the journal's last)

    @property
    def current(self) -> Optional[Migration]:
        return self.all[-1] if self.all and not self.all[-1].finished else None

    def get(self, migration_id: int) -> Migration:
        if migration_id < 0 and self.all:
            return self.all[-1]
        for m in self.all:
            if m.id == migration_id:
                return m
        raise MigrationError("unknown_migration", f"no migration with id {migration_id}")

    # ---------------------------------------------------------------------------------------------------------
    def request(self, source: str, target: str, require_healthy: bool = True) -> Migration:
        """Validate and start a migration of node ``source`` to standby ``target``. Raises MigrationError with
        a one-line reason; nothing changes then. ``require_healthy`` false lets tmd evacuate a node that is
        alive but flagged unhealthy (a bad GPU)."""
        reg = self.registry
        actives = sorted(n.name for n in reg.nodes.values() if n.role == "active")
        standbys = sorted(n.name for n in reg.nodes.values() if n.role == "standby")
        src = reg.nodes.get(source)
        if src is None or src.role not in ("active",):
            why = f"is {src.role}" if src else "is not part of this job"
            raise MigrationError("unknown_node", f"unknown node '{source}': it {why} (active nodes: {', '.join(actives) or 'none'})")
        dst = reg.nodes.get(target)
        if dst is None or dst.role not in ("standby", "joining"):
            why = f"is {dst.role}" if dst else "is not a standby of this job"
            raise MigrationError("unknown_standby", f"unknown standby '{target}': it {why} (standbys: {', '.join(standbys) or 'none'})")
        running = self.current
        if running is not None:
            raise MigrationError(
                "migration_running",
                f"migration {running.id} ({running.source} -> {running.target}) is still {running.state}",
            )
        if dst.role != "standby" or not dst.warm:
            state = "cold: not all its processes are up" if dst.role == "standby" else dst.role
            raise MigrationError("busy_standby", f"standby '{target}' is busy ({state})")
        if not reg.all_ranks_assigned() or reg.current_step() < 0:
            raise MigrationError("not_ready", "the job has not started training yet")
        if reg.current_step() <= self.record_steps:
            raise MigrationError("not_ready", f"the job is still recording its first {self.record_steps} steps "
                                              "for the joiners' shadow iterations; try again in a moment")
        if (require_healthy and src.health != "healthy") or len(src.workers) != len(src.ranks) or \
                any(w.exited for w in src.workers.values()):
            raise MigrationError("not_ready", f"node '{source}' is {src.health}; a planned migration needs a live leaver")
        if any(w.done for w in reg.rank_owner.values()):
            raise MigrationError("not_ready", "the job is finishing")

        leavers = {r: reg.rank_owner[r] for r in src.ranks}
        joiners = {r: dst.workers[i] for i, r in enumerate(src.ranks)}
        stayers = {r: w for r, w in reg.rank_owner.items() if r not in leavers}
        m = Migration(self.first_id + len(self.all), source, target, reg.generations.next(), leavers, joiners, stayers)
        m.request_step = reg.current_step()
        self.all.append(m)
        reg.promote(dst)
        self._enter(m, "requested", generation=m.generation)
        for rank, joiner in joiners.items():
            self.channel.assign(joiner, rank, migration_id=m.id)
        self._enter(m, "warming")
        return m

    # ---------------------------------------------------------------------------------------------------------
    def on_phase(self, w: Worker, msg: p.PhaseDone) -> None:
        """A party reports a phase. Out-of-date or unexpected reports are journalled and ignored."""
        if msg.phase == "committed" and msg.ok:
            done = next((x for x in self.all if x.id == msg.migration_id), None)
            if done is not None and any(w is s for s in done.stayers.values()):
                # how long training stood still on this stayer at the switch step (it may report after commit)
                done.pause_s = round(max(done.pause_s or 0.0, msg.seconds), 6)
                return
        m = self.current
        if m is None or msg.migration_id != m.id:
            self.journal.record("stale_phase_report", worker=w.identity.decode(), migration_id=msg.migration_id, phase=msg.phase)
            return
        if not msg.ok:
            self.abort(m, f"{w.node}/{w.local_rank} (rank {msg.rank}) failed in {msg.phase}: {msg.error}")
            return
        acks = m.acks.setdefault(msg.phase, set())
        acks.add(w.identity)
        if msg.phase == "warmed" and m.state == "warming":
            if len(acks) == len(m.joiners):
                self._prepare(m)
        elif msg.phase == "prepared" and m.state == "warming" and "prepare_started" in m.phases:
            m.rebuilt[f"{w.node}/{w.local_rank}"] = list(msg.groups)
            if len(acks) == len(m.parties()):
                self._enter(m, "prepared", rebuilt=m.rebuilt)
                self._arm(m)
        elif msg.phase == "armed" and m.state == "prepared":
            if msg.step >= (m.switch_step or 0):
                self.abort(m, f"rank {msg.rank} was already at step {msg.step} when switch step {m.switch_step} was armed")
                return
            if len(acks) == len(m.parties()):
                self._enter(m, "switching")
        elif msg.phase == "sent" and m.state in ("switching", "transferred"):  # may trail the joiner's report
            self._mark_transfer_start(m, msg.seconds)
        elif msg.phase == "transferred" and m.state == "switching":
            m.bytes_moved += msg.bytes_moved
            m.transfer_s = max(m.transfer_s, msg.seconds)
            self._mark_transfer_start(m, msg.seconds)
            if len(acks) == len(m.joiners):
                self._enter(m, "transferred")
                self._broadcast(m, p.Decide(migration_id=m.id, commit=True, reason="transferred"))
                for leaver in m.leavers.values():
                    leaver.done = True  # from here on a leaver exiting is the plan, whether or not its Done arrives
        elif msg.phase == "committed" and m.state == "transferred":
            if all(j.identity in acks for j in m.joiners.values()):
                self._commit(m)
        else:
            self.journal.record("unexpected_phase_report", migration_id=m.id, state=m.state, phase=msg.phase, rank=msg.rank)

    def on_worker_lost(self, w: Worker, why: str) -> None:
        """A process exited or stopped heartbeating: abort the migration it takes part in, if any."""
        m = self.current
        if m is None:
            return
        if any(w is x for x in m.parties()):
            if w.done and any(w is x for x in m.leavers.values()):
                return  # a leaver leaving after the commit decision is the plan
            role = "joiner" if any(w is x for x in m.joiners.values()) else "leaver" if any(w is x for x in m.leavers.values()) else "stayer"
            self.abort(m, f"{role} {w.node}/{w.local_rank} {why} during {m.state}")

    def tick(self, now_mono: float) -> None:
        m = self.current
        if m is not None and now_mono > m.deadline:
            self.abort(m, f"timed out in state {m.state} after {self.deadlines_s.get(m.state, 0):.0f} s")

    def on_step(self, rank: int, step: int) -> None:
        """Fill in downtime once the window after the last committed switch step is complete."""
        m = self.all[-1] if self.all else None
        if m is None or m.state != "committed" or m.downtime_s is not None or not m.stayers:
            return
        ref = min(m.stayers)
        S = m.switch_step
        if rank != ref or step < S + DOWNTIME_WINDOW_STEPS - 1:
            return
        times = self.registry.step_times.get(ref, {})
        window = [times.get(s) for s in range(S, S + DOWNTIME_WINDOW_STEPS)]
        median = self.registry.median_step_s(ref, before=max(m.request_step, 2))
        if median is None or any(t is None for t in window):
            return
        m.downtime_s = round(sum(window) - DOWNTIME_WINDOW_STEPS * median, 6)
        m.median_step_s = round(median, 6)
        self.journal.record("migration_downtime", migration_id=m.id, downtime_s=m.downtime_s, median_step_s=median,
                            window_s=[round(t, 6) for t in window])

    # ---------------------------------------------------------------------------------------------------------
    def abort(self, m: Migration, reason: str, spare_joiners: bool = False) -> None:
        """Abort ``m``: stayers and leavers keep their groups. The joiners are told too (they exit and the
        standby is restarted fresh) unless ``spare_joiners``: failure recovery then takes them over."""
        if m.finished:
            return
        m.reason = reason
        self._enter(m, "aborted", reason=reason)
        decision = p.Decide(migration_id=m.id, commit=False, reason=reason)
        for w in m.parties():
            if not w.exited and not (spare_joiners and any(w is j for j in m.joiners.values())):
                self.channel.send(w, decision)
        target = self.registry.nodes[m.target]
        if target.role == NodeRole.JOINING and not spare_joiners:
            self.registry.back_to_standby(target)  # its processes exit; the launcher brings fresh ones up

    @staticmethod
    def _mark_transfer_start(m: Migration, seconds: float) -> None:
        """The transfer began ``seconds`` before now by one party's clock; keep the earliest report."""
        start = time.time() - seconds
        m.phases["transfer_started"] = min(m.phases.get("transfer_started", start), start)

    def _prepare(self, m: Migration) -> None:
        m.phases["prepare_started"] = time.time()
        self.journal.record("migration_phase", migration_id=m.id, phase="prepare_started")
        leaver_ranks = sorted(m.leavers)
        for role, group in (("stayer", m.stayers), ("leaver", m.leavers), ("joiner", m.joiners)):
            for rank, w in group.items():
                prefix = f"tm/g{m.generation}/transfer/r{rank}" if role != "stayer" else ""
                self.channel.send(w, p.Prepare(migration_id=m.id, generation=m.generation, role=role, leaver_ranks=leaver_ranks, transfer_prefix=prefix))
        m.deadline = time.monotonic() + self.deadlines_s["prepared"]

    def _arm(self, m: Migration) -> None:
        """Pick the switch step: far enough ahead that every party hears of it before reaching it."""
        step = self.registry.current_step()
        median = self.registry.median_step_s(min(m.stayers or m.leavers)) or 1.0
        margin = 2 + math.ceil(self.switch_slack_s / max(median, 1e-3))
        m.switch_step = step + margin
        self.journal.record("switch_step_chosen", migration_id=m.id, switch_step=m.switch_step, current_step=step)
        self._broadcast(m, p.Switch(migration_id=m.id, step=m.switch_step))

    def _commit(self, m: Migration) -> None:
        reg = self.registry
        reg.hand_over(reg.nodes[m.source], reg.nodes[m.target], m.joiners,
                      f"ranks handed over to {m.target} in migration {m.id}")
        self._enter(m, "committed", switch_step=m.switch_step, bytes_moved=m.bytes_moved, phases_s=m.phases_s())

    def _enter(self, m: Migration, state: str, **fields) -> None:
        m.state = state
        m.phases[state] = time.time()
        m.acks.pop(state, None)
        m.deadline = time.monotonic() + self.deadlines_s.get(state, math.inf)
        self.journal.record("migration_" + state, migration_id=m.id, source=m.source, target=m.target, **fields)

    def _broadcast(self, m: Migration, msg: p.Message) -> None:
        for w in m.parties():
            if not w.exited:
                self.channel.send(w, msg)

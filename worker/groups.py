"""Generations of the job's process groups, set up in two phases (TrainMover, arXiv 2412.12636, section 4).

Every group (the world group, which is the default group, and every group the script creates after
``worker.init()``: ``dist.new_group``, DeviceMesh dimensions) is a mover Backend (csrc/) whose inner backend
carries a generation number. A script's group is first built under ``layout.created_group_prefix(name)``;
generation ``g`` of group ``name`` lives under ``tmd.protocol.layout.group_prefix(g, name)`` (``tm/g<g>/<name>``; a
prefix is never reused).

- Phase 1, :meth:`GroupManager.prepare`, runs on a background thread while training goes on: it builds the next
  generation of only the groups that contain a leaver (delta-based: a group without a leaver is not touched) and
  stages it on the mover; leaver and joiner also build their 2-rank transfer group.
- Phase 2, :meth:`GroupManager.commit`, runs at the switch step, between two iterations: the mover swaps the staged
  inner in atomically and drops the old one on a C++ thread (destroying a gloo group costs ~10 ms per peer).
  Once it is destroyed and the next step committed, the C heap's free pages go back to the OS (:func:`trim_heap`,
  on a background thread, started by :meth:`GroupManager.step_committed`, for a DDP model as the following step's
  backward pass begins):
  the new generation's threads allocate in malloc arenas of their own, and the arenas the old generation's threads
  leave behind would otherwise keep their freed buffers resident (about 1-2 % of a demo GPT rank's RSS).

**The job's store.** Groups set up through tmd's store (worker.store.JobStore, over CURVE with the worker key). A
rendezvous blocked in a ``get`` of a key that never comes (a peer died before publishing its address) holds its
connection until the store timeout; the store gives each thread a connection of its own, and each phase 1, each
recovery attempt and each snapshot round runs on a thread of its own, so a prepare stuck on a lost leaver cannot
stall the recovery that follows it. A group's setup keys are dropped from the store once all its members
released it (worker.backend.Setup: a release, a swap, the process's end), so the store's key cap holds however long
the job runs.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import logging
import threading
import time
from typing import TYPE_CHECKING, Callable, Optional

from tmd import protocol as p
from worker import backend as mb

if TYPE_CHECKING:
    from worker import sandbox

log = logging.getLogger("worker.groups")

RELEASE_WAIT_S = 30.0  # how long (seconds) a heap trim waits for the retired generation to be destroyed
_libc: Optional[ctypes.CDLL] = None


def trim_heap() -> bool:
    """Return the C heap's free memory to the OS: glibc's ``malloc_trim(0)`` releases the free pages of every
    malloc arena, not only the top of the main heap. Takes the arenas' locks in turn (milliseconds; allocations
    on other threads wait meanwhile). Returns False where the C library has no ``malloc_trim`` (not glibc)."""
    global _libc
    try:
        if _libc is None:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = _libc.malloc_trim
    except (OSError, AttributeError):
        return False
    trim(0)
    return True


def trim_heap_when_released(wait_s: float = RELEASE_WAIT_S, delay_s: float = 0.0) -> threading.Thread:
    """On a daemon thread: wait (up to ``wait_s`` seconds) until the groups dropped by ``release_in_background``
    are destroyed and at least ``delay_s`` seconds have passed, then :func:`trim_heap` (about 20-25 ms for 90 MB
    of free heap on a 2-core host, during which this process's allocations in the trimmed arena wait; the pages
    the training loop reuses fault back in over its next step). Returns the thread (started)."""
    start = time.monotonic()

    def run() -> None:
        mb.wait_for_background(wait_s)
        time.sleep(max(0.0, delay_s - (time.monotonic() - start)))
        t0 = time.monotonic()
        if trim_heap():
            log.debug("heap trimmed in %.1f ms", (time.monotonic() - t0) * 1e3)

    t = threading.Thread(target=run, daemon=True, name="tm-heap-trim")
    t.start()
    return t


@dataclasses.dataclass
class Group:
    """One of this rank's process groups: its name (the same on every process), global ranks, mover, and on a
    joiner in its sandbox what it replays (worker.sandbox)."""

    name: str
    ranks: list[int]
    mover: "mb.MoverBackend"
    recording: Optional[sandbox.Recording] = None
    setup: Optional["mb.Setup"] = None  # the current inner's setup in the job's store, released when swapped out

    def swap_setup(self, setup: Optional["mb.Setup"]) -> None:
        """The mover swapped a new inner in (set up as ``setup``): release the retired inner's setup."""
        old, self.setup = self.setup, setup
        if old is not None:
            old.release()


@dataclasses.dataclass
class _Pending:
    migration_id: int
    generation: int = -1  # the generation phase 1 builds
    cancelled: bool = False
    ready: threading.Event = dataclasses.field(default_factory=threading.Event)
    error: str = ""
    transfer: Optional[object] = None  # the 2-rank transfer group (leaver 0, joiner 1)
    staged: list[str] = dataclasses.field(default_factory=list)  # names of the groups with a staged generation
    setups: dict = dataclasses.field(default_factory=dict)  # group name -> the staged inner's mb.Setup


class GroupManager:
    def __init__(self, store, rank: int, world_size: int, host: Optional[str], timeout_s: float = 120.0) -> None:
        """``timeout_s``: gloo timeout (seconds) of every group built here, so a dead peer cannot block forever."""
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.host = host
        self.timeout_s = timeout_s
        self.world: Optional[mb.MoverBackend] = None
        self.replay_dir: Optional[str] = None  # a joiner in its sandbox: where the groups' recordings are
        # called with (name, ranks) after a group the script created is connected live (not on a joiner's replay)
        self.on_created: Optional[Callable[[str, list[int]], None]] = None
        self.groups: dict[str, Group] = {}  # this rank's groups by name, the world group included
        self.generation = -1  # the highest generation this process built or installed a group of
        # the generation of the world group in use: the same on every active rank at a step boundary (a phase 1
        # builds a higher one on stayers only, and a leaver builds none), so what a collective of every rank keys on
        self.world_generation = -1
        self._lock = threading.Lock()
        self._pending: Optional[_Pending] = None
        self._trim_due = False  # a swap retired a generation: trim the heap once the next step committed
        self._trim_armed = False  # that trim waits for the next step's backward pass (see step_committed)
        self._old_stores: list = []  # the stores of tmd's before a restart (set_store)

    def set_store(self, host: str, port: int) -> None:
        """Build future groups in the store at ``host:port``: a restarted tmd hosts a new one (the old store died
        with the old tmd). The groups in use keep working: gloo needs the store only while a group is set up.
        The old store object is kept: c10d may still hold it (a Python store must outlive its C++ users)."""
        from worker.store import JobStore

        self._old_stores.append(self.store)
        self.store = JobStore.of_job(host, port, self.timeout_s)

    def connect_store(self):
        """The store one group setup (a phase 1, a recovery attempt, a snapshot round) uses: the job's store,
        whose every thread has a connection of its own (worker.store), so a rendezvous blocked on a lost peer
        holds only its own thread."""
        return self.store

    def _inner(self, generation: int, group: str, ranks: list[int], store=None):
        self.generation = max(self.generation, generation)
        return mb.build_inner(self.store if store is None else store, p.layout.group_prefix(generation, group),
                              ranks.index(self.rank), len(ranks), self.timeout_s, self.host)

    def init_world(self, generation: int, mode: p.MoverMode, connect: bool) -> mb.MoverBackend:
        """Install the mover-backed world group as the default group. ``connect`` false leaves it without an
        inner backend (a joiner's sandbox: every collective is replayed)."""
        ranks = list(range(self.world_size))
        self.generation = max(self.generation, generation)
        world = p.layout.WORLD_GROUP
        self.world_generation = generation
        inner = self._inner(generation, world, ranks) if connect else None
        self.world = mb.init_mover_world(self.store, self.rank, self.world_size, inner, mode)
        self.groups[world] = Group(world, ranks, self.world, setup=mb.setup_of(inner) if inner is not None else None)
        mb.set_group_factory(self.create_group)
        return self.world

    def create_group(self, torch_name: str, ranks: list[int], group_rank: int, size: int) -> "mb.MoverBackend":
        """The mover of a group the training script creates (``dist.new_group``, ``new_subgroups``, a DeviceMesh
        dimension: the tmover creator calls this through ``worker.backend.set_group_factory``). ``torch_name``
        is torch's group name (the same on every process: torch numbers groups in creation order), ``ranks`` its
        global ranks. An active rank connects it under ``layout.created_group_prefix`` in the world group's
        current mode (recording while the world records); a joiner in its sandbox does not connect and replays
        the group from its recording (:attr:`replay_dir`). Raises FileNotFoundError on a joiner when the group
        has no recording (it was created after the job recorded its first steps). A group connected live is then
        passed to :attr:`on_created` (the session reports one created after the recorded steps)."""
        from worker import sandbox

        name = f"pg{torch_name}"
        if name in self.groups:
            raise ValueError(f"process group {name} exists already on rank {self.rank}")
        recording = setup = None
        if self.replay_dir is not None:
            mover = mb.MoverBackend(group_rank, size, None)
            recording = sandbox.start_replay(mover, self.replay_dir, self.rank, name, ranks=list(ranks))
        else:
            inner = mb.build_inner(self.store, p.layout.created_group_prefix(name), group_rank, size,
                                   self.timeout_s, self.host)
            setup = mb.setup_of(inner)
            mover = mb.MoverBackend(group_rank, size, inner)
            mover.set_mode(self.world.mode)
            mover.tolerant = self.world.tolerant
        self.groups[name] = Group(name, list(ranks), mover, recording, setup)
        if recording is None and self.on_created is not None:
            self.on_created(name, list(ranks))
        return mover

    # --- phase 1 -----------------------------------------------------------------------------------------------
    def prepare(self, migration_id: int, generation: int, role: p.MigrationRole, leaver_ranks: list[int],
                transfer_prefix: str, on_done: Callable[[bool, str, list], None]) -> None:
        """Build generation ``generation`` of the groups that contain a leaver, in the background, then call
        ``on_done(ok, error, rebuilt_group_names)`` from that thread. ``role``: this rank's part (stayer,
        leaver or joiner); leaver and joiner also build their transfer group under ``transfer_prefix``."""
        pending = _Pending(migration_id, generation)
        with self._lock:
            if self._pending is not None:
                self._pending.cancelled = True
            self._pending = pending
        # Delta-based: only the groups that contain a leaver get a new generation; the leaver builds none.
        # A group made only of leaver ranks is rebuilt by the joiners alone (nobody else is a member).
        leaver = role == p.MigrationRole.LEAVER
        affected = [] if leaver else [g for g in self.groups.values() if set(g.ranks) & set(leaver_ranks)]

        def build() -> None:
            built: dict[str, object] = {}
            transfer = None
            try:
                store = self.connect_store()  # its own: a peer lost mid-prepare blocks only this setup
                for g in affected:
                    built[g.name] = self._inner(generation, g.name, g.ranks, store)
                if role in (p.MigrationRole.LEAVER, p.MigrationRole.JOINER):
                    transfer = mb.build_inner(store, transfer_prefix, 0 if leaver else 1, 2, self.timeout_s, self.host)
                with self._lock:
                    if pending.cancelled:
                        raise RuntimeError("migration aborted while its groups were being built")
                    for name, inner in built.items():
                        self.groups[name].mover.stage(inner)
                        pending.staged.append(name)
                        pending.setups[name] = mb.setup_of(inner)
                    pending.transfer = transfer
                    built, transfer = {}, None  # owned by the movers / the pending record now
            except Exception as e:  # noqa: BLE001 - reported to tmd, never raised into training
                pending.error = f"{type(e).__name__}: {e}"
                for g in (*built.values(), transfer):
                    if g is not None:
                        mb.release_in_background(g)
            finally:
                pending.ready.set()
            on_done(not pending.error, pending.error, list(pending.staged))

        threading.Thread(target=build, daemon=True, name=f"tm-prepare-g{generation}").start()

    def transfer_group(self, migration_id: int, timeout_s: float) -> object:
        """The transfer group of ``migration_id`` once phase 1 built it. Raises RuntimeError if it failed, was
        cancelled, or is not ready within ``timeout_s`` seconds."""
        pending = self._pending
        if pending is None or pending.migration_id != migration_id:
            raise RuntimeError(f"no groups prepared for migration {migration_id}")
        if not pending.ready.wait(timeout_s):
            raise RuntimeError(f"transfer group not ready after {timeout_s:.0f} s")
        if pending.error or pending.transfer is None:
            raise RuntimeError(pending.error or "no transfer group was built")
        return pending.transfer

    def staged(self, migration_id: int) -> list[str]:
        """Names of the groups with a next generation staged for ``migration_id``."""
        pending = self._pending
        return list(pending.staged) if pending is not None and pending.migration_id == migration_id else []

    # --- phase 2 -----------------------------------------------------------------------------------------------
    def commit(self, migration_id: int) -> int:
        """Swap the staged generation in (between two iterations). Returns the mover's new generation."""
        with self._lock:
            pending, self._pending = self._pending, None
            if pending is None or pending.migration_id != migration_id or not pending.staged:
                raise RuntimeError(f"nothing staged for migration {migration_id}")
            for name in pending.staged:
                self.groups[name].mover.commit()
                self.groups[name].swap_setup(pending.setups.pop(name, None))
            if p.layout.WORLD_GROUP in pending.staged:
                self.world_generation = pending.generation
        self._retire(pending)
        self._trim_due, self._trim_armed = True, False
        return self.world.generation

    def discard(self, migration_id: int) -> None:
        """Drop what phase 1 built for ``migration_id`` (abort); the current groups stay as they are."""
        with self._lock:
            pending = self._pending
            if pending is None or pending.migration_id != migration_id:
                return
            pending.cancelled = True
            self._pending = None
            for name in pending.staged:
                self.groups[name].mover.discard_staged()
        self._retire(pending)
        self._discard_setups(pending)

    # --- failure recovery ----------------------------------------------------------------------------------------
    def set_tolerant(self, tolerant: bool = True) -> None:
        """Make every group's mover absorb a failed collective (latch the failure, complete the op with its
        outputs untouched) instead of raising from ``wait()``; see ``MoverBackend.tolerant``."""
        for g in self.groups.values():
            g.mover.tolerant = tolerant

    def fail_all(self, reason: str) -> int:
        """Latch a failure on every group's mover: a collective blocked on a lost peer returns at once and
        later ops complete without communicating until :meth:`install`. Returns the works released."""
        return sum(g.mover.fail(reason) for g in self.groups.values())

    def ops_issued(self) -> int:
        """Collectives and point-to-point ops issued so far over all of this rank's groups (the movers'
        ``ops_issued`` counters; a migration's transfer group is not one of them)."""
        return sum(g.mover.counters()["ops_issued"] for g in list(self.groups.values()))

    def failure(self) -> Optional[str]:
        """The first latched failure among this rank's groups, or None."""
        for g in self.groups.values():
            why = g.mover.failure
            if why:
                return f"{g.name}: {why}"
        return None

    def build_all(self, generation: int, store=None) -> dict[str, object]:
        """Build generation ``generation`` of every group of this rank (blocking until each group's members
        built theirs: a rendezvous) over ``store`` (default: the job's store; a recovery attempt passes its own
        :meth:`connect_store`). After a failure every group is rebuilt, not only those that held the lost
        ranks: an aborted step can leave a group's members at different points of its op sequence, so its
        communicator cannot be trusted. Returns inner backends by group name for :meth:`install`; on error the
        ones already built are released and the error is raised."""
        built: dict[str, object] = {}
        try:
            for name in sorted(self.groups):
                g = self.groups[name]
                built[name] = self._inner(generation, name, g.ranks, store)
        except BaseException:
            for inner in built.values():
                mb.release_in_background(inner)
            raise
        return built

    def install(self, built: dict[str, object], generation: int) -> None:
        """Stage and commit what :meth:`build_all` built as generation ``generation`` (clears each mover's failure
        latch; the old inners are dropped on C++ threads)."""
        with self._lock:
            if self._pending is not None:
                self._pending.cancelled = True
                for name in self._pending.staged:
                    self.groups[name].mover.discard_staged()
                self._retire(self._pending)
                self._discard_setups(self._pending)
                self._pending = None
            for name, inner in built.items():
                mover = self.groups[name].mover
                mover.stage(inner)
                mover.commit()
                self.groups[name].swap_setup(mb.setup_of(inner))
            if p.layout.WORLD_GROUP in built:
                self.world_generation = generation
        self._trim_due, self._trim_armed = True, False

    def step_committed(self, at_backward: Optional[Callable[[Callable[[], None]], bool]] = None) -> None:
        """The training loop committed a step. After the first one since a swap (:meth:`commit`, :meth:`install`),
        the heap trim that the swap made due (:func:`trim_heap_when_released`) starts:

        - not at the swap itself: the trim and the page faults that bring the trimmed pages back would land in the
          step right after it, the switch step's neighbour or a recovery's redone step, which every peer waits for;
        - where ``at_backward(fn)`` arms ``fn`` to run as the next step's backward pass begins (it returns False
          where it cannot: worker.void_passes ``VoidPassStopper.at_next_backward``), then. That is when the step's
          activations are all allocated, so the trim releases little more than what the swap freed: measured on a
          demo GPT rank, ~6 k minor page faults and ~15 ms more CPU in that step, against ~23 k and ~60 ms for a
          trim at the step boundary, where the step's transient memory is all free and every page of it comes back
          by faulting;
        - otherwise, or when the armed step committed without a backward pass, at once.

        A swap while a trim is armed disarms it: that swap's own trim follows the step after it."""
        self._trim_if_armed()  # armed at the last commit, and that step ran no backward pass
        if self._trim_due:
            self._trim_due = False
            self._trim_armed = at_backward is not None and at_backward(self._trim_if_armed)
            if not self._trim_armed:
                trim_heap_when_released()

    def _trim_if_armed(self) -> None:
        """Start the armed trim, once: as the armed step's backward pass begins (on the thread that runs its
        gradient hooks), or at the next commit when that step ran none."""
        with self._lock:
            armed, self._trim_armed = self._trim_armed, False
        if armed:
            trim_heap_when_released()

    def set_mode(self, mode: p.MoverMode) -> None:
        """Set every group's mover to ``mode``; out of ``replay`` (a joiner taking its rank), groups created
        from now on connect. Raises ValueError for a string that is no MoverMode."""
        value = p.MoverMode(mode).value  # the C++ backend takes the plain string
        if value != p.MoverMode.REPLAY.value:
            self.replay_dir = None
        for g in self.groups.values():
            g.mover.set_mode(value)

    def finish_transfer(self, migration_id: int) -> None:
        """Drop the transfer group after the state moved (off the hot path)."""
        with self._lock:
            pending = self._pending
            if pending is not None and pending.migration_id == migration_id:
                self._retire(pending)

    @staticmethod
    def _retire(pending: _Pending) -> None:
        if pending.transfer is not None:
            mb.release_in_background(pending.transfer)
            pending.transfer = None

    @staticmethod
    def _discard_setups(pending: _Pending) -> None:
        """The staged inners were discarded: release their setups."""
        for setup in pending.setups.values():
            if setup is not None:
                setup.release()
        pending.setups.clear()

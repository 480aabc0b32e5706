"""The session's checkpoint tier: the rank side of ``tmd local|slurm --checkpoint-dir DIR --checkpoint-every N``.

tmd passes the settings in the environment of every process it starts (:class:`Settings`, read once):
``TM_CHECKPOINT_DIR`` (the job's checkpoint root), ``TM_CHECKPOINT_EVERY`` (steps; 0 or unset: no saves),
``TM_CHECKPOINT_KEEP`` (checkpoints kept, default 2), ``TM_CHECKPOINT_JOB`` (the job id that owns the root,
tmd.tiers) and ``TM_RESUME_FROM`` (a checkpoint to start from: ``--resume-from``, or the one tmd chose when it
restarted the job from the checkpoint tier) and ``TM_CHECKPOINT_RESTART`` (1: tmd relaunched this job; its
processes keep the recording of the job's first steps that the run directory holds instead of recording again,
so a later joiner replays steps with DDP's regrouping in them as ever).

What the session does with them (worker.session, active ranks only, never in a joiner's shadow iterations):

- **at start** (the first step boundary, after ``manage``): with ``TM_RESUME_FROM`` every rank loads that
  checkpoint (worker.checkpoint.Checkpointer.load: the managed objects, its own rank state with its RNG and data
  position) and the loop starts at the checkpoint's step. A checkpoint of another world size or layout ends the
  job with one line naming the difference (:class:`worker.checkpoint.LayoutMismatch`, reported as the script's
  error).
- **at each step boundary** where ``steps done % every == 0``: an asynchronous save (the stall is the copy into
  host memory; the write runs on a thread of its own). A save that fails is reported to tmd as
  ``RankWarning(checkpoint_failed)`` by rank 0 (every rank sees the same failure) and the job trains on.

**DDP's gradient buckets.** DDP regroups its buckets once, at its second iteration, in the order the first
backward pass produced the gradients; the bucket layout decides each gradient's offset in the all-reduce and so the
order in which its values are summed. A process started from a checkpoint would run its first step with DDP's
initial layout, unlike the job it continues, and its state would differ in the last bits. So the checkpoint keeps
the (one) managed DDP model's regrouped layout in each rank's rank state (``_ddp_buckets``), and after a load DDP is
regrouped to it before the first step: its two regrouping broadcasts are answered from that layout by the mover
(replayed, as in a joiner's sandbox) instead of over the network. Those two are written into the job's recording
at the start of its recorded step 0 (:attr:`SessionCheckpoints.regrouped`, worker.sandbox.save_recordings_async):
a joiner, whose DDP is built afresh, replays them before its first iteration and has the job's layout.

The background saves run on a gloo process group of their own over the job's store (never the mover: its
collectives would be recorded and its failure latch would stop them), one per generation of the world group:
after a migration or a recovery the members changed, so the group is built afresh and the old saver is
abandoned (a save in flight when a member was lost fails on its own timeout and is reported).

**The saver group is built off the training thread.** tmd hosts the store, and tmd may be dead (kill -9, until
``tmd resume``) at any step; a build in a dead store waits out its timeout. So each rank builds the group on a
thread of its own (:class:`_Build`), started at the generation's first step, and publishes the build's state,
``[generation, attempt, state]``, in the per-step exchange (worker.step_exchange ``saver``). A save is a
collective on that group, so every rank must decide alike whether a step is saved: each decides from the statuses
all-gathered in the exchange of the step just committed, which every rank that committed it holds alike
(:func:`agree`). A due save is taken when every rank's build of the current generation is ready at the same
attempt, and skipped otherwise (reported once per generation by rank 0, ``checkpoint_failed``; the step is not
held up). A failed attempt (its timeout ran out, or this rank's store was replaced by a restarted tmd's while the
attempt waited in the old one) makes every rank start the next attempt at the same boundary, under a fresh prefix
in the store the rank holds now, so saves resume once tmd is back. A job without a managed optimizer has no
per-step exchange: there the group is built on the training thread at each due save until built (bounded by
:data:`GROUP_BUILD_TIMEOUT_S`, a failed build skips that save only).
"""
from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import threading
import time
from typing import Any, Callable, ContextManager, Optional

import torch
import torch.distributed as dist

from tmd import protocol as p
from worker import backend as mb
from worker import checkpoint
from worker.ddp_regroup import ddp_to_regroup

log = logging.getLogger("worker.checkpointing")

GROUP_TIMEOUT_S = 600.0  # the saver group's gloo timeout: a save of a large state waits this long for a peer
# how long one attempt at building the saver group (on a thread of its own) waits for every rank; a failed attempt
# is followed by another one (see the module docstring)
GROUP_BUILD_TIMEOUT_S = 60.0
RETRY_DELAY_S = 1.0  # a retried attempt starts this long after it was decided (a store that refuses at once)

# the state of one attempt at building a saver group, as published in the per-step exchange
BUILDING, READY, FAILED = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class Settings:
    """The checkpoint settings tmd gave this process (see the module docstring); ``root`` None: none."""

    root: Optional[str] = None
    every: int = 0
    keep: int = 2
    job_id: str = ""
    resume_from: Optional[str] = None
    restart: bool = False  # TM_CHECKPOINT_RESTART=1: tmd relaunched the job (the run dir's recordings are its own)

    @classmethod
    def from_env(cls, env: Optional[dict] = None) -> "Settings":
        """Read the ``TM_CHECKPOINT_*`` and ``TM_RESUME_FROM`` variables. Raises ValueError for a value that is
        not a number where one is expected."""
        env = os.environ if env is None else env
        return cls(root=env.get("TM_CHECKPOINT_DIR") or None, every=int(env.get("TM_CHECKPOINT_EVERY") or 0),
                   keep=int(env.get("TM_CHECKPOINT_KEEP") or 2), job_id=env.get("TM_CHECKPOINT_JOB") or "local",
                   resume_from=env.get("TM_RESUME_FROM") or None,
                   restart=env.get("TM_CHECKPOINT_RESTART") == "1")

    @property
    def active(self) -> bool:
        return self.resume_from is not None or (self.root is not None and self.every > 0)


def saver_backend(store: dist.Store, prefix: str, rank: int, size: int,
                  host: Optional[str]) -> dist.ProcessGroupGloo:
    """The gloo backend of a saver group (:func:`saver_group`): blocks until every rank built it, at most
    :data:`GROUP_BUILD_TIMEOUT_S` (then raises torch.distributed.DistStoreError); its ops time out after
    :data:`GROUP_TIMEOUT_S`. Touches nothing of torch.distributed's (any thread may build it)."""
    backend = mb.build_gloo(store, prefix, rank, size, GROUP_BUILD_TIMEOUT_S, host)
    backend._set_default_timeout(datetime.timedelta(seconds=GROUP_TIMEOUT_S))  # what dist._set_pg_timeout does
    return backend


def saver_group(store: dist.Store, prefix: str, rank: int, size: int, host: Optional[str],
                backend: Optional[dist.ProcessGroupGloo] = None) -> dist.ProcessGroup:
    """A gloo process group of every rank under ``prefix`` (never reused), registered with torch.distributed so
    that DCP can use it (``dist.get_rank(group)``), but unknown to the session's GroupManager: it is neither
    recorded, nor latched by a failure, nor rebuilt by a migration. ``backend``: its :func:`saver_backend`, built
    already (on another thread); else built here (blocking). Training thread: torch.distributed's registry of
    groups is not thread-safe."""
    if backend is None:
        backend = saver_backend(store, prefix, rank, size, host)
    pg = dist.ProcessGroup(store, rank, size)
    pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    world = dist.distributed_c10d._world
    world.pg_map[pg] = ("gloo", store)
    world.pg_names[pg] = prefix.replace("/", "_")
    world.pg_group_ranks[pg] = {r: r for r in range(size)}
    world.pg_backend_config[pg] = "gloo"
    return pg


def saver_prefix(generation: int, attempt: int) -> str:
    """The store prefix of ``attempt`` at generation ``generation``'s saver group (each attempt's keys are fresh)."""
    return f"tm/ckpt/g{generation}/a{attempt}"


class _Build:
    """One attempt at a generation's saver group: its gloo backend (:func:`saver_backend`), built by
    :meth:`start` on a thread of its own in the store that ``store()`` gives once the attempt's ``delay`` passed.
    The training thread reads :attr:`state`, makes the group of a ready one (:meth:`group`) and may
    :meth:`abandon` one (its thread then runs out on its own; what it builds is dropped)."""

    def __init__(self, generation: int, attempt: int, rank: int, size: int, host: Optional[str]) -> None:
        self.generation = generation
        self.attempt = attempt
        self.prefix = saver_prefix(generation, attempt)
        self.rank, self.size, self.host = rank, size, host
        self.store: Optional[dist.Store] = None  # the store the attempt builds in (None until its thread chose it)
        self.backend: Optional[dist.ProcessGroupGloo] = None
        self.error = ""  # why the attempt failed
        self._group: Optional[dist.ProcessGroup] = None
        self._lock = threading.Lock()
        self._done = False

    def start(self, store: Callable[[], dist.Store], delay: float) -> "_Build":
        threading.Thread(target=self._run, args=(store, delay), daemon=True,
                         name=f"saver-group-g{self.generation}a{self.attempt}").start()
        return self

    def _run(self, store: Callable[[], dist.Store], delay: float) -> None:
        if delay > 0:
            time.sleep(delay)
        with self._lock:
            if self._done:
                return  # abandoned while it waited
            self.store = store()
        try:
            backend = saver_backend(self.store, self.prefix, self.rank, self.size, self.host)
        except Exception as e:  # noqa: BLE001 - DistStoreError, a gloo error: the attempt failed, another follows
            self.finish(None, f"{type(e).__name__}: {e}")
        else:
            self.finish(backend, "")

    def build_here(self, store: dist.Store) -> "_Build":
        """Build it on this thread (blocking; raises what :func:`saver_backend` raises)."""
        self.store = store
        self.finish(saver_backend(store, self.prefix, self.rank, self.size, self.host), "")
        return self

    def finish(self, backend: Optional[dist.ProcessGroupGloo], error: str) -> None:
        with self._lock:
            if not self._done:
                self.backend, self.error, self._done = backend, error, True

    def abandon(self, why: str) -> None:
        """Count the attempt as failed (``why``) unless it finished already."""
        self.finish(None, why)

    @property
    def state(self) -> int:
        with self._lock:
            return BUILDING if not self._done else READY if self.backend is not None else FAILED

    def status(self) -> list[int]:
        """What the per-step exchange publishes: ``[generation, attempt, state]``."""
        return [self.generation, self.attempt, self.state]

    def group(self) -> dist.ProcessGroup:
        """The process group of a ready attempt (made once, on the training thread: :func:`saver_group`)."""
        if self._group is None:
            self._group = saver_group(self.store, self.prefix, self.rank, self.size, self.host, self.backend)
        return self._group


def agree(statuses: list[Optional[list[int]]], generation: int) -> tuple[Optional[int], int]:
    """The decision every rank takes alike from every rank's build status (``[generation, attempt, state]`` or
    None, in rank order, as the exchange of one committed step gathered them), at ``generation``: (the attempt
    whose saver group every rank built, or None; the attempt every rank should be building now). A failed attempt
    of any rank moves every rank to the next one; statuses of another generation are not counted."""
    current = [s for s in statuses if s is not None and s[0] == generation]
    if not current:
        return None, 0
    top = max(s[1] for s in current)
    if len(current) == len(statuses) and all(s[1] == top and s[2] == READY for s in current):
        return top, top
    return None, top + 1 if any(s[1] == top and s[2] == FAILED for s in current) else top


BUCKETS = "_ddp_buckets"  # the rank-state entry of DDP's bucket layout


def _ddp_of(replicated: dict[str, Any]) -> Optional[torch.nn.parallel.DistributedDataParallel]:
    """The managed DistributedDataParallel model, when there is exactly one."""
    found = [o for o in replicated.values() if isinstance(o, torch.nn.parallel.DistributedDataParallel)]
    return found[0] if len(found) == 1 else None


class BucketLayout:
    """DDP's regrouped bucket layout as a rank-local object of the checkpoint (see the module docstring): its
    state_dict is ``{"buckets": [[parameter index, ...], ...]}`` (``{}`` before DDP regrouped, or without one
    DDP model); what a load gave is in :attr:`loaded`."""

    def __init__(self, replicated: dict[str, Any]) -> None:
        self.replicated = replicated
        self.loaded: Optional[list[list[int]]] = None

    def state_dict(self) -> dict:
        ddp = _ddp_of(self.replicated)
        if ddp is None or not getattr(ddp, "_has_rebuilt_buckets", False):
            return {}
        text = ddp._get_ddp_logging_data().get("rebuilt_per_bucket_param_indices")
        if not isinstance(text, str) or not text.strip():
            return {}
        return {"buckets": [[int(i) for i in bucket.split()] for bucket in text.split(",")]}

    def load_state_dict(self, state: dict) -> None:
        self.loaded = state.get("buckets")


def regrouping_ops(buckets: list[list[int]], device: Any = "cpu") -> list[tuple[str, list[torch.Tensor]]]:
    """The two broadcasts of DDP's regrouping to ``buckets`` (worker.ddp_regroup), as recorded ops: the parameter
    indices with the bucket count, then the bucket sizes (int32)."""
    indices = torch.tensor([i for b in buckets for i in b] + [len(buckets)], dtype=torch.int32, device=device)
    sizes = torch.tensor([len(b) for b in buckets], dtype=torch.int32, device=device)
    return [("broadcast", [indices]), ("broadcast", [sizes])]


def regroup_to(ddp: torch.nn.parallel.DistributedDataParallel, buckets: list[list[int]]) -> bool:
    """Regroup ``ddp``'s gradient buckets to ``buckets`` (every rank, before its first iteration): torch's
    ``Reducer::rebuild_buckets`` with its two broadcasts (the indices with the bucket count, then the bucket sizes:
    worker.ddp_regroup) answered by the mover from ``buckets``. Returns whether it regrouped (False: a DDP this
    cannot regroup, see worker.ddp_regroup.ddp_to_regroup)."""
    ok, pending = ddp_to_regroup()
    if not ok or pending is not ddp:
        return False
    mover = mb.mover_of(ddp.process_group)
    mode = mover.mode
    mover.load_recording(regrouping_ops(buckets, next(ddp.module.parameters()).device))
    mover.set_mode(p.MoverMode.REPLAY.value)
    try:
        ddp.reducer._push_all_rebuilt_params()
        rebuilt = ddp.reducer._rebuild_buckets()
    finally:
        mover.set_mode(mode)
        mover.load_recording([])
    if rebuilt:
        ddp._has_rebuilt_buckets = True
    return rebuilt


class SessionCheckpoints:
    """One process's checkpoint tier. ``settings``: from the environment; ``store()``, ``host``: the job's store
    (now: a restarted tmd hosts a new one) and the gloo address (worker.groups.GroupManager's); ``warn(code, message)``: a RankWarning to tmd;
    ``disarmed()``: a context manager in which the managed optimizers' step hooks do nothing (DCP's
    ``get_optimizer_state_dict`` steps a fresh optimizer with lr 0 to create its state)."""

    def __init__(self, settings: Settings, store: Callable[[], dist.Store], host: Optional[str],
                 warn: Callable[[p.WarningCode, str], None], disarmed: Callable[[], ContextManager]) -> None:
        self.settings = settings
        self._store = store
        self._host = host
        self._warn = warn
        self._disarmed = disarmed
        self._saver: Optional[checkpoint.Checkpointer] = None
        self._saver_build: Optional[_Build] = None  # the build whose group self._saver saves on
        self._build: Optional[_Build] = None  # this rank's latest attempt at the current generation's saver group
        self._skip_reported: Optional[int] = None  # the generation whose first skipped save was reported
        self.loaded_step: Optional[int] = None
        # after a load that regrouped DDP: (its process group, the regrouping's broadcasts as recorded ops), which
        # the session writes at the start of the recording's step 0 (worker.sandbox.save_recordings_async ``inserted``)
        self.regrouped: Optional[tuple[Any, list]] = None

    @property
    def saving(self) -> bool:
        """Whether this process saves checkpoints (a checkpoint dir and a period)."""
        return self.settings.root is not None and self.settings.every > 0

    def _saver_of(self, build: _Build) -> checkpoint.Checkpointer:
        """The saver on ``build``'s group (made once; a saver of an older build is abandoned, a save of it in
        flight not waited for)."""
        if self._saver_build is not build:
            root = self.settings.root or self.settings.resume_from  # no root: this process only loads
            self._saver = checkpoint.Checkpointer(root, self.settings.job_id, keep=self.settings.keep,
                                                  process_group=build.group(), on_error=self._failed,
                                                  claim=self.settings.root is not None)
            self._saver_build = build
        return self._saver

    def _built_here(self, rank: int, world_size: int, generation: int, attempt: int) -> checkpoint.Checkpointer:
        """Build the saver group on this (the training) thread, every rank at the same boundary, and return its
        saver. Raises what :func:`saver_backend` raises."""
        self._build = _Build(generation, attempt, rank, world_size, self._host).build_here(self._store())
        return self._saver_of(self._build)

    def _start_build(self, rank: int, world_size: int, generation: int, attempt: int) -> _Build:
        if self._build is not None:
            self._build.abandon("abandoned for a later attempt")
        self._build = _Build(generation, attempt, rank, world_size, self._host).start(
            self._store, RETRY_DELAY_S if attempt else 0.0)
        return self._build

    def status(self, rank: int, world_size: int, generation: int) -> Optional[list[int]]:
        """This rank's part of the per-step exchange (training thread, live active steps): the state of its build
        of ``generation``'s saver group, ``[generation, attempt, state]``, starting the generation's first
        attempt at its first step. An attempt still waiting in a store that is no longer the job's (a restarted
        tmd hosts a new one: worker.groups.GroupManager.set_store) is counted as failed: the next attempt uses
        the new one. None when this process does not save."""
        if not self.saving:
            return None
        build = self._build
        if build is None or build.generation != generation:
            build = self._start_build(rank, world_size, generation, 0)
        elif build.store is not None and build.store is not self._store():
            build.abandon("the store it waited in was replaced (tmd restarted)")
        return build.status()

    def _failed(self, step: int, message: str) -> None:
        if self._saver is not None and self._saver.rank == 0:  # every rank saw the same failure: one report
            self._warn(p.WarningCode.CHECKPOINT_FAILED, message)

    def start(self, rank: int, world_size: int, generation: int, replicated: dict[str, Any],
              local: dict[str, Any]) -> int:
        """At an active rank's first step boundary: load ``TM_RESUME_FROM`` if given and return the step to start
        at (0 without one). Raises worker.checkpoint.CheckpointError (LayoutMismatch among them) when the
        checkpoint cannot be used."""
        source = self.settings.resume_from
        if source is None:
            return 0
        saver = self._built_here(rank, world_size, generation, 0)  # the store is up: tmd just started the job
        layout = BucketLayout(replicated)
        with self._disarmed():
            step = saver.load(replicated, {**local, BUCKETS: layout}, source=source)
        for line in saver.refused:
            log.warning("rank %d: %s", rank, line)
        if step is None:
            raise checkpoint.CheckpointError(f"no valid checkpoint in {source}: " + "; ".join(saver.refused))
        self.loaded_step = step
        ddp = _ddp_of(replicated)
        regrouped = bool(layout.loaded) and ddp is not None and regroup_to(ddp, layout.loaded)
        if regrouped:
            device = next(ddp.module.parameters()).device
            self.regrouped = (ddp.process_group, regrouping_ops(layout.loaded, device))
        log.info("rank %d: resumed from %s at step %d%s", rank, source, step,
                 ", DDP's buckets regrouped as the job had them" if regrouped else "")
        return step

    def after_commit(self, steps_done: int, rank: int, world_size: int, generation: int,
                     replicated: dict[str, Any], local: dict[str, Any],
                     agreed: Optional[list[Optional[list[int]]]] = None) -> None:
        """At the step boundary after ``steps_done`` steps: save when it is due and every rank's saver group is
        built (asynchronous: returns once the state is in host memory). ``agreed``: every rank's :meth:`status`
        as the exchange of the step just committed gathered them (the same on every rank that committed it);
        None without a per-step exchange (no managed optimizer). Never blocks on the store, never raises for
        storage errors (they are reported)."""
        if not self.saving:
            return
        due = steps_done % self.settings.every == 0 and steps_done != self.loaded_step
        if agreed is None:
            if due:
                self._save_built_here(steps_done, rank, world_size, generation, replicated, local)
            return
        ready, attempt = agree(agreed, generation)
        build = self._build
        if ready is None and (build is None or build.generation != generation or build.attempt < attempt):
            self._start_build(rank, world_size, generation, attempt)  # every rank alike: the next attempt
        if not due:
            return
        if ready is None or build is None or (build.generation, build.attempt) != (generation, ready):
            self._skipped(steps_done, rank, generation, agreed, build)
            return
        with self._disarmed():
            self._saver_of(build).save(steps_done, replicated, {**local, BUCKETS: BucketLayout(replicated)})

    def _skipped(self, steps_done: int, rank: int, generation: int, agreed: list[Optional[list[int]]],
                 build: Optional[_Build]) -> None:
        """A due save skipped because not every rank's saver group is built (``build``: this rank's attempt the
        statuses were of): logged, and reported to tmd once per generation (by rank 0: every rank skipped it
        alike)."""
        names = {BUILDING: "building", READY: "ready", FAILED: "failed"}
        states = [f"{s[1]}:{names.get(s[2], s[2])}" if s is not None and s[0] == generation else "none"
                  for s in agreed]
        why = f"attempt:state by rank {states}"
        if build is not None and build.generation == generation and build.error:
            why += f"; this rank's attempt {build.attempt} failed: {build.error}"
        message = (f"checkpoint at step {steps_done} not saved: the saver group of generation {generation} is not "
                   f"built yet on every rank ({why}); the next due save after it is built is taken")
        log.warning("rank %d: %s", rank, message)
        if self._skip_reported != generation and rank == 0:
            self._skip_reported = generation
            self._warn(p.WarningCode.CHECKPOINT_FAILED, message)

    def _save_built_here(self, steps_done: int, rank: int, world_size: int, generation: int,
                         replicated: dict[str, Any], local: dict[str, Any]) -> None:
        """Without a per-step exchange: build the generation's saver group on the training thread at a due save
        (at most :data:`GROUP_BUILD_TIMEOUT_S`; a failed build skips this save, the next due save tries again under
        a fresh prefix in the store the rank holds then)."""
        build = self._build
        if build is not None and build.generation == generation and build.state == READY:
            saver = self._saver_of(build)
        else:
            try:
                saver = self._built_here(rank, world_size, generation, steps_done)
            except RuntimeError as e:  # a rank lost, a dead store (DistStoreError, a gloo error)
                self._build = None
                self._warn(p.WarningCode.CHECKPOINT_FAILED,
                           f"checkpoint at step {steps_done} not saved: the saver group of generation {generation} "
                           f"was not built within {GROUP_BUILD_TIMEOUT_S:g} s ({type(e).__name__}: {e}); the next "
                           f"due save tries again")
                return
        with self._disarmed():
            saver.save(steps_done, replicated, {**local, BUCKETS: BucketLayout(replicated)})

    def wait(self) -> None:
        """Wait for the save in flight (a leaver before it hands over, every rank at the end)."""
        if self._saver is not None:
            self._saver.wait()

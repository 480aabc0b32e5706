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
after a migration or a recovery the members changed, so the next save builds the group afresh and the old
saver is abandoned (a save in flight when a member was lost fails on its own timeout and is reported).
"""
from __future__ import annotations

import dataclasses
import datetime
import logging
import os
from typing import Any, Callable, ContextManager, Optional

import torch
import torch.distributed as dist

from tmd import protocol as p
from worker import backend as mb
from worker import checkpoint
from worker.ddp_regroup import ddp_to_regroup

log = logging.getLogger("worker.checkpointing")

GROUP_TIMEOUT_S = 600.0  # the saver group's gloo timeout: a save of a large state waits this long for a peer
# how long building the saver group (on the training thread, at a step boundary) waits for every rank: a peer lost
# just then leaves the save undone and reported (a RankWarning), not the rank blocked for GROUP_TIMEOUT_S
GROUP_BUILD_TIMEOUT_S = 60.0


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


def saver_group(store: dist.Store, prefix: str, rank: int, size: int, host: Optional[str]) -> dist.ProcessGroup:
    """A gloo process group of every rank under ``prefix`` (never reused), registered with torch.distributed so
    that DCP can use it (``dist.get_rank(group)``), but unknown to the session's GroupManager: it is neither
    recorded, nor latched by a failure, nor rebuilt by a migration. Blocks until every rank built it, at most
    :data:`GROUP_BUILD_TIMEOUT_S` (then raises torch.distributed.DistStoreError); its ops time out after
    :data:`GROUP_TIMEOUT_S`."""
    backend = mb.build_gloo(store, prefix, rank, size, GROUP_BUILD_TIMEOUT_S, host)
    backend._set_default_timeout(datetime.timedelta(seconds=GROUP_TIMEOUT_S))  # what dist._set_pg_timeout does
    pg = dist.ProcessGroup(store, rank, size)
    pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    world = dist.distributed_c10d._world
    world.pg_map[pg] = ("gloo", store)
    world.pg_names[pg] = prefix.replace("/", "_")
    world.pg_group_ranks[pg] = {r: r for r in range(size)}
    world.pg_backend_config[pg] = "gloo"
    return pg


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
        self._generation: Optional[int] = None
        self._unbuilt: Optional[int] = None  # a generation whose saver group could not be built (no saves in it)
        self.loaded_step: Optional[int] = None
        # after a load that regrouped DDP: (its process group, the regrouping's broadcasts as recorded ops), which
        # the session writes at the start of the recording's step 0 (worker.sandbox.save_recordings_async ``inserted``)
        self.regrouped: Optional[tuple[Any, list]] = None

    def _checkpointer(self, rank: int, world_size: int, generation: int) -> checkpoint.Checkpointer:
        """The saver of world generation ``generation`` (built by every rank at the same boundary)."""
        if self._saver is None or self._generation != generation:
            self._saver = None  # an older generation's save in flight is abandoned, not waited for
            group = saver_group(self._store(), f"tm/ckpt/g{generation}", rank, world_size, self._host)
            root = self.settings.root or self.settings.resume_from  # no root: this process only loads
            self._saver = checkpoint.Checkpointer(root, self.settings.job_id, keep=self.settings.keep,
                                                  process_group=group, on_error=self._failed,
                                                  claim=self.settings.root is not None)
            self._generation = generation
        return self._saver

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
        saver = self._checkpointer(rank, world_size, generation)
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
                     replicated: dict[str, Any], local: dict[str, Any]) -> None:
        """At the step boundary after ``steps_done`` steps: save when it is due (asynchronous: returns once the
        state is in host memory). Never raises for storage errors (they are reported)."""
        every = self.settings.every
        if self.settings.root is None or every <= 0 or self._unbuilt == generation:
            return  # (an unbuilt saver group was reported: the next generation builds one afresh)
        # built (once per generation) at the generation's first committed step, every rank, while the store that
        # built the generation's groups is up: tmd hosts it, and a build at a later save could meet a tmd killed
        # meanwhile (its store gone; a restarted tmd hosts a new one) and wait GROUP_BUILD_TIMEOUT_S for nothing
        try:
            saver = self._checkpointer(rank, world_size, generation)
        except RuntimeError as e:  # a rank lost while the group was built (DistStoreError, a gloo error)
            self._unbuilt = generation
            self._warn(p.WarningCode.CHECKPOINT_FAILED,
                       f"checkpoints of generation {generation} not saved: its saver group was not built within "
                       f"{GROUP_BUILD_TIMEOUT_S:g} s at step {steps_done} ({type(e).__name__}: {e}); no saves "
                       f"until the world changes")
            return
        if steps_done % every != 0 or steps_done == self.loaded_step:
            return
        with self._disarmed():
            saver.save(steps_done, replicated, {**local, BUCKETS: BucketLayout(replicated)})

    def wait(self) -> None:
        """Wait for the save in flight (a leaver before it hands over, every rank at the end)."""
        if self._saver is not None:
            self._saver.wait()

"""The checkpoint tier on tmd's side: the last of the recovery tiers (a replica, then a buddy snapshot, then a
checkpoint). The ranks write the checkpoints themselves (worker.checkpointing, worker.checkpoint); tmd

- checks the options at start (:meth:`Tier.refusal`): ``--checkpoint-dir`` must not lie in another job's
  checkpoints, ``--resume-from`` must hold a valid checkpoint written under this world size;
- passes the settings to every process it starts (:meth:`Tier.env`: ``TM_CHECKPOINT_*``, ``TM_RESUME_FROM``);
- watches the directory for committed checkpoints (journal ``checkpoint_committed``) and journals failed saves
  (``checkpoint_failed``, from a rank's ``RankWarning(checkpoint_failed)``; the job trains on);
- when in-memory recovery is impossible (tmd.recovery.RecoveryError: every rank or every replica of some state
  lost, a node lost with its snapshot keeper, no standby within ``--standby-wait-s``, a recovery that failed)
  plans a restart from the newest valid checkpoint (:meth:`Tier.plan_restart`): a torn or corrupted one is
  passed over by name (``checkpoint_refused``), and ``job_restarting`` records the tier, the step rolled back to
  and the work lost in seconds. Local mode then relaunches every rank and standby process (tmd.cli) with
  ``TM_RESUME_FROM`` naming that checkpoint; the final state is bit-identical to an uninterrupted run. A tmd
  restarted by ``tmd resume`` (after a ``kill -9``) rebuilds the tier from the journal (:meth:`Tier.resumed`) and
  relaunches the same way, except for a job in network namespaces, which it cannot recreate (it fails the job).

The job id that owns a checkpoint directory (``<dir>/JOB``) is :func:`worker.checkpoint.job_identity` of the job's
name: the same across a restart in the same tmd and across a SLURM requeue (the SLURM job id stays), another for
any other job.
"""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Collection, Optional

from tmd.config import CheckpointTierConfig
from tmd.journal import Journal
from tmd.protocol.vocab import Event
from worker import checkpoint as ck

WATCH_EVERY_S = 1.0  # how often tmd looks for a newly committed checkpoint (a listdir and a stat)
MAX_RESTARTS_FROM_ONE_STEP = 3  # restarts from the same checkpoint after which the job fails (a crash loop)


@dataclasses.dataclass
class Restart:
    """A planned restart from the checkpoint at ``path`` (``step``: the steps it holds), after ``reason``;
    ``work_lost_s``: seconds between that checkpoint's commit and the failure."""

    step: int
    path: str
    reason: str
    work_lost_s: float
    at: float = dataclasses.field(default_factory=time.time)

    def to_dict(self) -> dict:
        return {"tier": "checkpoint", "step": self.step, "path": self.path, "reason": self.reason,
                "work_lost_s": round(self.work_lost_s, 3), "at": self.at}

    @classmethod
    def from_dict(cls, d: dict) -> Optional["Restart"]:
        """The restart a journalled ``job_restarting`` event (:meth:`to_dict`'s fields) describes; None for one
        without an int ``step`` and a str ``path`` (a journal is read, not trusted). ``at`` falls back to the
        event's ``ts``."""
        if not isinstance(d.get("step"), int) or not isinstance(d.get("path"), str):
            return None
        return cls(step=d["step"], path=d["path"], reason=str(d.get("reason", "")),
                   work_lost_s=float(d.get("work_lost_s") or 0.0), at=float(d.get("at") or d.get("ts") or 0.0))


def owner_in_path(path: str, job_id: str) -> Optional[str]:
    """Why ``path`` lies in another job's checkpoints (a ``JOB`` file naming another job in it or any directory
    above it), or None."""
    here = os.path.abspath(path)
    while True:
        try:
            ck.check_owner(here, job_id)
        except ck.CheckpointError as e:
            return str(e)
        parent = os.path.dirname(here)
        if parent == here:
            return None
        here = parent


def choose(source: str, job_id: Optional[str] = None,
           passed_over: Collection[str] = ()) -> tuple[Optional[tuple[int, str, dict]], list[str]]:
    """The newest valid checkpoint in ``source`` (a root of checkpoints or one ``step-*`` directory) as
    (step, path, manifest), or None; and one line per checkpoint passed over on the way (torn, truncated,
    corrupted, another job's when ``job_id`` is given). Verifies every file's sha256 (reads every byte).
    ``passed_over``: step directories not to consider (refused by the ranks already), not listed again."""
    source = os.path.abspath(source)
    one = os.path.exists(os.path.join(source, ck.MANIFEST)) or ck._STEP_DIR.match(os.path.basename(source))
    candidates = [(None, source)] if one else ck.checkpoints(source)
    refused = []
    for _, path in candidates:
        if path in passed_over:
            continue
        why, manifest = ck.verify(path, job_id)
        if why is None:
            return (int(manifest["step"]), path, manifest), refused
        refused.append(f"checkpoint {path} refused: {why}")
    return None, refused


class Tier:
    """tmd's checkpoint tier of one job (kept across the restarts it plans: the same object goes to each
    daemon). ``config``: the job configuration's ``checkpoint`` section (tmd.config.CheckpointTierConfig:
    ``--checkpoint-dir/-every/-keep``, ``--standby-wait-s``, each default defined there); ``job``: the job's name
    (its id is derived from it); ``world_size``: ranks; ``resume_from``: ``--resume-from`` (a root of checkpoints
    or one ``step-*`` directory, any job's) or None."""

    def __init__(self, config: CheckpointTierConfig, job: str, world_size: int,
                 resume_from: Optional[str] = None) -> None:
        self.config = config
        self.source = resume_from  # --resume-from as given (resume_from: the step directory it resolves to)
        self.job_id = ck.job_identity(job)
        self.world_size = world_size
        self.journal: Optional[Journal] = None
        self.resume_from: Optional[str] = None  # the step directory the next launch loads
        self.restarts: list[Restart] = []
        self.latest: Optional[int] = None  # the newest committed step tmd saw
        self.failed: Optional[str] = None  # the last failed save's message (shown for the job's life)
        self.last_seq = 0  # the journal's last sequence number when a restart ended the daemon before
        self.last_ids = (0, 0)  # that daemon's last migration and incident ids: the relaunched one goes on after
        self._refused: list[str] = []  # what --resume-from passed over, journalled once a daemon is attached
        self._watched_at = 0.0
        self.impossible: Optional[str] = None  # why this tmd cannot restart the job (then it fails instead)
        self.refused_at_load: set[str] = set()  # step directories a rank refused to load: never chosen again

    @classmethod
    def resumed(cls, config: CheckpointTierConfig, job: str, world_size: int, restarts: list[dict],
                netns: Optional[dict] = None) -> "Tier":
        """The tier of a job whose tmd died (``kill -9``) and is restarted by ``tmd resume``: the job's journalled
        ``config`` and the ``job_restarting`` events of its journal (``restarts``: the crash-loop count and the
        checkpoint a relaunch loaded go on). ``netns``: tmd.json's network namespaces: a resumed tmd cannot recreate
        them, so a job that had any is not restarted from a checkpoint (:attr:`impossible`; the job fails and
        ``job_failed`` says why)."""
        tier = cls(config, job, world_size)
        tier.restarts = [r for r in map(Restart.from_dict, restarts) if r is not None]
        tier.resume_from = tier.restarts[-1].path if tier.restarts else None
        if netns:
            tier.impossible = (f"a resumed tmd cannot recreate the network namespaces of {', '.join(sorted(netns))} "
                               f"(tmd local --netns-*)")
        return tier

    def attach(self, journal: Journal) -> None:
        """Journal to ``journal`` (each daemon's, after a restart the new one's)."""
        self.journal = journal

    def _record(self, event: Event, **fields) -> None:
        if self.journal is not None:
            self.journal.record(event, **fields)

    # --- start --------------------------------------------------------------------------------------------------
    def refusal(self) -> Optional[str]:
        """Why the job must not start with these options (one line), or None. Picks the checkpoint the job starts
        from (:attr:`resume_from`): ``--resume-from``'s newest valid one, else the newest valid one of this job
        in ``--checkpoint-dir`` (the same ``--job`` run again, a requeued SLURM job); what it passed over is
        journalled once a daemon is attached (:meth:`started`)."""
        root, source = self.config.checkpoint_dir, self.source  # the ranges are checked by the config section
        if self.config.checkpoint_every > 0 and root is None:
            return "--checkpoint-every needs --checkpoint-dir"
        if root is not None:
            why = owner_in_path(root, self.job_id)
            if why is not None:
                return f"{why}: give another --checkpoint-dir (to start from them: --resume-from)"
            if os.path.exists(root) and not os.path.isdir(root):
                return f"--checkpoint-dir {root} is not a directory"
        if source is None and root is not None and os.path.isdir(root):
            chosen, self._refused = choose(root, self.job_id)  # this job's own: it goes on from there
            self.resume_from = chosen[1] if chosen else None
        if source is not None:
            if not os.path.isdir(source):
                return f"--resume-from {source} is not a directory"
            chosen, refused = choose(source)
            self._refused = refused
            if chosen is None:
                return f"--resume-from {source} holds no valid checkpoint" + \
                    (f" ({refused[0]})" if refused else "")
            step, path, manifest = chosen
            saved = manifest["layout"].get("world_size")
            if saved != self.world_size:
                return f"checkpoint {path} was written under world size {saved}, this job has {self.world_size}"
            self.resume_from = path
        return None

    def started(self) -> None:
        """The first daemon is up: journal the checkpoints ``--resume-from`` passed over."""
        for line in self._refused:
            self._record(Event.CHECKPOINT_REFUSED, message=line)
        self._refused = []

    def env(self) -> dict[str, Optional[str]]:
        """The variables of every process tmd starts (None: unset it)."""
        c = self.config
        root = c.checkpoint_dir
        return {"TM_CHECKPOINT_DIR": os.path.abspath(root) if root else None,
                "TM_CHECKPOINT_EVERY": str(c.checkpoint_every) if root else None,
                "TM_CHECKPOINT_KEEP": str(c.checkpoint_keep) if root else None,
                "TM_CHECKPOINT_JOB": self.job_id,
                "TM_RESUME_FROM": self.resume_from,
                "TM_CHECKPOINT_RESTART": "1" if self.restarts else None}

    def export(self) -> None:
        """Put :meth:`env` into this process's environment, which the processes tmd starts inherit."""
        for name, value in self.env().items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

    def skip_existing(self) -> None:
        """A daemon starts (a new job or ``tmd resume``): the checkpoints already committed under
        ``--checkpoint-dir`` count as seen (:attr:`latest`) but are not journalled again by :meth:`tick`."""
        new = self._committed_since_latest()
        if new:
            self.latest = new[0][0]

    # --- while training -----------------------------------------------------------------------------------------
    def tick(self, now_mono: float) -> None:
        """Every :data:`WATCH_EVERY_S`: journal ``checkpoint_committed`` for each checkpoint committed since the
        last look (its manifest exists; the sha256s are checked when one is loaded), oldest first: saves more
        frequent than the look are each counted."""
        if self.config.checkpoint_dir is None or now_mono - self._watched_at < WATCH_EVERY_S:
            return
        self._watched_at = now_mono
        for step, path in reversed(self._committed_since_latest()):
            self.latest = step
            self._record(Event.CHECKPOINT_COMMITTED, step=step, path=path)

    def _committed_since_latest(self) -> list[tuple[int, str]]:
        """The checkpoints under ``--checkpoint-dir`` newer than :attr:`latest` whose manifest exists, as (step,
        path), newest first ([] without a checkpoint directory)."""
        if self.config.checkpoint_dir is None:
            return []
        return [(step, path) for step, path in ck.checkpoints(self.config.checkpoint_dir)
                if (self.latest is None or step > self.latest) and os.path.exists(os.path.join(path, ck.MANIFEST))]

    def save_failed(self, rank: int, node: str, message: str) -> None:
        """A rank reported a failed save: journalled; the warning shows in ``tmctl status`` (beside the newest
        committed step, which says whether saves succeed again)."""
        self.failed = message
        self._record(Event.CHECKPOINT_FAILED, rank=rank, node=node, message=message)

    # --- the restart --------------------------------------------------------------------------------------------
    def plan_restart(self, reason: str) -> tuple[Optional[Restart], str]:
        """In-memory recovery failed for ``reason``: the restart from the newest valid checkpoint of this job, or
        (None, why not). Journals each checkpoint passed over and, for a restart, ``job_restarting``; the next
        launch loads it (:attr:`resume_from`)."""
        if self.config.checkpoint_dir is None:
            return None, "no --checkpoint-dir"
        if self.impossible is not None:
            return None, self.impossible
        chosen, refused = choose(self.config.checkpoint_dir, self.job_id, self.refused_at_load)
        for line in refused:
            self._record(Event.CHECKPOINT_REFUSED, message=line)
        if chosen is None:
            return None, f"no valid checkpoint in {self.config.checkpoint_dir}"
        step, path, manifest = chosen
        if sum(1 for r in self.restarts if r.step == step) >= MAX_RESTARTS_FROM_ONE_STEP:
            return None, f"restarted {MAX_RESTARTS_FROM_ONE_STEP} times from step {step} already"
        manifest_time = manifest.get("time")
        lost = time.time() - manifest_time if isinstance(manifest_time, (int, float)) else 0.0
        restart = Restart(step=step, path=path, reason=reason, work_lost_s=max(0.0, lost))
        self.restarts.append(restart)
        self.resume_from = path
        self._record(Event.JOB_RESTARTING, **restart.to_dict(), restart=len(self.restarts))
        return restart, ""

    def load_refused(self, rank: int, node: str, error: str) -> bool:
        """Rank ``rank`` (on ``node``) refused the checkpoint this launch loads, for ``error`` (torn, corrupted, or
        changed since :meth:`plan_restart` verified it). Journals ``checkpoint_refused`` and passes that checkpoint
        over from now on. True when :meth:`plan_restart` chose it, so that a restart from the checkpoint before it
        can be planned; False for ``--resume-from``'s (the user's choice: the job fails, saying why)."""
        path = self.resume_from
        if path is None:
            return False
        if path not in self.refused_at_load:  # one line, however many ranks refuse it
            self.refused_at_load.add(path)
            self._record(Event.CHECKPOINT_REFUSED, message=f"checkpoint {path} refused at load by rank {rank} on "
                                                           f"{node}: {error}")
        return bool(self.restarts) and self.restarts[-1].path == path

    def status(self) -> dict:
        """What ``tmctl status`` shows of the tier (StatusReply.checkpoints)."""
        c = self.config
        root = c.checkpoint_dir
        return {"dir": os.path.abspath(root) if root else None, "every": c.checkpoint_every, "keep": c.checkpoint_keep,
                "latest": self.latest, "failed": self.failed, "resume_from": self.resume_from,
                "restarts": [r.to_dict() for r in self.restarts]}

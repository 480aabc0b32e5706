"""The project's vocabulary: every role, state, phase, health value, exit code and journal event name, defined once.

tmd, the worker runtime, tmctl, the SLURM hooks and ``tmd resume`` all import these; nothing compares a role, a
state or an event name against a string literal. The enums are ``str`` subclasses whose values are the wire and
journal spellings (``NodeRole.ACTIVE == "active"``), so JSON carries them unchanged and older journals still read.
Terms follow TrainMover (arXiv 2412.12636): leaver, joiner, stayer, standby, switch step, shadow iteration.
"""
from __future__ import annotations

import enum
import sys

if sys.version_info >= (3, 11):
    StrEnum = enum.StrEnum
else:  # pragma: no cover - Python 3.10
    class StrEnum(str, enum.Enum):
        """A str whose value is its spelling (``str()`` and f-strings give the value)."""

        def __str__(self) -> str:
            return str(self.value)

        def __format__(self, spec: str) -> str:
            return format(str(self.value), spec)


# --------------------------------------------------------------------------------------------------------------
# Roles
# --------------------------------------------------------------------------------------------------------------
class Sender(StrEnum):
    """Who may send a message (``Message.SENDER``): a ``WORKER`` agent, a ``CLIENT`` (tmctl and other requests),
    a SLURM ``HOOK`` (the epilog), or tmd itself (``COORDINATOR``: commands and replies)."""

    WORKER = "worker"
    CLIENT = "client"
    HOOK = "hook"
    COORDINATOR = "coordinator"


class NodeRole(StrEnum):
    """A node's place in the job, as tmd's registry holds it (tmd.registry). ``ACTIVE`` holds ranks;
    ``STANDBY`` is a warm spare with none; ``GUARDING`` is a standby already warmed, in its sandbox, as one
    active node's ranks (tmd.guards: it takes them over without a warm-up if that node fails); ``JOINING`` is a
    standby taking over ranks (a migration's joiners or a failure's replacements); ``LEFT`` handed its ranks over
    in a migration; ``FAILED`` was declared lost."""

    ACTIVE = "active"
    STANDBY = "standby"
    GUARDING = "guarding"
    JOINING = "joining"
    LEFT = "left"
    FAILED = "failed"


class WorkerRole(StrEnum):
    """A worker process's role (``Assign.role``, ``Rejoin.role``, ``Session.role``): an ``ACTIVE`` rank, a
    ``JOINER`` (a standby process given a rank, in its sandbox until it takes the rank over) or a ``STANDBY``
    process that holds no rank yet."""

    ACTIVE = "active"
    JOINER = "joiner"
    STANDBY = "standby"


class MigrationRole(StrEnum):
    """A rank's part in one migration (``Prepare.role``)."""

    STAYER = "stayer"
    LEAVER = "leaver"
    JOINER = "joiner"


class Health(StrEnum):
    """A node's health as tmd judges it from registration, heartbeats and GPU samples."""

    UNKNOWN = "unknown"
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"


class GpuLevel(StrEnum):
    """A GPU verdict of tmd.health.GpuHealthPolicy: ``UNHEALTHY`` moves the rank off the GPU (planned
    migration), ``DEGRADED`` (slow, still correct) is only reported."""

    DEGRADED = "degraded"
    UNHEALTHY = "unhealthy"


class MoverMode(StrEnum):
    """The mover Backend's modes (csrc/mover_backend.hpp ``Mode``): ``LIVE`` forwards to the inner backend,
    ``RECORD`` forwards and keeps each collective's outputs, ``REPLAY`` fills outputs from a recording without
    touching the network, ``BYPASS`` completes barriers and point-to-point ops at once."""

    LIVE = "live"
    RECORD = "record"
    REPLAY = "replay"
    BYPASS = "bypass"


# --------------------------------------------------------------------------------------------------------------
# Migrations (tmd.migration) and failure incidents (tmd.recovery)
# --------------------------------------------------------------------------------------------------------------
class MigrationState(StrEnum):
    """requested -> warming -> prepared -> switching -> transferred -> committed, or aborted from any of them."""

    REQUESTED = "requested"
    WARMING = "warming"
    PREPARED = "prepared"
    SWITCHING = "switching"
    TRANSFERRED = "transferred"
    COMMITTED = "committed"
    ABORTED = "aborted"

    @property
    def finished(self) -> bool:
        return self in (MigrationState.COMMITTED, MigrationState.ABORTED)


class MigrationMark(StrEnum):
    """Instants of a migration that are not states (kept beside the states' times in ``phases``)."""

    PREPARE_HELD = "prepare_held"  # warm, but phase 1 waits for the previous migration's stayers (tmd.migration)
    PREPARE_STARTED = "prepare_started"
    TRANSFER_STARTED = "transfer_started"


class MigrationPhase(StrEnum):
    """What a worker reports in ``PhaseDone.phase``: ``WARMED`` (joiner: shadow iterations done), ``PREPARED``
    (phase 1 built), ``ARMED`` (switch step accepted), ``SENT`` (leaver: state sent), ``TRANSFERRED`` (joiner:
    state received and verified), ``COMMITTED`` (phase 2 done at the switch step)."""

    WARMED = "warmed"
    PREPARED = "prepared"
    ARMED = "armed"
    SENT = "sent"
    TRANSFERRED = "transferred"
    COMMITTED = "committed"


class IncidentState(StrEnum):
    """A failure incident: halting -> recovering -> recovered; superseded by a newer incident; failed (the
    job ends)."""

    HALTING = "halting"
    RECOVERING = "recovering"
    RECOVERED = "recovered"
    SUPERSEDED = "superseded"
    FAILED = "failed"

    @property
    def finished(self) -> bool:
        return self in (IncidentState.RECOVERED, IncidentState.SUPERSEDED, IncidentState.FAILED)


class IncidentMark(StrEnum):
    """Instants of an incident kept in its ``phases`` (epoch seconds)."""

    DETECTED = "detected"
    PROMOTED = "promoted"
    HALTED = "halted"
    WARMED = "warmed"
    RECOVERING = "recovering"
    RECOVERED = "recovered"


class RecoveryPhase(StrEnum):
    """What a worker reports in ``RecoveryReport.phase``: ``COLLECTIVE_FAILED`` (a detection signal),
    ``HALTED`` (a survivor stopped at a step boundary), ``WARMED`` (a replacement's shadow iterations are
    done), ``RECOVERED`` (state received or kept, new groups committed)."""

    COLLECTIVE_FAILED = "collective_failed"
    HALTED = "halted"
    WARMED = "warmed"
    RECOVERED = "recovered"


class FailureSignal(StrEnum):
    """How tmd noticed a node failure: its process exited (or turned zombie), it is stopped (SIGSTOP), or it
    went silent (no heartbeat)."""

    PROCESS_EXIT = "process_exit"
    STOPPED = "stopped"
    SILENT = "silent"


class ErrorCode(StrEnum):
    """``ErrorReply.code``: why tmd refused a request."""

    UNKNOWN_NODE = "unknown_node"
    UNKNOWN_STANDBY = "unknown_standby"
    BUSY_STANDBY = "busy_standby"
    MIGRATION_RUNNING = "migration_running"
    RECOVERING = "recovering"
    BAD_REQUEST = "bad_request"
    NOT_READY = "not_ready"
    NOT_SUPPORTED = "not_supported"
    UNKNOWN_MIGRATION = "unknown_migration"
    UNMANAGED_STATE = "unmanaged_state"  # a rank reported misuse (RankWarning): moving the job would diverge


class FailureKind(StrEnum):
    """Why a rank reports that the job must fail (``RankFailed.kind``): the training script raised
    (``SCRIPT_ERROR``: the user's error, not a peer failure), the managed state of data-parallel replicas differs
    after a migration or recovery (``STATE_MISMATCH``: the trajectory diverged), or the script let a
    ``StepAborted`` (a peer failure's refused step) end the process instead of catching it in its
    ``session.steps()`` loop (``STEP_ABORTED_UNCAUGHT``: the rank's state is lost with it), or the checkpoint the
    rank was started to load (``TM_RESUME_FROM``) is not valid there: torn, corrupted, or changed since tmd chose
    it (``CHECKPOINT_REFUSED``; tmd.tiers falls back to the checkpoint before it where tmd chose that one)."""

    SCRIPT_ERROR = "script_error"
    STATE_MISMATCH = "state_mismatch"
    STEP_ABORTED_UNCAUGHT = "step_aborted_uncaught"
    CHECKPOINT_REFUSED = "checkpoint_refused"


class WarningCode(StrEnum):
    """Misuse a rank finds (``RankWarning.code``). At start: nothing replicated was managed, or a DDP/FSDP module's
    parameters are not all in managed state; such a job cannot be migrated or recovered without diverging, and
    tmd refuses to (tmd.faults). A process group created after the job's recorded steps (``late_group``): a joiner
    cannot replay it, and tmd refuses likewise. While training: the script changed its RNG or a rank-local object between a
    step's optimizer update and the next step's start (``state_after_update``); a failure's replacement then
    resumes from that state as it stood at the update, so its RNG stream or data position may differ from an
    uninterrupted run's. Migrations stay exact; tmd journals it and refuses nothing. At start, a DDP model's
    communication hook with a state (``stateful_comm_hook``: PowerSGD's, in no state_dict): journalled only."""

    NOTHING_MANAGED = "nothing_managed"
    UNMANAGED_PARAMETERS = "unmanaged_parameters"
    LATE_GROUP = "late_group"  # a process group created after the recorded steps (worker.session)
    STATEFUL_COMM_HOOK = "stateful_comm_hook"  # a DDP comm hook's state (PowerSGD's) moves with no one: warned only
    STATE_AFTER_UPDATE = "state_after_update"
    CHECKPOINT_FAILED = "checkpoint_failed"  # a save failed (worker.checkpointing); training goes on


# the warnings that make a job's state unmovable: tmd refuses its migrations (and aborts one not yet decided), and a
# failure fails it (tmd.faults)
REFUSING_WARNINGS = frozenset({WarningCode.NOTHING_MANAGED, WarningCode.UNMANAGED_PARAMETERS,
                               WarningCode.LATE_GROUP})


class HookKind(StrEnum):
    """The SLURM hook a NodeNotice or a hook report comes from (slurm/hooks.py)."""

    PROLOG = "prolog"
    EPILOG = "epilog"


# --------------------------------------------------------------------------------------------------------------
# Exit codes
# --------------------------------------------------------------------------------------------------------------
class ExitCode(enum.IntEnum):
    """Process exit codes with a meaning of their own (tmd's, a worker's, a hook's, tmctl's): one table, so that
    no two meanings share a number."""

    OK = 0  # the job finished; a leaver that handed over; a released standby; a tmctl command that succeeded
    FAILED = 1  # the job (or this process's part in it) failed; tmctl migrate: the migration aborted
    REFUSED = 2  # tmd refused the process (unknown node, local rank taken) or a request; a command's bad usage
    FENCED = 3  # tmd declared this process's node failed and gave its ranks to others (e.g. after SIGSTOP)
    STILL_RUNNING = 4  # tmctl migrate: the migration was still running when --timeout-s ran out (it goes on)
    INTERRUPTED = 130  # a command stopped by Ctrl-C (SIGINT; 128 + 2, the shell's convention)


# --------------------------------------------------------------------------------------------------------------
# Journal events (tmd.journal; read back by tmd.resume, tmctl and the tests)
# --------------------------------------------------------------------------------------------------------------
class Event(StrEnum):
    """Every event name tmd writes to ``<run_dir>/events.jsonl``. Fields are documented where each is
    recorded; every event has ``seq`` (1, 2, ...), ``ts`` (epoch seconds) and ``event``."""

    # tmd's own life
    TMD_STARTED = "tmd_started"
    JOB_CONFIG = "job_config"  # the job's whole tmd.config.JobConfig at each start (config; after a restart: overrides)
    TMD_RESTARTED = "tmd_restarted"
    TMD_SIGNALLED = "tmd_signalled"
    TMD_STOPPED = "tmd_stopped"
    TMD_CRASHED = "tmd_crashed"  # a bug in tmd ended its loop (traceback); the ranks train on, tmd is restarted
    INTERNAL_ERROR = "internal_error"  # a bug in tmd while handling one message or tick (traceback); tmd goes on
    JOB_FINISHED = "job_finished"
    JOB_FAILED = "job_failed"
    JOB_REFUSED = "job_refused"  # tmd local|slurm refused to start the job (its command cannot be started)
    JOB_RELEARNED = "job_relearned"
    PROCESSES_TERMINATED = "processes_terminated"
    NODES_ISOLATED = "nodes_isolated"  # tmd local --isolate-nodes: the CPU sets of the nodes (tmd.cpusets.Isolation)
    RANK_FAILED = "rank_failed"  # a rank's script raised, or its state diverged: the job fails
    JOB_WARNING = "job_warning"  # misuse found at start (RankWarning)
    JOINER_FAILED = "joiner_failed"  # a joiner's script raised in its sandbox: its migration/incident goes on without it
    REPLICA_CLASSES = "replica_classes"  # every rank's replica class and the snapshot keepers (read by tmd resume)
    STEP_TIMES = "step_times"  # steps every active rank finished since the last one: [[step, ts, slowest s], ...]
    SNAPSHOT_TAKEN = "snapshot_taken"  # a rank's first buddy snapshot: its host bytes and copy seconds
    NO_REPLICA = "no_replica"  # a node whose loss takes every copy of some rank's state (ReplicaReport)
    STARTUP_FAILED = "startup_failed"  # a rank process died before worker.init() registered
    # workers and nodes
    WORKER_REGISTERED = "worker_registered"
    REGISTER_REFUSED = "register_refused"
    WORKER_REJOINED = "worker_rejoined"
    REJOIN_REQUESTED = "rejoin_requested"
    REJOIN_REFUSED = "rejoin_refused"
    REJOIN_MISMATCH = "rejoin_mismatch"
    PROCESS_EXIT = "process_exit"
    STANDBY_WARM = "standby_warm"
    STANDBY_ADDED = "standby_added"
    STANDBY_RESTARTED = "standby_restarted"
    NODE_HEALTHY = "node_healthy"
    NODE_UNHEALTHY = "node_unhealthy"
    NODE_SLOW = "node_slow"
    NODE_FAILED = "node_failed"
    NODE_FENCED = "node_fenced"
    FENCED = "fenced"
    RANK_LEFT = "rank_left"
    RANK_DONE = "rank_done"
    GPU_HEALTHY = "gpu_healthy"
    GPU_DEGRADED = "gpu_degraded"
    GPU_UNHEALTHY = "gpu_unhealthy"
    STRAGGLER_DETECTED = "straggler_detected"
    STRAGGLER_CLEARED = "straggler_cleared"
    EVACUATION_STARTED = "evacuation_started"
    EVACUATION_SKIPPED = "evacuation_skipped"
    # bad input
    BAD_MESSAGE = "bad_message"
    BAD_MESSAGES_DROPPED = "bad_messages_dropped"  # bad messages of one sender counted, not journalled one by one
    STANDBY_REFUSED = "standby_refused"  # an AddStandbyRequest over the cap or the rate limit
    STALE_PHASE_REPORT = "stale_phase_report"
    UNEXPECTED_PHASE_REPORT = "unexpected_phase_report"
    STALE_RECOVERY_REPORT = "stale_recovery_report"
    MIGRATE_REFUSED = "migrate_refused"
    # migrations: one event per state (MIGRATION_EVENTS), plus these
    MIGRATION_REQUESTED = "migration_requested"
    MIGRATION_WARMING = "migration_warming"
    MIGRATION_PREPARED = "migration_prepared"
    MIGRATION_SWITCHING = "migration_switching"
    MIGRATION_TRANSFERRED = "migration_transferred"
    MIGRATION_COMMITTED = "migration_committed"
    MIGRATION_ABORTED = "migration_aborted"
    MIGRATION_PHASE = "migration_phase"
    MIGRATION_SENT = "migration_sent"  # a leaver sent its state: how (pre-copy or not), bytes, seconds
    MIGRATION_DOWNTIME = "migration_downtime"
    SWITCH_STEP_CHOSEN = "switch_step_chosen"
    # failure recovery
    COLLECTIVE_FAILED = "collective_failed"
    RECOVERY_STARTED = "recovery_started"
    RECOVERY_SUPERSEDED = "recovery_superseded"
    RECOVERY_WAITING = "recovery_waiting"
    RECOVERY_STANDBY_FOUND = "recovery_standby_found"
    STANDBY_PROMOTED = "standby_promoted"
    GUARD_ASSIGNED = "guard_assigned"  # a standby starts warming as an active node's ranks (tmd.guards)
    GUARD_WARMED = "guard_warmed"  # every process of a guard finished its shadow iterations
    GUARD_RELEASED = "guard_released"  # a guard is let go (needed elsewhere, its ranks gone, or it died)
    RECOVERY_HALTED = "recovery_halted"
    RECOVERY_PLAN = "recovery_plan"
    RECOVERY_DONE = "recovery_done"
    RECOVERY_FAILED = "recovery_failed"  # an incident cannot finish (tmd.recovery): the job fails next
    RECOVERY_NOT_RESUMED = "recovery_not_resumed"
    # the checkpoint tier (tmd.tiers)
    CHECKPOINT_COMMITTED = "checkpoint_committed"  # a checkpoint's manifest appeared: step, path
    CHECKPOINT_FAILED = "checkpoint_failed"  # a save failed (full disk, unwritable dir): the job trains on
    CHECKPOINT_REFUSED = "checkpoint_refused"  # a torn or corrupted checkpoint passed over, by name and why
    JOB_RESTARTING = "job_restarting"  # in-memory recovery impossible: every process relaunched from a checkpoint
    JOB_REQUEUED = "job_requeued"  # SLURM: scontrol requeue for a restart from the checkpoint (error: None or why not)
    WORLD_REBUILT = "world_rebuilt"  # SLURM: that restart relaunches every rank inside the allocation (nodes, replaced)
    # SLURM mode (tmd.slurm) and its hooks
    NODE_NOTICE = "node_notice"
    SLURM_HOOK = "slurm_hook"
    SLURM_ERROR = "slurm_error"
    SLURM_NODE_STATE = "slurm_node_state"
    SLURM_NODE_KEPT = "slurm_node_kept"
    SLURM_NODE_RELEASED = "slurm_node_released"
    NODE_LOST = "node_lost"
    STANDBY_LOST = "standby_lost"
    STANDBY_JOB_WAITING = "standby_job_waiting"
    STANDBY_JOB_RUNNING = "standby_job_running"
    STANDBY_JOB_GONE = "standby_job_gone"
    STANDBY_NODE_REFUSED = "standby_node_refused"
    STANDBY_NODE_REVIVED = "standby_node_revived"  # a node that left or failed is a fresh standby again (SLURM)
    DRAIN_MIGRATION = "drain_migration"
    DRAIN_MIGRATION_WAITING = "drain_migration_waiting"
    DRAIN_MIGRATION_GAVE_UP = "drain_migration_gave_up"
    SLURM_NODE_DRAINED = "slurm_node_drained"  # tmd drained a failed node (reason "trainmover: ...")
    STANDBY_JOB_SUBMITTED = "standby_job_submitted"  # the standby pool (tmd.standby_pool) submitted a standby job
    STANDBY_POOL_WAITING = "standby_pool_waiting"  # the pool is short and cannot submit now (with why)
    STANDBY_POOL_REFUSED = "standby_pool_refused"  # sbatch refused, or a standby job ended unused: backing off
    STANDBY_JOBS_CANCELLED = "standby_jobs_cancelled"  # standby jobs tmd submitted, cancelled (the job ended)


MIGRATION_EVENTS: dict[MigrationState, Event] = {
    MigrationState.REQUESTED: Event.MIGRATION_REQUESTED,
    MigrationState.WARMING: Event.MIGRATION_WARMING,
    MigrationState.PREPARED: Event.MIGRATION_PREPARED,
    MigrationState.SWITCHING: Event.MIGRATION_SWITCHING,
    MigrationState.TRANSFERRED: Event.MIGRATION_TRANSFERRED,
    MigrationState.COMMITTED: Event.MIGRATION_COMMITTED,
    MigrationState.ABORTED: Event.MIGRATION_ABORTED,
}
"""The event journalled when a migration enters each state."""

GPU_EVENTS: dict[GpuLevel, Event] = {GpuLevel.DEGRADED: Event.GPU_DEGRADED, GpuLevel.UNHEALTHY: Event.GPU_UNHEALTHY}
"""The event journalled when a rank's GPU verdict becomes each level (``GPU_HEALTHY`` when it clears)."""

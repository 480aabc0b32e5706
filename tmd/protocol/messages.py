"""The messages every party exchanges: tmd, the worker agents and tmctl import this one module.

Wire format: one ZeroMQ frame per message, UTF-8 JSON ``{"v": PROTOCOL_VERSION, "type": NAME, ...fields}``.
Messages are built by keyword only (``Assign(role=WorkerRole.ACTIVE, rank=0, ...)``); roles, phases and codes are
the enums of :mod:`tmd.protocol.vocab`, sent as their string values and turned back into enums on decoding.
Decoding is strict and total: whatever the bytes, :func:`decode` returns a message or raises :class:`ProtocolError`
(an unknown version or type, a missing or extra field, a field of the wrong type, an enum value outside the enum,
a frame over MAX_MESSAGE_BYTES, and the limits listed above :func:`decode`), and the receiver logs the message and
drops it (it never crashes on bad input).

Socket roles: tmd binds a ROUTER; every worker agent and every tmctl call connects a DEALER. A worker's ZeroMQ
identity is ``"<node>/<local_rank>"``; tmctl uses a random one.

Units: times are seconds (``*_s``) as floats; wall-clock times are epoch seconds; sizes are bytes.
"""
from __future__ import annotations

import dataclasses
import json
import math
import typing
import enum
from typing import Any, Callable, ClassVar, Optional

from tmd.protocol.vocab import (
    ErrorCode, FailureKind, HookKind, MigrationPhase, MigrationRole, RecoveryPhase, Sender, WarningCode, WorkerRole,
)

PROTOCOL_VERSION = 1


class ProtocolError(ValueError):
    """A frame that is not a valid message of this protocol version (raised by :func:`decode`)."""


_REGISTRY: dict[str, type["Message"]] = {}


@dataclasses.dataclass(kw_only=True)
class Message:
    """Base class: subclasses are registered under their class name, which is the wire ``type``. ``SENDER`` is
    the only party that may send it (tmd dispatches each message only from a sender of that role)."""

    TYPE: ClassVar[str] = ""
    SENDER: ClassVar[Sender]

    def __init_subclass__(cls, sender: Sender, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.TYPE = cls.__name__
        cls.SENDER = sender
        _REGISTRY[cls.TYPE] = cls


# --------------------------------------------------------------------------------------------------------------
# Worker agent -> tmd
# --------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(kw_only=True)
class Register(Message, sender=Sender.WORKER):
    """First message of a worker process. ``standby`` is true for processes started on a standby node.
    ``data_host``: the address its data plane (gloo, NCCL's bootstrap) binds and advertises, ``iface``: the
    network interface holding it (tmd.netif; "" when unknown)."""

    node: str
    local_rank: int
    pid: int
    host: str
    standby: bool
    iface: str = ""
    data_host: str = ""


@dataclasses.dataclass(kw_only=True)
class Heartbeat(Message, sender=Sender.WORKER):
    """Sent every ``heartbeat_interval_s`` (0.1 s by default). ``counters`` is the mover Backend's counters()
    dict (ops issued/completed, last op start/end in epoch seconds, busy_s, blocked_s); empty before init."""

    step: int
    counters: dict


@dataclasses.dataclass(kw_only=True)
class StepReport(Message, sender=Sender.WORKER):
    """A rank finished ``step``; ``step_time_s`` is the wall time from the previous boundary to this one."""

    rank: int
    step: int
    step_time_s: float
    shadow: bool


@dataclasses.dataclass(kw_only=True)
class PhaseDone(Message, sender=Sender.WORKER):
    """A worker finished its part of a migration phase.

    ``phase`` is one of ``warmed`` (joiner: shadow iterations done), ``prepared`` (phase 1: next-generation
    groups built and staged), ``armed`` (switch step accepted; ``step`` is the step the rank is on now),
    ``sent`` (leaver: state sent, ``seconds`` is the send time), ``transferred`` (joiner: state received and
    checksums verified, ``bytes_moved`` and ``seconds`` set),
    ``committed`` (phase 2 done at the switch step; a stayer's ``seconds`` is how long it stood at the switch
    step). ``ok`` false means the phase failed; ``error`` says why. A leaver's ``sent`` also says how:
    ``precopy_step`` is the step whose boundary its pre-copy started at (-1: the whole state moved at the switch
    step) and ``kept_tensors`` how many tensors its tail sent as references (worker.precopy). A ``committed``
    report of a stayer or joiner carries ``ready_unix_s``: when (Unix time, seconds) that rank was ready to run the
    switch step in the new groups (0.0: not given); tmd compares the joiners' with the stayers'. A joiner's
    ``warmed`` carries ``shadow_steps``, the shadow iterations it ran (journalled with the commit).
    """

    migration_id: int
    rank: int
    phase: MigrationPhase
    ok: bool
    error: str
    step: int
    bytes_moved: int
    seconds: float
    groups: list  # ``prepared``: the names of the groups this rank rebuilt (delta-based: only those with a leaver)
    precopy_step: int = -1
    kept_tensors: int = 0
    ready_unix_s: float = 0.0
    shadow_steps: int = 0  # ``warmed``: how many shadow iterations this joiner ran


@dataclasses.dataclass(kw_only=True)
class RecoveryReport(Message, sender=Sender.WORKER):
    """A worker's part in recovering from failure ``incident_id`` (0: no incident known yet).

    ``phase`` is one of ``collective_failed`` (this rank saw a collective fail before tmd said anything:
    a detection signal; ``error`` says what failed), ``halted`` (a survivor stopped at a step boundary;
    ``committed_step`` is the last step whose optimizer update it applied, -1 for none), ``warmed`` (a
    replacement finished its shadow iterations), ``recovered`` (state received or kept, new groups committed;
    ``committed_step`` is the step it resumes at minus one). ``ok`` false: the phase failed (``error``).
    ``snapshots`` (``halted``): the steps S for which this rank holds its own snapshot and its peer's copy
    (worker.snapshot), so tmd can roll the job back to S when a lost rank has no replica."""

    incident_id: int
    rank: int
    phase: RecoveryPhase
    ok: bool
    error: str
    committed_step: int
    bytes_moved: int
    seconds: float
    snapshots: list = dataclasses.field(default_factory=list)  # halted: steps of the complete snapshots held
    shadow_steps: int = 0  # warmed (a replacement): how many shadow iterations it ran


@dataclasses.dataclass(kw_only=True)
class ReplicaReport(Message, sender=Sender.WORKER):
    """The ranks that hold a bit-identical copy of rank ``rank``'s replicated state (its replica class, ``rank``
    included), found from every rank's state fingerprint at the job's first step (worker.step_exchange). Sent once
    per process. tmd recovers a lost rank from a survivor of its class, and journals at start every node whose
    loss would take all copies of a rank's state (``no_replica``). ``replicas`` holds 1 to MAX_RANKS ranks."""

    rank: int
    replicas: list


@dataclasses.dataclass(kw_only=True)
class SnapshotReport(Message, sender=Sender.WORKER):
    """What rank ``rank``'s first buddy snapshot (worker.snapshot) cost: ``bytes_per_copy`` of host memory (its own
    copy; the peer's copy it keeps is as large) and ``copy_s`` seconds for the host copy, the step-time overhead
    of a snapshot step. Sent once per process; tmd journals it (``snapshot_taken``)."""

    rank: int
    step: int
    bytes_per_copy: int
    copy_s: float


@dataclasses.dataclass(kw_only=True)
class Rejoin(Message, sender=Sender.WORKER):
    """A worker's answer to :class:`Reregister`: what this process holds now, so a restarted tmd can re-learn
    the job. ``role`` is ``active``, ``joiner`` or ``standby`` (never assigned a rank; ``rank`` is -1 then);
    ``step`` is the step it is running (-1 before training); ``generation`` is the highest group generation
    it built (-1: none). Sent after the worker switched its group builder to the new store. ``iface`` and
    ``data_host``: as in :class:`Register`."""

    node: str
    local_rank: int
    pid: int
    host: str
    rank: int
    role: WorkerRole
    step: int
    generation: int
    iface: str = ""
    data_host: str = ""


@dataclasses.dataclass(kw_only=True)
class Done(Message, sender=Sender.WORKER):
    """A rank finished its training loop (``final_step`` is the last step it ran) or, as a leaver, left. tmd
    answers each copy with a :class:`DoneAck` and journals the first; the process resends until acknowledged and
    exits only then (or after its time budget), so that its exit is never taken for a death before its Done was
    read."""

    rank: int
    final_step: int
    left: bool


@dataclasses.dataclass(kw_only=True)
class RankFailed(Message, sender=Sender.WORKER):
    """This rank cannot go on and the job must fail (not a node failure: no standby is spent on it). ``kind``
    SCRIPT_ERROR: the training script raised at ``step`` (``error`` is one line, ``"ValueError: ..."``;
    ``traceback`` the formatted traceback, at most 8000 characters, its tail kept). STATE_MISMATCH: after a
    migration or recovery the managed state of data-parallel replicas differs (``error`` says which ranks).
    STEP_ABORTED_UNCAUGHT: a ``StepAborted`` was not caught and ends the process (``error``: the step it
    refused and what to do; ``traceback`` as for SCRIPT_ERROR)."""

    rank: int
    step: int
    kind: FailureKind
    error: str
    traceback: str


@dataclasses.dataclass(kw_only=True)
class RankWarning(Message, sender=Sender.WORKER):
    """Misuse a rank found (see :class:`~tmd.protocol.vocab.WarningCode`); ``message`` says what to fix. tmd
    shows it in ``tmctl status``; for unmanaged state it refuses migrations and recoveries of the job."""

    rank: int
    code: WarningCode
    message: str


# --------------------------------------------------------------------------------------------------------------
# tmd -> worker agent
# --------------------------------------------------------------------------------------------------------------
# The fewest steps a job may record (tmd's ``--record-steps``). A joiner must do in its shadow iterations every
# one-time collective the stayers did in the steps it skips: DDP regroups its gradient buckets in the forward of
# a process's second iteration with a broadcast from rank 0 (torch's ``Reducer::rebuild_buckets``). With one step
# recorded that broadcast is not in the recording, so the joiner would make it live at its first real step, where
# the stayers make none: their collectives then pair up wrongly until gloo's timeout (seen: a 120 s hang and a
# recovery in a planned migration with ``--record-steps 1``).
MIN_RECORD_STEPS = 2


@dataclasses.dataclass(kw_only=True)
class Assign(Message, sender=Sender.COORDINATOR):
    """Gives a worker its rank. ``role`` is ``active`` (a rank at job start) or ``joiner`` (a standby that
    replaces ``rank`` in ``migration_id``). ``store_host``/``store_port`` locate the job's rendezvous store
    (hosted by tmd: tmd.store). Active ranks record their first ``record_steps`` steps' collective outputs to ``record_dir``;
    joiners replay ``record_dir``'s file for their rank during that many shadow iterations. A joiner that
    replaces a failed rank has ``incident_id`` > 0 (and ``migration_id`` 0): after its shadow iterations it
    reports ``warmed`` and waits for :class:`Recover`. ``guard`` (both ids 0): a *guard* (tmd.guards) warms as
    ``rank`` before any failure, reports ``warmed`` (a RecoveryReport of incident 0) and waits, without a
    deadline, for the Recover of an incident that adopts it, or for its Release. ``snapshot_every`` > 0: if some rank's state has no
    replica on another node, every rank keeps a host-memory snapshot of its state and of a peer node's rank's
    every that many steps (worker.snapshot). Fields with a default may be left out by a constructor, never on
    the wire."""

    role: WorkerRole
    rank: int
    world_size: int
    store_host: str
    store_port: int
    generation: int
    record_steps: int
    record_dir: str
    migration_id: int
    incident_id: int
    snapshot_every: int = 0  # buddy snapshots every that many steps where a rank's state has no replica (0: off)
    guard: bool = False  # a guard: warm as ``rank`` now, take it over only if its node fails (tmd.guards)


@dataclasses.dataclass(kw_only=True)
class Prepare(Message, sender=Sender.COORDINATOR):
    """Phase 1: build generation ``generation`` of the groups that contain a leaver, in the background.

    ``role`` is ``stayer``, ``leaver`` or ``joiner`` for this rank. Each rank rebuilds exactly those of its
    groups whose ranks intersect ``leaver_ranks`` (delta-based setup: other groups are untouched). Leavers and
    joiners also build a 2-rank transfer group (leaver = 0, joiner = 1) under ``transfer_prefix``."""

    migration_id: int
    generation: int
    role: MigrationRole
    leaver_ranks: list
    transfer_prefix: str


@dataclasses.dataclass(kw_only=True)
class Switch(Message, sender=Sender.COORDINATOR):
    """Phase 2 is armed for the boundary before ``step`` (the switch step). Each party answers ``armed``."""

    migration_id: int
    step: int


@dataclasses.dataclass(kw_only=True)
class Decide(Message, sender=Sender.COORDINATOR):
    """The outcome at the switch step: ``commit`` true swaps groups in, false keeps the old ones."""

    migration_id: int
    commit: bool
    reason: str


@dataclasses.dataclass(kw_only=True)
class Halt(Message, sender=Sender.COORDINATOR):
    """Failure ``incident_id``: ranks ``failed_ranks`` are lost. The survivor fails every mover (a blocked
    collective returns at once), refuses the current step's optimizer update, stops at the step boundary and
    answers ``halted``. A later Halt (higher id) supersedes an earlier one."""

    incident_id: int
    reason: str
    failed_ranks: list


@dataclasses.dataclass(kw_only=True)
class Recover(Message, sender=Sender.COORDINATOR):
    """The recovery plan of ``incident_id``, sent to every survivor and replacement once all survivors halted
    and all replacements warmed. Every party builds generation ``generation`` of all its groups and resumes
    at ``resume_step``. ``sends`` lists ``[src_rank, dst_rank]`` pairs: ``src`` (a data-parallel replica that
    committed ``resume_step - 1``) sends its replicated state to ``dst`` (a replacement, or a survivor one
    step behind) over a 2-rank group under store prefix ``tm/g<generation>/recover/r<dst>``. A lost rank whose
    state has no surviving replica is recovered by rolling the whole job back (``rollback_step`` >= 0): every
    survivor restores its own snapshot of that step, and each ``src`` sends the snapshot copy it keeps of
    ``dst``; ``resume_step`` is then ``rollback_step + 1``."""

    incident_id: int
    generation: int
    resume_step: int
    sends: list
    rollback_step: int = -1  # >= 0: every party restores its snapshot of this step (resume_step is one after)


@dataclasses.dataclass(kw_only=True)
class Reregister(Message, sender=Sender.COORDINATOR):
    """Sent by a restarted tmd (``tmd resume``) to a worker it does not know yet. The job's store moved with
    tmd: the worker builds its future groups in the store at ``store_host:store_port`` and answers with
    :class:`Rejoin`. ``generation`` is the highest group generation tmd knows of (it continues after it)."""

    store_host: str
    store_port: int
    generation: int


@dataclasses.dataclass(kw_only=True)
class Release(Message, sender=Sender.COORDINATOR):
    """The job is over (or this standby is no longer needed): the worker exits with ``exit_code``."""

    reason: str
    exit_code: int


# --------------------------------------------------------------------------------------------------------------
# tmctl <-> tmd (request / reply)
# --------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(kw_only=True)
class StatusRequest(Message, sender=Sender.CLIENT):
    pass


@dataclasses.dataclass(kw_only=True)
class StatusReply(Message, sender=Sender.COORDINATOR):
    """``nodes``: one dict per node (name, role, ranks, health, heartbeat_age_s, step, step_time_s, warm).
    ``health`` is unknown, healthy or unhealthy; ``stragglers`` lists the node's ranks that arrive late at
    collectives (tmd.health). ``migration``: the migration in progress or the last one
    (dict, see :class:`MigrationReply`) or None. ``recovery``: the failure recovery in progress or the last one
    (id, state, reason, lost_ranks, failed_nodes, standbys, waiting_standby, resume_step, phases_s) or None."""

    job: str
    world_size: int
    generation: int
    step: int
    nodes: list
    migration: Optional[dict]
    recovery: Optional[dict]
    failure: Optional[dict]  # why the job failed (rank, node, kind, error, traceback), or None
    warnings: list  # misuse the ranks reported: dicts of rank, node, code, message
    page: Optional[str] = None  # the status page and metrics address (http://host:port/), None when off
    config: Optional[dict] = None  # the job's settings: tmd.config.JobConfig.to_dict() ({section: {field: value}})
    # the checkpoint tier (tmd.tiers.Tier.status): dir, every, keep, latest (step), failed (the last failed
    # save's message or None), restarts (one dict per restart from a checkpoint); None when checkpoints are off
    checkpoints: Optional[dict] = None
    # SLURM mode: reservation, pool (the standby pool: keep, have, submitted, reason, retry_in_s, pending); else None
    slurm: Optional[dict] = None


@dataclasses.dataclass(kw_only=True)
class MigrateRequest(Message, sender=Sender.CLIENT):
    """Move every rank of node ``sources[i]`` to standby node ``targets[i]``, all in one migration (one
    generation, one prepare, one switch step). Each list holds 1 to MAX_MIGRATE_NODES node names of 1 to
    MAX_NAME_CHARS characters (decode refuses anything else); tmd refuses lists of different lengths or naming a
    node twice. Answered by MigrationReply (the new migration) or ErrorReply."""

    sources: list
    targets: list


@dataclasses.dataclass(kw_only=True)
class MigrationRequest(Message, sender=Sender.CLIENT):
    """Ask for one migration's state (``migration_id`` < 0: the latest)."""

    migration_id: int


@dataclasses.dataclass(kw_only=True)
class MigrationReply(Message, sender=Sender.COORDINATOR):
    """``migration``: id, sources and targets (lists of node names: ``sources[i]``'s ranks move to
    ``targets[i]``), source and target (the same names joined by commas, for display), state, reason, switch_step,
    ranks, phases (state -> epoch s), phases_s, downtime_s (None until known), bytes_moved."""

    migration: dict


@dataclasses.dataclass(kw_only=True)
class AddStandbyRequest(Message, sender=Sender.CLIENT):
    """Grow the standby pool by node ``node`` (local mode: tmd starts its processes). Answered by
    StatusReply or ErrorReply (bad_request: a name already in use; not_supported: SLURM mode, where a standby
    job is submitted instead)."""

    node: str


@dataclasses.dataclass(kw_only=True)
class EventsRequest(Message, sender=Sender.CLIENT):
    """Events with sequence number > ``after``, at most ``limit``."""

    after: int
    limit: int


@dataclasses.dataclass(kw_only=True)
class EventsReply(Message, sender=Sender.COORDINATOR):
    events: list


@dataclasses.dataclass(kw_only=True)
class ErrorReply(Message, sender=Sender.COORDINATOR):
    """A refused request. ``code``: unknown_node, unknown_standby, busy_standby, migration_running,
    bad_request, not_ready, unknown_migration."""

    code: ErrorCode
    message: str


# --------------------------------------------------------------------------------------------------------------
# SLURM hooks -> tmd, acknowledged
# --------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(kw_only=True)
class NodeNotice(Message, sender=Sender.HOOK):
    """A SLURM hook on ``node`` reports on SLURM job ``job_id`` (the job's own id, or that of one of its standby
    jobs). ``hook`` is ``epilog`` (the node left that job: the job ended, or the node was released from it).
    ``detail`` is free text for the journal, e.g. what the epilog cleaned up. tmd answers each copy with a
    :class:`NodeNoticeAck` and acts on the first (the hook resends until acknowledged, within its time budget)."""

    node: str
    job_id: str
    hook: HookKind
    detail: str


@dataclasses.dataclass(kw_only=True)
class DoneAck(Message, sender=Sender.COORDINATOR):
    """tmd has rank ``rank``'s :class:`Done` (journalled once): the process may exit."""

    rank: int


@dataclasses.dataclass(kw_only=True)
class NodeNoticeAck(Message, sender=Sender.COORDINATOR):
    """tmd has the :class:`NodeNotice` of ``hook`` on ``node`` for SLURM job ``job_id`` (journalled once)."""

    node: str
    job_id: str
    hook: HookKind


# --------------------------------------------------------------------------------------------------------------
def encode(msg: Message) -> bytes:
    """Serialise ``msg`` to one frame."""
    body = dataclasses.asdict(msg)
    body["v"] = PROTOCOL_VERSION
    body["type"] = msg.TYPE
    return json.dumps(body, separators=(",", ":")).encode()


# --------------------------------------------------------------------------------------------------------------
# Decoding: every frame from the network is untrusted. Limits (each breach raises ProtocolError):
# --------------------------------------------------------------------------------------------------------------
MAX_MESSAGE_BYTES = 4 * 1024 * 1024  # one frame (bytes); ZMQ_MAXMSGSIZE on every control-plane socket (keys.py)
MAX_DEPTH = 16  # nesting of JSON arrays/objects in one frame (a Heartbeat's counters.gpu.xids is 3)
MAX_NAME_CHARS = 64  # a name field (NAME_FIELDS): node names, SLURM job ids; each name of MigrateRequest
MAX_MIGRATE_NODES = 64  # MigrateRequest.sources / .targets entries: the nodes one migration moves
MAX_HOST_CHARS = 255  # a host name (RFC 1035's limit on a full domain name)
INT_RANGE = (-2 ** 63, 2 ** 63 - 1)  # every integer, anywhere in a frame (beyond: OverflowError in float math)
NAME_FIELDS = frozenset({"node", "job_id", "iface"})
HOST_FIELDS = frozenset({"host", "data_host"})
NON_NEGATIVE_FIELDS = frozenset({"step_time_s", "seconds", "bytes_moved", "bytes_per_copy", "copy_s", "kept_tensors",
                                 "shadow_steps"})
# A step and a byte count tmd adds to or journals: far beyond any job, far within the 64-bit range whatever tmd sums
# (a step 2**62 would make the next one, and a status reply, unencodable)
STEP_FIELDS = frozenset({"step", "committed_step", "final_step", "precopy_step", "shadow_steps"})
STEP_RANGE = (-1, 2 ** 48)  # -1: none yet
BYTE_FIELDS = frozenset({"bytes_moved", "bytes_per_copy"})
MAX_BYTES = 2 ** 50  # one message's byte count (1 PiB)
MAX_COUNTER_KEYS = 64  # keys of Heartbeat.counters and of its ``gpu`` sample
MAX_GROUPS = 4096  # PhaseDone.groups entries
MAX_LABEL_CHARS = 256  # a counter's text value (mode), a GPU uuid or throttle reason, a group name


def _reject_constant(name: str) -> Any:
    raise ProtocolError(f"{name} is not a number this protocol carries")


def _walk(body: Any) -> None:
    """Check every value of a parsed frame: nesting at most MAX_DEPTH, integers within INT_RANGE, floats finite
    (``1e999`` parses to inf), strings and keys encodable as UTF-8 (a lone surrogate such as ``"\ud800"`` is
    valid JSON but no valid text). Iterative: no recursion whatever the input."""
    lo, hi = INT_RANGE
    stack: list[tuple[Any, int]] = [(body, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            if not value.isascii():
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError:
                    raise ProtocolError("a string is not valid Unicode (lone surrogate)") from None
        elif isinstance(value, bool) or value is None:
            pass
        elif isinstance(value, int):
            if not lo <= value <= hi:
                raise ProtocolError("an integer is out of the 64-bit range")
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise ProtocolError("a number is not finite")
        elif isinstance(value, (list, dict)):
            if depth > MAX_DEPTH:
                raise ProtocolError(f"nested deeper than {MAX_DEPTH} levels")
            if isinstance(value, dict):
                stack.extend((k, depth) for k in value)
                stack.extend((v, depth + 1) for v in value.values())
            else:
                stack.extend((v, depth + 1) for v in value)


def _type_ok(value: Any, annotation: Any) -> bool:
    origin = typing.get_origin(annotation)
    if origin is typing.Union:  # Optional[X]
        return any(_type_ok(value, a) for a in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return isinstance(value, str) and value in annotation._value2member_map_
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, annotation)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# What the worker sends in Heartbeat.counters (worker.commands: the mover's counters() plus the GPU sample).
_COUNTER_INTS = ("ops_issued", "ops_completed", "ops_failed", "pending", "ops_skipped")  # counts, >= 0
_COUNTER_TIMES = ("last_op_start_s", "last_op_end_s", "busy_s", "blocked_s")  # seconds, >= 0
_GPU_COUNTS = ("ecc_uncorrected",)


def _check_scalar(where: str, value: Any) -> None:
    if isinstance(value, str):
        if len(value) > MAX_LABEL_CHARS:
            raise ProtocolError(f"{where}: text longer than {MAX_LABEL_CHARS} characters")
    elif not (value is None or isinstance(value, (bool, int, float))):
        raise ProtocolError(f"{where}: {type(value).__name__} where a number, text or true/false is expected")


def _check_counters(counters: dict) -> None:
    """Heartbeat.counters: known keys with their types (counts are non-negative integers, times non-negative
    numbers, ``mode`` text, ``failed`` a bool, ``gpu`` the GPU sample); other keys only scalars."""
    if len(counters) > MAX_COUNTER_KEYS:
        raise ProtocolError(f"Heartbeat.counters: more than {MAX_COUNTER_KEYS} keys")
    for key, value in counters.items():
        where = f"Heartbeat.counters.{key[:MAX_NAME_CHARS]}"
        if key in _COUNTER_INTS:
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
                raise ProtocolError(f"{where}: not a non-negative integer")
        elif key in _COUNTER_TIMES:
            if not (_number(value) and value >= 0):
                raise ProtocolError(f"{where}: not a non-negative number of seconds")
        elif key == "generation":
            if not (isinstance(value, int) and not isinstance(value, bool)):
                raise ProtocolError(f"{where}: not an integer")
        elif key == "failed":
            if not isinstance(value, bool):
                raise ProtocolError(f"{where}: not true/false")
        elif key == "mode":
            if not isinstance(value, str):
                raise ProtocolError(f"{where}: not text")
            _check_scalar(where, value)
        elif key == "gpu":
            if not isinstance(value, dict):
                raise ProtocolError(f"{where}: not an object")
            _check_gpu(value)
        else:
            _check_scalar(where, value)


def _check_gpu(gpu: dict) -> None:
    """The GPU sample (worker.gpu_health.GpuProbe.sample): every field may be None (NVML could not say)."""
    if len(gpu) > MAX_COUNTER_KEYS:
        raise ProtocolError(f"Heartbeat.counters.gpu: more than {MAX_COUNTER_KEYS} keys")
    for key, value in gpu.items():
        where = f"Heartbeat.counters.gpu.{key[:MAX_NAME_CHARS]}"
        if value is None:
            continue
        if key in ("index", "xid") + _GPU_COUNTS:
            if not (isinstance(value, int) and not isinstance(value, bool)) or (key in _GPU_COUNTS and value < 0):
                raise ProtocolError(f"{where}: not an integer")
        elif key == "temperature_c":
            if not _number(value):
                raise ProtocolError(f"{where}: not a number")
        elif key in ("gpu_lost", "retired_pages_pending"):
            if not isinstance(value, bool):
                raise ProtocolError(f"{where}: not true/false")
        elif key == "xids":
            if not (isinstance(value, list) and len(value) <= MAX_COUNTER_KEYS
                    and all(isinstance(x, int) and not isinstance(x, bool) for x in value)):
                raise ProtocolError(f"{where}: not a short list of integers")
        elif key == "throttle":
            if not (isinstance(value, list) and len(value) <= MAX_COUNTER_KEYS
                    and all(isinstance(x, str) and len(x) <= MAX_LABEL_CHARS for x in value)):
                raise ProtocolError(f"{where}: not a short list of text")
        else:
            _check_scalar(where, value)


def _check_groups(groups: list) -> None:
    if len(groups) > MAX_GROUPS or not all(isinstance(g, str) and len(g) <= MAX_LABEL_CHARS for g in groups):
        raise ProtocolError(f"PhaseDone.groups: not a list of at most {MAX_GROUPS} group names")


def _check_node_names(where: str) -> Callable[[Any], None]:
    def check(names: list) -> None:
        if not 1 <= len(names) <= MAX_MIGRATE_NODES or not all(
                isinstance(n, str) and 1 <= len(n) <= MAX_NAME_CHARS for n in names):
            raise ProtocolError(f"{where}: not a list of 1 to {MAX_MIGRATE_NODES} node names of 1 to "
                                f"{MAX_NAME_CHARS} characters")
    return check


MAX_RANKS = 1 << 20  # bound of a rank list tmd reads (ReplicaReport.replicas)


def _check_ranks(where: str) -> Callable[[Any], None]:
    def check(ranks: list) -> None:
        if not 1 <= len(ranks) <= MAX_RANKS or not all(
                isinstance(r, int) and not isinstance(r, bool) and 0 <= r < MAX_RANKS for r in ranks):
            raise ProtocolError(f"{where}: not a list of 1 to {MAX_RANKS} ranks")
    return check


MAX_SNAPSHOTS = 64  # bound of RecoveryReport.snapshots (a rank holds two or three)


def _check_steps(steps: list) -> None:
    if len(steps) > MAX_SNAPSHOTS or not all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in steps):
        raise ProtocolError(f"RecoveryReport.snapshots: not a list of at most {MAX_SNAPSHOTS} steps")


# Content checks of containers whose contents tmd reads (tmd -> worker/client messages are checked by type only).
_CONTENT_CHECKS: dict[tuple[str, str], Callable[[Any], None]] = {
    ("Heartbeat", "counters"): _check_counters,
    ("PhaseDone", "groups"): _check_groups,
    ("MigrateRequest", "sources"): _check_node_names("MigrateRequest.sources"),
    ("ReplicaReport", "replicas"): _check_ranks("ReplicaReport.replicas"),
    ("RecoveryReport", "snapshots"): _check_steps,
    ("MigrateRequest", "targets"): _check_node_names("MigrateRequest.targets"),
}


def _check_field(name: str, field: str, value: Any) -> None:
    if field in NAME_FIELDS and isinstance(value, str) and len(value) > MAX_NAME_CHARS:
        raise ProtocolError(f"{name}.{field}: longer than {MAX_NAME_CHARS} characters")
    if field in HOST_FIELDS and isinstance(value, str) and len(value) > MAX_HOST_CHARS:
        raise ProtocolError(f"{name}.{field}: longer than {MAX_HOST_CHARS} characters")
    if field in NON_NEGATIVE_FIELDS and _number(value) and value < 0:
        raise ProtocolError(f"{name}.{field}: negative")
    if field in STEP_FIELDS and _number(value) and not STEP_RANGE[0] <= value <= STEP_RANGE[1]:
        raise ProtocolError(f"{name}.{field}: not a step from {STEP_RANGE[0]} to 2**48")
    if field in BYTE_FIELDS and _number(value) and value > MAX_BYTES:
        raise ProtocolError(f"{name}.{field}: more than 2**50 bytes")
    check = _CONTENT_CHECKS.get((name, field))
    if check is not None:
        check(value)


_HINTS: dict[str, dict[str, Any]] = {}


def _preview(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def decode(frame: bytes) -> Message:
    """Parse one frame. Raises :class:`ProtocolError` (and nothing else, whatever the bytes) on anything that is
    not an exact, current message: a frame over MAX_MESSAGE_BYTES; not UTF-8 JSON; NaN or Infinity (refused
    everywhere: no field carries them); nesting deeper than MAX_DEPTH; an integer outside INT_RANGE (or over
    json's digit limit); a lone surrogate; an unknown version or type; a missing or extra field; a field of the
    wrong type (an enum field with a value outside the enum included); a name field (NAME_FIELDS) longer than
    MAX_NAME_CHARS or a host longer than MAX_HOST_CHARS; a negative time, byte count or count (NON_NEGATIVE_FIELDS);
    a step outside STEP_RANGE (STEP_FIELDS) or a byte count over MAX_BYTES (BYTE_FIELDS); Heartbeat counters or PhaseDone groups of the wrong shape (see _check_counters); MigrateRequest node lists
    that are empty, longer than MAX_MIGRATE_NODES or hold a name of 0 or over MAX_NAME_CHARS characters. Free
    text (errors, tracebacks, reasons) is not cut here: the frame limit bounds it and the journal cuts what it
    writes."""
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"a frame is bytes, not {type(frame).__name__}")
    if len(frame) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"frame of {len(frame)} bytes is over the {MAX_MESSAGE_BYTES}-byte limit")
    try:
        body = json.loads(bytes(frame), parse_constant=_reject_constant)
    except ProtocolError:
        raise
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProtocolError(f"not JSON: {e}") from None
    except RecursionError:
        raise ProtocolError("not JSON this protocol carries: nested too deep") from None
    except (ValueError, TypeError, OverflowError, MemoryError) as e:  # e.g. int over json's 4300-digit limit
        raise ProtocolError(f"not JSON this protocol carries: {str(e)[:200]}") from None
    if not isinstance(body, dict):
        raise ProtocolError("message is not a JSON object")
    _walk(body)
    version = body.pop("v", None)
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {_preview(version)} is not {PROTOCOL_VERSION}")
    name = body.pop("type", None)
    cls = _REGISTRY.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message type {_preview(name)}")
    hints = _HINTS.get(name)
    if hints is None:
        hints = _HINTS[name] = typing.get_type_hints(cls)
        hints.pop("TYPE", None)
        hints.pop("SENDER", None)
    missing = hints.keys() - body.keys()
    extra = body.keys() - hints.keys()
    if missing or extra:
        raise ProtocolError(f"{name}: missing fields {sorted(missing)}, unexpected fields "
                            f"{_preview(sorted(extra)[:8])}")
    for field, annotation in hints.items():
        value = body[field]
        if not _type_ok(value, annotation):
            raise ProtocolError(f"{name}.{field}: {_preview(value)} is not "
                                f"{getattr(annotation, '__name__', annotation)}")
        if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
            body[field] = annotation(value)
        elif annotation is float:
            body[field] = float(value)  # an int within INT_RANGE: exact enough, and float math stays float
        _check_field(name, field, value)
    return cls(**body)

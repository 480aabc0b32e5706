"""One job configuration: every setting tmd runs a job with, each defined once, with its unit and default.

:class:`JobConfig` holds one frozen section per concern (torchtitan's ``job_config`` style):

- ``detection`` (:class:`DetectionConfig`): when a silent node counts as failed (tmd.detection);
- ``replay`` (:class:`ReplayConfig`): the steps recorded at job start for the joiners' shadow iterations;
- ``snapshot`` (:class:`SnapshotConfig`): buddy snapshots where a rank's state has no replica on another node;
- ``standby`` (:class:`StandbyConfig`): what standbys do besides replacing failed nodes (guards, evacuation);
- ``serve`` (:class:`ServeConfig`): tmd's own ports and authentication;
- ``network`` (:class:`NetworkConfig`): the interface the ranks' data plane uses (tmd.netif);
- ``checkpoint`` (:class:`CheckpointTierConfig`): the checkpoint tier's directory, interval, retention and how long
  a recovery waits for a standby before it restarts the job from a checkpoint instead (tmd.tiers);
- ``slurm`` (:class:`SlurmConfig`): ``tmd slurm``'s address, reservation, SLURM client calls and standby pool.

Each field's default is written here and nowhere else; its help (the ``tmd`` option's) says its unit and meaning.
A field's name is its command-line option's (``heartbeat_timeout_s`` is ``--heartbeat-timeout-s``), unique across
the sections.

Its life:

- ``tmd local`` and ``tmd slurm`` build it from the options given (:meth:`JobConfig.with_options`; an option not
  given keeps its default). Every section checks itself as it is built: a bad value raises :class:`ConfigError`,
  one line naming the option, and tmd exits 2 with ``error: <that line>`` before anything starts;
- tmd journals it whole at every start (``job_config``: ``config``, the nested dict of :meth:`JobConfig.to_dict`;
  after a restart also ``overrides``, the fields that differ from the journal's, each ``{"was": .., "now": ..}``);
- ``tmd resume`` restores it from the journal (the last ``job_config``: tmd.resume.load); an option given to
  resume overrides its field, and the restarted tmd journals the override;
- ``tmctl status --json`` shows it under ``config``; ``tmctl status`` prints the fields that differ from the
  defaults (:func:`changed`).

Not in it: the job's identity and layout (its name, run directory, command, nodes, ranks per node and standbys: the
journal's ``tmd_started`` and ``tmd.json``, which ``tmd resume`` re-learns), how this tmd process prints
(``--quiet``), where ``tmd local`` puts its processes (``--netns-*``, ``--isolate-nodes``), and the checkpoint a
job starts from (``--resume-from``: once, at its start).

**Adding an option** takes two edits:

1. a field in the section of its concern, ``name: type = setting(default, "Help: meaning, unit.")``, with its
   range checked in that section's ``check()`` (a new concern: a new frozen section class, and a field of that
   type in :class:`JobConfig`);
2. its name in the ``@settings(...)`` of each ``tmd`` command that takes it (tmd/cli.py: ``RUN_SETTINGS`` for
   ``tmd local`` and ``tmd slurm``, ``SLURM_SETTINGS``, ``RESUME_SETTINGS``): the command gets the option
   (``--name-with-dashes``, with the field's help, default and ``envvar``) and passes its value on to
   :meth:`JobConfig.with_options`.

Nothing else: the journal, ``tmd resume`` (restore, override), ``tmctl status`` and the option's help follow from
the field. Read it where it is used as ``config.<section>.<name>``.
"""
from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any, Optional

from tmd.protocol.messages import INT_RANGE, MIN_RECORD_STEPS


class ConfigError(ValueError):
    """A setting outside its range or of the wrong type, or a journalled configuration that does not read. The
    message is one line that names the option."""


def setting(default: Any, help: str, envvar: Optional[str] = None) -> Any:
    """A config field with ``default`` (its only definition), ``help`` (its meaning and unit: the option's help
    text) and ``envvar``, an environment variable its option reads when not given (tmd.protocol.env)."""
    return dataclasses.field(default=default, metadata={"help": help, "envvar": envvar})


def flag(name: str) -> str:
    """The ``tmd`` option of field ``name``: ``heartbeat_timeout_s`` -> ``--heartbeat-timeout-s``."""
    return "--" + name.replace("_", "-")


def _kind(hint: Any) -> tuple[type, bool]:
    """(the base type, whether None is allowed) of a field's type hint."""
    args = typing.get_args(hint)
    if args and type(None) in args:
        return next(a for a in args if a is not type(None)), True
    return hint, False


def _typed(name: str, value: Any, hint: Any) -> Any:
    """``value`` as field ``name`` of type ``hint`` holds it (an int where a float goes becomes a float), or
    ConfigError."""
    base, optional = _kind(hint)
    if value is None and optional:
        return None
    if base is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise ConfigError(f"{flag(name)} must be a finite number, not {value!r}")
        return float(value)
    if base is int and isinstance(value, int) and not isinstance(value, bool):
        if not INT_RANGE[0] <= value <= INT_RANGE[1]:  # it could not reach a rank: the protocol's integers are 64-bit
            raise ConfigError(f"{flag(name)} must fit in 64 bits, not a {value.bit_length()}-bit integer")
        return value
    if base in (bool, str) and isinstance(value, base):
        return value
    raise ConfigError(f"{flag(name)} must be {'a number' if base is float else f'of type {base.__name__}'}, "
                      f"not {value!r}")


class _Section:
    """What every section does once built: check each field's type, then the section's own rules
    (:meth:`check`)."""

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            object.__setattr__(self, f.name, _typed(f.name, getattr(self, f.name), hints[f.name]))
        self.check()

    def check(self) -> None:
        """Raise ConfigError when a value is out of range (one line naming its option)."""

    def _at_least(self, name: str, low: float, unit: str = "") -> None:
        value = getattr(self, name)
        if value < low:
            raise ConfigError(f"{flag(name)} must be at least {low:g}{unit}, not {value:g}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DetectionConfig(_Section):
    """When tmd counts a node as failed (tmd.detection, whose module docstring gives the rules). Seconds, each
    positive, with ``blocked_after_s < suspect_after_s < heartbeat_timeout_s``."""

    heartbeat_timeout_s: float = setting(
        5.0, "Seconds of silence after which a node is failed whatever its peers do (any node with a silent "
             "process is marked unhealthy).")
    suspect_after_s: float = setting(
        0.8, "Seconds of silence after which a node is failed if a peer has been blocked in a collective for "
             "--blocked-after-s (hung or cut off), unless its processes on tmd's host use CPU.")
    blocked_after_s: float = setting(
        0.3, "Seconds a peer must be blocked in a collective for a silent node to count as hung.")

    def check(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value <= 0:
                raise ConfigError(f"{flag(f.name)} must be a positive number of seconds, not {value:g}")
        if not self.blocked_after_s < self.suspect_after_s < self.heartbeat_timeout_s:
            raise ConfigError(
                "the detection thresholds must rise, --blocked-after-s < --suspect-after-s < --heartbeat-timeout-s: "
                f"not {self.blocked_after_s:g}, {self.suspect_after_s:g}, {self.heartbeat_timeout_s:g} (seconds)")


MAX_RECORD_STEPS = 100  # recorded steps at job start, at most: each rank holds every recorded collective output


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplayConfig(_Section):
    """Record and replay (worker.sandbox)."""

    record_steps: int = setting(
        3, f"Steps recorded at job start (at least {MIN_RECORD_STEPS}: DDP regroups its buckets in the second; "
           f"at most {MAX_RECORD_STEPS}: every rank keeps each recorded collective's output in memory); joiners "
           "replay them as shadow iterations.")

    def check(self) -> None:
        if self.record_steps > MAX_RECORD_STEPS:
            raise ConfigError(f"{flag('record_steps')} must be at most {MAX_RECORD_STEPS}, not {self.record_steps}: "
                              "every rank keeps the output of each recorded collective in memory (worker.sandbox)")
        if self.record_steps < MIN_RECORD_STEPS:
            raise ConfigError(f"{flag('record_steps')} must be at least {MIN_RECORD_STEPS}, not {self.record_steps}: "
                              "a joiner replays DDP's bucket regrouping of the second step "
                              "(tmd.protocol.messages.MIN_RECORD_STEPS)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SnapshotConfig(_Section):
    """Buddy snapshots (worker.snapshot)."""

    snapshot_every: int = setting(
        10, "Buddy snapshots every this many steps where a rank's state has no replica on another node (0: off).")

    def check(self) -> None:
        self._at_least("snapshot_every", 0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StandbyConfig(_Section):
    """What standbys do besides replacing failed nodes (tmd.guards, tmd.evacuation)."""

    guards: int = setting(
        0, "Standby nodes kept warm as particular active nodes' ranks (guards, tmd.guards): a failure of a "
           "guarded node skips the replacement's warm-up, and a migration of it to its guard skips the joiners'. "
           "A guard is no migration target for another node (0: off).")
    migrate_stragglers: bool = setting(False, "Move a node with a straggler rank to a warm standby.")

    def check(self) -> None:
        self._at_least("guards", 0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServeConfig(_Section):
    """tmd's own sockets. A restarted tmd binds the address (and the status page's port) it had."""

    port: int = setting(0, "ZeroMQ port (0: any free port).")
    metrics_port: int = setting(
        0, "Serve Prometheus metrics (/metrics) and a live status page (/) on the job's address at this port "
           "(0: a free port, written to tmd.json; -1: off). Both need the token in the keys directory's web.token.")
    auth: bool = setting(True, "CURVE authentication of every connection (off only with tmd local --no-auth, to "
                               "measure its cost: anyone on this host can then command the job).")

    def check(self) -> None:
        self._at_least("port", 0)
        self._at_least("metrics_port", -1)
        for name in ("port", "metrics_port"):
            if getattr(self, name) > 65535:
                raise ConfigError(f"{flag(name)} must be at most 65535, not {getattr(self, name)}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class NetworkConfig(_Section):
    """The ranks' data plane (tmd.netif): each rank resolves the interface on its own node."""

    iface: Optional[str] = setting(
        None, "The network interface the ranks' data plane binds and advertises on every node (gloo's "
              "TM_GLOO_HOST and GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME), e.g. ib0; a node without it fails its "
              "ranks at start, naming node and interface (tmd/netif.py). With tmd local --netns-all every node's "
              "is tm0. Default: the interface that routes to tmd.", envvar="TM_IFNAME")

    def check(self) -> None:
        if self.iface is not None:
            from tmd.netif import check_name

            try:
                check_name(self.iface)
            except ValueError as e:
                raise ConfigError(f"{flag('iface')}: {e}") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointTierConfig(_Section):
    """The checkpoint tier (tmd.tiers; the ranks write the checkpoints, worker.checkpointing)."""

    checkpoint_dir: Optional[str] = setting(
        None, "The ranks checkpoint every managed object, each rank's RNG and data position and the step here "
              "(DCP, asynchronous); a failure in-memory recovery cannot repair restarts the job from the newest "
              "valid one (local mode). Not another job's.")
    checkpoint_every: int = setting(0, "Checkpoint every this many steps (0: off).")
    checkpoint_keep: int = setting(2, "Checkpoints kept (the newest this many).")
    standby_wait_s: float = setting(
        0.0, "With --checkpoint-dir: a recovery that found no standby within this many seconds restarts the job "
             "from its newest checkpoint instead (0: wait for one).")

    def check(self) -> None:
        self._at_least("checkpoint_every", 0)
        self._at_least("checkpoint_keep", 1)
        self._at_least("standby_wait_s", 0, " s")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SlurmConfig(_Section):
    """``tmd slurm`` (tmd.slurm; the standby pool: tmd.standby_pool)."""

    host: Optional[str] = setting(
        None, "Address tmd binds and the ranks reach it and its store at (default: the address this host's name "
              "resolves to; never all interfaces).", envvar="TM_HOST")
    reservation: str = setting("standby", "Reservation holding the standby jobs.", envvar="TM_RESERVATION")
    poll_s: float = setting(1.0, "Seconds between polls of node states and standby jobs.")
    slurm_timeout_s: float = setting(5.0, "Timeout of every SLURM client call (seconds).")
    keep_standbys: int = setting(
        0, "Keep this many standbys warm or pending: tmd submits standby jobs into the reservation itself "
           "(rate-limited, backing off when refused) and cancels them when the job ends (0: only standby jobs "
           "submitted by hand; tmd/standby_pool.py).")

    def check(self) -> None:
        self._at_least("poll_s", 0.1, " s")
        self._at_least("slurm_timeout_s", 0.1, " s")
        self._at_least("keep_standbys", 0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class JobConfig:
    """Every setting of one job, one section per concern (see the module docstring). Frozen: a changed
    setting is a new JobConfig (:meth:`with_options`), checked as it is built."""

    detection: DetectionConfig = dataclasses.field(default_factory=DetectionConfig)
    replay: ReplayConfig = dataclasses.field(default_factory=ReplayConfig)
    snapshot: SnapshotConfig = dataclasses.field(default_factory=SnapshotConfig)
    standby: StandbyConfig = dataclasses.field(default_factory=StandbyConfig)
    serve: ServeConfig = dataclasses.field(default_factory=ServeConfig)
    network: NetworkConfig = dataclasses.field(default_factory=NetworkConfig)
    checkpoint: CheckpointTierConfig = dataclasses.field(default_factory=CheckpointTierConfig)
    slurm: SlurmConfig = dataclasses.field(default_factory=SlurmConfig)

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(JobConfig)
        for f in dataclasses.fields(self):
            if not isinstance(getattr(self, f.name), hints[f.name]):
                raise ConfigError(f"config section {f.name!r} must be a {hints[f.name].__name__}")

    def to_dict(self) -> dict:
        """``{section: {field: value}}``: what the journal and ``tmctl status --json`` carry."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> "JobConfig":
        """The JobConfig of a :meth:`to_dict` dict (e.g. read back from the journal), checked. A section or field
        it lacks keeps its default (a journal of a tmd that had fewer settings); an unknown one, a value of the
        wrong type or out of range raises ConfigError."""
        if not isinstance(data, dict):
            raise ConfigError(f"a job configuration is an object of sections, not {type(data).__name__}")
        sections = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(str(k) for k in data if k not in sections)
        if unknown:
            raise ConfigError(f"unknown config section(s): {', '.join(unknown)}")
        built = {}
        for name, values in data.items():
            section = typing.get_type_hints(cls)[name]
            if not isinstance(values, dict):
                raise ConfigError(f"config section {name!r} is not an object")
            known = {f.name for f in dataclasses.fields(section)}
            extra = sorted(str(k) for k in values if k not in known)
            if extra:
                raise ConfigError(f"unknown setting(s) in config section {name!r}: {', '.join(extra)}")
            built[name] = section(**values)
        return cls(**built)

    def with_options(self, given: Optional[dict] = None, **options: Any) -> "JobConfig":
        """This config with the fields named in ``given`` and ``options`` (by field name: a command's options) set
        to their values; a value of None (an option not given) and a name that is no field change nothing. Raises
        ConfigError (one line) when the result is not valid."""
        changes: dict[str, dict[str, Any]] = {}
        for name, value in {**(given or {}), **options}.items():
            section = SECTION_OF.get(name)
            if section is not None and value is not None:
                changes.setdefault(section, {})[name] = value
        return dataclasses.replace(self, **{s: dataclasses.replace(getattr(self, s), **fields)
                                            for s, fields in changes.items()})

    def flat(self) -> dict[str, Any]:
        """``{field: value}`` over every section (field names are unique)."""
        return {name: value for fields in self.to_dict().values() for name, value in fields.items()}

    def overrides(self, base: "JobConfig") -> dict[str, dict[str, Any]]:
        """The fields where this config differs from ``base``: ``{field: {"was": base's, "now": this one's}}``."""
        was, now = base.flat(), self.flat()
        return {name: {"was": was[name], "now": value} for name, value in now.items() if was[name] != value}


def _sections() -> dict[str, str]:
    """Field name -> its section's name in JobConfig; a name used twice is a bug (options would clash)."""
    owner: dict[str, str] = {}
    hints = typing.get_type_hints(JobConfig)
    for section in dataclasses.fields(JobConfig):
        for f in dataclasses.fields(hints[section.name]):
            if f.name in owner:
                raise TypeError(f"config field {f.name!r} is in sections {owner[f.name]!r} and {section.name!r}")
            owner[f.name] = section.name
    return owner


SECTION_OF: dict[str, str] = _sections()  # field name -> section name
DEFAULTS = JobConfig()


def _field(name: str) -> dataclasses.Field:
    section = typing.get_type_hints(JobConfig)[SECTION_OF[name]]
    return next(f for f in dataclasses.fields(section) if f.name == name)


def option_type(name: str) -> Any:
    """The type of field ``name``'s option: ``Optional[<the field's type>]`` (None: not given)."""
    section = typing.get_type_hints(JobConfig)[SECTION_OF[name]]
    return Optional[_kind(typing.get_type_hints(section)[name])[0]]


def envvar(name: str) -> Optional[str]:
    """The environment variable field ``name``'s option reads when not given, or None."""
    return _field(name).metadata["envvar"]


def field_help(name: str, resumed: bool = False) -> str:
    """The help of field ``name`` with its default: the text of its ``tmd`` option (``resumed``: of ``tmd
    resume``'s, whose default is the job's own setting)."""
    f = _field(name)
    if resumed:
        return f"{f.metadata['help']} (default: the job's, from its journal)"
    return f.metadata["help"] if f.default is None else f"{f.metadata['help']} (default: {f.default})"


def changed(config: Any) -> dict[str, Any]:
    """The fields of ``config`` (a :meth:`JobConfig.to_dict` dict, e.g. from a StatusReply) that differ from the
    defaults, ``{field: value}``, in section order. Lenient: a field this version does not know is listed too,
    and anything that is not a dict of dicts gives {}."""
    defaults = DEFAULTS.flat()
    out: dict[str, Any] = {}
    if not isinstance(config, dict):
        return out
    for fields in config.values():
        if isinstance(fields, dict):
            out.update({str(k): v for k, v in fields.items() if k not in defaults or defaults[k] != v})
    return out

"""Restarting tmd for a running job: ``tmd resume --run-dir DIR`` (local mode).

tmd is a single point of coordination, not of training. When it dies (even ``kill -9``) the ranks train on:
their groups do not need the store once set up, their output goes to their log files, and their agents keep
heartbeating into a socket that ZeroMQ reconnects on its own. While tmd is down nothing that needs it can
start: no migration, no failure recovery (a failure meanwhile is handled once tmd is back: see below), and a
rank that finishes cannot report it (its Done is lost if it exits before tmd is back, so the job must still run
when tmd is restarted).

A restarted tmd re-learns the job from two sources:

- the journal (``events.jsonl``, the events of the job since its ``tmd_started``, :func:`load`): the layout
  (which node holds which ranks after the migrations and recoveries that completed), the highest group
  generation used (new generations go on after it: a store prefix is never reused), the last migration and
  incident ids, the job's settings (the last ``job_config``: tmd.config.JobConfig; an option given to ``tmd
  resume`` overrides its field), and ``tmd.json``'s address and launch command;
- the workers: it binds the same ZeroMQ address, so every agent reconnects; to any worker message from an
  identity it does not know it answers :class:`~tmd.protocol.Reregister`, carrying the new store (the old
  store died with the old tmd); the worker points its group builder at the new store and answers
  :class:`~tmd.protocol.Rejoin` with its rank, role, step and generation. Processes on this host are adopted
  by the launcher, so their exits and liveness are watched as if tmd had started them (psutil: they are not
  its children).

Cases at the restart:

- a migration that was cut by the crash is aborted (its stayers and leavers are told, its joiners exit and
  every standby of it is started afresh), unless every joiner had received its state: the decision was then to
  commit, and it is sent again (every pair of it is handed over);
- an active node whose processes did not re-register within ``rejoin_grace_s`` of the restart failed while
  tmd was down (or hangs): it is failed and recovered like any failure;
- a standby node with no process left is started again;
- a standby the journal replay does not know (added at run time) is added when its processes re-register.

Not resumed: a failure recovery (incident) that was in progress when tmd died. ``tmd resume`` by hand does not
take SLURM mode (its standby jobs and srun steps are not re-learned from disk); a tmd that crashed in SLURM mode
is restarted in its process by tmd.supervise, which hands the SLURM side (poller, standby jobs, srun steps) over.
Migration and incident ids go on after the journal's highest (those before a relaunch from a checkpoint too), so
one journal never holds two migrations or two incidents with the same id.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
import urllib.parse
from typing import Optional

import psutil

from tmd import protocol as p
from tmd.config import ConfigError, JobConfig
from tmd.control import JobControl
from tmd.journal import read_events
from tmd.protocol.layout import RunDir
from tmd.protocol.vocab import Event, ExitCode, FailureSignal, NodeRole, WorkerRole
from tmd.registry import Worker
from tmd.requests import NODE_NAME
from tmd.rundir import SECRET, UnsafePath, check_file, check_run_dir, no_follow, private_dir, trusted_dir

REASK_S = 1.0  # a worker that has not answered Reregister is asked again after this many seconds


class ResumeError(RuntimeError):
    """The run directory holds no job that a restarted tmd can take over (the message says why)."""


@dataclasses.dataclass
class JobState:
    """What the journal and ``tmd.json`` say about the job at the time tmd died."""

    job: str
    run_dir: str
    address: str
    command: Optional[list]  # what local mode starts every worker with (None: not recorded)
    cwd: Optional[str]  # the directory it ran in
    netns: dict  # nodes in network namespaces of their own (tmd.json's, for tmctl; see tmd/netns.py)
    nodes: list[str]  # the job's first active nodes, in rank order
    ranks_per_node: int
    standbys: list[str]
    config: JobConfig  # the job's settings (the journal's last job_config), before any option of tmd resume
    roles: dict[str, tuple[NodeRole, list[int]]]  # node -> (role, ranks) now
    generation: int  # the highest group generation used
    last_migration_id: int
    last_incident_id: int  # the journal's highest incident id: a restarted tmd's incidents go on after it
    cut_migration: Optional[dict]  # a migration the crash interrupted: id, sources, targets (lists), commit
    open_incident: Optional[int]  # a recovery the crash interrupted (not resumed: a new one starts, Resumed.tick)
    last_seq: int
    last_ts: float
    previous_pid: Optional[int]
    replicas: dict = dataclasses.field(default_factory=dict)  # rank -> its replica class (replica_classes event)
    keepers: dict = dataclasses.field(default_factory=dict)  # rank -> the rank keeping its buddy snapshot
    unprotected: list = dataclasses.field(default_factory=list)  # the no_replica warnings
    web_port: Optional[int] = None  # the port of the status page and metrics (tmd.json's ``web``; None: off)
    restarts: list = dataclasses.field(default_factory=list)  # the job's job_restarting events (checkpoint tier)
    lost_ranks: dict = dataclasses.field(default_factory=dict)  # rank -> the failed node that held it (node_failed)


def load(run_dir: str) -> JobState:
    """Read ``tmd.json`` and the journal of ``run_dir``. Raises ResumeError when there is nothing to resume:
    no such job, the job ended, or its tmd still runs; when this user did not make it (:func:`check_owned`); when
    the journalled configuration does not read; or when a field the replay relies on has a shape tmd never writes
    (a journal or tmd.json damaged or tampered with: ``cannot resume: the journal of DIR is malformed: ...``, one
    line naming the event and field)."""
    layout = RunDir(run_dir)
    try:
        layout = RunDir(check_owned(layout))
        with open(layout.tmd_json, opener=no_follow) as f:
            info = json.load(f)
        events = read_events(layout.events)
    except UnsafePath as e:
        raise ResumeError(f"refusing to resume: {e}") from None
    except (OSError, ValueError) as e:
        raise ResumeError(f"no job to resume in {layout.path}: {e}") from None
    if not isinstance(info, dict):
        raise ResumeError(f"no job to resume in {layout.path}: its tmd.json holds no object")
    if info.get("command") and info.get("cwd"):
        try:
            trusted_dir(str(info["cwd"]), "the job's working directory")
        except UnsafePath as e:
            raise ResumeError(f"refusing to run the job's command: {e}") from None
    starts = [i for i, e in enumerate(events) if e["event"] == Event.TMD_STARTED]
    if not starts:
        raise ResumeError(f"no job to resume in {layout.path}: its journal has no {Event.TMD_STARTED} event")
    restarts = [e for e in events if e["event"] == Event.JOB_RESTARTING]  # a relaunch journals tmd_started anew
    # ids go on across a relaunch from a checkpoint (tmd.tiers.Tier.last_ids): count those before it too
    earlier_ids = tuple(max((e[key] for e in events[:starts[-1]] if e["event"] == ev and _is_int(e.get(key))),
                            default=0)
                        for ev, key in ((Event.MIGRATION_REQUESTED, "migration_id"),
                                        (Event.RECOVERY_STARTED, "incident_id")))
    events = events[starts[-1]:]
    started = events[0]
    ends = [e for e in events if e["event"] in (Event.TMD_STARTED, Event.TMD_RESTARTED, Event.TMD_STOPPED,
                                                 Event.TMD_CRASHED, Event.JOB_FINISHED)]
    # A tmd that crashed (``tmd_crashed``; or, before tmd survived its own bugs, ``tmd_stopped`` with no exit
    # code) left the ranks training: that job can be resumed. A stop with an exit code ended the job.
    if ends[-1]["event"] == Event.TMD_STOPPED and ends[-1].get("exit_code") is not None:
        code = ends[-1].get("exit_code")
        raise ResumeError(f"job {started.get('job')} is over: its tmd stopped with exit code {code}")
    if any(e["event"] == Event.JOB_FINISHED for e in ends):
        raise ResumeError(f"job {started.get('job')} is over: it finished")
    pid = info.get("pid")
    if isinstance(pid, int) and pid != os.getpid() and _is_tmd(pid):
        raise ResumeError(f"tmd of job {started.get('job')} still runs (pid {pid})")

    try:
        return _replay(layout.path, info, events, started, pid, restarts, earlier_ids)
    except _Malformed as e:
        raise ResumeError(f"cannot resume: the {e.file} of {layout.path} is malformed: {e}") from None


class _Malformed(ValueError):
    """A journal or ``tmd.json`` field of a shape tmd never writes (tampered with, or damaged): one line saying
    which and what it holds; ``file`` names the file (``journal`` or ``tmd.json``)."""

    def __init__(self, message: str, file: str = "journal") -> None:
        super().__init__(message)
        self.file = file


def _replay(path: str, info: dict, events: list[dict], started: dict, pid, restarts: list,
            earlier_ids: tuple[int, int]) -> JobState:
    """The JobState of the journal's ``events`` (from the last ``tmd_started`` on) and ``info`` (tmd.json), every
    field it relies on checked first; ``earlier_ids``: the highest migration and incident ids before that
    ``tmd_started`` (a relaunch from a checkpoint goes on with them). Raises _Malformed."""
    where = f"its {Event.TMD_STARTED}"
    nodes = _names(started.get("nodes"), f"{where} nodes")
    standbys = _names(started.get("standbys"), f"{where} standbys", empty=True)
    if set(nodes) & set(standbys):
        raise _Malformed(f"{where} names {sorted(set(nodes) & set(standbys))} both active and standby")
    world = started.get("world_size")
    if not _is_int(world) or world < 1 or world % len(nodes):
        raise _Malformed(f"{where} world_size is {_show(world)}, not a positive multiple of its "
                         f"{len(nodes)} node(s)")
    job = started.get("job") or info.get("job")
    if not isinstance(job, str) or not job:
        raise _Malformed(f"{where} job is {_show(job)}, not a name")
    address = info.get("address")
    try:
        if not isinstance(address, str) or not address.startswith("tcp://"):
            raise ValueError
        host, port = split_address(address)
        if not host or not 0 < port < 65536:
            raise ValueError
    except ValueError:
        raise _Malformed(f"its address is {_show(address)}, not tcp://HOST:PORT", "tmd.json") from None
    command = info.get("command")
    if command is not None and not (isinstance(command, list) and command
                                    and all(isinstance(a, str) for a in command)):
        raise _Malformed(f"its command is {_show(command)}, not a list of strings", "tmd.json")
    if info.get("cwd") is not None and not isinstance(info["cwd"], str):
        raise _Malformed(f"its cwd is {_show(info['cwd'])}, not a directory", "tmd.json")
    if info.get("netns") is not None and not isinstance(info["netns"], dict):
        raise _Malformed(f"its netns is {_show(info['netns'])}, not an object", "tmd.json")

    rpn = world // len(nodes)
    roles: dict[str, tuple[NodeRole, list[int]]] = {
        n: (NodeRole.ACTIVE, list(range(i * rpn, (i + 1) * rpn))) for i, n in enumerate(nodes)}
    roles.update({s: (NodeRole.STANDBY, []) for s in standbys})
    generation = consumed = 0
    last_mid, last_incident = earlier_ids
    migration: Optional[dict] = None
    incident: Optional[int] = None
    lost: dict[str, list[int]] = {}  # failed node -> the ranks it held
    for i, e in enumerate(events):
        ev = e["event"]
        try:
            if _is_int(e.get("generation")):
                generation = max(generation, e["generation"])
            if ev == Event.MIGRATION_REQUESTED:
                consumed += 1
                mid = _count(e.get("migration_id"), "migration_id")
                last_mid = max(last_mid, mid)
                migration = {"id": mid, **_pairs(e), "commit": False}
                for source in migration["sources"]:
                    if source not in roles:
                        raise _Malformed(f"source {source} is not a node of the job")
                for target in migration["targets"]:
                    roles[target] = (NodeRole.JOINING, [])
            elif ev == Event.MIGRATION_TRANSFERRED and migration and migration["id"] == e.get("migration_id"):
                migration["commit"] = True  # tmd journals this, then tells every party to commit
            elif ev in (Event.MIGRATION_COMMITTED, Event.MIGRATION_ABORTED) and migration \
                    and migration["id"] == e.get("migration_id"):
                if ev == Event.MIGRATION_COMMITTED:
                    _hand_over(roles, migration)
                else:
                    adopted = _adopted_by_recovery(events[i + 1:], migration["targets"])
                    for target in migration["targets"]:
                        if roles.get(target, (None,))[0] == NodeRole.JOINING and target not in adopted:
                            roles[target] = (NodeRole.STANDBY, [])
                migration = None
            elif ev == Event.STANDBY_ADDED:  # tmctl standby add (local mode)
                roles[_name(e.get("node"), "node")] = (NodeRole.STANDBY, [])
            elif ev == Event.NODE_FAILED:
                node = _name(e.get("node"), "node")
                lost[node] = _ranks(e.get("ranks") or [], world, "ranks")
                roles[node] = (NodeRole.FAILED, [])
            elif ev == Event.STANDBY_PROMOTED:
                roles[_name(e.get("standby"), "standby")] = (NodeRole.JOINING, [])
            elif ev == Event.RECOVERY_STARTED:
                incident = _count(e.get("incident_id"), "incident_id")
                last_incident = max(last_incident, incident)
                _node_map(e.get("adopted") or {}, "adopted")
            elif ev == Event.RECOVERY_PLAN:
                consumed += 1
            elif ev == Event.RECOVERY_DONE:
                incident = None
                for failed_node, standby in _node_map(e.get("standbys"), "standbys").items():
                    roles[standby] = (NodeRole.ACTIVE, sorted(lost.get(failed_node, [])))
        except _Malformed as err:
            raise _Malformed(f"its {ev} event{_seq(e)}: {err}") from None
    if migration is not None and migration["commit"]:
        _hand_over(roles, migration)
    for name, (role, _) in roles.items():
        if role == NodeRole.JOINING:  # a cut migration's target, or a cut recovery's standby: a standby again
            roles[name] = (NodeRole.STANDBY, [])
    seqs = [e["seq"] for e in events if _is_int(e.get("seq"))]
    stamps = [e["ts"] for e in events if isinstance(e.get("ts"), (int, float)) and not isinstance(e["ts"], bool)]
    replicas, keepers = _replica_classes(events, world)
    unprotected = []
    for e in events:
        if e["event"] == Event.NO_REPLICA:
            if not all(k in e for k in ("rank", "node", "code", "message")):
                raise _Malformed(f"its {Event.NO_REPLICA} event{_seq(e)} lacks rank, node, code or message")
            unprotected.append({k: e[k] for k in ("rank", "node", "code", "message")})
    page_port = web_port(info)
    return JobState(
        job=job, run_dir=path, address=address, command=command, cwd=info.get("cwd"), netns=info.get("netns") or {},
        nodes=nodes, ranks_per_node=rpn, standbys=standbys, config=_config(events, page_port), roles=roles,
        generation=max(generation, consumed),  # each migration and each recovery plan took one
        last_migration_id=last_mid, last_incident_id=last_incident, cut_migration=migration,
        open_incident=incident,
        lost_ranks={r: node for node, ranks in lost.items() for r in ranks},
        last_seq=max(seqs, default=0), last_ts=stamps[-1] if stamps else time.time(),
        previous_pid=pid if isinstance(pid, int) else None,
        replicas=replicas, keepers=keepers, unprotected=unprotected, web_port=page_port, restarts=restarts)


def _replica_classes(events: list[dict], world: int) -> tuple[dict, dict]:
    """The last ``replica_classes`` event's replicas (rank -> the ranks of its class) and keepers (rank -> the
    rank keeping its buddy snapshot); empty when there is none."""
    classes = [e for e in events if e["event"] == Event.REPLICA_CLASSES]
    if not classes:
        return {}, {}
    e = classes[-1]
    try:
        replicas = {_rank(r, world): _ranks(c, world, "a class") for r, c in _object(e.get("replicas")).items()}
        keepers = {_rank(r, world): _rank(k, world) for r, k in _object(e.get("keepers")).items()}
    except _Malformed as err:
        raise _Malformed(f"its {Event.REPLICA_CLASSES} event{_seq(e)}: {err}") from None
    return replicas, keepers


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _show(value) -> str:
    """``value`` as a journal holds it, cut to 60 characters."""
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _seq(e: dict) -> str:
    return f" (seq {e['seq']})" if _is_int(e.get("seq")) else ""


def _count(value, what: str) -> int:
    """An id: an int >= 1."""
    if not _is_int(value) or value < 1:
        raise _Malformed(f"{what} is {_show(value)}, not a number >= 1")
    return value


def _name(value, what: str) -> str:
    if not isinstance(value, str) or not NODE_NAME.fullmatch(value):
        raise _Malformed(f"{what} is {_show(value)}, not a node name")
    return value


def _names(value, what: str, empty: bool = False) -> list[str]:
    """A list of distinct node names (non-empty unless ``empty``)."""
    if not isinstance(value, list) or not (value or empty) or len(set(map(str, value))) != len(value):
        raise _Malformed(f"{what} is {_show(value)}, not a list of distinct node names")
    return [_name(n, what) for n in value]


def _object(value) -> dict:
    if not isinstance(value, dict):
        raise _Malformed(f"{_show(value)} is not an object")
    return value


def _node_map(value, what: str) -> dict[str, str]:
    """A node -> node object (a recovery's ``standbys`` or ``adopted``)."""
    if not isinstance(value, dict):
        raise _Malformed(f"{what} is {_show(value)}, not an object of node names")
    return {_name(k, what): _name(v, what) for k, v in value.items()}


def _rank(value, world: int) -> int:
    """A rank of the job: an int in [0, ``world``), or its decimal string (a JSON object's key)."""
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    if not _is_int(value) or not 0 <= value < world:
        raise _Malformed(f"rank {_show(value)} is not one of the job's {world} ranks")
    return value


def _ranks(value, world: int, what: str) -> list[int]:
    if not isinstance(value, list):
        raise _Malformed(f"{what} is {_show(value)}, not a list of ranks")
    return [_rank(r, world) for r in value]


def _config(events: list[dict], web_port: Optional[int]) -> JobConfig:
    """The job's settings: its journal's last ``job_config`` (``events`` start at its ``tmd_started``). A journal
    of an older tmd has none: its ``tmd_started`` fields, the status page as tmd.json says (``web_port``), the
    defaults for the rest. Raises ResumeError when the journalled configuration does not read."""
    journalled = [e for e in events if e["event"] == Event.JOB_CONFIG]
    if journalled:
        data = journalled[-1].get("config")
    else:
        started = events[0]
        data = {"replay": {"record_steps": started.get("record_steps")},
                "snapshot": {"snapshot_every": started.get("snapshot_every")},
                "standby": {"guards": started.get("guards")},
                "serve": {"metrics_port": -1 if web_port is None else 0}}
        data = {s: {k: v for k, v in fields.items() if v is not None} for s, fields in data.items()}
    try:
        return JobConfig.from_dict(data)
    except ConfigError as e:
        raise ResumeError(f"the job's configuration in its journal does not read: {e}") from None


def check_owned(layout: RunDir) -> str:
    """What ``tmd resume`` trusts is this user's own: the run directory (resolved, returned), its ``tmd.json``
    and journal, the keys directory and its files, and the ``record/`` and ``logs/`` directories it writes in
    (tmd.rundir.check_run_dir: owned by this user, not a symlink, the run directory and files writable by nobody
    else, the keys readable by nobody else). The command tmd.json names
    is then the user's own: only the user (or root) can have written it. Raises tmd.rundir.UnsafePath;
    FileNotFoundError when a file is missing."""
    real = private_dir(layout.path, "run directory", create=False)
    for path, what in ((os.path.join(real, RunDir.TMD_JSON), "tmd.json"),
                       (os.path.join(real, RunDir.EVENTS), "journal")):
        check_file(path, what)
    # a job run with --no-auth has no keys; one of an older tmd no keys/worker/
    check_run_dir(real, keys_loose=SECRET)
    return real


def web_port(info: dict) -> Optional[int]:
    """The port of tmd.json's ``web`` url (``http://host:port/``); None when the page was off; 0 (any free port)
    when the url does not parse."""
    if not info.get("web"):
        return None
    try:
        return int(urllib.parse.urlsplit(info["web"]["url"]).port or 0)
    except (KeyError, TypeError, ValueError, AttributeError):
        return 0


def _is_tmd(pid: int) -> bool:
    try:
        return any("tmd" in part for part in psutil.Process(pid).cmdline())
    except psutil.Error:
        return False


def _pairs(e: dict) -> dict:
    """The ``sources`` and ``targets`` lists of a migration event (a journal written before migrations moved
    several nodes has ``source`` and ``target``: one node each). Raises _Malformed when they are not lists of
    node names of the same length."""
    if isinstance(e.get("sources"), list) and isinstance(e.get("targets"), list):
        sources, targets = e["sources"], e["targets"]
    elif "source" in e and "target" in e:
        sources, targets = [e["source"]], [e["target"]]
    else:
        raise _Malformed(f"sources {_show(e.get('sources'))} and targets {_show(e.get('targets'))} are not lists "
                         f"of node names")
    sources, targets = _names(sources, "sources"), _names(targets, "targets")
    if len(sources) != len(targets):
        raise _Malformed(f"{len(sources)} sources for {len(targets)} targets")
    return {"sources": sources, "targets": targets}


def _hand_over(roles: dict, migration: dict) -> None:
    for source, target in zip(migration["sources"], migration["targets"]):
        ranks = roles[source][1]
        roles[target] = (NodeRole.ACTIVE, list(ranks))
        roles[source] = (NodeRole.LEFT, [])


def _adopted_by_recovery(later: list[dict], targets: list[str]) -> set[str]:
    """The standbys of an aborted migration (its ``targets``) whose warm joiners a recovery that follows (in the
    ``later`` events) adopted (a leaver that died hands its pair's joiners over)."""
    return {s for e in later if e["event"] == Event.RECOVERY_STARTED and isinstance(e.get("adopted"), dict)
            for s in e["adopted"].values() if s in targets}  # (a malformed one is refused when the replay gets there)


def split_address(address: str) -> tuple[str, int]:
    """``tcp://HOST:PORT`` -> (HOST, PORT)."""
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    return host, int(port)


class Resumed:
    """The restarted tmd's side of re-learning the job; acts through ``control`` (the daemon)."""

    def __init__(self, control: JobControl, state: JobState, rejoin_grace_s: float = 10.0) -> None:
        """``rejoin_grace_s``: an active node with a process that has not re-registered this many seconds
        after the restart is failed."""
        self.control = control
        self.state = state
        self.rejoin_grace_s = rejoin_grace_s
        self.started = time.monotonic()
        self._asked: dict[bytes, float] = {}  # identity -> time.monotonic() of the last Reregister
        self._refused: set[bytes] = set()
        self._relearned = False
        self._checked = False
        self.decision: Optional[p.Decide] = None  # for the parties of a migration the crash cut

    def start(self) -> None:
        """Apply the journal's layout and highest generation to the registry and journal the restart (the
        daemon goes on with the migration and incident ids: ``state.last_migration_id``, ``last_incident_id``)."""
        c, st = self.control, self.state
        reg = c.registry
        for name, (role, ranks) in st.roles.items():
            node = reg.nodes.get(name) or reg.add_node(name)  # (or a standby added at run time)
            why = {NodeRole.FAILED: "failed before tmd restarted",
                   NodeRole.LEFT: "its ranks were handed over before tmd restarted"}.get(role, "")
            reg.restore(node, NodeRole(role), ranks, why)
        reg.generations.restore(st.generation)
        c.journal.record(Event.TMD_RESTARTED, job=st.job, address=c.address, store_port=c.store_port,
                         world_size=reg.world_size, generation=st.generation, previous_pid=st.previous_pid,
                         down_s=round(time.time() - st.last_ts, 3),
                         layout={n: list(r) for n, r in st.roles.items()})
        m = st.cut_migration
        if m is not None:
            if m["commit"]:
                self.decision = p.Decide(migration_id=m["id"], commit=True,
                                         reason="every joiner had its state before tmd restarted")
                c.journal.record(Event.MIGRATION_COMMITTED, migration_id=m["id"], sources=m["sources"],
                                 targets=m["targets"], reason="decided before tmd restarted")
            else:
                self.decision = p.Decide(migration_id=m["id"], commit=False,
                                         reason="tmd restarted during the migration")
                c.journal.record(Event.MIGRATION_ABORTED, migration_id=m["id"], sources=m["sources"],
                                 targets=m["targets"], reason=self.decision.reason)
        if st.open_incident is not None:
            c.journal.record(Event.RECOVERY_NOT_RESUMED, incident_id=st.open_incident,
                             reason="tmd restarted during this recovery; a new one starts once the processes "
                                    "re-registered")

    # ---------------------------------------------------------------------------------------------------------
    def ask(self, identity: bytes) -> None:
        """A worker message from ``identity``, which this tmd does not know: ask it to re-register."""
        if identity in self._refused:
            return
        now = time.monotonic()
        last = self._asked.get(identity)
        if last is not None and now - last < REASK_S:
            return
        self._asked[identity] = now
        c = self.control
        if last is None:
            c.journal.record(Event.REJOIN_REQUESTED, worker=identity.decode(errors="replace"))
        c.reply(identity, p.Reregister(store_host=c.store_host, store_port=c.store_port,
                                       generation=c.registry.generations.current))

    def on_rejoin(self, identity: bytes, msg: p.Rejoin) -> None:
        """A worker's answer to Reregister: adopt it into the registry (and its process into the launcher), or
        tell it to exit when it no longer fits the job (``rejoin_refused``)."""
        c = self.control
        reg = c.registry
        now = time.monotonic()
        known = reg.by_identity.get(identity)
        if known is not None and known.pid == msg.pid:
            known.last_heartbeat = now  # a second answer (it was asked again before its first one arrived)
            return
        self._asked.pop(identity, None)
        fields = {"node": msg.node, "local_rank": msg.local_rank, "pid": msg.pid, "rank": msg.rank,
                  "role": msg.role, "step": msg.step, "generation": msg.generation}
        node = reg.nodes.get(msg.node)
        if node is None and msg.role == WorkerRole.STANDBY:  # a standby added at run time, unknown to the replay
            node = reg.add_node(msg.node)
        if node is None or not 0 <= msg.local_rank < node.expected_workers:
            return self._refuse(identity, fields, f"unknown process {msg.node}/{msg.local_rank}", ExitCode.REFUSED)
        if node.role == NodeRole.FAILED:
            return self._refuse(identity, fields, f"{node.name} was declared failed", ExitCode.FENCED)
        if msg.role == WorkerRole.JOINER and node.role != NodeRole.ACTIVE:
            # (a guard, tmd.guards, too: the restarted tmd places guards afresh)
            return self._refuse(identity, fields, "joiner of a migration tmd's restart aborted, or a guard",
                                ExitCode.OK)
        if msg.role == WorkerRole.STANDBY and node.role == NodeRole.ACTIVE:
            return self._refuse(identity, fields, "tmd restarted before this process had its rank", ExitCode.REFUSED)
        if msg.role != WorkerRole.STANDBY and node.role == NodeRole.STANDBY:
            return self._refuse(identity, fields, f"holds rank {msg.rank}, but {node.name} is a standby",
                                ExitCode.FENCED)
        reg.generations.restore(msg.generation)  # new groups go on after the highest this worker built
        w = Worker(identity, msg.node, msg.local_rank, msg.pid, msg.host, step=msg.step, last_heartbeat=now,
                   iface=msg.iface, data_host=msg.data_host)
        if node.role == NodeRole.LEFT:  # a leaver whose migration committed: it leaves once it has the decision
            w.done = True
            node.workers[w.local_rank] = w
            reg.by_identity[identity] = w
        else:
            try:
                reg.add_worker(w)
            except ValueError as e:
                return self._refuse(identity, fields, str(e), ExitCode.REFUSED)
        if w.rank is not None and w.rank != msg.rank:
            c.journal.record(Event.REJOIN_MISMATCH, **fields, journal_rank=w.rank)
        if c.launcher is not None and msg.host == c.hostname \
                and c.launcher.pid_of(msg.node, msg.local_rank) != msg.pid:  # (tmd.supervise: tracked already)
            c.launcher.adopt(msg.node, msg.local_rank, msg.pid)
        c.journal.record(Event.WORKER_REJOINED, **fields)
        if self.decision is not None and msg.role != WorkerRole.STANDBY:
            c.send(w, self.decision)
        if node.role == NodeRole.STANDBY and node.warm:
            c.journal.record(Event.STANDBY_WARM, node=node.name)
        if not self._relearned and reg.all_ranks_assigned():
            self._relearned = True
            c.journal.record(Event.JOB_RELEARNED, after_s=round(now - self.started, 3), step=reg.current_step(),
                             generation=reg.generations.current)

    def _refuse(self, identity: bytes, fields: dict, reason: str, exit_code: ExitCode) -> None:
        self._refused.add(identity)
        self.control.journal.record(Event.REJOIN_REFUSED, **fields, reason=reason)
        self.control.reply(identity, p.Release(reason=reason, exit_code=exit_code))

    # ---------------------------------------------------------------------------------------------------------
    def tick(self, now: float) -> None:
        """Once ``rejoin_grace_s`` passed: fail active nodes that did not re-register, restart empty standbys.
        ``now``: time.monotonic()."""
        if self._checked or now - self.started < self.rejoin_grace_s:
            return
        self._checked = True
        c = self.control
        launcher = c.launcher
        for n in list(c.registry.nodes.values()):
            missing = [f"{n.name}/{i}" for i in range(n.expected_workers) if i not in n.workers]
            if n.role == NodeRole.ACTIVE and missing:
                c.fail_node(n, f"{', '.join(missing)} did not re-register within {self.rejoin_grace_s:.0f} s of "
                               "tmd's restart", FailureSignal.SILENT)
            elif n.role == NodeRole.STANDBY and not n.workers and launcher is not None and launcher.command \
                    and not launcher.running(n.name):
                c.journal.record(Event.STANDBY_RESTARTED, node=n.name, reason="no process of it re-registered")
                launcher.start_node(n.name, standby=True)
        self._recover_lost_ranks()

    def _recover_lost_ranks(self) -> None:
        """Ranks that no process holds after the restart (a recovery the crash cut, whose survivors wait halted
        for a plan that will never come) are recovered by a new incident: the survivors halt again under its id
        and follow its plan. Without it the job hung (found by an outside test: tmd killed during a recovery)."""
        c = self.control
        reg = c.registry
        lost = [r for r in range(reg.world_size) if r not in reg.rank_owner]
        if not lost or c.current_incident is not None:
            return
        c.recover_ranks({r: self.state.lost_ranks.get(r, "a node lost before tmd restarted") for r in lost},
                        f"ranks {lost} lost before tmd restarted (recovery {self.state.open_incident} was cut)")

"""tmd: the per-job coordinator. One ZeroMQ ROUTER serves the worker agents, tmctl and the SLURM hooks.

Single-threaded by design: one loop receives messages and, between them, runs the ticks. All state lives in this
thread, so nothing is locked. tmd hosts the job's rendezvous store (tmd.store, on a thread of its own), so the store
outlives any rank, leavers included.

The daemon is the loop, the socket, a handler table per sender role (``Message.SENDER``: worker messages only
from registered workers, Register and Rejoin being how a process becomes one; client requests (tmd.requests) and
hook notices only from other identities; anything else is journalled as ``bad_message``) and the application of
failure detection's verdicts (tmd.detection): failing a node (fence, abort its migration, start recovery),
health changes, restarting a standby; and failing the job (:meth:`Daemon.fail_job`) when tmd.faults says the
user's error ends it (a RankFailed, a process dead before it registered, the crash-loop guard, misuse). The rules
live elsewhere: migrations (tmd.migration) and recoveries (tmd.recovery) reach workers through it as a
tmd.channel.WorkerChannel; evacuation (tmd.evacuation), the end of the job (tmd.ending), ``tmd resume``
(tmd.resume) and SLURM (tmd.slurm) act through tmd.control.JobControl.

Assumption (as in torchft's lighthouse): tmd is a single point of coordination, not of training. If it dies the
ranks keep training; they just cannot migrate (or recover from a failure) until it is back: ``tmd resume``
restarts it on the same address, and it re-learns the job from the journal and the workers (tmd/resume.py).
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import sys
import time
import traceback
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, Union

import zmq

from tmd import protocol as p
from tmd.bad_input import BadInput
from tmd.config import DEFAULTS, JobConfig
from tmd.detection import Detector, Failure, Healthy, HostProcesses, ProcessExited, Slow, Unhealthy, Verdict
from tmd.ending import JobEnd
from tmd.evacuation import Evacuation
from tmd.faults import Faults, JobFailed
from tmd.guards import Guards
from tmd.journal import Journal, cut_text, last_seq
from tmd.local import LocalLauncher
from tmd.migration import Migration, MigrationError, Migrations
from tmd.protocol.keys import KEYS_ENV, Authenticator, JobKeys, limit, role_of_frame
from tmd.rundir import no_follow, write_atomic
from tmd.protocol.layout import RunDir
from tmd.protocol.vocab import (
    ErrorCode, Event, ExitCode, FailureSignal, Health, MigrationPhase, MigrationState, NodeRole, Sender,
    WorkerRole,
)
from tmd.recovery import Incident, Incidents, RecoveryError
from tmd.registry import Node, Registry, Worker
from tmd.requests import Requests
from tmd.resume import JobState, Resumed, split_address
from tmd.status import status_reply
from tmd.steplog import StepLog
from tmd.store import StoreServer

if TYPE_CHECKING:
    from tmd.metrics import Metrics
    from tmd.slurm import Rebuild, SlurmCluster
    from tmd.tiers import Restart, Tier
    from tmd.web import WebServer

TICK_S = 0.05
STEP_TIMES_EVERY_S = 1.0  # how often the steps every rank finished are journalled (step_times)
STEP_TIMES_MAX = 256  # ... or sooner, once this many are waiting (~8 KB of a journal line's 16 KiB)
PUBLISH_STATUS_EVERY_S = 0.5  # how often the status page and the live metrics get a fresh status
CRASH_AFTER_TICK_ERRORS = 20  # consecutive failing ticks (a bug that does not go away) end the loop: TmdCrashed


class TmdCrashed(Exception):
    """tmd's loop ended by a bug of its own (journalled as ``tmd_crashed`` with its traceback). The ranks were
    left training: tmd.supervise restarts tmd (as ``tmd resume`` would), or the user runs ``tmd resume``."""


def _web_port_of(tmd_json: str) -> Optional[int]:
    """The status page's port in the tmd.json at ``tmd_json`` (None: none there, or unreadable)."""
    from tmd.resume import web_port

    try:
        with open(tmd_json, "rb", opener=no_follow) as f:
            info = json.loads(f.read())
    except (OSError, ValueError):
        return None
    return web_port(info) if isinstance(info, dict) else None


class Daemon:
    """The coordinator of one job; implements :class:`tmd.control.JobControl` and
    :class:`tmd.channel.WorkerChannel`."""

    def __init__(self, job: str, run_dir: str, nodes: list[str], ranks_per_node: int, standbys: list[str],
                 config: JobConfig = DEFAULTS, *, host: str = "127.0.0.1", echo: bool = True,
                 resume: Optional[JobState] = None, command: Optional[list[str]] = None,
                 netns: Optional[dict] = None, keys_dir: Optional[str] = None,
                 tier: Optional["Tier"] = None, port: Optional[int] = None) -> None:
        """Coordinate job ``job`` (its journal, logs and recordings in ``run_dir``): ``nodes`` active nodes of
        ``ranks_per_node`` ranks each, in rank order, and ``standbys``, with the settings of ``config``
        (tmd.config.JobConfig: detection, recording, snapshots, guards, ports...), journalled whole as
        ``job_config``. ``host``: the address tmd binds, hosts the job's store at and advertises (never all
        interfaces). ``echo``: print each journal event. ``resume``: take over this running job (its journal goes
        on; the workers re-register) instead of starting one: bind the address it had (``resume.address``), and
        journal where ``config`` differs from the journal's (the options given to ``tmd resume``).
        ``command``: the workers' command line in local mode (kept in tmd.json for ``tmd resume``). ``netns``:
        tmd.json's network namespaces (tmd.netns). ``keys_dir``: where the job's CURVE keys and secret live
        (tmd.protocol.keys; default ``<run_dir>/keys``): created at start, reused by a resumed tmd (the workers
        pinned its public key). ``tier``: the job's checkpoint tier (tmd.tiers; None: no checkpoints): when in-memory
        recovery is impossible, a local job is restarted from its newest checkpoint (:attr:`restart` set, the loop
        ends, and tmd.cli relaunches the job with a new daemon and the same tier, whose keys and journal it goes on
        with). ``port``: the port to bind instead of ``config.serve.port`` (a relaunch binds the address its
        processes know; the setting stays the user's). Raises zmq.ZMQError when the address is taken,
        KeysUnavailable when a resumed job's keys cannot be read."""
        port = config.serve.port if port is None else port
        if resume is not None:
            host, port = split_address(resume.address)
        os.umask(0o077)  # the run dir's files (journal, recordings, logs; the workers inherit it) are the user's only
        self.job = job
        self.layout = RunDir(run_dir)
        self.run_dir = self.layout.path
        os.makedirs(self.layout.record_dir, exist_ok=True)
        self.config = config
        record_steps = config.replay.record_steps
        self.hostname = socket.gethostname()
        self.tier = tier
        self.restart: Optional["Restart"] = None  # set when this daemon ends for a restart from a checkpoint
        self.rebuild: Optional["Rebuild"] = None  # SLURM mode: that restart's world inside the allocation
        restarted = resume is None and tier is not None and bool(tier.restarts)  # a relaunch after a restart
        self.journal = Journal(self.layout.events, echo=echo,
                               seq=resume.last_seq if resume else tier.last_seq if restarted else
                               last_seq(self.layout.events))
        if tier is not None:
            tier.attach(self.journal)
            if not restarted:
                tier.skip_existing()
            if not restarted and resume is None:
                tier.started()
        self.registry = Registry(nodes, ranks_per_node, standbys)
        self.steplog = StepLog(self.registry.world_size)
        self._steps_flushed_at = self._status_published_at = 0.0
        self.migrations = Migrations(self.registry, self.journal, self, record_steps=record_steps)
        if resume is not None:
            self.migrations.first_id = resume.last_migration_id + 1  # migration ids go on after a restart
        self.incidents = Incidents(self.registry, self.journal, self, self.layout,
                                   snapshot_every=config.snapshot.snapshot_every)
        if restarted:  # a relaunch from a checkpoint: one journal, so migration and incident ids go on too
            self.migrations.first_id, self.incidents.first_id = (last + 1 for last in tier.last_ids)
        if resume is not None:
            self.incidents.first_id = resume.last_incident_id + 1  # incident ids go on after a restart too
            self.incidents.restore(resume.replicas, resume.keepers, resume.unprotected)
        self.faults = Faults(self.registry, self.journal, self.layout, self.incidents)
        self.incidents.refusal = self.faults.unmanaged
        self.guards = Guards(self.registry, self.journal, self, self.layout, config.standby.guards, record_steps,
                             suspects=self._suspects)
        self.incidents.free_standby = self.guards.free_one
        if tier is not None:
            self.incidents.standby_wait_s = tier.config.standby_wait_s
        self.keys: Optional[JobKeys] = None
        self._auth: Optional[Authenticator] = None
        self._ctx = zmq.Context()  # its own context: ZAP (the authenticator) is per context
        self.sock = self._ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        # No ROUTER_HANDOVER: an identity in use cannot be taken over by another connection (worker identities
        # carry a random part, so a restarted process never collides with its predecessor).
        if config.serve.auth:
            keys_dir = keys_dir or os.path.join(self.layout.path, "keys")
            reuse = resume is not None or restarted  # the ranks of a relaunched job get the same keys
            self.keys = JobKeys.load(keys_dir) if reuse else JobKeys.create(keys_dir)
            os.environ[KEYS_ENV] = self.keys.worker_keys()  # the processes tmd starts get a worker's keys only
            self._auth = Authenticator(self._ctx, self.keys)
            self._auth.start()
            self.keys.serve(self.sock)
        else:
            os.environ.pop(KEYS_ENV, None)
            limit(self.sock)
        self.sock.bind(f"tcp://{host}:{port or '*'}")
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        # the job's rendezvous store: on the job's address only, never all interfaces; only the worker key admitted
        self.store = StoreServer(host, self.keys)
        self.store_host = host
        self.launcher: Optional[LocalLauncher] = None  # starts the processes (local mode, srun): set by tmd.cli
        self.cluster: Optional["SlurmCluster"] = None  # SLURM mode: ticked; resolves targets; gets NodeNotices
        self.processes = HostProcesses(self.hostname)
        self.evacuation = Evacuation(self, config.standby.migrate_stragglers)
        self.detector = Detector(
            self.registry, exits=lambda: self.launcher.poll() if self.launcher else (), processes=self.processes,
            replacing=self._replacing, held_unhealthy=self.evacuation.gpu_unhealthy,
            config=config.detection)
        self.ending = JobEnd(self)
        self.requests = Requests(self, self.status, lambda: self.cluster)
        self.exit_code: Optional[int] = None
        self.bad_input = BadInput(self.journal)
        self.metrics: Optional["Metrics"] = None
        self.web: Optional["WebServer"] = None
        self.web_token_file: Optional[str] = None
        if config.serve.metrics_port >= 0:
            self._serve_web(host, config.serve.metrics_port, keys_dir or os.path.join(self.layout.path, "keys"), resume,
                            replay=resume is not None or restarted)
        self.internal_errors = 0  # handler and tick errors (bugs of tmd's own) survived
        self._failing_ticks = 0
        info = {"address": self.address, "pid": os.getpid(), "job": job, "run_dir": self.run_dir, "netns": netns or {},
                "keys": self.keys.path if self.keys else None,
                "web": {"url": self.web.url, "token_file": self.web_token_file} if self.web else None}
        if command:
            info.update(command=command, cwd=os.getcwd())
        write_atomic(self.layout.tmd_json, json.dumps(info).encode())  # never through a symlink (tmd.rundir)
        # How a process becomes a known worker, then what each sender role may send.
        self._joining: dict[type, Callable[[bytes, Any], None]] = {p.Register: self._register, p.Rejoin: self._rejoin}
        self._handlers: dict[Sender, dict[type, Callable[[Any, Any], None]]] = {
            Sender.WORKER: {p.Heartbeat: self._heartbeat, p.StepReport: self._step_report,
                            p.PhaseDone: self._phase_done, p.RecoveryReport: self._recovery_report,
                            p.Done: self._done, p.RankFailed: self._rank_failed,
                            p.RankWarning: self._rank_warning, p.ReplicaReport: self._replicas,
                            p.SnapshotReport: self._snapshot_report},
            Sender.CLIENT: {p.StatusRequest: self.requests.status, p.MigrateRequest: self.requests.migrate,
                            p.MigrationRequest: self.requests.migration,
                            p.AddStandbyRequest: self.requests.add_standby, p.EventsRequest: self.requests.events},
            Sender.HOOK: {p.NodeNotice: self.requests.node_notice},
        }
        self._snapshots_journalled: set[tuple[str, int]] = set()
        self.resumed: Optional[Resumed] = None
        if resume is not None:
            self.resumed = Resumed(self, resume, rejoin_grace_s=max(10.0, 2 * config.detection.heartbeat_timeout_s))
            self.resumed.start()
            self.journal.record(Event.JOB_CONFIG, config=config.to_dict(), overrides=config.overrides(resume.config))
        else:
            self.journal.record(Event.TMD_STARTED, job=job, address=self.address, world_size=self.registry.world_size,
                                nodes=nodes, standbys=standbys, store_port=self.store.port, record_steps=record_steps,
                                snapshot_every=config.snapshot.snapshot_every, guards=config.standby.guards,
                                page=self.web.url if self.web else None)
            self.journal.record(Event.JOB_CONFIG, config=config.to_dict())

    # --- the loop -------------------------------------------------------------------------------------------------
    def run(self) -> int:
        """Serve until the job ends. Returns the job's exit code (0: every rank finished)."""
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)

        def stop(signum, frame) -> None:  # SIGTERM/SIGINT: end the loop so local-mode processes are terminated
            self.journal.record(Event.TMD_SIGNALLED, signal=signal.Signals(signum).name)
            self.exit_code = 128 + signum

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, stop)
        crashed: Optional[BaseException] = None
        try:
            while self.exit_code is None:
                try:
                    if poller.poll(int(TICK_S * 1000)):
                        # read what is queued, but tick at least every TICK_S: a flood of messages (from a party
                        # holding a key) must not hold back failure detection, deadlines or the job's end
                        drain_until = time.monotonic() + TICK_S
                        while time.monotonic() < drain_until:
                            try:
                                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                            except zmq.Again:
                                break
                            role = role_of_frame(frames[-1]) if self.keys else None
                            self.on_frames([f.bytes for f in frames], role)
                    if self.exit_code is None:
                        self._contained_tick()
                except RecoveryError as e:
                    self._recovery_impossible(str(e))
                except JobFailed as e:
                    self.fail_job(e)
        except Exception as e:  # a bug of tmd's own that containment could not absorb: the ranks train on
            crashed = e
            self.journal.record(Event.TMD_CRASHED, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
            raise TmdCrashed(f"tmd crashed: {type(e).__name__}: {e}") from e
        finally:
            if self.launcher and crashed is None:
                self.launcher.terminate_all(close=self.restart is None)  # a relaunch keeps namespaces, CPU sets
            if self.cluster is not None and crashed is None and self.rebuild is None:
                self.cluster.job_ended()  # SLURM mode: cancels the standby jobs tmd submitted (not for a rebuild)
            self._flush_steps()
            if crashed is None:
                self.journal.record(Event.TMD_STOPPED, exit_code=self.exit_code)
            self.close()
        return self.exit_code

    def close(self) -> None:
        """Close the socket, the authenticator and the journal (the job's processes are left alone). Idempotent."""
        if self.sock.closed:
            return
        self.journal.close()
        if self.web is not None:
            self.web.stop()
        self.store.stop()
        self.sock.close()
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        self._ctx.term()

    def _serve_web(self, host: str, port: int, keys_dir: str, resume: Optional[JobState], replay: bool) -> None:
        """Start the metrics endpoint and status page (tmd.metrics, tmd.web) on ``host``:``port``, fed by the
        journal. A resumed tmd (and one relaunched from a checkpoint: ``replay``) replays the journal first
        (counters go on) and takes the page's old port back when free (tmd.json's, so that a scrape config and a
        bookmark stay right)."""
        from tmd.journal import read_events
        from tmd.metrics import Metrics
        from tmd.web import WebServer, WebState, load_or_create_token

        self.metrics, self.web_state = Metrics(self.job), WebState()
        if replay:
            for entry in read_events(self.layout.events):
                self.metrics.observe(entry)
                self.web_state.add_event(entry)
        wanted = port
        if resume is not None:
            port = resume.web_port or port
        elif replay:  # relaunched from a checkpoint: the previous tmd's tmd.json is still in place
            port = _web_port_of(self.layout.tmd_json) or port
        self.web_token_file = p.layout.web_token(keys_dir)
        token = load_or_create_token(self.web_token_file)
        try:
            self.web = WebServer(host, port, token, self.metrics, self.web_state)
            self.web.start()
        except OSError:
            if port == wanted or port == 0:
                raise
            self.web = WebServer(host, 0, token, self.metrics, self.web_state)  # the old port is taken
            self.web.start()
        self.journal.subscribe(self.metrics.observe)
        self.journal.subscribe(self.web_state.add_event)

    def _flush_steps(self) -> None:
        steps = self.steplog.flush()
        if steps:
            self.journal.record(Event.STEP_TIMES, steps=steps)

    def _contained_tick(self) -> None:
        """One tick; a bug in it is journalled (``internal_error``) and the loop goes on, unless ticks keep
        failing (:data:`CRASH_AFTER_TICK_ERRORS` in a row): then it raises and the loop ends as a crash."""
        try:
            self._tick()
            self._failing_ticks = 0
        except (RecoveryError, JobFailed):
            raise
        except Exception as e:
            self._failing_ticks += 1
            self.internal_errors += 1
            if self._failing_ticks >= CRASH_AFTER_TICK_ERRORS:
                raise
            if self._failing_ticks == 1:
                self.journal.record(Event.INTERNAL_ERROR, where="tick", error=f"{type(e).__name__}: {e}",
                                    traceback=traceback.format_exc())

    def _recovery_impossible(self, reason: str) -> None:
        """In-memory recovery cannot repair the job (tmd.recovery.RecoveryError's ``reason``): with a checkpoint
        tier, end this daemon for a restart of every process from the newest valid checkpoint (:attr:`restart`;
        tmd.cli relaunches). SLURM mode relaunches inside the allocation, on the surviving nodes plus standbys
        (:attr:`rebuild`, journalled ``world_rebuilt``), or, where too few usable nodes are left, requeues the job
        (``job_requeued``; its next run resumes). Else fail the job, saying why."""
        why = "no --checkpoint-dir"
        if self.tier is not None and not self.ending.released:
            local = self.cluster is None and isinstance(self.launcher, LocalLauncher) and bool(self.launcher.command)
            restart, why = self.tier.plan_restart(reason) if local or self.cluster is not None else \
                (None, "tmd starts no processes")
            how = "every process restarts"
            if restart is not None and self.cluster is not None:  # SLURM: inside the allocation, else requeued
                self.rebuild, not_rebuilt = self.cluster.rebuild_world()
                if self.rebuild is not None:
                    self.journal.record(Event.WORLD_REBUILT, step=restart.step, nodes=self.rebuild.world,
                                        replaced={str(r): n for r, n in self.rebuild.replaced.items()})
                    how = f"every rank restarts on {', '.join(self.rebuild.world)}"
                else:
                    error = self.cluster.requeue()
                    self.journal.record(Event.JOB_REQUEUED, step=restart.step, error=error, reason=not_rebuilt)
                    how = f"the job is requeued ({not_rebuilt})"
                    if error is not None:
                        why = f"{not_rebuilt}, and scontrol requeue failed: {error}"
                        restart = None
            if restart is not None:
                print(f"[tmd] in-memory recovery impossible ({reason}): {how} from checkpoint {restart.path} (step "
                      f"{restart.step}; {restart.work_lost_s:.1f} s of work lost)", flush=True)
                self.restart = restart
                self.exit_code = ExitCode.FAILED  # unless tmd.cli relaunches the job (local mode)
                return
        self.fail_job(JobFailed(reason if self.tier is None else f"{reason} (no restart from a checkpoint: {why})"))

    def fail_job(self, failure: JobFailed) -> None:
        """End the job now with exit code 1: journal ``job_failed`` and print the reason and its details (a
        traceback, a log tail) on stderr, even with --quiet. The loop's end terminates every process."""
        self.journal.record(Event.JOB_FAILED, reason=failure.reason)
        text = f"tmd: job {self.job} failed: {failure.reason}"
        if failure.details:
            text += "\n" + failure.details.rstrip("\n")
        print(text, file=sys.stderr, flush=True)
        self.exit_code = ExitCode.FAILED

    def _tick(self) -> None:
        now = time.monotonic()
        self.faults.tick()
        for verdict in self.detector.tick(now):
            self._apply(verdict)
        self.bad_input.tick(now)
        self.migrations.tick(now)
        self.incidents.tick(now)
        self.evacuation.tick(now)
        if self.tier is not None:
            self.tier.tick(now)
        busy = self.migrations.current is not None or self.incidents.current is not None or self.ending.released
        self.guards.tick(busy, time.time())
        if self.resumed is not None:
            self.resumed.tick(now)
        if self.cluster is not None:
            self.cluster.tick(now)
        if now - self._steps_flushed_at >= STEP_TIMES_EVERY_S:
            self._steps_flushed_at = now
            self._flush_steps()
        if self.web is not None and now - self._status_published_at >= PUBLISH_STATUS_EVERY_S:
            self._status_published_at = now
            status = dataclasses.asdict(self.status())
            self.metrics.set_live(status)
            self.web_state.publish_status(status)
        code = self.ending.tick(now)
        if code is not None:
            self.exit_code = code

    # --- dispatch -------------------------------------------------------------------------------------------------
    def on_frames(self, frames: list[bytes], role: Optional[Sender] = None) -> None:
        """Handle one multipart message from the socket: ``[identity, frame]``, sent over a connection
        authenticated as ``role`` (tmd.protocol.keys; None: no authentication, any role). Never raises for bad
        input, and a bug of tmd's own in a handler is journalled (``internal_error``) and survived; only the
        job's own end (JobFailed, RecoveryError) propagates."""
        def refuse(identity: bytes, why: str) -> None:
            self._refuse(identity, why)
            if role == Sender.CLIENT and identity:  # tmctl waits for an answer: say why, not let it time out
                self.reply(identity, p.ErrorReply(code=ErrorCode.BAD_REQUEST, message=cut_text(why, 500)))

        if len(frames) != 2:
            refuse(frames[0] if frames else b"", f"expected 2 frames, got {len(frames)}")
            return
        identity, frame = frames
        try:
            msg = p.decode(frame)
        except p.ProtocolError as e:
            refuse(identity, str(e))
            return
        if role is not None and msg.SENDER != role:
            refuse(identity, f"{msg.TYPE} is a {msg.SENDER} message; this connection is authenticated as a {role}")
            return
        try:
            self._dispatch(identity, msg)
        except MigrationError as e:
            self.reply(identity, p.ErrorReply(code=e.code, message=str(e)))
        except (RecoveryError, JobFailed):
            raise
        except Exception as e:
            self.internal_errors += 1
            self.journal.record(Event.INTERNAL_ERROR, where=msg.TYPE, sender=identity.decode(errors="replace"),
                                error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())

    def _dispatch(self, identity: bytes, msg: p.Message) -> None:
        kind = type(msg)
        if kind in self._joining:
            self._joining[kind](identity, msg)
            return
        handler = self._handlers.get(msg.SENDER, {}).get(kind)
        if handler is None:
            self._refuse(identity, f"{msg.TYPE} is not a request tmd serves (a {msg.SENDER} message)")
        elif msg.SENDER == Sender.WORKER:
            w = self._worker(identity, msg)
            if w is not None:
                handler(w, msg)
        elif identity in self.registry.by_identity:
            w = self.registry.by_identity[identity]
            self._refuse(identity, f"{msg.TYPE} is a {msg.SENDER} message, not one a worker "
                                   f"({w.node}/{w.local_rank}) may send")
        else:
            handler(identity, msg)

    def _refuse(self, identity: bytes, error: str) -> None:
        self.bad_input.refuse(identity.decode(errors="replace"), error, time.monotonic())

    def _worker(self, identity: bytes, msg: p.Message) -> Optional[Worker]:
        """The registered, live worker that sent ``msg``, or None: an unknown process is refused (or, after
        ``tmd resume``, asked to re-register), and a fenced one, or one whose slot another process holds now, told
        to exit."""
        w = self.registry.by_identity.get(identity)
        if w is None and self.resumed is not None:  # a worker this restarted tmd has not re-learned yet
            self.resumed.ask(identity)
            return None
        if w is None:
            self._refuse(identity, f"{msg.TYPE} from a process that never registered")
            return None
        if w.fenced and w.fenced_on_exit and isinstance(msg, p.RankFailed):
            # its exit was taken for a node failure before its report arrived: the report still counts (not for a
            # node failed as silent or stopped: what it raises once it runs again follows from the fencing)
            return w
        if w.fenced:  # declared failed and replaced (e.g. SIGSTOPped, then continued): it must go away
            if not w.fence_sent:
                w.fence_sent = True
                self.journal.record(Event.FENCED, node=w.node, local_rank=w.local_rank, pid=w.pid, message=msg.TYPE)
            self.send(w, p.Release(reason=f"{w.node} was declared failed; its ranks are held by others now",
                                   exit_code=ExitCode.FENCED))
            return None
        holder = self.registry.nodes[w.node].workers.get(w.local_rank)
        if holder is not None and holder is not w:
            # its slot went to another process (a standby restarted): this identity speaks for nothing any more
            self._refuse(identity, f"{msg.TYPE} from {w.node}/{w.local_rank} (pid {w.pid}), whose slot another "
                                   f"process holds now")
            self.send(w, p.Release(reason="another process holds this slot", exit_code=ExitCode.REFUSED))
            return None
        w.last_heartbeat = time.monotonic()
        return w

    # --- sending (JobControl, WorkerChannel) ------------------------------------------------------------------
    def reply(self, identity: bytes, msg: p.Message) -> None:
        """Queue ``msg`` for the ZeroMQ peer ``identity``."""
        self.sock.send_multipart([identity, p.encode(msg)])

    def send(self, worker: Worker, msg: p.Message) -> None:
        """Queue ``msg`` for one worker process."""
        self.reply(worker.identity, msg)

    def ignore(self, worker: Worker, event: Event, **fields) -> None:
        """Journal a report that counts for nothing, bounded (see :class:`tmd.channel.WorkerChannel`)."""
        self.bad_input.ignore(worker.identity.decode(errors="replace"), time.monotonic(), event, **fields)

    def assign(self, worker: Worker, rank: int, *, migration_id: int = 0, incident_id: int = 0,
               guard: bool = False) -> None:
        """Give a standby process ``rank`` as a joiner (see :class:`tmd.channel.WorkerChannel`)."""
        self.send(worker, self._assignment(WorkerRole.JOINER, rank, self.registry.generations.current,
                                           migration_id=migration_id, incident_id=incident_id, guard=guard))

    def _assignment(self, role: WorkerRole, rank: int, generation: int, migration_id: int = 0,
                    incident_id: int = 0, guard: bool = False) -> p.Assign:
        return p.Assign(role=role, rank=rank, world_size=self.registry.world_size, store_host=self.store_host,
                        store_port=self.store.port, generation=generation,
                        record_steps=self.config.replay.record_steps,
                        snapshot_every=self.config.snapshot.snapshot_every, record_dir=self.layout.record_dir,
                        migration_id=migration_id, incident_id=incident_id, guard=guard)

    # --- worker messages --------------------------------------------------------------------------------------
    def _register(self, identity: bytes, msg: p.Register) -> None:
        if not identity.startswith(f"{msg.node}/{msg.local_rank}/".encode()):  # see worker.agent: node/local/nonce
            self._refuse(identity, f"Register of {msg.node}/{msg.local_rank} from another identity")
            return
        w = Worker(identity, msg.node, msg.local_rank, msg.pid, msg.host, iface=msg.iface, data_host=msg.data_host)
        try:
            node = self.registry.add_worker(w)
        except (KeyError, ValueError) as e:
            reason = f"unknown node '{msg.node}'" if isinstance(e, KeyError) else str(e)
            self.journal.record(Event.REGISTER_REFUSED, node=msg.node, local_rank=msg.local_rank, reason=reason)
            self.reply(identity, p.Release(reason=reason, exit_code=ExitCode.REFUSED))
            return
        self.journal.record(Event.WORKER_REGISTERED, node=msg.node, local_rank=msg.local_rank, pid=msg.pid,
                            rank=w.rank, role=node.role, iface=msg.iface or None, address=msg.data_host or None)
        self.faults.registered(w)
        if w.rank is not None:  # an active rank at job start: the first generation of groups
            self.send(w, self._assignment(WorkerRole.ACTIVE, w.rank, 0))
        if self.ending.released and node.role in (NodeRole.STANDBY, NodeRole.JOINING):
            # a standby restarted just before the job finished registers after the others were released: release
            # it too, now, instead of waiting out the job end's grace
            self.send(w, p.Release(reason="job finished", exit_code=ExitCode.OK))
            return
        if node.role == NodeRole.STANDBY and node.warm:
            self.journal.record(Event.STANDBY_WARM, node=node.name)

    def _rejoin(self, identity: bytes, msg: p.Rejoin) -> None:
        if not identity.startswith(f"{msg.node}/{msg.local_rank}/".encode()):
            self._refuse(identity, f"Rejoin of {msg.node}/{msg.local_rank} from another identity")
            return
        if self.resumed is None:
            self._refuse(identity, "Rejoin, but this tmd did not restart")
            return
        self.resumed.on_rejoin(identity, msg)

    def _heartbeat(self, w: Worker, msg: p.Heartbeat) -> None:
        w.counters = msg.counters
        self.evacuation.observe(w, msg.counters, time.monotonic())

    def _step_report(self, w: Worker, msg: p.StepReport) -> None:
        w.step = msg.step + 1  # the step it is on now
        if msg.shadow:
            return
        w.step_time_s = msg.step_time_s
        owner = self.registry.rank_owner.get(msg.rank)
        if owner is w or (w.rank == msg.rank and self.migrations.leaver_step(w, msg.step)):
            self.registry.record_step(msg.rank, msg.step, msg.step_time_s)
            self.steplog.report(msg.rank, msg.step, msg.step_time_s)
            if self.steplog.ready >= STEP_TIMES_MAX:  # fast steps: keep each journal line well under its bound
                self._flush_steps()
            self.migrations.on_step(msg.rank, msg.step)

    def _phase_done(self, w: Worker, msg: p.PhaseDone) -> None:
        m = self.migrations.current
        if m is not None and not msg.ok and msg.phase == MigrationPhase.TRANSFERRED and w.node in m.targets \
                and m.state != MigrationState.TRANSFERRED:
            # A joiner's transfer broke: if its leaver is dead, that is a node failure (the warm joiners are kept
            # and get their state from a replica), not merely an aborted migration. (After the commit decision
            # the joiner exits instead: its own node's failure.)
            source, leavers = m.leaver_side(w)
            failure = self.detector.broken_transfer(self.registry.nodes[source], leavers)
            if failure is not None:
                self.fail_node(failure.node, failure.reason, failure.signal)
        self.migrations.on_phase(w, msg)

    def _recovery_report(self, w: Worker, msg: p.RecoveryReport) -> None:
        if not self.guards.on_warmed(w, msg, time.time()):  # a guard's warm-up: not an incident's business
            self.incidents.on_report(w, msg)

    def _suspects(self) -> set[str]:
        """Active nodes under suspicion (a straggler rank or an unhealthy GPU verdict): guarded first."""
        return {n.name for n in self.registry.nodes_in(NodeRole.ACTIVE)
                if self.evacuation.flagged(n) or self.evacuation.gpu_unhealthy(n)}

    def _done(self, w: Worker, msg: p.Done) -> None:
        if not self._own_rank(w, msg):
            return
        w.done = True
        if not w.done_journalled:  # a resent copy (its first ack was late) is acknowledged again, not journalled
            w.done_journalled = True
            self.journal.record(Event.RANK_LEFT if msg.left else Event.RANK_DONE, node=w.node,
                                local_rank=w.local_rank, rank=msg.rank, final_step=msg.final_step)
        self.send(w, p.DoneAck(rank=msg.rank))

    def _own_rank(self, w: Worker, msg: Union[p.RankFailed, p.RankWarning, p.Done, p.SnapshotReport]) -> bool:
        """Whether ``msg`` speaks for the rank tmd gave ``w``: the one it owns, or takes over as a joiner of the
        running migration. The worker key is shared by every process of the job: another rank's failure or
        warning, end or snapshot, or one from a process given no rank, is refused."""
        rank = w.rank
        if rank is None and self.migrations.current is not None:  # a joiner owns its rank from the commit on
            rank = next((r for r, j in self.migrations.current.joiners.items() if j is w), None)
        if rank is not None and msg.rank == rank:
            return True
        held = "no rank" if rank is None else f"rank {rank}"
        self._refuse(w.identity, f"{msg.TYPE} for rank {msg.rank} from {w.node}/{w.local_rank}, which holds {held}")
        return False

    def _rank_failed(self, w: Worker, msg: p.RankFailed) -> None:
        if not self._own_rank(w, msg):
            return
        if msg.kind == p.FailureKind.CHECKPOINT_REFUSED and self.tier is not None:
            if self.restart is not None:  # another rank refused it too: the restart before it is planned already
                return
            if self.tier.load_refused(msg.rank, w.node, msg.error):  # one tmd chose: restart from an older one
                raise RecoveryError(f"rank {msg.rank} on {w.node} refused checkpoint {self.tier.resume_from} at load")
        if self.registry.rank_owner.get(msg.rank) is not w and not w.fenced:
            # a joiner (in its sandbox) that raised, e.g. a mesh created in another order: its standby is out of
            # this migration or incident (its exit aborts it), never the job, which trains on untouched
            self.journal.record(Event.JOINER_FAILED, rank=msg.rank, node=w.node, local_rank=w.local_rank,
                                step=msg.step, kind=msg.kind, error=msg.error, traceback=msg.traceback)
            return
        raise self.faults.rank_failed(w, msg)

    def _replicas(self, w: Worker, msg: p.ReplicaReport) -> None:
        try:
            self.incidents.on_replicas(w, msg)
        except ValueError as e:  # a class that does not fit the job: refused, the job untouched
            self._refuse(w.identity, str(e))

    def _snapshot_report(self, w: Worker, msg: p.SnapshotReport) -> None:
        if not self._own_rank(w, msg):
            return
        if (w.node, msg.rank) in self._snapshots_journalled:  # one line per process of a rank, however often sent
            return
        self._snapshots_journalled.add((w.node, msg.rank))
        self.journal.record(Event.SNAPSHOT_TAKEN, rank=msg.rank, node=w.node, step=msg.step,
                            bytes_per_copy=msg.bytes_per_copy, copy_s=round(msg.copy_s, 6))

    def _rank_warning(self, w: Worker, msg: p.RankWarning) -> None:
        if not self._own_rank(w, msg):
            return
        if msg.code == p.WarningCode.CHECKPOINT_FAILED and self.tier is not None:
            self.tier.save_failed(msg.rank, w.node, msg.message)  # every failed save, not the first one only
            return
        self.faults.warned(w, msg)
        m = self.migrations.current
        if msg.code in p.REFUSING_WARNINGS and m is not None and not m.finished and \
                m.state != MigrationState.TRANSFERRED:  # (after the decision nothing aborts: it commits)
            self.migrations.abort(m, f"rank {msg.rank} on {w.node} reported {msg.code}: {msg.message}")

    # --- verdicts of failure detection --------------------------------------------------------------------------
    def _apply(self, v: Verdict) -> None:
        if isinstance(v, Failure):
            if self.detector.in_job(v.node):  # (an earlier verdict of the same tick may have settled it)
                self.fail_node(v.node, v.reason, v.signal)
        elif isinstance(v, ProcessExited):
            self._process_exited(v)
        elif isinstance(v, Unhealthy):
            n = v.node
            n.health, n.reason = Health.UNHEALTHY, v.reason
            self.journal.record(Event.NODE_UNHEALTHY, node=n.name, reason=n.reason,
                                processes=[f"{w.node}/{w.local_rank}" for w in v.silent])
            for w in v.silent:
                self.migrations.on_worker_lost(w, n.reason)
        elif isinstance(v, Healthy):
            v.node.health, v.node.reason = Health.HEALTHY, ""
            self.journal.record(Event.NODE_HEALTHY, node=v.node.name)
        elif isinstance(v, Slow):
            self.journal.record(Event.NODE_SLOW, node=v.node.name, silent_s=v.silent_s, cpu_s=v.cpu_s,
                                note="silent but computing: not failed")

    def _process_exited(self, v: ProcessExited) -> None:
        """Journal the exit; a standby's or a joiner's unexpected exit aborts its migration, and a standby whose
        processes are all gone is started again (until the job finished)."""
        node, w = v.node, v.worker
        if w is not None:
            w.exited = True
        extra = {} if v.returncode is not None else {"exit_code_known": False, "reported_done": bool(w and w.done)}
        self.journal.record(Event.PROCESS_EXIT, node=node.name, local_rank=v.local_rank, returncode=v.returncode,
                            expected=v.expected, **extra)
        if w is None and not self.ending.released:
            failed = self.faults.startup_exit(node, v.local_rank, v.returncode)
            if failed is not None:
                raise failed
        if not v.lost and w is not None:
            return
        if w is not None:
            self.migrations.on_worker_lost(w, f"exited with code {v.returncode}")
        if node.role == NodeRole.GUARDING:  # its sandbox is gone: the rest of it goes too, fresh ones come up
            self.guards.lost(node, f"{node.name}/{v.local_rank} exited with code {v.returncode}")
        if node.role == NodeRole.STANDBY and not self.ending.released and self.launcher is not None:
            node.health = Health.UNHEALTHY if node.workers else node.health
            if not self.launcher.running(node.name):
                node.workers.clear()
                node.health = Health.UNKNOWN
                refused = self.faults.may_restart_standby(node)
                if refused:
                    self.journal.record(Event.STANDBY_RESTARTED, node=node.name, stopped=True, reason=refused)
                    return
                self.journal.record(Event.STANDBY_RESTARTED, node=node.name)
                self.launcher.start_node(node.name, standby=True)

    def status(self) -> p.StatusReply:
        """What ``tmctl status`` shows (tmd.status)."""
        latest = lambda episodes: episodes.all[-1] if episodes.all else None  # noqa: E731
        return status_reply(self.job, self.registry, latest(self.migrations), latest(self.incidents),
                            self.evacuation.flagged, self.cluster.decorate if self.cluster else None,
                            failure=self.faults.failure, warnings=self.faults.warnings + self.incidents.unprotected,
                            page=self.web.url if self.web else None,
                            # the detection thresholds as the detector holds them: what it judges with
                            config=dataclasses.replace(self.config, detection=self.detector.config).to_dict(),
                            checkpoints=self.tier.status() if self.tier is not None else None,
                            slurm=self.cluster.status() if self.cluster else None)

    # --- JobControl (see tmd.control for what each does) ---------------------------------------------------
    @property
    def store_port(self) -> int:
        return self.store.port

    def fail_node(self, node: Node, reason: str, signal: FailureSignal) -> None:
        if node.role == NodeRole.FAILED:
            return
        beats = [w.last_heartbeat for w in node.workers.values()]
        silent_s = round(time.monotonic() - max(beats), 6) if beats else None  # the detection latency, at most
        self.journal.record(Event.NODE_FAILED, node=node.name, reason=reason, signal=signal, ranks=node.ranks,
                            silent_s=silent_s)
        refused = self.faults.refuse_recovery(node, reason) if self.detector.in_job(node) else None
        if refused is not None:
            raise refused
        self._stonith(node, signal)
        if node.role == NodeRole.JOINING and self._replacing(node.name):
            self.incidents.on_replacement_lost(node, reason)
            return
        # A leaver that died mid-migration: its pair's joiners are warm for exactly these ranks; their state
        # will come from a data-parallel replica instead (``adopt``). Otherwise the node's guard, if it has one.
        stranded, leavers = self.migrations.stranded_by(node.name)
        adopt = self.migrations.on_node_failed(node.name, reason) or self.guards.adopt(node)
        for name in leavers:  # they hold no rank any more and their last step failed with this node
            self._stonith(self.registry.nodes[name], signal)
        for name in stranded:  # decided joiners whose state cannot be completed: lost with this node
            other = self.registry.nodes[name]
            why = f"its joiners had not finished their state when {node.name} was lost"
            self.journal.record(Event.NODE_FAILED, node=name, reason=why, signal=signal, ranks=other.ranks,
                                silent_s=None)
            self._stonith(other, signal)
            self.incidents.lose(name, why)
        self.incidents.on_node_failed(node.name, reason, adopt)

    def recover_ranks(self, lost: dict[int, str], reason: str) -> None:
        self.incidents.lost.update(lost)
        self.incidents.start(reason)

    def _stonith(self, n: Node, signal: FailureSignal) -> None:
        """Fence a failed node's processes: whatever they send from now on is answered with a Release, and those
        that run on this host are killed (SIGKILL works on a stopped process too). A hung or cut-off process that came back could otherwise finish a collective it was in:
        gloo cannot cancel an op in flight, and the survivors' abandoned op would write into buffers they reuse.
        Remote processes cannot be reached: they are fenced by the Release they get when they call in."""
        for w in n.workers.values():
            w.fenced = True
            w.fenced_on_exit = signal == FailureSignal.PROCESS_EXIT
        killed = [w.pid for w in n.workers.values() if not w.exited and self.processes.kill(w)]
        if killed:
            self.journal.record(Event.NODE_FENCED, node=n.name, killed_pids=killed)

    def _replacing(self, node_name: str) -> bool:
        """Whether ``node_name`` is a standby taking over a failed node's ranks in the running recovery."""
        inc = self.incidents.current
        return inc is not None and node_name in inc.standbys.values()

    def request_migration(self, sources: Union[str, Sequence[str]], targets: Union[str, Sequence[str]], *,
                          require_healthy: bool = True) -> Migration:
        unmanaged = self.faults.unmanaged()
        if unmanaged:
            raise MigrationError(ErrorCode.UNMANAGED_STATE, f"refused: the joiners could not take the ranks over "
                                                            f"without diverging ({unmanaged})")
        return self.migrations.request(sources, targets, require_healthy=require_healthy)

    def migration(self, migration_id: int) -> Migration:
        return self.migrations.get(migration_id)

    def abort_migration(self, migration: Migration, reason: str) -> None:
        self.migrations.abort(migration, reason)

    @property
    def current_migration(self) -> Optional[Migration]:
        return self.migrations.current

    @property
    def current_incident(self) -> Optional[Incident]:
        return self.incidents.current

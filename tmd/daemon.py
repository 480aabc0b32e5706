"""tmd: the per-job coordinator. One ZeroMQ ROUTER serves the worker agents and tmctl (one protocol module).

Single-threaded by design: one loop receives messages, and between messages runs the ticks (health, the
local launcher's process exits, migration deadlines). All state lives in this thread, so nothing is locked.
tmd hosts the job's TCPStore, so the store outlives any rank, leavers included.

Assumption (as in torchft's lighthouse): tmd is a single point of coordination, not of training. If it dies the
ranks keep training; they just cannot migrate (or recover from a failure) until it is back: ``tmd resume``
restarts it on the same address, and it re-learns the job from the journal and the workers (tmd/resume.py).

Failure detection (defaults), cheapest signal first:
- a rank process exits (local mode: Popen poll each tick, ~50 ms) or turns zombie/stopped (psutil, for processes
  on tmd's host: a SIGSTOPped node is seen within a tick);
- a node is silent for ``suspect_after_s`` (0.8 s; heartbeats every 0.1 s) while a peer is blocked in a
  collective (its counters show a pending op older than ``blocked_after_s``, 0.3 s): hung or cut off;
- a node is silent for ``heartbeat_timeout_s`` (5 s) whatever its peers do.
A long step is not a failure: heartbeats come from a separate thread and peers wait only at the collective.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import time
from typing import Optional

import psutil
import zmq

from tmd import protocol as p
from tmd.health import GpuHealthPolicy, StragglerDetector
from tmd.journal import Journal
from tmd.local import LocalLauncher
from tmd.migration import MigrationError, Migrations
from tmd.recovery import Incidents, RecoveryError
from tmd.protocol.layout import RunDir
from tmd.registry import Node, Registry, Worker
from tmd.resume import JobState, Resumed

TICK_S = 0.05
RELEASE_GRACE_S = 30.0  # processes still running this long after the job finished are terminated


class Daemon:
    def __init__(
        self,
        job: str,
        run_dir: str,
        nodes: list[str],
        ranks_per_node: int,
        standbys: list[str],
        bind_host: str = "127.0.0.1",
        store_host: str = "127.0.0.1",
        port: int = 0,
        record_steps: int = 3,
        heartbeat_timeout_s: float = 5.0,
        echo: bool = True,
        suspect_after_s: float = 0.8,
        blocked_after_s: float = 0.3,
        migrate_stragglers: bool = False,
        advertise_host: Optional[str] = None,
        netns: Optional[dict] = None,
        command: Optional[list[str]] = None,
        resume: Optional[JobState] = None,
    ) -> None:
        """``record_steps``: steps whose collective outputs the active ranks record for joiners' replay (and
        the joiners' number of shadow iterations). ``heartbeat_timeout_s``: silence after which a node is
        failed whatever its peers do (seconds). ``suspect_after_s``: silence after which a node is failed if a
        peer has been blocked in a collective for ``blocked_after_s`` (seconds). ``migrate_stragglers``: move a
        node with a straggler rank to a warm standby (a planned migration). ``command``: the workers' command
        line in local mode (kept in tmd.json for ``tmd resume``). ``resume``: take over this running job (its
        journal goes on; the workers re-register) instead of starting one."""
        import torch.distributed as dist  # only tmd pays for torch: it hosts the job's store

        self.job = job
        self.run_dir = os.path.abspath(run_dir)
        os.makedirs(os.path.join(self.run_dir, "record"), exist_ok=True)
        self.record_steps = record_steps
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.suspect_after_s = suspect_after_s
        self.blocked_after_s = blocked_after_s
        self.migrate_stragglers = migrate_stragglers
        self.gpu_policy = GpuHealthPolicy()
        self._gpu_verdicts: dict[int, Optional[tuple[str, str]]] = {}
        self._processes: dict[int, psutil.Process] = {}  # pid -> handle, for processes on this host
        self._hostname = socket.gethostname()
        self.journal = Journal(os.path.join(self.run_dir, "events.jsonl"), echo=echo,
                               seq=resume.last_seq if resume else 0)
        self.registry = Registry(nodes, ranks_per_node, standbys)
        self.migrations = Migrations(self.registry, self.journal, self, record_steps=record_steps)
        self.incidents = Incidents(self.registry, self.journal, self, RunDir(self.run_dir))
        self.store = dist.TCPStore(store_host, 0, is_master=True, wait_for_workers=False)
        self.store_host = store_host
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted worker may reuse its identity
        self.sock.bind(f"tcp://{bind_host}:{port or '*'}")
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT).replace(
            "0.0.0.0", advertise_host or socket.gethostname())
        self.stragglers = StragglerDetector()
        self.launcher: Optional[LocalLauncher] = None
        # SLURM mode (tmd.slurm.SlurmCluster): ticked from the loop; resolves migrate targets; gets NodeNotices.
        self.cluster = None
        self.exit_code: Optional[int] = None
        self._released = False
        self._release_deadline = float("inf")
        info = {"address": self.address, "pid": os.getpid(), "job": job, "run_dir": self.run_dir, "netns": netns or {}}
        if command:
            info.update(command=command, cwd=os.getcwd())
        with open(os.path.join(self.run_dir, "tmd.json"), "w") as f:
            json.dump(info, f)
        self.resumed: Optional[Resumed] = None
        if resume is not None:
            self.resumed = Resumed(self, resume, rejoin_grace_s=max(10.0, 2 * heartbeat_timeout_s))
            self.resumed.start()
        else:
            self.journal.record("tmd_started", job=job, address=self.address, world_size=self.registry.world_size,
                                nodes=nodes, standbys=standbys, store_port=self.store.port, record_steps=record_steps)

    # ---------------------------------------------------------------------------------------------------------
    def run(self) -> int:
        """Serve until the job ends. Returns the job's exit code (0: every rank finished)."""
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)

        def stop(signum, frame) -> None:  # SIGTERM/SIGINT: end the loop so local-mode processes are terminated
            self.journal.record("tmd_signalled", signal=signal.Signals(signum).name)
            self.exit_code = 128 + signum

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, stop)
        try:
            while self.exit_code is None:
                try:
                    if poller.poll(int(TICK_S * 1000)):
                        while True:
                            try:
                                frames = self.sock.recv_multipart(zmq.NOBLOCK)
                            except zmq.Again:
                                break
                            self._on_frames(frames)
                    if self.exit_code is None:
                        self._tick()
                except RecoveryError as e:
                    self.journal.record("job_failed", reason=str(e))
                    self.exit_code = 1
        finally:
            if self.launcher:
                self.launcher.terminate_all()
            self.journal.record("tmd_stopped", exit_code=self.exit_code)
            self.journal.close()
            self.sock.close()
        return self.exit_code

    def _on_frames(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            self.journal.record("bad_message", error=f"expected 2 frames, got {len(frames)}")
            return
        identity, frame = frames
        try:
            msg = p.decode(frame)
        except p.ProtocolError as e:
            self.journal.record("bad_message", sender=identity.decode(errors="replace"), error=str(e))
            return
        handler = getattr(self, "_on_" + msg.TYPE, None)
        if handler is None:
            self.journal.record("bad_message", sender=identity.decode(errors="replace"),
                                error=f"{msg.TYPE} is not a request tmd serves")
            return
        try:
            handler(identity, msg)
        except MigrationError as e:
            self._reply(identity, p.ErrorReply(code=e.code, message=str(e)))

    def _reply(self, identity: bytes, msg: p.Message) -> None:
        self.sock.send_multipart([identity, p.encode(msg)])

    def send(self, worker: Worker, msg: p.Message) -> None:
        """WorkerChannel: queue ``msg`` for one worker process."""
        self._reply(worker.identity, msg)

    def _worker(self, identity: bytes, msg: p.Message) -> Optional[Worker]:
        w = self.registry.by_identity.get(identity)
        if w is None and self.resumed is not None:  # a worker this restarted tmd has not re-learned yet
            self.resumed.ask(identity)
            return None
        if w is None:
            self.journal.record("bad_message", sender=identity.decode(errors="replace"),
                                error=f"{msg.TYPE} from a process that never registered")
            return None
        if w.fenced:  # declared failed and replaced (e.g. SIGSTOPped, then continued): it must go away
            if not w.fence_sent:
                w.fence_sent = True
                self.journal.record("fenced", node=w.node, local_rank=w.local_rank, pid=w.pid, message=msg.TYPE)
            self.send(w, p.Release(reason=f"{w.node} was declared failed; its ranks are held by others now",
                                    exit_code=p.ExitCode.FENCED))
            return None
        w.last_heartbeat = time.monotonic()
        return w

    # --- worker messages ----------------------------------------------------------------------------------------
    def _on_Register(self, identity: bytes, msg: p.Register) -> None:
        w = Worker(identity, msg.node, msg.local_rank, msg.pid, msg.host)
        try:
            node = self.registry.add_worker(w)
        except (KeyError, ValueError) as e:
            reason = f"unknown node '{msg.node}'" if isinstance(e, KeyError) else str(e)
            self.journal.record("register_refused", node=msg.node, local_rank=msg.local_rank, reason=reason)
            self._reply(identity, p.Release(reason=reason, exit_code=2))
            return
        self.journal.record("worker_registered", node=msg.node, local_rank=msg.local_rank, pid=msg.pid,
                            rank=w.rank, role=node.role)
        if w.rank is not None:
            self.send(w, p.Assign(role="active", rank=w.rank, world_size=self.registry.world_size, store_host=self.store_host, store_port=self.store.port,
                                   generation=0, record_steps=self.record_steps, record_dir=os.path.join(self.run_dir, "record"), migration_id=0, incident_id=0))
        if node.role == "standby" and node.warm:
            self.journal.record("standby_warm", node=node.name)

    def _on_Rejoin(self, identity: bytes, msg: p.Rejoin) -> None:
        if self.resumed is None:
            self.journal.record("bad_message", sender=identity.decode(errors="replace"),
                                error="Rejoin, but this tmd did not restart")
            return
        self.resumed.on_rejoin(identity, msg)

    def assign(self, worker: Worker, rank: int, *, migration_id: int = 0, incident_id: int = 0) -> None:
        """WorkerChannel: give a standby process ``rank`` as a joiner (see :class:`tmd.channel.WorkerChannel`)."""
        self.send(worker, p.Assign(role=p.WorkerRole.JOINER, rank=rank, world_size=self.registry.world_size,
                                   store_host=self.store_host, store_port=self.store.port,
                                   generation=self.registry.generations.current, record_steps=self.record_steps,
                                   record_dir=RunDir(self.run_dir).record_dir, migration_id=migration_id,
                                   incident_id=incident_id))

    def _on_Heartbeat(self, identity: bytes, msg: p.Heartbeat) -> None:
        w = self._worker(identity, msg)
        if w:
            w.counters = msg.counters
            busy = msg.counters.get("busy_s")
            owner = w.rank is not None and self.registry.rank_owner.get(w.rank) is w
            if owner and isinstance(busy, (int, float)):
                self.stragglers.observe(w.rank, time.monotonic(), float(busy))
            gpu = msg.counters.get("gpu")
            if owner and isinstance(gpu, dict):
                self._check_gpu(w, gpu)

    def _check_gpu(self, w: Worker, sample: dict) -> None:
        """GPU health from the rank's pynvml probe: journal changes; an unhealthy GPU (critical XID, new
        uncorrected ECC errors, GPU lost) on a node that still runs is moved off by a planned migration."""
        verdict = self.gpu_policy.evaluate(w.rank, sample)
        if verdict == self._gpu_verdicts.get(w.rank):
            return
        self._gpu_verdicts[w.rank] = verdict
        node = self.registry.nodes[w.node]
        if verdict is None:
            self.journal.record("gpu_healthy", node=w.node, rank=w.rank)
            return
        level, reason = verdict
        self.journal.record("gpu_" + level, node=w.node, rank=w.rank, reason=reason)
        if level == "unhealthy":
            node.health, node.reason = "unhealthy", reason
            self._evacuate(node, reason)

    def _gpu_unhealthy(self, n: Node) -> bool:
        """Whether a rank of ``n`` has an unhealthy GPU verdict (heartbeats coming back do not clear it)."""
        return any((self._gpu_verdicts.get(r) or ("",))[0] == "unhealthy" for r in n.ranks)

    def _evacuate(self, node: Node, reason: str) -> None:
        """Move a live but failing node (bad GPU, straggler) to a warm standby, if one is free."""
        standby = next((n for n in self.registry.nodes.values() if n.role == "standby" and n.warm), None)
        if standby is None or self.migrations.current is not None or self.incidents.current is not None:
            self.journal.record("evacuation_skipped", node=node.name, reason=reason,
                                why="no warm standby" if standby is None else "a migration or recovery is running")
            return
        try:
            m = self.migrations.request(node.name, standby.name, require_healthy=False)
        except MigrationError as e:
            self.journal.record("evacuation_skipped", node=node.name, reason=reason, why=str(e))
            return
        self.journal.record("evacuation_started", node=node.name, standby=standby.name, migration_id=m.id,
                            reason=reason)

    def _on_RecoveryReport(self, identity: bytes, msg: p.RecoveryReport) -> None:
        w = self._worker(identity, msg)
        if w:
            self.incidents.on_report(w, msg)

    def _on_StepReport(self, identity: bytes, msg: p.StepReport) -> None:
        w = self._worker(identity, msg)
        if w is None:
            return
        w.step = msg.step + 1  # the step it is on now
        if msg.shadow:
            return
        w.step_time_s = msg.step_time_s
        if self.registry.rank_owner.get(msg.rank) is w:
            self.registry.record_step(msg.rank, msg.step, msg.step_time_s)
            self.migrations.on_step(msg.rank, msg.step)

    def _on_PhaseDone(self, identity: bytes, msg: p.PhaseDone) -> None:
        w = self._worker(identity, msg)
        if w is None:
            return
        m = self.migrations.current
        if m is not None and not msg.ok and msg.phase == "transferred":
            # A joiner's transfer broke: if its leaver is dead, that is a node failure (the warm joiners are kept
            # and get their state from a replica), not merely an aborted migration.
            source = self.registry.nodes[m.source]
            dead = next((f"{x.node}/{x.local_rank} (pid {x.pid}) {s}" for x in m.leavers.values()
                         if (s := self._liveness(x)) is not None), None)
            if dead is not None:
                self._fail_node(source, dead, "process_exit")
        self.migrations.on_phase(w, msg)

    def _on_Done(self, identity: bytes, msg: p.Done) -> None:
        w = self._worker(identity, msg)
        if w is None:
            return
        w.done = True
        self.journal.record("rank_left" if msg.left else "rank_done", node=w.node, local_rank=w.local_rank,
                            rank=msg.rank, final_step=msg.final_step)

    # --- tmctl requests -----------------------------------------------------------------------------------------
    def _on_StatusRequest(self, identity: bytes, msg: p.StatusRequest) -> None:
        now = time.monotonic()
        nodes = []
        for n in self.registry.nodes.values():
            workers = [w for w in n.workers.values() if not w.exited]
            ages = [now - w.last_heartbeat for w in workers]
            steps = [w.step for w in workers]
            times = [w.step_time_s for w in workers if w.step_time_s is not None]
            nodes.append({
                "name": n.name, "role": n.role, "ranks": n.ranks, "health": n.health, "reason": n.reason,
                "processes": len(workers), "expected_processes": n.expected_workers,
                "heartbeat_age_s": round(max(ages), 3) if ages else None,
                "step": max(steps) if steps else None,
                "step_time_s": round(max(times), 6) if times else None,
                "warm": n.warm,
                "stragglers": sorted(r for r in n.ranks if r in self.stragglers.flagged),
            })
        if self.cluster is not None:
            self.cluster.decorate(nodes)
        m = self.migrations.all[-1] if self.migrations.all else None
        inc = self.incidents.all[-1] if self.incidents.all else None
        self._reply(identity, p.StatusReply(job=self.job, world_size=self.registry.world_size, generation=self.registry.generations.current,
                                            step=self.registry.current_step(), nodes=nodes, migration=m.to_dict() if m else None,
                                            recovery=inc.to_dict() if inc else None))

    def _on_MigrateRequest(self, identity: bytes, msg: p.MigrateRequest) -> None:
        try:
            target = self.cluster.resolve_target(msg.target) if self.cluster is not None else msg.target
            inc = self.incidents.current
            if inc is not None:
                raise MigrationError("recovering", f"recovery {inc.id} from a failure is in progress "
                                                   f"({inc.state}); try again once it is done")
            m = self.migrations.request(msg.source, target)
        except MigrationError as e:
            self.journal.record("migrate_refused", source=msg.source, target=msg.target, code=e.code, reason=str(e))
            raise
        self._reply(identity, p.MigrationReply(migration=m.to_dict()))

    def _on_MigrationRequest(self, identity: bytes, msg: p.MigrationRequest) -> None:
        self._reply(identity, p.MigrationReply(migration=self.migrations.get(msg.migration_id).to_dict()))

    def _on_NodeNotice(self, identity: bytes, msg: p.NodeNotice) -> None:
        if self.cluster is not None:
            self.cluster.on_notice(msg)
        else:
            self.journal.record("node_notice", node=msg.node, slurm_job=msg.job_id, hook=msg.hook, detail=msg.detail)

    def _on_AddStandbyRequest(self, identity: bytes, msg: p.AddStandbyRequest) -> None:
        if self.launcher is None:
            raise MigrationError("not_supported", "tmd does not start processes in this mode: submit a standby job "
                                                  "(sbatch slurm/standby.sbatch) and it registers by itself")
        name = msg.node.strip()
        if not name or not name.replace("-", "").replace("_", "").isalnum():
            raise MigrationError("bad_request", f"bad node name {msg.node!r}: letters, digits, - and _ only")
        try:
            self.registry.add_node(name)
        except ValueError as e:
            raise MigrationError("bad_request", str(e)) from None
        self.journal.record("standby_added", node=name)
        self.launcher.start_node(name, standby=True)
        self._on_StatusRequest(identity, p.StatusRequest())

    def _on_EventsRequest(self, identity: bytes, msg: p.EventsRequest) -> None:
        self._reply(identity, p.EventsReply(events=self.journal.since(msg.after, msg.limit)))

    # --- ticks ----------------------------------------------------------------------------------------------------
    def _tick(self) -> None:
        now = time.monotonic()
        if self.launcher:
            self._check_processes()
        self._check_liveness()
        self._check_heartbeats(now)
        self.migrations.tick(now)
        self.incidents.tick(now)
        self._check_stragglers(now)
        if self.resumed is not None:
            self.resumed.tick(now)
        if self.cluster is not None:
            self.cluster.tick(now)
        self._check_finished()

    # --- failure detection --------------------------------------------------------------------------------------
    def _in_job(self, n: Node) -> bool:
        """Nodes whose loss is a failure of the job: active ones, and standbys taking over ranks."""
        return n.role == "active" or (n.role == "joining" and self._replacing(n))

    def _replacing(self, n: Node) -> bool:
        inc = self.incidents.current
        return inc is not None and n.name in inc.standbys.values()

    def _fail_node(self, n: Node, reason: str, signal: str) -> None:
        """Node ``n`` is lost (``signal``: process_exit, stopped, silent). Start (or restart) recovery."""
        if n.role == "failed":
            return
        self.journal.record("node_failed", node=n.name, reason=reason, signal=signal, ranks=n.ranks)
        for w in n.workers.values():
            w.fenced = True  # whatever it sends from now on is answered with a Release
        self._stonith(n)
        if n.role == "joining" and self._replacing(n):
            self.incidents.on_replacement_lost(n, reason)
            return
        m = self.migrations.current
        adopt = None
        if m is not None:
            if m.source == n.name and "prepare_started" in m.phases and m.state != "transferred":
                # The leaver died mid-migration: its joiners are warm for exactly these ranks; their state will
                # come from a data-parallel replica instead.
                self.migrations.abort(m, f"leaver {n.name} lost: {reason}", spare_joiners=True)
                adopt = (m.target, dict(m.joiners))
            else:
                self.migrations.abort(m, f"node {n.name} lost during {m.state}: {reason}")
        self.incidents.on_node_failed(n.name, reason, adopt)

    def _stonith(self, n: Node) -> None:
        """Fence a failed node's processes that run on this host by killing them (SIGKILL works on a stopped
        process too). A hung or cut-off process that came back could otherwise finish a collective it was in:
        gloo cannot cancel an op in flight, and the survivors' abandoned op would write into buffers they reuse.
        Remote processes cannot be reached: they are fenced by the Release they get when they call in."""
        killed = []
        for w in n.workers.values():
            proc = self._process(w)
            if proc is None or w.exited:
                continue
            try:
                proc.kill()
                killed.append(w.pid)
            except psutil.Error:
                pass
        if killed:
            self.journal.record("node_fenced", node=n.name, killed_pids=killed)

    def _check_processes(self) -> None:
        for proc in self.launcher.poll():
            node = self.registry.nodes[proc.node]
            w = node.workers.get(proc.local_rank)
            if w is not None:
                w.exited = True
            expected = w is not None and (w.done or w.fenced)
            self.journal.record("process_exit", node=proc.node, local_rank=proc.local_rank, returncode=proc.returncode,
                                expected=expected)
            if w is None or expected:
                continue
            why = f"{proc.node}/{proc.local_rank} exited with code {proc.returncode}"
            if self._in_job(node):
                self._fail_node(node, why, "process_exit")
                continue
            self.migrations.on_worker_lost(w, f"exited with code {proc.returncode}")
            if node.role == "standby" and not self._released:
                node.health = "unhealthy" if node.workers else node.health
                if not self.launcher.running(node.name):
                    node.workers.clear()
                    node.health = "unknown"
                    self.journal.record("standby_restarted", node=node.name)
                    self.launcher.start_node(node.name, standby=True)

    def _process(self, w: Worker) -> Optional[psutil.Process]:
        if w.host != self._hostname:
            return None
        proc = self._processes.get(w.pid)
        if proc is None:
            try:
                proc = self._processes[w.pid] = psutil.Process(w.pid)
            except psutil.Error:
                return None
        return proc

    def _liveness(self, w: Worker) -> Optional[str]:
        """"died" or "is stopped" for a process on this host that is, else None (fine, or not ours to see)."""
        proc = self._process(w)
        if proc is None:
            return None
        try:
            status = proc.status()
        except psutil.NoSuchProcess:
            return "died"
        except psutil.Error:
            return None
        if status in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
            return "died"
        return "is stopped" if status == psutil.STATUS_STOPPED else None

    def _check_liveness(self) -> None:
        """Processes on this host: a zombie or vanished one has died, a stopped one (SIGSTOP) hangs."""
        for n in list(self.registry.nodes.values()):
            if not self._in_job(n):
                continue
            for w in n.workers.values():
                if w.exited or w.done or w.fenced:
                    continue
                state = self._liveness(w)
                if state is not None:
                    self._fail_node(n, f"{w.node}/{w.local_rank} (pid {w.pid}) {state}",
                                    "stopped" if state == "is stopped" else "process_exit")
                    break

    def _peer_blocked_s(self, n: Node) -> float:
        """How long (seconds) a rank outside ``n`` has been blocked in a collective, from its last heartbeat."""
        now = time.time()
        worst = 0.0
        for w in self.registry.rank_owner.values():
            c = w.counters
            if w.node != n.name and c.get("pending", 0) > 0 and c.get("last_op_start_s", 0) > 0:
                worst = max(worst, now - float(c["last_op_start_s"]))
        return worst

    def _busy(self, n: Node, live: list[Worker], now: float) -> bool:
        """For a silent node whose processes run on this host: are they using CPU (alive, only slow to
        heartbeat) rather than blocked (hung, cut off)? The first call samples CPU time and says busy; a later
        call says busy if they used more than 0.05 s of CPU since. Remote processes: never busy."""
        total = 0.0
        for w in live:
            proc = self._process(w)
            if proc is None:
                return False
            try:
                t = proc.cpu_times()
            except psutil.Error:
                return False
            total += t.user + t.system
        if n.suspect_cpu is None:
            n.suspect_cpu = (now, total)
            return True
        since, cpu = n.suspect_cpu
        if total - cpu > 0.05:
            self.journal.record("node_slow", node=n.name, silent_s=round(now - since, 3),
                                cpu_s=round(total - cpu, 3), note="silent but computing: not failed")
            n.suspect_cpu = (now, total)
            return True
        return now - since < 0.1

    def _check_heartbeats(self, now: float) -> None:
        for n in list(self.registry.nodes.values()):
            if n.role in ("left", "failed"):
                continue
            live = [w for w in n.workers.values() if not w.exited and not w.done]
            silence = max((now - w.last_heartbeat for w in live), default=0.0)
            # Until all its ranks finished a first step (imports, lazy initialisation on a crowded machine can
            # starve the heartbeat thread), only the long timeout applies.
            started = all(w.step_time_s is not None for w in live)
            if self._in_job(n) and live and silence > (self.suspect_after_s if started else self.heartbeat_timeout_s):
                blocked = self._peer_blocked_s(n)
                if (blocked > self.blocked_after_s and not self._busy(n, live, now)) or \
                        silence > self.heartbeat_timeout_s:
                    self._fail_node(n, f"no heartbeat for {silence:.2f} s (peers blocked for {blocked:.2f} s)",
                                    "silent")
                    continue
            else:
                n.suspect_cpu = None
            silent = [w for w in live if now - w.last_heartbeat > self.heartbeat_timeout_s]
            if silent and n.health != "unhealthy":
                n.health, n.reason = "unhealthy", f"no heartbeat for {self.heartbeat_timeout_s:.1f} s"
                self.journal.record("node_unhealthy", node=n.name, reason=n.reason,
                                    processes=[f"{w.node}/{w.local_rank}" for w in silent])
                for w in silent:
                    self.migrations.on_worker_lost(w, n.reason)
            elif not silent and n.health == "unhealthy" and live and len(n.workers) == n.expected_workers \
                    and not any(w.exited for w in n.workers.values()) and not self._gpu_unhealthy(n):
                n.health, n.reason = "healthy", ""
                self.journal.record("node_healthy", node=n.name)

    def _check_stragglers(self, now: float) -> None:
        """Journal ranks that turn into stragglers or recover (tmctl status shows them per node); with
        ``migrate_stragglers``, move a straggler's node to a warm standby."""
        new, cleared = self.stragglers.evaluate(now)
        for rank, event in [(r, "straggler_detected") for r in new] + [(r, "straggler_cleared") for r in cleared]:
            w = self.registry.rank_owner.get(rank)
            self.journal.record(event, rank=rank, node=w.node if w else None,
                                lateness=round(self.stragglers.lateness.get(rank, 0.0), 3))
            if event == "straggler_detected" and self.migrate_stragglers and w is not None:
                self._evacuate(self.registry.nodes[w.node], f"rank {rank} is a straggler")

    def _check_finished(self) -> None:
        reg = self.registry
        if self.exit_code is not None or not reg.all_ranks_assigned():
            return
        if not all(w.done for w in reg.rank_owner.values()):
            return
        if not self._released:
            self._released = True
            self._release_deadline = time.monotonic() + RELEASE_GRACE_S
            self.journal.record("job_finished", step=reg.current_step())
            if self.migrations.current is not None:
                self.migrations.abort(self.migrations.current, "the job finished before the migration committed")
            for n in reg.nodes.values():
                if n.role in ("standby", "joining"):
                    for w in n.workers.values():
                        if not w.exited:
                            self.send(w, p.Release(reason="job finished", exit_code=0))
        if self.launcher is None or not self.launcher.running():
            self.exit_code = 0
        elif time.monotonic() > self._release_deadline:
            stuck = [f"{proc.node}/{proc.local_rank}" for proc in self.launcher.running()]
            self.journal.record("processes_terminated", processes=stuck, reason=f"still running {RELEASE_GRACE_S:.0f} s after the job finished")
            self.launcher.terminate_all()
            self.exit_code = 0

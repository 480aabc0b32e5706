"""The worker agent: a daemon thread holding one ZeroMQ DEALER to tmd.

It registers, sends a heartbeat every ``heartbeat_interval_s`` (0.1 s by default, so tmd can tell a hung node
within a second) and whatever the session queues
(step reports, phase reports), and hands every command from tmd to ``on_message`` on the agent thread
(worker.commands.Commands.on_message, which hands it to worker.control.Control). Only this
thread touches the DEALER; other threads queue messages through :meth:`send`, which wakes the loop at once over
an inproc socket (no polling delay on the switch path).

The DEALER is a CURVE client of the job (tmd.protocol.keys, from env ``TM_KEYS``): it authenticates with the
job's worker key and pins tmd's public key, so a process that binds tmd's address while tmd is down is never
heard. libzmq retries a connection by itself (every 100 ms) after it was refused or closed, a failed handshake
among them, but gives the endpoint up for good after a handshake this client itself failed (the peer's greeting
named another security mechanism, or the peer refused our credentials): only then does the agent connect again, after
RECONNECT_AFTER_HANDSHAKE_FAILURE_S, so the real tmd is reached once it is back (:class:`Reconnect` says why never
otherwise). Its ZeroMQ identity is ``<node>/<local_rank>/<16 random hex digits>``: unique per
process, so a restarted process never collides with its predecessor and no other connection can take the identity over.
"""
from __future__ import annotations

import itertools
import logging
import os
import queue
import secrets
import socket
import threading
import time
from typing import Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from tmd import protocol as p
from tmd.protocol.keys import KEYS_ENV, JobKeys, limit

log = logging.getLogger("worker.agent")
_ids = itertools.count()
RECONNECT_AFTER_HANDSHAKE_FAILURE_S = 1.0
# Handshake failures after which libzmq gives the endpoint up (a protocol error of this side; checked with libzmq
# 4.3.5). EVENT_HANDSHAKE_FAILED_NO_DETAIL (the peer closed the connection mid-handshake) is retried by libzmq itself.
_GIVEN_UP = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
_MONITORED = _GIVEN_UP | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED


class Reconnect:
    """When the agent connects again after a failed handshake (see the module docstring), from its socket's
    monitor events: only after a failure libzmq does not retry (``_GIVEN_UP``), and never once a handshake
    succeeded with no disconnect since. Connecting again while libzmq still retries, or over a live connection,
    leaves the DEALER two connections with one identity: tmd's ROUTER (no handover, on purpose) never reads the
    second one, and the DEALER sends every other message on it, so a Rejoin answering tmd's Reregister could be
    lost every time (seen after ``tmd resume``: n1/0 never re-registered and tmd failed n1 after its grace).
    Times are ``time.monotonic()`` seconds."""

    def __init__(self, after_s: float = RECONNECT_AFTER_HANDSHAKE_FAILURE_S) -> None:
        self.after_s = after_s
        self.connected = False  # a handshake succeeded and no disconnect came since
        self.at: float | None = None  # when to connect again, or None
        self.lost_at: float | None = time.monotonic()  # since when tmd has not been connected (None: it is)

    def on_event(self, event: int, now: float) -> bool:
        """One monitor event; returns True when it scheduled a reconnect (the caller says why)."""
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.connected, self.at, self.lost_at = True, None, None
        elif event == zmq.EVENT_DISCONNECTED:
            self.connected = False
            self.lost_at = now if self.lost_at is None else self.lost_at
        elif event & _GIVEN_UP and not self.connected and self.at is None:
            self.at = now + self.after_s
            return True
        return False

    def due(self, now: float) -> bool:
        """Whether to connect again now (then it is no longer scheduled)."""
        if self.at is None or now < self.at:
            return False
        self.at = None
        return True


class Agent:
    def __init__(self, address: str, node: str, local_rank: int, standby: bool,
                 on_message: Callable[[p.Message], None], heartbeat: Callable[[], p.Heartbeat],
                 heartbeat_interval_s: float = 0.1, iface: str = "", data_host: str = "") -> None:
        """``iface``, ``data_host``: the network interface and address this process's data plane uses (sent in
        Register and Rejoin; "" when unknown). Raises tmd.protocol.keys.KeysUnavailable when env ``TM_KEYS`` names keys this process cannot read
        (without ``TM_KEYS`` the socket is plain: tmd was started without authentication)."""
        self.address = address
        self.keys = JobKeys.load(os.environ[KEYS_ENV]) if os.environ.get(KEYS_ENV) else None
        self.identity = f"{node}/{local_rank}/{secrets.token_hex(8)}".encode()
        self.node = node
        self.local_rank = local_rank
        self.standby = standby
        self.iface, self.data_host = iface, data_host
        self._on_message = on_message
        self._heartbeat = heartbeat
        self.heartbeat_interval_s = heartbeat_interval_s
        self._ctx = zmq.Context.instance()
        self._wake_addr = f"inproc://agent-wake-{os.getpid()}-{next(_ids)}"
        self._wake_rx = self._ctx.socket(zmq.PULL)
        self._wake_rx.bind(self._wake_addr)
        self._wake_tx = self._ctx.socket(zmq.PUSH)
        self._wake_tx.connect(self._wake_addr)
        self._wake_lock = threading.Lock()
        self._outbox: "queue.Queue[p.Message]" = queue.Queue()
        self._stop = threading.Event()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="tm-agent")

    def start(self) -> "Agent":
        self._thread.start()
        return self

    def send(self, msg: p.Message) -> None:
        """Queue ``msg`` for tmd (thread safe, never blocks)."""
        self._outbox.put(msg)
        with self._wake_lock:
            self._wake_tx.send(b"", zmq.NOBLOCK)

    def rejoin(self, rank: int, role: p.WorkerRole, step: int, generation: int) -> None:
        """Tell a restarted tmd (it sent Reregister) what this process holds now (see :class:`p.Rejoin`)."""
        self.send(p.Rejoin(node=self.node, local_rank=self.local_rank, pid=os.getpid(), host=socket.gethostname(),
                           rank=rank, role=role, step=step, generation=generation, iface=self.iface,
                           data_host=self.data_host))

    def close(self, flush_timeout_s: float = 2.0) -> None:
        """Send what is queued (up to ``flush_timeout_s`` seconds), then stop the thread."""
        self._stop.set()
        with self._wake_lock:
            self._wake_tx.send(b"", zmq.NOBLOCK)
        self._stopped.wait(flush_timeout_s)

    def _run(self) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self.identity)
        sock.setsockopt(zmq.LINGER, 2000)
        if self.keys is not None:
            self.keys.connect_as(sock, p.Sender.WORKER)
        else:
            limit(sock)
        monitor = sock.get_monitor_socket(_MONITORED)
        sock.connect(self.address)
        self._send(sock, p.Register(node=self.node, local_rank=self.local_rank, pid=os.getpid(),
                                    host=socket.gethostname(), standby=self.standby, iface=self.iface,
                                    data_host=self.data_host))
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        next_beat = time.monotonic()
        reconnect = self._reconnect = Reconnect()
        try:
            while True:
                self._drain_outbox(sock)
                if self._stop.is_set():
                    break
                now = time.monotonic()
                if now >= next_beat:
                    try:
                        self._send(sock, self._heartbeat())
                    except Exception:  # a failing probe must not stop the agent: tmd sees the silence
                        log.exception("heartbeat failed")
                    next_beat = now + self.heartbeat_interval_s
                if reconnect.due(now):
                    try:
                        sock.disconnect(self.address)  # (libzmq gave the endpoint up, but may still list it)
                    except zmq.ZMQError:  # not listed any more: an exception here would end the agent
                        pass
                    sock.connect(self.address)
                wake = next_beat if reconnect.at is None else min(next_beat, reconnect.at)
                events = dict(poller.poll(max(0, int((wake - time.monotonic()) * 1000)) + 1))
                if monitor in events:
                    while monitor.poll(0):
                        event = recv_monitor_message(monitor)["event"]
                        if reconnect.on_event(event, time.monotonic()):
                            log.warning("handshake with %s failed (not this job's tmd?): connecting again in %g s",
                                        self.address, reconnect.after_s)
                if self._wake_rx in events:
                    while self._wake_rx.poll(0):
                        self._wake_rx.recv()
                if sock in events:
                    while sock.poll(0):
                        frame = sock.recv()
                        try:
                            msg = p.decode(frame)
                        except p.ProtocolError as e:
                            log.warning("ignoring malformed message from tmd: %s", e)
                            continue
                        try:
                            self._on_message(msg)
                        except Exception:  # a handler bug must not kill heartbeats
                            log.exception("error handling %s", msg.TYPE)
        finally:
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close()
            self._stopped.set()

    def unreachable_s(self) -> float:
        """Seconds since this process was last connected to tmd (its start, if never; 0 while connected)."""
        reconnect = getattr(self, "_reconnect", None)
        lost_at = reconnect.lost_at if reconnect is not None else None
        return 0.0 if lost_at is None else time.monotonic() - lost_at

    @staticmethod
    def _send(sock: zmq.Socket, msg: p.Message) -> None:
        """Send without blocking: while tmd is unreachable for long (its queue is full) the message is dropped; a
        restarted tmd re-learns the job from a Rejoin instead (tmd.resume)."""
        try:
            sock.send(p.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            log.debug("tmd unreachable: %s dropped", msg.TYPE)

    def _drain_outbox(self, sock: zmq.Socket) -> None:
        while True:
            try:
                msg = self._outbox.get_nowait()
            except queue.Empty:
                return
            self._send(sock, msg)

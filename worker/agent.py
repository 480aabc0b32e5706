"""The worker agent: a daemon thread holding one ZeroMQ DEALER to tmd.

It registers, sends a heartbeat every ``heartbeat_interval_s`` (0.1 s by default, so tmd can tell a hung node
within a second) and whatever the session queues
(step reports, phase reports), and hands every command from tmd to ``on_message`` on the agent thread
(worker.commands.Commands.on_message, which hands it to worker.control.Control). Only this
thread touches the DEALER; other threads queue messages through :meth:`send`, which wakes the loop at once over
an inproc socket (no polling delay on the switch path).
"""
from __future__ import annotations

import itertools
import logging
import os
import queue
import socket
import threading
import time
from typing import Callable

import zmq

from tmd import protocol as p

log = logging.getLogger("worker.agent")
_ids = itertools.count()


class Agent:
    def __init__(self, address: str, node: str, local_rank: int, standby: bool,
                 on_message: Callable[[p.Message], None], heartbeat: Callable[[], p.Heartbeat],
                 heartbeat_interval_s: float = 0.1) -> None:
        self.address = address
        self.node = node
        self.local_rank = local_rank
        self.standby = standby
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
                           rank=rank, role=role, step=step, generation=generation))

    def close(self, flush_timeout_s: float = 2.0) -> None:
        """Send what is queued (up to ``flush_timeout_s`` seconds), then stop the thread."""
        self._stop.set()
        with self._wake_lock:
            self._wake_tx.send(b"", zmq.NOBLOCK)
        self._stopped.wait(flush_timeout_s)

    def _run(self) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, f"{self.node}/{self.local_rank}".encode())
        sock.setsockopt(zmq.LINGER, 2000)
        sock.connect(self.address)
        sock.send(p.encode(p.Register(node=self.node, local_rank=self.local_rank, pid=os.getpid(),
                                      host=socket.gethostname(), standby=self.standby)))
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        next_beat = time.monotonic()
        try:
            while True:
                self._drain_outbox(sock)
                if self._stop.is_set():
                    break
                now = time.monotonic()
                if now >= next_beat:
                    try:
                        sock.send(p.encode(self._heartbeat()))
                    except Exception:  # a failing probe must not stop the agent: tmd sees the silence
                        log.exception("heartbeat failed")
                    next_beat = now + self.heartbeat_interval_s
                events = dict(poller.poll(max(0, int((next_beat - time.monotonic()) * 1000)) + 1))
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
            sock.close()
            self._stopped.set()

    def _drain_outbox(self, sock: zmq.Socket) -> None:
        while True:
            try:
                msg = self._outbox.get_nowait()
            except queue.Empty:
                return
            sock.send(p.encode(msg))

"""A rank's client of the job's rendezvous store (tmd.store): a c10d ``Store`` over ZeroMQ CURVE.

:class:`JobStore` subclasses ``torch.distributed.Store`` (c10d calls a Python subclass through its trampoline), so
gloo, NCCL, ``PrefixStore`` and ``init_process_group`` use it as they would a TCPStore. It authenticates with the
job's worker key and pins tmd's public key (env ``TM_KEYS``, worker.job_keys), so it talks only to the job's own
store, and nobody without the keys can talk to that store at all. The wire format and the store's bounds are in
tmd.protocol.store; a request the store refuses raises ``torch.distributed.DistStoreError`` with its one-line
reason, as does a blocking ``get``/``wait`` that runs out of time.

**One connection per thread.** Each thread that uses a JobStore gets a DEALER socket of its own (ZeroMQ sockets
belong to one thread), so a group setup blocked in a ``get`` of a key that never comes (a peer died before
publishing its address) holds only its own thread: a prepare stuck on a lost leaver cannot stall the recovery
that follows it on another thread. A thread c10d runs without Python's knowledge (a C++ watchdog) shares one
socket under a lock.

**Few round trips.** A gloo setup sets this rank's key, then reads every peer's (``wait`` then ``get``, peer by
peer, all under one parent): two round trips per peer over a TCPStore. Here:

- the store answers a ``get``/``wait`` with the keys asked for and the ones that follow them under the same parent
  (tmd.protocol.store); the thread keeps them and answers its next ``get``/``wait`` of those keys itself, until
  it writes anything or a read misses. The values at hand are those of the last answer: right for keys set once,
  as every rendezvous key of gloo and NCCL is; a counter (``add``) is never read from them;
- a ``set`` is pipelined: sent without waiting for its answer, which the thread reads with its next request's (the
  store answers a connection's requests in order, so the next request sees the key set); a refused ``set``
  raises there. A C++ thread's ``set`` waits for its answer.

So a gloo setup costs a few round trips instead of ``2 * world + 1`` (benchmarks/rendezvous.py compares it with a
TCPStore).
"""
from __future__ import annotations

import datetime
import itertools
import os
import threading
from typing import Optional

import torch.distributed as dist
import zmq

from tmd.protocol import store as ps
from tmd.protocol.keys import KEYS_ENV, JobKeys, limit
from tmd.protocol.vocab import Sender

SLACK_S = 5.0  # a blocking request waits this much longer (seconds) than its timeout for the server's answer
LINGER_MS = 1000  # how long a closed socket still tries to deliver what it queued (a release's ``done``)


class _Connection:
    """One thread's DEALER to the store, its reads at hand (key -> value) and the ids of its requests sent without
    waiting (id -> op: a pipelined ``set``, a ``done``)."""

    def __init__(self, sock: zmq.Socket) -> None:
        self.sock = sock
        self.seen: dict[bytes, bytes] = {}
        self.unanswered: dict[bytes, bytes] = {}
        self.lock = threading.Lock()  # (taken only by the threads that share the C++ threads' connection)


class JobStore(dist.Store):
    """The job's store at ``tcp://host:port``. ``timeout_s``: c10d's store timeout (seconds): how long a
    ``get``/``wait`` waits for its keys, and any request for an answer. ``keys``: the job's keys, with the
    worker's secret key (None: a plain socket, for ``tmd local --no-auth``). Raises
    tmd.protocol.keys.KeysUnavailable when ``keys`` holds no worker secret key. :meth:`of_job`: with the keys
    of env ``TM_KEYS``."""

    @classmethod
    def of_job(cls, host: str, port: int, timeout_s: float = 300.0) -> "JobStore":
        """The store at ``host:port`` with the keys named by env ``TM_KEYS`` (what tmd hands every process it
        starts), or plain without it. Raises KeysUnavailable when they cannot be read."""
        path = os.environ.get(KEYS_ENV)
        return cls(host, port, timeout_s, JobKeys.load(path, parties=(Sender.WORKER,)) if path else None)

    def __init__(self, host: str, port: int, timeout_s: float, keys: Optional[JobKeys]) -> None:
        super().__init__()
        self.set_timeout(datetime.timedelta(seconds=timeout_s))
        self.host, self.port = host, port
        self._endpoint = f"tcp://{'[' + host + ']' if ':' in host else host}:{port}"
        if keys is not None:  # no worker secret key: fail now, not in a group setup
            probe = zmq.Context.instance().socket(zmq.DEALER)
            try:
                keys.connect_as(probe, Sender.WORKER)
            finally:
                probe.close(linger=0)
        self._keys = keys
        self._local = threading.local()
        self._shared: Optional[_Connection] = None  # for the threads Python did not start
        self._shared_lock = threading.Lock()
        self._ids = itertools.count(1)

    # --- the connection -----------------------------------------------------------------------------------------
    def _connection(self) -> _Connection:
        """This thread's connection (made on first use), or the one the C++ threads share."""
        if isinstance(threading.current_thread(), threading._DummyThread):
            with self._shared_lock:
                if self._shared is None:
                    self._shared = _Connection(self._socket())
                return self._shared
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = _Connection(self._socket())
        return conn

    def _socket(self) -> zmq.Socket:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, LINGER_MS)
        if self._keys is not None:
            self._keys.connect_as(sock, Sender.WORKER)
        limit(sock, ps.MAX_FRAME_BYTES)
        sock.connect(self._endpoint)
        return sock

    def _request(self, op: bytes, *args: bytes, timeout: Optional[datetime.timedelta] = None,
                 answer: bool = True) -> list[bytes]:
        """Send ``op`` and return its answer's frames (``answer`` false: do not wait for it). Raises DistStoreError
        when the store refuses it (or a ``set`` sent before it) or does not answer within the timeout
        (+ SLACK_S)."""
        conn = self._connection()
        with conn.lock:
            if op not in (ps.GET, ps.WAIT, ps.CHECK, ps.NUM_KEYS):
                conn.seen = {}  # it writes: what it read may change
            return self._exchange(conn, op, args, (timeout or self.timeout).total_seconds(), answer)

    def _exchange(self, conn: _Connection, op: bytes, args, timeout_s: float, answer: bool) -> list[bytes]:
        request_id = next(self._ids).to_bytes(8, "little")
        conn.sock.send_multipart([request_id, op, str(int(timeout_s * 1000)).encode(), *args])
        if not answer:
            conn.unanswered[request_id] = op
            return []
        poll_ms = int((timeout_s + SLACK_S) * 1000)
        while conn.sock.poll(poll_ms):
            reply = conn.sock.recv_multipart()
            status, frames = (reply[1], reply[2:]) if len(reply) >= 2 else (ps.ERR, [b"a malformed answer"])
            if reply[0] == request_id:
                if status == ps.OK:
                    return frames
                raise dist.DistStoreError(_reason(frames))
            if conn.unanswered.pop(reply[0], None) == ps.SET and status != ps.OK:
                raise dist.DistStoreError(f"an earlier set was refused: {_reason(frames)}")
            # else: a done's answer, or the late answer to a request that gave up waiting
        raise dist.DistStoreError(f"the job's store at {self._endpoint} did not answer a {op.decode()} within "
                                  f"{timeout_s + SLACK_S:.0f} s")

    def _read(self, op: bytes, keys: list[str], timeout: Optional[datetime.timedelta] = None) -> dict[bytes, bytes]:
        """The values of ``keys`` (a get/wait: blocking until all exist), from this thread's reads at hand when
        it has them all, else from the store, whose answer replaces them."""
        wanted = [k.encode() for k in keys]
        conn = self._connection()
        with conn.lock:
            if not all(k in conn.seen for k in wanted):
                pairs = self._exchange(conn, op, wanted, (timeout or self.timeout).total_seconds(), True)
                conn.seen = dict(zip(pairs[::2], pairs[1::2]))
            return conn.seen

    # --- c10d's Store ---------------------------------------------------------------------------------------------
    def set(self, key: str, value) -> None:
        pipelined = not isinstance(threading.current_thread(), threading._DummyThread)
        self._request(ps.SET, key.encode(), _value(value), answer=not pipelined)

    def get(self, key: str) -> bytes:
        return self._read(ps.GET, [key])[key.encode()]

    def add(self, key: str, value: int) -> int:
        return int(self._request(ps.ADD, key.encode(), str(int(value)).encode())[0])

    def compare_set(self, key: str, expected_value, desired_value) -> bytes:
        return self._request(ps.CAS, key.encode(), _value(expected_value), _value(desired_value))[0]

    def check(self, keys: list[str]) -> bool:
        return self._request(ps.CHECK, *(k.encode() for k in keys))[0] == b"1"

    def wait(self, keys: list[str], timeout: Optional[datetime.timedelta] = None) -> None:
        self._read(ps.WAIT, keys, timeout)

    def delete_key(self, key: str) -> bool:
        return self._request(ps.DELETE, key.encode())[0] == b"1"

    def num_keys(self) -> int:
        return int(self._request(ps.NUM_KEYS)[0])

    def clone(self) -> "JobStore":
        return JobStore(self.host, self.port, self.timeout.total_seconds(), self._keys)

    # --- the job's own ------------------------------------------------------------------------------------------
    def release(self, prefix: str, members: int, wait: bool = False) -> None:
        """This member of the group set up under ``prefix`` (the full store prefix: namespace included) will not
        use its setup keys again; the store drops them once all ``members`` said so. Does not wait for the
        store's answer unless ``wait``: a group is released where nothing may block (a switch step). Raises
        DistStoreError (``wait`` only) when the store refuses it or does not answer."""
        self._request(ps.DONE, prefix.encode(), str(members).encode(), answer=wait)


def _reason(frames: list[bytes]) -> str:
    return frames[0].decode(errors="replace") if frames else "refused by the store"


def _value(value) -> bytes:
    """``value`` as bytes. Raises DistStoreError over the store's value bound (the store would disconnect a
    frame that large before reading it; this says why)."""
    data = value.encode() if isinstance(value, str) else bytes(value)
    if len(data) > ps.MAX_VALUE_BYTES:
        raise dist.DistStoreError(f"a store value may hold at most {ps.MAX_VALUE_BYTES} bytes, not {len(data)}")
    return data

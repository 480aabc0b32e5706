"""The job's rendezvous store, served by tmd over ZeroMQ CURVE on one address of this host.

Every process group of the job (the world group, each generation, the script's groups, transfer and snapshot
groups) sets up through this store (worker.store.JobStore on the ranks). It replaces c10d's TCPStore, which has no
authentication: any local user could connect to it, count its keys, set and delete keys, and fill tmd's memory.
Here:

- The server's ROUTER is a CURVE server with tmd's coordinator key pair and a ZAP handler of its own that admits
  only the job's worker key (tmd.protocol.keys.Authenticator with ``roles=(worker,)``): a stranger, tmctl's or
  the hook's key never completes the handshake and is never read.
- Sizes are bounded (tmd.protocol.store): a frame over the limit disconnects its sender before it is read; a key,
  a value, the number of keys, the bytes held and the blocked requests are capped, and a request over a cap is
  refused with a one-line error and changes nothing.
- It runs on a thread of its own with a ZeroMQ context of its own, so tmd's loop never waits for it, nor it for
  tmd's loop; it binds ``host`` only (TM_HOST: the job's interface), never all interfaces.

The store lives in tmd and outlives every rank, leavers included; a restarted tmd (tmd resume) serves a new one
and tells the ranks where (tmd.protocol.Reregister). Without keys (``tmd local --no-auth``, only to measure CURVE's
cost) the socket is plain ZeroMQ: anyone on the host can use it.
"""
from __future__ import annotations

import bisect
import heapq
import itertools
import logging
import threading
import time
from typing import Optional

import zmq

from tmd.protocol import store as ps
from tmd.protocol.keys import Authenticator, JobKeys, limit
from tmd.protocol.vocab import Sender

log = logging.getLogger("tmd.store")


class StoreError(Exception):
    """A request the store refuses; the message (one line) goes back to the client."""


class _Waiter:
    """A blocked get/wait: who asked, what for, until when (``time.monotonic()`` seconds)."""

    __slots__ = ("identity", "request_id", "op", "keys", "deadline", "answered")

    def __init__(self, identity: bytes, request_id: bytes, op: bytes, keys: list[bytes], deadline: float) -> None:
        self.identity, self.request_id, self.op, self.keys, self.deadline = identity, request_id, op, keys, deadline
        self.answered = False


class StoreState:
    """The store's keys and its bounds, without the socket (what :class:`StoreServer` serves; unit-testable).

    ``max_*``: the bounds of tmd.protocol.store (keys and values in bytes)."""

    def __init__(self, max_keys: int = ps.MAX_KEYS, max_value_bytes: int = ps.MAX_VALUE_BYTES,
                 max_stored_bytes: int = ps.MAX_STORED_BYTES, max_waiters: int = ps.MAX_WAITERS) -> None:
        self.max_keys, self.max_value_bytes = max_keys, max_value_bytes
        self.max_stored_bytes, self.max_waiters = max_stored_bytes, max_waiters
        self.data: dict[bytes, bytes] = {}
        self.stored_bytes = 0  # keys and values held
        self.children: dict[bytes, list[bytes]] = {}  # parent (the key up to its last '/') -> its keys, sorted
        self.done: dict[bytes, int] = {}  # setup prefix -> members that released it (counted as keys)
        self.waiting: dict[bytes, list[_Waiter]] = {}  # missing key -> waiters for it
        self.waiters = 0
        self._expiry: list[tuple[float, int, _Waiter]] = []  # heap by deadline
        self._order = itertools.count()

    # --- writes ---------------------------------------------------------------------------------------------------
    def _key(self, key: bytes) -> bytes:
        if not key or len(key) > ps.MAX_KEY_BYTES:
            raise StoreError(f"a store key must be 1 to {ps.MAX_KEY_BYTES} bytes, not {len(key)}")
        return key

    def put(self, key: bytes, value: bytes) -> list[_Waiter]:
        """Set ``key`` to ``value``. Returns the waiters it completes. Raises StoreError over a bound."""
        self._key(key)
        if len(value) > self.max_value_bytes:
            raise StoreError(f"a store value may hold at most {self.max_value_bytes} bytes, not {len(value)} "
                             f"(key {key[-64:]!r})")
        old = self.data.get(key)
        if old is None and len(self.data) + len(self.done) >= self.max_keys:
            raise StoreError(f"the store holds its maximum of {self.max_keys} keys: refused {key[-64:]!r}")
        grown = len(value) - (len(old) if old is not None else -len(key))
        if self.stored_bytes + grown > self.max_stored_bytes:
            raise StoreError(f"the store holds its maximum of {self.max_stored_bytes} bytes: refused "
                             f"{key[-64:]!r}")
        if old is None:
            bisect.insort(self.children.setdefault(_parent(key), []), key)
        self.data[key] = value
        self.stored_bytes += grown
        return self._arrived(key)

    def add(self, key: bytes, delta: bytes) -> tuple[bytes, list[_Waiter]]:
        """Add the integer ``delta`` (ASCII) to ``key`` (missing: 0). Returns the new value and the waiters it
        completes. Raises StoreError when either is not a 64-bit integer."""
        try:
            value = int(self.data.get(self._key(key), b"0")) + int(delta)
        except ValueError:
            raise StoreError(f"add: {key[-64:]!r} or the delta is not an integer") from None
        if not -2**63 <= value < 2**63:
            raise StoreError(f"add: {key[-64:]!r} would leave the 64-bit range")
        new = str(value).encode()
        return new, self.put(key, new)

    def compare_set(self, key: bytes, expected: bytes, desired: bytes) -> tuple[bytes, list[_Waiter]]:
        """c10d's compare_set: set ``desired`` when ``key`` holds ``expected`` (or is missing and ``expected`` is
        empty). Returns the value now held (``expected`` for a missing key left missing) and completed waiters."""
        current = self.data.get(self._key(key))
        if (current is None and expected == b"") or (current is not None and current == expected):
            return desired, self.put(key, desired)
        return (current if current is not None else expected), []

    def delete(self, key: bytes) -> bool:
        old = self.data.pop(key, None)
        if old is None:
            return False
        self.stored_bytes -= len(key) + len(old)
        siblings = self.children[_parent(key)]
        del siblings[bisect.bisect_left(siblings, key)]
        if not siblings:
            del self.children[_parent(key)]
        return True

    def release(self, prefix: bytes, members: bytes) -> None:
        """One member of the setup under ``prefix`` released it; the last of ``members`` drops its keys."""
        try:
            count = int(members)
        except ValueError:
            raise StoreError("done: the member count is not an integer") from None
        self._key(prefix)
        if prefix not in self.done and len(self.data) + len(self.done) >= self.max_keys:
            raise StoreError(f"the store holds its maximum of {self.max_keys} keys: refused done {prefix[-64:]!r}")
        self.done[prefix] = self.done.get(prefix, 0) + 1
        if self.done[prefix] >= count:
            del self.done[prefix]
            below = prefix + b"/"
            for parent in [p for p in self.children if p == prefix or p.startswith(below)]:
                for key in list(self.children.get(parent, ())):
                    self.delete(key)

    # --- blocking reads -------------------------------------------------------------------------------------------
    def block(self, identity: bytes, request_id: bytes, op: bytes, keys: list[bytes], timeout_ms: int,
              now: float) -> Optional[_Waiter]:
        """A get/wait for ``keys``: None when they all exist (answer now), else the waiter registered until
        ``timeout_ms`` from ``now``. Raises StoreError when :attr:`max_waiters` requests are blocked already."""
        missing = [k for k in keys if self._key(k) not in self.data]
        if not missing:
            return None
        if self.waiters >= self.max_waiters:
            raise StoreError(f"{self.max_waiters} store requests are blocked already: refused")
        w = _Waiter(identity, request_id, op, keys, now + timeout_ms / 1000.0)
        for k in missing:
            self.waiting.setdefault(k, []).append(w)
        self.waiters += 1
        heapq.heappush(self._expiry, (w.deadline, next(self._order), w))
        return w

    def _arrived(self, key: bytes) -> list[_Waiter]:
        done = []
        for w in self.waiting.pop(key, ()):
            if not w.answered and all(k in self.data for k in w.keys):
                w.answered = True
                self.waiters -= 1
                done.append(w)
        return done

    def expired(self, now: float) -> list[_Waiter]:
        """The waiters whose deadline passed (each once), unregistered."""
        out = []
        while self._expiry and self._expiry[0][0] <= now:
            w = heapq.heappop(self._expiry)[2]
            if not w.answered:
                w.answered = True
                self.waiters -= 1
                for k in w.keys:
                    if k in self.waiting:
                        self.waiting[k] = [x for x in self.waiting[k] if x is not w]
                        if not self.waiting[k]:
                            del self.waiting[k]
                out.append(w)
        return out

    def read(self, keys: list[bytes]) -> list[bytes]:
        """The answer to a get/wait of ``keys`` (all present): key, value pairs, flat: each of ``keys``, then the
        keys that follow the first one under its parent (in byte order), while the pairs hold at most
        PREFETCH_BYTES (the first key's always). A rank setting up a group reads its peers' keys one after
        another; with them at hand its client answers the next reads itself (worker.store)."""
        out: list[bytes] = []
        budget = ps.PREFETCH_BYTES
        siblings = self.children.get(_parent(keys[0]), [])
        start = bisect.bisect_right(siblings, keys[0])
        for key in itertools.chain(dict.fromkeys(keys), itertools.islice(siblings, start, None)):
            value = self.data[key]
            if out and len(key) + len(value) > budget:
                break
            out += (key, value)
            budget -= len(key) + len(value)
        return out

    def next_deadline(self) -> Optional[float]:
        while self._expiry and self._expiry[0][2].answered:
            heapq.heappop(self._expiry)
        return self._expiry[0][0] if self._expiry else None


class StoreServer:
    """The job's store on ``tcp://host:port`` (``port`` 0: a free one; :attr:`port` says which), served on a
    thread of its own. ``keys``: the job's keys (CURVE, only the worker key admitted), or None for a plain socket.
    Raises zmq.ZMQError when ``host`` is not an address of this host or the port is taken."""

    POLL_S = 0.2  # how often (seconds) the thread looks at the stop flag when nothing happens

    def __init__(self, host: str, keys: Optional[JobKeys], port: int = 0, state: Optional[StoreState] = None) -> None:
        self.state = state or StoreState()
        self.refused = 0  # requests refused (over a bound, malformed)
        self.served = 0  # requests answered (refusals and timeouts included)
        self._ctx = zmq.Context()  # its own: ZAP is per context, and this one admits workers only
        self._auth: Optional[Authenticator] = None
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            if keys is not None:
                self._auth = Authenticator(self._ctx, keys, roles=(Sender.WORKER,))
                self._auth.start()
                keys.serve(self._sock)
            limit(self._sock, ps.MAX_FRAME_BYTES)
            self._sock.bind(f"tcp://{host}:{port or '*'}")
        except BaseException:
            self._close()
            raise
        self._keys = keys
        self.host = host
        self.port = int(self._sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True, name="tm-store")
        self._thread.start()

    def stop(self) -> None:
        """Stop serving and close the socket (blocked clients time out on their side)."""
        self._stop.set()
        self._thread.join(timeout=5.0)

    def _close(self) -> None:
        self._sock.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()

    # --- the thread -------------------------------------------------------------------------------------------------
    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                deadline = self.state.next_deadline()
                wait_s = self.POLL_S if deadline is None else min(self.POLL_S, max(0.0, deadline - time.monotonic()))
                if poller.poll(int(wait_s * 1000) + 1):
                    while True:
                        try:
                            frames = self._sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._handle(frames)
                for w in self.state.expired(time.monotonic()):
                    self._reply(w.identity, w.request_id, ps.ERR,
                                f"store {w.op.decode()} timed out waiting for {_names(w.keys)}".encode())
        finally:
            self._close()

    def _reply(self, identity: bytes, request_id: bytes, status: bytes, *frames: bytes) -> None:
        self.served += 1
        try:
            self._sock.send_multipart([identity, request_id, status, *frames], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the client is gone (or its queue full): it times out on its side

    def _handle(self, frames: list[bytes]) -> None:
        """One request (ZAP admitted its sender: the worker key, or anyone on a plain socket)."""
        identity = frames[0]
        if len(frames) < 3:  # no request id and op: nothing to answer to
            self.refused += 1
            return
        request_id, op = frames[1], frames[2]
        try:
            args = frames[4:]
            if len(args) > ps.MAX_FRAMES - 3:
                raise StoreError(f"a store request may name at most {ps.MAX_FRAMES - 3} keys, not {len(args)}")
            try:
                timeout_ms = int(frames[3])
            except (IndexError, ValueError):
                raise StoreError(f"store {op[:16]!r}: its timeout (ms) is missing or not an integer") from None
            if not 0 <= timeout_ms <= ps.MAX_TIMEOUT_MS:
                raise StoreError(f"store {op[:16]!r}: its timeout must be 0 to {ps.MAX_TIMEOUT_MS} ms, not "
                                 f"{timeout_ms}")
            least, most = ps.ARITY.get(op, (-1, -1))
            if not least <= len(args) <= most:
                raise StoreError(f"malformed store request {op[:16]!r} with {len(args)} arguments")
            self._do(identity, request_id, op, timeout_ms, args)
        except (StoreError, ValueError) as e:
            self.refused += 1
            self._reply(identity, request_id, ps.ERR, str(e).encode()[:1024])

    def _do(self, identity: bytes, request_id: bytes, op: bytes, timeout_ms: int, args: list[bytes]) -> None:
        st = self.state
        woken: list[_Waiter] = []
        result: list[bytes] = []
        if op == ps.SET:
            woken = st.put(args[0], args[1])
        elif op == ps.ADD:
            value, woken = st.add(args[0], args[1])
            result = [value]
        elif op == ps.CAS:
            value, woken = st.compare_set(*args)
            result = [value]
        elif op in (ps.GET, ps.WAIT):
            if st.block(identity, request_id, op, args, timeout_ms, time.monotonic()) is not None:
                return  # answered when the keys arrive or the time is up
            result = st.read(args)
        elif op == ps.CHECK:
            result = [b"1" if all(st._key(k) in st.data for k in args) else b"0"]
        elif op == ps.DELETE:
            result = [b"1" if st.delete(st._key(args[0])) else b"0"]  # an empty key is refused, as by done
        elif op == ps.NUM_KEYS:
            result = [str(len(st.data)).encode()]
        elif op == ps.DONE:
            st.release(args[0], args[1])
        self._reply(identity, request_id, ps.OK, *result)
        for w in woken:
            self._reply(w.identity, w.request_id, ps.OK, *st.read(w.keys))


def _parent(key: bytes) -> bytes:
    return key.rpartition(b"/")[0]


def _names(keys: list[bytes]) -> str:
    shown = ", ".join(k[-48:].decode(errors="replace") for k in keys[:4])
    return shown + (f" and {len(keys) - 4} more" if len(keys) > 4 else "")

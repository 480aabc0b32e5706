"""How tmctl finds the coordinator (tmd) and asks it one question at a time.

:func:`find_coordinator` turns the CLI's options and the environment into a ZeroMQ address and :func:`find_keys`
into the job's key directory; :class:`Client` sends one :mod:`tmd.protocol` message over a DEALER socket,
authenticated with the job's client key (CURVE, tmd.protocol.keys), and waits (seconds, bounded) for the reply.
When none comes it says which of these happened (each a :class:`CoordinatorUnreachable`): the address is invalid,
the connection was refused (nothing listens: the job ended or tmd died), authentication failed (not this job's
keys, or not this job's tmd), or tmd accepted the connection but did not answer in time.
"""
from __future__ import annotations

import json
import os
import secrets
import socket
from typing import Optional
from urllib.parse import urlsplit

import zmq
from zmq.utils.monitor import recv_monitor_message

from tmd.protocol import Message, Sender, decode, encode, layout
from tmd.protocol.keys import KEYS_ENV, JobKeys, KeysUnavailable

DEFAULT_RUN_DIR = "./tmrun"
_HANDSHAKE_FAILED = {zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                     zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL}


class TmctlError(Exception):
    """Base of the errors tmctl reports as one line (``error: <message>``)."""


class CoordinatorNotFound(TmctlError):
    """No address was given and the ``tmd.json`` that should name one is missing or unreadable."""


class CoordinatorUnreachable(TmctlError):
    """The coordinator did not answer within the timeout (the subclasses say why)."""

    def __init__(self, address: str, timeout_s: float, why: str = "") -> None:
        super().__init__(why or f"no coordinator reachable at {address} (no reply in {timeout_s:g} s)")
        self.address = address
        self.timeout_s = timeout_s


class InvalidAddress(CoordinatorUnreachable):
    """The address is not ``tcp://HOST:PORT`` with a port in 1..65535, or HOST does not resolve."""

    def __init__(self, address: str, problem: str) -> None:
        super().__init__(address, 0.0, f"invalid coordinator address {address}: {problem}")


class ConnectionRefused(CoordinatorUnreachable):
    """Nothing listens at the address: the job ended, or its tmd died (``tmd resume`` restarts it)."""

    def __init__(self, address: str, timeout_s: float) -> None:
        super().__init__(address, timeout_s, f"connection refused at {address}: no tmd listens there (the job "
                                             f"ended, or its tmd died: `tmd resume` restarts it)")


class AuthenticationFailed(CoordinatorUnreachable):
    """The CURVE handshake failed: these are not the job's keys, or that is not the job's tmd."""

    def __init__(self, address: str, timeout_s: float, keys_dir: Optional[str]) -> None:
        how = f"with the keys in {keys_dir}" if keys_dir else "without keys (give --job/--run-dir, or TM_KEYS)"
        super().__init__(address, timeout_s, f"authentication failed at {address} {how}: not this job's keys, "
                                             f"or not this job's tmd")


class TimedOut(CoordinatorUnreachable):
    """Connected and authenticated, but tmd did not answer within the timeout (busy, stopped, or hung)."""

    def __init__(self, address: str, timeout_s: float, detail: str = "connected, no reply") -> None:
        super().__init__(address, timeout_s, f"timed out after {timeout_s:g} s waiting for tmd at {address} "
                                             f"({detail})")


class KeysUnreadable(TmctlError):
    """The job's key directory cannot be read: another user's job (only its user can command it), or a path
    that does not exist."""


def _normalise(address: str) -> str:
    address = address.strip()
    return address if "://" in address else f"tcp://{address}"


def _read_tmd_json(path: str, how: str, field: str = "address") -> Optional[str]:
    hint = ("is tmd running? Point tmctl at it with --coordinator ADDR (or TM_COORDINATOR), --job JOBID, "
            "or --run-dir DIR (or TM_RUN_DIR)")
    try:
        with open(path) as f:
            info = json.load(f)
    except FileNotFoundError:
        raise CoordinatorNotFound(f"no tmd.json at {os.path.abspath(path)} ({how}); {hint}") from None
    except (OSError, ValueError) as e:
        raise CoordinatorNotFound(f"cannot read {path} ({how}): {e}") from None
    value = info.get(field) if isinstance(info, dict) else None
    if field != "address":
        return value if isinstance(value, str) and value else None
    if not isinstance(value, str) or not value:
        raise CoordinatorNotFound(f"{path} ({how}) has no \"address\" field")
    return _normalise(value)


def find_coordinator(coordinator: str | None, run_dir: str | None, job: str | None) -> str:
    """The coordinator's ZeroMQ address, e.g. ``tcp://127.0.0.1:5555``.

    First that applies: ``coordinator`` (``--coordinator``); env ``TM_COORDINATOR``; ``job`` (``--job``) ->
    ``$TM_STATE_DIR/jobs/<job>/tmd.json`` (``~/.trainmover`` when TM_STATE_DIR is unset); ``run_dir``
    (``--run-dir``) or env ``TM_RUN_DIR`` -> ``<dir>/tmd.json``; else ``./tmrun/tmd.json``.
    An address without a scheme gets ``tcp://``.

    Raises :class:`CoordinatorNotFound` when the tmd.json to read is missing, unreadable or has no address;
    the message names the path and how to point tmctl elsewhere.
    """
    if coordinator:
        return _normalise(coordinator)
    if os.environ.get("TM_COORDINATOR"):
        return _normalise(os.environ["TM_COORDINATOR"])
    path, how = _tmd_json(run_dir, job)
    return _read_tmd_json(path, how)


def _tmd_json(run_dir: str | None, job: str | None) -> tuple[str, str]:
    if job:
        return layout.job_tmd_json(job), f"from --job {job}"
    if run_dir:
        return layout.RunDir(run_dir).tmd_json, "from --run-dir"
    if os.environ.get("TM_RUN_DIR"):
        return layout.RunDir(os.environ["TM_RUN_DIR"]).tmd_json, "from TM_RUN_DIR"
    return layout.RunDir(DEFAULT_RUN_DIR).tmd_json, f"default run dir {DEFAULT_RUN_DIR}"


def find_keys(run_dir: str | None, job: str | None) -> Optional[str]:
    """The job's key directory (tmd.protocol.keys): env ``TM_KEYS``, else the ``keys`` field of the tmd.json
    that ``run_dir``/``job`` (or the defaults of :func:`find_coordinator`) name; None when neither exists (tmd
    then refuses the connection unless it runs without authentication)."""
    if os.environ.get(KEYS_ENV):
        return os.environ[KEYS_ENV]
    path, how = _tmd_json(run_dir, job)
    try:
        return _read_tmd_json(path, how, field="keys")
    except CoordinatorNotFound:
        return None


def web_token_file(run_dir: str | None, job: str | None) -> Optional[str]:
    """The file of the job's web token (the status page's and /metrics', tmd.web): ``web.token`` in the key
    directory :func:`find_keys` finds; None when it finds none."""
    keys = find_keys(run_dir, job)
    return layout.web_token(keys) if keys else None


def check_address(address: str) -> None:
    """Raise :class:`InvalidAddress` unless ``address`` is ``tcp://HOST:PORT`` (port 1..65535, HOST resolves)."""
    expected = "expected tcp://HOST:PORT with a port in 1..65535"
    try:
        parts = urlsplit(address)
        port = parts.port
    except ValueError:
        raise InvalidAddress(address, expected) from None
    if parts.scheme != "tcp" or not parts.hostname or port is None or not 1 <= port <= 65535:
        raise InvalidAddress(address, expected)
    host = parts.hostname
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise InvalidAddress(address, f"cannot resolve host {host!r}: {e}") from None


RECONNECT_IVL_MS = 100  # the first reconnection attempt to an address that refused (libzmq's default) ...
RECONNECT_IVL_MAX_MS = 2000  # ... then backing off to one every 2 s


class Client:
    """Request/reply with tmd over one DEALER socket (random identity, LINGER 0), a CURVE client with the job's
    client key when ``keys_dir`` is given (plain otherwise).

    ``timeout_s``: how long (seconds) :meth:`request` waits for each reply. Use as a context manager or call
    :meth:`close`. Raises :class:`KeysUnreadable` when ``keys_dir`` cannot be read (another user's job).
    """

    def __init__(self, address: str, timeout_s: float = 2.0, keys_dir: Optional[str] = None) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.keys_dir = keys_dir
        try:
            self._keys = JobKeys.load(keys_dir, parties=(Sender.CLIENT,)) if keys_dir else None
        except KeysUnavailable as e:
            raise KeysUnreadable(f"{e} (only the job's user can command it)") from None
        self._sock: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None
        self._ctx: zmq.Context | None = None
        self._seen: set = set()  # monitor events of the current socket

    def _socket(self) -> zmq.Socket:
        if self._sock is not None and self._handshake_failed():
            self.close()  # libzmq does not retry a connection whose handshake failed (a stranger was there)
        if self._sock is None:
            check_address(self.address)
            self._ctx = zmq.Context()  # its own: nothing a long-lived process did to the shared one can affect it
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)  # back off from a tmd that is gone
            sock.setsockopt(zmq.IDENTITY, f"tmctl-{secrets.token_hex(6)}".encode())
            if self._keys is not None:
                try:
                    self._keys.connect_as(sock, Sender.CLIENT)
                except KeysUnavailable as e:
                    sock.close()
                    raise KeysUnreadable(f"{e} (only the job's user can command it)") from None
            # a unique endpoint: pyzmq's default names it by file descriptor, which a later socket may reuse
            # while a garbage-collected client's monitor is still bound
            self._monitor = sock.get_monitor_socket(addr=f"inproc://tmctl-monitor-{secrets.token_hex(8)}")
            sock.connect(self.address)
            self._sock = sock
        return self._sock

    def _handshake_failed(self) -> bool:
        """Whether the monitor reported a failed handshake since it was last read (the events are kept for
        :meth:`_why_silent`)."""
        while self._monitor is not None and self._monitor.poll(0):
            self._seen.add(recv_monitor_message(self._monitor)["event"])
        return bool(self._seen & _HANDSHAKE_FAILED)

    def _why_silent(self) -> CoordinatorUnreachable:
        """What the connection did while no reply came (read from the socket's monitor)."""
        self._handshake_failed()
        seen = self._seen
        if seen & _HANDSHAKE_FAILED:
            return AuthenticationFailed(self.address, self.timeout_s, self.keys_dir)
        if zmq.EVENT_HANDSHAKE_SUCCEEDED in seen:
            return TimedOut(self.address, self.timeout_s)
        if zmq.EVENT_CONNECTED in seen:
            return TimedOut(self.address, self.timeout_s, "connected, handshake not finished")
        if seen & {zmq.EVENT_CLOSED, zmq.EVENT_CONNECT_RETRIED}:
            return ConnectionRefused(self.address, self.timeout_s)
        return TimedOut(self.address, self.timeout_s, "no connection made yet")

    def request(self, msg: Message) -> Message:
        """Send ``msg`` and return tmd's reply (an :class:`~tmd.protocol.ErrorReply` is returned, not raised).

        Raises :class:`CoordinatorUnreachable` (one of its subclasses where the cause is known) when no reply
        comes within ``timeout_s`` seconds, and :class:`~tmd.protocol.ProtocolError` when the reply is not a
        valid message.
        """
        sock = self._socket()
        try:
            sock.send(encode(msg), zmq.NOBLOCK)
            if sock.poll(int(self.timeout_s * 1000), zmq.POLLIN):
                frames = sock.recv_multipart()
                return decode(frames[-1])  # tolerate an empty delimiter frame before the message
        except zmq.Again:
            pass
        why = self._why_silent()
        # A late reply must not be read as the answer to the next request: start over with a fresh socket.
        self.close()
        raise why

    def close(self) -> None:
        """Close the socket (pending messages are dropped). The next request opens a new one. Never blocks:
        the monitor's unread events are drained first (libzmq's monitor-stopped event waits for room in the
        monitor's pipe, which a client left connecting to a dead tmd fills within a minute)."""
        if self._sock is not None:
            self._handshake_failed()  # reads every pending monitor event
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None
            self._sock.close(linger=0)
            self._sock = None
            self._seen = set()
            self._ctx.term()
            self._ctx = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

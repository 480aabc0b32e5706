"""How tmctl finds the coordinator (tmd) and asks it one question at a time.

:func:`find_coordinator` turns the CLI's options and the environment into a ZeroMQ address; :class:`Client`
sends one :mod:`tmd.protocol` message over a DEALER socket and waits (seconds, bounded) for the reply.
"""
from __future__ import annotations

import json
import os
import secrets

import zmq

from tmd.protocol import Message, decode, encode, layout

DEFAULT_RUN_DIR = "./tmrun"


class TmctlError(Exception):
    """Base of the errors tmctl reports as one line (``error: <message>``)."""


class CoordinatorNotFound(TmctlError):
    """No address was given and the ``tmd.json`` that should name one is missing or unreadable."""


class CoordinatorUnreachable(TmctlError):
    """The coordinator did not answer within the timeout."""

    def __init__(self, address: str, timeout_s: float) -> None:
        super().__init__(f"no coordinator reachable at {address} (no reply in {timeout_s:g} s)")
        self.address = address
        self.timeout_s = timeout_s


def _normalise(address: str) -> str:
    address = address.strip()
    return address if "://" in address else f"tcp://{address}"


def _read_tmd_json(path: str, how: str) -> str:
    hint = ("is tmd running? Point tmctl at it with --coordinator ADDR (or TM_COORDINATOR), --job JOBID, "
            "or --run-dir DIR (or TM_RUN_DIR)")
    try:
        with open(path) as f:
            info = json.load(f)
    except FileNotFoundError:
        raise CoordinatorNotFound(f"no tmd.json at {os.path.abspath(path)} ({how}); {hint}") from None
    except (OSError, ValueError) as e:
        raise CoordinatorNotFound(f"cannot read {path} ({how}): {e}") from None
    address = info.get("address") if isinstance(info, dict) else None
    if not isinstance(address, str) or not address:
        raise CoordinatorNotFound(f"{path} ({how}) has no \"address\" field")
    return _normalise(address)


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
    if job:
        return _read_tmd_json(layout.job_tmd_json(job), f"from --job {job}")
    if run_dir:
        return _read_tmd_json(layout.RunDir(run_dir).tmd_json, "from --run-dir")
    if os.environ.get("TM_RUN_DIR"):
        return _read_tmd_json(layout.RunDir(os.environ["TM_RUN_DIR"]).tmd_json, "from TM_RUN_DIR")
    return _read_tmd_json(layout.RunDir(DEFAULT_RUN_DIR).tmd_json, f"default run dir {DEFAULT_RUN_DIR}")


class Client:
    """Request/reply with tmd over one DEALER socket (random identity, LINGER 0).

    ``timeout_s``: how long (seconds) :meth:`request` waits for each reply. Use as a context manager or call
    :meth:`close`.
    """

    def __init__(self, address: str, timeout_s: float = 2.0) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._sock: zmq.Socket | None = None

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            sock = zmq.Context.instance().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IDENTITY, f"tmctl-{secrets.token_hex(6)}".encode())
            sock.connect(self.address)
            self._sock = sock
        return self._sock

    def request(self, msg: Message) -> Message:
        """Send ``msg`` and return tmd's reply (an :class:`~tmd.protocol.ErrorReply` is returned, not raised).

        Raises :class:`CoordinatorUnreachable` when no reply comes within ``timeout_s`` seconds, and
        :class:`~tmd.protocol.ProtocolError` when the reply is not a valid message.
        """
        sock = self._socket()
        try:
            sock.send(encode(msg), zmq.NOBLOCK)
            if sock.poll(int(self.timeout_s * 1000), zmq.POLLIN):
                frames = sock.recv_multipart()
                return decode(frames[-1])  # tolerate an empty delimiter frame before the message
        except zmq.Again:
            pass
        # A late reply must not be read as the answer to the next request: start over with a fresh socket.
        self.close()
        raise CoordinatorUnreachable(self.address, self.timeout_s)

    def close(self) -> None:
        """Close the socket (pending messages are dropped). The next request opens a new one."""
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

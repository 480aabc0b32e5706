"""The job's keys: ZeroMQ CURVE key pairs per party and the job secret, and how each socket uses them.

Every party of a job talks to tmd over CURVE (elliptic-curve encryption and authentication, RFC 26 / CurveZMQ):

* tmd's ROUTER is the CURVE server; its key pair is ``coordinator``. Every client pins tmd's public key, so a
  process that binds tmd's address while tmd is down (a rogue coordinator) fails the handshake and is never heard.
* Each other party authenticates with its role's key pair: ``worker`` (every rank and standby process of the job),
  ``client`` (tmctl), ``hook`` (the SLURM epilog). tmd's ZAP handler (:class:`Authenticator`) accepts only these
  three public keys and labels each connection with its role (the ZeroMQ ``User-Id`` message property); tmd
  dispatches a message only when its type's ``SENDER`` matches that role (tmd.daemon).
* The job secret (32 random bytes) keys the HMAC of each state-transfer header (worker.transfer) and names the
  job's store keys (:attr:`JobKeys.store_namespace`), so nobody outside the job can guess a rendezvous key.

Files, in a directory created 0700 by tmd at job start (local mode ``<run_dir>/keys``, SLURM mode
``<state dir>/jobs/<JOBID>/keys``; tmd.json's ``keys`` field names it and tmd exports it as ``TM_KEYS`` to the
processes it starts), each 0600 (pyzmq's certificate format)::

    coordinator.key  coordinator.key_secret
    worker.key       worker.key_secret
    client.key       client.key_secret
    hook.key         hook.key_secret
    secret           the job secret, 64 hex digits
    worker/          what a rank gets (least privilege): worker.key, worker.key_secret, coordinator.key, secret

Only the job's user (and root, e.g. the SLURM epilog) can read them: another user cannot talk to the job at all.
tmd exports ``TM_KEYS`` as the ``worker/`` directory (:meth:`JobKeys.worker_keys`): a rank, and everything its
script starts, is handed no client, hook or coordinator secret key. tmctl reads the client secret key and the
epilog the hook's from the whole directory (tmd.json's ``keys``). See docs/security.md.
Imports only the standard library and pyzmq (the SLURM epilog imports it).
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import tempfile
from typing import Optional

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from tmd.protocol.vocab import Sender

KEYS_ENV = "TM_KEYS"  # the key directory, for the processes tmd starts
PARTIES = (Sender.COORDINATOR, Sender.WORKER, Sender.CLIENT, Sender.HOOK)
SECRET_FILE = "secret"
WORKER_DIR = "worker"  # below the keys directory: the keys a rank gets (TM_KEYS)
ZAP_DOMAIN = "trainmover"  # the ZAP domain of tmd's socket
from tmd.protocol.messages import MAX_MESSAGE_BYTES  # noqa: E402 - ZMQ_MAXMSGSIZE on every socket (bytes)


class KeysUnavailable(OSError):
    """The key directory or one of its files is missing or unreadable (another user's job, a job not started
    yet, a wrong path). The message names the path."""


class JobKeys:
    """The keys of one job, read from ``path`` (see the module docstring for the files)."""

    def __init__(self, path: str, pairs: dict[Sender, tuple[bytes, Optional[bytes]]], secret: bytes) -> None:
        self.path = path
        self._pairs = pairs
        self.secret = secret  # 32 bytes

    # --- files ------------------------------------------------------------------------------------------------
    @classmethod
    def create(cls, path: str) -> "JobKeys":
        """Generate a fresh key pair per party and a job secret in ``path`` (created 0700; files 0600).
        Existing keys in ``path`` are replaced. Raises OSError when ``path`` cannot be made private."""
        os.makedirs(path, mode=0o700, exist_ok=True)
        if os.path.islink(path):
            raise KeysUnavailable(f"{path} is a symlink: refusing to keep the job's keys there")
        os.chmod(path, 0o700)
        if os.stat(path).st_uid != os.getuid():
            raise KeysUnavailable(f"{path} belongs to another user: refusing to keep the job's keys there")
        old = os.umask(0o077)
        try:
            for party in PARTIES:
                for suffix in (".key", ".key_secret"):
                    try:
                        os.unlink(os.path.join(path, party.value + suffix))
                    except FileNotFoundError:
                        pass
                zmq.auth.create_certificates(path, party.value)
            fd = os.open(os.path.join(path, SECRET_FILE), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32))
        finally:
            os.umask(old)
        for name in os.listdir(path):
            if os.path.isfile(os.path.join(path, name)):
                os.chmod(os.path.join(path, name), 0o600)
        return cls.load(path)

    def worker_keys(self) -> str:
        """Write ``<keys>/worker/`` (0700; files 0600, each a new file renamed into place): the worker key pair,
        tmd's public key and the job secret, what a rank needs and nothing else. Returns its path (the
        ``TM_KEYS`` of the processes tmd starts). Raises OSError when it cannot be written."""
        d = os.path.join(self.path, WORKER_DIR)
        os.makedirs(d, mode=0o700, exist_ok=True)
        if os.path.islink(d) or os.stat(d).st_uid != os.getuid():
            raise KeysUnavailable(f"{d} is a symlink or another user's: refusing to put the worker's keys there")
        os.chmod(d, 0o700)
        for name in (f"{Sender.WORKER.value}.key", f"{Sender.WORKER.value}.key_secret",
                     f"{Sender.COORDINATOR.value}.key", SECRET_FILE):
            with open(os.path.join(self.path, name), "rb") as f:
                data = f.read()
            fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-")  # 0600, never an existing file
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, os.path.join(d, name))
        return d

    @classmethod
    def load(cls, path: str, parties: tuple[Sender, ...] = PARTIES) -> "JobKeys":
        """Read the keys in ``path`` (a job's keys directory, or its ``worker/``): each party's public key that
        is there, and the secret key of each party in ``parties`` that this process can read. Raises
        :class:`KeysUnavailable` when ``path``, tmd's public key or the job secret cannot be read."""
        pairs: dict[Sender, tuple[bytes, Optional[bytes]]] = {}
        try:
            for party in PARTIES:
                secret_file = os.path.join(path, party.value + ".key_secret")
                public_file = os.path.join(path, party.value + ".key")
                if party in parties and os.access(secret_file, os.R_OK):
                    pairs[party] = zmq.auth.load_certificate(secret_file)
                elif party != Sender.COORDINATOR and not os.path.exists(public_file) and os.path.isdir(path):
                    continue  # a worker/ directory: no other party's key
                else:
                    public, _ = zmq.auth.load_certificate(os.path.join(path, party.value + ".key"))
                    pairs[party] = (public, None)
            with open(os.path.join(path, SECRET_FILE)) as f:
                secret = bytes.fromhex(f.read().strip())
        except (OSError, ValueError) as e:
            raise KeysUnavailable(f"cannot read the job's keys in {path}: {e}") from None
        if len(secret) != 32:
            raise KeysUnavailable(f"{path}/{SECRET_FILE} is not a 32-byte job secret")
        return cls(path, pairs, secret)

    @classmethod
    def from_env(cls) -> "JobKeys":
        """The keys named by env ``TM_KEYS``. Raises :class:`KeysUnavailable` when it is unset or unreadable."""
        path = os.environ.get(KEYS_ENV)
        if not path:
            raise KeysUnavailable(f"{KEYS_ENV} is not set: this process was not started by tmd, or lost its "
                                  "environment")
        return cls.load(path)

    # --- what the keys are for ----------------------------------------------------------------------------------
    def public(self, party: Sender) -> bytes:
        """``party``'s public key (z85, 40 bytes). Raises KeysUnavailable when it is not in these keys."""
        if party not in self._pairs:
            raise KeysUnavailable(f"no {party} key in {self.path}")
        return self._pairs[party][0]

    def role_of(self, public_key: bytes) -> Optional[Sender]:
        """The party whose public key (z85) is ``public_key``, or None for a stranger. The coordinator's own
        key is no client's."""
        for party, (public, _) in self._pairs.items():
            if party != Sender.COORDINATOR and hmac.compare_digest(public, public_key):
                return party
        return None

    @property
    def store_namespace(self) -> str:
        """The job's store key prefix (``tm-<16 hex digits>``, derived from the job secret): the root of every
        store key the job uses (tmd.protocol.layout's prefixes go below it)."""
        return "tm-" + hmac.new(self.secret, b"store-namespace", hashlib.sha256).hexdigest()[:16]

    def mac(self, data: bytes) -> bytes:
        """HMAC-SHA256 of ``data`` with the job secret (32 bytes)."""
        return hmac.new(self.secret, data, hashlib.sha256).digest()

    def verify(self, data: bytes, mac: bytes) -> bool:
        """Whether ``mac`` is :meth:`mac` of ``data`` (constant time)."""
        return hmac.compare_digest(self.mac(data), mac)

    # --- sockets -------------------------------------------------------------------------------------------------
    def serve(self, sock: zmq.Socket) -> None:
        """Make ``sock`` (tmd's ROUTER, before bind) this job's CURVE server. Start an :class:`Authenticator`
        on the socket's context first, or every client is refused. Raises KeysUnavailable without the
        coordinator's secret key."""
        public, secret = self._pairs[Sender.COORDINATOR]
        if secret is None:
            raise KeysUnavailable(f"no coordinator secret key readable in {self.path}")
        limit(sock)
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_server = True
        sock.zap_domain = ZAP_DOMAIN.encode()

    def connect_as(self, sock: zmq.Socket, party: Sender) -> None:
        """Make ``sock`` (a DEALER, before connect) a CURVE client of this job's tmd as ``party``, pinning tmd's
        public key. Raises KeysUnavailable when ``party``'s secret key is not readable here."""
        public, secret = self._pairs.get(party, (b"", None))
        if secret is None:
            raise KeysUnavailable(f"no {party} secret key readable in {self.path}")
        limit(sock)
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_serverkey = self.public(Sender.COORDINATOR)


def limit(sock: zmq.Socket, max_bytes: int = MAX_MESSAGE_BYTES) -> None:
    """Refuse messages larger than ``max_bytes`` on ``sock`` (ZMQ_MAXMSGSIZE: the peer is disconnected)."""
    sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)


class Authenticator(ThreadAuthenticator):
    """tmd's ZAP handler: admits exactly the job's worker, client and hook public keys (or those of ``roles``)
    and labels each connection with its role (the ``User-Id`` property of every message it sends: ``worker``,
    ``client`` or ``hook``). One per ZeroMQ context (ZAP is per context); runs on pyzmq's own thread."""

    def __init__(self, context: zmq.Context, keys: JobKeys,
                 roles: tuple[Sender, ...] = (Sender.WORKER, Sender.CLIENT, Sender.HOOK)) -> None:
        """``roles``: the parties admitted (the job's store admits only ``worker``)."""
        super().__init__(context)
        self._keys = keys
        self._roles = roles

    def start(self) -> None:
        super().start()
        self.configure_curve_callback(ZAP_DOMAIN, self)

    def callback(self, domain: str, key: bytes) -> bool:
        """CURVE credentials provider: ``key`` is the client's public key (z85)."""
        return self._keys.role_of(key) in self._roles

    def curve_user_id(self, client_public_key: bytes) -> str:
        role = self._keys.role_of(zmq.utils.z85.encode(client_public_key))
        return role.value if role is not None else ""


def role_of_frame(frame: zmq.Frame) -> Optional[Sender]:
    """The authenticated role of the connection ``frame`` came from (its ``User-Id``), or None (a socket without
    CURVE, or an unknown label)."""
    try:
        return Sender(frame.get("User-Id"))
    except (zmq.ZMQError, ValueError, KeyError, TypeError):
        return None

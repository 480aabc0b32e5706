"""The job's keys as a worker process holds them: tmd.protocol.keys.JobKeys, read once from env ``TM_KEYS``.

tmd exports ``TM_KEYS`` (the job's key directory) to every process it starts. The data plane uses the job secret
twice: worker.transfer authenticates each state-transfer header with it, and worker.backend puts every store key
below the job's secret namespace. Without ``TM_KEYS`` (tmd started without authentication, a unit test) there are
no keys: the transfer header is then unauthenticated (still plain data, never code) and store keys carry no
namespace, as the agent's socket is plain then. ``TM_KEYS`` naming keys that cannot be read is an error, never a
silent downgrade.
"""
from __future__ import annotations

import os
import threading
from typing import Optional

from tmd.protocol.keys import KEYS_ENV, JobKeys

_lock = threading.Lock()
_loaded: dict[str, JobKeys] = {}  # by key directory: read once per process


def current() -> Optional[JobKeys]:
    """The keys named by env ``TM_KEYS`` (read on first use, then cached; public keys and the job secret, no
    CURVE secret key), or None when it is unset or empty.
    Raises tmd.protocol.keys.KeysUnavailable when it names keys this process cannot read."""
    path = os.environ.get(KEYS_ENV)
    if not path:
        return None
    with _lock:
        keys = _loaded.get(path)
        if keys is None:
            keys = _loaded[path] = JobKeys.load(path, parties=())  # the job secret; no CURVE secret key
        return keys


def store_namespace() -> Optional[str]:
    """The job's secret store-key root (:attr:`JobKeys.store_namespace`), or None without ``TM_KEYS``. Raises
    KeysUnavailable as :func:`current`."""
    keys = current()
    return keys.store_namespace if keys is not None else None

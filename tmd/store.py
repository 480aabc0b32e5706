"""The job's TCPStore, hosted by tmd on one address of this host, never on all interfaces.

c10d's TCPStore master binds every interface (``0.0.0.0``/``::``) whatever host name it is given, so any host
that can route to this one could reach the job's rendezvous keys. It also accepts an already listening socket
(``master_listen_fd``): :func:`host_store` binds that socket itself to the one address given (``TM_HOST``: the
job's own interface) and hands it over. Works with both of c10d's server backends (libuv and the classic one,
checked with torch 2.13); the store owns the socket from then on and closes it when it is destroyed.

Store keys are not secret by themselves; every key the job uses lives below the job's secret namespace
(tmd.protocol.keys.JobKeys.store_namespace, applied by worker.backend), so a process that can connect still
cannot guess where a rendezvous happens.
"""
from __future__ import annotations

import datetime
import socket

import torch.distributed as dist

LISTEN_BACKLOG = 4096  # pending connections (c10d's own default)


def host_store(host: str, port: int = 0, timeout_s: float = 300.0, use_libuv: bool = True) -> dist.TCPStore:
    """A TCPStore master listening on ``host`` only (an IP address or a name resolving to one address of this
    host), at ``port`` (0: any free port; the store's ``port`` attribute says which). ``timeout_s``: seconds of
    the master's own store operations. ``use_libuv``: c10d's libuv server (its default) or the classic one.
    Raises OSError when ``host`` does not resolve or is not an address of this host (EADDRNOTAVAIL), or the
    port is taken (EADDRINUSE)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as c10d's own: a restarted tmd rebinds
        listener.bind(address)
        listener.listen(LISTEN_BACKLOG)
        bound_port = listener.getsockname()[1]
        store = dist.TCPStore(host, bound_port, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout_s),
                              master_listen_fd=listener.fileno(), use_libuv=use_libuv)
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store closes the socket: Python must not close the same descriptor again
    return store

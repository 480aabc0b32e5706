"""The network a job's data plane uses: ``--iface NAME`` (env ``TM_IFNAME``) of ``tmd local`` and ``tmd slurm``.

On a cluster with several networks (Ethernet for management, InfiniBand or a fast Ethernet for training), the
collectives and the state transfers of a migration or recovery must run on the fast one: torchft's users saw a
state transfer take ~800 s over Ethernet and ~20 s on InfiniBand (torchft #329). Left to themselves, gloo and
NCCL take the interface that routes to the job's store (or the one the host name resolves to).

tmd passes the name to every process it starts (``TM_IFNAME``); each rank resolves it **on its own node**, in
``worker.init()`` before it registers (:func:`data_plane_env`): it binds and advertises that interface's IPv4
address (``TM_GLOO_HOST``), and sets ``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` to the name (gloo groups
the script builds itself, NCCL's bootstrap and socket transport; NCCL's InfiniBand transport picks its HCAs
with ``NCCL_IB_HCA``, which this does not set). A name the node does not have fails that node's processes at
once with one line naming the node and the interface (:class:`InterfaceError`), before any rendezvous could wait
for them. In SLURM mode tmd itself binds the interface's address on the batch host when ``--host`` is not given.

Without ``--iface`` a rank still tells tmd the address it uses and the interface holding it
(:func:`interface_of`), and ``tmctl status`` shows both for each node.

All lookups are of the calling process's network namespace (psutil's ``net_if_addrs``, getifaddrs(3)): inside
``tmd local --netns-all`` each node's bridge interface is ``tm0`` (tmd.netns), with that node's own address.
"""
from __future__ import annotations

import re
import socket
from typing import Optional

import psutil

ENV = "TM_IFNAME"
MAX_NAME_CHARS = 15  # Linux's IFNAMSIZ (16) less the terminating NUL
_NAME = re.compile(r"[A-Za-z0-9_.:@-]+")  # what ip-link(8) accepts, less '/' and whitespace


class InterfaceError(ValueError):
    """An interface this node cannot use; the message is one line naming the node and the interface."""


def check_name(name: str) -> str:
    """``name`` if it can be an interface name (1 to 15 characters of letters, digits and ``_.:@-``, not ``.``
    or ``..``); raises ValueError with one line otherwise. Says nothing about whether this host has it."""
    if not (0 < len(name) <= MAX_NAME_CHARS) or not _NAME.fullmatch(name) or name in (".", ".."):
        raise ValueError(f"'{name}' is not a network interface name (1 to {MAX_NAME_CHARS} characters of letters, "
                         "digits and _.:@-)")
    return name


def ipv4_addresses() -> dict[str, list[str]]:
    """Every interface of this network namespace -> its IPv4 addresses (possibly none), in the kernel's order."""
    return {name: [a.address for a in addrs if a.family == socket.AF_INET]
            for name, addrs in psutil.net_if_addrs().items()}


def resolve(name: str, node: str) -> str:
    """The IPv4 address of interface ``name`` on this node (its first, when it has several). Raises
    :class:`InterfaceError` (one line naming ``node`` and ``name``) when this node has no such interface or it
    has no IPv4 address."""
    interfaces = ipv4_addresses()
    if name not in interfaces:
        raise InterfaceError(f"node {node}: network interface '{name}' does not exist (this node has: "
                             f"{', '.join(sorted(interfaces)) or 'none'})")
    if not interfaces[name]:
        raise InterfaceError(f"node {node}: network interface '{name}' has no IPv4 address")
    return interfaces[name][0]


def interface_of(address: str) -> Optional[str]:
    """The interface of this network namespace holding IPv4 ``address``, or None (not a local address)."""
    return next((name for name, addrs in ipv4_addresses().items() if address in addrs), None)


def data_plane_env(name: str, node: str) -> dict[str, str]:
    """What a rank on ``node`` sets in its environment to bind and advertise interface ``name``:
    ``TM_GLOO_HOST`` (its address, :func:`resolve`), ``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME``.
    Raises :class:`InterfaceError` as :func:`resolve` does."""
    return {"TM_GLOO_HOST": resolve(name, node), "GLOO_SOCKET_IFNAME": name, "NCCL_SOCKET_IFNAME": name}

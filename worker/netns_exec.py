"""Entering a node's network namespace from a forked process: what ``ip netns exec NAME`` does before it execs
its command (iproute2's ``netns_switch``), so that a rank forked by the fork server (worker/fork_server.py) runs
inside its node's namespace (``tmd local --netns-node``/``--netns-all``, tmd/netns.py) as one started through
``ip netns exec`` would.

:func:`enter` moves the calling process into the network namespace ``/var/run/netns/NAME`` (setns(2)), gives it
a mount namespace of its own (unshare(2); the mounts below do not propagate back), mounts a sysfs there that
shows the namespace's interfaces, and bind-mounts every file of ``/etc/netns/NAME/`` over its namesake in
``/etc`` (tmd.netns writes a ``resolv.conf`` there, so that name lookups fail fast in the namespace). It must
be called by a process with one thread (a thread keeps the namespaces it had); it raises OSError naming the
call that failed, and RuntimeError for a name that is not a namespace. Needs root (CAP_SYS_ADMIN).
"""
from __future__ import annotations

import ctypes
import errno
import os
import re

NETNS_DIR = "/var/run/netns"  # where `ip netns add NAME` keeps a namespace (a bind-mounted nsfs file)
ETC_NETNS = "/etc/netns"  # `ip netns exec NAME` bind-mounts the files of ETC_NETNS/NAME/ over those of /etc/
CLONE_NEWNET = 0x40000000
CLONE_NEWNS = 0x00020000
MS_RDONLY, MS_BIND, MS_REC, MS_SLAVE = 1, 4096, 16384, 1 << 19
MNT_DETACH = 2
NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def _check(result: int, call: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{call}: {os.strerror(err)} ({errno.errorcode.get(err, err)})")


def enter(name: str) -> None:
    """Move this (single-threaded) process into network namespace ``name``, as ``ip netns exec name`` would."""
    if not NAME.fullmatch(name) or name.startswith(".") or not os.path.exists(os.path.join(NETNS_DIR, name)):
        raise RuntimeError(f"no network namespace {name!r} in {NETNS_DIR}")
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:
        raise RuntimeError(f"entering a namespace needs a single-threaded process ({threads} threads)")
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(os.path.join(NETNS_DIR, name), os.O_RDONLY | os.O_CLOEXEC)
    try:
        _check(libc.setns(fd, CLONE_NEWNET), f"setns({name})")
    finally:
        os.close(fd)
    _check(libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    _check(libc.mount(b"", b"/", b"none", MS_SLAVE | MS_REC, None), "mount(/, MS_SLAVE|MS_REC)")
    # sysfs as the namespace sees it (iproute2 keeps it read-only where /sys was)
    readonly = os.statvfs("/sys").f_flag & os.ST_RDONLY
    if libc.umount2(b"/sys", MNT_DETACH) == 0:
        _check(libc.mount(name.encode(), b"/sys", b"sysfs", MS_RDONLY if readonly else 0, None), "mount(/sys)")
    etc = os.path.join(ETC_NETNS, name)
    for entry in sorted(os.listdir(etc)) if os.path.isdir(etc) else ():
        source, target = os.path.join(etc, entry), os.path.join("/etc", entry)
        if os.path.exists(target):
            _check(libc.mount(source.encode(), target.encode(), b"none", MS_BIND, None), f"mount --bind {source}")

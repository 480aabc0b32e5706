"""Local partitions: one node's processes in their own Linux network namespace, which a test can cut off and heal.

``NodeNamespace(node, index)`` creates the namespace ``tm-<node>-<pid>-<index>`` and a veth pair joining it to
the host's namespace::

    host namespace                          tm-<node>-<pid>-<index>
    tmh<index> 10.213.<index>.1/24  <---->  tmn<index> 10.213.<index>.2/24  (default route via 10.213.<index>.1)

Start a node's processes with ``subprocess.Popen(ns.wrap(argv), ...)`` (``ip netns exec`` execs ``argv``, so
the Popen's pid is the process itself). Addressing:

* ranks inside the namespace advertise ``ns.node_ip`` (env ``TM_GLOO_HOST``) and reach tmd and the job's
  TCPStore at ``ns.host_ip``. The namespace's loopback works, so ranks of the same node still reach each other
  while the node is cut off, as on a real node;
* ranks in the host namespace must advertise an address the namespace can reach: ``ns.host_ip`` works, it is
  a local address of the host (127.0.0.1 does not: inside the namespace it is the namespace's own loopback).
  Servers in the host namespace bound to 0.0.0.0 or to ``host_ip`` accept connections from the namespace;
* several namespaces (different ``index``) reach each other through the host: packets that arrive on
  ``tmh<index>`` are forwarded (only that interface's ``forwarding`` sysctl is set, the host-wide one is left
  alone). Nothing is NATed: the namespace reaches the host and the other namespaces, not the outside world;
* name lookups inside the namespace fail fast instead of waiting on the host's unreachable nameserver (a
  resolv.conf of its own, see RESOLV_CONF); /etc/hosts still answers.

``cut()`` installs a ``blackhole`` root qdisc (``netem loss 100%`` where the kernel has netem but no blackhole)
on the egress of both ends of the veth: every packet either way is dropped silently, the sending stack is not
told (no RST, no ICMP, no error on send), so established TCP connections hang and retransmit, connects hang in
SYN_SENT, ARP goes unanswered. Taking links down would not do: it removes the connected routes and sends fail
at once with EHOSTUNREACH/ENETUNREACH. ``heal()`` deletes the qdiscs; TCP connections resume at their next
retransmission (exponential backoff from ~200 ms: after a long cut that can take seconds). Measured here: a
gloo all_reduce across a 2 s cut completes ~1 s after heal(); one that outlives the group's timeout fails
("Timed out waiting ... for recv") and the pair is closed, so that group is unusable even after heal().

``close()`` deletes the veth and the namespace (idempotent; also run at exit). Creating a ``NodeNamespace``
first deletes the namespaces ``tm-*`` left by processes that are gone (a crashed test).
Needs root and iproute2 (``ip``, ``tc``); ``available()`` says whether this machine can do it.
"""
from __future__ import annotations

import atexit
import os
import re
import shutil
import subprocess
import threading
from typing import Optional

PREFIX = "tm-"
ETC_NETNS = "/etc/netns"  # `ip netns exec NAME` bind-mounts the files of ETC_NETNS/NAME/ over those of /etc/
# The host's nameserver is unreachable from a namespace (no NAT): every lookup would wait out its timeouts (10 s
# with glibc's defaults; c10d's TCPStore client does a reverse lookup of its peer). 127.0.0.1 inside the
# namespace refuses at once, so lookups fail fast and /etc/hosts still answers.
RESOLV_CONF = "# tmd.netns: no DNS inside a node namespace\nnameserver 127.0.0.1\noptions timeout:1 attempts:1\n"
_CMD_TIMEOUT_S = 20.0
_CUT_QDISCS = (["blackhole"], ["netem", "loss", "100%"])

_available: Optional[bool] = None
_lock = threading.Lock()


def _ip(*args: str, netns: Optional[str] = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = ["ip", *(["-n", netns] if netns else []), *args]
    return _run(cmd, check)


def _tc(*args: str, netns: Optional[str] = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = ["tc", *(["-n", netns] if netns else []), *args]
    return _run(cmd, check)


def _run(cmd: list[str], check: bool) -> subprocess.CompletedProcess:
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=_CMD_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        if check:
            raise RuntimeError(f"`{' '.join(cmd)}` failed: {e}") from e
        return subprocess.CompletedProcess(cmd, -1, "", str(e))
    if check and res.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed (exit {res.returncode}): {res.stderr.strip()}")
    return res


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _list_namespaces() -> list[str]:
    res = _ip("netns", "list", check=False)
    # lines look like "name" or "name (id: 3)"
    return [line.split()[0] for line in res.stdout.splitlines() if line.strip()]


def _creator_pid(name: str) -> Optional[int]:
    """The pid encoded in a namespace name ``tm-<node>-<pid>-<index>``; None for names not made here."""
    if not name.startswith(PREFIX):
        return None
    parts = name.rsplit("-", 2)
    if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
        return None
    return int(parts[1])


def _delete_namespace(name: str) -> None:
    """Delete the veth links inside ``name`` (which removes their host ends even if a process still holds the
    namespace) and then the namespace."""
    res = _ip("-o", "link", "show", netns=name, check=False)
    for line in res.stdout.splitlines():
        m = re.match(r"\d+:\s*([^:@\s]+)", line)
        if m and m.group(1) != "lo":
            _ip("link", "del", m.group(1), netns=name, check=False)
    _ip("netns", "del", name, check=False)
    shutil.rmtree(os.path.join(ETC_NETNS, name), ignore_errors=True)


def cleanup_stale() -> list[str]:
    """Delete the namespaces ``tm-*`` whose creating process is gone; return their names."""
    removed = []
    for name in _list_namespaces():
        pid = _creator_pid(name)
        if pid is not None and pid != os.getpid() and not _pid_alive(pid):
            _delete_namespace(name)
            removed.append(name)
    return removed


def available() -> bool:
    """Whether this machine can create a namespace, a veth pair and the cut qdisc (root, iproute2). Cached;
    never raises."""
    global _available
    with _lock:
        if _available is None:
            _available = _probe()
        return _available


def _probe() -> bool:
    if not (shutil.which("ip") and shutil.which("tc")):
        return False
    if hasattr(os, "geteuid") and os.geteuid() != 0:
        return False
    name = f"{PREFIX}probe-{os.getpid()}-0"
    host_if = f"tmq{os.getpid()}"[:15]
    try:
        _ip("netns", "add", name)
        try:
            _ip("link", "add", host_if, "type", "veth", "peer", "name", "tmq0", "netns", name)
            try:
                return any(_tc("qdisc", "add", "dev", host_if, "root", *q, check=False).returncode == 0
                           for q in _CUT_QDISCS)
            finally:
                _ip("link", "del", host_if, check=False)
        finally:
            _ip("netns", "del", name, check=False)
    except Exception:
        return False


class NodeNamespace:
    """A network namespace for one node's processes, joined to the host by a veth pair (see the module doc).
    ``index`` (0..255) picks the subnet 10.213.<index>.0/24 and the interface names; it must be unique among
    the namespaces alive on this machine."""

    def __init__(self, node: str, index: int) -> None:
        if not 0 <= index <= 255:
            raise ValueError(f"index must be in 0..255, got {index}")
        self.node = node
        self.index = index
        safe = re.sub(r"[^A-Za-z0-9_.]", "_", node)[:40] or "node"
        self.name = f"{PREFIX}{safe}-{os.getpid()}-{index}"
        self.host_if = f"tmh{index}"
        self.ns_if = f"tmn{index}"
        self.host_ip = f"10.213.{index}.1"
        self.node_ip = f"10.213.{index}.2"
        self.is_cut = False
        self._closed = False
        self._cut_qdisc: Optional[list[str]] = None
        self._made_link = False
        cleanup_stale()
        if _ip("link", "show", "dev", self.host_if, check=False).returncode == 0:
            raise RuntimeError(f"interface {self.host_if} already exists (another NodeNamespace with index {index} "
                               f"is alive, or a leftover: `ip link del {self.host_if}`)")
        if self.name in _list_namespaces():
            raise RuntimeError(f"network namespace {self.name} already exists")
        atexit.register(self.close)
        try:
            _ip("netns", "add", self.name)
            self._write_resolv_conf()
            _ip("link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if, "netns", self.name)
            self._made_link = True
            _ip("addr", "add", f"{self.host_ip}/24", "dev", self.host_if)
            _ip("link", "set", self.host_if, "up")
            _ip("link", "set", "lo", "up", netns=self.name)
            _ip("addr", "add", f"{self.node_ip}/24", "dev", self.ns_if, netns=self.name)
            _ip("link", "set", self.ns_if, "up", netns=self.name)
            _ip("route", "add", "default", "via", self.host_ip, netns=self.name)
            self._set_forwarding()
        except BaseException:
            self.close()
            raise

    def _write_resolv_conf(self) -> None:
        etc = os.path.join(ETC_NETNS, self.name)
        try:
            os.makedirs(etc, exist_ok=True)
            with open(os.path.join(etc, "resolv.conf"), "w") as f:
                f.write(RESOLV_CONF)
        except OSError as e:
            raise RuntimeError(f"cannot write {etc}/resolv.conf: {e}") from e

    def _set_forwarding(self) -> None:
        """Forward what arrives on our host interface (namespace-to-namespace traffic); best effort."""
        try:
            with open(f"/proc/sys/net/ipv4/conf/{self.host_if}/forwarding", "w") as f:
                f.write("1")
        except OSError:
            pass

    @classmethod
    def existing(cls, node: str, name: str, index: int) -> "NodeNamespace":
        """A handle on a namespace another process created (e.g. tmd's, named in its tmd.json): it can cut()
        and heal() it; close() leaves it alone."""
        ns = cls.__new__(cls)
        ns.node, ns.index, ns.name = node, index, name
        ns.host_if, ns.ns_if = f"tmh{index}", f"tmn{index}"
        ns.host_ip, ns.node_ip = f"10.213.{index}.1", f"10.213.{index}.2"
        ns.is_cut, ns._closed, ns._cut_qdisc, ns._made_link = False, False, None, False
        ns._owner = False
        return ns

    def wrap(self, argv: list[str]) -> list[str]:
        """``argv`` run inside the namespace."""
        return ["ip", "netns", "exec", self.name, *argv]

    def cut(self) -> None:
        """Partition: drop every packet both ways, silently (see the module doc). Idempotent."""
        if self._closed:
            raise RuntimeError(f"{self.name} is closed")
        qdiscs = [self._cut_qdisc] if self._cut_qdisc else list(_CUT_QDISCS)
        errors = []
        for q in qdiscs:
            host = _tc("qdisc", "replace", "dev", self.host_if, "root", *q, check=False)
            if host.returncode != 0:
                errors.append(f"tc qdisc replace dev {self.host_if} root {' '.join(q)}: {host.stderr.strip()}")
                continue
            _tc("qdisc", "replace", "dev", self.ns_if, "root", *q, netns=self.name)
            self._cut_qdisc = q
            self.is_cut = True
            return
        raise RuntimeError("cannot cut " + self.name + ": " + "; ".join(errors))

    def heal(self) -> None:
        """Undo ``cut()``: traffic flows again; TCP resumes at its next retransmission. Idempotent."""
        if self._closed:
            raise RuntimeError(f"{self.name} is closed")
        for netns, dev in ((None, self.host_if), (self.name, self.ns_if)):
            res = _tc("qdisc", "del", "dev", dev, "root", netns=netns, check=False)
            if res.returncode != 0 and self.is_cut and "No such file" not in res.stderr \
                    and "Cannot delete qdisc with handle of zero" not in res.stderr:
                raise RuntimeError(f"`tc qdisc del dev {dev} root` failed: {res.stderr.strip()}")
        self.is_cut = False

    def close(self) -> None:
        """Delete the veth pair and the namespace (processes still inside lose their network). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if not getattr(self, "_owner", True):
            return
        try:
            atexit.unregister(self.close)
        except Exception:
            pass
        if self._made_link:
            _ip("link", "del", self.host_if, check=False)
        _delete_namespace(self.name)

    def __enter__(self) -> "NodeNamespace":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"NodeNamespace({self.name!r}, node_ip={self.node_ip}, host_ip={self.host_ip}, cut={self.is_cut})"

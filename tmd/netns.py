"""Local partitions: one node's processes in their own Linux network namespace, which a test can cut off and heal.

``NodeNamespace(node, index)`` creates the namespace ``tm-<node>-<pid>-<index>`` and a veth pair joining it to
the host's namespace::

    host namespace                          tm-<node>-<pid>-<index>
    tmh<index> 10.213.<index>.1/24  <---->  tmn<index> 10.213.<index>.2/24  (default route via 10.213.<index>.1)

Start a node's processes with ``subprocess.Popen(ns.wrap(argv), ...)`` (``ip netns exec`` execs ``argv``, so
the Popen's pid is the process itself). Addressing:

* ranks inside the namespace advertise ``ns.node_ip`` (env ``TM_GLOO_HOST``) and reach tmd and the job's
  rendezvous store (tmd.store) at ``ns.host_ip``. The namespace's loopback works, so ranks of the same node
  still reach each other while the node is cut off, as on a real node;
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

**Every process on its own address** (``tmd local --netns-all``): a :class:`Bridge` ``tmbr<k>`` in the host
namespace owns the subnet 10.214.<k>.0/24 (``k``: the first one free on this machine) and gives the host
10.214.<k>.1; ``Bridge.add(node)`` makes a ``NodeNamespace`` joined to the bridge by its own veth, with the next
address (10.214.<k>.2, .3, ...)::

    host namespace                                            tm-<node>-<pid>-<j>
    tmbr<k> 10.214.<k>.1/24 -- port tmb<k>v<j>  <---->  tm0 10.214.<k>.<j>/24  (no default route)

All of them share one link-local subnet, as hosts on one switch; nothing is routed or forwarded, and with no default
route a name lookup fails at once (ENETUNREACH). The bridge has a MAC address of its own (:func:`bridge_mac`): a
Linux bridge left to choose takes the lowest of its ports' MACs, so a namespace added later with a lower one changed
it, and a namespace that was sending to the host then (tmd answering tmctl's ``standby add``) went on sending to the
old MAC, which the host drops (``otherhost``), until that neighbour entry was resolved again: 0.2 to 13.4 s measured
here with TCP's retransmission backoff, over tmctl's 10 s timeout. ``cut()``/``heal()`` work as above on the veth's
two ends (the host end is a bridge port). :func:`enter` moves the calling process itself into such a namespace (tmd
does, so it binds and advertises its own address); the ``ip``/``tc`` commands of this module then still run in the
host namespace (through ``nsenter`` and a descriptor of it kept open), so that process can add namespaces to the
bridge later (standbys added by request). ``close()`` of the bridge deletes its namespaces and itself; bridges whose
creator is gone (its pid is the bridge's alias ``tm-<pid>``) go at the next start.

**Holding namespaces for other programs** (``slurm/local-cluster.sh up DIR --multihost``: each slurmd in a
namespace of its own)::

    python -m tmd.netns hold --env FILE NODE...

makes a bridge and one namespace per NODE on it, writes FILE (shell assignments: ``NETNS_BRIDGE``,
``NETNS_HOST_IP``, and per node ``NETNS_<node>`` (its namespace, for ``ip netns exec``) and ``ADDR_<node>``), then
holds them until SIGTERM or SIGINT and deletes them. The names carry this process's pid, so if it dies they are
deleted at the next start of any ``NodeNamespace`` or ``Bridge`` on this machine.
"""
from __future__ import annotations

import argparse
import atexit
import ctypes
import errno
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from typing import Optional

PREFIX = "tm-"
ETC_NETNS = "/etc/netns"  # `ip netns exec NAME` bind-mounts the files of ETC_NETNS/NAME/ over those of /etc/
# The host's nameserver is unreachable from a namespace (no NAT): every lookup would wait out its timeouts (10 s
# with glibc's defaults; gloo and c10d's TCPStore resolve names). 127.0.0.1 inside the
# namespace refuses at once, so lookups fail fast and /etc/hosts still answers.
RESOLV_CONF = "# tmd.netns: no DNS inside a node namespace\nnameserver 127.0.0.1\noptions timeout:1 attempts:1\n"
_CMD_TIMEOUT_S = 20.0
_CUT_QDISCS = (["blackhole"], ["netem", "loss", "100%"])
BRIDGE_PREFIX = "tmbr"  # tmbr<k>: the bridge of 10.214.<k>.0/24
BRIDGE_NS_IF = "tm0"  # a bridged namespace's end of its veth
_CLONE_NEWNET = 0x40000000
_host_net_fd: Optional[int] = None  # set by enter(): the host's network namespace, for the ip/tc commands

_available: Optional[bool] = None
_lock = threading.Lock()


def bridge_mac(index: int) -> str:
    """The MAC address of bridge ``tmbr<index>``: locally administered, unicast, one per bridge of this host."""
    return f"02:74:6d:62:00:{index:02x}"


def _ip(*args: str, netns: Optional[str] = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = ["ip", *(["-n", netns] if netns else []), *args]
    return _run(cmd, check)


def _tc(*args: str, netns: Optional[str] = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = ["tc", *(["-n", netns] if netns else []), *args]
    return _run(cmd, check)


def _run(cmd: list[str], check: bool) -> subprocess.CompletedProcess:
    """Run ``cmd`` in the host's network namespace (also after :func:`enter` moved this process out of it)."""
    fds: tuple[int, ...] = ()
    if _host_net_fd is not None:
        cmd, fds = ["nsenter", f"--net=/proc/self/fd/{_host_net_fd}", *cmd], (_host_net_fd,)
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=_CMD_TIMEOUT_S, stdin=subprocess.DEVNULL,
                             pass_fds=fds)
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
    """Delete the namespaces ``tm-*`` and the bridges ``tmbr*`` whose creating process is gone; return their
    names."""
    removed = []
    for name in _list_namespaces():
        pid = _creator_pid(name)
        if pid is not None and pid != os.getpid() and not _pid_alive(pid):
            _delete_namespace(name)
            removed.append(name)
    for name, pid in _bridges().items():
        if pid is not None and pid != os.getpid() and not _pid_alive(pid):
            _ip("link", "del", name, check=False)
            removed.append(name)
    return removed


def _bridges() -> dict[str, Optional[int]]:
    """The bridges ``tmbr*`` of the host namespace -> their creator's pid (from the alias ``tm-<pid>``)."""
    out: dict[str, Optional[int]] = {}
    for line in _ip("-o", "link", "show", "type", "bridge", check=False).stdout.splitlines():
        m = re.match(r"\d+:\s*([^:@\s]+)", line)
        if m and m.group(1).startswith(BRIDGE_PREFIX):
            alias = re.search(r"alias " + re.escape(PREFIX) + r"(\d+)", line)
            out[m.group(1)] = int(alias.group(1)) if alias else None
    return out


def enter(ns: "NodeNamespace") -> None:
    """Move this process into ``ns``'s network namespace: every socket it opens from now on is there (tmd in
    ``tmd local --netns-all``). Only the network namespace changes (not the mounts: /etc/resolv.conf stays the
    host's; with no default route a lookup fails at once). Call it while the process has one thread (a thread
    keeps the namespace it had); raises RuntimeError otherwise or when setns(2) fails. The module's ip/tc
    commands go on running in the host namespace."""
    global _host_net_fd
    threads = os.listdir("/proc/self/task")
    if len(threads) != 1:
        raise RuntimeError(f"enter() needs a single-threaded process ({len(threads)} threads: they would stay "
                           f"in the host namespace)")
    if _host_net_fd is not None:
        raise RuntimeError("this process already entered a namespace")
    if not shutil.which("nsenter"):
        raise RuntimeError("nsenter (util-linux) is needed to manage namespaces from inside one")
    host = os.open("/proc/self/ns/net", os.O_RDONLY)
    target = os.open(os.path.join("/var/run/netns", ns.name), os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(target, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            os.close(host)
            raise RuntimeError(f"setns({ns.name}) failed: {errno.errorcode.get(err, err)}")
    finally:
        os.close(target)
    _host_net_fd = host


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
    the namespaces alive on this machine. With ``bridge`` (made by :meth:`Bridge.add`) the veth is a port of
    that bridge instead and ``index`` (2..254) is the last byte of the node's address on the bridge's subnet."""

    def __init__(self, node: str, index: int, bridge: Optional["Bridge"] = None) -> None:
        if not (2 <= index <= 254 if bridge else 0 <= index <= 255):
            raise ValueError(f"index must be in {'2..254' if bridge else '0..255'}, got {index}")
        self.node = node
        self.index = index
        safe = re.sub(r"[^A-Za-z0-9_.]", "_", node)[:40] or "node"
        self.name = f"{PREFIX}{safe}-{os.getpid()}-{index}"
        self.bridge = bridge.name if bridge else None
        if bridge:
            self.host_if, self.ns_if = f"tmb{bridge.index}v{index}", BRIDGE_NS_IF
            self.host_ip, self.node_ip = bridge.host_ip, f"{bridge.subnet}.{index}"
        else:
            self.host_if, self.ns_if = f"tmh{index}", f"tmn{index}"
            self.host_ip, self.node_ip = f"10.213.{index}.1", f"10.213.{index}.2"
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
            if self.bridge:
                _ip("link", "set", self.host_if, "master", self.bridge)
            else:
                _ip("addr", "add", f"{self.host_ip}/24", "dev", self.host_if)
            _ip("link", "set", self.host_if, "up")
            _ip("link", "set", "lo", "up", netns=self.name)
            _ip("addr", "add", f"{self.node_ip}/24", "dev", self.ns_if, netns=self.name)
            _ip("link", "set", self.ns_if, "up", netns=self.name)
            if not self.bridge:  # on a bridge every peer is on the namespace's own subnet: nothing to route
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
    def existing(cls, node: str, name: str, index: int, **spec) -> "NodeNamespace":
        """A handle on a namespace another process created (e.g. tmd's, named in its tmd.json): it can cut()
        and heal() it; close() leaves it alone. ``spec``: the other fields of :meth:`spec` (``host_if``,
        ``ns_if``, ``host_ip``, ``node_ip``, ``bridge``); by default those of a namespace made without a bridge."""
        ns = cls.__new__(cls)
        ns.node, ns.index, ns.name = node, index, name
        ns.host_if, ns.ns_if = spec.get("host_if") or f"tmh{index}", spec.get("ns_if") or f"tmn{index}"
        ns.host_ip = spec.get("host_ip") or f"10.213.{index}.1"
        ns.node_ip = spec.get("node_ip") or f"10.213.{index}.2"
        ns.bridge = spec.get("bridge")
        ns.is_cut, ns._closed, ns._cut_qdisc, ns._made_link = False, False, None, False
        ns._owner = False
        return ns

    @classmethod
    def from_spec(cls, node: str, spec: dict) -> "NodeNamespace":
        """:meth:`existing` from a :meth:`spec` dict (tmd.json's ``netns`` entries)."""
        return cls.existing(node, **spec)

    def spec(self) -> dict:
        """What another process needs to find, cut and heal this namespace (JSON-able; see :meth:`from_spec`)."""
        return {"name": self.name, "index": self.index, "host_if": self.host_if, "ns_if": self.ns_if,
                "host_ip": self.host_ip, "node_ip": self.node_ip, "bridge": self.bridge}

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


TMD_KEY = "@tmd"  # tmd's own namespace in tmd.json's ``netns`` (not a node name: those are alphanumeric)


class Bridge:
    """The bridge ``tmbr<k>`` of subnet 10.214.<k>.0/24 in the host namespace, with ``host_ip`` 10.214.<k>.1,
    and the namespaces on it (see the module doc). ``k`` is the first subnet no interface of this machine uses
    and no other bridge took. Raises RuntimeError when none is free or a command fails."""

    def __init__(self) -> None:
        cleanup_stale()
        used = set()
        for line in _ip("-o", "-4", "addr", "show", check=False).stdout.splitlines():
            m = re.search(r"inet 10\.214\.(\d+)\.", line)
            if m:
                used.add(int(m.group(1)))
        self.index = -1
        for k in range(256):
            # taken atomically (another job may race), with an address of its own: one no port changes
            if k not in used and _ip("link", "add", f"{BRIDGE_PREFIX}{k}", "address", bridge_mac(k), "type",
                                     "bridge", check=False).returncode == 0:
                self.index = k
                break
        if self.index < 0:
            raise RuntimeError("no free bridge subnet 10.214.<k>.0/24 (k in 0..255)")
        self.name = f"{BRIDGE_PREFIX}{self.index}"
        self.subnet = f"10.214.{self.index}"
        self.host_ip = f"{self.subnet}.1"
        self.namespaces: list[NodeNamespace] = []
        self._next = 2
        self._closed = False
        atexit.register(self.close)
        try:
            _ip("link", "set", self.name, "alias", f"{PREFIX}{os.getpid()}")
            _ip("addr", "add", f"{self.host_ip}/24", "dev", self.name)
            _ip("link", "set", self.name, "up")
        except BaseException:
            self.close()
            raise

    def add(self, node: str) -> NodeNamespace:
        """A new namespace for ``node`` on this bridge, with the next free address (thread-safe). Raises
        RuntimeError when the subnet is full (253 namespaces) or a command fails."""
        with _lock:
            if self._closed:
                raise RuntimeError(f"bridge {self.name} is closed")
            if self._next > 254:
                raise RuntimeError(f"bridge {self.name} is full")
            index, self._next = self._next, self._next + 1
        ns = NodeNamespace(node, index, bridge=self)
        self.namespaces.append(ns)
        return ns

    def close(self) -> None:
        """Delete this bridge's namespaces and the bridge (idempotent; also run at exit)."""
        with _lock:
            if self._closed:
                return
            self._closed = True
        try:
            atexit.unregister(self.close)
        except Exception:
            pass
        for ns in self.namespaces:
            ns.close()
        _ip("link", "del", self.name, check=False)

    def __repr__(self) -> str:
        return f"Bridge({self.name!r}, {self.subnet}.0/24, namespaces={len(self.namespaces)})"


_SHELL_NAME = re.compile(r"[A-Za-z0-9_]+")  # a node name that can be part of a shell variable's name


def hold(nodes: list[str], env_path: str, stop: Optional[threading.Event] = None) -> int:
    """``python -m tmd.netns hold``: a bridge and a namespace per node (see the module doc), described in
    ``env_path`` (written atomically once all exist), held until ``stop`` is set (by default: SIGTERM or SIGINT),
    then deleted. Returns the exit code: 0, or 1 when they cannot be made (the reason on stderr, one line)."""
    bad = [n for n in nodes if not _SHELL_NAME.fullmatch(n)]
    if bad or not nodes or len(set(nodes)) != len(nodes):
        print(f"tmd.netns hold: node names must be distinct letters, digits and _ (got {' '.join(nodes) or 'none'})",
              file=sys.stderr)
        return 1
    if stop is None:
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    try:
        bridge = Bridge()
    except RuntimeError as e:
        print(f"tmd.netns hold: {e}", file=sys.stderr)
        return 1
    try:
        lines = [f"NETNS_BRIDGE={bridge.name}", f"NETNS_HOST_IP={bridge.host_ip}"]
        for node in nodes:
            ns = bridge.add(node)
            lines += [f"NETNS_{node}={ns.name}", f"ADDR_{node}={ns.node_ip}"]
        tmp = f"{env_path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            f.write("\n".join(lines) + "\n")
        os.replace(tmp, env_path)
        while not stop.wait(1.0):  # a signal handler runs between the waits
            pass
        return 0
    except RuntimeError as e:
        print(f"tmd.netns hold: {e}", file=sys.stderr)
        return 1
    finally:
        bridge.close()


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tmd.netns", description="Hold network namespaces on a bridge "
                                 "for other programs (see tmd/netns.py). Needs root and iproute2.")
    sub = ap.add_subparsers(dest="command", required=True)
    h = sub.add_parser("hold", help="make a namespace per node on one bridge and hold them until SIGTERM")
    h.add_argument("--env", required=True, metavar="FILE", help="where to write the namespaces and addresses")
    h.add_argument("nodes", nargs="+", metavar="NODE")
    args = ap.parse_args(argv)
    if not available():
        print("tmd.netns hold: network namespaces need root, iproute2 (ip, tc) and a kernel that allows them",
              file=sys.stderr)
        return 1
    return hold(args.nodes, args.env)


if __name__ == "__main__":
    sys.exit(main())

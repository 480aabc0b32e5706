"""tmd.netns: a node's processes in their own network namespace; cut() is a real, silent partition; heal() undoes it.

Needs root and iproute2; skipped elsewhere. Children print readiness lines that the test waits for.
"""
from __future__ import annotations

import json
import os
import queue
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from tmd import netns

pytestmark = pytest.mark.skipif(not netns.available(), reason="needs root, ip/tc and network namespaces")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Child:
    """A subprocess whose stdout lines are read by a thread, so the test can wait for one with a timeout."""

    def __init__(self, argv: list[str], code: str, *args: str) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
        self.popen = subprocess.Popen([*argv, sys.executable, "-c", textwrap.dedent(code), *args], env=env,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, bufsize=1)
        self.lines: queue.Queue = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.popen.stdout:  # type: ignore[union-attr]
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def expect(self, prefix: str, timeout_s: float) -> str:
        """The next line starting with ``prefix`` (other lines are kept in ``seen``)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no line {prefix!r} within {timeout_s} s; output so far: {self.seen}")
            if line is None:
                raise AssertionError(f"child exited ({self.popen.wait()}) before {prefix!r}; output: {self.seen}")
            self.seen.append(line)
            if line.startswith(prefix):
                return line

    def send(self, line: str) -> None:
        self.popen.stdin.write(line + "\n")  # type: ignore[union-attr]
        self.popen.stdin.flush()  # type: ignore[union-attr]

    def wait(self, timeout_s: float) -> int:
        return self.popen.wait(timeout=timeout_s)

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait()


@pytest.fixture
def children():
    started: list[Child] = []

    def start(argv, code, *args) -> Child:
        child = Child(argv, code, *args)
        started.append(child)
        return child

    yield start
    for child in started:
        child.kill()


def _listener(host: str) -> socket.socket:
    srv = socket.socket()
    srv.bind((host, 0))
    srv.listen()
    srv.settimeout(5.0)
    return srv


# --- 1: plain reachability both ways ---------------------------------------------------------------------------
ECHO_CLIENT = """
    import socket, sys
    s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)
    s.sendall(b"ping")
    print("got", s.recv(16).decode())
"""

ECHO_SERVER = """
    import socket, sys
    srv = socket.socket(); srv.bind((sys.argv[1], 0)); srv.listen()
    print("port", srv.getsockname()[1])
    c, _ = srv.accept()
    c.sendall(c.recv(16))
"""


def test_echo_both_ways(children):
    with netns.NodeNamespace("echo", 11) as ns:
        # a server on the host bound to host_ip, a client inside the namespace
        srv = _listener(ns.host_ip)
        client = children(ns.wrap([]), ECHO_CLIENT, ns.host_ip, str(srv.getsockname()[1]))
        conn, (peer, _) = srv.accept()
        assert peer == ns.node_ip
        conn.settimeout(5.0)
        conn.sendall(conn.recv(16))
        assert client.expect("got", 5.0) == "got ping"
        assert client.wait(5.0) == 0
        conn.close()
        srv.close()

        # a server inside the namespace bound to node_ip, a client on the host
        server = children(ns.wrap([]), ECHO_SERVER, ns.node_ip)
        port = int(server.expect("port", 5.0).split()[1])
        with socket.create_connection((ns.node_ip, port), timeout=5.0) as s:
            s.sendall(b"pong")
            assert s.recv(16) == b"pong"
        assert server.wait(5.0) == 0

        # a server bound to 0.0.0.0 on the host accepts from the namespace too
        srv = _listener("0.0.0.0")
        client = children(ns.wrap([]), ECHO_CLIENT, ns.host_ip, str(srv.getsockname()[1]))
        conn, _ = srv.accept()
        conn.settimeout(5.0)
        conn.sendall(conn.recv(16))
        assert client.expect("got", 5.0) == "got ping"
        conn.close()
        srv.close()
    assert ns.name not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert subprocess.run(["ip", "link", "show", ns.host_if], capture_output=True).returncode != 0


# --- 2: cut makes an established TCP connection hang silently; heal resumes it -----------------------------
LOOP_ECHO_CLIENT = """
    import socket, sys
    s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)
    s.settimeout(None)
    print("connected", flush=True)
    while True:
        data = s.recv(64)
        if not data:
            break
        s.sendall(data)
    print("eof")
"""


def test_cut_hangs_established_tcp_and_heal_resumes(children):
    with netns.NodeNamespace("cut", 12) as ns:
        srv = _listener(ns.host_ip)
        client = children(ns.wrap([]), LOOP_ECHO_CLIENT, ns.host_ip, str(srv.getsockname()[1]))
        conn, _ = srv.accept()
        client.expect("connected", 5.0)
        conn.settimeout(5.0)
        conn.sendall(b"a")
        assert conn.recv(64) == b"a"

        t0 = time.monotonic()
        ns.cut()
        cut_s = time.monotonic() - t0
        assert ns.is_cut
        conn.sendall(b"b")  # the send itself succeeds: the kernel only buffers it
        conn.settimeout(1.0)
        with pytest.raises(socket.timeout):  # a timeout, not ConnectionResetError / an ICMP error
            conn.recv(64)
        # a new connection does not get refused either: it hangs in SYN_SENT
        with pytest.raises(socket.timeout):
            socket.create_connection((ns.node_ip, 9), timeout=1.0)
        assert client.popen.poll() is None

        t0 = time.monotonic()
        ns.heal()
        conn.settimeout(8.0)
        assert conn.recv(64) == b"b"  # delivered by TCP's retransmission
        resumed_s = time.monotonic() - t0
        conn.settimeout(5.0)
        conn.sendall(b"c")
        assert conn.recv(64) == b"c"
        print(f"cut() took {cut_s * 1000:.1f} ms; the connection resumed {resumed_s:.2f} s after heal()")
        conn.close()
        client.expect("eof", 5.0)
        srv.close()


# --- 3: ZeroMQ DEALER/ROUTER across the partition --------------------------------------------------------------
DEALER = """
    import sys, zmq
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.connect(sys.argv[1])
    print("ready", flush=True)
    n = 0
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "req":
            n += 1
            s.send(b"req%d" % n)
        wait_ms = 8000 if cmd == "drain" else 1000
        if s.poll(wait_ms):
            print("reply", s.recv().decode(), flush=True)
        else:
            print("timeout", flush=True)
"""


def test_zmq_dealer_stops_getting_replies_when_cut(children):
    import zmq

    with netns.NodeNamespace("zmq", 13) as ns:
        ctx = zmq.Context()
        router = ctx.socket(zmq.ROUTER)
        router.linger = 0
        port = router.bind_to_random_port(f"tcp://{ns.host_ip}")
        stop = threading.Event()

        def serve():
            while not stop.is_set():
                if router.poll(100):
                    ident, msg = router.recv_multipart()
                    router.send_multipart([ident, b"ok-" + msg])

        server = threading.Thread(target=serve, daemon=True)
        server.start()
        try:
            dealer = children(ns.wrap([]), DEALER, f"tcp://{ns.host_ip}:{port}")
            dealer.expect("ready", 5.0)
            dealer.send("req")
            assert dealer.expect("reply", 5.0) == "reply ok-req1"
            ns.cut()
            dealer.send("req")
            assert dealer.expect("", 5.0) == "timeout"
            ns.heal()
            dealer.send("drain")  # the request sent during the cut gets through once TCP retransmits it
            assert dealer.expect("", 10.0) == "reply ok-req2"
            dealer.send("req")
            assert dealer.expect("", 5.0) == "reply ok-req3"
        finally:
            stop.set()
            server.join(5.0)
            router.close()
            ctx.term()


# --- 4: tmd's store and a gloo group across the veth ---------------------------------------------------------
GLOO_RANK = """
    import datetime, sys
    import torch, torch.distributed as dist
    from tmd.protocol.keys import JobKeys
    from tmd.protocol.vocab import Sender
    from worker.store import JobStore
    store_host, port, rank, me, keys = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    store = JobStore(store_host, port, 10.0, JobKeys.load(keys, parties=(Sender.WORKER,)))
    store.set(f"hello{rank}", me)
    print("peer", store.get(f"hello{1 - rank}").decode(), flush=True)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = datetime.timedelta(seconds=10)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=me)]
    pg = dist.ProcessGroupGloo(dist.PrefixStore("netns-test", store), rank, 2, opts)
    t = torch.tensor([float(rank + 1)])
    pg.allreduce([t]).wait()
    print("sum", t.item(), flush=True)
    # Both ranks are done before either tears gloo down: a pair whose peer closed first can abort (SIGABRT) in
    # its destructor at interpreter exit, which says nothing about the veth. Then exit without that teardown.
    store.set(f"done{rank}", "1")
    store.wait([f"done{1 - rank}"])
    import os
    os._exit(0)
"""


def test_the_job_store_and_gloo_across_the_veth(children, tmp_path):
    from tmd.protocol.keys import JobKeys
    from tmd.store import StoreServer

    keys = JobKeys.create(str(tmp_path / "keys"))
    worker_keys = keys.worker_keys()
    with netns.NodeNamespace("gloo", 14) as ns:
        # as tmd does it (tmd/daemon.py): the store on the host; the namespace reaches it at host_ip
        store = StoreServer(ns.host_ip, keys)
        try:
            port = str(store.port)
            host_rank = children([], GLOO_RANK, ns.host_ip, port, "0", ns.host_ip, worker_keys)
            ns_rank = children(ns.wrap([]), GLOO_RANK, ns.host_ip, port, "1", ns.node_ip, worker_keys)
            assert ns_rank.expect("peer", 10.0) == f"peer {ns.host_ip}"
            assert host_rank.expect("peer", 10.0) == f"peer {ns.node_ip}"
            assert store.state.data[b"hello1"].decode() == ns.node_ip
            assert host_rank.expect("sum", 10.0) == "sum 3.0"
            assert ns_rank.expect("sum", 10.0) == "sum 3.0"
            assert host_rank.wait(5.0) == 0 and ns_rank.wait(5.0) == 0
        finally:
            store.stop()


# --- extras: two namespaces reach each other; close() is idempotent; stale namespaces are removed -------------
def test_two_namespaces_reach_each_other_and_cut_isolates_one(children):
    with netns.NodeNamespace("a", 15) as a, netns.NodeNamespace("b", 16) as b:
        server = children(b.wrap([]), ECHO_SERVER, b.node_ip)
        port = server.expect("port", 5.0).split()[1]
        client = children(a.wrap([]), ECHO_CLIENT, b.node_ip, port)
        assert client.expect("got", 5.0) == "got ping"

        server = children(b.wrap([]), ECHO_SERVER, "0.0.0.0")
        port = server.expect("port", 5.0).split()[1]
        a.cut()
        cut_client = children(a.wrap([]), ECHO_CLIENT, b.node_ip, port)
        # the namespace's own loopback still works while it is cut off (ranks of one node still talk)
        local = children(a.wrap([]), ECHO_SERVER, a.node_ip)
        local_port = local.expect("port", 5.0).split()[1]
        local_client = children(a.wrap([]), ECHO_CLIENT, a.node_ip, local_port)
        assert local_client.expect("got", 5.0) == "got ping"
        with pytest.raises(AssertionError):
            cut_client.expect("got", 1.0)
        a.heal()
        assert cut_client.expect("got", 8.0) == "got ping"  # its SYN got through on a retransmission


def test_close_is_idempotent_and_stale_namespaces_are_removed():
    ns = netns.NodeNamespace("idem", 17)
    ns.cut()
    ns.close()
    ns.close()
    with pytest.raises(RuntimeError):
        ns.cut()

    # a namespace left by a process that is gone (its pid is in the name)
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"tm-crashed-{dead.pid}-18"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    subprocess.run(["ip", "link", "add", "tmh18", "type", "veth", "peer", "name", "tmn18", "netns", stale],
                   check=True)
    with netns.NodeNamespace("fresh", 18) as fresh:  # would collide on tmh18 without the cleanup
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert stale not in names and fresh.name in names


def test_setup_failure_is_a_clear_error():
    with netns.NodeNamespace("dup", 19):
        with pytest.raises(RuntimeError, match="tmh19"):
            netns.NodeNamespace("dup2", 19)
        # the failed attempt must not have torn down the live one
        assert subprocess.run(["ip", "link", "show", "tmh19"], capture_output=True).returncode == 0


# --- every process on its own address: a bridge (tmd local --netns-all) -----------------------------------------
def test_bridge_gives_each_namespace_its_own_address_and_cut_still_isolates_one(children):
    bridge = netns.Bridge()
    try:
        a, b = bridge.add("a"), bridge.add("b")
        assert a.node_ip != b.node_ip and a.host_ip == b.host_ip == bridge.host_ip
        assert a.node_ip.rsplit(".", 1)[0] == bridge.host_ip.rsplit(".", 1)[0]  # one subnet, as on one switch
        # b and the host reach a server on a's address through the bridge
        server = children(a.wrap([]), ECHO_SERVER, "0.0.0.0")
        port = server.expect("port", 5.0).split()[1]
        assert children(b.wrap([]), ECHO_CLIENT, a.node_ip, port).expect("got", 5.0) == "got ping"
        server = children(a.wrap([]), ECHO_SERVER, a.node_ip)  # it serves one client: another for the host
        port = server.expect("port", 5.0).split()[1]
        with socket.create_connection((a.node_ip, int(port)), timeout=5.0) as s:
            s.sendall(b"host")
            assert s.recv(16) == b"host"
        # 127.0.0.1 is each namespace's own: a's loopback is out of b's reach
        server = children(a.wrap([]), ECHO_SERVER, "127.0.0.1")
        port = server.expect("port", 5.0).split()[1]
        refused = children(b.wrap([]), ECHO_CLIENT, "127.0.0.1", port)
        refused.expect("ConnectionRefusedError", 5.0)
        assert refused.wait(5.0) != 0
        # a handle from tmd.json's spec cuts b off the bridge; heal() lets the hung connect through
        handle = netns.NodeNamespace.from_spec("b", json.loads(json.dumps(b.spec())))
        server = children(b.wrap([]), ECHO_SERVER, b.node_ip)
        port = server.expect("port", 5.0).split()[1]
        handle.cut()
        cut_client = children(a.wrap([]), ECHO_CLIENT, b.node_ip, port)
        with pytest.raises(AssertionError):
            cut_client.expect("got", 1.0)
        handle.heal()
        assert cut_client.expect("got", 8.0) == "got ping"
        handle.close()  # a handle leaves the namespace alone
        assert b.name in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    finally:
        bridge.close()
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert a.name not in names and b.name not in names
    assert subprocess.run(["ip", "link", "show", bridge.name], capture_output=True).returncode != 0


ENTERED = """
    import socket, subprocess, sys
    from tmd import netns
    bridge = netns.Bridge()
    me = bridge.add("tmd")
    netns.enter(me)
    late = bridge.add("late")  # made from inside a namespace: the ip commands still run in the host's
    srv = socket.socket(); srv.bind((me.node_ip, 0)); srv.listen()
    print("serving", me.node_ip, srv.getsockname()[1], late.name, bridge.name, flush=True)
    for _ in range(2):
        conn, peer = srv.accept()
        print("peer", peer[0], flush=True)
        conn.close()
    sys.stdin.readline()
    bridge.close()
    print("closed", flush=True)
"""


def test_enter_moves_the_process_into_its_namespace_and_it_still_adds_namespaces(children):
    tmd = children([], ENTERED)
    _, ip, port, late, bridge = tmd.expect("serving", 20.0).split()
    with socket.create_connection((ip, int(port)), timeout=5.0):  # the host reaches it through the bridge
        pass
    host_ip = tmd.expect("peer", 5.0).split()[1]
    assert host_ip.startswith(ip.rsplit(".", 1)[0] + ".")  # the host's address on the bridge, not 127.0.0.1
    children(["ip", "netns", "exec", late], ECHO_CLIENT, ip, port)
    assert tmd.expect("peer", 5.0).split()[1] not in (ip, host_ip)  # the late namespace's own address
    tmd.send("")
    tmd.expect("closed", 20.0)
    assert tmd.wait(5.0) == 0
    assert late not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert subprocess.run(["ip", "link", "show", bridge], capture_output=True).returncode != 0


def test_stale_bridge_of_a_dead_process_is_removed():
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"{netns.BRIDGE_PREFIX}250"
    subprocess.run(["ip", "link", "add", stale, "type", "bridge"], check=True)
    subprocess.run(["ip", "link", "set", stale, "alias", f"{netns.PREFIX}{dead.pid}"], check=True)
    bridge = netns.Bridge()
    try:
        assert subprocess.run(["ip", "link", "show", stale], capture_output=True).returncode != 0
    finally:
        bridge.close()

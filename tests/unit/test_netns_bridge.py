"""tmd.netns.Bridge keeps one MAC address: a namespace joining the bridge (a standby added by request under
``tmd local --netns-all``) does not cut the replies tmd's namespace is sending to the host (tmctl's).

Needs root and iproute2; skipped elsewhere."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import pytest

from tmd import netns

pytestmark = [pytest.mark.skipif(not netns.available(), reason="needs root, ip/tc and network namespaces"),
              pytest.mark.timeout(30)]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# tmd's part: answer a first message at once, then a request only once told (a standby joined meanwhile)
SERVER = """
    import socket, sys
    srv = socket.socket(); srv.bind((sys.argv[1], 0)); srv.listen()
    print("port", srv.getsockname()[1], flush=True)
    c, _ = srv.accept()
    c.sendall(c.recv(16))
    print("request", c.recv(16).decode(), flush=True)
    sys.stdin.readline()
    c.sendall(b"reply")
    sys.stdin.readline()
"""


def mac(dev: str) -> str:
    with open(f"/sys/class/net/{dev}/address") as f:
        return f.read().strip()


def set_mac(ns: netns.NodeNamespace, address: str) -> None:
    """Give ``ns``'s end on the bridge (a port) ``address``, as its random one might be."""
    subprocess.run(["ip", "link", "set", "dev", ns.host_if, "address", address], check=True)


def test_a_reply_to_the_host_gets_through_while_a_namespace_with_the_lowest_mac_joins_the_bridge():
    """A Linux bridge whose address was not set takes the lowest of its ports' MACs: a namespace joining with a
    lower one changed it, the host's neighbour entries were flushed, and tmd's namespace, holding the old MAC,
    sent its replies to an address the host no longer took as its own (dropped) until its neighbour entry went
    stale, 15-45 s later: the chaos soak's AddStandbyRequest got no reply in 10 s (tmctl: "connected, no
    reply"). The bridge has an address of its own now, which no port changes."""
    bridge = netns.Bridge()
    server = None
    try:
        tmd, node = bridge.add("tmd"), bridge.add("n1")
        set_mac(node, "02:00:00:00:00:02")  # below tmd's port: the bridge's MAC, were it the ports' lowest
        server = subprocess.Popen([*tmd.wrap([]), sys.executable, "-c", textwrap.dedent(SERVER), tmd.node_ip],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                  env={**os.environ, "PYTHONPATH": REPO})
        port = int(server.stdout.readline().split()[1])
        with socket.create_connection((tmd.node_ip, port), timeout=5.0) as s:
            s.sendall(b"ping")
            assert s.recv(16) == b"ping"  # each side has the other's MAC now
            s.sendall(b"add")
            assert server.stdout.readline().split() == ["request", "add"]
            before = mac(bridge.name)
            late = bridge.add("x1")  # a standby added by request, its port the lowest MAC on the bridge
            set_mac(late, "02:00:00:00:00:01")
            server.stdin.write("\n")
            server.stdin.flush()
            s.settimeout(3.0)
            assert s.recv(16) == b"reply"  # before: socket.timeout (the reply went to the bridge's old MAC)
        assert mac(bridge.name) == before
    finally:
        if server is not None:
            server.kill()
            server.wait()
        bridge.close()

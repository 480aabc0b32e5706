"""The data plane's network interface (``--iface``, ``TM_IFNAME``; tmd/netif.py): an interface that exists resolves
to its address, a missing one fails in one line naming node and interface, and the address a rank uses reaches
tmd in Register and ``tmctl status``."""
from __future__ import annotations

import socket
import subprocess
import sys
from types import SimpleNamespace

import pytest

from tmd import netif
from tmd import protocol as p
from tmd.registry import Registry, Worker
from tmd.status import node_status
from tmctl.render import nodes_table

NOPE = "tm-nope0"  # an interface no test machine has


def test_an_interface_that_exists_resolves_to_its_ipv4_address():
    assert netif.resolve("lo", "n1") == "127.0.0.1"
    assert netif.data_plane_env("lo", "n1") == {"TM_GLOO_HOST": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo",
                                                "NCCL_SOCKET_IFNAME": "lo"}


def test_a_missing_interface_fails_in_one_line_naming_node_and_interface():
    with pytest.raises(netif.InterfaceError) as e:
        netif.resolve(NOPE, "n7")
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"node n7: network interface '{NOPE}' does not exist (this node has: ")
    assert "lo" in msg.split("this node has: ")[1]  # says what the node has instead


def test_an_interface_without_an_ipv4_address_is_refused(monkeypatch):
    v6 = SimpleNamespace(family=socket.AF_INET6, address="fe80::1")
    monkeypatch.setattr(netif.psutil, "net_if_addrs", lambda: {"lo": [v6], "ib0": []})
    with pytest.raises(netif.InterfaceError, match="^node n2: network interface 'ib0' has no IPv4 address$"):
        netif.resolve("ib0", "n2")


def test_the_interface_holding_an_address():
    assert netif.interface_of("127.0.0.1") == "lo"
    assert netif.interface_of("192.0.2.1") is None  # TEST-NET-1: never a local address


@pytest.mark.parametrize("name", ["eth0", "ib0", "tm0", "enp1s0f0.100", "bond0:1", "a" * 15])
def test_interface_names_that_are_accepted(name):
    assert netif.check_name(name) == name


@pytest.mark.parametrize("name", ["", "a" * 16, "eth 0", "../eth0", "eth0/x", ".", "..", "e\nth"])
def test_interface_names_that_are_refused(name):
    with pytest.raises(ValueError, match="is not a network interface name"):
        netif.check_name(name)


def test_a_rank_binds_the_interface_it_is_given_and_tells_tmd(monkeypatch):
    from worker import backend

    for var in ("TM_GLOO_HOST", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(netif.ENV, "lo")
    assert backend.data_plane("n1", "tcp://192.0.2.1:5555") == ("lo", "127.0.0.1")  # the interface wins
    assert backend.gloo_host("192.0.2.1") == "127.0.0.1"  # every group built later binds it
    import os
    assert os.environ["GLOO_SOCKET_IFNAME"] == os.environ["NCCL_SOCKET_IFNAME"] == "lo"
    monkeypatch.setenv(netif.ENV, NOPE)
    with pytest.raises(netif.InterfaceError, match=f"node n1: network interface '{NOPE}'"):
        backend.data_plane("n1", "tcp://127.0.0.1:5555")


def test_without_an_interface_a_rank_reports_the_one_routing_to_tmd(monkeypatch):
    from worker import backend

    monkeypatch.delenv(netif.ENV, raising=False)
    monkeypatch.delenv("TM_GLOO_HOST", raising=False)
    assert backend.data_plane("n1", "tcp://127.0.0.1:5555") == ("lo", "127.0.0.1")


def test_worker_init_on_a_node_without_the_interface_exits_at_once_in_one_line():
    # tmd's address is never answered: registering would wait forever; the process must end before that
    env = {"TM_COORDINATOR": "tcp://192.0.2.1:9", "TM_NODE": "n9", "TM_LOCAL_RANK": "0", netif.ENV: NOPE,
           "PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)}
    r = subprocess.run([sys.executable, "-c", "import worker; worker.init()"], env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == p.ExitCode.REFUSED, r
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"[worker] exiting with code 2 (REFUSED): node n9: network interface '{NOPE}' "
                               "does not exist"), lines


def test_register_carries_the_data_plane_and_status_shows_it_per_node():
    msg = p.Register(node="n1", local_rank=0, pid=1, host="h", standby=False, iface="tm0", data_host="10.214.0.3")
    assert p.decode(p.encode(msg)) == msg
    with pytest.raises(p.ProtocolError, match="iface"):
        p.decode(p.encode(p.Register(node="n1", local_rank=0, pid=1, host="h", standby=False, iface="x" * 65)))
    reg = Registry(["n1", "n2"], 1, [])
    reg.add_worker(Worker(b"n1/0/x", "n1", 0, 11, "h", iface="tm0", data_host="10.214.0.3"))
    reg.add_worker(Worker(b"n2/0/x", "n2", 0, 12, "h"))  # an older worker: says nothing
    n1, n2 = (node_status(reg.nodes[n], 0.0, []) for n in ("n1", "n2"))
    assert (n1["iface"], n1["address"]) == ("tm0", "10.214.0.3")
    assert (n2["iface"], n2["address"]) == (None, None)
    from rich.console import Console
    console = Console(width=200, record=True)
    console.print(nodes_table([n1, n2]))
    text = console.export_text()
    assert "network" in text and "tm0 10.214.0.3" in text


# --- `python -m tmd.netns hold`: the namespaces of slurm/local-cluster.sh --multihost -------------------------------
def test_hold_refuses_node_names_a_shell_variable_cannot_carry(tmp_path, capsys):
    from tmd import netns

    assert netns.hold(["n1", "n-2"], str(tmp_path / "netns.env")) == 1
    assert "node names must be distinct letters, digits and _" in capsys.readouterr().err
    assert not (tmp_path / "netns.env").exists()


def test_hold_gives_each_node_its_own_address_on_tm0_and_deletes_them_when_stopped(tmp_path):
    import threading

    from tmd import netns

    if not netns.available():
        pytest.skip("needs root and iproute2")
    env_file, stop = tmp_path / "netns.env", threading.Event()
    held: dict[str, str] = {}

    def look() -> None:  # while it holds them: each namespace has tm0 at its node's address
        while not env_file.exists():
            threading.Event().wait(0.05)
        held.update(line.split("=", 1) for line in env_file.read_text().split())
        for node in ("n1", "n2"):
            out = subprocess.run(["ip", "-n", held[f"NETNS_{node}"], "-4", "-o", "addr", "show", "dev", "tm0"],
                                 capture_output=True, text=True).stdout
            held[f"seen_{node}"] = out.split()[3].split("/")[0] if out else ""
        stop.set()
    t = threading.Thread(target=look)
    t.start()
    assert netns.hold(["n1", "n2"], str(env_file), stop) == 0
    t.join()
    assert held["seen_n1"] == held["ADDR_n1"] != held["seen_n2"] == held["ADDR_n2"]
    assert held["NETNS_HOST_IP"].startswith("10.214.") and held["ADDR_n1"].startswith("10.214.")
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert held["NETNS_n1"] not in names and held["NETNS_n2"] not in names
    assert subprocess.run(["ip", "link", "show", held["NETNS_BRIDGE"]], capture_output=True).returncode != 0


# --- the command line ---------------------------------------------------------------------------------------------
def test_tmd_local_refuses_a_name_that_is_no_interface_name_in_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "tmd.cli", "local", "--run-dir", str(tmp_path / "run"), "--iface",
                        "eth0/x", "--", sys.executable, "-c", "pass"], capture_output=True, text=True, timeout=60)
    assert r.returncode == p.ExitCode.REFUSED, r
    assert r.stderr.strip().splitlines() == [
        "error: Invalid value for --iface: 'eth0/x' is not a network interface name (1 to 15 characters of letters, "
        "digits and _.:@-)"], r.stderr
    assert not (tmp_path / "run").exists()


def test_tmd_slurm_refuses_an_interface_its_own_node_lacks_in_one_line(tmp_path):
    env = {**os_environ(), "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "n1", "SLURMD_NODENAME": "n1",
           "TM_STATE_DIR": str(tmp_path / "state"), "TM_IFNAME": NOPE}  # the environment variable, as --iface
    env.pop("TM_HOST", None)
    r = subprocess.run([sys.executable, "-m", "tmd.cli", "slurm", "--", sys.executable, "-c", "pass"], env=env,
                       cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == p.ExitCode.REFUSED, r
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: node n1: network interface '{NOPE}' does not exist"), r


def os_environ() -> dict[str, str]:
    import os

    return dict(os.environ)

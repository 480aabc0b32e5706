"""Multi-host for real: ``tmd local --netns-all`` puts tmd and every node in a network namespace of its own, each
with its own address on one bridge (tmd/netns.py), so nothing passes by assuming 127.0.0.1 or one host.

Once each that way: the demo (a planned migration n2 -> s1) and a partition of a node (cut off the bridge;
recovery onto standby s1, which also checks the addresses each process is given, with ``--iface tm0``: each
node's data plane on its own bridge interface, as ``tmctl status`` shows). Both end bit-identical to the
demo's plain reference run (tiny GPT, same steps). A kill -9 of a node's ranks in the optimizer step is
test_failures.test_kill_node_during_a_step (one namespace); the recovery path across namespaces is the partition's.
Needs root, iproute2 and nsenter; skipped elsewhere.
"""
from __future__ import annotations

import ipaddress
import json
import os
import shutil
import subprocess
import sys

import pytest

from tmctl.client import Client, find_keys
from tmctl.localjob import end_job, events, final_hashes, tmd_command, wait_for_address, wait_until
from tmd import netns
from tmd import protocol as p

pytestmark = pytest.mark.skipif(not (netns.available() and shutil.which("nsenter")),
                                reason="needs root, ip/tc, nsenter and network namespaces")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 40
PAD_S = 0.05  # tiny steps take ~20 ms: the switch step (~0.5 s of training ahead) could fall past the job's end


def _tmd_json(run_dir: str) -> dict:
    with open(p.layout.RunDir(run_dir).tmd_json) as f:
        return json.load(f)


def _assert_every_process_on_its_own_address(info: dict) -> None:
    """tmd.json: tmd binds and advertises its own namespace's address; every node has another one, on the bridge."""
    specs = info["netns"]
    tmd_ip = specs[netns.TMD_KEY]["node_ip"]
    assert info["address"].startswith(f"tcp://{tmd_ip}:"), info["address"]
    ips = [s["node_ip"] for s in specs.values()]
    assert len(set(ips)) == len(ips) == 4, specs  # tmd, n1, n2, s1
    assert all(ipaddress.ip_address(ip) in ipaddress.ip_network("10.214.0.0/16") for ip in ips)
    assert len({s["bridge"] for s in specs.values()}) == 1


def _assert_cleaned_up(info: dict) -> None:
    """The namespaces and the bridge of a finished job are gone."""
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not [s["name"] for s in info["netns"].values() if s["name"] in names]
    bridge = info["netns"][netns.TMD_KEY]["bridge"]
    assert subprocess.run(["ip", "link", "show", bridge], capture_output=True).returncode != 0


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> tuple[str, dict]:
    """The demo with ``--netns-all``: (its run dir, its JSON result). Its reference run (plain) serves every test."""
    run_dir = str(tmp_path_factory.mktemp("demo"))
    res = subprocess.run([sys.executable, "-m", "examples.demo", "--tiny", "--steps", str(STEPS), "--migrate-at",
                          "12", "--min-step-time-s", str(PAD_S), "--run-dir", run_dir, "--netns-all"], cwd=REPO, capture_output=True, text=True,
                         timeout=500)
    lines = res.stdout.strip().splitlines()
    assert lines, res.stderr[-3000:]
    return run_dir, {"rc": res.returncode, "stderr": res.stderr, **json.loads(lines[-1])}


@pytest.mark.timeout(600)
def test_demo_migration_with_every_process_in_its_own_namespace(demo):
    run_dir, result = demo
    assert result["rc"] == 0 and result["bit_identical"], (result, result["stderr"][-3000:])
    (m,) = result["migrations"]
    assert m["state"] == p.MigrationState.COMMITTED and (m["from"], m["to"]) == ("n2", "s1")
    mig_dir = os.path.join(run_dir, "migration")
    info = _tmd_json(mig_dir)
    _assert_every_process_on_its_own_address(info)
    started = next(e for e in events(mig_dir) if e["event"] == p.Event.TMD_STARTED)
    assert started["address"] == info["address"]
    _assert_cleaned_up(info)


@pytest.mark.timeout(600)
def test_partition_of_a_node_with_every_process_in_its_own_namespace(tmp_path, demo):
    reference = final_hashes(os.path.join(demo[0], "reference"))
    assert len(reference) == 4
    run_dir = str(tmp_path / "job")
    cmd = tmd_command(run_dir, 1, STEPS, True, True, ("--min-step-time-s", "0.03"))
    cmd[cmd.index("--"):cmd.index("--")] = ["--netns-all", "--iface", "tm0"]  # every node's bridge interface
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL)
    try:
        wait_for_address(run_dir, proc)
        info = _tmd_json(run_dir)
        _assert_every_process_on_its_own_address(info)
        # tmctl, in the host namespace, reaches tmd through the bridge
        with Client(info["address"], timeout_s=10.0, keys_dir=find_keys(run_dir, None)) as client:
            wait_until(lambda: client.request(p.StatusRequest()).step >= 8, 120, "training")
            nodes = client.request(p.StatusRequest()).nodes
            # --iface tm0: each node's data plane on its own namespace's tm0, as status shows
            assert {n["name"]: (n["iface"], n["address"]) for n in nodes} == {
                node: ("tm0", info["netns"][node]["node_ip"]) for node in ("n1", "n2", "s1")}
        # every rank is told to bind gloo to its own node's address and to reach tmd at tmd's
        for node in ("n1", "n2", "s1"):
            pids = [e["pid"] for e in events(run_dir) if e["event"] == p.Event.WORKER_REGISTERED and e["node"] == node]
            assert len(pids) == 2, (node, pids)
            for pid in pids:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
                assert env[b"TM_GLOO_HOST"].decode() == info["netns"][node]["node_ip"]
                assert env[b"TM_COORDINATOR"].decode() == info["address"]
        n2 = netns.NodeNamespace.from_spec("n2", info["netns"]["n2"])
        n2.cut()  # n2 drops off the bridge: its processes live on, no packet gets in or out
        done = wait_until(lambda: [e for e in events(run_dir) if e["event"] == p.Event.RECOVERY_DONE], 120,
                          "recovery_done")
        n2.heal()
        rc = proc.wait(timeout=300)
    finally:
        end_job(proc)
    journal = events(run_dir)
    assert rc == 0, [e for e in journal if e["event"] in (p.Event.JOB_FAILED, p.Event.NODE_FAILED)]
    failed = [e for e in journal if e["event"] == p.Event.NODE_FAILED]
    assert [(e["node"], e["signal"]) for e in failed] == [("n2", p.FailureSignal.SILENT)]
    assert len(done) == 1 and done[0]["standbys"] == {"n2": "s1"}
    assert final_hashes(run_dir) == reference
    _assert_cleaned_up(info)

"""SLURM mode across emulated hosts: ``slurm/local-cluster.sh up DIR --multihost`` runs every slurmd in a network
namespace of its own, with its own address on a bridge (tmd/netns.py), and slurmctld on the bridge's address, so
nothing works by 127.0.0.1: tmd (in the batch script on n1), the ranks srun starts on n2, the standbys and the
prolog/epilog each live in their node's namespace, and reach each other as separate hosts would.

One cluster, one training job (2 nodes x 1 rank, ``--iface tm0``: every node's bridge interface) and two standby
jobs, in order: every node uses its own address on tm0 (``tmctl status``); an admin's drain of n2 migrates it to a
standby; a kill -9 of the rank that moved there recovers onto the other standby; the final state is bit-identical
to an uninterrupted run; no standby job outlives the training job. Other tests pass more ``tmd slurm`` options
with :func:`submit` (``tmd_args``). Needs what tests/e2e/test_slurm.py needs, and network namespaces.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from tmctl.localjob import final_hashes, wait_until
from tests.e2e.test_slurm import (  # noqa: F401 (reference: the uninterrupted run, a fixture)
    CLUSTER_SH, PACE_S, STEPS, Cluster, SlurmJob, leftovers, reference, slurm_missing,
)
from tmd import netns
from tmd.protocol.vocab import Event

IFACE = "tm0"  # each namespace's end of its veth (tmd.netns.BRIDGE_NS_IF)
TMD_ARGS = ("--quiet", "--poll-s", "0.5", "--iface", IFACE)
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL")


def netns_missing() -> str:
    if not (netns.available() and shutil.which("nsenter")):
        return "needs root, ip/tc, nsenter and network namespaces"
    return ""


@pytest.fixture(scope="module")
def cluster():
    why = slurm_missing() or netns_missing()
    if why:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true but the multi-host SLURM tests cannot run: {why}")
        pytest.skip(why)
    path = tempfile.mkdtemp(prefix="tm-slurm-mh-")
    c = Cluster(path)
    for var in ("TM_HOST", "TM_GLOO_HOST"):  # tmd binds --iface's address on its node; each rank its own
        c.env.pop(var)
    t0 = time.monotonic()
    up = subprocess.run([CLUSTER_SH, "up", path, "--hooks", sys.executable, "--multihost"], env=c.env,
                        capture_output=True, text=True, timeout=150)
    try:
        assert up.returncode == 0, f"local cluster did not come up: {up.stderr.strip()}"
        print(f"\n[slurm-multihost] cluster up in {time.monotonic() - t0:.2f} s", flush=True)
        with open(os.path.join(path, "etc", "netns.env")) as f:
            c.netns = dict(line.strip().split("=", 1) for line in f if "=" in line)
        yield c
    finally:
        down = subprocess.run([CLUSTER_SH, "down", path], env=c.env, capture_output=True, text=True, timeout=120)
        left = leftovers(path)
        bridge = getattr(c, "netns", {}).get("NETNS_BRIDGE")
        bridge_left = bridge and subprocess.run(["ip", "link", "show", bridge], capture_output=True).returncode == 0
        if down.returncode == 0 and not left and not bridge_left:
            shutil.rmtree(path, ignore_errors=True)
        assert down.returncode == 0, down.stderr
        assert not left, f"still running after teardown: {left}"
        assert not bridge_left, f"bridge {bridge} left after teardown"


def submit(cluster: Cluster, tmd_args: tuple[str, ...] = TMD_ARGS, standby_jobs: int = 2) -> SlurmJob:
    """Submit the training job (``tmd slurm`` with ``tmd_args``) and ``standby_jobs`` standby jobs for it."""
    run_dir = os.path.join(cluster.dir, "run")
    jid = cluster.sbatch("--output", os.path.join(cluster.dir, "train-%j.out"), "slurm/train.sbatch",
                         sys.executable, "-m", "examples.train_gpt", "--steps", str(STEPS), "--tiny",
                         "--min-step-time-s", str(PACE_S), TM_RUN_DIR=run_dir, TM_TMD_ARGS=" ".join(tmd_args))
    standbys = [cluster.sbatch("--reservation=standby", "--output", os.path.join(cluster.dir, "standby-%j.out"),
                               "slurm/standby.sbatch", jid) for _ in range(standby_jobs)]
    return SlurmJob(cluster, jid, run_dir, standbys)


@pytest.fixture(scope="module")
def job(cluster):
    j = submit(cluster)
    wait_until(lambda: os.path.exists(os.path.join(cluster.state_dir, "jobs", j.id, "tmd.json")), 60, "tmd.json")

    def ready():
        st = j.status()
        return st["step"] > 5 and sum(1 for n in st["nodes"] if n["warm"]) == 2 and st
    wait_until(ready, 120, "training and two warm standbys")
    yield j
    for s in [j.id, *j.standby_jobs]:
        cluster.run("scancel", s, check=False)


def out_of(job: SlurmJob) -> str:
    with open(os.path.join(job.cluster.dir, f"train-{job.id}.out")) as f:
        return f.read()[-3000:]


@pytest.mark.timeout(330)  # includes bringing the cluster up and warming the standbys
def test_every_node_uses_its_own_address_on_the_interface_asked_for(job):
    addr = job.cluster.netns
    with open(os.path.join(job.cluster.dir, "etc", "slurm.conf")) as f:
        assert "127.0.0.1" not in f.read()  # slurmctld and every slurmd on the bridge
    with open(os.path.join(job.cluster.state_dir, "jobs", job.id, "tmd.json")) as f:
        assert json.load(f)["address"].startswith(f"tcp://{addr['ADDR_n1']}:")  # tmd on its batch host's tm0
    nodes = job.status()["nodes"]
    assert {n["name"] for n in nodes} == {"n1", "n2", "n4", "n5"}
    assert {n["name"]: (n["iface"], n["address"]) for n in nodes} == {
        name: (IFACE, addr[f"ADDR_{name}"]) for name in ("n1", "n2", "n4", "n5")}
    assert len({addr[f"ADDR_n{i}"] for i in range(1, 6)}) == 5 and not any(
        a.startswith("127.") for k, a in addr.items() if k.startswith("ADDR_"))
    r = job.cluster.tmctl("--job", job.id, "status")  # the table an operator reads
    assert r.returncode == 0 and f"{IFACE} {addr['ADDR_n2']}" in r.stdout, r


@pytest.mark.timeout(120)
def test_a_drain_migrates_n2_to_a_standby(job):
    job.cluster.run("scontrol", "update", "NodeName=n2", "State=DRAIN", "Reason=maintenance")
    ev = wait_until(lambda: job.event("drain_migration", node="n2"), 30, "the drain migration to start")
    done = wait_until(lambda: job.event("migration_committed", migration_id=ev["migration_id"]) or
                      job.event("migration_aborted", migration_id=ev["migration_id"]), 90, "the drain migration")
    assert done["event"] == "migration_committed", done
    roles = {n["name"]: n["role"] for n in job.status()["nodes"]}
    assert roles["n2"] == "left" and roles[ev["target"]] == "active"
    wait_until(lambda: job.event("slurm_node_released", node="n2"), 30, "n2 released from the job")
    job.moved_to = ev["target"]


@pytest.mark.timeout(120)
def test_a_kill_9_of_a_node_recovers_onto_the_other_standby(job):
    node = getattr(job, "moved_to", None)
    assert node, "the drain migration did not commit"
    (pid,) = {n["name"]: n for n in job.status()["nodes"]}[node]["pids"].values()
    os.kill(pid, signal.SIGKILL)  # its rank, in the node's namespace (one pid namespace: this host)
    failed = wait_until(lambda: job.event("node_failed", node=node), 30, f"{node} to be failed")
    done = wait_until(lambda: job.event(Event.RECOVERY_DONE), 90, "the recovery")
    spare = ({"n4", "n5"} - {node}).pop()
    assert done["standbys"] == {node: spare}, (failed, done)
    roles = {n["name"]: n["role"] for n in job.status()["nodes"]}
    assert roles[node] == "failed" and roles[spare] == "active" and roles["n1"] == "active"


@pytest.mark.timeout(300)
def test_the_job_completes_bit_identical_and_no_standby_job_outlives_it(job, reference):
    c = job.cluster
    wait_until(lambda: c.job_state(job.id) in ENDED, 200, "the training job to end")
    assert c.job_state(job.id) == "COMPLETED", out_of(job)
    got, ref = final_hashes(job.run_dir), reference()
    assert len(ref) == 2 and got == ref
    names = [e["event"] for e in job.events()]
    assert names.count("migration_committed") == 1 and names.count("recovery_done") == 1, names
    assert "job_failed" not in names and "migration_aborted" not in names
    for s in job.standby_jobs:
        wait_until(lambda s=s: c.job_state(s) in ENDED, 30, f"standby job {s} to end")

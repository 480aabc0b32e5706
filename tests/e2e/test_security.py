"""Attacks on a running job's control plane (issue 10): strangers, forged workers and other users have no effect.

One local job (2 nodes x 2 ranks, standby s1, a tiny GPT) is attacked while it trains:
- unauthenticated senders (a plain ZeroMQ DEALER, and a CURVE client with a key of its own) send a migrate
  request, forged worker messages under a worker's old predictable identity (``n2/0``) and an add-standby
  request: none gets a reply, none reaches the journal;
- the job's own client key sending worker messages (Done, a collective failure report) is refused by role;
- a process with the job's worker key that claims to be a registered worker is refused, and the real one goes on;
- a process of another uid (nobody) can read neither the run directory nor the keys, and cannot command the job;
then the job must end with exit code 0, no migration, failure or recovery in its journal, and every rank's final
state bit-identical to an uninterrupted run. The rogue-coordinator attack is in tests/e2e/test_tmd_restart.py
(it needs tmd down).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import zmq

from tests.support import events, wait_until
from tests.support.job import final_hashes, job_client, tmd_command
from tmd import protocol as p
from tmd.protocol.keys import JobKeys

pytestmark = pytest.mark.timeout(240)

STEPS = 400
ARGS = ("--min-step-time-s", "0.03")  # does not change the numerics
NOBODY = 65534


def dealer(address: str, identity: bytes | None = None, keys: JobKeys | None = None,
           party: p.Sender | None = None, stranger: bool = False) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if identity:
        sock.setsockopt(zmq.IDENTITY, identity)
    if stranger:  # a CURVE client with a key pair of its own, pinning tmd's real public key
        public, secret = zmq.curve_keypair()
        sock.curve_publickey, sock.curve_secretkey = public, secret
        sock.curve_serverkey = keys.public(p.Sender.COORDINATOR)
    elif keys is not None:
        keys.connect_as(sock, party)
    sock.connect(address)
    return sock


FORGED = [
    p.MigrateRequest(sources=["n2"], targets=["s1"]),
    p.AddStandbyRequest(node="s9"),
    p.EventsRequest(after=0, limit=10),
    p.Done(rank=2, final_step=5, left=False),
    p.RecoveryReport(incident_id=0, rank=2, phase=p.RecoveryPhase.COLLECTIVE_FAILED, ok=False, error="forged",
                     committed_step=-1, bytes_moved=0, seconds=0.0),
    p.Heartbeat(step=1, counters={"xid": 79}),
]


def as_nobody(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *argv],
                          capture_output=True, text=True, timeout=60, cwd="/", env={**os.environ, **(env or {})})


def test_attacks_have_no_effect_on_the_job(tmp_path, gpt_reference):
    reference = gpt_reference(STEPS)  # before the job: never alongside it
    run_dir = str(tmp_path / "job")
    proc = subprocess.Popen(tmd_command(run_dir, 1, STEPS, True, True, ARGS), stdout=subprocess.DEVNULL)
    try:
        client = job_client(run_dir, proc)
        status = lambda: client.request(p.StatusRequest())  # noqa: E731
        wait_until(lambda: status().step > 5 and any(n["warm"] for n in status().nodes), 120, "training, warm s1")
        address = client.address
        keys = JobKeys.load(os.path.join(run_dir, "keys"))

        # 1. strangers: nothing they send is answered or acted on
        for sock in (dealer(address, b"n2/0"), dealer(address, b"n2/0", keys, stranger=True)):
            for msg in FORGED:
                sock.send(p.encode(msg))
            assert sock.poll(1500) == 0, "a stranger got a reply"
            sock.close()
        # 2. the job's client key may send requests only
        sock = dealer(address, b"n2/0", keys, p.Sender.CLIENT)
        for msg in FORGED[3:]:
            sock.send(p.encode(msg))
        sock.send(p.encode(p.StatusRequest()))  # answered once the forged ones were handled (one connection: FIFO)
        assert sock.poll(20_000) and isinstance(p.decode(sock.recv()), p.StatusReply)
        sock.close()
        # 3. the job's worker key claiming a registered worker's place
        sock = dealer(address, b"n2/0/forged", keys, p.Sender.WORKER)
        sock.send(p.encode(p.Register(node="n2", local_rank=0, pid=4242, host="elsewhere", standby=False)))
        assert sock.poll(20_000)
        reply = p.decode(sock.recv())
        assert isinstance(reply, p.Release) and reply.exit_code == p.ExitCode.REFUSED
        sock.send(p.encode(p.Done(rank=2, final_step=5, left=False)))  # still nobody: refused
        sock.close()
        # 4. another user: cannot read the run directory or the keys, cannot talk to the job
        r = as_nobody(sys.executable, "-m", "tmctl.cli", "status", "--run-dir", run_dir, "--timeout", "1")
        assert r.returncode == 2 and "Permission denied" in r.stderr, r
        r = as_nobody("cat", os.path.join(run_dir, "keys", "client.key_secret"))
        assert r.returncode != 0 and "Permission denied" in r.stderr, r
        r = as_nobody(sys.executable, "-m", "tmctl.cli", "migrate", "--from", "n2", "--to", "s1",
                      "--coordinator", address, "--timeout", "1", env={"TM_KEYS": ""})
        assert r.returncode == 2 and "authentication failed" in r.stderr, r
        r = as_nobody(sys.executable, "-m", "tmctl.cli", "status", "--coordinator", address, "--timeout", "1",
                      env={"TM_KEYS": os.path.join(run_dir, "keys")})
        assert r.returncode == 2 and "cannot read the job's keys" in r.stderr, r

        st = status()
        assert all(n["health"] == "healthy" for n in st.nodes if n["role"] == "active") and st.migration is None
        assert proc.wait(timeout=180) == 0
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=30)
    ev = events(run_dir)
    names = [e["event"] for e in ev]
    for harmful in ("migration_requested", "node_failed", "recovery_started", "collective_failed", "job_failed",
                    "standby_added", "gpu_unhealthy", "evacuation_started", "rank_left"):
        assert harmful not in names, (harmful, [e for e in ev if e["event"] == harmful])
    assert names.count("rank_done") == 4
    refused = [e for e in ev if e["event"] == "register_refused"]
    assert len(refused) == 1 and refused[0]["node"] == "n2", refused
    assert any(e["event"] in ("bad_message", "bad_messages_dropped") for e in ev)
    assert all(not str(e.get("sender", "")).startswith("n2/0") or e["event"] != "worker_registered" for e in ev)

    assert final_hashes(run_dir) == reference
    with open(os.path.join(run_dir, "tmd.json")) as f:
        assert json.load(f)["keys"] == os.path.join(run_dir, "keys")

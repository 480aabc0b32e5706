"""End to end, in local mode with real processes: tmd, 2 nodes x 2 ranks and a standby node, a tiny GPT.

One job serves the tests of this module, in order (each test leaves the job running and healthy):
bad tmctl input and malformed messages are refused without harm, a joiner killed during warm-up aborts its
migration, a second migration to the restarted standby commits, and the final state is bit-identical to an
uninterrupted run of the same seed.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import zmq

from tmctl.localjob import (end_job, end_padding, events, final_hashes, job_client, pace_args, start_tmd, tmd_command,
                            tmd_log, wait_until)
from tmd import protocol as p
from tmd.protocol.keys import JobKeys


STEPS = 400
# Per-node subgroups (a collective in them every step), and steps padded so the job outlives the tests: 400 x
# 0.09 s = 36 s, against about 17 s for the tests before test_final_state once s1 is warm (2-core machine), which
# then waits for the rest. Neither changes the numerics.
ARGS = ("--group-size", "2", "--min-step-time-s", "0.09")


def run_tmctl(run_dir: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tmctl.cli", *args, "--run-dir", run_dir],
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def job(tmp_path_factory, gpt_reference):
    reference = gpt_reference(STEPS)  # before the job: never alongside it
    run_dir = str(tmp_path_factory.mktemp("job"))
    proc = start_tmd(tmd_command(run_dir, 1, STEPS, True, True, ARGS + pace_args(run_dir)), tmd_log(run_dir))
    try:
        client = job_client(run_dir, proc)
        status = lambda: client.request(p.StatusRequest())  # noqa: E731
        wait_until(lambda: status().step > 5 and any(n["warm"] for n in status().nodes), 120,
                   "training and a warm s1")
        yield {"proc": proc, "run_dir": run_dir, "client": client, "status": status, "reference": reference}
    finally:
        end_job(proc)


@pytest.mark.timeout(180)  # the first also starts the job (and the shared reference, unless cached)
@pytest.mark.parametrize("args, message", [
    (("--from", "n9", "--to", "s1"), "unknown node 'n9'"),
    (("--from", "s1", "--to", "s1"), "s1 is not an active node (it is standby)"),
    (("--from", "n2", "--to", "s7"), "unknown standby 's7'"),
    (("--from", "n2", "--to", "n1"), "n1 is not a standby (it is active)"),
])
def test_bad_migrate_requests_fail_with_one_line(job, args, message):
    before = job["status"]().step
    r = run_tmctl(job["run_dir"], "migrate", *args)
    assert r.returncode == 2, r
    assert r.stderr.strip().count("\n") == 0 and message in r.stderr, r.stderr
    wait_until(lambda: job["status"]().step > before, 30, "training to go on")


@pytest.mark.timeout(30)
def test_no_coordinator_reachable(tmp_path):
    (tmp_path / "tmd.json").write_text(json.dumps({"address": "tcp://127.0.0.1:9"}))
    r = run_tmctl(str(tmp_path), "status", "--timeout", "0.3")
    assert r.returncode == 2 and r.stderr.startswith("error: connection refused at tcp://127.0.0.1:9"), r


@pytest.mark.timeout(60)
def test_malformed_and_unknown_messages_are_logged_and_ignored(job):
    """Each bad frame from its own authenticated client connection (refusals are journalled once per sender per
    second: see tmd.bad_input), then a request on the same connection proves tmd handled it."""
    keys = JobKeys.load(os.path.join(job["run_dir"], "keys"))
    address = json.load(open(os.path.join(job["run_dir"], "tmd.json")))["address"]
    for frames in [[b"\x00garbage"], [b'{"v": 1, "type": "Reboot"}'], [b'{"v": 1, "type": "Switch", "migration_id": 1}'],
                   [p.encode(p.Switch(migration_id=1, step=5))],
                   [p.encode(p.StepReport(rank=0, step=1, step_time_s=0.1, shadow=False))], [b"two", b"frames"]]:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        keys.connect_as(sock, p.Sender.CLIENT)
        sock.connect(address)
        sock.send_multipart(frames)
        # One connection delivers in order: once tmd answers this request, it has handled the frame above.
        sock.send(p.encode(p.StatusRequest()))
        replies = []  # a frame that does not decode is answered with bad_request first (tmd.daemon.on_frames)
        while not replies or not isinstance(replies[-1], p.StatusReply):
            assert sock.poll(20_000), "tmd did not answer after a malformed frame"
            replies.append(p.decode(sock.recv()))
        assert all(isinstance(r, p.ErrorReply) and r.code == p.ErrorCode.BAD_REQUEST for r in replies[:-1])
        sock.close()
    bad = [e for e in events(job["run_dir"]) if e["event"] == "bad_message"]
    assert len(bad) == 6, bad
    reasons = " | ".join(e["error"] for e in bad)
    for needle in ["not JSON", "unknown message type 'Reboot'", "missing fields ['step']",
                   "Switch is a coordinator message; this connection is authenticated as a client",
                   "StepReport is a worker message; this connection is authenticated as a client",
                   "expected 2 frames"]:
        assert needle in reasons
    st = job["status"]()  # tmd is still up and the job still healthy
    assert all(n["health"] == "healthy" for n in st.nodes if n["role"] == "active")


@pytest.mark.timeout(120)
def test_joiner_killed_during_warm_up_aborts_and_training_goes_on(job):
    client = job["client"]
    reply = client.request(p.MigrateRequest(sources=["n2"], targets=["s1"]))
    assert isinstance(reply, p.MigrationReply) and reply.migration["state"] == "warming"
    mid = reply.migration["id"]
    # while it warms up: a second request is refused, and the job is not harmed
    again = client.request(p.MigrateRequest(sources=["n1"], targets=["s1"]))
    assert isinstance(again, p.ErrorReply) and again.code == "migration_running"
    joiner_pid = next(e["pid"] for e in reversed(events(job["run_dir"]))
                      if e["event"] == "worker_registered" and e["node"] == "s1" and e["local_rank"] == 0)
    os.kill(joiner_pid, signal.SIGKILL)
    m = wait_until(lambda: (lambda m: m if m["state"] in ("aborted", "committed") else None)(
        client.request(p.MigrationRequest(migration_id=mid)).migration), 60, "the migration to end")
    assert m["state"] == "aborted"
    assert m["reason"].startswith("joiner s1/0 exited with code -9 during warming"), m["reason"]
    aborted = [e for e in events(job["run_dir"]) if e["event"] == "migration_aborted"]
    assert aborted and "exited with code -9" in aborted[-1]["reason"]
    step = job["status"]().step
    wait_until(lambda: job["status"]().step > step + 10, 30, "training to go on")
    assert job["proc"].poll() is None


@pytest.mark.timeout(120)
def test_cold_standby_is_busy_then_a_second_migration_commits(job):
    st = job["status"]()
    s1 = next(n for n in st.nodes if n["name"] == "s1")
    if not s1["warm"]:
        busy = run_tmctl(job["run_dir"], "migrate", "--from", "n2", "--to", "s1")
        assert busy.returncode == 2 and "standby 's1' is busy" in busy.stderr, busy
    wait_until(lambda: any(n["name"] == "s1" and n["warm"] for n in job["status"]().nodes), 90, "s1 warm again")
    r = run_tmctl(job["run_dir"], "migrate", "--from", "n2", "--to", "s1", "--json", "--timeout-s", "90")
    assert r.returncode == 0, r.stderr
    m = json.loads(r.stdout.strip().splitlines()[-1])
    assert m["state"] == "committed" and m["switch_step"] > 0
    assert set(m["phases"]) >= {"requested", "warming", "prepared", "switching", "transferred", "committed"}
    assert m["bytes_moved"] > 100_000
    # the leavers sent their state before the switch step (worker.precopy): at S only a tail moved, with the
    # parameters and AdamW's moments as references to what the joiners' replayed optimizer steps computed
    sent = [e for e in events(job["run_dir"]) if e["event"] == "migration_sent" and e["migration_id"] == m["id"]]
    assert sorted(e["rank"] for e in sent) == [2, 3], sent
    assert all(0 <= e["precopy_step"] < m["switch_step"] and e["kept_tensors"] > 0 for e in sent), sent
    # the commit was decided once the joiners loaded the pre-copy, before the tail left at S: the stayers found
    # the decision waiting at S (a pause of a group swap), and the joiners' lag behind them was measured
    order = [e["event"] for e in events(job["run_dir"]) if e.get("migration_id") == m["id"]]
    # each joiner ran one shadow iteration: DDP's bucket regrouping (the second's one-time collective) was
    # replayed right after it (worker.ddp_regroup.regroup_ddp_buckets), as a failure's replacement does
    committed = next(e for e in events(job["run_dir"]) if e["event"] == "migration_committed"
                     and e["migration_id"] == m["id"])
    assert committed["shadow_steps"] == {"2": 1, "3": 1}, committed
    assert order.index("migration_transferred") < order.index("migration_sent") < order.index("migration_committed")
    down = wait_until(lambda: next((e for e in events(job["run_dir"]) if e["event"] == "migration_downtime"
                                    and e["migration_id"] == m["id"]), None), 30, "the downtime window")
    assert down["pause_s"] is not None and down["joiner_lag_s"] is not None, down
    # delta-based setup: stayers rebuilt only the world group (n1's node group has no leaver); n2's node group
    # [2, 3] was rebuilt by the joiners alone; the leavers built no group
    assert m["rebuilt"] == {"n1/0": ["world"], "n1/1": ["world"], "n2/0": [], "n2/1": [],
                            "s1/0": ["world", "pg2"], "s1/1": ["world", "pg2"]}
    st = job["status"]()
    roles = {n["name"]: (n["role"], n["ranks"]) for n in st.nodes}
    assert roles["s1"] == ("active", [2, 3]) and roles["n2"][0] == "left"
    assert st.world_size == 4 and st.generation == 2


@pytest.mark.timeout(300)
def test_final_state_is_bit_identical_to_an_uninterrupted_run(job):
    end_padding(job["run_dir"])  # the module's migrations are over: the rest at the job's own speed
    assert job["proc"].wait(timeout=240) == 0
    assert final_hashes(job["run_dir"]) == job["reference"]  # 4 ranks, one hash (gpt_reference checks)
    names = [e["event"] for e in events(job["run_dir"])]
    assert names.count("migration_committed") == 1 and names.count("migration_aborted") == 1
    left = [e for e in events(job["run_dir"]) if e["event"] == "process_exit" and e["node"] == "n2"]
    assert [e["returncode"] for e in left] == [0, 0] and all(e["expected"] for e in left)
    # every step has its time, the switch step's neighbours included (the leavers' step S - 1 counts although
    # the commit was decided while they ran it)
    timed = {s for e in events(job["run_dir"]) if e["event"] == "step_times" for s, _, _ in e["steps"]}
    assert timed == set(range(STEPS)), sorted(set(range(STEPS)) - timed)


# SIGTERM to tmd stopping a local job and all its processes: test_user_errors.py (its unmanaged job ends that way)

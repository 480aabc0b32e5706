"""Unit tests of tmctl (client, rendering, CLI) against a fake coordinator.

The fake is a thread with a ZeroMQ ROUTER on a free 127.0.0.1 port that answers each request with a canned
:mod:`tmd.protocol` message; end-to-end tests against the real tmd live elsewhere.
"""
import json
import sys
import socket
import threading
import time

import pytest
import zmq
from typer.testing import CliRunner

from tests.support import stand_in_tmd
from tmctl import cli
from tmctl.client import Client, CoordinatorNotFound, TimedOut, find_coordinator
from tmctl.render import warning_lines
from tmd.config import DEFAULTS
from tmd.protocol import (
    ErrorReply,
    EventsReply,
    EventsRequest,
    MigrateRequest,
    MigrationReply,
    MigrationRequest,
    StatusReply,
    StatusRequest,
    decode,
    encode,
)


class FakeCoordinator:
    """ROUTER thread: ``handler(request) -> reply`` (None: stay silent). Records every request it decodes."""

    def __init__(self, handler):
        self.handler = handler
        self.requests = []
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        assert self._ready.wait(5)

    def _serve(self):
        sock = zmq.Context.instance().socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self._ready.set()
        try:
            while not self._stop.is_set():
                if not sock.poll(20):
                    continue
                ident, frame = sock.recv_multipart()
                request = decode(frame)
                self.requests.append(request)
                reply = self.handler(request)
                if reply is not None:
                    sock.send_multipart([ident, encode(reply)])
        finally:
            sock.close()

    def stop(self):
        self._stop.set()
        self._thread.join(5)


@pytest.fixture
def fake():
    started = []

    def start(handler):
        started.append(FakeCoordinator(handler))
        return started[-1]

    yield start
    for f in started:
        f.stop()


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    for name in ("TM_COORDINATOR", "TM_RUN_DIR", "TM_STATE_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli, "POLL_INTERVAL_S", 0.01)
    monkeypatch.setattr(cli, "FOLLOW_INTERVAL_S", 0.01)


def run(*args):
    return CliRunner().invoke(cli.app, list(args))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lines(text):
    return [line for line in text.splitlines() if line.strip()]


NODES = [
    {"name": "node0", "role": "active", "ranks": [0, 1], "health": "ok", "heartbeat_age_s": 0.21, "step": 42,
     "step_time_s": 0.137, "warm": False},
    {"name": "node1", "role": "active", "ranks": [2, 3], "health": "late", "heartbeat_age_s": 3.5, "step": 41,
     "step_time_s": 0.141, "warm": False},
    {"name": "spare0", "role": "standby", "ranks": [], "health": "ok", "heartbeat_age_s": 0.4, "step": None,
     "step_time_s": None, "warm": True},
    {"name": "spare1", "role": "standby", "ranks": [], "health": "ok", "heartbeat_age_s": 0.3, "step": None,
     "step_time_s": None, "warm": False},
]


def migration(state, reason="", **extra):
    order = ["requested", "warming", "prepared", "switching", "transferred", "committed"]
    reached = order[: order.index(state) + 1] if state in order else order[:3] + [state]
    m = {"id": 7, "source": "node1", "target": "spare0", "state": state, "reason": reason, "switch_step": None,
         "phases": {s: 1000.0 + 0.5 * i for i, s in enumerate(reached)}, "phases_s": {}, "downtime_s": None,
         "bytes_moved": 0}
    m.update(extra)
    return m


CONFIG = DEFAULTS.with_options(heartbeat_timeout_s=12.0, migrate_stragglers=True).to_dict()  # tmd.config


def status_reply(mig=None):
    return StatusReply(job="local-abc", world_size=4, generation=1, step=42, nodes=NODES, migration=mig, recovery=None, failure=None,
                       warnings=[], config=CONFIG)


# ------------------------------------------------------------------------------------------------------------
# status
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.timeout(10)
def test_status_table(fake):
    f = fake(lambda req: status_reply(migration("warming")))
    r = run("status", "--coordinator", f.address)
    assert r.exit_code == 0, r.output
    out = r.stdout
    assert "local-abc" in out and "world size 4" in out
    for name in ("node0", "node1", "spare0", "spare1"):
        assert name in out
    assert "0-1" in out and "2-3" in out  # rank ranges
    assert "standbys: spare0 (warm), spare1 (cold)" in out
    assert "migration in progress" in out and "warming" in out
    assert "config: heartbeat_timeout_s=12.0 migrate_stragglers=True\n" in out  # the settings not the defaults
    assert isinstance(f.requests[0], StatusRequest)


@pytest.mark.timeout(10)
def test_status_json_is_the_reply(fake):
    f = fake(lambda req: status_reply())
    r = run("--coordinator", f.address, "status", "--json")  # options before the command work too
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data == {"job": "local-abc", "world_size": 4, "generation": 1, "step": 42, "nodes": NODES,
                    "migration": None, "recovery": None, "failure": None, "warnings": [], "page": None,
                    "config": CONFIG, "checkpoints": None, "slurm": None}
    assert data["config"]["detection"]["heartbeat_timeout_s"] == 12.0


# ------------------------------------------------------------------------------------------------------------
# migrate
# ------------------------------------------------------------------------------------------------------------
def scripted_migration(states, final_extra=None):
    """Handler: MigrateRequest -> 'requested'; each MigrationRequest -> the next of ``states``."""
    script = list(states)

    def handler(req):
        if isinstance(req, MigrateRequest):
            return MigrationReply(migration=migration("requested", sources=req.sources, targets=req.targets,
                                                      source=",".join(req.sources), target=",".join(req.targets)))
        if isinstance(req, MigrationRequest):
            state = script.pop(0) if len(script) > 1 else script[0]
            extra = final_extra if state in ("committed", "aborted") else {}
            return MigrationReply(migration=migration(state, **(extra or {})))
        return ErrorReply(code="bad_request", message="unexpected")

    return handler


@pytest.mark.timeout(10)
def test_migrate_success_prints_phases(fake):
    done = {"switch_step": 50, "phases_s": {"warming": 0.5, "switching": 0.2}, "downtime_s": 0.31,
            "bytes_moved": 3 * 1024 ** 2}
    f = fake(scripted_migration(["warming", "prepared", "switching", "committed"], done))
    r = run("migrate", "--from", "node1", "--to", "spare0", "--coordinator", f.address)
    assert r.exit_code == 0, r.output
    out = lines(r.stdout)
    assert out[0] == "migration 7: node1 -> spare0"
    phase_lines = [line for line in out if line.startswith("[")]
    assert [line.split("] ")[1] for line in phase_lines] == [
        "requested", "warming", "prepared", "switching", "transferred", "committed"]
    assert phase_lines[1] == "[   0.50 s] warming"
    assert "committed" in out[-1] and "downtime 0.31 s" in out[-1] and "3.0 MiB" in out[-1]
    assert r.stderr == ""
    assert f.requests[0] == MigrateRequest(sources=["node1"], targets=["spare0"])
    assert all(req == MigrationRequest(migration_id=7) for req in f.requests[1:])


@pytest.mark.timeout(10)
def test_migrate_several_nodes_at_once_sends_the_lists_in_one_request(fake):
    done = {"sources": ["node0", "node1"], "targets": ["spare0", "spare1"], "downtime_s": 0.2}
    f = fake(scripted_migration(["warming", "committed"], done))
    r = run("migrate", "--from", "node0, node1", "--to", "spare0,spare1", "--coordinator", f.address)
    assert r.exit_code == 0, r.output
    assert f.requests[0] == MigrateRequest(sources=["node0", "node1"], targets=["spare0", "spare1"])
    out = lines(r.stdout)
    assert out[0] == "migration 7: node0 -> spare0, node1 -> spare1"
    assert out[-1].startswith("migration 7: node0 -> spare0, node1 -> spare1; committed")


@pytest.mark.timeout(10)
@pytest.mark.parametrize("option, value", [("--from", "node0,,node1"), ("--from", "node0,"), ("--to", ","),
                                           ("--to", " ")])
def test_migrate_refuses_an_empty_name_in_a_list_without_asking_tmd(fake, option, value):
    f = fake(scripted_migration(["committed"]))
    args = {"--from": "node0,node1", "--to": "spare0,spare1", option: value}
    r = run("migrate", "--from", args["--from"], "--to", args["--to"], "--coordinator", f.address)
    assert r.exit_code == 2 and f.requests == []
    assert lines(r.stderr) == [f"error: {option} {value!r}: a comma-separated list of node names, with no empty name"]


def test_node_lists_split_on_commas_and_drop_spaces():
    assert cli.node_list("--from", "n1") == ["n1"]
    assert cli.node_list("--from", "n1, n2 ,n3") == ["n1", "n2", "n3"]
    assert cli.node_list("--to", "n1,n1") == ["n1", "n1"]  # tmd refuses repeated names, with its reason


@pytest.mark.timeout(10)
@pytest.mark.parametrize("message", ["node 'node1' is named twice among the nodes to move",
                                     "2 node(s) to move (node0,node1) but 1 standby(s) to take them (spare0): "
                                     "name one standby per node"])
def test_migrate_several_nodes_refused_by_tmd_exits_2_with_its_line(fake, message):
    f = fake(lambda req: ErrorReply(code="bad_request", message=message))
    r = run("migrate", "--from", "node1,node1", "--to", "spare0,spare1", "--coordinator", f.address)
    assert r.exit_code == 2 and lines(r.stderr) == [f"error: {message}"] and r.stdout == ""


@pytest.mark.timeout(10)
def test_migrate_no_wait_prints_id(fake):
    f = fake(scripted_migration(["warming"]))
    r = run("migrate", "--from", "node1", "--to", "spare0", "--no-wait", "--coordinator", f.address)
    assert r.exit_code == 0, r.output
    assert r.stdout.strip() == "7"
    assert len(f.requests) == 1


@pytest.mark.timeout(10)
def test_migrate_refused_exits_2_with_one_line(fake):
    f = fake(lambda req: ErrorReply(code="busy_standby", message="standby spare0 is busy"))
    r = run("migrate", "--from", "node1", "--to", "spare0", "--coordinator", f.address)
    assert r.exit_code == 2
    assert lines(r.stderr) == ["error: standby spare0 is busy"]
    assert r.stdout == ""


@pytest.mark.timeout(10)
def test_migrate_aborted_exits_1_with_reason(fake):
    f = fake(scripted_migration(["warming", "aborted"], {"reason": "joiner checksum mismatch"}))
    r = run("migrate", "--from", "node1", "--to", "spare0", "--coordinator", f.address)
    assert r.exit_code == 1, r.output
    assert lines(r.stderr) == ["error: migration 7 aborted: joiner checksum mismatch"]
    assert "] aborted" in r.stdout


@pytest.mark.timeout(10)
def test_migrate_reads_the_end_of_a_migration_from_the_journal_once_tmd_stopped(fake, tmp_path):
    """The job finished before the switch step: tmd aborted the migration and stopped. tmctl's next poll gets no
    answer; the journal says how it ended (exit 1 with tmd's reason, not 2 with a timeout)."""
    def handler(req):
        if isinstance(req, MigrateRequest):
            return MigrationReply(migration=migration("requested"))
        return None  # tmd has stopped

    f = fake(handler)
    run_dir = tmp_path / "r"
    write_tmd_json(run_dir, f.address)
    reason = "the job finished before the migration committed"
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in [
        {"seq": 1, "ts": 1.0, "event": "tmd_started", "job": "j"},
        {"seq": 2, "ts": 2.0, "event": "migration_requested", "migration_id": 7, "sources": ["node1"],
         "targets": ["spare0"]},
        {"seq": 3, "ts": 3.0, "event": "migration_aborted", "migration_id": 7, "sources": ["node1"],
         "targets": ["spare0"], "reason": reason},
        {"seq": 4, "ts": 4.0, "event": "tmd_stopped", "exit_code": 0}]))
    r = run("migrate", "--from", "node1", "--to", "spare0", "--run-dir", str(run_dir), "--timeout", "0.3")
    assert r.exit_code == 1, r.output
    assert lines(r.stderr) == [f"error: migration 7 aborted: {reason}"]


@pytest.mark.timeout(10)
def test_migrate_gives_up_after_timeout_s(fake):
    f = fake(scripted_migration(["warming"]))
    r = run("migrate", "--from", "node1", "--to", "spare0", "--timeout-s", "0.2", "--coordinator", f.address)
    assert r.exit_code == cli.EXIT_STILL_RUNNING == 4
    assert lines(r.stderr) == ["error: migration 7 still warming after 0.2 s (it goes on in tmd; watch it with "
                               "tmctl status)"]


# ------------------------------------------------------------------------------------------------------------
# events
# ------------------------------------------------------------------------------------------------------------
EVENTS = [{"seq": i, "ts": 1000.0 + i, "event": "heartbeat_late" if i % 2 else "migration_requested",
           "node": f"node{i}"} for i in range(1, 6)]


def events_handler(req):
    if not isinstance(req, EventsRequest):
        return ErrorReply(code="bad_request", message="unexpected")
    return EventsReply(events=[e for e in EVENTS if e["seq"] > req.after][: req.limit])


@pytest.mark.timeout(10)
def test_events_table_and_json(fake):
    f = fake(events_handler)
    r = run("events", "--after", "2", "--coordinator", f.address)
    assert r.exit_code == 0, r.output
    assert "node3" in r.stdout and "node5" in r.stdout and "node2" not in r.stdout
    r = run("events", "--json", "--limit", "2", "--coordinator", f.address)
    assert r.exit_code == 0, r.output
    assert [json.loads(line) for line in lines(r.stdout)] == EVENTS[:2]


@pytest.mark.timeout(10)
def test_events_leave_out_step_times_unless_asked(fake):
    journal = EVENTS + [{"seq": 6, "ts": 1006.0, "event": "step_times", "steps": [[3, 1005.9, 0.25]]},
                        {"seq": 7, "ts": 1007.0, "event": "migration_committed", "node": "node7"}]
    f = fake(lambda req: EventsReply(events=[e for e in journal if e["seq"] > req.after][: req.limit]))
    r = run("events", "--json", "--after", "4", "--coordinator", f.address)
    assert [json.loads(line)["seq"] for line in lines(r.stdout)] == [5, 7]
    r = run("events", "--json", "--after", "4", "--steps", "--coordinator", f.address)
    assert [json.loads(line)["seq"] for line in lines(r.stdout)] == [5, 6, 7]
    r = run("events", "--after", "4", "--coordinator", f.address)
    assert "node7" in r.stdout and "step_times" not in r.stdout


@pytest.mark.timeout(10)
def test_events_follow_pages_through_until_interrupted(fake, monkeypatch):
    polls = []

    def handler(req):
        polls.append(req.after)
        return events_handler(req)

    f = fake(handler)
    real_sleep = time.sleep

    def sleep(s):  # an idle wait once every event was seen stands in for Ctrl-C
        if polls[-1] >= 5:
            raise KeyboardInterrupt
        real_sleep(s)

    monkeypatch.setattr(cli.time, "sleep", sleep)
    r = run("events", "--follow", "--limit", "2", "--coordinator", f.address)
    assert r.exit_code == 0, r.output
    assert [line.split()[0] for line in lines(r.stdout)] == ["1", "2", "3", "4", "5"]
    assert polls == [0, 2, 4, 5]  # full pages are fetched back to back


# ------------------------------------------------------------------------------------------------------------
# unreachable coordinator, address resolution
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.timeout(10)
def test_unreachable_coordinator_exits_2_with_one_line():
    address = f"tcp://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    r = run("status", "--coordinator", address, "--timeout", "0.3")
    assert time.monotonic() - t0 < 3
    assert r.exit_code == 2
    assert lines(r.stderr) == [f"error: connection refused at {address}: no tmd listens there (the job ended, or "
                               f"its tmd died: `tmd resume` restarts it)"]


@pytest.mark.timeout(10)
def test_client_raises_timed_out_on_silence(fake):
    f = fake(lambda req: None)
    with Client(f.address, timeout_s=0.2) as client, pytest.raises(TimedOut) as e:
        client.request(StatusRequest())
    assert e.value.address == f.address and e.value.timeout_s == 0.2
    assert str(e.value) == f"timed out after 0.2 s waiting for tmd at {f.address} (connected, no reply)"


@pytest.mark.timeout(10)
@pytest.mark.parametrize("address, problem", [
    ("tcp://127.0.0.1:99999", "expected tcp://HOST:PORT with a port in 1..65535"),
    ("tcp://127.0.0.1", "expected tcp://HOST:PORT with a port in 1..65535"),
    ("tcp://no-such-host.invalid:5555", "cannot resolve host 'no-such-host.invalid'"),
])
def test_invalid_address_is_named_as_such(address, problem):
    r = run("status", "--coordinator", address, "--timeout", "0.2")
    assert r.exit_code == 2
    (line,) = lines(r.stderr)
    assert line.startswith(f"error: invalid coordinator address {address}: {problem}")


@pytest.mark.timeout(20)
def test_authentication_failure_is_named_as_such(tmp_path, monkeypatch):
    """A CURVE tmd with job A's keys: tmctl with job B's keys, and tmctl without keys, each get told why."""
    from tmd.protocol.keys import JobKeys
    ours, theirs = JobKeys.create(str(tmp_path / "a")), JobKeys.create(str(tmp_path / "b"))
    with stand_in_tmd(ours) as (_, address):
        monkeypatch.chdir(tmp_path)  # no ./tmrun/tmd.json to take keys from
        monkeypatch.delenv("TM_KEYS", raising=False)
        r = run("status", "--coordinator", address, "--timeout", "0.5")
        assert r.exit_code == 2 and lines(r.stderr) == [
            f"error: authentication failed at {address} without keys (give --job/--run-dir, or TM_KEYS): not this "
            f"job's keys, or not this job's tmd"]
        monkeypatch.setenv("TM_KEYS", theirs.path)
        r = run("status", "--coordinator", address, "--timeout", "0.5")
        assert r.exit_code == 2 and lines(r.stderr) == [
            f"error: authentication failed at {address} with the keys in {theirs.path}: not this job's keys, or "
            f"not this job's tmd"]
        monkeypatch.setenv("TM_KEYS", str(tmp_path / "missing"))
        r = run("status", "--coordinator", address, "--timeout", "0.5")
        assert r.exit_code == 2 and "cannot read the job's keys in" in r.stderr and "only the job's user" in r.stderr


def write_tmd_json(directory, address):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tmd.json").write_text(json.dumps({"address": address, "pid": 1, "job": "j", "run_dir": "x"}))


@pytest.mark.timeout(10)
def test_resolution_order(monkeypatch, tmp_path):
    state = tmp_path / "state"
    monkeypatch.setenv("TM_STATE_DIR", str(state))
    write_tmd_json(state / "jobs" / "job1", "tcp://10.0.0.1:1001")
    write_tmd_json(tmp_path / "run", "tcp://10.0.0.2:1002")
    write_tmd_json(tmp_path / "envrun", "tcp://10.0.0.3:1003")
    write_tmd_json(tmp_path / "tmrun", "tcp://10.0.0.4:1004")  # the default ./tmrun (cwd is tmp_path)

    assert find_coordinator(None, None, None) == "tcp://10.0.0.4:1004"
    monkeypatch.setenv("TM_RUN_DIR", str(tmp_path / "envrun"))
    assert find_coordinator(None, None, None) == "tcp://10.0.0.3:1003"
    assert find_coordinator(None, str(tmp_path / "run"), None) == "tcp://10.0.0.2:1002"
    assert find_coordinator(None, str(tmp_path / "run"), "job1") == "tcp://10.0.0.1:1001"
    monkeypatch.setenv("TM_COORDINATOR", "tcp://10.0.0.5:1005")
    assert find_coordinator(None, str(tmp_path / "run"), "job1") == "tcp://10.0.0.5:1005"
    assert find_coordinator("10.0.0.6:1006", str(tmp_path / "run"), "job1") == "tcp://10.0.0.6:1006"


@pytest.mark.timeout(10)
def test_job_file_under_home_by_default(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    write_tmd_json(tmp_path / "home" / ".trainmover" / "jobs" / "j9", "tcp://10.0.0.9:1009")
    assert find_coordinator(None, None, "j9") == "tcp://10.0.0.9:1009"


@pytest.mark.timeout(10)
def test_missing_file_names_the_path(tmp_path):
    with pytest.raises(CoordinatorNotFound) as e:
        find_coordinator(None, str(tmp_path / "nowhere"), None)
    assert str(tmp_path / "nowhere" / "tmd.json") in str(e.value) and "--coordinator" in str(e.value)

    r = run("status")  # nothing at ./tmrun/tmd.json
    assert r.exit_code == 2
    (line,) = lines(r.stderr)
    assert line.startswith("error: no tmd.json at ") and str(tmp_path / "tmrun" / "tmd.json") in line
    assert "--run-dir" in line and "--job" in line


@pytest.mark.timeout(10)
def test_cli_uses_run_dir_and_env(fake, monkeypatch, tmp_path):
    f = fake(lambda req: status_reply())
    write_tmd_json(tmp_path / "r", f.address)
    assert run("status", "--json", "--run-dir", str(tmp_path / "r")).exit_code == 0
    monkeypatch.setenv("TM_RUN_DIR", str(tmp_path / "r"))
    assert run("status", "--json").exit_code == 0
    # --coordinator beats TM_RUN_DIR: a dead address wins and fails
    dead = f"tcp://127.0.0.1:{free_port()}"
    r = run("status", "--coordinator", dead, "--timeout", "0.2")
    assert r.exit_code == 2 and dead in r.stderr
    assert len(f.requests) == 2


@pytest.mark.timeout(10)
def test_bad_reply_is_one_line_not_a_traceback(fake):
    f = fake(lambda req: EventsReply(events=[]))  # wrong reply type for a StatusRequest
    r = run("status", "--coordinator", f.address)
    assert r.exit_code == 2
    assert lines(r.stderr) == ["error: unexpected reply from tmd: EventsReply (wanted StatusReply)"]


# ------------------------------------------------------------------------------------------------------------
# a job whose tmd is gone: the journal answers
# ------------------------------------------------------------------------------------------------------------
ENDED = [
    {"seq": 1, "ts": 1.0, "event": "tmd_started", "job": "j7"},
    {"seq": 2, "ts": 1.0, "event": "job_config", "config": CONFIG},
    {"seq": 3, "ts": 2.0, "event": "job_warning", "rank": 0, "node": "n1", "code": "nothing_managed",
     "message": "manage it"},
    {"seq": 3, "ts": 2.5, "event": "no_replica", "rank": 2, "node": "n2", "code": "no_replica",
     "message": "losing node n2 loses every copy of rank 2's state"},
    {"seq": 4, "ts": 3.0, "event": "rank_failed", "rank": 3, "node": "n2", "step": 5, "kind": "script_error",
     "error": "ValueError: bad", "traceback": "Traceback (most recent call last):\nValueError: bad"},
    {"seq": 5, "ts": 4.0, "event": "job_failed", "reason": "rank 3 on n2 raised at step 5: ValueError: bad"},
    {"seq": 6, "ts": 5.0, "event": "tmd_stopped", "exit_code": 1},
]


@pytest.mark.timeout(10)
def test_status_and_events_of_an_ended_job_read_its_journal(tmp_path):
    run_dir = tmp_path / "r"
    write_tmd_json(run_dir, f"tcp://127.0.0.1:{free_port()}")
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in ENDED))
    r = run("status", "--json", "--run-dir", str(run_dir), "--timeout", "0.2")
    assert r.exit_code == 0, r.output
    state = json.loads(r.stdout)
    assert state["ended"] is True and state["exit_code"] == 1 and state["job"] == "j7" and state["step"] == 5
    assert state["failure"]["rank"] == 3  # its warnings as the live status showed them, no_replica's too
    assert [w["code"] for w in state["warnings"]] == ["nothing_managed", "no_replica"]
    assert state["config"] == CONFIG
    r = run("status", "--run-dir", str(run_dir), "--timeout", "0.2")
    assert r.exit_code == 0 and "has ended" in r.stdout and "ValueError: bad" in r.stdout and "warning" in r.stdout
    assert "config: heartbeat_timeout_s=12.0 migrate_stragglers=True" in r.stdout
    r = run("events", "--json", "--after", "4", "--run-dir", str(run_dir), "--timeout", "0.2")
    assert r.exit_code == 0 and [json.loads(line)["seq"] for line in lines(r.stdout)] == [5, 6]
    # an explicit --coordinator names no run directory: still the one-line error
    r = run("events", "--coordinator", f"tcp://127.0.0.1:{free_port()}", "--timeout", "0.2")
    assert r.exit_code == 2 and lines(r.stderr)[0].startswith("error: connection refused at")


def test_downtime_pending_until_its_window_passed():
    from tmctl import render

    m = {"id": 1, "source": "n2", "target": "s1", "state": "committed", "switch_step": 20,
         "downtime_s": None, "downtime_after_step": 25}
    assert "downtime pending (known after step 25" in render.migration_line(m)
    assert "downtime 0.12 s" in render.migration_line({**m, "downtime_s": 0.12})


def test_a_migration_of_several_nodes_renders_its_pairs():
    from rich.console import Console

    from tmctl import render

    m = {"id": 3, "sources": ["n1", "n2"], "targets": ["s1", "s2"], "source": "n1,n2", "target": "s1,s2",
         "state": "committed", "switch_step": 20, "downtime_s": 0.1}
    assert render.migration_line(m).startswith("migration 3: n1 -> s1, n2 -> s2; committed; switch step 20")
    assert render.moves({"source": "n2", "target": "s1"}) == "n2 -> s1"  # a reply without the lists
    console = Console(width=120, record=True)
    console.print(render.migration_panel(m))
    assert "n1 → s1, n2 → s2" in console.export_text()


@pytest.mark.timeout(10)
def test_a_timeout_too_short_to_connect_says_so(fake):
    f = fake(lambda req: None)
    with Client(f.address, timeout_s=0.0001) as client, pytest.raises(TimedOut) as e:
        client.request(StatusRequest())
    assert str(e.value).startswith(f"timed out after 0.0001 s waiting for tmd at {f.address} (")


# ------------------------------------------------------------------------------------------------------------
# migrate: --wait/--no-wait, exit codes, the live display
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.timeout(10)
@pytest.mark.parametrize("states, extra, code", [
    (["warming", "prepared", "committed"], {"downtime_s": 0.1}, 0),
    (["warming", "aborted"], {"reason": "the leaver died"}, cli.EXIT_ABORTED),
    (["warming"], None, cli.EXIT_STILL_RUNNING),
])
def test_migrate_wait_exit_codes(fake, states, extra, code):
    f = fake(scripted_migration(states, extra))
    r = run("migrate", "--from", "node1", "--to", "spare0", "--wait", "--timeout-s", "0.3", "--json",
            "--coordinator", f.address)
    assert r.exit_code == code, r.output
    if code == 0:
        assert json.loads(r.stdout)["state"] == "committed" and r.stderr == ""
    elif code == cli.EXIT_ABORTED:
        assert json.loads(r.stdout)["state"] == "aborted"
        assert lines(r.stderr) == ["error: migration 7 aborted: the leaver died"]
    else:
        assert r.stdout == "" and "still warming after 0.3 s" in r.stderr
    r = run("migrate", "--from", "node1", "--to", "spare0", "--no-wait", "--json", "--coordinator", f.address)
    assert r.exit_code == 0 and json.loads(r.stdout)["state"] == "requested"


@pytest.mark.timeout(10)
def test_migrate_refused_is_exit_2_whatever_the_wait():
    assert cli.EXIT_REFUSED == 2
    for wait in ("--wait", "--no-wait"):
        f = FakeCoordinator(lambda req: ErrorReply(code="unknown_node", message="no node 'n9'"))
        try:
            r = run("migrate", "--from", "n9", "--to", "spare0", wait, "--coordinator", f.address)
        finally:
            f.stop()
        assert r.exit_code == 2 and lines(r.stderr) == ["error: no node 'n9'"]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("final, tick", [("committed", "✓"), ("aborted", "✗")])
def test_migrate_in_a_terminal_shows_the_phases_live(fake, monkeypatch, final, tick):
    monkeypatch.setattr(cli, "stdout_is_terminal", lambda: True)
    f = fake(scripted_migration(["warming", "prepared", final], {"reason": "timed out in prepared",
                                                                 "downtime_s": 0.2}))
    r = run("migrate", "--from", "node1", "--to", "spare0", "--coordinator", f.address)
    assert r.exit_code == (0 if final == "committed" else 1), r.output
    out = lines(r.stdout)
    assert out[0] == "migration 7: node1 -> spare0"
    rows = [line.split() for line in out if line.lstrip().startswith(("✓", "✗"))]
    assert [row[1] for row in rows][:2] == ["requested", "warming"] and rows[-1][:2] == [tick, final]
    assert rows[0][2:4] == ["0.50", "s"]  # seconds spent in "requested"
    assert not any(line.startswith("[") for line in out)  # no phase lines in a terminal


def test_migration_progress_rendering():
    from rich.console import Console
    from rich.spinner import Spinner

    from tmctl import render

    m = migration("prepared")  # requested at 1000.0, warming 1000.5, prepared 1001.0
    m["phases"]["prepare_started"] = 1000.7  # a mark, not a state: left out
    assert render.reached_states(m, current_s=0.25) == [("requested", 1000.0, 0.5), ("warming", 1000.5, 0.5),
                                                       ("prepared", 1001.0, 0.25)]
    done = migration("committed")
    assert render.reached_states(done, current_s=9.0)[-1] == ("committed", 1002.5, None)
    console = Console(width=80, record=True)
    console.print(render.migration_progress(m, Spinner("dots"), current_s=0.25))
    text = [line.split() for line in lines(console.export_text())]
    assert text[0] == ["✓", "requested", "0.50", "s", "at", "+0.00", "s"]
    assert text[2][1:] == ["prepared", "0.25", "s", "at", "+1.00", "s"] and text[2][0] != "✓"


# ------------------------------------------------------------------------------------------------------------
# timeline
# ------------------------------------------------------------------------------------------------------------
def timeline_journal(migrations=3, incidents=2):
    """A journal of 40 steps with ``migrations`` committed migrations and ``incidents`` recovered incidents."""
    out = [{"seq": 1, "ts": 1000.0, "event": "tmd_started", "job": "j5"}]

    def add(name, ts, **fields):
        out.append({"seq": len(out) + 1, "ts": ts, "event": name, **fields})

    for k in range(4):
        add("step_times", 1000.0 + 10 * k + 10, steps=[[i, 1000.0 + i + 1, 0.1 + 0.3 * (i == 25)]
                                                      for i in range(10 * k, 10 * k + 10)])
    for mid in range(1, migrations + 1):
        for i, state in enumerate(["requested", "warming", "prepared", "switching", "transferred", "committed"]):
            add(f"migration_{state}", 1000.0 + 5 * mid + 0.1 * i, migration_id=mid, sources=["n2"], targets=["s1"])
    for iid in range(1, incidents + 1):
        add("node_failed", 1025.0 + iid, node="n2", reason="died", signal="process_exit", ranks=[2, 3])
        add("recovery_started", 1025.0 + iid, incident_id=iid, reason="n2: died", lost_ranks=[2, 3])
        add("recovery_done", 1025.5 + iid, incident_id=iid)
    out.sort(key=lambda e: e["ts"])
    for seq, e in enumerate(out, 1):
        e["seq"] = seq
    return out


def write_journal(run_dir, events):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))


@pytest.mark.timeout(20)
def test_timeline_of_a_run_dir_in_text_json_and_png(tmp_path):
    run_dir = tmp_path / "r"
    write_journal(run_dir, timeline_journal())
    r = run("timeline", "--run-dir", str(run_dir))
    assert r.exit_code == 0, r.output
    out = lines(r.stdout)
    assert out[0] == "job j5: 40 step(s) over 40.0 s; step time max 0.400 s, median 0.100 s"
    assert out[1].startswith("0.400 s ┤") and "█" in out[1]
    assert "M" in out[2] and "x" in out[2]
    assert [line.split(":")[0] for line in out if line[:2] in ("M ", "R ")] == [
        "M migration 1", "M migration 2", "M migration 3", "R incident 1", "R incident 2"]

    r = run("--run-dir", str(run_dir), "timeline", "--json")  # the global option works too
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert [(s["kind"], s["id"], s["outcome"]) for s in data["spans"]] == [
        ("migration", 1, "committed"), ("migration", 2, "committed"), ("migration", 3, "committed"),
        ("incident", 1, "recovered"), ("incident", 2, "recovered")]
    assert len(data["steps"]) == 40 and data["job"] == "j5"

    r = run("timeline", "--run-dir", str(run_dir), "--json", "--minutes", "0.25")  # the last 15 s
    assert r.exit_code == 0, r.output
    late = json.loads(r.stdout)
    assert late["start"] == 1025.0 and [s["kind"] for s in late["spans"]] == ["incident", "incident"]

    from tmctl import timeline_plot

    png = tmp_path / "t.png"
    r = run("timeline", "--run-dir", str(run_dir), "--png", str(png))
    assert r.exit_code == 0, r.output
    assert lines(r.stdout) == [f"wrote {png}: 3 migration(s), 2 incident(s), 2 mark(s), 40 step(s)"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert timeline_plot.count_bands(str(png)) == {"migration": 3, "incident": 2}
    import matplotlib.image

    assert matplotlib.image.imread(str(png)).shape[:2] == (timeline_plot.HEIGHT_PX, timeline_plot.WIDTH_PX)


@pytest.mark.timeout(10)
def test_timeline_without_a_journal_or_with_a_bad_png_path_exits_2(tmp_path):
    r = run("timeline", "--run-dir", str(tmp_path / "nowhere"))
    assert r.exit_code == 2 and lines(r.stderr)[0].startswith("error: no tmd.json at ")
    write_journal(tmp_path / "empty", [])
    write_tmd_json(tmp_path / "empty", f"tcp://127.0.0.1:{free_port()}")
    r = run("timeline", "--run-dir", str(tmp_path / "empty"))
    assert r.exit_code == 2 and lines(r.stderr) == ["error: the journal has no events"]
    write_journal(tmp_path / "r", timeline_journal(1, 0))
    r = run("timeline", "--run-dir", str(tmp_path / "r"), "--png", str(tmp_path / "no" / "such" / "dir.png"))
    assert r.exit_code == 2 and lines(r.stderr)[0].startswith(f"error: cannot write {tmp_path}/no/such/dir.png")


@pytest.mark.timeout(10)
def test_timeline_pages_through_a_live_tmd(fake):
    journal = timeline_journal(2, 1)
    asked = []

    def handler(req):
        if not isinstance(req, EventsRequest):
            return ErrorReply(code="bad_request", message="unexpected")
        asked.append(req.after)
        return EventsReply(events=[e for e in journal if e["seq"] > req.after][:7])  # short pages, as tmd cuts

    f = fake(handler)
    r = run("timeline", "--json", "--coordinator", f.address)
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert [s["id"] for s in data["spans"]] == [1, 2, 1] and len(data["steps"]) == 40
    assert asked == list(range(0, len(journal) + 1, 7)) + ([len(journal)] if len(journal) % 7 else [])


@pytest.mark.timeout(20)
def test_timeline_of_an_ended_job_reads_its_journal(tmp_path):
    # the default ./tmrun (cwd is tmp_path): its tmd is gone, its journal answers
    write_journal(tmp_path / "tmrun", timeline_journal(1, 1))
    write_tmd_json(tmp_path / "tmrun", f"tcp://127.0.0.1:{free_port()}")
    r = run("timeline", "--json", "--timeout", "0.2")
    assert r.exit_code == 0, r.output
    assert [s["kind"] for s in json.loads(r.stdout)["spans"]] == ["migration", "incident"]
    # no tmd answers and there is no journal: the one-line error, exit 2
    (tmp_path / "tmrun" / "events.jsonl").unlink()
    r = run("timeline", "--timeout", "0.2")
    assert r.exit_code == 2 and lines(r.stderr)[0].startswith("error: connection refused at")


def test_tmctl_does_not_load_matplotlib_until_a_picture_is_asked_for():
    import subprocess
    import sys

    code = "import sys, tmctl.cli; sys.exit('matplotlib' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


# ------------------------------------------------------------------------------------------------------------
# page
# ------------------------------------------------------------------------------------------------------------
def with_page(url):
    reply = status_reply()
    reply.page = url
    return reply


@pytest.mark.timeout(10)
def test_page_prints_the_address_with_the_token_and_a_scrape_config(fake, tmp_path, monkeypatch):
    keys = tmp_path / "keys"
    keys.mkdir()
    (keys / "web.token").write_text("tok-123")
    monkeypatch.setattr(cli, "web_token_file", lambda run_dir, job: str(keys / "web.token"))
    f = fake(lambda req: with_page("http://127.0.0.1:8123/"))
    r = run("page", "--coordinator", f.address)
    assert r.exit_code == 0, r.output
    assert r.stdout.strip() == "http://127.0.0.1:8123/?token=tok-123"
    r = run("page", "--prometheus", "--coordinator", f.address)
    assert r.exit_code == 0, r.output
    assert f"credentials_file: {keys / 'web.token'}" in r.stdout and '"127.0.0.1:8123"' in r.stdout
    assert "tok-123" not in r.stdout
    r = run("status", "--coordinator", f.address)
    assert "page: http://127.0.0.1:8123/" in r.stdout


@pytest.mark.timeout(10)
def test_page_says_why_when_there_is_no_page_or_no_token(fake, tmp_path, monkeypatch):
    monkeypatch.setattr(cli, "web_token_file", lambda run_dir, job: str(tmp_path / "nothing" / "web.token"))
    f = fake(lambda req: with_page(None))
    r = run("page", "--coordinator", f.address)
    assert r.exit_code == 2 and "serves no status page" in r.output
    f = fake(lambda req: with_page("http://127.0.0.1:8123/"))
    r = run("page", "--coordinator", f.address)
    assert r.exit_code == 2 and "cannot read the job's web token" in r.output


@pytest.mark.timeout(60)
def test_close_does_not_block_on_a_monitor_full_of_reconnection_events(monkeypatch):
    """A client left connecting to a dead tmd fills its monitor's pipe; closing it (also from a finalizer, at
    any garbage collection) must still return."""
    import tmctl.client as client_module

    monkeypatch.setattr(client_module, "RECONNECT_IVL_MS", 1)
    monkeypatch.setattr(client_module, "RECONNECT_IVL_MAX_MS", 1)
    c = Client(f"tcp://127.0.0.1:{free_port()}", timeout_s=0.1)  # nothing listens there
    c._socket()  # noqa: SLF001 - connect without a request: the events pile up unread
    time.sleep(3)  # thousands of refused reconnections, each a few monitor events; nothing to wait on
    closer = threading.Thread(target=c.close, daemon=True)
    closer.start()
    closer.join(10)
    assert not closer.is_alive(), "Client.close blocked"


def test_a_warning_says_migrations_are_refused_only_for_unmanaged_state():
    refusing, informative = warning_lines([
        {"rank": 0, "node": "n1", "code": "unmanaged_parameters", "message": "manage the model"},
        {"rank": 2, "node": "n2", "code": "state_after_update", "message": "the CPU RNG changed"}])
    assert refusing.endswith("(migrations and recoveries are refused)") and "unmanaged_parameters" in refusing
    assert informative == "[yellow]warning[/]: rank 2 on n2: state_after_update: the CPU RNG changed"


def test_status_shows_the_checkpoint_tier_a_failed_save_and_each_restart():
    from tmctl import render

    lines = render.checkpoint_lines({"dir": "/c", "every": 5, "keep": 2, "latest": 15,
                                     "failed": "checkpoint at step 10 not saved (/c/step-000000010): rank 0: denied",
                                     "restarts": [{"tier": "checkpoint", "step": 5, "work_lost_s": 3.2,
                                                   "reason": "every rank is lost"}]})
    assert lines[0] == "checkpoints: /c every 5 steps, keep 2; newest: step 15"
    assert "checkpoint_failed: checkpoint at step 10 not saved" in lines[1] and "training goes on" in lines[1]
    assert "restarted[/] from the checkpoint tier at step 5 (3.2 s of work lost): every rank is lost" in lines[2]
    assert render.checkpoint_lines(None) == []


def test_the_last_step_of_an_ended_job_counts_its_step_times():
    from tmctl.ended import last_known

    events = [{"seq": 1, "ts": 1.0, "event": "tmd_started", "job": "j"},
              {"seq": 2, "ts": 2.0, "event": "worker_rejoined", "step": 4566},
              {"seq": 3, "ts": 3.0, "event": "step_times", "steps": [[4933, 3.0, 0.1], [4934, 3.1, 0.1], ["x"]]},
              {"seq": 4, "ts": 4.0, "event": "tmd_stopped", "exit_code": 0}]
    assert last_known("/nowhere", events)["step"] == 4934


def test_text_from_ranks_cannot_act_on_the_terminal():
    from tmctl import render

    hostile = "\x1b[2J\x1b[31mred\u202eevil\x07 [bold]x"
    line = render.warning_lines([{"rank": 0, "node": "n1", "code": "state_after_update", "message": hostile}])[0]
    assert "\x1b" not in line and "\u202e" not in line and "\x07" not in line
    assert line.endswith("\\x1b[2J\\x1b[31mred\\u202eevil\\x07 \\[bold]x")  # shown, escaped; rich markup too
    event = render.event_line({"seq": 1, "ts": 0.0, "event": "job_warning", "message": hostile, "k\x1b": 1})
    assert "\x1b" not in event and "\u202e" not in event
    failure = render.failure_text({"rank": 0, "node": "n1", "kind": "script_error", "error": "E\x1b[2J",
                                   "traceback": "Traceback\n  line\x1b]0;title\x07\nE"})
    assert "\x1b" not in failure and "\x07" not in failure and failure.count("\n") == 3


def test_a_piped_status_table_keeps_its_node_names(monkeypatch):
    """Outside test: in a script (not a terminal: rich's 80 columns) the node, ranks and step columns of a SLURM
    job's status collapsed to '…'."""
    from tmctl import cli

    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.setattr(sys.stdout, "isatty", lambda: False)
    assert cli._console().width == cli.PIPED_WIDTH  # noqa: SLF001
    monkeypatch.setenv("COLUMNS", "90")
    assert cli._console().width == 90  # noqa: SLF001 - the user's say

"""tmd survives any input and stays bounded (issue 10): decode, a live Daemon's dispatch in process, the journal's
bounds, the refusal aggregator, the standby cap and rate limit, malformed heartbeats, and the in-process restart."""
from __future__ import annotations

import io
import json
import random
import sys
from types import SimpleNamespace

import pytest

from tmd import protocol as p
from tmd.bad_input import OTHER_SENDERS, BadInput
from tmd.config import DEFAULTS
from tmd.daemon import Daemon, TmdCrashed
from tmd.detection import Detector, HostProcesses
from tmd.evacuation import Evacuation
from tmd.health import GpuHealthPolicy
from tmd.journal import MAX_FIELD_CHARS, MAX_LINE_BYTES, Journal, read_events
from tmd.migration import MigrationError
from tmd.protocol.messages import MAX_MESSAGE_BYTES, MAX_NAME_CHARS
from tmd.protocol.vocab import ErrorCode, Event, NodeRole
from tmd.registry import Registry, Worker
from tmd.requests import Requests
from tmd.resume import ResumeError, load

pytestmark = pytest.mark.timeout(60)
RECORD_2 = DEFAULTS.with_options(record_steps=2, metrics_port=-1)  # the fewest recorded steps; no status page


def frame(**body) -> bytes:
    return json.dumps({"v": p.PROTOCOL_VERSION, **body}).encode()


# Each single frame that ended tmd before (the list), and more of the same kind.
BAD_FRAMES = {
    "int digit limit": b"1" * 5000,
    "deep nesting": b"[" * 100_000,
    "lone surrogate": b'{"v":1,"type":"MigrateRequest","sources":["\\ud800"],"targets":["s1"]}',
    "long standby name": frame(type="AddStandbyRequest", node="a" * 300),
    "gpu temperature as text": frame(type="Heartbeat", step=1, counters={"gpu": {"temperature_c": "hot"}}),
    "non-UTF-8": b'{"v":1,"type":"MigrateRequest","sources":["n\xff"],"targets":["s1"]}',
    "NaN": b'{"v":1,"type":"StepReport","rank":0,"step":1,"step_time_s":NaN,"shadow":false}',
    "Infinity as 1e999": b'{"v":1,"type":"StepReport","rank":0,"step":1,"step_time_s":1e999,"shadow":false}',
    "int over 64 bits": frame(type="StepReport", rank=0, step=10 ** 30, step_time_s=1.0, shadow=False),
    "negative time": frame(type="StepReport", rank=0, step=1, step_time_s=-5.0, shadow=False),
    # a step whose successor tmd could not encode again (every tmctl status would fail), a byte count it sums
    "step near 2**63": frame(type="StepReport", rank=0, step=2 ** 63 - 1, step_time_s=1.0, shadow=True),
    "step below -1": frame(type="Done", rank=0, final_step=-2, left=False),
    "bytes over 2**50": frame(type="SnapshotReport", rank=0, step=1, bytes_per_copy=2 ** 50 + 1, copy_s=0.1),
    "nested 20 deep in counters": frame(type="Heartbeat", step=1, counters=json.loads('{"a":' * 20 + "1" + "}" * 20)),
    "counter as text": frame(type="Heartbeat", step=1, counters={"pending": "many"}),
    "negative op start": frame(type="Heartbeat", step=1, counters={"pending": 1, "last_op_start_s": -1e9}),
    "counters a list": frame(type="Heartbeat", step=1, counters=[1, 2]),
    "xids of text": frame(type="Heartbeat", step=1, counters={"gpu": {"xids": ["48"]}}),
    "groups of numbers": frame(type="PhaseDone", migration_id=1, rank=0, phase="prepared", ok=True, error="",
                               step=0, bytes_moved=0, seconds=0.0, groups=[1, 2]),
    "negative shadow iterations": frame(type="PhaseDone", migration_id=1, rank=0, phase="warmed", ok=True, error="",
                                        step=-1, bytes_moved=0, seconds=0.0, groups=[], precopy_step=-1,
                                        kept_tensors=0, ready_unix_s=0.0, shadow_steps=-1),
    "long node in Register": frame(type="Register", node="n" * 100, local_rank=0, pid=1, host="h", standby=False),
    "unknown kind": frame(type="Nope"),
    "no version": b'{"type":"StatusRequest"}',
    "not an object": b"[1,2,3]",
    "empty": b"",
    "truncated": p.encode(p.StatusRequest())[:-3],
    "over the size limit": b" " * (MAX_MESSAGE_BYTES + 1),
}


@pytest.mark.parametrize("name", sorted(BAD_FRAMES))
def test_each_bad_frame_is_a_protocol_error(name):
    with pytest.raises(p.ProtocolError):
        p.decode(BAD_FRAMES[name])


def test_decode_raises_only_protocol_error_on_mutated_frames():
    rng = random.Random(10)
    good = [p.encode(m) for m in (
        p.Heartbeat(step=3, counters={"ops_issued": 5, "pending": 1, "last_op_start_s": 1.5, "mode": "live",
                                      "gpu": {"xids": [48], "temperature_c": 50, "throttle": ["hw_slowdown"]}}),
        p.MigrateRequest(sources=["n1"], targets=["s1"]), p.EventsRequest(after=0, limit=10),
        p.PhaseDone(migration_id=1, rank=0, phase=p.MigrationPhase.PREPARED, ok=True, error="", step=0,
                    bytes_moved=0, seconds=0.0, groups=["world"]))]
    junk = [b"\x00", b"\xff", b"\\ud800", b"[", b"{", b'"', b"1e999", b"NaN", b"9" * 40, b"-", b"\xed\xa0\x80"]
    decoded = 0
    for _ in range(5000):
        b = bytearray(rng.choice(good))
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(len(b))
            if rng.random() < 0.5:
                b[at] = rng.randrange(256)
            else:
                b[at:at] = rng.choice(junk)
        if rng.random() < 0.2:
            b = b[:rng.randrange(len(b))]
        try:
            p.decode(bytes(b))
            decoded += 1
        except p.ProtocolError:
            pass
    assert decoded < 5000


def test_valid_messages_still_decode_and_ints_become_floats_where_a_float_is_expected():
    msg = p.decode(frame(type="StepReport", rank=0, step=1, step_time_s=2, shadow=False))
    assert msg == p.StepReport(rank=0, step=1, step_time_s=2.0, shadow=False) and isinstance(msg.step_time_s, float)
    hb = p.Heartbeat(step=-1, counters={"ops_issued": 0, "failed": False, "generation": 0, "busy_s": 0.0,
                                        "gpu": {"index": 0, "uuid": None, "temperature_c": None, "xids": []}})
    assert p.decode(p.encode(hb)) == hb
    name = "n" * MAX_NAME_CHARS
    assert p.decode(p.encode(p.MigrateRequest(sources=[name], targets=["s1"]))).sources == [name]


# --- a real Daemon, in process --------------------------------------------------------------------------------
class FakeLauncher:
    def __init__(self):
        self.started = []
        self.command = ["true"]

    def start_node(self, node, standby):
        self.started.append(node)

    def poll(self):
        return ()

    def running(self, node=None):
        return []

    def pid_of(self, node, local_rank):
        return None

    def terminate_all(self, close=True):
        pass


@pytest.fixture
def daemon(tmp_path, monkeypatch):
    monkeypatch.setenv("TM_KEYS", "")  # recorded, so the Daemon's export of its keys is undone after the test
    monkeypatch.delenv("TM_KEYS")
    d = Daemon("t", str(tmp_path), ["n1", "n2"], 1, ["s1"], RECORD_2, echo=False)
    d.sent = []
    d.reply = lambda identity, msg: d.sent.append((identity, msg))  # observe, no sockets
    d.launcher = FakeLauncher()
    for node in ("n1", "n2", "s1"):
        d.registry.add_worker(Worker(f"{node}/0/x".encode(), node, 0, 1, "elsewhere"))
    try:
        yield d
    finally:
        d.close()


def on_frames(d: Daemon, identity: bytes, data: bytes) -> None:
    d.on_frames([identity, data])


def test_every_bad_frame_is_refused_by_a_live_daemon_which_then_still_answers(daemon):
    d = daemon
    for data in BAD_FRAMES.values():
        for identity in (b"n1/0/x", b"tmctl-1", b"\xff\xfe", b"z" * 255):
            on_frames(d, identity, data)
    d.on_frames([b"only-one-frame"])
    d.on_frames([b"a", b"b", b"c"])
    on_frames(d, b"tmctl-2", p.encode(p.StatusRequest()))
    (reply,) = [m for i, m in d.sent if i == b"tmctl-2"]
    assert isinstance(reply, p.StatusReply) and reply.world_size == 2
    assert d.bad_input.total >= 4 * len(BAD_FRAMES) and d.exit_code is None
    assert Event.INTERNAL_ERROR not in [e["event"] for e in d.journal.since(0, 10_000)]
    d._tick()  # noqa: SLF001 - the aggregator's counts are journalled, nothing raises
    d.journal.close()
    with open(d.layout.events, "rb") as f:
        lines = f.read().splitlines()
    assert all(len(line) <= MAX_LINE_BYTES for line in lines)
    assert all(line.isascii() for line in lines) and len(read_events(d.layout.events)) == len(lines)


def test_weird_names_in_requests_get_clean_error_replies(daemon):
    d = daemon
    on_frames(d, b"tmctl-1", p.encode(p.MigrateRequest(sources=["n\xff"], targets=["s1"])))
    on_frames(d, b"tmctl-1", p.encode(p.MigrateRequest(sources=["\u202e"], targets=["s1"])))
    on_frames(d, b"tmctl-1", p.encode(p.AddStandbyRequest(node="../etc")))
    on_frames(d, b"tmctl-1", p.encode(p.AddStandbyRequest(node="-dash")))  # NODE_NAME starts with a letter or digit
    on_frames(d, b"tmctl-1", p.encode(p.AddStandbyRequest(node="x\n")))  # refused, not trimmed into another name
    codes = [m.code for _, m in d.sent]
    assert codes == [ErrorCode.UNKNOWN_NODE, ErrorCode.UNKNOWN_NODE] + [ErrorCode.BAD_REQUEST] * 3
    assert d.launcher.started == [] and "x" not in d.registry.nodes
    refused = [e for e in d.journal.since(0, 100) if e["event"] == Event.STANDBY_REFUSED]
    assert len(refused) == 3


def test_a_heartbeat_with_wrong_types_never_raises_where_counters_are_read(daemon):
    d = daemon
    w = d.registry.rank_owner[0]
    bad = {"busy_s": "x", "pending": "1", "last_op_start_s": float("nan"),
           "gpu": {"temperature_c": "hot", "xids": "48", "ecc_uncorrected": "9", "throttle": 5, "uuid": 3}}
    for counters in (bad, {"gpu": [1]}, {"busy_s": 10 ** 400}, {"pending": 10 ** 400, "last_op_start_s": -5}):
        d._heartbeat(w, p.Heartbeat(step=1, counters=counters))  # noqa: SLF001 - what decode would refuse
        w.counters = counters
        d.detector._peer_blocked_s(d.registry.nodes["n2"])  # noqa: SLF001
    assert Evacuation(d).observe(w, bad, 0.0) == "busy_s is not a non-negative number"
    assert GpuHealthPolicy().evaluate(0, bad["gpu"]) is None


# --- the journal ------------------------------------------------------------------------------------------------
def test_journal_entries_are_bounded_escaped_and_never_raise(tmp_path, monkeypatch):
    out = io.TextIOWrapper(io.BytesIO(), encoding="ascii")  # PYTHONIOENCODING=ascii: the echo must not raise
    monkeypatch.setattr(sys, "stdout", out)
    path = str(tmp_path / "events.jsonl")
    j = Journal(path, echo=True)
    tb = "Traceback (most recent call last):\n" + "  frame\n" * 10_000 + "ValueError: the end"
    e = j.record(Event.INTERNAL_ERROR, error="\ud800 n\xff", traceback=tb, raw=b"\x00" * 100_000,
                 nested=[[[[[[[[[[1]]]]]]]]]], big=list(range(5000)), obj=object(), huge=10 ** 100)
    assert e["traceback"].endswith("ValueError: the end") and len(e["traceback"]) < MAX_FIELD_CHARS + 100
    assert "\\ud800" in e["error"]
    for i in range(50):
        j.record(Event.BAD_MESSAGE, **{f"f{k}": "x" * 10_000 for k in range(10)})
    j.close()
    with open(path, "rb") as f:
        lines = f.read().splitlines()
    assert len(lines) == 51 and all(len(line) <= MAX_LINE_BYTES for line in lines)
    assert read_events(path)[0]["traceback"].endswith("ValueError: the end")
    out.flush()
    assert b"[tmd] internal_error" in out.buffer.getvalue()


def test_journal_write_errors_are_counted_not_raised(tmp_path):
    j = Journal(str(tmp_path / "events.jsonl"))

    class Full:
        def write(self, _):
            raise OSError(28, "No space left on device")

        def flush(self):
            raise OSError(28, "No space left on device")

        def fileno(self):
            return -1

        def close(self):
            pass

    j._file = Full()  # noqa: SLF001 - a disk that is full
    j.record(Event.BAD_MESSAGE, error="x")
    j.record(Event.BAD_MESSAGE, error="y")
    assert j.write_errors == 2 and [e["error"] for e in j.since(0, 10)] == ["x", "y"]
    j.close()
    assert j.write_errors == 3


def test_journal_since_keeps_a_reply_under_the_message_limit():
    j = Journal(None)
    for _ in range(1000):
        j.record(Event.BAD_MESSAGE, error="x" * 8000)
    page = j.since(0, 10_000)
    assert 0 < len(page) < 1000 and len(p.encode(p.EventsReply(events=page))) < MAX_MESSAGE_BYTES
    assert j.since(page[-1]["seq"], 10_000)[0]["seq"] == page[-1]["seq"] + 1


# --- the refusal aggregator -------------------------------------------------------------------------------------
def test_bad_input_journals_the_first_refusal_per_sender_per_second_and_counts_the_rest():
    j = Journal(None)
    b = BadInput(j)
    for i in range(100):
        b.refuse("a", f"error {i}", 10.0 + i * 0.001)
    b.refuse("b", "other", 10.0)
    b.tick(10.5)
    assert [e["event"] for e in j.since(0, 100)] == [Event.BAD_MESSAGE, Event.BAD_MESSAGE]
    b.tick(11.01)
    dropped = [e for e in j.since(0, 100) if e["event"] == Event.BAD_MESSAGES_DROPPED]
    assert [(e["sender"], e["count"], e["first_error"]) for e in dropped] == [("a", 99, "error 1")]
    assert b.total == 101 and b.senders == 0
    b.refuse("a", "again", 12.0)
    assert j.since(0, 100)[-1]["error"] == "again"


def test_bad_input_tracks_a_bounded_number_of_senders():
    j = Journal(None)
    b = BadInput(j, max_senders=8)
    for i in range(10_000):
        b.refuse(f"rotating-{i}", "x" * 100_000, 5.0)
    assert b.senders <= 9 and b.total == 10_000
    assert len(j.since(0, 100_000)) == 9  # 8 senders, then one event for all the others
    b.tick(6.0)
    (dropped,) = [e for e in j.since(0, 100_000) if e["event"] == Event.BAD_MESSAGES_DROPPED]
    assert dropped["sender"] == OTHER_SENDERS and dropped["count"] == 10_000 - 9
    assert len(dropped["first_error"]) <= 1100


# --- the standby cap and rate limit -----------------------------------------------------------------------------
def test_add_standby_is_capped_and_rate_limited():
    clock = [100.0]
    replies = []
    control = SimpleNamespace(registry=Registry(["n1"], 1, ["s1"]), journal=Journal(None), launcher=FakeLauncher(),
                              reply=lambda identity, msg: replies.append(msg))
    r = Requests(control, lambda: "status", lambda: None, max_added_standbys=2, add_standby_interval_s=10.0,
                 clock=lambda: clock[0])

    def add(name):
        try:
            r.add_standby(b"c", p.AddStandbyRequest(node=name))
            return "ok"
        except MigrationError as e:
            return e.code

    assert add("s2") == "ok"
    assert add("s3") == ErrorCode.NOT_READY  # 10 s between two
    clock[0] += 10
    assert add("s2") == ErrorCode.BAD_REQUEST  # in use
    assert add("s3") == "ok"
    clock[0] += 10
    assert add("s4") == ErrorCode.BAD_REQUEST  # the cap
    assert add("x" * 65) == ErrorCode.BAD_REQUEST and add("-x") == ErrorCode.BAD_REQUEST
    assert control.launcher.started == ["s2", "s3"] and replies == ["status", "status"]
    refused = [e for e in control.journal.since(0, 100) if e["event"] == Event.STANDBY_REFUSED]
    assert len(refused) == 5 and "4 nodes are alive, 2 more than the job started with" in refused[2]["reason"]
    assert [n.name for n in control.registry.nodes_in(NodeRole.STANDBY)] == ["s1", "s2", "s3"]
    # s2 took over n1's ranks after n1 failed: n1's place is free again, and one more standby may come
    control.registry.fail_node(control.registry.nodes["n1"], "n1/0 exited with code -9")
    clock[0] += 10
    assert add("s4") == "ok" and control.launcher.started == ["s2", "s3", "s4"]
    clock[0] += 10
    assert add("s5") == ErrorCode.BAD_REQUEST


# --- resume and the in-process restart --------------------------------------------------------------------------
def write_job(run_dir, *ends):
    layout = p.layout.RunDir(str(run_dir))
    with open(layout.tmd_json, "w") as f:
        json.dump({"address": "tcp://127.0.0.1:5555", "pid": 1, "job": "t", "run_dir": layout.path}, f)
    events = [{"seq": 1, "ts": 1.0, "event": Event.TMD_STARTED, "job": "t", "nodes": ["n1"], "standbys": ["s1"],
               "world_size": 1, "record_steps": 2}]
    events += [{"seq": i + 2, "ts": 2.0, **e} for i, e in enumerate(ends)]
    with open(layout.events, "w") as f:
        f.writelines(json.dumps(e) + "\n" for e in events)


def test_resume_accepts_a_crashed_tmd_and_refuses_an_ended_job(tmp_path):
    write_job(tmp_path, {"event": Event.TMD_CRASHED, "error": "KeyError: 1"})
    assert load(str(tmp_path)).nodes == ["n1"]
    write_job(tmp_path, {"event": Event.TMD_STOPPED, "exit_code": None})  # a crash before tmd_crashed existed
    assert load(str(tmp_path)).last_seq == 2
    write_job(tmp_path, {"event": Event.TMD_STOPPED, "exit_code": 0})
    with pytest.raises(ResumeError):
        load(str(tmp_path))


class FakeDaemon:
    def __init__(self, outcomes, launcher=None):
        self.outcomes = list(outcomes)
        self.launcher, self.cluster = launcher, None
        self.run_dir, self.job = "/nowhere", "t"

    def run(self):
        outcome = self.outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome


def test_supervise_restarts_a_crashed_tmd_with_its_launcher_and_gives_up_after_a_crash_loop(monkeypatch):
    from tmd import supervise as s

    monkeypatch.setattr(s, "load", lambda run_dir: "state")
    launcher = object()
    built, said = [], []

    def build(state, script):
        d = FakeDaemon(script.pop(0), launcher if state is None else None)
        built.append((state, d))
        return d

    script = [[TmdCrashed("boom")], [TmdCrashed("again")], [0]]
    assert s.supervise(lambda st: build(st, script), say=said.append) == 0
    assert [st for st, _ in built] == [None, "state", "state"] and all(d.launcher is launcher for _, d in built)
    assert len(said) == 2 and "restarting" in said[0]

    built.clear()
    clock = [0.0]

    def tick():
        clock[0] += 1.0
        return clock[0]

    script = [[TmdCrashed("x")] for _ in range(10)]
    assert s.supervise(lambda st: build(st, script), max_crashes=3, window_s=60, clock=tick,
                       say=said.append) == s.GAVE_UP
    assert len(built) == 3 and "tmd resume --run-dir /nowhere" in said[-1]
    clock[0] = 0.0
    spaced = lambda: clock.__setitem__(0, clock[0] + 100.0) or clock[0]  # noqa: E731 - one crash per 100 s
    script = [[TmdCrashed("x")] for _ in range(5)] + [[7]]  # never 3 within 60 s: restarted every time
    assert s.supervise(lambda st: build(st, script), max_crashes=3, window_s=60, clock=spaced, say=said.append) == 7


def test_supervise_gives_up_when_the_journal_cannot_be_resumed(monkeypatch):
    from tmd import supervise as s

    def refuse(run_dir):
        raise ResumeError("job t is over")

    monkeypatch.setattr(s, "load", refuse)
    said = []
    assert s.supervise(lambda st: FakeDaemon([TmdCrashed("x")]), say=said.append) == s.GAVE_UP
    assert "job t is over" in said[-1] and "tmd resume --run-dir" in said[-1]


def test_detector_peer_blocked_ignores_malformed_counters():
    reg = Registry(["n1", "n2"], 1, [])
    for node in ("n1", "n2"):
        reg.add_worker(Worker(f"{node}/0".encode(), node, 0, 1, "elsewhere"))
    det = Detector(reg, exits=lambda: (), processes=HostProcesses("here"), replacing=lambda n: False,
                   held_unhealthy=lambda n: False)
    reg.rank_owner[0].counters = {"pending": "1", "last_op_start_s": "0"}
    assert det._peer_blocked_s(reg.nodes["n2"]) == 0.0  # noqa: SLF001
    reg.rank_owner[0].counters = {"pending": 1, "last_op_start_s": float("inf")}
    assert det._peer_blocked_s(reg.nodes["n2"]) == 0.0  # noqa: SLF001


def test_supervise_restarts_a_real_daemon_from_its_journal_on_the_same_address(tmp_path, monkeypatch):
    """A tick that keeps failing crashes the loop (tmd_crashed); supervise resumes the job from the journal,
    binding the same address with the same keys, hands the launcher over, and the resumed daemon journals
    tmd_restarted."""
    from tmd import supervise as s

    monkeypatch.setenv("TM_KEYS", "")
    monkeypatch.delenv("TM_KEYS")
    launcher = FakeLauncher()
    built = []

    def build(state):
        d = Daemon("t", str(tmp_path), ["n1"], 1, ["s1"], RECORD_2, echo=False, resume=state)
        if state is None:
            d.launcher = launcher

            def broken():
                raise KeyError("a bug")
            d._tick = broken  # noqa: SLF001 - a bug that does not go away
        else:
            def finish():
                d.exit_code = 0
            d._tick = finish  # noqa: SLF001
        built.append(d)
        return d

    assert s.supervise(build, say=lambda line: None) == 0
    first, second = built
    assert second.address == first.address and second.launcher is launcher
    names = [e["event"] for e in read_events(p.layout.RunDir(str(tmp_path)).events)]
    assert names.count(Event.INTERNAL_ERROR) == 1 and Event.TMD_CRASHED in names
    assert names.index(Event.TMD_CRASHED) < names.index(Event.TMD_RESTARTED) and names[-1] == Event.TMD_STOPPED


def test_add_standby_is_refused_under_slurm_saying_how_to_add_one():
    """Under SLURM it was accepted and did nothing: the node stayed a cold standby, and a real standby job on it
    was then refused ("already part of this job (standby)")."""
    control = SimpleNamespace(registry=Registry(["n1"], 1, []), journal=Journal(None), launcher=FakeLauncher(),
                              reply=lambda identity, msg: None)
    r = Requests(control, lambda: "status", lambda: object())  # a SLURM cluster
    with pytest.raises(MigrationError) as e:
        r.add_standby(b"c", p.AddStandbyRequest(node="n5"))
    assert e.value.code == ErrorCode.NOT_SUPPORTED and "sbatch --reservation=standby slurm/standby.sbatch" in str(e.value)
    assert "n5" not in control.registry.nodes and control.launcher.started == []
    from tmctl.render import recovery_line
    assert "sbatch --reservation=standby" in recovery_line({"id": 1, "state": "waiting", "waiting_standby": True},
                                                           slurm=True)
    assert "tmctl standby add NAME" in recovery_line({"id": 1, "state": "waiting", "waiting_standby": True})


def test_under_slurm_a_wrong_node_to_move_is_named_before_the_standbys_are_resolved():
    """Outside test: `migrate --from n7 --to any` (n7 not in the job) said "needs 1 warm standbys" when none was
    warm; `--from n1,n1 --to any,any` reported the standby count too."""
    class Cluster:
        def resolve_targets(self, targets):
            raise MigrationError(ErrorCode.BUSY_STANDBY, "needs 1 warm standbys ('any'); 0 are warm")

    control = SimpleNamespace(registry=Registry(["n1", "n2"], 1, []), journal=Journal(None), launcher=FakeLauncher(),
                              reply=lambda identity, msg: None, current_incident=None)
    r = Requests(control, lambda: "status", lambda: Cluster())
    for sources, code, words in ((["n7"], ErrorCode.UNKNOWN_NODE, "unknown node 'n7'"),
                                 (["n1", "n1"], ErrorCode.BAD_REQUEST, "node 'n1' is named twice"),
                                 (["n2"], ErrorCode.BUSY_STANDBY, "needs 1 warm standbys")):
        with pytest.raises(MigrationError) as e:
            r.migrate(b"c", p.MigrateRequest(sources=sources, targets=["any"] * len(sources)))
        assert e.value.code == code and words in str(e.value), (sources, str(e.value))

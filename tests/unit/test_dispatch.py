"""tmd's handler table per sender role, in process (no worker processes; replies recorded, not sent)."""
from __future__ import annotations

import pytest

from tmd import protocol as p
from tmd.config import DEFAULTS
from tmd.daemon import Daemon
from tmd.protocol.vocab import Event, ExitCode

pytestmark = pytest.mark.timeout(30)
RECORD_2 = DEFAULTS.with_options(record_steps=2, metrics_port=-1)  # the fewest recorded steps; no status page


@pytest.fixture
def daemon(tmp_path):
    d = Daemon("t", str(tmp_path), ["n1", "n2"], 1, ["s1"], RECORD_2, echo=False)
    d.sent = []
    d.reply = lambda identity, msg: d.sent.append((identity, msg))  # observe, no sockets
    d.bad_input.window_s = 0.0  # every refusal journalled (tmd.bad_input: one per sender per second otherwise)
    try:
        yield d
    finally:
        d.close()


def register(d: Daemon, node: str) -> bytes:
    identity = f"{node}/0/0123456789abcdef".encode()
    msg = p.Register(node=node, local_rank=0, pid=1, host="elsewhere", standby=node.startswith("s"))
    d.on_frames([identity, p.encode(msg)])
    return identity


def refusals(d: Daemon) -> list[dict]:
    return [e for e in d.journal.since(0, 1000) if e["event"] == Event.BAD_MESSAGE]


def test_a_client_identity_sending_a_worker_message_is_refused(daemon):
    daemon.on_frames([b"tmctl-1", p.encode(p.Heartbeat(step=3, counters={"busy_s": 1.0}))])
    assert daemon.sent == []
    (bad,) = refusals(daemon)
    assert bad["sender"] == "tmctl-1" and bad["error"] == "Heartbeat from a process that never registered"


def test_a_registered_worker_sending_a_client_request_is_refused(daemon):
    n2 = register(daemon, "n2")
    register(daemon, "s1")
    daemon.sent.clear()
    daemon.on_frames([n2, p.encode(p.MigrateRequest(sources=["n2"], targets=["s1"]))])
    daemon.on_frames([n2, p.encode(p.NodeNotice(node="n2", job_id="7", hook=p.HookKind.EPILOG, detail=""))])
    daemon.on_frames([n2, p.encode(p.StatusRequest())])
    assert daemon.sent == [] and daemon.migrations.all == []
    assert [(e["sender"], e["error"]) for e in refusals(daemon)] == [
        ("n2/0/0123456789abcdef", "MigrateRequest is a client message, not one a worker (n2/0) may send"),
        ("n2/0/0123456789abcdef", "NodeNotice is a hook message, not one a worker (n2/0) may send"),
        ("n2/0/0123456789abcdef", "StatusRequest is a client message, not one a worker (n2/0) may send")]


def test_a_coordinator_message_sent_to_tmd_is_refused(daemon):
    for identity in (b"tmctl-1", register(daemon, "n1")):
        daemon.sent.clear()
        daemon.on_frames([identity, p.encode(p.Release(reason="bye", exit_code=0))])
        assert daemon.sent == []
    assert [(e["sender"], e["error"]) for e in refusals(daemon)] == [
        ("tmctl-1", "Release is not a request tmd serves (a coordinator message)"),
        ("n1/0/0123456789abcdef", "Release is not a request tmd serves (a coordinator message)")]


def test_each_role_is_served_from_its_own_senders(daemon):
    n1 = register(daemon, "n1")
    assert daemon.sent[-1][0] == n1 and isinstance(daemon.sent[-1][1], p.Assign)
    daemon.on_frames([n1, p.encode(p.Heartbeat(step=0, counters={"busy_s": 0.5}))])
    assert daemon.registry.by_identity[n1].counters == {"busy_s": 0.5}
    daemon.on_frames([b"tmctl-1", p.encode(p.StatusRequest())])
    assert daemon.sent[-1][0] == b"tmctl-1" and isinstance(daemon.sent[-1][1], p.StatusReply)
    daemon.on_frames([b"tmctl-1", p.encode(p.MigrateRequest(sources=["n9"], targets=["s1"]))])
    assert daemon.sent[-1] == (b"tmctl-1", p.ErrorReply(code=p.ErrorCode.UNKNOWN_NODE, message=(
        "unknown node 'n9': it is not part of this job (active nodes: n1, n2)")))
    daemon.on_frames([b"epilog", p.encode(p.NodeNotice(node="s1", job_id="7", hook=p.HookKind.EPILOG, detail="x"))])
    assert daemon.sent[-1] == (b"epilog", p.NodeNoticeAck(node="s1", job_id="7", hook=p.HookKind.EPILOG))
    events = [e["event"] for e in daemon.journal.since(0, 1000)]
    assert Event.NODE_NOTICE in events and Event.MIGRATE_REFUSED in events and refusals(daemon) == []


def test_a_fenced_worker_is_told_to_exit(daemon):
    n1 = register(daemon, "n1")
    daemon.registry.by_identity[n1].fenced = True
    daemon.on_frames([n1, p.encode(p.Heartbeat(step=0, counters={}))])
    msg = daemon.sent[-1][1]
    assert isinstance(msg, p.Release) and msg.exit_code == ExitCode.FENCED


def test_bad_frames_are_journalled(daemon):
    daemon.on_frames([b"x", b"not json"])
    daemon.on_frames([b"only one frame"])
    assert [e["error"][:8] for e in refusals(daemon)] == ["not JSON", "expected"]


def test_a_rank_failed_ends_the_job_even_from_a_worker_fenced_for_its_exit(daemon):
    from tmd.faults import JobFailed

    n2 = register(daemon, "n2")
    w = daemon.registry.nodes["n2"].workers[0]
    w.fenced = w.fenced_on_exit = True  # its exit was taken for a node failure first
    with pytest.raises(JobFailed, match="rank 1 on n2 raised at step 5: ValueError: x"):
        daemon.on_frames([n2, p.encode(p.RankFailed(rank=1, step=5, kind=p.FailureKind.SCRIPT_ERROR,
                                                     error="ValueError: x", traceback="tb"))])
    assert daemon.status().failure["rank"] == 1


def test_a_rank_failed_from_a_node_failed_as_silent_is_fenced_not_the_jobs_end(daemon):
    """n2 went silent (a partition, SIGSTOP), was failed and its rank recovered elsewhere; its process comes back
    and raises (a stale file handle, a broken collective): that follows from the fencing, the job trains on."""
    n2 = register(daemon, "n2")
    register(daemon, "n1")
    register(daemon, "s1")
    for rank in (0, 1):  # the job recorded its first steps: the incident can warm a replacement
        open(daemon.layout.recording(rank), "w").close()
    daemon.fail_node(daemon.registry.nodes["n2"], "no heartbeat for 5.0 s", p.FailureSignal.SILENT)
    daemon.on_frames([n2, p.encode(p.RankFailed(rank=1, step=7, kind=p.FailureKind.SCRIPT_ERROR,
                                                 error="OSError: stale file handle", traceback=""))])
    assert isinstance(daemon.sent[-1][1], p.Release) and daemon.sent[-1][1].exit_code == ExitCode.FENCED
    assert daemon.status().failure is None and daemon.journal.since(0, 1000)[-1]["event"] == Event.FENCED


def test_a_warning_is_shown_and_refuses_migrations(daemon):
    from tmd.migration import MigrationError

    n1 = register(daemon, "n1")
    register(daemon, "n2")
    register(daemon, "s1")
    daemon.on_frames([n1, p.encode(p.RankWarning(rank=0, code=p.WarningCode.NOTHING_MANAGED, message="manage it"))])
    assert daemon.status().warnings == [{"rank": 0, "node": "n1", "code": p.WarningCode.NOTHING_MANAGED,
                                         "message": "manage it"}]
    with pytest.raises(MigrationError) as e:
        daemon.request_migration("n2", "s1")
    assert e.value.code == p.ErrorCode.UNMANAGED_STATE and "nothing_managed" in str(e.value)
    assert daemon.status().nodes[0]["pids"] == {"0": 1}


def test_a_late_group_aborts_a_migration_not_yet_decided_and_refuses_the_next(daemon):
    """A process group created after the recorded steps: a migration whose joiners warmed without it committed, and
    the stayers' collective on it then failed (outside review m01). tmd aborts a migration not yet decided."""
    from tmd.migration import MigrationError

    n1 = register(daemon, "n1")
    register(daemon, "n2")
    register(daemon, "s1")
    for w in daemon.registry.rank_owner.values():
        w.step = 9  # past the recorded steps
    m = daemon.request_migration("n2", "s1")
    assert not m.finished
    warning = p.RankWarning(rank=0, code=p.WarningCode.LATE_GROUP, message="process group pg2 (ranks [0, 1]) was "
                            "created at step 8, after the job recorded its first 2 steps")
    daemon.on_frames([n1, p.encode(warning)])
    assert m.state == p.MigrationState.ABORTED and "reported late_group: process group pg2" in m.reason
    with pytest.raises(MigrationError) as e:
        daemon.request_migration("n2", "s1")
    assert e.value.code == p.ErrorCode.UNMANAGED_STATE and "created at step 8" in str(e.value)


def test_a_worker_speaks_only_for_its_own_rank_and_no_process_joins_a_node_that_left(daemon):
    """Every process of the job holds the worker key: what one says of another rank, or a process that registers
    on a node that left the job, is refused, and the job is untouched."""
    from tmd.registry import Worker

    n1, _, s1 = register(daemon, "n1"), register(daemon, "n2"), register(daemon, "s1")
    spoofed = [(n1, p.RankFailed(rank=1, step=5, kind=p.FailureKind.SCRIPT_ERROR, error="E: not mine", traceback="")),
               (n1, p.RankWarning(rank=1, code=p.WarningCode.NOTHING_MANAGED, message="not mine")),
               (n1, p.RankWarning(rank=101, code=p.WarningCode.STATE_AFTER_UPDATE, message="A" * 100)),
               (s1, p.RankFailed(rank=-1, step=0, kind=p.FailureKind.SCRIPT_ERROR, error="E: a standby", traceback=""))]
    for identity, msg in spoofed:
        daemon.on_frames([identity, p.encode(msg)])  # no JobFailed raised
    assert daemon.status().warnings == [] and daemon.status().failure is None
    assert [e["error"] for e in refusals(daemon)] == [
        "RankFailed for rank 1 from n1/0, which holds rank 0", "RankWarning for rank 1 from n1/0, which holds rank 0",
        "RankWarning for rank 101 from n1/0, which holds rank 0", "RankFailed for rank -1 from s1/0, which holds no rank"]
    daemon.registry.nodes["n2"].role = p.NodeRole.LEFT  # (its migration committed)
    daemon.registry.nodes["n2"].workers[0].exited = True
    ghost = b"n2/0/fedcba9876543210"
    daemon.on_frames([ghost, p.encode(p.Register(node="n2", local_rank=0, pid=2, host="elsewhere", standby=False))])
    assert isinstance(daemon.sent[-1][1], p.Release) and "node n2 left the job" in daemon.sent[-1][1].reason
    assert ghost not in daemon.registry.by_identity
    daemon.on_frames([n1, p.encode(p.RankWarning(rank=0, code=p.WarningCode.STATE_AFTER_UPDATE, message="B" * 5000))])
    (kept,) = daemon.status().warnings  # its own: kept, with its message cut
    assert kept["rank"] == 0 and len(kept["message"]) < 1100


def test_each_authenticated_role_may_send_only_its_own_messages(daemon):
    """tmd.protocol.keys labels each connection worker, client or hook: a message of another role is refused."""
    S = p.Sender
    cases = [(b"tmctl-1", S.CLIENT, p.Register(node="n1", local_rank=0, pid=1, host="h", standby=False)),
             (b"tmctl-2", S.CLIENT, p.Done(rank=0, final_step=1, left=False)),
             (b"epilog-1", S.HOOK, p.MigrateRequest(sources=["n2"], targets=["s1"])),
             (b"n9/0/x", S.WORKER, p.MigrateRequest(sources=["n2"], targets=["s1"])),
             (b"n9/1/x", S.WORKER, p.NodeNotice(node="n2", job_id="7", hook=p.HookKind.EPILOG, detail=""))]
    for identity, role, msg in cases:
        daemon.on_frames([identity, p.encode(msg)], role)
    assert daemon.registry.by_identity == {} and daemon.migrations.all == []
    whys = [f"{msg.TYPE} is a {msg.SENDER} message; this connection is authenticated as a {role}"
            for _, role, msg in cases]
    assert [e["error"] for e in refusals(daemon)] == whys
    # tmctl waits for an answer: its refusals are answered (a hook's and a worker's are not: they do not wait)
    assert daemon.sent == [(identity, p.ErrorReply(code=p.ErrorCode.BAD_REQUEST, message=why))
                           for (identity, role, _), why in zip(cases, whys) if role == S.CLIENT]
    daemon.sent.clear()
    daemon.on_frames([b"tmctl-3", p.encode(p.StatusRequest())], S.CLIENT)
    assert isinstance(daemon.sent[-1][1], p.StatusReply)


def test_a_worker_registers_only_under_its_own_identity(daemon):
    """A worker's identity is ``<node>/<local_rank>/<nonce>`` (worker.agent): a Register naming another is refused."""
    daemon.on_frames([b"n1/0/0123456789abcdef", p.encode(
        p.Register(node="n2", local_rank=0, pid=1, host="h", standby=False))], p.Sender.WORKER)
    assert daemon.registry.by_identity == {}
    assert refusals(daemon)[-1]["error"] == "Register of n2/0 from another identity"
    register(daemon, "n2")
    assert list(daemon.registry.by_identity) == [b"n2/0/0123456789abcdef"]


def test_an_authenticated_client_gets_told_why_its_frame_was_refused(daemon):
    """tmctl waits for an answer: a frame it sent that does not decode is answered with bad_request at once."""
    daemon.on_frames([b"tmctl-1", b'{"v": 1, "type": "MigrateRequest", "sources": ["n\\udcff"], "targets": ["s1"]}'],
                     p.Sender.CLIENT)
    ((identity, reply),) = daemon.sent
    assert identity == b"tmctl-1" and reply.code == p.ErrorCode.BAD_REQUEST and "surrogate" in reply.message
    daemon.on_frames([b"n1/0/x", b"garbage"], p.Sender.WORKER)  # a worker gets no answer: it does not wait
    assert len(daemon.sent) == 1 and daemon.migrations.all == []


def test_reports_for_another_rank_or_from_a_process_with_no_part_count_for_nothing(daemon):
    """The worker key is every process's: a standby (no rank) cannot end a rank, start a regroup, or journal a
    snapshot for one; a rank cannot speak for another."""
    n1, n2, s1 = register(daemon, "n1"), register(daemon, "n2"), register(daemon, "s1")  # ranks 0, 1; a standby
    failed = dict(incident_id=0, phase=p.RecoveryPhase.COLLECTIVE_FAILED, ok=False, error="forged", committed_step=-1,
                  bytes_moved=0, seconds=0.0)
    for identity, msg in [(s1, p.Done(rank=0, final_step=9, left=False)),
                          (n1, p.Done(rank=1, final_step=9, left=False)),
                          (s1, p.SnapshotReport(rank=1, step=4, bytes_per_copy=2 ** 40, copy_s=1e9)),
                          (s1, p.RecoveryReport(rank=0, **failed)), (n2, p.RecoveryReport(rank=0, **failed))]:
        daemon.on_frames([identity, p.encode(msg)], p.Sender.WORKER)
    kinds = [e["event"] for e in daemon.journal.since(0, 1000)]
    assert Event.RANK_DONE not in kinds and Event.SNAPSHOT_TAKEN not in kinds and Event.COLLECTIVE_FAILED not in kinds
    assert not any(w.done for w in daemon.registry.by_identity.values())
    daemon.incidents.tick(10 ** 9)  # past regroup_after_s: no regroup was armed
    assert daemon.incidents.current is None
    assert [e["error"] for e in refusals(daemon)] == [
        "Done for rank 0 from s1/0, which holds no rank", "Done for rank 1 from n1/0, which holds rank 0",
        "SnapshotReport for rank 1 from s1/0, which holds no rank"]
    stale = [e for e in daemon.journal.since(0, 1000) if e["event"] == Event.STALE_RECOVERY_REPORT]
    assert [e["reason"] for e in stale] == ["s1/0 does not hold rank 0", "n2/0 does not hold rank 0"]
    daemon.on_frames([n2, p.encode(p.RecoveryReport(rank=1, **failed))], p.Sender.WORKER)  # its own: counts
    assert [e["rank"] for e in daemon.journal.since(0, 1000) if e["event"] == Event.COLLECTIVE_FAILED] == [1]


def test_a_process_whose_slot_another_holds_now_is_told_to_exit(daemon):
    """A standby's process exited and a fresh one registered in its slot: the old identity speaks for nothing."""
    old = register(daemon, "s1")
    daemon.registry.nodes["s1"].workers[0].exited = True
    new = b"s1/0/fedcba9876543210"
    daemon.on_frames([new, p.encode(p.Register(node="s1", local_rank=0, pid=2, host="h", standby=True))])
    daemon.sent.clear()
    daemon.on_frames([old, p.encode(p.Heartbeat(step=0, counters={}))], p.Sender.WORKER)
    assert daemon.sent == [(old, p.Release(reason="another process holds this slot", exit_code=ExitCode.REFUSED))]
    assert refusals(daemon)[-1]["error"] == "Heartbeat from s1/0 (pid 1), whose slot another process holds now"
    daemon.on_frames([new, p.encode(p.Heartbeat(step=0, counters={"busy_s": 1.0}))], p.Sender.WORKER)
    assert daemon.registry.by_identity[new].counters == {"busy_s": 1.0}


def test_reports_that_count_for_nothing_are_journalled_once_a_second_per_sender(daemon):
    daemon.bad_input.window_s = 1.0
    n1 = register(daemon, "n1")
    stale = p.RecoveryReport(incident_id=7, rank=0, phase=p.RecoveryPhase.HALTED, ok=True, error="",
                             committed_step=3, bytes_moved=0, seconds=0.0)
    for _ in range(1000):
        daemon.on_frames([n1, p.encode(stale)], p.Sender.WORKER)
    kinds = [e["event"] for e in daemon.journal.since(0, 10000)]
    assert kinds.count(Event.STALE_RECOVERY_REPORT) == 1
    daemon.bad_input.tick(10 ** 9)
    (dropped,) = [e for e in daemon.journal.since(0, 10000) if e["event"] == Event.BAD_MESSAGES_DROPPED]
    assert dropped["count"] == 999


def test_a_replica_report_that_does_not_fit_the_job_is_refused_not_an_internal_error(daemon):
    n1, n2, s1 = register(daemon, "n1"), register(daemon, "n2"), register(daemon, "s1")  # ranks 0, 1; a standby
    cases = [(n1, p.ReplicaReport(rank=0, replicas=[1]), "replica report of rank 0 names [1] (world size 2)"),
             (n1, p.ReplicaReport(rank=0, replicas=[0, 2]), "replica report of rank 0 names [0, 2] (world size 2)"),
             (n1, p.ReplicaReport(rank=1, replicas=[1]), "replica report for rank 1 from the process of rank 0"),
             (s1, p.ReplicaReport(rank=0, replicas=[0]), "replica report for rank 0 from the process of rank None")]
    for identity, msg, _ in cases:
        daemon.on_frames([identity, p.encode(msg)], p.Sender.WORKER)
    daemon.on_frames([n2, b'{"v": 1, "type": "ReplicaReport", "rank": 1, "replicas": [true]}'], p.Sender.WORKER)
    assert [e["error"] for e in refusals(daemon)][:4] == [why for _, _, why in cases]
    assert "ReplicaReport.replicas" in refusals(daemon)[4]["error"] and len(refusals(daemon)) == 5
    events = [e["event"] for e in daemon.journal.since(0, 1000)]
    assert Event.INTERNAL_ERROR not in events and daemon.internal_errors == 0
    assert daemon.incidents.replicas == {} and Event.NO_REPLICA not in events


def test_replica_reports_of_unreplicated_ranks_are_shown_in_status(daemon):
    n1, n2 = register(daemon, "n1"), register(daemon, "n2")
    daemon.on_frames([n1, p.encode(p.ReplicaReport(rank=0, replicas=[0]))], p.Sender.WORKER)
    assert daemon.status().warnings == []  # rank 1 has not reported yet
    daemon.on_frames([n2, p.encode(p.ReplicaReport(rank=1, replicas=[1]))], p.Sender.WORKER)
    warnings = daemon.status().warnings
    assert [(w["rank"], w["node"], w["code"]) for w in warnings] == [(0, "n1", Event.NO_REPLICA),
                                                                     (1, "n2", Event.NO_REPLICA)]
    assert "rolls the job back to the last buddy snapshot" in warnings[0]["message"]  # snapshots on by default
    assert refusals(daemon) == [] and daemon.incidents.keepers == {0: 1, 1: 0}


def test_a_joiner_that_raises_is_journalled_and_the_job_trains_on(daemon):
    register(daemon, "n1")
    register(daemon, "n2")
    s1 = register(daemon, "s1")
    for w in daemon.registry.rank_owner.values():
        w.step = 5  # past the recorded steps
    daemon.request_migration(["n2"], ["s1"])  # s1/0 takes rank 1 over: its owner only from the commit on
    assert daemon.registry.by_identity[s1].rank is None and daemon.registry.rank_owner[1].node == "n2"
    daemon.on_frames([s1, p.encode(p.RankFailed(rank=1, step=2, kind=p.FailureKind.SCRIPT_ERROR,
                                                error="RuntimeError: mesh created in another order",
                                                traceback="tb"))], p.Sender.WORKER)
    (failed,) = [e for e in daemon.journal.since(0, 1000) if e["event"] == Event.JOINER_FAILED]
    assert failed["rank"] == 1 and failed["node"] == "s1" and failed["error"].endswith("another order")
    assert daemon.status().failure is None and daemon.exit_code is None


def test_thousands_of_warnings_leave_the_status_reply_one_frame(daemon):
    """One warning per rank and code, each up to ~1,000 characters: at 4,096 ranks, more than a frame holds."""
    from tmd.status import MAX_WARNINGS

    n1 = register(daemon, "n1")
    w = daemon.registry.by_identity[n1]
    for rank in range(5000):
        w.rank = rank  # (as if each rank had reported its own)
        daemon.on_frames([n1, p.encode(p.RankWarning(rank=rank, code=p.WarningCode.STATE_AFTER_UPDATE,
                                                     message="x" * 5000))])
    reply = daemon.status()
    assert len(reply.warnings) == MAX_WARNINGS and reply.warnings[-1]["message"].startswith("4937 more warnings")
    assert len(p.encode(reply)) < p.MAX_MESSAGE_BYTES
    assert len(daemon.faults.warnings) == 5000  # every one kept (and journalled)

"""The shared protocol: round trips, and strict decoding of everything else."""
import json

import pytest

from tmd import protocol as p

pytestmark = pytest.mark.timeout(10)


def test_every_message_round_trips():
    samples = [
        p.Register(node="n1", local_rank=0, pid=123, host="host", standby=False),
        p.Heartbeat(step=3, counters={"ops_issued": 5, "mode": "live"}),
        p.StepReport(rank=2, step=7, step_time_s=0.125, shadow=False),
        p.PhaseDone(migration_id=1, rank=2, phase="transferred", ok=True, error="", step=-1, bytes_moved=1024, seconds=0.5, groups=[]),
        p.Assign(role="joiner", rank=2, world_size=4, store_host="127.0.0.1", store_port=29500, generation=1, record_steps=3, record_dir="/tmp/r", migration_id=1, incident_id=0),
        p.Halt(incident_id=3, reason="n2 exited", failed_ranks=[2, 3]),
        p.Recover(incident_id=3, generation=4, resume_step=17, sends=[[0, 2], [1, 3]]),
        p.RecoveryReport(incident_id=3, rank=0, phase="halted", ok=True, error="", committed_step=16, bytes_moved=0, seconds=0.0),
        p.Prepare(migration_id=1, generation=2, role="stayer", leaver_ranks=[2, 3], transfer_prefix=""),
        p.Switch(migration_id=1, step=20),
        p.Decide(migration_id=1, commit=True, reason="transferred"),
        p.Release(reason="job finished", exit_code=0),
        p.Reregister(store_host="127.0.0.1", store_port=29501, generation=2),
        p.Rejoin(node="n1", local_rank=1, pid=123, host="host", rank=1, role="active", step=57, generation=2),
        p.StatusReply(job="job", world_size=4, generation=1, step=10, nodes=[{"name": "n1"}], migration=None, recovery=None,
                      failure=None, warnings=[]),
        p.MigrateRequest(sources=["n2"], targets=["s1"]),
        p.ErrorReply(code="unknown_node", message="unknown node 'n9'"),
    ]
    for msg in samples:
        assert p.decode(p.encode(msg)) == msg


@pytest.mark.parametrize("frame, why", [
    (b"\xff\xfe", "not JSON"),
    (b"[1, 2]", "not a JSON object"),
    (json.dumps({"v": 99, "type": "Switch", "migration_id": 1, "step": 2}).encode(), "version"),
    (json.dumps({"v": 1, "type": "Reboot"}).encode(), "unknown message type"),
    (json.dumps({"v": 1, "type": "Switch", "migration_id": 1}).encode(), "missing fields ['step']"),
    (json.dumps({"v": 1, "type": "Switch", "migration_id": 1, "step": 2, "x": 0}).encode(), "unexpected fields ['x']"),
    (json.dumps({"v": 1, "type": "Switch", "migration_id": "1", "step": 2}).encode(), "Switch.migration_id"),
    (json.dumps({"v": 1, "type": "Switch", "migration_id": True, "step": 2}).encode(), "Switch.migration_id"),
    (json.dumps({"v": 1, "type": "Message"}).encode(), "unknown message type"),
])
def test_malformed_frames_raise_protocol_error(frame, why):
    with pytest.raises(p.ProtocolError, match=why.replace("[", r"\[").replace("]", r"\]")):
        p.decode(frame)


def frame(type_, **fields):
    return json.dumps({"v": 1, "type": type_, **fields}).encode()


def recovery_report(**overrides):
    fields = dict(incident_id=1, rank=0, phase="halted", ok=True, error="", committed_step=9, bytes_moved=0,
                  seconds=0.0, snapshots=[4, 9], shadow_steps=0)
    fields.update(overrides)
    return frame("RecoveryReport", **fields)


def test_replica_and_snapshot_fields_round_trip_and_default_in_constructors():
    assert p.RecoveryReport(incident_id=1, rank=0, phase="halted", ok=True, error="", committed_step=9,
                            bytes_moved=0, seconds=0.0).snapshots == []
    assert p.Recover(incident_id=1, generation=2, resume_step=5, sends=[]).rollback_step == -1
    assert p.Assign(role="active", rank=0, world_size=2, store_host="h", store_port=1, generation=0, record_steps=3,
                    record_dir="/r", migration_id=0, incident_id=0).snapshot_every == 0
    for msg in (p.ReplicaReport(rank=3, replicas=[1, 3]),
                p.RecoveryReport(incident_id=1, rank=0, phase="halted", ok=True, error="", committed_step=9,
                                 bytes_moved=0, seconds=0.0, snapshots=[4, 9]),
                p.Recover(incident_id=1, generation=2, resume_step=5, sends=[[4, 2]], rollback_step=4),
                p.Assign(role="active", rank=0, world_size=2, store_host="h", store_port=1, generation=0,
                         record_steps=3, record_dir="/r", migration_id=0, incident_id=0, snapshot_every=10)):
        assert p.decode(p.encode(msg)) == msg
    assert p.decode(recovery_report(snapshots=[])).snapshots == []
    assert p.decode(recovery_report(snapshots=list(range(p.MAX_SNAPSHOTS)))).snapshots == list(range(p.MAX_SNAPSHOTS))


def test_a_field_with_a_default_is_still_required_on_the_wire():
    fields = json.loads(recovery_report())
    del fields["snapshots"]
    with pytest.raises(p.ProtocolError, match=r"missing fields \['snapshots'\]"):
        p.decode(json.dumps(fields).encode())


@pytest.mark.parametrize("snapshots", [[True], [-1], [4, -2], [1.5], ["4"], [[4]], list(range(p.MAX_SNAPSHOTS + 1))])
def test_recovery_report_snapshots_out_of_bounds_are_refused(snapshots):
    with pytest.raises(p.ProtocolError, match="RecoveryReport.snapshots"):
        p.decode(recovery_report(snapshots=snapshots))


@pytest.mark.parametrize("replicas", [[], [True], [False, 1], [-1], [p.MAX_RANKS], [0.0], ["1"], [None]])
def test_replica_report_ranks_out_of_bounds_are_refused(replicas):
    with pytest.raises(p.ProtocolError, match="ReplicaReport.replicas"):
        p.decode(frame("ReplicaReport", rank=0, replicas=replicas))


def test_replica_report_of_valid_ranks_decodes():
    top = p.MAX_RANKS - 1
    assert p.decode(frame("ReplicaReport", rank=2, replicas=[0, 2, top])).replicas == [0, 2, top]
    with pytest.raises(p.ProtocolError, match="ReplicaReport.rank"):
        p.decode(frame("ReplicaReport", rank=True, replicas=[0]))


def test_exit_codes_have_one_meaning_each():
    """tmd's, the workers', the hooks' and tmctl's exit codes are one table: an IntEnum member with a number already
    taken would silently become an alias of the first (as tmctl's 'still running' and 'fenced' once shared 3)."""
    from tmctl import cli

    from tmd.protocol.vocab import ExitCode

    assert len(ExitCode.__members__) == len({m.value for m in ExitCode.__members__.values()}), ExitCode.__members__
    assert {cli.EXIT_ABORTED, cli.EXIT_REFUSED, cli.EXIT_STILL_RUNNING} <= set(ExitCode)
    assert cli.EXIT_STILL_RUNNING != ExitCode.FENCED

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
        p.MigrateRequest(source="n2", target="s1"),
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

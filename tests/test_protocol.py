"""The shared protocol: round trips, and strict decoding of everything else."""
import json

import pytest

from tmd import protocol as p

pytestmark = pytest.mark.timeout(10)


def test_every_message_round_trips():
    samples = [
        p.Register("n1", 0, 123, "host", False),
        p.Heartbeat(3, {"ops_issued": 5, "mode": "live"}),
        p.StepReport(2, 7, 0.125, False),
        p.PhaseDone(1, 2, "transferred", True, "", -1, 1024, 0.5, []),
        p.Assign("joiner", 2, 4, "127.0.0.1", 29500, 1, 3, "/tmp/r", 1, 0),
        p.Halt(3, "n2 exited", [2, 3]),
        p.Recover(3, 4, 17, [[0, 2], [1, 3]]),
        p.RecoveryReport(3, 0, "halted", True, "", 16, 0, 0.0),
        p.Prepare(1, 2, "stayer", [2, 3], ""),
        p.Switch(1, 20),
        p.Decide(1, True, "transferred"),
        p.Release("job finished", 0),
        p.Reregister("127.0.0.1", 29501, 2),
        p.Rejoin("n1", 1, 123, "host", 1, "active", 57, 2),
        p.StatusReply("job", 4, 1, 10, [{"name": "n1"}], None, None),
        p.MigrateRequest("n2", "s1"),
        p.ErrorReply("unknown_node", "unknown node 'n9'"),
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

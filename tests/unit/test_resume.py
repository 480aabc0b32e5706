"""``tmd resume`` without processes: the journal replay (``resume.load``) on made-up journals, and the restarted
tmd's re-learning (``Resumed``) against a recording JobControl."""
from __future__ import annotations

import json
import os

import pytest

from tmd import protocol as p
from tmd.episode import Episodes
from tmd.journal import Journal
from tmd.protocol.vocab import Event, ExitCode, FailureSignal, NodeRole, WorkerRole
from tmd.registry import Registry
from tmd.resume import JobState, ResumeError, Resumed, load

pytestmark = pytest.mark.timeout(10)

ACTIVE, STANDBY, LEFT, FAILED = NodeRole.ACTIVE, NodeRole.STANDBY, NodeRole.LEFT, NodeRole.FAILED


def write_job(tmp_path, *events: dict, cut: bool = True) -> str:
    """A run dir whose tmd (not running: a pid that does not exist) journalled ``events`` after its start:
    2 nodes x 2 ranks, standbys s1 and s2. ``cut``: the last line is cut short, as by a kill."""
    (tmp_path / "tmd.json").write_text(json.dumps({"address": "tcp://127.0.0.1:5555", "pid": 999_999_999,
                                                   "job": "j", "run_dir": str(tmp_path), "command": ["train"]}))
    start = {"event": Event.TMD_STARTED, "job": "j", "world_size": 4, "nodes": ["n1", "n2"],
             "standbys": ["s1", "s2"], "store_port": 1, "record_steps": 3}
    with open(tmp_path / "events.jsonl", "w") as f:
        for i, e in enumerate([start, *events]):
            f.write(json.dumps({"seq": i + 1, "ts": 1000.0 + i, **e}) + "\n")
        if cut:
            f.write('{"seq": 99, "ts": 1000.5, "event": "migration_comm')
    return str(tmp_path)


def migration(event: Event, mid: int = 1, source: str = "n2", target: str = "s1", **fields) -> dict:
    """A migration event as tmd journals it: the lists ``sources`` and ``targets`` (``source``/``target``: one
    node, or several joined by commas)."""
    return {"event": event, "migration_id": mid, "sources": source.split(","), "targets": target.split(","),
            **fields}


def test_a_committed_migration_hands_the_ranks_over(tmp_path):
    st = load(write_job(tmp_path, migration(Event.MIGRATION_REQUESTED, generation=1),
                        migration(Event.MIGRATION_TRANSFERRED), migration(Event.MIGRATION_COMMITTED)))
    assert st.roles == {"n1": (ACTIVE, [0, 1]), "n2": (LEFT, []), "s1": (ACTIVE, [2, 3]), "s2": (STANDBY, [])}
    assert (st.generation, st.last_migration_id, st.cut_migration, st.open_incident) == (1, 1, None, None)
    assert (st.job, st.ranks_per_node, st.config.replay.record_steps, st.command, st.last_seq) == \
        ("j", 2, 3, ["train"], 4)


def test_a_migration_cut_before_its_commit_decision_is_aborted(tmp_path):
    st = load(write_job(tmp_path, migration(Event.MIGRATION_REQUESTED, mid=4, source="n1", target="s2")))
    assert st.cut_migration == {"id": 4, "sources": ["n1"], "targets": ["s2"], "commit": False}
    assert st.roles["n1"] == (ACTIVE, [0, 1]) and st.roles["s2"] == (STANDBY, [])  # the joiners go
    assert st.generation == 1 and st.last_migration_id == 4  # its generation is used even if none was journalled


def test_a_migration_cut_after_its_commit_decision_is_committed(tmp_path):
    st = load(write_job(tmp_path, migration(Event.MIGRATION_REQUESTED, mid=2, source="n1", target="s2"),
                        migration(Event.MIGRATION_SWITCHING, mid=2, source="n1", target="s2"),
                        migration(Event.MIGRATION_TRANSFERRED, mid=2, source="n1", target="s2")))
    assert st.cut_migration == {"id": 2, "sources": ["n1"], "targets": ["s2"], "commit": True}
    assert st.roles["s2"] == (ACTIVE, [0, 1]) and st.roles["n1"] == (LEFT, [])


def test_an_aborted_migration_returns_its_target_to_the_standbys(tmp_path):
    st = load(write_job(tmp_path, migration(Event.MIGRATION_REQUESTED), migration(Event.MIGRATION_ABORTED)))
    assert st.roles["s1"] == (STANDBY, []) and st.roles["n2"] == (ACTIVE, [2, 3]) and st.cut_migration is None


def test_a_journal_of_single_node_migrations_with_source_and_target_fields_still_reads(tmp_path):
    old = [{"event": ev, "migration_id": 1, "source": "n2", "target": "s1"}
           for ev in (Event.MIGRATION_REQUESTED, Event.MIGRATION_TRANSFERRED, Event.MIGRATION_COMMITTED)]
    st = load(write_job(tmp_path, *old))
    assert st.roles == {"n1": (ACTIVE, [0, 1]), "n2": (LEFT, []), "s1": (ACTIVE, [2, 3]), "s2": (STANDBY, [])}
    st = load(write_job(tmp_path, old[0]))
    assert st.cut_migration == {"id": 1, "sources": ["n2"], "targets": ["s1"], "commit": False}


def test_a_committed_migration_of_two_nodes_hands_over_every_pair(tmp_path):
    pairs = {"source": "n1,n2", "target": "s2,s1"}
    st = load(write_job(tmp_path, migration(Event.MIGRATION_REQUESTED, generation=1, **pairs),
                        migration(Event.MIGRATION_TRANSFERRED, **pairs), migration(Event.MIGRATION_COMMITTED, **pairs)))
    assert st.roles == {"n1": (LEFT, []), "n2": (LEFT, []), "s1": (ACTIVE, [2, 3]), "s2": (ACTIVE, [0, 1])}
    assert (st.generation, st.last_migration_id, st.cut_migration) == (1, 1, None)


def test_a_cut_migration_of_two_nodes_is_aborted_or_committed_as_a_whole(tmp_path):
    pairs = {"mid": 5, "source": "n1,n2", "target": "s1,s2"}
    st = load(write_job(tmp_path, migration(Event.MIGRATION_REQUESTED, **pairs)))
    assert st.cut_migration == {"id": 5, "sources": ["n1", "n2"], "targets": ["s1", "s2"], "commit": False}
    assert st.roles == {"n1": (ACTIVE, [0, 1]), "n2": (ACTIVE, [2, 3]), "s1": (STANDBY, []), "s2": (STANDBY, [])}
    st = load(write_job(tmp_path, migration(Event.MIGRATION_REQUESTED, **pairs),
                        migration(Event.MIGRATION_TRANSFERRED, **pairs)))
    assert st.cut_migration["commit"]
    assert st.roles == {"n1": (LEFT, []), "n2": (LEFT, []), "s1": (ACTIVE, [0, 1]), "s2": (ACTIVE, [2, 3])}


def test_an_aborted_two_node_migration_whose_leaver_died_keeps_only_its_pairs_standby_promoted(tmp_path):
    pairs = {"source": "n1,n2", "target": "s1,s2"}
    st = load(write_job(tmp_path, migration(Event.MIGRATION_REQUESTED, generation=1, **pairs),
                        migration(Event.MIGRATION_ABORTED, reason="leaver n2 lost", **pairs),
                        {"event": Event.NODE_FAILED, "node": "n2", "ranks": [2, 3]},
                        {"event": Event.RECOVERY_STARTED, "incident_id": 1, "adopted": {"n2": "s2"}},
                        {"event": Event.RECOVERY_PLAN, "incident_id": 1, "generation": 2, "sends": []},
                        {"event": Event.RECOVERY_DONE, "incident_id": 1, "standbys": {"n2": "s2"}}))
    assert st.roles == {"n1": (ACTIVE, [0, 1]), "n2": (FAILED, []), "s1": (STANDBY, []), "s2": (ACTIVE, [2, 3])}


def test_a_finished_recovery_and_an_open_one(tmp_path):
    done = [{"event": Event.NODE_FAILED, "node": "n1", "ranks": [0, 1]},
            {"event": Event.RECOVERY_STARTED, "incident_id": 1, "adopted": {}},
            {"event": Event.STANDBY_PROMOTED, "incident_id": 1, "failed_node": "n1", "standby": "s2"},
            {"event": Event.RECOVERY_PLAN, "incident_id": 1, "generation": 1, "resume_step": 50, "sends": []},
            {"event": Event.RECOVERY_DONE, "incident_id": 1, "standbys": {"n1": "s2"}}]
    st = load(write_job(tmp_path, *done))
    assert st.roles == {"n1": (FAILED, []), "n2": (ACTIVE, [2, 3]), "s1": (STANDBY, []), "s2": (ACTIVE, [0, 1])}
    assert st.open_incident is None and st.generation == 1
    cut = [{"event": Event.NODE_FAILED, "node": "n2", "ranks": [2, 3]},
           {"event": Event.RECOVERY_STARTED, "incident_id": 2, "adopted": {}},
           {"event": Event.STANDBY_PROMOTED, "incident_id": 2, "failed_node": "n2", "standby": "s1"}]
    st = load(write_job(tmp_path, *done, *cut))
    assert st.open_incident == 2
    assert st.roles["n2"] == (FAILED, []) and st.roles["s1"] == (STANDBY, [])  # its replacement: a standby again


def test_a_leavers_warm_joiners_adopted_by_the_recovery_stay_promoted_until_it_is_done(tmp_path):
    st = load(write_job(tmp_path, migration(Event.MIGRATION_REQUESTED, generation=1),
                        migration(Event.MIGRATION_ABORTED, reason="leaver n2 lost"),
                        {"event": Event.NODE_FAILED, "node": "n2", "ranks": [2, 3]},
                        {"event": Event.RECOVERY_STARTED, "incident_id": 1, "adopted": {"n2": "s1"}},
                        {"event": Event.RECOVERY_PLAN, "incident_id": 1, "generation": 2, "sends": []},
                        {"event": Event.RECOVERY_DONE, "incident_id": 1, "standbys": {"n2": "s1"}}))
    assert st.roles["s1"] == (ACTIVE, [2, 3]) and st.roles["n2"] == (FAILED, []) and st.generation == 2


def test_a_guard_is_a_standby_to_a_restarted_tmd_until_a_finished_recovery_adopted_it(tmp_path):
    guarded = [{"event": Event.GUARD_ASSIGNED, "standby": "s1", "node": "n1", "ranks": [0, 1]},
               {"event": Event.GUARD_WARMED, "standby": "s1", "ranks": [0, 1]}]
    st = load(write_job(tmp_path, *guarded))
    assert st.roles["s1"] == (STANDBY, [])  # its processes are refused on rejoin and come back fresh
    adopted = [{"event": Event.NODE_FAILED, "node": "n1", "ranks": [0, 1]},
               {"event": Event.RECOVERY_STARTED, "incident_id": 1, "adopted": {"n1": "s1"}},
               {"event": Event.RECOVERY_PLAN, "incident_id": 1, "generation": 1, "sends": []},
               {"event": Event.RECOVERY_DONE, "incident_id": 1, "standbys": {"n1": "s1"}}]
    st = load(write_job(tmp_path, *guarded, *adopted))
    assert st.roles["s1"] == (ACTIVE, [0, 1]) and st.roles["n1"] == (FAILED, [])
    st = load(write_job(tmp_path, *guarded))
    c = Control(st)
    r = Resumed(c, st, rejoin_grace_s=10.0)
    r.start()
    r.on_rejoin(b"s1/0", rejoin("s1", 0, 0, WorkerRole.JOINER))
    assert c.sent[-1] == (b"s1/0", p.Release(reason="joiner of a migration tmd's restart aborted, or a guard",
                                             exit_code=ExitCode.OK))


def test_a_standby_added_at_run_time(tmp_path):
    st = load(write_job(tmp_path, {"event": Event.STANDBY_ADDED, "node": "s3"}))
    assert st.roles["s3"] == (STANDBY, []) and st.standbys == ["s1", "s2"]


def test_a_journal_cut_by_a_kill_reads_up_to_its_last_whole_line(tmp_path):
    st = load(write_job(tmp_path, migration(Event.MIGRATION_REQUESTED), cut=True))
    assert st.last_seq == 2 and st.last_ts == 1001.0 and st.cut_migration["id"] == 1


def test_nothing_to_resume(tmp_path):
    with pytest.raises(ResumeError, match="no job to resume"):
        load(str(tmp_path))
    with pytest.raises(ResumeError, match="stopped with exit code 0"):
        load(write_job(tmp_path, {"event": Event.JOB_FINISHED}, {"event": Event.TMD_STOPPED, "exit_code": 0}))
    with pytest.raises(ResumeError, match="it finished"):
        load(write_job(tmp_path, {"event": Event.JOB_FINISHED}))



def tamper(run_dir: str, start: dict = {}, info: dict = {}, drop: tuple = ()) -> str:  # noqa: B006 - read only
    """``run_dir`` (write_job's) with its ``tmd_started`` fields and tmd.json's changed (``start``, ``info``) or
    removed (``drop``: names of either)."""
    with open(os.path.join(run_dir, "tmd.json")) as f:
        data = {k: v for k, v in {**json.load(f), **info}.items() if k not in drop}
    with open(os.path.join(run_dir, "tmd.json"), "w") as f:
        json.dump(data, f)
    with open(os.path.join(run_dir, "events.jsonl")) as f:
        lines = [json.loads(line) for line in f if line.endswith("}\n")]
    lines[0] = {k: v for k, v in {**lines[0], **start}.items() if k not in drop}
    with open(os.path.join(run_dir, "events.jsonl"), "w") as f:
        f.writelines(json.dumps(e) + "\n" for e in lines)
    return run_dir


def failed(node: str = "n2", ranks=(2, 3)) -> dict:
    return {"event": Event.NODE_FAILED, "node": node, "ranks": ranks if isinstance(ranks, str) else list(ranks)}


TAMPERED = {  # what a damaged or tampered journal or tmd.json holds -> what the error says
    "no nodes": ({"start": {"nodes": []}}, "tmd_started nodes is [], not a list of distinct node names"),
    "nodes missing": ({"drop": ("nodes",)}, "tmd_started nodes is null, not a list"),
    "nodes a string": ({"start": {"nodes": "n1"}}, "tmd_started nodes is 'n1', not a list"),
    "a node a path": ({"start": {"nodes": ["n1", "../n2"]}}, "tmd_started nodes is '../n2', not a node name"),
    "twice the same node": ({"start": {"nodes": ["n1", "n1"]}}, "not a list of distinct node names"),
    "a standby active too": ({"start": {"standbys": ["n1"]}}, "names ['n1'] both active and standby"),
    "world size a string": ({"start": {"world_size": "2"}}, "world_size is '2', not a positive multiple of its 2"),
    "world size negative": ({"start": {"world_size": -2}}, "world_size is -2, not a positive multiple"),
    "world size not a multiple": ({"start": {"world_size": 3}}, "world_size is 3, not a positive multiple"),
    "standbys null": ({"start": {"standbys": None}}, "tmd_started standbys is null, not a list"),
    "no address": ({"drop": ("address",)}, "tmd.json of {} is malformed: its address is null, not tcp://HOST:PORT"),
    "a garbage address": ({"info": {"address": "garbage"}}, "its address is 'garbage', not tcp://HOST:PORT"),
    "a port out of range": ({"info": {"address": "tcp://127.0.0.1:70000"}}, "not tcp://HOST:PORT"),
    "a command string": ({"info": {"command": "python -c pass"}},
                         "tmd.json of {} is malformed: its command is 'python -c pass', not a list"),
    "netns a list": ({"info": {"netns": [1]}}, "its netns is [1], not an object"),
    "no migration id": ({"events": [{"event": Event.MIGRATION_REQUESTED, "sources": ["n2"], "targets": ["s1"]}]},
                        "its migration_requested event (seq 2): migration_id is null, not a number >= 1"),
    "targets null": ({"events": [migration(Event.MIGRATION_REQUESTED, targets=None)]},
                     "migration_requested event (seq 2): sources [\"n2\"] and targets null are not lists"),
    "more sources than targets": ({"events": [migration(Event.MIGRATION_REQUESTED, source="n1,n2")]},
                                  "2 sources for 1 targets"),
    "an unknown source": ({"events": [migration(Event.MIGRATION_REQUESTED, source="n9")]},
                          "source n9 is not a node of the job"),
    "recovery standbys a list": ({"events": [failed(), {"event": Event.RECOVERY_STARTED, "incident_id": 1},
                                             {"event": Event.RECOVERY_DONE, "incident_id": 1, "standbys": [1]}]},
                                 "its recovery_done event (seq 4): standbys is [1], not an object of node names"),
    "no incident id": ({"events": [failed(), {"event": Event.RECOVERY_STARTED}]},
                       "its recovery_started event (seq 3): incident_id is null"),
    "ranks a string": ({"events": [failed(ranks="abc")]}, "its node_failed event (seq 2): ranks is 'abc', not a list"),
    "a rank out of range": ({"events": [failed(ranks=(2, 9))]}, "rank 9 is not one of the job's 4 ranks"),
    "replica classes of no rank": ({"events": [{"event": Event.REPLICA_CLASSES, "replicas": {"x": 1}, "keepers": {}}]},
                                   "its replica_classes event (seq 2): rank 'x' is not one of the job's 4 ranks"),
    "a no_replica warning without its fields": ({"events": [{"event": Event.NO_REPLICA, "rank": 1}]},
                                                "its no_replica event (seq 2) lacks rank, node, code or message"),
}


@pytest.mark.parametrize("case", TAMPERED, ids=list(TAMPERED))
def test_a_malformed_journal_or_tmd_json_is_refused_in_one_line(tmp_path, case):
    """A journal or tmd.json whose fields have shapes tmd never writes (tampered with, or damaged) is refused with
    one ResumeError line naming the field, never a traceback (a ZeroDivisionError, KeyError or TypeError before),
    nor a resumed tmd that hangs (a negative world size)."""
    edits, says = TAMPERED[case]
    run_dir = tamper(write_job(tmp_path, *edits.get("events", ())), edits.get("start", {}), edits.get("info", {}),
                     edits.get("drop", ()))
    with pytest.raises(ResumeError) as e:
        load(run_dir)
    file = "tmd.json" if "info" in edits or "address" in edits.get("drop", ()) else "journal"
    assert str(e.value).startswith(f"cannot resume: the {file} of {tmp_path} is malformed: ")
    assert says.format(tmp_path) in str(e.value) and "\n" not in str(e.value)


def test_tmd_resume_of_a_malformed_journal_says_so_in_one_line_and_exits_2(tmp_path):
    from typer.testing import CliRunner

    from tmd import cli

    result = CliRunner().invoke(cli.app, ["resume", "--run-dir", tamper(write_job(tmp_path), {"nodes": []})])
    assert result.exit_code == ExitCode.REFUSED
    assert result.output.strip().splitlines() == [
        f"error: cannot resume: the journal of {tmp_path} is malformed: its tmd_started nodes is [], not a list of "
        "distinct node names"]



def test_a_resumed_tmd_goes_on_with_the_journals_incident_and_migration_ids(tmp_path):
    """The restarted tmd's first incident gets the id after the journal's highest, as its first migration does
    (both started again at 1: one journal held two recovery_started with incident_id 1). A relaunch from a
    checkpoint journals tmd_started anew and goes on with the ids: those before it count too."""
    from tmd.config import JobConfig
    from tmd.daemon import Daemon

    recovery = [{"event": Event.NODE_FAILED, "node": "n1", "ranks": [0, 1]},
                {"event": Event.RECOVERY_STARTED, "incident_id": 1, "adopted": {}},
                {"event": Event.RECOVERY_DONE, "incident_id": 1, "standbys": {"n1": "s1"}},
                {"event": Event.RECOVERY_STARTED, "incident_id": 2, "adopted": {}}]
    st = load(write_job(tmp_path, *recovery))
    assert (st.last_incident_id, st.open_incident, st.last_migration_id) == (2, 2, 0)
    relaunched = {"event": Event.TMD_STARTED, "job": "j", "world_size": 4, "nodes": ["n1", "n2"],
                  "standbys": ["s1", "s2"]}
    cut = [migration(Event.MIGRATION_REQUESTED, mid=3), migration(Event.MIGRATION_ABORTED, mid=3)]
    st = load(write_job(tmp_path, *cut, *recovery, relaunched))
    assert (st.last_incident_id, st.open_incident, st.last_migration_id) == (2, None, 3)

    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir, mode=0o700)
    first = Daemon("t", run_dir, ["n1", "n2"], 1, ["s1"], JobConfig(), echo=False)
    for e in recovery:
        first.journal.record(e["event"], **{k: v for k, v in e.items() if k != "event"})
    first.close()  # as if killed: no tmd_stopped
    second = Daemon("t", run_dir, ["n1", "n2"], 1, ["s1"], JobConfig(), echo=False, resume=load(run_dir))
    try:
        assert second.incidents.next_id() == 3 and second.migrations.next_id() == 1
    finally:
        second.close()


# --- Resumed, through the narrow interface --------------------------------------------------------------------
class Control:
    """A JobControl that records: what would be sent, and the nodes declared failed."""

    def __init__(self, st: JobState):
        self.journal = Journal(None)
        self.registry = Registry(st.nodes, st.ranks_per_node, st.standbys)
        self.run_dir, self.address, self.hostname = st.run_dir, st.address, "here"
        self.store_host, self.store_port, self.launcher = "127.0.0.1", 7, None
        self.sent: list[tuple[bytes, p.Message]] = []
        self.failed: list[tuple[str, FailureSignal]] = []
        self.recovered: list[tuple[dict, str]] = []
        self.current_incident = None

    def reply(self, identity, msg):
        self.sent.append((identity, msg))

    def send(self, worker, msg):
        self.reply(worker.identity, msg)

    def fail_node(self, node, reason, signal):
        self.failed.append((node.name, signal))
        self.current_incident = "an incident"  # as the daemon starts one

    def recover_ranks(self, lost, reason):
        self.recovered.append((lost, reason))
        self.current_incident = "an incident"


def rejoin(node: str, local_rank: int, rank: int, role: WorkerRole, generation: int = 0) -> p.Rejoin:
    return p.Rejoin(node=node, local_rank=local_rank, pid=10 + local_rank, host="there", rank=rank, role=role,
                    step=42, generation=generation)


def test_resumed_relearns_the_job_and_fails_what_did_not_come_back(tmp_path):
    st = load(write_job(tmp_path, migration(Event.MIGRATION_REQUESTED, mid=3, generation=2)))
    c = Control(st)
    r = Resumed(c, st, rejoin_grace_s=10.0)
    r.start()
    assert c.registry.generations.current == 2 and c.registry.nodes["s1"].role == STANDBY
    r.ask(b"n1/0")
    r.ask(b"n1/0")  # asked again only after REASK_S
    assert c.sent == [(b"n1/0", p.Reregister(store_host="127.0.0.1", store_port=7, generation=2))]
    r.on_rejoin(b"s1/0", rejoin("s1", 0, 2, WorkerRole.JOINER, generation=3))
    assert c.sent[-1] == (b"s1/0", p.Release(reason="joiner of a migration tmd's restart aborted, or a guard",
                                             exit_code=ExitCode.OK))
    r.on_rejoin(b"n1/0", rejoin("n1", 0, 0, WorkerRole.ACTIVE, generation=4))
    assert c.sent[-1] == (b"n1/0", p.Decide(migration_id=3, commit=False, reason="tmd restarted during the migration"))
    assert c.registry.generations.current == 4  # never reuse a generation a worker built
    for ident, lr, rank in ((b"n1/1", 1, 1), (b"n2/0", 0, 2)):
        r.on_rejoin(ident, rejoin(ident.decode()[:2], lr, rank, WorkerRole.ACTIVE))
    r.tick(r.started + 5.0)
    assert c.failed == []
    r.tick(r.started + 10.5)  # n2/1 never came back
    assert c.failed == [("n2", FailureSignal.SILENT)]
    names = [e["event"] for e in c.journal.since(0, 100)]
    assert names[:2] == [Event.TMD_RESTARTED, Event.MIGRATION_ABORTED]
    assert names.count(Event.WORKER_REJOINED) == 3 and Event.REJOIN_REFUSED in names
    assert Event.JOB_RELEARNED not in names  # n2/1 is missing


def test_a_recovery_the_crash_cut_is_started_again_once_the_survivors_re_registered(tmp_path):
    """Outside test: tmd killed during a recovery, then `tmd resume`: the survivors waited halted for a plan of the
    cut incident forever (the job hung with no error). Now a new incident recovers the ranks no process holds."""
    st = load(write_job(tmp_path, {"event": Event.NODE_FAILED, "node": "n2", "ranks": [2, 3], "reason": "died"},
                        {"event": Event.RECOVERY_STARTED, "incident_id": 1, "adopted": {}}))
    assert st.open_incident == 1 and st.lost_ranks == {2: "n2", 3: "n2"}
    c = Control(st)
    r = Resumed(c, st, rejoin_grace_s=10.0)
    r.start()
    for lr in (0, 1):
        r.on_rejoin(f"n1/{lr}".encode(), rejoin("n1", lr, lr, WorkerRole.ACTIVE))
    r.tick(r.started + 5.0)
    assert c.recovered == []  # within the grace: processes may still re-register
    r.tick(r.started + 10.5)
    assert c.failed == [] and c.recovered == [({2: "n2", 3: "n2"}, "ranks [2, 3] lost before tmd restarted "
                                                                  "(recovery 1 was cut)")]
    r.tick(r.started + 20.0)
    assert len(c.recovered) == 1  # once


# --- the checkpoint tier of a resumed tmd ----------------------------------------------------------------------
def checkpointed_job(tmp_path, *events: dict) -> str:
    """A job started with ``--checkpoint-dir <tmp_path>/ck --checkpoint-every 5`` whose tmd died (kill -9)."""
    config = {"event": Event.JOB_CONFIG, "config": {"checkpoint": {"checkpoint_dir": str(tmp_path / "ck"),
                                                                   "checkpoint_every": 5}}}
    return write_job(tmp_path, config, *events)


def test_a_resumed_tmd_keeps_the_checkpoint_tier_and_relaunches_the_job_from_a_checkpoint(tmp_path, monkeypatch):
    """``tmd resume`` after a kill -9 of ``tmd local``: the resumed tmd has the job's checkpoint tier (its
    journalled settings and earlier restarts, exported to the processes it starts); when in-memory recovery becomes
    impossible (its daemon ends with ``restart`` set) it relaunches every rank and standby process on the same
    address, as the original tmd would."""
    from typer.testing import CliRunner

    import tmd.daemon
    import tmd.local
    from tmd import cli

    earlier = {"event": Event.JOB_RESTARTING, "tier": "checkpoint", "step": 5, "path": str(tmp_path / "ck/step-5"),
               "reason": "every rank is lost", "work_lost_s": 1.5, "at": 1000.0, "restart": 1}
    run_dir = checkpointed_job(tmp_path, earlier)
    made, started = [], []

    class FakeDaemon:  # what tmd resume builds; the first one's recovery became impossible
        def __init__(self, job, run_dir, nodes, rpn, standbys, config, **kw):
            self.job, self.run_dir, self.kw, self.cluster, self.launcher = job, run_dir, kw, None, None
            self.port = config.serve.port if kw.get("port") is None else kw["port"]  # the relaunch's: not a setting
            self.address = f"tcp://{kw.get('host', '127.0.0.1')}:{self.port}"
            self.journal, self.restart = Journal(None), None
            self.migrations = self.incidents = Episodes()  # none yet: ids go on from 1
            made.append(self)

        def run(self):
            tier = self.kw["tier"]
            if len(made) == 1:
                assert tier.restarts[0].step == 5 and os.environ["TM_CHECKPOINT_EVERY"] == "5"
                assert os.environ["TM_RESUME_FROM"] == str(tmp_path / "ck/step-5")
                self.restart = object()
            return 0

    class FakeLauncher:
        def __init__(self, command, *a, inherited=None, **kw):
            self.command = command
            self.fork_server = None  # a relaunch's launcher inherits it (none here: nothing is forked)

        def start_node(self, node, standby):
            started.append((node, standby))

    monkeypatch.setattr(tmd.daemon, "Daemon", FakeDaemon)
    monkeypatch.setattr(tmd.local, "LocalLauncher", FakeLauncher)
    monkeypatch.setattr(cli, "_exit", lambda code: None)
    for name in ("TM_CHECKPOINT_DIR", "TM_CHECKPOINT_EVERY", "TM_CHECKPOINT_KEEP", "TM_CHECKPOINT_JOB",
                 "TM_RESUME_FROM", "TM_CHECKPOINT_RESTART"):
        monkeypatch.setenv(name, "")  # restored after the test: tmd resume exports the tier's settings
        monkeypatch.delenv(name)
    result = CliRunner().invoke(cli.app, ["resume", "--run-dir", run_dir, "--quiet"])
    assert result.exit_code == 0, result.output
    assert len(made) == 2 and made[0].kw["resume"] is not None and made[1].kw.get("resume") is None
    assert made[0].kw["tier"] is made[1].kw["tier"] and made[1].port == 5555
    assert started == [("n1", False), ("n2", False), ("s1", True), ("s2", True)]


def test_a_resumed_tmd_of_a_job_in_network_namespaces_refuses_the_restart_saying_why(tmp_path):
    """The namespaces of ``tmd local --netns-*`` cannot be recreated by ``tmd resume``: the tier refuses the
    restart (the daemon fails the job with that reason); the crash-loop count goes on from the journal."""
    from tmd.tiers import MAX_RESTARTS_FROM_ONE_STEP, Tier

    st = load(checkpointed_job(tmp_path))
    tier = Tier.resumed(st.config.checkpoint, st.job, 4, st.restarts, netns={"n2": {}})
    restart, why = tier.plan_restart("every rank is lost")
    assert restart is None and why.startswith("a resumed tmd cannot recreate the network namespaces of n2")
    many = [{"event": Event.JOB_RESTARTING, "step": 5, "path": "p", "reason": "r"}] * MAX_RESTARTS_FROM_ONE_STEP
    assert len(Tier.resumed(st.config.checkpoint, st.job, 4, many).restarts) == MAX_RESTARTS_FROM_ONE_STEP

"""The agent thread's handling of tmd's commands (worker.commands) and the one way to report (worker.reports),
with fake group managers: no processes, no torch, no sockets."""
import pytest

from tmd import protocol as p
from worker import commands as worker_commands
from worker.commands import Commands
from worker.control import Control
from worker.reports import Reporter

pytestmark = pytest.mark.timeout(10)


class FakeGroups:
    generation = 6
    world = None

    def __init__(self):
        self.calls = []

    def fail_all(self, reason):
        self.calls.append(("fail_all", reason))
        return 1

    def discard(self, migration_id):
        self.calls.append(("discard", migration_id))

    def set_store(self, host, port):
        self.calls.append(("set_store", host, port))

    def prepare(self, migration_id, generation, role, leaver_ranks, transfer_prefix, on_done):
        self.calls.append(("prepare", migration_id, role))
        on_done(True, "", ["world"])


class Exited(Exception):
    pass


@pytest.fixture
def setup(monkeypatch):
    control = Control()
    sent = []
    rejoins = []
    exits = []

    def fake_exit(code, why):
        exits.append((code, why))
        raise Exited()

    monkeypatch.setattr(worker_commands, "exit_process", fake_exit)
    reports = Reporter(sent.append, lambda: control.rank)
    cmds = Commands(control, reports, lambda *a: rejoins.append(a), lambda: {})
    return control, cmds, sent, rejoins, exits


def make_active(control, groups=None, step=5):
    control.start(p.Assign(role=p.WorkerRole.ACTIVE, rank=2, world_size=4, store_host="h", store_port=1,
                           generation=0, record_steps=3, record_dir="/r", migration_id=0, incident_id=0))
    control.attach(groups if groups is not None else FakeGroups())
    control.boundary(step)
    return control.groups


def test_a_halt_fails_every_mover_of_an_active_rank_at_once(setup):
    control, cmds, *_ = setup
    groups = make_active(control)
    cmds.on_message(p.Halt(incident_id=4, reason="n2 lost", failed_ranks=[2]))
    assert groups.calls == [("fail_all", "halted by tmd (incident 4): n2 lost")]
    assert control.halt.incident_id == 4


def test_a_release_of_a_standby_exits_at_once(setup):
    control, cmds, _, _, exits = setup
    with pytest.raises(Exited):
        cmds.on_message(p.Release(reason="not needed", exit_code=0))
    assert exits == [(0, "released by tmd: not needed")]


def test_a_release_of_an_active_rank_waits_for_its_loop_unless_fenced(setup):
    control, cmds, _, _, exits = setup
    make_active(control)
    cmds.on_message(p.Release(reason="job finished", exit_code=0))
    assert exits == []
    with pytest.raises(Exited):
        cmds.on_message(p.Release(reason="declared failed", exit_code=int(p.ExitCode.FENCED)))
    assert exits == [(p.ExitCode.FENCED, "released by tmd: declared failed")]


def test_an_aborted_joiner_drops_phase_one_and_exits(setup):
    control, cmds, _, _, exits = setup
    control.start(p.Assign(role=p.WorkerRole.JOINER, rank=3, world_size=4, store_host="h", store_port=1,
                           generation=0, record_steps=3, record_dir="/r", migration_id=1, incident_id=0))
    groups = FakeGroups()
    control.attach(groups)
    with pytest.raises(Exited):
        cmds.on_message(p.Decide(migration_id=1, commit=False, reason="leaver gone"))
    assert groups.calls == [("discard", 1)]
    assert exits == [(p.ExitCode.OK, "joiner for rank 3 aborted: leaver gone")]


def test_a_late_switch_is_answered_armed_not_ok(setup):
    control, cmds, sent, _, _ = setup
    make_active(control, step=9)
    cmds.on_message(p.Switch(migration_id=1, step=9))
    cmds.on_message(p.Switch(migration_id=1, step=11))
    assert [(m.phase, m.ok, m.error, m.step) for m in sent] == [
        (p.MigrationPhase.ARMED, False, "already at step 9", 9), (p.MigrationPhase.ARMED, True, "", 9)]
    assert control.switch.step == 11


def test_prepare_starts_phase_one_and_reports_prepared(setup):
    control, cmds, sent, _, _ = setup
    groups = make_active(control)
    cmds.on_message(p.Prepare(migration_id=2, generation=3, role=p.MigrationRole.STAYER, leaver_ranks=[3],
                              transfer_prefix=p.layout.transfer_prefix(3, 3)))
    assert groups.calls == [("prepare", 2, p.MigrationRole.STAYER)]
    assert sent == [p.PhaseDone(migration_id=2, rank=2, phase=p.MigrationPhase.PREPARED, ok=True, error="", step=-1,
                                bytes_moved=0, seconds=0.0, groups=["world"])]


def test_reregister_switches_the_store_then_rejoins(setup):
    control, cmds, _, rejoins, _ = setup
    groups = make_active(control, step=8)
    cmds.on_message(p.Reregister(store_host="h2", store_port=9, generation=6))
    assert groups.calls == [("set_store", "h2", 9)]
    assert rejoins == [(2, p.WorkerRole.ACTIVE, 8, 6)]


def test_one_report_method_picks_the_message_by_the_phase_kind():
    sent = []
    r = Reporter(sent.append, lambda: 1)
    r.report(7, p.MigrationPhase.WARMED)
    r.report(3, p.RecoveryPhase.WARMED)  # the same string value, another kind of phase
    r.report(3, p.RecoveryPhase.RECOVERED, ok=False, error=KeyError("model"), step=9)
    assert isinstance(sent[0], p.PhaseDone) and sent[0].migration_id == 7
    assert isinstance(sent[1], p.RecoveryReport) and sent[1].incident_id == 3 and sent[1].committed_step == -1
    assert (sent[2].ok, sent[2].error, sent[2].committed_step) == (False, "KeyError: 'model'", 9)
    with pytest.raises(TypeError):
        r.report(1, "warmed")
    with pytest.raises(ValueError):
        r.report(1, p.RecoveryPhase.HALTED, groups=["world"])


def test_done_is_resent_until_tmd_acknowledges_it_then_the_rank_may_exit():
    """A rank that exits at once after its Done could be gone, its queued message with it, before tmd read it:
    tmd would take the exit for a death and start a recovery with no standby to finish it (seen at a job's end).
    The Done is sent again every DONE_RESEND_S until tmd's DoneAck comes through the agent's dispatch."""
    sent = []
    reports = Reporter(sent.append, lambda: 3)
    commands = Commands(Control(), reports, lambda *a: None, dict)

    def send(msg):  # the first copy is lost; tmd acknowledges the second
        sent.append(msg)
        if len(sent) == 2:
            commands.on_message(p.DoneAck(rank=3))

    reports.send = send
    assert reports.done(41, left=False, budget_s=5.0)
    assert sent == [p.Done(rank=3, final_step=41, left=False)] * 2


def test_done_without_an_acknowledgement_gives_up_after_its_budget():
    sent = []
    reports = Reporter(sent.append, lambda: 0)
    assert not reports.done(7, left=True, budget_s=0.1)
    assert sent and set(map(type, sent)) == {p.Done}

"""tmd's daemon on its own (in-process, no worker processes): applying detection's verdicts, and the job's end."""
import dataclasses
import time

import pytest

from tmd import protocol as p
from tmd.config import DEFAULTS
from tmd.daemon import CRASH_AFTER_TICK_ERRORS, Daemon, TmdCrashed
from tmd.detection import Failure, ProcessExited
from tmd.protocol.vocab import (
    Event, FailureSignal, IncidentState, MigrationMark, MigrationPhase, MigrationState, NodeRole,
)
from tmd.recovery import RecoveryError
from tmd.registry import Worker

pytestmark = pytest.mark.timeout(30)
RECORD_2 = DEFAULTS.with_options(record_steps=2, metrics_port=-1)  # the fewest recorded steps; no status page


@pytest.fixture
def daemon(tmp_path):
    """2 active nodes of 1 rank and standby s1, each with its process registered and past step 5; what the
    daemon sends is recorded in ``d.sent`` as (identity, message)."""
    d = Daemon("t", str(tmp_path), ["n1", "n2"], 1, ["s1"], RECORD_2, echo=False)
    d.sent = []
    d.send = lambda w, msg: d.sent.append((w.identity.decode(), msg))  # observe, no sockets
    for node in ("n1", "n2", "s1"):
        d.registry.add_worker(Worker(f"{node}/0".encode(), node, 0, 1, "elsewhere"))
    for w in d.registry.rank_owner.values():
        w.step = 5
    for rank in (0, 1):  # a lost rank's replacement is warmed from its recording
        open(p.layout.RunDir(str(tmp_path)).recording(rank), "w").close()
    try:
        yield d
    finally:
        d.close()


def events(d: Daemon) -> list[str]:
    return [e["event"] for e in d.journal.since(0, 1000)]


def test_fewer_recorded_steps_than_a_joiner_needs_are_refused_at_start(tmp_path):
    """One recorded step leaves DDP's bucket regrouping (a broadcast in a process's second forward) out of the
    recording: a joiner would make it live at its first real step and hang the job (tmd.protocol.messages.
    MIN_RECORD_STEPS). tmd refuses it before it binds anything; ``tmd local --record-steps 1`` exits 2."""
    from typer.testing import CliRunner

    from tmd import cli

    with pytest.raises(ValueError, match="--record-steps must be at least 2, not 1"):
        Daemon("t", str(tmp_path / "one"), ["n1", "n2"], 1, ["s1"], DEFAULTS.with_options(record_steps=1), echo=False)
    assert not (tmp_path / "one").exists()
    result = CliRunner().invoke(cli.app, ["local", "--record-steps", "1", "--run-dir", str(tmp_path / "cli"),
                                          "--", "true"])
    assert result.exit_code == 2 and "--record-steps" in result.output, result.output
    assert not (tmp_path / "cli").exists()


def test_job_end_aborts_a_migration_in_flight_and_releases_the_standbys(daemon):
    d = daemon
    m = d.migrations.request("n2", "s1")
    for w in d.registry.rank_owner.values():
        w.done = True
    assert d.ending.tick(time.monotonic()) == 0  # no launcher: nothing left to wait for
    assert m.state == MigrationState.ABORTED and m.reason == "the job finished before the migration committed"
    assert ("s1/0", p.Release(reason="job finished", exit_code=0)) in d.sent
    assert events(d).count(Event.JOB_FINISHED) == 1 and d.ending.released


def test_a_standby_registering_after_the_job_finished_is_released_at_once(daemon):
    d = daemon
    for w in d.registry.rank_owner.values():
        w.done = True
    d.registry.nodes["s1"].workers[0].exited = True  # restarted (an aborted joiner) just before the end
    assert d.ending.tick(time.monotonic()) == 0
    late = b"s1/0/0123456789abcdef"
    d.on_frames([late, p.encode(p.Register(node="s1", local_rank=0, pid=7, host="elsewhere", standby=True))])
    assert d.sent[-1] == (late.decode(), p.Release(reason="job finished", exit_code=0))
    assert Event.STANDBY_WARM not in events(d)


def test_a_failed_leaver_hands_its_warm_joiners_to_recovery(daemon):
    d = daemon
    m = d.migrations.request("n2", "s1")
    m.mark(MigrationMark.PREPARE_STARTED)
    n2 = d.registry.nodes["n2"]
    d._apply(ProcessExited(n2, 0, -9, n2.workers[0], expected=False, lost=False))  # noqa: SLF001
    d._apply(Failure(n2, "n2/0 exited with code -9", FailureSignal.PROCESS_EXIT))  # noqa: SLF001
    assert n2.role == NodeRole.FAILED and n2.workers[0].fenced and n2.workers[0].exited
    assert m.state == MigrationState.ABORTED and m.reason.startswith("leaver n2 lost")
    inc = d.incidents.current
    assert inc.state == IncidentState.HALTING and inc.standbys == {"n2": "s1"} and sorted(inc.lost) == [1]
    assert d.registry.nodes["s1"].role == NodeRole.JOINING  # kept: its joiner is warm for rank 1
    assert not any(dest == "s1/0" and isinstance(msg, p.Decide) for dest, msg in d.sent)
    ev = events(d)
    assert ev.index(Event.NODE_FAILED) == ev.index(Event.PROCESS_EXIT) + 1
    d._apply(Failure(n2, "again", FailureSignal.SILENT))  # noqa: SLF001 - a failed node is failed once
    assert events(d).count(Event.NODE_FAILED) == 1


def test_a_standby_whose_process_exited_is_not_failed(daemon):
    d = daemon
    s1 = d.registry.nodes["s1"]
    d._apply(ProcessExited(s1, 0, 1, s1.workers[0], expected=False, lost=True))  # noqa: SLF001
    assert s1.role == NodeRole.STANDBY and Event.NODE_FAILED not in events(d)


def test_a_bug_in_a_handler_is_journalled_and_tmd_goes_on(daemon, monkeypatch):
    d = daemon
    replies = []
    d.reply = lambda identity, msg: replies.append(msg)

    def bug(w, msg):
        raise TypeError("a bug in tmd")

    d._handlers[p.Sender.WORKER][p.Heartbeat] = bug
    d.on_frames([b"n1/0", p.encode(p.Heartbeat(step=6, counters={}))], p.Sender.WORKER)
    (err,) = [e for e in d.journal.since(0, 1000) if e["event"] == Event.INTERNAL_ERROR]
    assert err["where"] == "Heartbeat" and err["error"] == "TypeError: a bug in tmd" and "bug" in err["traceback"]
    d.on_frames([b"tmctl-1", p.encode(p.StatusRequest())], p.Sender.CLIENT)
    assert isinstance(replies[-1], p.StatusReply) and d.internal_errors == 1


def test_a_tick_that_keeps_failing_ends_the_loop_as_a_crash_and_leaves_the_ranks(daemon, monkeypatch):
    d = daemon

    class Launcher:
        terminated = False

        def poll(self):
            return ()

        def terminate_all(self, close=True):
            self.terminated = True

    d.launcher = Launcher()
    monkeypatch.setattr(d.migrations, "tick", lambda now: 1 / 0)
    with pytest.raises(TmdCrashed, match="ZeroDivisionError"):
        d.run()
    names = events(d)
    assert names.count(Event.INTERNAL_ERROR) == 1 and names[-1] == Event.TMD_CRASHED
    assert Event.TMD_STOPPED not in names and d.internal_errors == CRASH_AFTER_TICK_ERRORS
    assert not d.launcher.terminated, "tmd's own crash must not take the ranks down"


def test_a_stayer_lost_after_the_commit_decision_takes_the_undecided_joiners_with_it(daemon):
    """After the decision (the joiner loaded its pre-copy, during step S - 1) the stayer's node n1 dies: the
    leaver's step S - 1 fails with it, so the joiner's tail never comes. Nothing aborts (the rank already passed
    to s1): s1 fails with n1 and the leaver is fenced; here no replica is left, so the job ends with that."""
    d = daemon
    m = d.migrations.request("n2", "s1")
    by = d.registry.by_identity

    def ack(who, phase, **kw):
        d.migrations.on_phase(by[who], p.PhaseDone(migration_id=m.id, rank=by[who].rank if by[who].rank is not None
                                                   else -1, phase=phase, ok=True, error="", step=kw.get("step", -1),
                                                   bytes_moved=0, seconds=0.0, groups=[]))

    ack(b"s1/0", MigrationPhase.WARMED)
    for who in (b"n1/0", b"n2/0", b"s1/0"):
        ack(who, MigrationPhase.PREPARED)
    for who in (b"n1/0", b"n2/0", b"s1/0"):
        ack(who, MigrationPhase.ARMED, step=6)
    ack(b"s1/0", MigrationPhase.TRANSFERRED)
    assert m.state == MigrationState.TRANSFERRED and d.registry.nodes["s1"].role == NodeRole.ACTIVE
    n1 = d.registry.nodes["n1"]
    with pytest.raises(RecoveryError, match="every rank is lost"):
        d._apply(Failure(n1, "n1/0 exited with code -9", FailureSignal.PROCESS_EXIT))  # noqa: SLF001
    assert m.state == MigrationState.COMMITTED and m.lost.startswith("node n1 lost during transferred")
    assert d.registry.nodes["s1"].role == NodeRole.FAILED and d.registry.nodes["n2"].workers[0].fenced
    failed = [e for e in d.journal.since(0, 1000) if e["event"] == Event.NODE_FAILED]
    assert [e["node"] for e in failed] == ["n1", "s1"] and failed[1]["ranks"] == [1]
    assert not any(isinstance(msg, p.Decide) and not msg.commit for _, msg in d.sent)


def test_recovery_impossible_restarts_a_local_job_from_its_newest_checkpoint_or_fails_it(daemon, tmp_path):
    from tests.unit.test_tiers import write_checkpoint
    from tmd.local import LocalLauncher
    from tmd.config import CheckpointTierConfig
    from tmd.tiers import Tier

    daemon._recovery_impossible("every rank is lost (n1 and n2)")  # noqa: SLF001 - no tier: the job fails
    assert daemon.exit_code == 1 and daemon.restart is None
    daemon.exit_code = None
    daemon.tier = Tier(CheckpointTierConfig(checkpoint_dir=str(tmp_path / "ck"), checkpoint_every=5), "t", 2)
    daemon.tier.attach(daemon.journal)
    daemon._recovery_impossible("every rank is lost")  # noqa: SLF001 - no checkpoint yet: fails, saying why
    failed = [e for e in daemon.journal.since(0, 1000) if e["event"] == Event.JOB_FAILED]
    assert failed[-1]["reason"] == "every rank is lost (no restart from a checkpoint: tmd starts no processes)"
    daemon.exit_code = None
    daemon.launcher = LocalLauncher(["true"], str(tmp_path), "tcp://x:1", 1, echo=False)
    path = write_checkpoint(daemon.tier.config.checkpoint_dir, 5, daemon.tier.job_id)
    daemon._recovery_impossible("every rank is lost")  # noqa: SLF001
    assert daemon.restart is not None and daemon.restart.path == path and daemon.exit_code == 1
    restarting = [e for e in daemon.journal.since(0, 1000) if e["event"] == Event.JOB_RESTARTING]
    assert restarting[0]["step"] == 5 and restarting[0]["reason"] == "every rank is lost"
    assert daemon.status().checkpoints["restarts"][0]["tier"] == "checkpoint"


def test_a_checkpoint_the_ranks_refuse_at_load_restarts_the_job_from_the_one_before(daemon, tmp_path):
    """After a restart from checkpoint 10, a rank refuses it at load (``checkpoint_refused``): tmd restarts the job
    from checkpoint 5 instead of failing it; another rank's refusal of the same checkpoint changes nothing."""
    from tests.unit.test_tiers import write_checkpoint
    from tmd.local import LocalLauncher
    from tmd.config import CheckpointTierConfig
    from tmd.tiers import Tier

    daemon.launcher = LocalLauncher(["true"], str(tmp_path), "tcp://x:1", 1, echo=False)
    daemon.tier = Tier(CheckpointTierConfig(checkpoint_dir=str(tmp_path / "ck"), checkpoint_every=5), "t", 2)
    daemon.tier.attach(daemon.journal)
    older = write_checkpoint(daemon.tier.config.checkpoint_dir, 5, daemon.tier.job_id)
    newer = write_checkpoint(daemon.tier.config.checkpoint_dir, 10, daemon.tier.job_id)
    assert daemon.tier.plan_restart("every rank is lost")[0].path == newer  # the relaunch this daemon serves
    refused = p.RankFailed(rank=0, step=0, kind=p.FailureKind.CHECKPOINT_REFUSED, traceback="",
                           error=f"no valid checkpoint in {newer}: __0_0.distcp does not match its sha256")
    n1 = daemon.registry.by_identity[b"n1/0"]
    with pytest.raises(RecoveryError, match=f"rank 0 on n1 refused checkpoint {newer} at load"):
        daemon._rank_failed(n1, refused)  # noqa: SLF001
    daemon._recovery_impossible(f"rank 0 on n1 refused checkpoint {newer} at load")  # noqa: SLF001 - as the loop
    assert daemon.restart is not None and daemon.restart.path == older
    again = dataclasses.replace(refused, rank=1)
    daemon._rank_failed(daemon.registry.by_identity[b"n2/0"], again)  # noqa: SLF001 - the second: nothing new
    names = [e["event"] for e in daemon.journal.since(0, 1000)]
    assert names.count(Event.JOB_RESTARTING) == 2 and Event.JOB_FAILED not in names
    assert names.count(Event.CHECKPOINT_REFUSED) == 1


def test_recovery_impossible_in_slurm_mode_rebuilds_the_world_or_requeues_the_job_or_fails_it_saying_why(
        daemon, tmp_path):
    from tests.unit.test_tiers import write_checkpoint
    from tmd.config import CheckpointTierConfig
    from tmd.slurm import Rebuild
    from tmd.tiers import Tier

    short = "2 of the job's 2 nodes are lost and 1 usable standby node can replace them"

    class Cluster:  # the part of tmd.slurm.SlurmCluster this uses
        def __init__(self, error, plan=None):
            self.error, self.plan, self.calls = error, plan, 0

        def rebuild_world(self):
            return self.plan, "" if self.plan else short

        def requeue(self):
            self.calls += 1
            return self.error

    daemon.tier = Tier(CheckpointTierConfig(checkpoint_dir=str(tmp_path / "ck"), checkpoint_every=5), "4711", 2)
    daemon.tier.attach(daemon.journal)
    write_checkpoint(daemon.tier.config.checkpoint_dir, 5, daemon.tier.job_id)
    daemon.cluster = Cluster("scontrol: error: Requested operation is presently disabled")
    daemon._recovery_impossible("n1 lost with its snapshot keeper")  # noqa: SLF001
    assert daemon.restart is None and daemon.exit_code == 1
    failed = [e for e in daemon.journal.since(0, 1000) if e["event"] == Event.JOB_FAILED]
    assert failed[-1]["reason"].endswith(f"(no restart from a checkpoint: {short}, and scontrol requeue failed: "
                                         "scontrol: error: Requested operation is presently disabled)")
    daemon.exit_code = None
    daemon.cluster = Cluster(None)
    daemon._recovery_impossible("n1 lost with its snapshot keeper")  # noqa: SLF001
    assert daemon.cluster.calls == 1 and daemon.restart is not None and daemon.restart.step == 5
    assert daemon.rebuild is None  # tmd.cli's loop ends: the requeued job's next run resumes
    requeued = [e for e in daemon.journal.since(0, 1000) if e["event"] == Event.JOB_REQUEUED]
    assert requeued[-1]["error"] is None and requeued[-1]["step"] == 5 and requeued[-1]["reason"] == short
    # enough usable nodes: every rank restarts inside the allocation, nothing is requeued
    daemon.exit_code, daemon.restart = None, None
    plan = Rebuild(world=["n4", "n2"], replaced={0: "n4"}, standbys=[], gone={"n1": ("failed", "lost")})
    daemon.cluster = Cluster(None, plan)
    daemon._recovery_impossible("n1 lost with its snapshot keeper")  # noqa: SLF001
    assert daemon.cluster.calls == 0 and daemon.rebuild is plan and daemon.restart.step == 5
    rebuilt = [e for e in daemon.journal.since(0, 1000) if e["event"] == Event.WORLD_REBUILT]
    assert rebuilt[-1]["nodes"] == ["n4", "n2"] and rebuilt[-1]["replaced"] == {"0": "n4"} and rebuilt[-1]["step"] == 5


def test_each_copy_of_a_done_is_acknowledged_and_journalled_once(daemon):
    """A rank resends its Done until acknowledged (worker.reports.Reporter.done): every copy gets a DoneAck, the
    journal one rank_done."""
    d = daemon
    for _ in range(2):
        d.on_frames([b"n1/0", p.encode(p.Done(rank=0, final_step=9, left=False))])
    assert [msg for dest, msg in d.sent if dest == "n1/0"] == [p.DoneAck(rank=0)] * 2
    assert events(d).count(Event.RANK_DONE) == 1 and d.registry.nodes["n1"].workers[0].done
    n2 = d.registry.nodes["n2"].workers[0]
    n2.done = True  # a leaver: done since its migration's commit was decided; its Done(left) still goes on record
    for _ in range(2):
        d.on_frames([b"n2/0", p.encode(p.Done(rank=1, final_step=9, left=True))])
    assert events(d).count(Event.RANK_LEFT) == 1


def test_a_daemon_relaunched_from_a_checkpoint_goes_on_with_the_journals_sequence_and_ids(tmp_path):
    """One journal across a restart from a checkpoint: the relaunched daemon's entries, migration ids and incident
    ids follow the previous daemon's (the chaos soak once read two migrations with id 1 in one journal)."""
    from tmd.config import CheckpointTierConfig
    from tmd.tiers import Restart, Tier

    tier = Tier(CheckpointTierConfig(checkpoint_dir=str(tmp_path / "ck"), checkpoint_every=5), "t", 2)
    tier.restarts.append(Restart(step=5, path=str(tmp_path / "ck" / "step-5"), reason="every rank is lost",
                                 work_lost_s=1.0))
    tier.last_seq, tier.last_ids = 40, (3, 2)
    from tmd.protocol.keys import JobKeys

    (tmp_path / "run").mkdir(mode=0o700)
    JobKeys.create(str(tmp_path / "run" / "keys"))  # the first daemon's: a relaunch keeps them
    d = Daemon("t", str(tmp_path / "run"), ["n1", "n2"], 1, [], RECORD_2, echo=False, tier=tier)
    try:
        assert d.migrations.next_id() == 4 and d.incidents.next_id() == 3
        assert d.journal.seq >= 40
    finally:
        d.close()


def test_a_flood_of_frames_does_not_hold_back_the_ticks(tmp_path, monkeypatch):
    """Failure detection, deadlines and the job's end run in the ticks: a sender flooding tmd's socket (a party
    holding a key) must not keep the loop reading. Each frame here costs 1 ms to handle, 3,000 are queued: the
    loop ticks at least every TICK_S while it works through them."""
    import zmq

    from tmd import daemon as daemon_module

    d = Daemon("t", str(tmp_path), ["n1"], 1, [], RECORD_2.with_options(auth=False), echo=False)
    handled, ticks_mid_flood = [0], []
    total = 3000

    def slow(frames, role=None):
        time.sleep(0.001)
        handled[0] += 1

    def tick():
        if 0 < handled[0] < total:
            ticks_mid_flood.append(handled[0])
        if handled[0] >= total:
            d.exit_code = 0

    monkeypatch.setattr(d, "on_frames", slow)
    monkeypatch.setattr(d, "_contained_tick", tick)
    ctx = zmq.Context()
    sender = ctx.socket(zmq.DEALER)
    sender.setsockopt(zmq.SNDHWM, 0)
    sender.connect(d.address)
    for _ in range(total):
        sender.send(b"x")
    try:
        d.run()  # closes the daemon as it ends
    finally:
        sender.close(linger=0)
        ctx.term()
    assert handled[0] == total
    # about 3 s of handling at one tick per TICK_S (0.05 s): dozens of ticks; reading until the socket was empty
    # gave none before the last frame
    assert len(ticks_mid_flood) >= 10, ticks_mid_flood
    assert daemon_module.TICK_S == 0.05


def test_a_new_job_in_a_used_run_directory_goes_on_with_its_journals_numbers(tmp_path):
    """A refused job (job_refused, seq 1) or an ended one left events.jsonl: the next job's events follow its
    numbers, so that seq stays unique and tmctl events --after N skips nothing of the new job."""
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    (run_dir / "events.jsonl").write_text(
        '{"seq": 1, "ts": 1.0, "event": "job_refused", "reason": "no such command"}\n'
        '{"seq": 2, "ts": 2.0, "event": "tmd_stopped", "exit_code": 2}\n{"cut sh')
    d = Daemon("t", str(run_dir), ["n1"], 1, [], RECORD_2, echo=False)
    try:
        started = [e for e in d.journal.since(0, 100) if e["event"] == Event.TMD_STARTED]
    finally:
        d.close()
    assert started[0]["seq"] == 3
    from tmd.journal import read_events
    seqs = [e["seq"] for e in read_events(str(run_dir / "events.jsonl"))]
    assert len(seqs) == len(set(seqs)) and seqs[:3] == [1, 2, 3]

"""The standby pool of ``tmd slurm --keep-standbys N`` (tmd.standby_pool) and distinct standby picks, without SLURM:
the policy on a fake clock, then tmd.slurm.SlurmCluster against a fake SLURM (sbatch, scancel, scontrol and the
poller's snapshots), driven poll by poll."""
from __future__ import annotations

import dataclasses

import pytest

from tmctl import render
from tmd import slurm as s
from tmd.journal import Journal
from tmd.migration import MigrationError
from tmd.protocol.vocab import ErrorCode, Event, NodeRole
from tmd.registry import Registry, Worker
from tmd.standby_pool import PoolPolicy, StandbyPoolConfig, parse_job_id, sbatch_argv


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


# ----------------------------------------------------------------------------------------------------------------
# The policy alone
# ----------------------------------------------------------------------------------------------------------------
def test_policy_submits_one_at_a_time_rate_limited_and_only_while_short():
    clock = Clock()
    pol = PoolPolicy(StandbyPoolConfig(keep=2, min_interval_s=5), clock)
    assert pol.due(0)
    pol.submitting()
    assert not pol.due(0), "one submission in flight at a time"
    pol.submitted("10")
    clock.t += 1
    assert not pol.due(1), "min_interval_s between two submissions"
    clock.t += 4
    assert pol.due(1) and not pol.due(2) and not pol.due(3)
    assert pol.jobs == ["10"] and pol.reason is None


def test_policy_backs_off_doubling_after_refusals_and_clears_once_a_standby_is_warm():
    clock = Clock()
    pol = PoolPolicy(StandbyPoolConfig(keep=1, min_interval_s=0, backoff_s=10, max_backoff_s=35), clock)
    waits = []
    for _ in range(4):
        assert pol.due(0)
        pol.submitting()
        waits.append(pol.refused("Invalid reservation name specified"))
        assert not pol.due(0)
        clock.t += waits[-1] - 0.1
        assert not pol.due(0), "still backing off"
        clock.t += 0.1
    assert waits == [10, 20, 35, 35]
    assert pol.reason == "sbatch refused a standby job: Invalid reservation name specified"
    assert pol.to_dict(0)["refusals"] == 4
    pol.submitting()
    pol.submitted("11")
    # a job that ends without ever holding a warm standby counts as a refusal; one that did, does not
    assert pol.job_ended("11", "standby job 11 ended") == 35 and pol.refusals == 5
    clock.t += 35
    pol.submitting()
    pol.submitted("12")
    pol.warm("12")
    assert pol.refusals == 0 and pol.reason is None and pol.retry_at is None
    assert pol.job_ended("12", "ended") is None and pol.job_ended("99", "not ours") is None


def test_policy_waits_for_a_missing_reservation_without_calling_sbatch_and_caps_submissions_per_window():
    clock = Clock()
    pol = PoolPolicy(StandbyPoolConfig(keep=5, min_interval_s=1, max_per_window=3, window_s=100), clock)
    assert not pol.due(0, reservation_ok=False, reservation="standby")
    assert pol.reason.startswith("reservation 'standby' does not exist")
    for i in range(3):
        assert pol.due(0, reservation_ok=True)
        pol.submitting()
        pol.submitted(str(i))
        clock.t += 1
    assert not pol.due(0) and "3 standby jobs submitted within 100 s" in pol.reason
    clock.t += 98
    assert pol.due(0), "the first submission left the window"


def test_config_and_sbatch_command_line():
    with pytest.raises(ValueError):
        StandbyPoolConfig(keep=-1)
    argv = sbatch_argv(StandbyPoolConfig(keep=1, script="/x/standby.sbatch"), "standby", "57", "/run")
    assert argv == ["sbatch", "--parsable", "--reservation=standby", "--nodes=1", "--job-name=tm-standby",
                    "--output=/run/standby-%j.out", "/x/standby.sbatch", "57"]
    assert parse_job_id("58;cluster\n") == "58" and parse_job_id("59\n") == "59"
    with pytest.raises(ValueError):
        parse_job_id("sbatch: error")


# ----------------------------------------------------------------------------------------------------------------
# SlurmCluster against a fake SLURM
# ----------------------------------------------------------------------------------------------------------------
class FakeSlurm:
    """sbatch, scancel and scontrol as tmd calls them (through tmd.slurm.run_slurm), over a reservation of nodes;
    :meth:`schedule` starts pending jobs on free, undrained reservation nodes."""

    def __init__(self, reservation_nodes=("n4", "n5")) -> None:
        self.reservation = list(reservation_nodes)
        self.jobs: dict[str, s.StandbyJob] = {}
        self.node_states: dict[str, tuple[str, str]] = {}
        self.reservation_ok = True
        self.refuse = ""  # sbatch's error, when set
        self.calls: list[list[str]] = []
        self.next_id = 100

    def __call__(self, argv, timeout_s=None, cwd=None, env=None) -> str:
        self.calls.append(list(argv))
        if argv[0] == "sbatch":
            if self.refuse:
                raise s.SlurmError(f"sbatch --parsable --reservation=standby: {self.refuse}")
            assert env is not None and not any(k.startswith("SLURM_JOB") for k in env) and "TM_PYTHON" in env
            jid, self.next_id = str(self.next_id), self.next_id + 1
            self.jobs[jid] = s.StandbyJob(jid, "PENDING", [], "Resources")
            return f"{jid}\n"
        if argv[0] == "scancel":
            for jid in argv[1:]:
                self.jobs.pop(jid, None)
            return ""
        if argv[:2] == ["scontrol", "update"]:
            fields = dict(a.split("=", 1) for a in argv[2:])
            if "NodeName" in fields:
                self.node_states[fields["NodeName"]] = ("draining", fields["Reason"])
            return ""
        raise AssertionError(f"unexpected SLURM call {argv}")

    def sbatch_calls(self) -> int:
        return sum(1 for a in self.calls if a[0] == "sbatch")

    def schedule(self) -> None:
        held = {n for j in self.jobs.values() for n in j.nodes}
        for j in self.jobs.values():
            free = [n for n in self.reservation if n not in held and "drain" not in self.node_states.get(n, ("",))[0]]
            if j.state == "PENDING" and free:
                j.state, j.nodes, j.reason = "RUNNING", [free[0]], ""
                held.add(free[0])


class FakePoller:
    """tmd.slurm.Poller's interface, polled by the test: runs the queued actions, then snapshots the fake."""

    timeout_s = 1.0

    def __init__(self, fake: FakeSlurm) -> None:
        self.fake, self.actions, self.latest, self.seq = fake, [], None, 0

    def watch(self, nodes) -> None:
        pass

    def submit(self, name, action) -> None:
        self.actions.append((name, action))

    def stop(self) -> None:
        pass

    def poll(self) -> None:
        done = []
        for name, action in self.actions:
            try:
                done.append({"action": name, "ok": True, "result": action()})
            except s.SlurmError as e:
                done.append({"action": name, "ok": False, "error": str(e)})
        self.actions = []
        self.fake.schedule()
        self.seq += 1
        jobs = {j: dataclasses.replace(sj, nodes=list(sj.nodes)) for j, sj in self.fake.jobs.items()}
        self.latest = s.Snapshot(self.seq, dict(self.fake.node_states), jobs, self.fake.reservation_ok, [], done)


class FakeLauncher:
    def __init__(self) -> None:
        self.node_job: dict[str, str] = {}
        self.started: list[str] = []

    def assign(self, node, job_id):
        self.node_job[node] = job_id

    def forget(self, node):
        self.node_job.pop(node, None)

    def start_node(self, node, standby):
        self.started.append(node)

    def running(self, node):
        return []

    def base_env(self):
        return {"PATH": "/usr/bin", "SLURM_CONF": "/etc/slurm.conf"}


@dataclasses.dataclass
class FakeControl:
    journal: Journal
    registry: Registry
    run_dir: str
    address: str = "tcp://127.0.0.1:1"
    keys: object = None
    current_migration: object = None
    current_incident: object = None

    def request_migration(self, sources, targets, require_healthy=True):
        raise MigrationError(ErrorCode.MIGRATION_RUNNING, "not in this test")


def make_warm(reg: Registry, name: str) -> None:
    reg.add_worker(Worker(f"{name}/0".encode(), name, 0, 1, "h"))


@pytest.fixture
def pool_job(tmp_path, monkeypatch):
    """A SlurmCluster for job 1 (n1, n2) with ``--keep-standbys 1`` against a FakeSlurm; ``step()`` is one poll."""
    monkeypatch.setenv("TM_STATE_DIR", str(tmp_path / "state"))
    fake = FakeSlurm()
    monkeypatch.setattr(s, "run_slurm", fake)
    reg = Registry(["n1", "n2"], 1, [])
    control = FakeControl(Journal(None), reg, str(tmp_path))
    clock = Clock()
    cluster = s.SlurmCluster(control, FakeLauncher(), "1", ["n1", "n2"], "n1",
                             pool=StandbyPoolConfig(keep=1, min_interval_s=5, backoff_s=10, max_backoff_s=40))
    cluster.pool.clock = clock
    cluster.poller = FakePoller(fake)

    def step(seconds: float = 1.0) -> None:
        clock.t += seconds
        cluster.poller.poll()
        cluster.tick(clock.t)

    def events(name: str) -> list[dict]:
        return [e for e in control.journal.since(0, 10_000) if e["event"] == name]
    return cluster, fake, reg, step, events


def test_the_pool_replaces_consumed_and_failed_standbys_drains_failed_nodes_and_cancels_its_jobs(pool_job):
    cluster, fake, reg, step, events = pool_job
    step()  # short by one: sbatch queued
    step()  # submitted, scheduled on n4, adopted
    assert [e["slurm_job"] for e in events(Event.STANDBY_JOB_SUBMITTED)] == ["100"]
    assert reg.nodes["n4"].role == NodeRole.STANDBY and cluster.launcher.node_job["n4"] == "100"
    make_warm(reg, "n4")
    for _ in range(10):
        step()
    assert fake.sbatch_calls() == 1, "the pool is full: nothing more is submitted"
    # consumed: n4 takes n2's ranks -> a replacement standby job, started on n5
    n4 = reg.nodes["n4"]
    n4.role, n4.ranks = NodeRole.ACTIVE, [1]
    step(5)
    step()
    assert [e["slurm_job"] for e in events(Event.STANDBY_JOB_SUBMITTED)] == ["100", "101"]
    assert reg.nodes["n5"].role == NodeRole.STANDBY
    make_warm(reg, "n5")
    step()
    # failed: n5 is drained with tmd's reason and handed back (its standby job cancelled); the replacement pends
    reg.fail_node(reg.nodes["n5"], "rank 1 exited with code -9")
    for _ in range(5):  # (two polls after the failure still list n5's job: the node is drained)
        step(5)
    drain = [a for a in fake.calls if a[:2] == ["scontrol", "update"]]
    assert drain == [["scontrol", "update", "NodeName=n5", "State=DRAIN",
                      "Reason=trainmover: job 1: rank 1 exited with code -9"]]
    assert events(Event.SLURM_NODE_DRAINED)[0]["node"] == "n5"
    assert ["scancel", "101"] in fake.calls and "101" not in fake.jobs
    assert fake.sbatch_calls() == 3 and fake.jobs["102"].state == "PENDING"
    for _ in range(20):
        step(5)
    assert fake.sbatch_calls() == 3, "a full reservation: the pending job counts, nothing loops"
    st = cluster.status()
    assert st["drained"] == ["n5"] and st["pool"]["have"] == 1
    assert st["pool"]["pending"] == [{"slurm_job": "102", "state": "PENDING", "reason": "Resources"}]
    shown = render.slurm_lines(st)  # tmctl status
    assert shown[1] == "standby pool: 1 of 1 warm or pending; submitted: 100, 101, 102; job 102 PENDING (Resources)"
    assert shown[-1] == "drained by tmd (failed): n5"
    # the job ends: what tmd submitted that has not started is cancelled (a running one ends by itself)
    cluster.job_ended()
    assert fake.calls[-1] == ["scancel", "102"] and list(fake.jobs) == ["100"]
    assert events(Event.STANDBY_JOBS_CANCELLED)[-1]["slurm_jobs"] == ["102"]


def test_a_refusing_or_missing_reservation_is_reported_and_retried_with_backoff_never_in_a_loop(pool_job):
    cluster, fake, reg, step, events = pool_job
    fake.reservation_ok = False
    for _ in range(30):
        step()
    assert fake.sbatch_calls() == 0
    assert "reservation 'standby' does not exist" in cluster.status()["pool"]["reason"]
    assert len(events(Event.STANDBY_POOL_WAITING)) == 1, "said once, not every poll"
    fake.reservation_ok, fake.refuse = True, "Access denied to requested reservation"
    for _ in range(120):  # 120 s
        step()
    # tries at 0, then 10, 20, 40, 40 s after each refusal: 5 calls in 120 s (1 s polls would make 120)
    assert fake.sbatch_calls() == 5
    refusals = events(Event.STANDBY_POOL_REFUSED)
    assert [e["retry_in_s"] for e in refusals] == [10, 20, 40, 40, 40][:len(refusals)] and len(refusals) == 5
    assert "Access denied to requested reservation" in refusals[0]["reason"]
    assert cluster.status()["pool"]["refusals"] == 5
    fake.refuse = ""
    for _ in range(45):
        step()
    assert fake.sbatch_calls() == 6 and reg.nodes["n4"].role == NodeRole.STANDBY


def test_a_standby_job_that_ends_unused_backs_off_instead_of_resubmitting_at_once(pool_job):
    cluster, fake, reg, step, events = pool_job
    fake.reservation = []  # nothing can start: the job pends
    step()
    step()
    assert list(fake.jobs) == ["100"]
    del fake.jobs["100"]  # it failed (its script, its node) before ever holding a warm standby
    for _ in range(9):
        step()
    assert fake.sbatch_calls() == 1
    assert "standby job 100 ended without a warm standby" in events(Event.STANDBY_POOL_REFUSED)[0]["reason"]
    step(2)
    step()
    assert fake.sbatch_calls() == 2


# ----------------------------------------------------------------------------------------------------------------
# Distinct standbys
# ----------------------------------------------------------------------------------------------------------------
def test_any_any_picks_two_distinct_standbys_or_is_refused_naming_how_many_are_warm(pool_job):
    cluster, fake, reg, step, events = pool_job
    fake.jobs.update({"7": s.StandbyJob("7", "RUNNING", ["n4"], ""), "8": s.StandbyJob("8", "RUNNING", ["n5"], "")})
    fake.reservation = []
    step()
    make_warm(reg, "n4")
    with pytest.raises(MigrationError) as e:
        cluster.resolve_targets(["any", "any"])
    assert e.value.code == ErrorCode.BUSY_STANDBY and "needs 2 warm standbys" in str(e.value) and \
        "1 is warm: n4" in str(e.value)
    make_warm(reg, "n5")
    assert sorted(cluster.resolve_targets(["any", "any"])) == ["n4", "n5"]
    assert cluster.resolve_targets(["n4", "any"]) == ["n4", "n5"]
    assert cluster.resolve_targets(["any", "n4"]) == ["n5", "n4"], "a named standby is not picked for 'any'"
    assert cluster.resolve_targets(["8", "any"]) == ["n5", "n4"]
    with pytest.raises(MigrationError, match="standby job 7 is running but has no warm node left"):
        cluster.resolve_targets(["n4", "7"])
    # a standby SLURM drains is picked by nobody (migrate any, drains, evacuations, recoveries, guards)
    fake.node_states["n5"] = ("draining", "bad fan")
    step()
    assert [n.name for n in reg.warm_standbys()] == ["n4"] and cluster.resolve_targets(["any"]) == ["n4"]
    assert [n.name for n in reg.warm_standbys(exclude=["n4"])] == []



def test_a_restarted_tmd_gets_the_slurm_side_with_its_standby_jobs_pool_and_drain_aware_picks(pool_job, tmp_path):
    from tmd.supervise import hand_over

    cluster, fake, reg, step, events = pool_job
    step()
    step()
    fake.node_states["n4"] = ("draining", "bad fan")
    step()
    crashed = FakeControl(cluster.journal, reg, str(tmp_path))
    crashed.launcher, crashed.cluster = cluster.launcher, cluster
    resumed = FakeControl(Journal(None), Registry(["n1", "n2"], 1, []), str(tmp_path))
    resumed.launcher = resumed.cluster = None
    hand_over(crashed, resumed)
    assert resumed.cluster is cluster and cluster.control is resumed and cluster.registry is resumed.registry
    assert resumed.launcher is crashed.launcher and "n4" in resumed.registry.nodes
    make_warm(resumed.registry, "n4")
    assert resumed.registry.warm_standbys() == [], "the resumed registry skips what SLURM drains too"
    assert cluster.pool.jobs == ["100"]


def test_a_restarted_tmd_still_knows_the_failed_and_left_nodes_of_the_world_before_a_rebuild(pool_job, tmp_path):
    """After a rebuild inside the allocation the journal since the last tmd_started no longer names the old
    world's failed node; a tmd that crashes then must still drain it (not take it for a standby)."""
    from tmd.supervise import hand_over

    cluster, fake, reg, step, events = pool_job
    step()
    step()  # standby job 100 runs on n4, adopted
    reg.restore(reg.nodes["n4"], NodeRole.FAILED, [], "n4/0 exited with code -9")  # it failed before a rebuild
    reg.restore(reg.add_node("n9"), NodeRole.LEFT, [], "migrated")
    crashed = FakeControl(cluster.journal, reg, str(tmp_path))
    crashed.launcher, crashed.cluster = cluster.launcher, cluster
    resumed = FakeControl(Journal(None), Registry(["n1", "n2"], 1, []), str(tmp_path))  # its journal: n1, n2
    resumed.launcher = resumed.cluster = None
    hand_over(crashed, resumed)
    got = {n: (resumed.registry.nodes[n].role, resumed.registry.nodes[n].reason) for n in ("n4", "n9")}
    assert got == {"n4": (NodeRole.FAILED, "n4/0 exited with code -9"), "n9": (NodeRole.LEFT, "migrated")}
    for _ in range(4):  # two polls after the failure still list n4's job; the drain runs on the poller's thread
        step()
    assert ["scontrol", "update", "NodeName=n4", "State=DRAIN",
            "Reason=trainmover: job 1: n4/0 exited with code -9"] in fake.calls


def test_a_prolog_report_written_after_its_job_runs_is_journalled_once_and_a_resent_notice_once(pool_job):
    """SLURM lists a job as RUNNING while its prologs may still run: tmd journals each node's prolog report
    when it appears, not only those there at adoption; an epilog notice the hook resends is journalled once."""
    import json
    import os

    from tmd import protocol as p

    cluster, fake, reg, step, events = pool_job
    step()
    step()  # standby job 100 runs on n4 and is adopted: no prolog report yet
    assert reg.nodes["n4"].role == NodeRole.STANDBY and events(Event.SLURM_HOOK) == []
    d = p.layout.hook_report_dir("100")
    os.makedirs(d)
    with open(os.path.join(d, "prolog.n4.json"), "w") as f:
        json.dump({"hook": "prolog", "node": "n4", "job_id": "100", "ok": True, "problems": [], "duration_s": 0.3}, f)
    for _ in range(3):
        step()
    assert [(e["hook"], e["node"], e["slurm_job"], e["ok"]) for e in events(Event.SLURM_HOOK)] == [
        ("prolog", "n4", "100", True)]
    notice = p.NodeNotice(node="n4", job_id="100", hook=p.HookKind.EPILOG, detail="node left the job")
    for _ in range(2):  # the first copy, then the hook's resend
        cluster.on_notice(notice)
    assert [e["hook"] for e in events(Event.SLURM_HOOK)] == ["prolog", "epilog"]
    assert reg.nodes["n4"].role == NodeRole.FAILED and len(events(Event.STANDBY_LOST)) == 1


# ----------------------------------------------------------------------------------------------------------------
# A restart from a checkpoint inside the allocation (the checkpoint tier in SLURM mode)
# ----------------------------------------------------------------------------------------------------------------
def test_a_rebuilt_world_keeps_the_survivors_places_takes_usable_standbys_and_carries_the_failed_nodes(pool_job):
    cluster, fake, reg, step, events = pool_job
    for name in ("n1", "n2"):
        cluster.launcher.assign(name, "1")  # as tmd.cli does
    fake.jobs.update({"7": s.StandbyJob("7", "RUNNING", ["n4"], ""), "8": s.StandbyJob("8", "RUNNING", ["n5"], "")})
    fake.reservation = []  # the pool's own job pends
    step()
    assert reg.nodes["n4"].role == reg.nodes["n5"].role == NodeRole.STANDBY
    fake.node_states["n5"] = ("drained", "maintenance")
    step()
    reg.fail_node(reg.nodes["n1"], "n1/0 exited with code -9")
    reg.fail_node(reg.nodes["n2"], "n2/0 exited with code -9")
    plan, why = cluster.rebuild_world()  # n5 is drained: one usable standby for two lost places
    assert plan is None and why == "2 of the job's 2 nodes are lost and 1 usable standby node can replace them"

    reg.restore(reg.nodes["n2"], NodeRole.ACTIVE, [1])  # n2 survives: n4 takes n1's place (ranks from 0)
    plan, why = cluster.rebuild_world()
    assert why == "" and plan.world == ["n4", "n2"] and plan.replaced == {0: "n4"}
    assert plan.standbys == ["n5"] and plan.gone == {"n1": (NodeRole.FAILED, "n1/0 exited with code -9")}

    # the relaunched daemon: the plan's world as its nodes, a new launcher that knows which job holds each node
    new_reg = Registry(plan.world, 1, plan.standbys)  # as tmd.cli makes it
    control = FakeControl(Journal(None), new_reg, cluster.control.run_dir)
    launcher = FakeLauncher()
    cluster.relaunch(control, launcher)
    assert launcher.started == ["n4", "n2", "n5"] and cluster.launcher is launcher and cluster.registry is new_reg
    assert launcher.node_job == {"n1": "1", "n2": "1", "n4": "7", "n5": "8"}
    assert new_reg.nodes["n4"].ranks == [0] and new_reg.nodes["n5"].role == NodeRole.STANDBY
    assert new_reg.nodes["n1"].role == NodeRole.FAILED and new_reg.nodes["n1"].reason == "n1/0 exited with code -9"
    events = lambda name: [e for e in control.journal.since(0, 10_000) if e["event"] == name]  # noqa: E731
    step()
    step()
    assert ["scontrol", "update", "NodeName=n1", "State=DRAIN",
            "Reason=trainmover: job 1: n1/0 exited with code -9"] in fake.calls  # still drained as unfit
    assert events(Event.SLURM_NODE_DRAINED)[0]["node"] == "n1"
    with pytest.raises(RuntimeError, match="without a rebuilt world"):
        cluster.relaunch(control, launcher)


def test_a_node_that_left_or_was_lost_with_its_job_is_a_standby_again_when_a_new_standby_job_lands_on_it(pool_job):
    """Outside test on the local SLURM cluster: after `scancel` of a warm pool standby (n4 lost with its job), the
    pool's next job landed on n4 and was refused ("already part of this job (failed)"): it held n4 with no node in
    use until the job ended, and once the other standby was used the job waited for a standby forever."""
    cluster, fake, reg, step, events = pool_job
    fake.reservation = ["n4"]  # one reservation node: the next standby job can land only where the last one was
    step()
    step()  # job 100 runs on n4, adopted
    make_warm(reg, "n4")
    fake.jobs.pop("100")  # scancel 100
    reg.nodes["n4"].workers[0].exited = True  # (its process ended with the job)
    for _ in range(4):
        step(10)  # gone; the pool submits 101, which lands on n4
    assert [e["node"] for e in events(Event.STANDBY_LOST)] == ["n4"]
    assert events(Event.STANDBY_NODE_REFUSED) == [] and [e["node"] for e in events(Event.STANDBY_NODE_REVIVED)] == ["n4"]
    assert reg.nodes["n4"].role == NodeRole.STANDBY and reg.nodes["n4"].workers == {}
    assert cluster.launcher.node_job["n4"] == "101" and cluster.launcher.started.count("n4") == 2
    make_warm(reg, "n4")  # its new process registers
    assert [n.name for n in reg.warm_standbys()] == ["n4"]


def test_a_failed_node_tmd_is_draining_is_refused_and_its_empty_standby_job_cancelled(pool_job):
    cluster, fake, reg, step, events = pool_job
    fake.reservation = ["n4"]
    step()
    step()
    make_warm(reg, "n4")
    reg.fail_node(reg.nodes["n4"], "n4/0 exited with code -9")  # a real failure: tmd drains n4
    cluster._draining.add("n4")  # noqa: SLF001 - (the drain asked, SLURM has not drained it yet)
    fake.jobs.pop("100")
    fake.jobs["105"] = s.StandbyJob("105", "RUNNING", ["n4"], "")  # SLURM put a new standby job there meanwhile
    for _ in range(3):
        step(10)
    refused = [e for e in events(Event.STANDBY_NODE_REFUSED) if e["slurm_job"] == "105"]
    assert refused and refused[0]["reason"].startswith("node 'n4' is already part of this job (failed)")
    assert ["scancel", "105"] in fake.calls and reg.nodes["n4"].role == NodeRole.FAILED
    cancelled = [e for e in events(Event.STANDBY_JOBS_CANCELLED) if e["slurm_jobs"] == ["105"]]
    assert cancelled[0]["reason"] == "none of its nodes can be a standby of this job"
    cluster.adopted.pop("100", None)  # its old job is gone for good: only the pending drain keeps n4 out
    cluster._drained.discard("n4")  # noqa: SLF001
    assert cluster._not_revivable("n4").endswith("tmd asked SLURM to drain it")  # noqa: SLF001
    cluster._drained.add("n4")  # noqa: SLF001 - drained, then resumed by an admin (SLURM scheduled it again)
    assert cluster._not_revivable("n4") is None  # noqa: SLF001


def test_a_standby_job_cancelled_under_ranks_does_not_get_its_healthy_node_drained(pool_job):
    """Outside test on the local SLURM cluster: `scancel` of the standby job whose node held ranks killed them;
    tmd saw them die before it saw the job end, counted a failure, and drained the healthy node."""
    cluster, fake, reg, step, events = pool_job
    step()
    step()  # job 100 on n4
    n4 = reg.nodes["n4"]
    n4.role, n4.ranks = NodeRole.ACTIVE, [1]  # ranks migrated onto n4
    reg.fail_node(n4, "n4/0 (pid 14881) died")  # scancel 100: its ranks die first
    step()  # a poll from before the scancel still lists job 100
    fake.jobs.pop("100")
    for _ in range(4):
        step(5)
    assert not [a for a in fake.calls if a[:2] == ["scontrol", "update"]] and events(Event.SLURM_NODE_DRAINED) == []
    assert cluster.status()["drained"] == []

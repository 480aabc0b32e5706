"""Failure detection on synthetic heartbeats and process states: no processes, clocks and psutil injected."""
from __future__ import annotations

import os
import subprocess
import sys
import time

from types import SimpleNamespace

import pytest

from tmd.config import DetectionConfig
from tmd.detection import Detector, Failure, Healthy, ProcessExited, ProcessState, Slow, Unhealthy
from tmd.protocol.vocab import FailureSignal, Health, NodeRole
from tmd.registry import Registry, Worker

pytestmark = pytest.mark.timeout(10)

T0 = 1000.0  # time.monotonic() of the synthetic clock at the start of each test
WALL = 5000.0  # epoch seconds at T0
EVERYONE = ("n1/0", "n1/1", "n2/0", "n2/1", "s1/0", "s1/1")
BUT_N2 = ("n1/0", "n1/1", "s1/0", "s1/1")


class Processes:
    """A ProcessInspector over made-up states and CPU times, by identity ("n1/0")."""

    def __init__(self):
        self.states: dict[str, ProcessState] = {}
        self.cpu: dict[str, float] = {}
        self.waiting: set[str] = set()  # processes with a thread that waits for a CPU

    def state(self, w):
        return self.states.get(w.identity.decode())

    def cpu_s(self, w):
        return self.cpu.get(w.identity.decode())

    def waiting_for_cpu(self, w):
        return w.identity.decode() in self.waiting


class Job:
    """2 active nodes x 2 ranks and a standby, every process registered, past its first step."""

    def __init__(self, **detector_args):
        self.reg = Registry(["n1", "n2"], 2, ["s1"])
        for node in ("n1", "n2", "s1"):
            for lr in range(2):
                w = Worker(f"{node}/{lr}".encode(), node, lr, 100 + lr, "h", last_heartbeat=T0, step_time_s=0.1)
                self.reg.add_worker(w)
                w.last_heartbeat = T0
        self.procs = Processes()
        self.exited: list = []
        self.now = T0
        self.replacing: set[str] = set()
        self.detector = Detector(self.reg, exits=self._exits, processes=self.procs,
                                 replacing=lambda name: name in self.replacing,
                                 wall_clock=lambda: WALL + (self.now - T0), **detector_args)

    def _exits(self):
        out, self.exited = self.exited, []
        return out

    def w(self, ident: str) -> Worker:
        return self.reg.by_identity[ident.encode()]


    def block(self, ident: str, since: float) -> None:
        """``ident``'s counters: one collective pending since ``since`` seconds after T0."""
        self.w(ident).counters = {"pending": 1, "last_op_start_s": WALL + since}

    def tick(self, at: float, *beating: str):
        """The detector's verdicts ``at`` seconds after T0, the ``beating`` processes having just heartbeated."""
        self.now = T0 + at
        for ident in beating:
            self.w(ident).last_heartbeat = self.now
        return self.detector.tick(self.now)


def failures(verdicts):
    return [(v.node.name, v.signal) for v in verdicts if isinstance(v, Failure)]


def test_a_killed_process_fails_its_node_once():
    job = Job()
    job.exited = [SimpleNamespace(node="n2", local_rank=0, returncode=-9),
                  SimpleNamespace(node="n2", local_rank=1, returncode=-9)]
    v = job.tick(0.05)
    exits = [x for x in v if isinstance(x, ProcessExited)]
    assert [(x.local_rank, x.expected, x.lost) for x in exits] == [(0, False, False), (1, True, False)]
    assert failures(v) == [("n2", FailureSignal.PROCESS_EXIT)]
    assert v.index(exits[0]) < v.index(next(x for x in v if isinstance(x, Failure))) < v.index(exits[1])
    assert next(x for x in v if isinstance(x, Failure)).reason == "n2/0 exited with code -9"


def test_a_standby_process_exit_is_lost_not_a_failure_and_a_done_rank_is_expected():
    job = Job()
    job.w("n1/0").done = True
    job.exited = [SimpleNamespace(node="s1", local_rank=1, returncode=1),
                  SimpleNamespace(node="n1", local_rank=0, returncode=0)]
    v = job.tick(0.05)
    assert failures(v) == []
    assert [(x.node.name, x.expected, x.lost) for x in v] == [("s1", False, True), ("n1", True, False)]


def test_a_vanished_process_and_a_stopped_one():
    job = Job()
    job.procs.states["n1/1"] = ProcessState.DIED
    job.procs.states["n2/0"] = ProcessState.STOPPED
    v = job.tick(0.05)
    assert failures(v) == [("n1", FailureSignal.PROCESS_EXIT), ("n2", FailureSignal.STOPPED)]
    assert [f.reason for f in v] == ["n1/1 (pid 101) died", "n2/0 (pid 100) is stopped"]
    job.procs.states["s1/0"] = ProcessState.STOPPED  # a standby's loss is no failure of the job
    job.reg.nodes["n1"].role = job.reg.nodes["n2"].role = NodeRole.FAILED
    assert failures(job.tick(0.1)) == []


def test_silence_with_a_blocked_peer_fails_the_node_fast():
    job = Job()
    job.block("n1/0", since=0.0)  # n2 goes silent at T0, its peer n1/0 waits for it in a collective
    assert failures(job.tick(0.7, *BUT_N2)) == []  # not silent for suspect_after_s (0.8 s) yet
    v = job.tick(0.9, *BUT_N2)
    assert failures(v) == [("n2", FailureSignal.SILENT)]
    assert v[0].reason == "no heartbeat for 0.90 s (peers blocked for 0.90 s)"


def test_a_peer_that_is_done_is_not_blocked_and_the_last_rank_to_finish_is_not_failed():
    """At the job's end the other ranks report done and exit: their last heartbeat may still show the final
    collective pending. That is no peer waiting, so a slow last rank gets the long timeout, not the fast rule (a
    run here failed it 0.9 s after the others were done, and waited for a standby forever)."""
    job = Job()
    for ident in ("n1/0", "n1/1"):
        job.block(ident, since=0.0)
        job.w(ident).done = True
    assert failures(job.tick(0.9, *BUT_N2)) == []
    assert failures(job.tick(4.9, *BUT_N2)) == []
    job.w("n1/1").done = False  # one still waits in the collective: the fast rule again
    assert failures(job.tick(5.0, *BUT_N2)) == [("n2", FailureSignal.SILENT)]


def test_the_thresholds_are_the_jobs_config():
    job = Job(config=DetectionConfig(heartbeat_timeout_s=12.0, suspect_after_s=1.5, blocked_after_s=0.5))
    job.block("n1/0", since=0.0)
    assert failures(job.tick(0.9, *BUT_N2)) == []  # failed by now with the defaults (above)
    assert failures(job.tick(1.4, *BUT_N2)) == []
    assert failures(job.tick(1.6, *BUT_N2)) == [("n2", FailureSignal.SILENT)]
    quiet = Job(config=DetectionConfig(heartbeat_timeout_s=2.0, suspect_after_s=1.5, blocked_after_s=0.5))
    v = quiet.tick(2.1, *BUT_N2)  # no peer blocked: the long timeout, the job's
    assert failures(v) == [("n2", FailureSignal.SILENT)] and v[0].reason.startswith("no heartbeat for 2.10 s")


def test_silence_without_a_blocked_peer_waits_for_the_long_timeout():
    job = Job()
    for at in (1.0, 3.0, 4.9):
        assert job.tick(at, *BUT_N2) == []  # silent, but every peer is computing: maybe a long step
    v = job.tick(5.1, *BUT_N2)
    assert failures(v) == [("n2", FailureSignal.SILENT)]
    assert not any(isinstance(x, Unhealthy) for x in v)  # failed, not merely unhealthy


def test_a_slow_but_computing_node_is_not_failed():
    job = Job()
    job.procs.cpu.update({"n2/0": 10.0, "n2/1": 10.0})  # n2 runs on this host: its CPU time is visible
    job.block("n1/0", since=0.0)
    assert failures(job.tick(1.0, *BUT_N2)) == []  # the first sample gives it the benefit of the doubt
    job.procs.cpu["n2/0"] = 10.5  # it computes
    v = job.tick(1.5, *BUT_N2)
    assert failures(v) == [] and [(x.node.name, x.silent_s, x.cpu_s) for x in v] == [("n2", 0.5, 0.5)]
    assert isinstance(v[0], Slow)
    assert failures(job.tick(1.55, *BUT_N2)) == []  # no CPU since, but within the 0.1 s grace
    assert failures(job.tick(1.7, *BUT_N2)) == [("n2", FailureSignal.SILENT)]  # no more CPU: hung


def test_a_starved_node_whose_threads_wait_for_a_cpu_is_not_failed():
    """On a crowded host a computing rank may get under 0.05 s of CPU in the grace; a thread of it is runnable."""
    job = Job()
    job.procs.cpu.update({"n2/0": 10.0, "n2/1": 10.0})
    job.block("n1/0", since=0.0)
    assert failures(job.tick(1.0, *BUT_N2)) == []  # the first sample
    job.procs.cpu["n2/0"] = 10.02  # 20 ms of CPU: less than the rule asks
    job.procs.waiting.add("n2/1")  # but a thread of n2/1 is runnable: it waits for a CPU
    assert job.tick(1.5, *BUT_N2) == []  # busy, and no Slow verdict
    assert job.tick(3.0, *BUT_N2) == []
    job.procs.waiting.clear()  # every thread sleeps now: hung
    assert failures(job.tick(3.1, *BUT_N2)) == [("n2", FailureSignal.SILENT)]
    starved = Job()
    starved.procs.cpu.update({"n2/0": 10.0, "n2/1": 10.0})
    starved.procs.waiting.add("n2/0")
    starved.block("n1/0", since=0.0)
    starved.tick(1.0, *BUT_N2)
    assert failures(starved.tick(5.1, *BUT_N2)) == [("n2", FailureSignal.SILENT)]  # the long timeout still holds


def test_thread_states_tells_a_computing_process_from_a_sleeping_one():
    from tmd.detection import thread_states
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        deadline = time.monotonic() + 5
        while "R" not in thread_states(spinner.pid) and time.monotonic() < deadline:
            time.sleep(0.01)  # until it runs: the kernel has no event for that
        assert "R" in thread_states(spinner.pid)
        deadline = time.monotonic() + 5
        while thread_states(sleeper.pid) != ["S"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert thread_states(sleeper.pid) == ["S"]
    finally:
        spinner.kill(), sleeper.kill()
        spinner.wait(), sleeper.wait()
    assert thread_states(spinner.pid) == []  # gone


def test_start_up_grace_only_the_long_timeout_before_the_first_step():
    job = Job()
    job.w("n2/1").step_time_s = None  # still importing: its heartbeat thread may starve
    job.block("n1/0", since=0.0)
    assert failures(job.tick(2.0, *BUT_N2)) == []
    assert failures(job.tick(5.1, *BUT_N2)) == [("n2", FailureSignal.SILENT)]


def test_a_silent_standby_turns_unhealthy_then_healthy_again():
    job = Job()
    v = job.tick(5.5, *EVERYONE[:-1])
    assert [(type(x), x.node.name) for x in v] == [(Unhealthy, "s1")]
    assert [w.identity for w in v[0].silent] == [b"s1/1"] and v[0].reason == "no heartbeat for 5.0 s"
    job.reg.nodes["s1"].health = Health.UNHEALTHY  # (the daemon applies the verdict)
    v = job.tick(5.6, *EVERYONE)
    assert [(type(x), x.node.name) for x in v] == [(Healthy, "s1")]


def test_something_else_keeps_a_node_unhealthy():
    job = Job(held_unhealthy=lambda node: node.name == "s1")  # e.g. a bad GPU
    job.reg.nodes["s1"].health = Health.UNHEALTHY
    assert job.tick(0.1) == []


def test_a_standby_replacing_a_failed_node_is_part_of_the_job():
    job = Job()
    s1 = job.reg.nodes["s1"]
    job.reg.promote(s1)
    job.procs.states["s1/0"] = ProcessState.STOPPED
    assert failures(job.tick(0.1)) == []  # a migration's joiner: its loss only aborts the migration
    job.replacing.add("s1")  # a recovery's replacement: its loss is a failure
    assert failures(job.tick(0.2)) == [("s1", FailureSignal.STOPPED)]


def test_a_broken_transfer_is_a_failure_only_if_the_leaver_is_dead():
    job = Job()
    leavers = [job.w("n2/0"), job.w("n2/1")]
    assert job.detector.broken_transfer(job.reg.nodes["n2"], leavers) is None
    job.procs.states["n2/1"] = ProcessState.DIED
    f = job.detector.broken_transfer(job.reg.nodes["n2"], leavers)
    assert (f.node.name, f.reason, f.signal) == ("n2", "n2/1 (pid 101) died", FailureSignal.PROCESS_EXIT)


def test_an_exit_with_a_positive_code_waits_for_the_ranks_report_before_failing_its_node():
    job = Job()
    job.exited = [SimpleNamespace(node="n2", local_rank=1, returncode=1)]  # a script that raised: RankFailed first
    v = job.tick(0.05)
    assert failures(v) == [] and [x.local_rank for x in v if isinstance(x, ProcessExited)] == [1]
    job.w("n2/1").exited = True  # (the daemon applied the exit)
    assert failures(job.tick(0.3, *BUT_N2, "n2/0")) == []
    v = job.tick(0.6, *BUT_N2, "n2/0")  # no report came: the node fails after the grace
    assert failures(v) == [("n2", FailureSignal.PROCESS_EXIT)]
    assert next(x for x in v if isinstance(x, Failure)).reason == "n2/1 exited with code 1"
    assert failures(job.tick(1.5, *BUT_N2, "n2/0")) == []  # once

"""tmd.cpusets (``tmd local --isolate-nodes``): the split of this host's CPUs and processes really pinned to it."""
from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

from tmd import cpusets
from tmd.local import LocalLauncher
from tmd.protocol.layout import RunDir

TWO = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 usable CPUs")
REPORT = ("import os, threading\n"
          "seen = {}\n"
          "t = threading.Thread(target=lambda: seen.update(t=sorted(os.sched_getaffinity(threading.get_native_id()))))\n"
          "t.start(); t.join()\n"
          "print([sorted(os.sched_getaffinity(0)), seen['t']], flush=True)\n")


def test_the_split_on_two_cpus_gives_the_standbys_one_and_the_active_nodes_the_other():
    assert cpusets.split_cpus([0, 1], 2, 1) == ([0], [1], 1)
    assert cpusets.split_cpus([0, 1], 2, 0) == ([0], [1], 1)  # the same active CPUs with no standby
    iso = cpusets.Isolation.plan(["n1", "n2"], ["s1"], cpus=[0, 1], use_cgroup=False)
    assert [iso.cpus_of(n, n.startswith("s")) for n in ("n1", "n2", "s1")] == [[0], [0], [1]]
    assert iso.cpus_of("s2", True) == [1]  # a standby added later: the standbys' pool
    assert iso.describe() == ("isolated nodes (sched_setaffinity): active nodes on CPUs 0, standbys and guards on "
                              "CPUs 1")
    assert iso.to_dict() == {"mechanism": "sched_setaffinity", "active_cpus": [0], "standby_cpus": [1], "per_node": 1,
                             "nodes": {"n1": [0], "n2": [0], "s1": [1], "s2": [1]}}


def test_with_room_each_node_gets_cpus_of_its_own():
    iso = cpusets.Isolation.plan(["n1", "n2"], ["s1"], cpus=range(16), use_cgroup=False)
    assert iso.per_node == 5 and iso.standby == list(range(11, 16))
    assert iso.cpus_of("n1", False) == [0, 1, 2, 3, 4] and iso.cpus_of("n2", False) == [5, 6, 7, 8, 9]
    assert iso.cpus_of("s1", True) == [11, 12, 13, 14, 15]


def test_one_cpu_is_refused_with_one_line():
    with pytest.raises(ValueError, match="^--isolate-nodes needs at least 2 CPUs; this process may use 1$"):
        cpusets.split_cpus([3], 1, 1)


@TWO
def test_a_wrapped_process_and_its_threads_run_on_the_nodes_cpus_only():
    cpus = sorted(os.sched_getaffinity(0))
    iso = cpusets.Isolation.plan(["n1"], ["s1"], cpus=cpus[:2], use_cgroup=False)
    for node, standby, want in (("n1", False, [cpus[0]]), ("s1", True, [cpus[1]])):
        out = subprocess.run(iso.wrap(node, standby, [sys.executable, "-c", REPORT]), capture_output=True,
                             text=True, timeout=60, check=True).stdout
        assert ast.literal_eval(out.strip()) == [want, want], node


@TWO
def test_the_launcher_starts_each_node_pinned(tmp_path):
    cpus = sorted(os.sched_getaffinity(0))
    iso = cpusets.Isolation.plan(["n1"], ["s1"], cpus=cpus[:2], use_cgroup=False)
    launcher = LocalLauncher([sys.executable, "-c", REPORT], str(tmp_path), "tcp://127.0.0.1:1", 1, echo=False,
                             isolation=iso)
    launcher.start_node("n1", standby=False)
    launcher.start_node("s1", standby=True)
    for proc in launcher.procs:
        assert proc.popen.wait(timeout=60) == 0
    for node, want in (("n1", cpus[0]), ("s1", cpus[1])):
        with open(RunDir(str(tmp_path)).log(node, 0)) as f:
            assert ast.literal_eval(f.read().strip()) == [[want], [want]], node
    launcher.terminate_all()


def test_the_pinning_wrapper_refuses_bad_use():
    r = subprocess.run([sys.executable, "-m", "tmd.cpusets", "--cpus", "0", "--"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 1 and r.stderr.strip() == "tmd.cpusets: no command after --"
    r = subprocess.run([sys.executable, "-m", "tmd.cpusets", "--cpus", "4096", "--", "true"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 1 and r.stderr.startswith("tmd.cpusets: cannot pin to CPUs 4096: ")


def test_the_benchmarks_read_the_split_from_the_journal(tmp_path):
    from benchmarks import report
    from tmd.journal import Journal
    from tmd.protocol.vocab import Event

    assert report.isolation(str(tmp_path)) is None and report.setting(False) == "co-located"
    iso = cpusets.Isolation.plan(["n1", "n2"], ["s1"], cpus=[0, 1], use_cgroup=False)
    journal = Journal(RunDir(str(tmp_path)).events)
    journal.record(Event.TMD_STARTED, job="j")
    journal.record(Event.NODES_ISOLATED, **iso.to_dict())
    assert report.isolation(str(tmp_path)) == iso.to_dict() and report.setting(True) == "isolated"

"""The local launcher's bookkeeping of exits (tmd.local): an adopted process's exit code is unknown, not -1."""
import subprocess
import sys
import time

import pytest

from tmd.local import LocalLauncher

pytestmark = pytest.mark.timeout(10)


def test_an_adopted_process_exit_has_no_made_up_code(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "pass"])  # stands in for a worker tmd resume adopted
    launcher = LocalLauncher(["true"], str(tmp_path), "tcp://127.0.0.1:1", 1, echo=False)
    proc = launcher.adopt("n1", 0, child.pid)
    deadline = time.monotonic() + 5
    exited = []
    while not exited and time.monotonic() < deadline:
        exited = launcher.poll()
        time.sleep(0.05)
    child.wait()
    assert exited == [proc] and proc.exited and proc.returncode is None and launcher.running() == []


def test_a_started_process_exit_has_its_code(tmp_path):
    launcher = LocalLauncher([sys.executable, "-c", "import sys; sys.exit(4)"], str(tmp_path), "tcp://127.0.0.1:1", 1,
                             echo=False)
    launcher.start_node("n1", standby=False)
    deadline = time.monotonic() + 5
    exited = []
    while not exited and time.monotonic() < deadline:
        exited = launcher.poll()
        time.sleep(0.05)
    assert [(p.node, p.local_rank, p.returncode) for p in exited] == [("n1", 0, 4)]

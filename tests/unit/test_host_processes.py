"""tmd's look at processes on its own host (tmd.detection.HostProcesses): a killed process counts as dead as soon
as the kernel begins to tear it down, before it turns zombie."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tmd.detection import HostProcesses, ProcessState, exiting
from tmd.registry import Worker

pytestmark = pytest.mark.timeout(60)

HOLD_MB = 2048  # the kernel frees this much of the killed child's memory before it turns zombie (~0.1 s here)


def _stat_file(tmp_path, comm: str, flags: int) -> str:
    path = tmp_path / "stat"
    fields = ["R", "1", "1", "1", "0", "-1", str(flags), "0", "0"]
    path.write_text(f"4242 ({comm}) " + " ".join(fields) + "\n")
    return str(path)


def test_exiting_reads_the_pf_exiting_flag_after_any_command_name(tmp_path):
    assert exiting(0, _stat_file(tmp_path, "a) (b 4 5 6 7 8 9 10", 0x400004))  # PF_RANDOMIZE | PF_EXITING
    assert not exiting(0, _stat_file(tmp_path, "python3", 0x400000))
    assert not exiting(0, str(tmp_path / "absent"))
    (tmp_path / "torn").write_text("4242 (python3) R 1")
    assert not exiting(0, str(tmp_path / "torn"))
    assert not exiting(os.getpid())  # this very process, on Linux's real /proc


def _died_before_reapable(procs: HostProcesses) -> bool:
    """Kill a child that holds HOLD_MB and poll ``procs`` until it says DIED. Returns whether the child could not
    be reaped yet at that moment, i.e. DIED was seen during the kernel's teardown rather than after it."""
    child = subprocess.Popen(
        [sys.executable, "-c",
         # nice 19: on a loaded machine the child's teardown (run in its own context) is what waits for a core
         f"import os\nos.nice(19)\nb = bytearray({HOLD_MB} << 20)\nfor i in range(0, len(b), 4096): b[i] = 1\n"
         "print('held', flush=True)\nimport time\ntime.sleep(60)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "held"
        w = Worker(b"n1/0", "n1", 0, child.pid, "here")
        assert procs.state(w) is None  # alive and asleep
        os.kill(child.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10.0
        while (state := procs.state(w)) is None:
            assert time.monotonic() < deadline, "the killed child never counted as died"
        assert state is ProcessState.DIED
        reaped, _ = os.waitpid(child.pid, os.WNOHANG)
        return reaped == 0
    finally:
        child.kill()
        child.wait()


def test_a_killed_process_counts_as_died_before_it_is_a_zombie():
    """The child is single-threaded, so the thread that frees its 2 GB is its main thread: the whole time, the
    process is neither a zombie nor reapable. HostProcesses must call it DIED within that window.

    The window is ~0.1 s, and a loaded 2-core machine can deschedule this test's polling for longer, so up to 3
    kills are tried and one must be caught in its teardown. A detector that sees only zombies fails all 3."""
    procs = HostProcesses("here")
    outcomes = []
    for _ in range(3):
        outcomes.append(_died_before_reapable(procs))
        if outcomes[-1]:
            break
    assert outcomes[-1], f"DIED was seen only once the child could be reaped, in all {len(outcomes)} kills"

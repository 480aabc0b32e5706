"""worker.exit.exit_process: says why, flushes, and exits with the code (in a subprocess and monkeypatched)."""
import os
import subprocess
import sys

import pytest

from tmd import protocol as p
from worker import exit as worker_exit

pytestmark = pytest.mark.timeout(30)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_child(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=20)


def test_exit_process_prints_why_and_exits_with_the_code():
    r = run_child("import atexit\n"
                  "from tmd import protocol as p\n"
                  "from worker.exit import exit_process\n"
                  "atexit.register(print, 'ATEXIT RAN')\n"
                  "print('buffered line', end='')\n"
                  "exit_process(p.ExitCode.FENCED, 'declared failed by tmd')\n"
                  "print('NOT REACHED')\n")
    assert r.returncode == 3
    assert "[worker] exiting with code 3 (FENCED): declared failed by tmd" in r.stderr
    assert r.stdout == "buffered line"  # flushed before os._exit; nothing after it ran
    assert "ATEXIT RAN" not in r.stdout  # no atexit handlers, no interpreter teardown


def test_exit_ok_says_why_on_stdout():
    r = run_child("from tmd import protocol as p\n"
                  "from worker.exit import exit_process\n"
                  "exit_process(p.ExitCode.OK, 'released by tmd: job finished')\n")
    assert r.returncode == 0
    assert r.stdout.strip() == "[worker] exiting with code 0 (OK): released by tmd: job finished"


def test_exit_process_with_a_code_from_tmd(monkeypatch, capsys):
    codes = []

    def fake_exit(code):
        codes.append(code)
        raise SystemExit(code)

    monkeypatch.setattr(worker_exit.os, "_exit", fake_exit)
    with pytest.raises(SystemExit):
        worker_exit.exit_process(2, "register refused")
    with pytest.raises(SystemExit):
        worker_exit.exit_process(7, "a code without a name")
    assert codes == [2, 7] and all(type(c) is int for c in codes)
    err = capsys.readouterr().err
    assert "exiting with code 2 (REFUSED): register refused" in err
    assert "exiting with code 7: a code without a name" in err
    assert worker_exit.describe(p.ExitCode.FAILED) == "1 (FAILED)"

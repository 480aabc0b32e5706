"""tmctl.warm_start: processes forked from one warm image, with their exit codes, signals and refusals; and the
fork server a process forked that way makes by forking itself (tmd.local.ForkServer)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from tmctl import warm_start
from tmctl.localjob import wait_until

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def starter():
    s = warm_start.WarmStarter()
    yield s
    s.close()


def target(*args: str) -> list[str]:
    return [sys.executable, "-m", "tests.unit.warm_target", *args]


def seen(log) -> dict:
    return json.loads(log.read_text().splitlines()[0])


def test_a_forked_process_runs_as_a_fresh_one_and_reports_its_exit_code(starter, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    log = tmp_path / "out.log"
    proc = starter.start(target("exit", "3"), str(log))
    assert proc is not None
    assert proc.wait(timeout=60) == 3 and proc.poll() == 3
    got = seen(log)
    assert got["argv"] == ["exit", "3"] and got["cwd"] == REPO and got["name"] == "tmd"
    assert got["torch_loaded"]  # the image: nothing to import
    assert got["threads"] == 1  # what lets it fork a fork server of its own


def test_a_signal_is_its_exit_code_and_terminate_ends_it(starter, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    log = tmp_path / "out.log"
    proc = starter.start(target("hang", "0"), str(log))
    wait_until(lambda: "hanging" in log.read_text() if log.exists() else False, 30, "the process to start")
    assert proc.poll() is None
    proc.kill()
    assert proc.wait(timeout=30) == -signal.SIGKILL
    proc.kill()  # ended: nothing is signalled (its pid may be another process's by now)


def test_another_environment_or_interpreter_is_not_forked(starter, monkeypatch):
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("WARM_PROBE", "1")  # torch and tmd read some variables at import: never guessed
    assert starter.start(target("exit", "0")) is None
    monkeypatch.delenv("WARM_PROBE")
    assert starter.start(["/bin/sh", "-c", "exit 0"]) is None
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "changes with every test")  # volatile: still forked
    proc = starter.start(target("exit", "0"))
    assert proc is not None and proc.wait(timeout=60) == 0


def test_a_forked_process_forks_its_fork_server_from_itself(starter, tmp_path, monkeypatch):
    """What makes a warm tmd fast: its launcher's fork server is a fork of it (no import), and the ranks are forked
    from that server. A process with threads (this one) starts ``python -m worker.fork_server`` instead."""
    monkeypatch.chdir(REPO)
    log = tmp_path / "out.log"
    proc = starter.start(target("launch", str(tmp_path / "run")), str(log))
    assert proc.wait(timeout=120) == 0, log.read_text()
    report = json.loads(log.read_text().splitlines()[-1])
    assert report == {"server_forked": True, "ranks_forked": True, "codes": [7, 7]}, report
    assert "image inherited" in (tmp_path / "run" / "logs" / "fork-server.log").read_text()


def test_start_tmd_falls_back_to_popen_when_not_enabled(monkeypatch):
    monkeypatch.setattr(warm_start, "_enabled", None)
    proc = warm_start.start_tmd([sys.executable, "-c", "raise SystemExit(5)"])
    assert isinstance(proc, subprocess.Popen) and proc.wait(timeout=60) == 5


def test_each_fork_preload_gets_a_starter_whose_tmd_forks_a_server_holding_those_modules(tmp_path, monkeypatch):
    """A job with ``TM_FORK_PRELOAD`` (torchtitan's image in tests/e2e/test_torchtitan.py) is forked from a starter
    of its own that imported those modules too: its fork server is then a fork of it as well (``image inherited``,
    which needs every preloaded module imported). Any other change of the environment starts tmd cold."""
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(warm_start, "_starters", {})
    warm_start.enable()
    try:
        monkeypatch.setenv("TM_FORK_PRELOAD", "graphlib")
        log = tmp_path / "out.log"
        proc = warm_start.start_tmd(target("launch", str(tmp_path / "run")), str(log))
        assert isinstance(proc, warm_start.WarmProcess) and proc.wait(timeout=120) == 0, log.read_text()
        assert json.loads(log.read_text().splitlines()[-1])["server_forked"] is True
        assert "image inherited" in (tmp_path / "run" / "logs" / "fork-server.log").read_text()
        assert list(warm_start._starters) == ["graphlib"]
        monkeypatch.setenv("WARM_PROBE", "1")
        cold = warm_start.start_tmd(target("exit", "4"))
        assert isinstance(cold, subprocess.Popen) and cold.wait(timeout=60) == 4
        assert list(warm_start._starters) == ["graphlib"]
    finally:
        for s in warm_start._starters.values():
            s.close()
        monkeypatch.setattr(warm_start, "_enabled", None)

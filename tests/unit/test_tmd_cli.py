"""tmd's command line as a user types it (issue 37): an unknown option or a command that cannot be started is
refused in one line, ``error: ...`` on stderr, exit 2, before anything starts; everything after ``--`` is the
job's command, unchanged."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import psutil
import pytest

from tmd.cli import unstartable
from tmd.protocol.vocab import ExitCode


def tmd_local(run_dir, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "tmd.cli", "local", "--nodes", "1", "--ranks-per-node", "1",
                           "--standbys", "0", "--run-dir", str(run_dir), *args],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return done, time.monotonic() - started


def nothing_runs_in(run_dir) -> bool:
    """No process has ``run_dir`` on its command line or as its working directory."""
    for p in psutil.process_iter(["cmdline", "cwd"]):
        try:
            if str(run_dir) in " ".join(p.info["cmdline"] or ()) or p.info["cwd"] == str(run_dir):
                return False
        except psutil.Error:
            continue
    return True


@pytest.mark.parametrize("typo,named,suggested", [(["--bogus-flag", "3"], "--bogus-flag", None),
                                                  (["--standby", "1"], "--standby", "--standbys")])
def test_an_unknown_option_is_refused_in_one_line_before_anything_starts(tmp_path, typo, named, suggested):
    run_dir = tmp_path / "run"
    done, took_s = tmd_local(run_dir, *typo, "--", sys.executable, "-c", "pass")
    assert done.returncode == ExitCode.REFUSED, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: No such option: {named}"), done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    if suggested:
        assert suggested in lines[0]
    assert took_s < 5.0, took_s
    assert not run_dir.exists() and nothing_runs_in(run_dir)


def test_a_command_that_cannot_start_is_refused_and_the_run_directory_says_why(tmp_path):
    run_dir = tmp_path / "run"
    # what follows -- is the job's, options included: it is not parsed as tmd's
    done, took_s = tmd_local(run_dir, "--", "/no/such/binary", "--bogus-flag", "3")
    assert done.returncode == ExitCode.REFUSED, done
    assert done.stderr.strip().splitlines() == [
        "error: the job's command '/no/such/binary' was not found: nothing was started (the job's command comes "
        "after --)"], done.stderr
    assert took_s < 5.0, took_s
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert [(e["event"], e["command"]) for e in events] == [("job_refused", ["/no/such/binary", "--bogus-flag", "3"])]
    assert nothing_runs_in(run_dir)



@pytest.mark.parametrize("link", ["events.jsonl", "keys", "logs", "logs/n1.0.log"])
def test_a_run_directory_with_a_symlink_where_tmd_writes_is_refused_in_one_line(tmp_path, link):
    """A journal, keys or logs directory, or log that is a symlink: one line naming it, exit 2, nothing started (a
    90-line traceback of ELOOP before; a symlinked logs/ was followed)."""
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True, mode=0o700)
    os.chmod(run_dir, 0o700)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    if link == "logs":
        (run_dir / "logs").rmdir()
    os.symlink(elsewhere if link in ("keys", "logs") else elsewhere / "file", run_dir / link)
    done, _ = tmd_local(run_dir, "--", sys.executable, "-c", "pass")
    assert done.returncode == ExitCode.REFUSED, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and f"{run_dir / link} is a symlink: refusing it" in \
        lines[0], done.stderr
    assert "Traceback" not in done.stdout and os.listdir(elsewhere) == [] and nothing_runs_in(run_dir)


def test_unstartable_names_what_is_wrong(tmp_path):
    script = tmp_path / "train.sh"
    script.write_text("#!/bin/sh\n")
    assert "is not executable" in unstartable([str(script)])
    script.chmod(0o755)
    assert unstartable([str(script), "--anything"]) is None
    assert "was not found on PATH" in unstartable(["no-such-program-tm", "x"])
    assert "was not found" in unstartable([str(tmp_path / "missing")])
    assert unstartable([sys.executable, "-m", "examples.train_gpt"]) is None
    assert unstartable(["sh", "-c", "true"]) is None


def test_the_ranks_files_are_the_users_only(tmp_path):
    """Every process tmd local starts, the first ones forked from the fork server made before the daemon included,
    runs with umask 077 (the run dir's files, checkpoints and shared-memory segments are the user's only)."""
    script = tmp_path / "umask_probe.py"
    script.write_text("import os, sys\nopen(sys.argv[1] + '.' + os.environ['TM_LOCAL_RANK'], 'w').write("
                      "oct(os.umask(0)))\n")
    probe = tmp_path / "umask"
    done, _ = tmd_local(tmp_path / "run", "--nodes", "1", "--ranks-per-node", "2", "--standbys", "0", "--quiet", "--",
                        sys.executable, str(script), str(probe))
    assert done.returncode != 0  # they exited before worker.init: tmd fails the job, and that is all
    assert [(tmp_path / f"umask.{r}").read_text() for r in (0, 1)] == ["0o77", "0o77"]


@pytest.mark.skipif(not __import__("tmd.netns").netns.available(), reason="needs root, ip and tc for namespaces")
def test_a_job_with_checkpoints_starts_in_network_namespaces(tmp_path):
    """tmd enters its namespace (--netns-all, which needs a single-threaded process) before the checkpoint tier
    imports torch, whose native thread would stay behind: tmd refused to start such a job before (exit 1)."""
    script = tmp_path / "where_probe.py"
    script.write_text("import os, sys\nopen(sys.argv[1], 'w').write(os.environ['TM_GLOO_HOST'])\n")
    probe = tmp_path / "where"
    done, _ = tmd_local(tmp_path / "run", "--netns-all", "--checkpoint-dir", str(tmp_path / "ckpt"), "--quiet", "--",
                        sys.executable, str(script), str(probe))
    assert "single-threaded" not in done.stderr, done.stderr[-2000:]
    assert probe.read_text().startswith("10.214."), done.stderr[-2000:]  # the rank ran on its node's bridge address
    with open(tmp_path / "run" / "tmd.json") as f:
        assert json.load(f)["address"].startswith("tcp://10.214.")  # and tmd in a namespace of its own

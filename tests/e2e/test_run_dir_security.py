"""Another local user's run directory, and the keys a rank gets (issue 33, holes 1 and 3), end to end.

Each attack is played as issue 33 reproduced it, by uid nobody, against ``tmd`` run by root (the tests run as
root):

* nobody plants a run directory in /tmp whose ``tmd.json`` and ``events.jsonl`` are symlinks to root's files:
  ``tmd local --run-dir`` refuses it in one line (exit 2) and writes neither file;
* nobody writes a fake crashed job (its own command, a journal, keys it generated): ``tmd resume --run-dir``
  refuses it in one line (exit 2) and the planted command never runs (its marker file is never created);
* a rank's script reads ``TM_KEYS`` and finds the worker key pair, tmd's public key and the job secret, and no
  client, hook or coordinator secret key (one short job: the script exits without registering).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from tmd.protocol.vocab import Event, ExitCode

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="plays uid nobody against root's tmd: needs root")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TMD = [sys.executable, "-m", "tmd.cli"]

# Run by nobody: a run directory as issue 33's attacker made it.
PLANT = r"""
import json, os, sys
from tmd.protocol.keys import JobKeys
how, d = sys.argv[1], sys.argv[2]
os.mkdir(d, 0o755)
if how == "symlinks":  # tmd.json and events.jsonl point at root's files
    os.symlink(sys.argv[3], os.path.join(d, "tmd.json"))
    os.symlink(sys.argv[4], os.path.join(d, "events.jsonl"))
else:  # a fake crashed job running nobody's command
    os.chmod(d, 0o700)
    with open(os.path.join(d, "tmd.json"), "w") as f:
        json.dump({"address": "tcp://127.0.0.1:1", "pid": 999999999, "job": "fake", "keys": os.path.join(d, "keys"),
                   "run_dir": d, "command": ["sh", "-c", "touch " + sys.argv[3]], "cwd": "/"}, f)
    with open(os.path.join(d, "events.jsonl"), "w") as f:
        f.write(json.dumps({"seq": 1, "ts": 1.0, "event": "tmd_started", "job": "fake", "world_size": 1,
                            "nodes": ["n1"], "standbys": ["s1"], "store_port": 1, "record_steps": 3}) + "\n")
    JobKeys.create(os.path.join(d, "keys"))
"""


def as_nobody(*argv: str) -> None:
    subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", *argv], check=True,
                   capture_output=True, text=True, timeout=60, cwd="/", env={**os.environ, "PYTHONPATH": REPO})


@pytest.fixture
def planted(request):
    """plant(how, *args) -> the path of a run directory uid nobody made in /tmp (removed after the test)."""
    made = []

    def plant(how: str, *args: str) -> str:
        d = os.path.join(tempfile.gettempdir(), f"tm-planted-{os.getpid()}-{len(made)}")
        made.append(d)
        as_nobody(sys.executable, "-c", PLANT, how, d, *args)
        return d

    yield plant
    for d in made:
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.timeout(60)
def test_tmd_local_refuses_a_run_directory_nobody_planted(planted, tmp_path):
    victims = [tmp_path / "roots-config", tmp_path / "roots-log"]
    for v in victims:
        v.write_text("root's own\n")
    run_dir = planted("symlinks", *map(str, victims))
    r = subprocess.run([*TMD, "local", "--run-dir", run_dir, "--nodes", "1", "--ranks-per-node", "1",
                        "--standbys", "0", "--", "true"], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == ExitCode.REFUSED, r
    assert r.stderr.count("\n") == 1 and f"run directory {run_dir} belongs to uid 65534" in r.stderr, r.stderr
    assert [v.read_text() for v in victims] == ["root's own\n"] * 2
    assert sorted(os.listdir(run_dir)) == ["events.jsonl", "tmd.json"]  # nothing made there


@pytest.mark.timeout(60)
def test_tmd_resume_refuses_nobodys_fake_job_and_runs_nothing(planted, tmp_path):
    marker = tmp_path / "ran-as-root"
    run_dir = planted("fake-job", str(marker))
    r = subprocess.run([*TMD, "resume", "--run-dir", run_dir], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == ExitCode.REFUSED, r
    assert r.stderr.count("\n") == 1, r.stderr
    assert f"refusing to resume: run directory {run_dir} belongs to uid 65534" in r.stderr, r.stderr
    assert not marker.exists(), "nobody's command ran as root"
    with open(os.path.join(run_dir, "events.jsonl")) as f:
        assert [json.loads(line)["event"] for line in f] == [Event.TMD_STARTED]  # nothing journalled there


# Run by the job's one rank: what TM_KEYS hands it (then it exits without registering: the job ends at once).
PEEK = r"""
import json, os
d = os.environ["TM_KEYS"]
print("TM_KEYS " + json.dumps({"dir": d, "files": sorted(os.listdir(d))}), flush=True)
"""


@pytest.mark.timeout(90)
def test_a_ranks_script_finds_only_the_worker_keys_in_tm_keys(tmp_path):
    run_dir = tmp_path / "job"
    r = subprocess.run([*TMD, "local", "--run-dir", str(run_dir), "--nodes", "1", "--ranks-per-node", "1",
                        "--standbys", "0", "--quiet", "--", sys.executable, "-c", PEEK],
                       capture_output=True, text=True, timeout=90, cwd=REPO)
    assert "before worker.init() registered" in r.stderr, r  # it ran, and ended the job as expected
    with open(run_dir / "logs" / "n1.0.log") as f:
        seen = json.loads(next(line for line in f if line.startswith("TM_KEYS "))[len("TM_KEYS "):])
    assert seen["files"] == ["coordinator.key", "secret", "worker.key", "worker.key_secret"], seen
    assert seen["dir"] == str(run_dir / "keys" / "worker")
    for party in ("client", "hook", "coordinator"):  # still in the job's keys directory, for tmctl, hooks, tmd
        assert os.path.exists(run_dir / "keys" / f"{party}.key_secret")

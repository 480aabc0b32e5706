"""Paths only the job's user can change (tmd.rundir, issue 33): the run directory, files written without following
symlinks, what ``tmd resume`` accepts, the keys a rank gets, and the SLURM hooks acting as the job's user.
Other users are played by chown to uid nobody (the tests run as root); skipped otherwise."""
from __future__ import annotations

import errno
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import pytest

from tmd.journal import Journal
from tmd.protocol.keys import WORKER_DIR, JobKeys, KeysUnavailable
from tmd.protocol.vocab import Event, Sender
from tmd.resume import ResumeError, load
from tmd.rundir import (SECRET, UnsafePath, check_file, check_run_dir, no_follow, private_dir, trusted_dir,
                        write_atomic)

pytestmark = [pytest.mark.timeout(20),
              pytest.mark.skipif(os.geteuid() != 0, reason="plays another user by chown: needs root")]
NOBODY = 65534
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def mode(path) -> int:
    return os.lstat(path).st_mode & 0o7777


def test_a_missing_run_directory_is_made_0700_with_its_parents(tmp_path):
    real = private_dir(str(tmp_path / "a" / "run"), "run directory")
    assert real == str(tmp_path / "a" / "run")
    assert mode(tmp_path / "a") == 0o700 and mode(real) == 0o700


def test_a_directory_of_another_user_is_refused_in_one_line(tmp_path):
    planted = tmp_path / "planted"
    planted.mkdir(mode=0o755)
    os.chown(planted, NOBODY, NOBODY)
    with pytest.raises(UnsafePath, match=r"run directory .*planted belongs to uid 65534 .*not to you") as e:
        private_dir(str(planted), "run directory")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("bits", [0o777, 0o770, 0o702])
def test_a_directory_writable_by_group_or_others_is_refused(tmp_path, bits):
    d = tmp_path / "loose"
    d.mkdir()
    os.chmod(d, bits)
    with pytest.raises(UnsafePath, match=f"has mode {bits:04o}"):
        private_dir(str(d))


def test_a_parent_another_user_could_change_is_refused_unless_sticky(tmp_path):
    parent = tmp_path / "shared"
    parent.mkdir()
    os.chmod(parent, 0o777)
    with pytest.raises(UnsafePath, match="could replace what is below it"):
        private_dir(str(parent / "run"))
    os.chmod(parent, 0o1777)  # as /tmp: others cannot rename what they do not own
    assert private_dir(str(parent / "run")) == str(parent / "run")
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, NOBODY, NOBODY)
    with pytest.raises(UnsafePath, match="belongs to uid 65534"):
        private_dir(str(theirs / "run"))


def test_a_symlinked_run_directory_resolves_once_and_is_refused_where_tmd_made_it(tmp_path):
    (tmp_path / "real").mkdir(mode=0o700)
    os.symlink(tmp_path / "real", tmp_path / "link")
    assert private_dir(str(tmp_path / "link")) == str(tmp_path / "real")  # then used through the real path
    with pytest.raises(UnsafePath, match="is a symlink"):
        private_dir(str(tmp_path / "link"), create=False)
    with pytest.raises(UnsafePath, match="does not exist"):
        private_dir(str(tmp_path / "missing"), create=False)


def test_check_file_refuses_symlinks_other_owners_and_loose_modes(tmp_path):
    f = tmp_path / "f"
    f.write_text("x")
    os.chmod(f, 0o644)
    check_file(str(f))
    os.symlink(f, tmp_path / "s")
    with pytest.raises(UnsafePath, match="is a symlink"):
        check_file(str(tmp_path / "s"))
    os.chmod(f, 0o664)
    with pytest.raises(UnsafePath, match="has mode 0664"):
        check_file(str(f))
    os.chmod(f, 0o640)
    with pytest.raises(UnsafePath, match="has mode 0640"):
        check_file(str(f), loose=SECRET)
    os.chmod(f, 0o600)
    os.chown(f, NOBODY, NOBODY)
    with pytest.raises(UnsafePath, match="belongs to uid 65534"):
        check_file(str(f))


def test_trusted_dir_accepts_roots_and_refuses_a_world_writable_one(tmp_path):
    assert trusted_dir(REPO) == os.path.realpath(REPO)
    d = tmp_path / "w"
    d.mkdir()
    os.chmod(d, 0o1777)  # sticky or not: anyone may add a module there
    with pytest.raises(UnsafePath, match="has mode 1777"):
        trusted_dir(str(d))


def test_files_are_never_written_through_a_symlink(tmp_path):
    target = tmp_path / "roots-file"
    target.write_text("root's\n")
    os.symlink(target, tmp_path / "events.jsonl")
    with pytest.raises(OSError) as e:
        Journal(str(tmp_path / "events.jsonl"))
    assert e.value.errno == errno.ELOOP
    with pytest.raises(OSError):
        open(tmp_path / "events.jsonl", "ab", opener=no_follow)
    os.symlink(target, tmp_path / "tmd.json")
    write_atomic(str(tmp_path / "tmd.json"), b"{}")  # the link is replaced, its target untouched
    assert target.read_text() == "root's\n"
    assert not os.path.islink(tmp_path / "tmd.json") and mode(tmp_path / "tmd.json") == 0o600



def used_run_dir(run_dir) -> str:
    """A run directory as a job leaves it: tmd.json, journal, keys, a recording and the logs."""
    os.makedirs(os.path.join(run_dir, "record"), mode=0o700)
    os.makedirs(os.path.join(run_dir, "logs"), mode=0o700)
    for name in ("tmd.json", "events.jsonl", "record/rank0.world.pt", "logs/n1.0.log", "logs/fork-server.log"):
        write_atomic(os.path.join(run_dir, name), b"x")
    JobKeys.create(os.path.join(run_dir, "keys")).worker_keys()
    return str(run_dir)


def swap_for_symlink(run_dir: str, rel: str) -> None:
    """``rel`` (a file or directory of ``run_dir``) moved out of the run directory, a symlink to it in its place."""
    aside = os.path.join(run_dir + ".aside", os.path.basename(rel))
    os.makedirs(os.path.dirname(aside), exist_ok=True)
    os.rename(os.path.join(run_dir, rel), aside)
    os.symlink(aside, os.path.join(run_dir, rel))


@pytest.mark.parametrize("plant, why", [
    (lambda d: swap_for_symlink(d, "events.jsonl"), "journal .*/events.jsonl is a symlink"),
    (lambda d: swap_for_symlink(d, "keys"), "keys directory .*/keys is a symlink"),
    (lambda d: swap_for_symlink(d, os.path.join("keys", WORKER_DIR)), "keys directory .*/keys/worker is a symlink"),
    (lambda d: swap_for_symlink(d, "logs"), "logs directory .*/logs is a symlink"),
    (lambda d: swap_for_symlink(d, "logs/n1.0.log"), "log file .*/logs/n1.0.log is a symlink"),
    (lambda d: os.symlink("/etc/passwd", os.path.join(d, "logs", "n2.0.log")), "log file .*/n2.0.log is a symlink"),
    (lambda d: os.mkfifo(os.path.join(d, "logs", "n2.0.log")), "log file .*/n2.0.log is not a regular file"),
    (lambda d: swap_for_symlink(d, "record"), "recordings directory .*/record is a symlink"),
    (lambda d: os.chown(os.path.join(d, "logs"), NOBODY, NOBODY), "logs directory .*/logs belongs to uid 65534"),
    (lambda d: os.chmod(os.path.join(d, "logs"), 0o777), "logs directory .*/logs has mode 0777"),
    (lambda d: os.chown(os.path.join(d, "record", "rank0.world.pt"), NOBODY, NOBODY), "recording .* belongs to"),
])
def test_a_run_directory_whose_files_or_subdirectories_lead_elsewhere_is_refused(tmp_path, plant, why):
    """O_NOFOLLOW covers a path's last component only: a symlinked logs/ (or keys/, record/) would have every file
    in it written elsewhere. tmd local and tmd slurm refuse such a run directory (check_run_dir) in one line."""
    run_dir = used_run_dir(tmp_path / "run")
    check_run_dir(run_dir)  # as a job leaves it: accepted
    plant(run_dir)
    with pytest.raises(UnsafePath, match=why):
        check_run_dir(run_dir)


# --- tmd resume ---------------------------------------------------------------------------------------------------
def fake_job(run_dir, cwd: str = REPO) -> str:
    """A crashed job's run directory as tmd leaves it (tmd.json with its command, a journal, keys)."""
    os.makedirs(run_dir, mode=0o700)
    write_atomic(os.path.join(run_dir, "tmd.json"), json.dumps(
        {"address": "tcp://127.0.0.1:5555", "pid": 999_999_999, "job": "j", "keys": os.path.join(run_dir, "keys"),
         "command": ["touch", "/tmp/marker"], "cwd": cwd}).encode())
    with open(os.path.join(run_dir, "events.jsonl"), "w") as f:
        f.write(json.dumps({"seq": 1, "ts": 1.0, "event": Event.TMD_STARTED, "job": "j", "world_size": 2,
                            "nodes": ["n1"], "standbys": [], "store_port": 1, "record_steps": 3}) + "\n")
    JobKeys.create(os.path.join(run_dir, "keys")).worker_keys()
    return str(run_dir)


def test_resume_accepts_the_users_own_job(tmp_path):
    st = load(fake_job(tmp_path / "job"))
    assert st.command == ["touch", "/tmp/marker"] and st.run_dir == str(tmp_path / "job")


@pytest.mark.parametrize("plant, why", [
    (lambda d: os.chown(d, NOBODY, NOBODY), "run directory .* belongs to uid 65534"),
    (lambda d: os.chmod(d, 0o777), "run directory .* has mode 0777"),
    (lambda d: os.chown(os.path.join(d, "tmd.json"), NOBODY, NOBODY), "tmd.json .* belongs to uid 65534"),
    (lambda d: os.chmod(os.path.join(d, "events.jsonl"), 0o666), "journal .* has mode 0666"),
    (lambda d: (os.rename(os.path.join(d, "tmd.json"), os.path.join(d, "x")),
                os.symlink(os.path.join(d, "x"), os.path.join(d, "tmd.json"))), "tmd.json .* is a symlink"),
    (lambda d: os.chmod(os.path.join(d, "keys"), 0o755), "keys directory .* has mode 0755"),
    (lambda d: os.chown(os.path.join(d, "keys", "client.key_secret"), NOBODY, NOBODY), "key file .* belongs to"),
    (lambda d: os.chmod(os.path.join(d, "keys", WORKER_DIR, "secret"), 0o644), "key file .* has mode 0644"),
    (lambda d: (os.rename(os.path.join(d, "keys"), os.path.join(d, "k")),
                os.symlink(os.path.join(d, "k"), os.path.join(d, "keys"))), "keys directory .* is a symlink"),
    (lambda d: (os.mkdir(os.path.join(d, "elsewhere")), os.symlink(os.path.join(d, "elsewhere"),
                                                                    os.path.join(d, "logs"))),
     "logs directory .* is a symlink"),
])
def test_resume_refuses_a_job_it_did_not_make(tmp_path, plant, why):
    run_dir = fake_job(tmp_path / "job")
    plant(run_dir)
    with pytest.raises(ResumeError, match="refusing to resume: " + why):
        load(run_dir)


def test_resume_refuses_to_run_the_command_in_a_directory_others_can_write(tmp_path):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    os.chmod(cwd, 0o777)
    with pytest.raises(ResumeError, match="refusing to run the job's command: the job's working directory .* "
                                          "has mode 0777"):
        load(fake_job(tmp_path / "job", cwd=str(cwd)))


# --- least-privilege keys ---------------------------------------------------------------------------------------
def test_a_rank_gets_the_worker_pair_tmds_public_key_and_the_secret_only(tmp_path):
    keys = JobKeys.create(str(tmp_path / "keys"))
    d = keys.worker_keys()
    assert sorted(os.listdir(d)) == ["coordinator.key", "secret", "worker.key", "worker.key_secret"]
    assert mode(d) == 0o700 and all(mode(os.path.join(d, n)) == 0o600 for n in os.listdir(d))
    worker = JobKeys.load(d)
    assert worker.secret == keys.secret and worker.public(Sender.COORDINATOR) == keys.public(Sender.COORDINATOR)
    assert worker.role_of(keys.public(Sender.WORKER)) == Sender.WORKER
    import zmq
    sock = zmq.Context.instance().socket(zmq.DEALER)
    try:
        worker.connect_as(sock, Sender.WORKER)
        for party in (Sender.CLIENT, Sender.HOOK, Sender.COORDINATOR):
            with pytest.raises(KeysUnavailable):
                worker.connect_as(sock, party)
    finally:
        sock.close(0)


# --- the SLURM epilog ---------------------------------------------------------------------------------------------
def test_the_epilog_reads_the_users_tmd_json_and_keys_as_the_user(tmp_path, request):
    """A job user's tmd.json naming root's keys (another job's) as its own: the epilog, dropped to the user's
    ids, cannot read them, so it sends no notice with them."""
    roots = JobKeys.create(str(tmp_path / "roots" / "keys"))
    top = tempfile.mkdtemp(prefix="tm-epilog-", dir="/tmp")  # where nobody can reach its state dir (pytest's is root's, 0700)
    os.chmod(top, 0o755)
    request.addfinalizer(lambda: shutil.rmtree(top))
    state = pathlib.Path(top) / "state"
    job = state / "jobs" / "5"
    job.mkdir(parents=True)
    for d in (state, state / "jobs", job):
        os.chown(d, NOBODY, NOBODY)
    (job / "tmd.json").write_text(json.dumps({"address": "tcp://127.0.0.1:9", "keys": roots.path}))
    os.chown(job / "tmd.json", NOBODY, NOBODY)
    env = {"SLURM_JOB_ID": "5", "SLURM_JOB_UID": str(NOBODY), "SLURM_JOB_GID": str(NOBODY), "SLURMD_NODENAME": "x"}
    r = subprocess.run([sys.executable, "-I", os.path.join(REPO, "slurm", "hooks.py"), "epilog", "--state-dir",
                        str(state), "--log", str(tmp_path / "log")], env=env, capture_output=True, text=True,
                       timeout=20)
    assert r.returncode == 0, r.stderr
    report = json.loads((tmp_path / "log").read_text())
    assert "failed: cannot read the job's keys" in report.get("notice", ""), report  # as root: "notice sent"
    assert os.stat(job / "hooks" / "epilog.x.json").st_uid == NOBODY  # the report too, as the user

"""The checkpoint tier end to end (issue 31): checkpoints the ranks write themselves, a restart of every process from
the newest valid one when in-memory recovery is impossible, and ``--resume-from``; local mode, 2 nodes x 2 ranks,
a tiny GPT with dropout drawn from per-rank RNG streams, so a lost RNG state or data position shows in the hashes.

Every job is compared, rank by rank, with one uninterrupted run (module-scoped): the final parameter and optimizer
hash (``state_sha256``) and the CPU RNG state's hash (``rng_sha256``). Launches are few: one job goes through a save
whose directory cannot be made (a failed save: journalled, training goes on, nothing deleted), a torn save and a
corrupted newest checkpoint, and the loss of every active node at once; a second job resumes from its checkpoints
after it ended; a third, of another layout, is refused; one with no standby at all loses a node and restarts once
``--standby-wait-s`` passed. A fifth job, TP x FSDP2 (examples.train_llama on 4 nodes
of 1 rank: no state has a replica), loses a node together with the node that keeps its buddy snapshots and is
compared with an uninterrupted run of its own.
"""
from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys

import pytest

from tmctl.localjob import Job, events, final_hashes, reference_hashes, wait_until
from worker import checkpoint as ck

STEPS = 40
EVERY = 5
NUMERICS = ("--dropout", "0.1", "--seed-mode", "per-rank")  # the RNG matters: every rank draws its own masks
PADDING = ("--min-step-time-s", "0.2")  # time to act between checkpoints; the numerics are the reference's


def finals(run_dir: str) -> dict[int, tuple[str, str]]:
    """{rank: (state_sha256, rng_sha256)} of a finished job."""
    return final_hashes(run_dir, rng=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, tuple[str, str]]:
    run_dir = str(tmp_path_factory.mktemp("uninterrupted"))
    reference_hashes(run_dir, STEPS, NUMERICS)
    out = finals(run_dir)
    assert len(out) == 4 and len({s for s, _ in out.values()}) == 1 and len({r for _, r in out.values()}) == 4
    return out


def manifest_of(root: str, step: int) -> str:
    return os.path.join(ck.step_dir(root, step), ck.MANIFEST)


def valid(root: str) -> list[tuple[int, str]]:
    return [(s, path) for s, path in ck.checkpoints(root) if ck.verify(path)[0] is None]


@pytest.fixture(scope="module")
def chaos(tmp_path_factory, reference):
    """One job: a save into an unwritable directory fails (and the job trains on), then every active rank is
    frozen, the newest valid checkpoint corrupted, a torn save of a later step left behind, and every active
    process killed. tmd must restart the whole job from the checkpoint before the corrupted one."""
    base = tmp_path_factory.mktemp("chaos")
    root = str(base / "ckpt")
    blocked = ck.step_dir(root, 2 * EVERY)
    os.makedirs(root)
    with open(blocked, "w") as f:  # the second save cannot make its directory (as an unwritable one, even as root)
        f.write("in the way")
    job = Job(str(base / "job"), 1, STEPS, *NUMERICS, *PADDING,
              tmd_args=("--checkpoint-dir", root, "--checkpoint-every", str(EVERY)))
    try:
        failed = job.wait_event("checkpoint_failed", timeout_s=120)
        first_intact = ck.verify(ck.step_dir(root, EVERY))[0] is None
        os.remove(blocked)
        status = job.tmctl("status")
        later = failed_step = int(failed["message"].split()[3])
        wait_until(lambda: os.path.exists(manifest_of(root, later + EVERY)), 120, "a checkpoint after the failed one",
                   poll_s=0.02)
        active = job.pids("n1") + job.pids("n2")
        for pid in active:  # freeze the job where it is (a save in flight stops with it)
            os.kill(pid, signal.SIGSTOP)
        kept = valid(root)
        corrupted = kept[0][1]
        data = sorted(glob.glob(os.path.join(corrupted, "__*.distcp")))[0]
        with open(data, "r+b") as f:
            byte = f.read(1)
            f.seek(0)
            f.write(bytes([byte[0] ^ 0xFF]))
        torn = ck.step_dir(root, kept[0][0] + EVERY)
        os.makedirs(torn, exist_ok=True)  # a save that died half-way: data but no manifest
        with open(os.path.join(torn, "__0_0.distcp"), "wb") as f:
            f.write(b"half a shard")
        for pid in active:
            os.kill(pid, signal.SIGKILL)
        job.end_padding()  # the faults are over: the relaunched job at its own speed
        rc = job.finish(timeout_s=300)
    finally:
        job.close()
    return {"job": job, "root": root, "rc": rc, "failed": failed, "failed_step": failed_step, "status": status,
            "first_intact": first_intact, "kept": kept, "corrupted": corrupted, "torn": torn}


@pytest.mark.timeout(600)
def test_every_active_node_lost_restarts_from_the_checkpoint_before_a_corrupted_one(chaos, reference):
    job, kept = chaos["job"], chaos["kept"]
    assert chaos["rc"] == 0, [e for e in events(job.run_dir) if e["event"] in ("job_failed", "recovery_failed")]
    (restart,) = job.events("job_restarting")
    assert restart["tier"] == "checkpoint" and restart["step"] == kept[1][0] and restart["path"] == kept[1][1]
    assert "every rank is lost" in restart["reason"] or "no surviving replica" in restart["reason"], restart
    assert restart["work_lost_s"] > 0
    refused = [e["message"] for e in job.events("checkpoint_refused")]
    assert f"checkpoint {chaos['torn']} refused: no manifest (a torn or unfinished save)" in refused
    assert any(m.startswith(f"checkpoint {chaos['corrupted']} refused: __") and "does not match its sha256" in m
               for m in refused), refused
    assert finals(job.run_dir) == reference
    assert not job.events("job_failed")
    # the relaunched job rewrote the torn and the corrupted steps and committed its last checkpoint
    assert [s for s, _ in valid(chaos["root"])] == [STEPS, STEPS - EVERY]
    # one fork server for both launches: the relaunch forked its ranks from the image the first launch made
    with open(os.path.join(job.run_dir, "logs", "fork-server.log")) as f:
        assert f.read().count("[fork-server] image") == 1


def test_a_failed_save_is_journalled_shown_and_deletes_nothing(chaos):
    failed = chaos["failed"]
    assert failed["message"].startswith(f"checkpoint at step {chaos['failed_step']} not saved")
    assert "NotADirectoryError" in failed["message"] and "\n" not in failed["message"]
    assert chaos["first_intact"]
    out = " ".join(chaos["status"].stdout.split())  # (rich wraps long lines)
    assert chaos["status"].returncode == 0 and "checkpoint_failed" in out and "training goes on" in out, out
    # and training went on: the failed step was not the last checkpoint written
    assert any(e["step"] > chaos["failed_step"] for e in chaos["job"].events("checkpoint_committed"))


@pytest.mark.timeout(300)
def test_resume_from_after_the_job_ended_is_bit_identical(chaos, reference, tmp_path):
    source = ck.step_dir(chaos["root"], STEPS - EVERY)
    job = Job(str(tmp_path / "resumed"), 0, STEPS, *NUMERICS, tmd_args=("--resume-from", source))
    assert job.finish() == 0
    assert finals(job.run_dir) == reference
    steps = [step for e in job.events("step_times") for step, _, _ in e["steps"]]
    assert min(steps) == STEPS - EVERY  # it started at the checkpoint's step, not at 0


@pytest.mark.timeout(300)
def test_no_standby_within_standby_wait_s_restarts_from_the_checkpoint(reference, tmp_path):
    """No standby at all: a node lost after the first checkpoint leaves the incident waiting for one; after
    ``--standby-wait-s`` it fails and the job restarts every process from the checkpoint, bit-identical."""
    root = str(tmp_path / "ckpt")
    job = Job(str(tmp_path / "job"), 0, STEPS, *NUMERICS, *PADDING,
              tmd_args=("--checkpoint-dir", root, "--checkpoint-every", str(EVERY), "--standby-wait-s", "1"))
    try:
        job.wait_event("checkpoint_committed", timeout_s=120)
        killed = job.pids("n2")
        for pid in killed:
            os.kill(pid, signal.SIGKILL)
        job.wait_event("job_restarting", timeout_s=60)
        job.end_padding()
        rc = job.finish(timeout_s=300)
    finally:
        job.close()
    assert rc == 0, [e for e in job.events() if e["event"] in ("job_failed", "recovery_failed")]
    assert sorted(e["returncode"] for e in job.events("process_exit") if e["node"] == "n2")[:2] == [-9, -9]
    (waiting,) = job.events("recovery_waiting")
    (failed,) = job.events("recovery_failed")
    assert failed["reason"] == "no standby arrived within 1 s (--standby-wait-s)", failed
    (restart,) = job.events("job_restarting")
    assert restart["tier"] == "checkpoint" and "--standby-wait-s" in restart["reason"], restart
    assert restart["ts"] - waiting["ts"] >= 1.0 and restart["step"] % EVERY == 0
    assert finals(job.run_dir) == reference
    # the relaunch kept the page's address (a Prometheus scrape config points there) and shows no port the user
    # did not set among its settings
    pages = [e["page"] for e in job.events("tmd_started")]
    assert len(pages) == 2 and pages[0] == pages[1] and pages[0], pages
    assert all(e["config"]["serve"]["port"] == 0 for e in job.events("job_config")), job.events("job_config")


@pytest.mark.timeout(300)
def test_another_world_size_or_layout_is_refused_in_one_line(chaos, tmp_path):
    root = chaos["root"]
    cmd = [sys.executable, "-m", "tmd.cli", "local", "--nodes", "1", "--standbys", "0", "--run-dir",
           str(tmp_path / "one"), "--resume-from", root, "--", sys.executable, "-m", "examples.train_gpt", "--tiny"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    newest = ck.step_dir(root, STEPS)
    assert r.returncode == 2 and r.stderr == \
        f"error: checkpoint {newest} was written under world size 4, this job has 2\n", r.stderr
    assert not os.path.exists(str(tmp_path / "one" / "logs" / "n1.0.log"))  # nothing was started
    # the same world size, another model (not --tiny): the ranks refuse it, naming the first tensor that differs
    job = Job(str(tmp_path / "layout"), 0, STEPS, tiny=False, tmd_args=("--resume-from", root))
    assert job.finish() == 1
    (failed,) = job.events("job_failed")
    assert f"checkpoint {newest} was written under tensor model." in failed["reason"], failed
    assert "this job has" in failed["reason"] and "\n" not in failed["reason"]


# TP x FSDP2 on 4 nodes of 1 rank: TP over (n1, n2) and (n3, n4), FSDP2 over (n1, n3) and (n2, n4), so no rank's
# state has a replica, and rank r's buddy snapshot is kept by rank r + 1 (the next node, a ring)
LLAMA = {"nodes": 4, "ranks_per_node": 1, "script": "examples.train_llama"}
LLAMA_MESH = ("--tp", "2", "--dp-shard", "2")
LLAMA_STEPS = 20


@pytest.mark.timeout(600)
def test_a_node_lost_with_its_snapshot_keeper_restarts_from_the_checkpoint_tp_fsdp2(tmp_path):
    uninterrupted = Job(str(tmp_path / "uninterrupted"), 0, LLAMA_STEPS, *LLAMA_MESH, **LLAMA)
    assert uninterrupted.finish() == 0
    expected = finals(uninterrupted.run_dir)
    assert len(expected) == 4 and len({s for s, _ in expected.values()}) == 4  # four different shards
    root = str(tmp_path / "ckpt")
    job = Job(str(tmp_path / "job"), 0, LLAMA_STEPS, *LLAMA_MESH, *PADDING, **LLAMA,
              tmd_args=("--snapshot-every", "2", "--checkpoint-dir", root, "--checkpoint-every", str(EVERY)))
    try:
        classes = job.wait_event("replica_classes", timeout_s=120)
        assert classes["keepers"] == {"0": 1, "1": 2, "2": 3, "3": 0}, classes
        job.wait_event("checkpoint_committed", timeout_s=120)
        lost = job.pids("n1") + job.pids("n2")  # rank 0, and rank 1, which keeps rank 0's snapshot
        for pid in lost:
            os.kill(pid, signal.SIGKILL)
        job.end_padding()
        rc = job.finish(timeout_s=300)
    finally:
        job.close()
    assert rc == 0, [e for e in job.events() if e["event"] in ("job_failed", "recovery_failed")]
    (restart,) = job.events("job_restarting")
    assert restart["tier"] == "checkpoint" and "snapshot" in restart["reason"] and \
        "is lost too" in restart["reason"], restart
    assert restart["step"] >= EVERY and restart["step"] % EVERY == 0, restart
    assert finals(job.run_dir) == expected
    assert not job.events("job_failed")

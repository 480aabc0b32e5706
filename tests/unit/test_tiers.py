"""tmd.tiers: the checkpoint tier on tmd's side (options refused at start, the restart plan, failed saves in the
status), without a job: checkpoints are written by hand in the on-disk format of worker.checkpoint."""
from __future__ import annotations

import hashlib
import json
import os
import time

import pytest

from tmd.journal import Journal
from tmd.protocol.vocab import Event
from tmd.config import CheckpointTierConfig, ConfigError
from tmd.tiers import Restart, Tier, choose, owner_in_path
from worker import checkpoint as ck


def write_checkpoint(root: str, step: int, job_id: str, world_size: int = 2, when: float | None = None) -> str:
    """A valid checkpoint of ``step`` (one data file per rank and a manifest over them)."""
    path = ck.step_dir(root, step)
    os.makedirs(path, exist_ok=True)
    files = {}
    for name in [".metadata"] + [f"__{r}_0.distcp" for r in range(world_size)]:
        data = f"{name} of step {step}".encode()
        with open(os.path.join(path, name), "wb") as f:
            f.write(data)
        files[name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    manifest = {"format": ck.FORMAT, "job_id": job_id, "step": step, "time": when or time.time(),
                "layout": {"world_size": world_size, "tensors": {}}, "files": files}
    with open(os.path.join(path, ck.MANIFEST), "w") as f:
        json.dump(manifest, f)
    with open(os.path.join(root, ck.JOB_FILE), "w") as f:
        f.write(job_id + "\n")
    return path


def tier(tmp_path, resume_from=None, **options) -> Tier:
    """A tier of job ``job-a`` (2 ranks) with the ``checkpoint`` section's ``options`` (short names: ``dir``,
    ``every``, ``keep``)."""
    names = {"dir": "checkpoint_dir", "every": "checkpoint_every", "keep": "checkpoint_keep"}
    config = CheckpointTierConfig(**{names.get(k, k): v for k, v in options.items()})
    t = Tier(config, "job-a", world_size=2, resume_from=resume_from)
    t.attach(Journal(None))
    return t


def events(t: Tier, name: Event) -> list[dict]:
    return [e for e in t.journal.since(0, 1000) if e["event"] == name]


def test_another_jobs_directory_or_one_inside_it_is_refused(tmp_path):
    other = Tier(CheckpointTierConfig(), "job-b", 2).job_id
    write_checkpoint(str(tmp_path / "ck"), 5, other)
    for d in (tmp_path / "ck", tmp_path / "ck" / "step-000000005", tmp_path / "ck" / "sub"):
        why = tier(tmp_path, dir=str(d), every=5).refusal()
        assert why is not None and f"holds the checkpoints of job {other}" in why, why
    assert tier(tmp_path, dir=str(tmp_path / "mine"), every=5).refusal() is None
    assert owner_in_path(str(tmp_path / "mine"), other) is None


def test_resume_from_another_world_size_is_refused_in_one_line(tmp_path):
    path = write_checkpoint(str(tmp_path / "ck"), 5, "someone", world_size=4)
    why = tier(tmp_path, resume_from=str(tmp_path / "ck")).refusal()
    assert why == f"checkpoint {path} was written under world size 4, this job has 2"
    assert "\n" not in why


def test_resume_from_picks_the_newest_valid_and_exports_it(tmp_path, monkeypatch):
    root = str(tmp_path / "ck")
    older = write_checkpoint(root, 5, "someone")
    newest = write_checkpoint(root, 10, "someone")
    with open(os.path.join(newest, "__1_0.distcp"), "r+b") as f:
        f.write(b"X")  # corrupted: same size, other bytes
    t = tier(tmp_path, resume_from=root)
    assert t.refusal() is None and t.resume_from == older
    t.started()
    refused = events(t, Event.CHECKPOINT_REFUSED)
    assert refused and "__1_0.distcp does not match its sha256" in refused[0]["message"]
    monkeypatch.setenv("TM_RESUME_FROM", "stale")
    t.export()
    assert os.environ["TM_RESUME_FROM"] == older and os.environ["TM_CHECKPOINT_JOB"] == t.job_id
    assert "TM_CHECKPOINT_DIR" not in os.environ


def test_a_restart_falls_back_past_a_torn_and_a_corrupted_checkpoint(tmp_path):
    t = tier(tmp_path, dir=str(tmp_path / "ck"), every=5)
    root = t.config.checkpoint_dir
    good = write_checkpoint(root, 5, t.job_id, when=time.time() - 30)
    corrupted = write_checkpoint(root, 10, t.job_id)
    os.truncate(os.path.join(corrupted, "__0_0.distcp"), 3)
    os.makedirs(ck.step_dir(root, 15))  # torn: no manifest
    restart, why = t.plan_restart("every rank is lost")
    assert why == "" and restart.step == 5 and restart.path == good and restart.work_lost_s >= 30
    lines = [e["message"] for e in events(t, Event.CHECKPOINT_REFUSED)]
    assert lines[0].endswith("step-000000015 refused: no manifest (a torn or unfinished save)")
    assert "__0_0.distcp has 3 bytes" in lines[1]
    (started,) = events(t, Event.JOB_RESTARTING)
    assert started["tier"] == "checkpoint" and started["step"] == 5 and started["restart"] == 1
    assert t.resume_from == good and t.status()["restarts"][0]["step"] == 5


def test_no_restart_without_a_valid_checkpoint_or_in_a_crash_loop(tmp_path):
    t = tier(tmp_path, dir=str(tmp_path / "ck"), every=5)
    assert t.plan_restart("lost")[0] is None and "no valid checkpoint" in t.plan_restart("lost")[1]
    write_checkpoint(t.config.checkpoint_dir, 5, t.job_id)
    for _ in range(3):
        assert t.plan_restart("lost")[0] is not None
    restart, why = t.plan_restart("lost")
    assert restart is None and why == "restarted 3 times from step 5 already"


def test_a_failed_save_warns_beside_the_newest_committed_step(tmp_path):
    t = tier(tmp_path, dir=str(tmp_path / "ck"), every=5)
    t.save_failed(0, "n1", "checkpoint at step 5 not saved (...): OSError: [Errno 28] No space left on device")
    assert "No space left" in t.status()["failed"]
    assert events(t, Event.CHECKPOINT_FAILED)[0]["node"] == "n1"
    write_checkpoint(t.config.checkpoint_dir, 10, t.job_id)
    t.tick(100.0)
    assert "No space left" in t.status()["failed"] and t.status()["latest"] == 10
    assert events(t, Event.CHECKPOINT_COMMITTED)[0]["step"] == 10


def test_every_save_between_two_looks_is_journalled_once_oldest_first(tmp_path):
    t = tier(tmp_path, dir=str(tmp_path / "ck"), every=5)
    for step in (5, 10, 15):
        write_checkpoint(t.config.checkpoint_dir, step, t.job_id)
    os.makedirs(os.path.join(t.config.checkpoint_dir, "step-000000020"))  # being saved: no manifest yet
    t.tick(100.0)
    t.tick(200.0)
    write_checkpoint(t.config.checkpoint_dir, 20, t.job_id)
    t.tick(300.0)
    assert [e["step"] for e in events(t, Event.CHECKPOINT_COMMITTED)] == [5, 10, 15, 20]
    assert t.status()["latest"] == 20
    # a daemon started over them (tmd resume): seen already, not journalled again; a new save is
    again = tier(tmp_path, dir=t.config.checkpoint_dir, every=5)
    again.skip_existing()
    again.tick(100.0)
    assert again.status()["latest"] == 20 and not events(again, Event.CHECKPOINT_COMMITTED)
    write_checkpoint(t.config.checkpoint_dir, 25, t.job_id)
    again.tick(200.0)
    assert [e["step"] for e in events(again, Event.CHECKPOINT_COMMITTED)] == [25]


def test_choose_takes_one_step_directory_too(tmp_path):
    path = write_checkpoint(str(tmp_path / "ck"), 5, "x")
    (step, got, _), refused = choose(path)
    assert (step, got, refused) == (5, path, [])


def test_bad_options_are_refused(tmp_path):
    assert "needs --checkpoint-dir" in tier(tmp_path, every=5).refusal()
    with pytest.raises(ConfigError, match="--checkpoint-keep"):  # ranges: the config section's, checked once
        tier(tmp_path, dir="d", keep=0)


def test_the_tier_takes_its_defaults_from_the_job_configuration(tmp_path):
    from tmd.config import JobConfig

    t = Tier(JobConfig().checkpoint, "job-a", 2)
    assert t.env()["TM_CHECKPOINT_DIR"] is None and t.status()["keep"] == JobConfig().checkpoint.checkpoint_keep
    t = Tier(JobConfig().with_options(checkpoint_dir=str(tmp_path / "ck")).checkpoint, "job-a", 2)
    assert t.env()["TM_CHECKPOINT_KEEP"] == str(JobConfig().checkpoint.checkpoint_keep)


def test_the_same_job_run_again_goes_on_from_its_own_newest_checkpoint(tmp_path):
    t = tier(tmp_path, dir=str(tmp_path / "ck"), every=5)
    write_checkpoint(t.config.checkpoint_dir, 5, t.job_id)
    newest = write_checkpoint(t.config.checkpoint_dir, 10, t.job_id)
    again = tier(tmp_path, dir=str(tmp_path / "ck"), every=5)  # the same --job name (or SLURM job id): same id
    assert again.refusal() is None and again.resume_from == newest
    assert tier(tmp_path, dir=str(tmp_path / "fresh"), every=5).refusal() is None


def test_a_journalled_restart_round_trips_and_a_malformed_one_is_skipped():
    r = Restart(step=10, path="/ck/step-10", reason="every active node lost", work_lost_s=1.25, at=5.0)
    assert Restart.from_dict({**r.to_dict(), "event": "job_restarting", "ts": 9.0}) == r
    assert Restart.from_dict({"step": "10", "path": "/ck"}) is None  # read from a journal, not trusted
    assert Restart.from_dict({"step": 3, "path": "/ck/step-3", "ts": 7.5}).at == 7.5


def test_a_checkpoint_refused_at_load_is_passed_over_and_the_one_before_it_chosen(tmp_path):
    """A checkpoint valid when tmd chose it may be refused by the ranks that load it (changed since: a chaos run
    corrupted one in between). It is journalled once, never chosen again, and the restart goes to the one before;
    a checkpoint the user gave (--resume-from) is not fallen back from."""
    t = tier(tmp_path, dir=str(tmp_path / "ck"), every=5)
    root = t.config.checkpoint_dir
    older, newer = write_checkpoint(root, 5, t.job_id), write_checkpoint(root, 10, t.job_id)
    assert t.plan_restart("every rank is lost")[0].path == newer
    assert t.load_refused(0, "n1", "no valid checkpoint: __0_0.distcp does not match its sha256")
    assert t.load_refused(1, "n2", "no valid checkpoint: __1_0.distcp does not match its sha256")  # once
    (line,) = [e["message"] for e in events(t, Event.CHECKPOINT_REFUSED)]
    assert line == f"checkpoint {newer} refused at load by rank 0 on n1: no valid checkpoint: __0_0.distcp does " \
                   f"not match its sha256"
    restart, why = t.plan_restart("rank 0 on n1 refused it at load")
    assert why == "" and restart.path == older and t.resume_from == older
    assert t.load_refused(0, "n1", "again") and t.plan_restart("refused")[0] is None  # nothing older: no restart
    given = tier(tmp_path, dir=str(tmp_path / "other"), every=5, resume_from=root)
    assert given.refusal() is None and given.resume_from == newer  # the user's choice, not tmd's
    assert not given.load_refused(0, "n1", "corrupted")

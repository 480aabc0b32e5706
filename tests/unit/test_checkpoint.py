"""worker.checkpoint with real multi-process gloo jobs (tests/unit/checkpoint_job.py, 2 ranks): bit-identical
round trips (model, AdamW, StepLR, a rank-local sampler, the RNG) with DDP and FSDP2, keep-K pruning, a full
disk, a crash in the middle of a save, a corrupted shard, another world size, another job's directory, and
plain ``torch.distributed.checkpoint.load`` without this project.

The jobs are launched once per module and each test checks one outcome of them. Their ranks are forked from one
process that imported torch once (tests/support/forked.py): started fresh, each rank paid some 5 s of CPU in
imports, 60 s of CPU for the module's 6 jobs of 2 ranks."""
from __future__ import annotations

import json
import collections
import os
import subprocess
import sys

import pytest
import torch

from tests.support.forked import Launcher
from worker import checkpoint

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "checkpoint_job.py")


def launch(launcher: Launcher, tmp, name: str, world: int = 2, **options) -> dict:
    """Run the job with ``world`` ranks, forked by ``launcher``; {"rc": [exit codes], "ranks": [rank<r>.json or
    None], "out": dir}."""
    out = tmp / name
    out.mkdir()
    args = []
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        args += [flag] if value is True else [flag, str(value)]
    rcs = launcher.run([{"argv": [sys.executable, JOB, "--rank", str(r), "--world", str(world), "--store",
                                  str(out / "store"), "--out", str(out), *args],
                         "env": dict(os.environ), "cwd": os.getcwd(), "log": str(out / f"rank{r}.log")}
                        for r in range(world)])
    ranks = []
    for r in range(world):
        path = out / f"rank{r}.json"
        ranks.append(json.loads(path.read_text()) if path.exists() else None)
    return {"rc": rcs, "ranks": ranks, "out": out}


@pytest.fixture(scope="module")
def launcher():
    """Forks each job's ranks from one process that imported torch and these modules once (tests.support.forked)."""
    with Launcher(["torch.distributed.checkpoint", "torch.distributed.fsdp", "worker.checkpoint"]) as launcher:
        yield launcher


@pytest.fixture(scope="module")
def runs(tmp_path_factory, launcher):
    tmp = tmp_path_factory.mktemp("ckpt")
    full, torn = tmp / "full", tmp / "torn"
    r = {"tmp": tmp, "full_root": full, "torn_root": torn}
    # the reference: 8 steps, a checkpoint every 2, keep 2, the save of step 8 on a "full disk"
    r["full"] = launch(launcher, tmp, "full", root=full, total=8, every=2, disk_full_at=8)
    # a crash: rank 0 SIGKILLed as it is about to commit step 4; the job ends after step 5
    r["crash"] = launch(launcher, tmp, "crash", root=torn, total=8, every=2, stop=5, kill_in_commit=4)
    torn_dirs = sorted(os.listdir(torn))
    # restart: step 4 is torn, step 2 is loaded; the job trains to 8 (saving 4, 6, 8)
    r["resume"] = launch(launcher, tmp, "resume", root=torn, total=8, every=2, resume=True)
    r["torn_dirs"] = torn_dirs
    # a corrupted shard in the newest checkpoint: refused by name, step 6 loaded
    step8 = checkpoint.step_dir(str(torn), 8)
    r["plain"] = plain_load(step8)
    with open(os.path.join(step8, "__1_0.distcp"), "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    r["corrupt"] = launch(launcher, tmp, "corrupt", root=torn, total=8, every=2, resume=True)
    # FSDP2: the reference, then a resume from its step-2 checkpoint into a new root (--resume-from)
    r["fsdp"] = launch(launcher, tmp, "fsdp", root=tmp / "fsdp", total=4, every=2, model="fsdp")
    r["fsdp_resume"] = launch(launcher, tmp, "fsdp_resume", root=tmp / "fsdp2", total=4, every=2, model="fsdp",
                              resume_from=checkpoint.step_dir(str(tmp / "fsdp"), 2))
    return r


def plain_load(path: str) -> dict:
    """The model and optimizer of a checkpoint, loaded with plain torch (docs/checkpoints.md's snippet)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    torch.manual_seed(123)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.3), torch.nn.ReLU(),
                                torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = {"model": model.state_dict(), "optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    set_optimizer_state_dict(model, optimizer, state["optimizer"])
    return {"model": model.state_dict(), "exp_avg": optimizer.state_dict()["state"][0]["exp_avg"]}


def hashes(run) -> list:
    assert run["rc"] == [0] * len(run["rc"]), run
    return [r["hash"] for r in run["ranks"]]


def test_round_trip_after_a_crash_is_bit_identical(runs):
    assert [r["loaded"] for r in runs["resume"]["ranks"]] == [2, 2]
    assert hashes(runs["resume"]) == hashes(runs["full"])
    assert len(set(hashes(runs["full"]))) == 2  # the ranks' RNG and samplers differ: the hash covers them


def test_crash_mid_save_leaves_the_previous_valid(runs):
    crash = runs["crash"]
    assert crash["rc"][0] == -9 and crash["rc"][1] == 0
    assert runs["torn_dirs"] == ["JOB", "step-000000002", "step-000000004"]
    refused = runs["resume"]["ranks"][0]["refused"]
    assert len(refused) == 1 and "step-000000004 refused: no manifest" in refused[0]


def test_corrupted_shard_is_refused_by_name_and_the_previous_used(runs):
    corrupt = runs["corrupt"]
    assert [r["loaded"] for r in corrupt["ranks"]] == [6, 6]
    assert corrupt["ranks"][1]["refused"] == [
        f"checkpoint {checkpoint.step_dir(str(runs['torn_root']), 8)} refused: __1_0.distcp does not match its "
        "sha256 in the manifest"]
    assert hashes(corrupt) == hashes(runs["full"])


def test_full_disk_is_reported_and_keeps_earlier_checkpoints(runs):
    full = runs["full"]
    for rank in full["ranks"]:
        assert len(rank["errors"]) == 1
        assert rank["errors"][0].startswith("checkpoint at step 8 not saved")
        assert "File too large" in rank["errors"][0]
    root = str(runs["full_root"])
    assert [s for s, _ in checkpoint.checkpoints(root)] == [8, 6, 4]  # 2 pruned after 6; 4 kept after 8 failed
    assert checkpoint.verify(checkpoint.step_dir(root, 8))[0] == "no manifest (a torn or unfinished save)"
    assert checkpoint.verify(checkpoint.step_dir(root, 6))[0] is None
    assert checkpoint.verify(checkpoint.step_dir(root, 4))[0] is None


def test_keep_prunes_to_the_newest_two_and_torn_older(runs):
    # after the resume (saves 4, 6, 8 with the torn 4 replaced) only 6 and 8 remain
    assert [s for s, _ in checkpoint.checkpoints(str(runs["torn_root"]))] == [8, 6]


@pytest.fixture
def one_rank():
    """A 1-rank gloo default group in this process."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def small_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.3), torch.nn.ReLU(), torch.nn.Linear(16, 1))


def test_another_world_size_is_refused_in_one_line(runs, one_rank):
    ckpt = checkpoint.Checkpointer(str(runs["torn_root"]), "job-a")
    with pytest.raises(checkpoint.LayoutMismatch) as refused:
        ckpt.load({"model": small_model()}, {})
    assert str(refused.value) == (f"checkpoint {checkpoint.step_dir(str(runs['torn_root']), 8)} was written "
                                  "under world size 2, this job has 1")


def test_a_redone_step_keeps_its_valid_checkpoint_and_replaces_a_corrupted_one(tmp_path, one_rank):
    model = small_model()
    ckpt = checkpoint.Checkpointer(str(tmp_path), "job-a")
    first = ckpt.save(2, {"model": model}, {})
    assert ckpt.wait() is first and first.error is None and not first.skipped
    manifest = os.path.join(checkpoint.step_dir(str(tmp_path), 2), checkpoint.MANIFEST)
    before = open(manifest, "rb").read()
    again = ckpt.save(2, {"model": model}, {})
    ckpt.wait()
    assert again.skipped and again.error is None and open(manifest, "rb").read() == before
    with open(os.path.join(checkpoint.step_dir(str(tmp_path), 2), "rank00000.pt"), "ab") as f:
        f.write(b"x")  # truncation's cousin: the size no longer matches
    assert checkpoint.verify(checkpoint.step_dir(str(tmp_path), 2))[0].startswith("rank00000.pt has ")
    third = ckpt.save(2, {"model": model}, {})
    ckpt.wait()
    assert not third.skipped and third.error is None
    assert checkpoint.verify(checkpoint.step_dir(str(tmp_path), 2))[0] is None


def test_fsdp2_resume_from_a_step_dir_is_bit_identical(runs):
    assert [r["loaded"] for r in runs["fsdp_resume"]["ranks"]] == [2, 2]
    assert hashes(runs["fsdp_resume"]) == hashes(runs["fsdp"])


def test_plain_dcp_load_without_this_project(runs):
    final = torch.load(runs["resume"]["out"] / "final.pt", weights_only=True)
    plain = runs["plain"]
    assert plain["model"].keys() == final["model"].keys()
    for key, value in final["model"].items():
        assert torch.equal(plain["model"][key], value), key
    assert torch.equal(plain["exp_avg"], final["exp_avg"])


def test_another_jobs_directory_is_refused(tmp_path):
    (tmp_path / checkpoint.JOB_FILE).write_text("job-a\n")
    with pytest.raises(checkpoint.CheckpointError, match=r"holds the checkpoints of job job-a, not of this job"):
        checkpoint.check_owner(str(tmp_path), "job-b")
    checkpoint.check_owner(str(tmp_path), "job-a")


def test_layout_difference_names_what_differs():
    saved = {"world_size": 4, "tensors": {"model.w": "(8, 4) torch.float32 ('Shard(dim=0)',) mesh (4,)"}}
    same = {"world_size": 4, "tensors": dict(saved["tensors"])}
    assert checkpoint.layout_difference(saved, same) is None
    other = {"world_size": 4, "tensors": {"model.w": "(8, 4) torch.float32 ('Replicate()',) mesh (4,)"}}
    assert checkpoint.layout_difference(saved, other) == (
        "tensor model.w is (8, 4) torch.float32 ('Shard(dim=0)',) mesh (4,), this job has (8, 4) torch.float32 "
        "('Replicate()',) mesh (4,)")


def test_a_multisteplr_comes_back_with_its_milestones_a_counter(tmp_path, one_rank):
    """MultiStepLR's state_dict holds a collections.Counter; a checkpoint must give it back as one, with the lr."""
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[2, 2, 4], gamma=0.5)
    for _ in range(3):
        opt.step()
        sched.step()
    history = History([0, 1, 2])  # a replicated object whose list grew since the job began
    ckpt = checkpoint.Checkpointer(str(tmp_path), "job-a")
    saved = ckpt.save(3, {"model": model, "optimizer": opt, "scheduler": sched, "history": history}, {})
    assert ckpt.wait() is saved and saved.error is None
    model2 = small_model()
    opt2 = torch.optim.SGD(model2.parameters(), lr=1.0)
    sched2 = torch.optim.lr_scheduler.MultiStepLR(opt2, milestones=[2, 2, 4], gamma=0.5)  # the same script
    history2 = History([])
    assert ckpt.load({"model": model2, "optimizer": opt2, "scheduler": sched2, "history": history2}, {}) == 3
    assert type(sched2.milestones) is collections.Counter and sched2.milestones == collections.Counter([2, 2, 4])
    assert sched2.state_dict() == sched.state_dict() and opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    assert history2.steps == [0, 1, 2]


class History:
    def __init__(self, steps):
        self.steps = list(steps)

    def state_dict(self):
        return {"steps": list(self.steps), "by_step": {s: s * s for s in self.steps}}

    def load_state_dict(self, state):
        self.steps = list(state["steps"])

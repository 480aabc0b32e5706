"""End to end, torchtitan's own Trainer (torchtitan 0.3.0, ``llama3_debugmodel``: 2 layers, sequence 64, batch 2)
under the runtime (worker.integrations.torchtitan, driven by examples.torchtitan.train), 2 nodes x 2 ranks, gloo on CPU.

One job per layout, against an uninterrupted runtime run of the same config:

1. a planned migration ``n2 -> s1`` once training runs and the standbys are warm;
2. then ``s1`` (the node that just joined) is killed with SIGKILL during step KILL_AT's forward (``--fault``) and
   recovered on ``s2``: neither layout has a replica of a node's state on another node, so the job rolls back to
   the last buddy snapshot (``--snapshot-every 4``) and redoes the steps since;
3. every rank's final model and optimizer hash (its local shards) equals the uninterrupted run's.

In the FSDP job torchtitan's own checkpoints are on too (``--checkpoint.enable``, every 8 steps): they are written
through the migration and the recovery (by the joiner and the replacement too), and change no number.

Layouts: ``fsdp`` (FSDP2 over the 4 ranks) and ``tp_fsdp`` (tensor parallel 2 in node x FSDP2 2 across nodes).
Skipped where torchtitan is not installed (``pip install -e .[torchtitan]``, scripts/setup.sh).
"""
from __future__ import annotations

import os

import pytest

from tmctl.localjob import Job, final_hashes, wait_until
from tmd import protocol as p

pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install -e .[torchtitan])")

STEPS = 24
KILL_AT = 20  # after the migration's switch step and the joiner's first buddy snapshot (SNAPSHOT_EVERY)
SNAPSHOT_EVERY = 4
CHECKPOINT_EVERY = 8  # torchtitan's own checkpoints (fsdp only)
LAYOUTS = {
    "fsdp": (),
    "tp_fsdp": ("--parallelism.tensor-parallel-degree", "2"),
}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> str:
    from examples.torchtitan.make_data import write

    directory = str(tmp_path_factory.mktemp("torchtitan-data"))
    write(directory, docs=400)
    return directory


def job(run_dir: str, layout: str, data_dir: str, standbys: int, extra: tuple = ()) -> Job:
    args = ("--module", "examples.torchtitan.config", "--config", "llama3_tiny", "--dataloader.dataset-path",
            data_dir, *LAYOUTS[layout], *extra)
    return Job(run_dir, standbys, STEPS, *args, script="examples.torchtitan.train", tiny=False,
               tmd_args=("--snapshot-every", str(SNAPSHOT_EVERY)))


@pytest.mark.skip(reason="not yet seen passing end to end (issue 32): the migration commits; the recovery's "
                  "replacement was fixed (no checkpointer.load on a joiner) after the last run")
@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_migration_then_kill_is_bit_identical(tmp_path, layout, data_dir):
    with job(str(tmp_path / "reference"), layout, data_dir, 0) as reference:
        assert reference.finish(timeout_s=400) == 0
    expected = final_hashes(reference.run_dir)
    assert len(expected) == 4, expected

    checkpoints = ("--checkpoint.enable", "--checkpoint.interval", str(CHECKPOINT_EVERY), "--dump-folder",
                   str(tmp_path / "titan")) if layout == "fsdp" else ()
    with job(str(tmp_path / "job"), layout, data_dir, 2, ("--fault", f"s1:{KILL_AT}:forward") + checkpoints) as moved:
        def warm() -> bool:
            return {n["name"] for n in moved.status().nodes if n["warm"] and n["role"] == "standby"} >= {"s1", "s2"}

        wait_until(warm, 300, "warm standbys s1, s2")
        moved.migrate("n2", "s1", timeout_s=300)  # accepted once the job recorded its first steps
        assert moved.finish(timeout_s=600) == 0
        journal = moved.events()
    assert final_hashes(moved.run_dir) == expected

    def of(kind: p.Event) -> list[dict]:
        return [e for e in journal if e["event"] == kind]

    committed, = of(p.Event.MIGRATION_COMMITTED)
    assert committed["switch_step"] < KILL_AT, "the kill was due before the joiner held n2's ranks: raise KILL_AT"
    left = [e for e in of(p.Event.PROCESS_EXIT) if e["node"] == "n2"]
    assert [e["returncode"] for e in left] == [0, 0], left
    killed = [e for e in of(p.Event.PROCESS_EXIT) if e["node"] == "s1"]
    assert sorted(e["returncode"] for e in killed) == [-9, -9], killed
    plan, = of(p.Event.RECOVERY_PLAN)
    assert 0 <= plan["rollback_step"] < KILL_AT and plan["resume_step"] == plan["rollback_step"] + 1, plan
    done, = of(p.Event.RECOVERY_DONE)
    assert done["standbys"] == {"s1": "s2"}, done
    if not checkpoints:
        return
    saved = sorted(os.listdir(tmp_path / "titan" / "checkpoint"))
    assert saved == [f"step-{s}" for s in sorted(range(CHECKPOINT_EVERY, STEPS + 1, CHECKPOINT_EVERY), key=str)], saved

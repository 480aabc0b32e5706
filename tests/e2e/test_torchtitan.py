"""End to end, torchtitan's own Trainer (torchtitan 0.3.0, ``llama3_debugmodel`` cut to 2 layers, sequence 64, batch
2: examples/torchtitan's ``llama3_tiny``) under the runtime (worker.integrations.torchtitan, driven by
examples.torchtitan.train), 2 nodes x 2 ranks, gloo on CPU, in two layouts: ``fsdp`` (FSDP2 over the 4 ranks) and
``tp_fsdp`` (tensor parallel 2 in node x FSDP2 2 across nodes).

The reference of each layout is torchtitan's own loop on 4 ranks with torchrun's environment (``--plain``:
``config.build()`` and ``Trainer.train``, no runtime; forked from one warm process, tests/support/forked.py), run
once per layout and shared by the tests (module-scoped). Per layout, one job:

1. a planned migration ``n2 -> s1`` once training runs and the standbys are warm;
2. once ``s1`` holds n2's ranks and took its first buddy snapshot, both its processes are killed with SIGKILL and
   the job recovers on ``s2``: neither layout has a replica of a node's state on another node, so it rolls back to
   the last buddy snapshot (``--snapshot-every``) and redoes the steps since;
3. every rank's final model and optimizer hash (its local shards) equals the plain torchrun run's.

In the FSDP job both kinds of checkpoint are on: torchtitan's own (``--checkpoint.enable``, DCP under
``--dump-folder``, every 10 steps) and the runtime's (tmd ``--checkpoint-dir``, every 5 steps, the 4 newest kept).
They are all written through the migration and the kill, the runtime's of the steps after the recovery too (its
saver group is keyed by the world generation in use), each valid against its manifest, and they change no number.
A runtime save in flight at the kill fails (journalled) and is written again when the recovered job redoes its step.
One more job, the runtime's uninterrupted FSDP run, gives the plain run's hashes: the runtime changes nothing in the
numerics. Skipped where torchtitan is not installed (``pip install -e .[torchtitan]``).

The suite runs both layouts' jobs (about 2 minutes here: 62 s for FSDP and 76 s for TP x FSDP2, each with its
plain reference). The runtime's uninterrupted run adds about 1 minute and says less (each layout's migrated and
recovered run already equals the plain run), so it runs with ``TM_TEST_TORCHTITAN=all`` only (all three: 175 s).
"""
from __future__ import annotations

import os
import re
import signal
import sys
import time

import pytest

from tests.support.forked import Launcher, torchrun, torchrun_env
from tmctl.localjob import Job, final_hashes, wait_until
from tmd import protocol as p
from worker import checkpoint as ck

pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install -e .[torchtitan])")
ALL = os.environ.get("TM_TEST_TORCHTITAN") == "all"
uninterrupted_too = pytest.mark.skipif(not ALL, reason="set TM_TEST_TORCHTITAN=all (about 1 more minute)")

STEPS = 20
SNAPSHOT_EVERY = 4
CHECKPOINT_EVERY = 10  # torchtitan's own (fsdp job): steps 10 and 20
RUNTIME_CHECKPOINT_EVERY = 5  # the runtime's (fsdp job): steps 5, 10, 15, 20, all kept
LAYOUTS = {
    "fsdp": (),
    "tp_fsdp": ("--parallelism.tensor-parallel-degree", "2"),
}
# what the ranks' image imports once (TM_FORK_PRELOAD, worker/fork_server.py), the driver's helpers too
IMAGE = "worker.integrations.torchtitan_image,examples.train_gpt"


@pytest.fixture(autouse=True)
def image(monkeypatch):
    """Every ``tmd local`` job here forks its ranks and standbys from a fork server that imported torchtitan."""
    monkeypatch.setenv("TM_FORK_PRELOAD", IMAGE)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> str:
    from examples.torchtitan.make_data import write

    directory = str(tmp_path_factory.mktemp("torchtitan-data"))
    write(directory, docs=400)
    return directory


def titan_args(layout: str, data_dir: str) -> tuple[str, ...]:
    return ("--module", "examples.torchtitan.config", "--config", "llama3_tiny", "--dataloader.dataset-path",
            data_dir, *LAYOUTS[layout])


@pytest.fixture(scope="module")
def plain(tmp_path_factory, data_dir):
    """``plain(layout)``: every rank's final hash of torchtitan's own loop on 4 ranks with torchrun's environment
    (one node), run on first use and kept for the module. The ranks are forked from one process that imported
    torch and most of torchtitan once for both layouts (tests.support.forked, IMAGE), as torchrun's 4 fresh
    interpreters would each have done."""
    done: dict[str, dict[int, str]] = {}
    launcher: list[Launcher] = []

    def run(layout: str) -> dict[int, str]:
        if layout not in done:
            run_dir = str(tmp_path_factory.mktemp(f"plain-{layout}"))
            argv = [sys.executable, "-m", "examples.torchtitan.train", "--plain", "--run-dir", run_dir,
                    "--steps", str(STEPS), *titan_args(layout, data_dir)]
            if not launcher:
                launcher.append(Launcher(IMAGE.split(","), torchrun_env()))
            ranks = torchrun(launcher[0], argv, 4, os.path.join(run_dir, "logs"))
            assert [r.returncode for r in ranks] == [0] * 4, ranks[0].stderr[-3000:]
            done[layout] = final_hashes(run_dir)
            assert len(done[layout]) == 4, done[layout]
        return done[layout]

    yield run
    for each in launcher:
        each.close()


def job(run_dir: str, layout: str, data_dir: str, standbys: int, extra: tuple = (), tmd_args: tuple = ()) -> Job:
    """A ``tmd local`` job of 2 nodes x 2 ranks and ``standbys`` standbys running the driver for STEPS steps
    (``extra``: more driver or torchtitan flags, ``tmd_args``: more tmd options)."""
    return Job(run_dir, standbys, STEPS, *titan_args(layout, data_dir), *extra, script="examples.torchtitan.train",
               tiny=False, tmd_args=("--snapshot-every", str(SNAPSHOT_EVERY), *tmd_args))


@uninterrupted_too
@pytest.mark.timeout(600)
def test_runtime_changes_no_number(tmp_path, data_dir, plain):
    """The runtime's uninterrupted run equals torchtitan's own loop under torchrun, rank by rank."""
    with job(str(tmp_path / "job"), "fsdp", data_dir, 0) as uninterrupted:
        assert uninterrupted.finish(timeout_s=400) == 0
    assert final_hashes(uninterrupted.run_dir) == plain("fsdp")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_migration_then_kill_is_bit_identical(tmp_path, layout, data_dir, plain):
    expected = plain(layout)
    checkpoints = layout == "fsdp"
    titan_dump = tmp_path / "titan"
    extra = ("--checkpoint.enable", "--checkpoint.interval", str(CHECKPOINT_EVERY),
             "--dump-folder", str(titan_dump)) if checkpoints else ()
    runtime_root = str(tmp_path / "checkpoints")
    runtime_saves = list(range(RUNTIME_CHECKPOINT_EVERY, STEPS + 1, RUNTIME_CHECKPOINT_EVERY))
    tmd_args = ("--checkpoint-dir", runtime_root, "--checkpoint-every", str(RUNTIME_CHECKPOINT_EVERY),
                "--checkpoint-keep", str(len(runtime_saves))) if checkpoints else ()
    run_dir = str(tmp_path / "job")
    with job(run_dir, layout, data_dir, 2, extra, tmd_args) as moved:
        def warm() -> bool:
            return {n["name"] for n in moved.status().nodes if n["warm"] and n["role"] == "standby"} >= {"s1", "s2"}

        wait_until(warm, 300, "warm standbys s1, s2")
        migration = moved.migrate("n2", "s1", timeout_s=300)  # accepted once the job recorded its first steps
        committed = moved.finished(migration, timeout_s=300)
        assert committed["event"] == p.Event.MIGRATION_COMMITTED, committed
        switch = committed["switch_step"]
        # s1's first buddy snapshot as n2's ranks, and one step past it: then kill -9 both its processes
        snapshot = wait_until(lambda: next((e for e in moved.events(p.Event.SNAPSHOT_TAKEN)
                                            if e["node"] == "s1" and e["step"] >= switch), None), 120,
                              "s1's first snapshot")
        wait_until(lambda: moved.status().step > snapshot["step"] + 1, 120, "a step past s1's snapshot")
        killed_at = time.time()
        for pid in moved.pids("s1"):
            os.kill(pid, signal.SIGKILL)
        assert moved.finish(timeout_s=600) == 0
        journal = moved.events()
    assert final_hashes(run_dir) == expected

    def of(kind: p.Event) -> list[dict]:
        return [e for e in journal if e["event"] == kind]

    left = [e for e in of(p.Event.PROCESS_EXIT) if e["node"] == "n2"]
    assert [e["returncode"] for e in left] == [0, 0], left
    killed = [e for e in of(p.Event.PROCESS_EXIT) if e["node"] == "s1"]
    assert sorted(e["returncode"] for e in killed) == [-9, -9], killed
    plan, = of(p.Event.RECOVERY_PLAN)
    assert switch <= plan["rollback_step"] < STEPS and plan["resume_step"] == plan["rollback_step"] + 1, plan
    done, = of(p.Event.RECOVERY_DONE)
    assert done["standbys"] == {"s1": "s2"} and done["ts"] > killed_at, done
    if not checkpoints:
        return
    saved = sorted(os.listdir(titan_dump / "checkpoint"))
    assert saved == [f"step-{s}" for s in range(CHECKPOINT_EVERY, STEPS + 1, CHECKPOINT_EVERY)], saved
    # the runtime's: every save due is there and valid, and at least one was committed after the recovery. A save
    # in flight when s1 was killed fails (its saver group lost a peer): journalled, and redone after the roll-back
    # (a run here failed step 15's save at the kill and committed it once the recovered job got there again)
    for failed in of(p.Event.CHECKPOINT_FAILED):
        assert failed["ts"] > killed_at and failed["ts"] < done["ts"], failed
        assert re.match(r"checkpoint at step \d+ not saved", failed["message"]), failed
    verdicts = {step: ck.verify(path) for step, path in ck.checkpoints(runtime_root)}
    assert sorted(verdicts) == runtime_saves, verdicts
    for step, (why, manifest) in verdicts.items():
        assert why is None and manifest["step"] == step and manifest["layout"]["world_size"] == 4, (step, why)
    committed = {s: os.path.getmtime(os.path.join(ck.step_dir(runtime_root, s), ck.MANIFEST)) for s in verdicts}
    assert any(t > done["ts"] for t in committed.values()), (committed, done["ts"])

"""End to end, hybrid parallelism in local mode (2 nodes x 2 ranks, gloo, a tiny Llama: examples.train_llama):
HSDP, tensor parallel x FSDP2 and pipeline x data parallel, each on one ``init_device_mesh``, unmodified.

One job per layout, against an uninterrupted run of the same layout and seed:

1. a planned migration ``n2 -> s1`` at step 4 (every group the script made through the DeviceMesh is a mover
   group: the ones holding n2's ranks are rebuilt, the others are not);
2. then ``s1`` (the node that just joined) is killed with SIGKILL at step 28 (``--fault``) and recovered on
   ``s2``: from a replica where its state has one on another node (HSDP), otherwise by rolling the whole job
   back to the last buddy snapshot (``--snapshot-every 4``) and redoing the steps since;
3. every rank's final model and optimizer hash (its local shards) equals the uninterrupted run's.

FSDP2 sharded over all 4 ranks (one mesh dimension) is not run here: its path under the runtime (no replica, the
roll-back to a buddy snapshot, a stayer rebuilding a mesh group that holds a leaver) is tp_fsdp's, whose FSDP2
dimension also spans both nodes and which, in addition, keeps a group that holds no leaver. It trains without the
runtime in tests/e2e/test_llama_layouts.py.
"""
from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.support import events, wait_until
from tests.support.job import final_hashes, job_client, tmd_command
from tmd import protocol as p

STEPS = 32  # 4 steps after the kill; a rollback goes back to step 24 at most (SNAPSHOT_EVERY)
# The migration's switch step lands between steps 12 and 19 here (more steps pass during the joiner's warm-up on a
# loaded machine); the kill must come after it and after the joiner's first buddy snapshot (every 4 steps).
KILL_AT = 28
SNAPSHOT_EVERY = 4
# layout -> (train_llama's mesh flags, whether a lost node's state has a replica elsewhere, groups per rank)
LAYOUTS = {
    "hsdp": (("--dp-replicate", "2", "--dp-shard", "2"), True),
    "tp_fsdp": (("--tp", "2", "--dp-shard", "2"), False),
    "pp_dp": (("--pp", "2", "--dp-replicate", "2"), False),
}
PAD = ("--min-step-time-s", "0.15")  # every step lasts at least this (numerics unchanged): time to migrate


def command(run_dir: str, layout: str, standbys: int, extra: tuple = ()) -> list[str]:
    return tmd_command(run_dir, standbys, STEPS, True, True, LAYOUTS[layout][0] + extra,
                       tmd_args=("--snapshot-every", str(SNAPSHOT_EVERY)), script="examples.train_llama")


def reference(tmp_path, layout: str) -> dict[int, str]:
    run_dir = str(tmp_path / "reference")
    subprocess.run(command(run_dir, layout, 0), check=True, timeout=240, stdout=subprocess.DEVNULL)
    hashes = final_hashes(run_dir)
    assert len(hashes) == 4, hashes
    return hashes


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_migration_then_kill_is_bit_identical(tmp_path, layout):
    expected = reference(tmp_path, layout)
    run_dir = str(tmp_path / "job")
    proc = subprocess.Popen(command(run_dir, layout, 2, PAD + ("--fault", f"s1:{KILL_AT}:forward")),
                            stdout=subprocess.DEVNULL)
    try:
        client = job_client(run_dir, proc)

        def ready() -> bool:
            st = client.request(p.StatusRequest())
            return st.step >= 4 and {n["name"] for n in st.nodes if n["warm"]} >= {"s1", "s2"}

        wait_until(ready, 120, "training at step 4 and warm standbys")
        reply = client.request(p.MigrateRequest(sources=["n2"], targets=["s1"]))
        assert isinstance(reply, p.MigrationReply), reply
        assert proc.wait(timeout=300) == 0
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=30)
    assert final_hashes(run_dir) == expected

    journal = events(run_dir)

    def of(kind: p.Event) -> list[dict]:
        return [e for e in journal if e["event"] == kind]

    committed = of(p.Event.MIGRATION_COMMITTED)
    assert len(committed) == 1, of(p.Event.MIGRATION_ABORTED)
    assert committed[0]["switch_step"] < KILL_AT, "the kill was due before the joiner held s1's ranks: raise KILL_AT"
    # delta-based: a stayer rebuilds only its groups that hold a leaver (n2's ranks 2, 3); the joiners all theirs
    rebuilt = of(p.Event.MIGRATION_PREPARED)[0]["rebuilt"]
    stayer, joiner = set(rebuilt["n1/0"]), set(rebuilt["s1/0"])
    assert p.layout.WORLD_GROUP in stayer and stayer <= joiner | {p.layout.WORLD_GROUP}, rebuilt
    if layout in ("tp_fsdp", "pp_dp"):  # the stayers' in-node group (TP, or the stage's DP) holds no leaver
        assert len(stayer) < len(joiner), rebuilt

    plan, = of(p.Event.RECOVERY_PLAN)
    done, = of(p.Event.RECOVERY_DONE)
    has_replica = LAYOUTS[layout][1]
    if has_replica:  # from the replica on n1: rank 0 -> 2, rank 1 -> 3, nothing rolled back
        assert plan["rollback_step"] == -1 and sorted(plan["sends"]) == [[0, 2], [1, 3]], plan
    else:  # rolled back to the last snapshot every rank held, sent by the ranks that kept s1's copies
        assert 0 <= plan["rollback_step"] < KILL_AT and plan["resume_step"] == plan["rollback_step"] + 1, plan
        assert sorted(plan["sends"]) == [[0, 2], [1, 3]], plan
    warnings = of(p.Event.NO_REPLICA)
    assert bool(warnings) != has_replica, warnings
    assert done["standbys"] == {"s1": "s2"}
    final = [json.load(open(os.path.join(run_dir, "final", f))) for f in sorted(os.listdir(
        os.path.join(run_dir, "final")))]
    assert {f["steps"] for f in final} == {STEPS}

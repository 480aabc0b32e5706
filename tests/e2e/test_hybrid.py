"""End to end, hybrid parallelism in local mode (2 nodes x 2 ranks, gloo, a tiny Llama: examples.train_llama):
HSDP, tensor parallel x FSDP2 and pipeline x data parallel, each on one ``init_device_mesh``, unmodified.

One job per layout, against an uninterrupted run of the same layout and seed:

1. a planned migration ``n2 -> s1`` at step 4 (every group the script made through the DeviceMesh is a mover
   group: the ones holding n2's ranks are rebuilt, the others are not);
2. then ``s1`` (the node that just joined) is killed with SIGKILL at step 28 (``--fault``) and recovered on
   ``s2``: from a replica where its state has one on another node (HSDP), otherwise by rolling the whole job
   back to the last buddy snapshot (``--snapshot-every 4``) and redoing the steps since;
3. every rank's final model and optimizer hash (its local shards) equals the uninterrupted run's.

tp_fsdp runs with a guard instead (``--guards 1``, tmd.guards): once recording ends, a standby warms up as n1's
ranks, running its shadow iterations on the 2-D mesh; n2 moves to the other standby, and then n1 is killed and
its guard adopted, with no warm-up, through the roll-back to the last buddy snapshot (which the joiner of n2's
ranks took part in).

FSDP2 sharded over all 4 ranks (one mesh dimension) is not run here: its path under the runtime (no replica, the
roll-back to a buddy snapshot, a stayer rebuilding a mesh group that holds a leaver) is tp_fsdp's, whose FSDP2
dimension also spans both nodes and which, in addition, keeps a group that holds no leaver. It trains without the
runtime in tests/e2e/test_llama_layouts.py.
"""
from __future__ import annotations

import json
import os

import pytest

from tmctl.localjob import (end_job, events, final_hashes, job_client, run_tmd, start_tmd, tmd_command, tmd_log,
                            wait_until)
from tmd import protocol as p

STEPS = 32  # 4 steps after the kill; a rollback goes back to step 24 at most (SNAPSHOT_EVERY)
# The migration's switch step lands between steps 12 and 19 here (more steps pass during the joiner's warm-up on a
# loaded machine); the kill must come after it and after the joiner's first buddy snapshot (every 4 steps).
KILL_AT = 28
SNAPSHOT_EVERY = 4
# layout -> (train_llama's mesh flags, whether a lost node's state has a replica elsewhere, whether n1 is guarded
# and killed instead of the joiner)
LAYOUTS = {
    "hsdp": (("--dp-replicate", "2", "--dp-shard", "2"), True, False),
    "tp_fsdp": (("--tp", "2", "--dp-shard", "2"), False, True),
    "pp_dp": (("--pp", "2", "--dp-replicate", "2"), False, False),
}
PAD = ("--min-step-time-s", "0.15")  # every step lasts at least this (numerics unchanged): time to migrate


def command(run_dir: str, layout: str, standbys: int, extra: tuple = ()) -> list[str]:
    guards = ("--guards", "1") if standbys and LAYOUTS[layout][2] else ()
    return tmd_command(run_dir, standbys, STEPS, True, True, LAYOUTS[layout][0] + extra,
                       tmd_args=("--snapshot-every", str(SNAPSHOT_EVERY)) + guards, script="examples.train_llama")


def reference(tmp_path, layout: str) -> dict[int, str]:
    run_dir = str(tmp_path / "reference")
    run_tmd(command(run_dir, layout, 0), run_dir, timeout_s=240)
    hashes = final_hashes(run_dir)
    assert len(hashes) == 4, hashes
    return hashes


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_migration_then_kill_is_bit_identical(tmp_path, layout):
    expected = reference(tmp_path, layout)
    guarded = LAYOUTS[layout][2]
    killed = "n1" if guarded else "s1"  # fired by the processes started there, not by their replacements
    run_dir = str(tmp_path / "job")
    proc = start_tmd(command(run_dir, layout, 2, PAD + ("--fault", f"{killed}:{KILL_AT}:forward")), tmd_log(run_dir))
    try:
        client = job_client(run_dir, proc)
        roles: dict[str, dict] = {}

        def ready() -> bool:
            st = client.request(p.StatusRequest())
            roles.update({n["name"]: n for n in st.nodes})
            warm = {n["name"] for n in st.nodes if n["warm"] and n["role"] == "standby"}
            guarding = [n["name"] for n in st.nodes if n["role"] == "guarding"]
            return st.step >= 4 and (len(guarding) == 1 and len(warm) == 1 if guarded else warm >= {"s1", "s2"})

        wait_until(ready, 120, "training at step 4 and warm standbys" + (", one guarding n1" if guarded else ""))
        if guarded:  # the guard stays on n1; n2 moves to the other standby
            guard, = [name for name, n in roles.items() if n["role"] == "guarding"]
            assert roles[guard]["guards"] == [0, 1], roles[guard]
            target, = [name for name, n in roles.items() if n["role"] == "standby"]
        else:
            guard, target = "", "s1"
        reply = client.request(p.MigrateRequest(sources=["n2"], targets=[target]))
        assert isinstance(reply, p.MigrationReply), reply
        assert proc.wait(timeout=300) == 0
    finally:
        end_job(proc)
    assert final_hashes(run_dir) == expected

    journal = events(run_dir)

    def of(kind: p.Event) -> list[dict]:
        return [e for e in journal if e["event"] == kind]

    committed = of(p.Event.MIGRATION_COMMITTED)
    assert len(committed) == 1, of(p.Event.MIGRATION_ABORTED)
    # no DDP here: one shadow iteration each, because the job's recorded steps 1 and 2 issued the same collectives
    # (worker.sandbox.unsteady_after_first); the others ran --record-steps (3) before that check
    assert committed[0]["shadow_steps"] == {"2": 1, "3": 1}, committed[0]
    assert committed[0]["switch_step"] < KILL_AT, "the kill was due before the joiner held n2's ranks: raise KILL_AT"
    # the joiners replayed the leavers' optimizer steps, DTensor ones (FSDP2, TP) included: the tail left out the
    # tensors the replay made identical
    sent = of(p.Event.MIGRATION_SENT)
    assert len(sent) == 2 and all(e["kept_tensors"] > 0 for e in sent), sent
    # delta-based: a stayer rebuilds only its groups that hold a leaver (n2's ranks 2, 3); the joiners all theirs
    rebuilt = of(p.Event.MIGRATION_PREPARED)[0]["rebuilt"]
    stayer, joiner = set(rebuilt["n1/0"]), set(rebuilt[f"{target}/0"])
    assert p.layout.WORLD_GROUP in stayer and stayer <= joiner | {p.layout.WORLD_GROUP}, rebuilt
    if layout in ("tp_fsdp", "pp_dp"):  # the stayers' in-node group (TP, or the stage's DP) holds no leaver
        assert len(stayer) < len(joiner), rebuilt

    plan, = of(p.Event.RECOVERY_PLAN)
    done, = of(p.Event.RECOVERY_DONE)
    has_replica = LAYOUTS[layout][1]
    # the lost ranks' state comes from the other node's ranks: 0 -> 2 and 1 -> 3 when s1 (ranks 2, 3) was killed
    sends = [[2, 0], [3, 1]] if guarded else [[0, 2], [1, 3]]
    if has_replica:  # from the replica on the other node, nothing rolled back
        assert plan["rollback_step"] == -1 and sorted(plan["sends"]) == sends, plan
    else:  # rolled back to the last snapshot every rank held, sent by the ranks that kept the lost ranks' copies
        assert 0 <= plan["rollback_step"] < KILL_AT and plan["resume_step"] == plan["rollback_step"] + 1, plan
        assert sorted(plan["sends"]) == sends, plan
    warnings = of(p.Event.NO_REPLICA)
    assert bool(warnings) != has_replica, warnings
    if guarded:  # the guard of n1, warm since before the migration, adopted: no warm-up left to do
        started, = of(p.Event.RECOVERY_STARTED)
        assert started["adopted"] == {"n1": guard}, started
        assert [(e["standby"], e["node"]) for e in of(p.Event.GUARD_ASSIGNED)] == [(guard, "n1")]
        assert done["standbys"] == {"n1": guard} and done["phases_s"]["warm_up"] < 0.05, done
        assert [e["shadow_steps"] for e in of(p.Event.GUARD_WARMED)] == [1], of(p.Event.GUARD_WARMED)
    else:
        assert done["standbys"] == {"s1": "s2"}
        # on the failure's critical path (2 before 2026-11-25 09:00, 1 until 12:00): none where the recorded steps
        # 0, 1 and 2 issue the same collectives (HSDP); the pipeline's first step differs from its later ones
        n = {"hsdp": 0, "pp_dp": 1}[layout]
        assert done["shadow_steps"] == {"2": n, "3": n}, done
    final = [json.load(open(os.path.join(run_dir, "final", f))) for f in sorted(os.listdir(
        os.path.join(run_dir, "final")))]
    assert {f["steps"] for f in final} == {STEPS}

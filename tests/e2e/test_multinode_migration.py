"""End to end, in local mode with real processes: DDP over 4 nodes x 2 ranks and 2 standbys (a tiny GPT), two
nodes moved in ONE migration (``tmctl migrate --from n2,n4 --to s1,s2``: one id, one generation, one switch
step).

The tests of this module share one job, in order: requests that name a node or a standby twice, or pair counts
that differ, are refused with one line and the job is untouched; then the two-node migration commits, every rank's
final state is bit-identical to an uninterrupted run of the same seed (run first, before the job, so the two never
compete for the machine's cores), and the journal shows one migration with both pairs.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tmctl.localjob import (end_job, end_padding, events, final_hashes, job_client, pace_args, reference_hashes,
                            start_tmd, tmd_command, tmd_log, wait_until)
from tmd import protocol as p

NODES, RANKS_PER_NODE = 4, 2
STEPS = 60
# Per-node subgroups (a collective in them every step: n2's and n4's are rebuilt by their joiners alone).
ARGS = ("--group-size", "2")
# The job's steps are padded so that it outlives the migration on a loaded machine (numerics unchanged): 60 x 0.3 s
# = 18 s, against about 6 s from step 5 to the migration's downtime figure (three refused requests, then the
# migration) on a 2-core machine. Few steps keep the 8-rank reference short (about 0.13 s a step unpadded).
PAD = ("--min-step-time-s", "0.3")


def run_tmctl(run_dir: str, *args: str, timeout: float = 150) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tmctl.cli", *args, "--run-dir", run_dir],
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, str]:
    run_dir = str(tmp_path_factory.mktemp("reference"))
    return reference_hashes(run_dir, STEPS, ARGS, nodes=NODES, ranks_per_node=RANKS_PER_NODE, timeout_s=240)


@pytest.fixture(scope="module")
def job(tmp_path_factory, reference):
    run_dir = str(tmp_path_factory.mktemp("job"))
    proc = start_tmd(tmd_command(run_dir, 2, STEPS, True, True, ARGS + PAD + pace_args(run_dir), nodes=NODES,
                                 ranks_per_node=RANKS_PER_NODE), tmd_log(run_dir))
    try:
        client = job_client(run_dir, proc)
        status = lambda: client.request(p.StatusRequest())  # noqa: E731

        def ready() -> bool:
            st = status()
            return st.step > 5 and {n["name"] for n in st.nodes if n["warm"]} >= {"s1", "s2"}

        wait_until(ready, 150, "training and warm standbys s1 and s2")
        yield {"proc": proc, "run_dir": run_dir, "client": client, "status": status, "reference": reference}
    finally:
        end_job(proc)


@pytest.mark.timeout(300)  # the first test also runs the reference and starts the job (the module's fixtures)
@pytest.mark.parametrize("source, target, message", [
    ("n2,n2", "s1,s2", "node 'n2' is named twice among the nodes to move"),
    ("n2,n4", "s1,s1", "standby 's1' is named twice: one standby takes one node's ranks"),
    ("n2,n4", "s1", "2 node(s) to move (n2,n4) but 1 standby(s) to take them (s1): name one standby per node"),
])
def test_bad_multi_node_requests_fail_with_one_line_and_leave_the_job_alone(job, source, target, message):
    before = job["status"]()
    r = run_tmctl(job["run_dir"], "migrate", "--from", source, "--to", target)
    assert r.returncode == 2, r
    assert r.stderr.strip() == f"error: {message}", r.stderr
    after = job["status"]()
    assert after.generation == before.generation == 0 and after.migration is None
    assert {n["name"]: n["role"] for n in after.nodes} == {"n1": "active", "n2": "active", "n3": "active",
                                                           "n4": "active", "s1": "standby", "s2": "standby"}
    wait_until(lambda: job["status"]().step > after.step, 30, "training to go on")


@pytest.mark.timeout(150)
def test_two_nodes_move_in_one_migration(job):
    r = run_tmctl(job["run_dir"], "migrate", "--from", "n2,n4", "--to", "s1,s2", "--json", "--timeout-s", "120")
    assert r.returncode == 0, r.stderr
    m = json.loads(r.stdout.strip().splitlines()[-1])
    assert m["state"] == "committed", m
    assert (m["sources"], m["targets"], m["ranks"], m["generation"]) == (["n2", "n4"], ["s1", "s2"], [2, 3, 6, 7], 1)
    assert m["bytes_moved"] > 2 * 100_000  # four ranks' state (each pair its own transfer)
    # delta-based: stayers rebuilt only the world group, leavers nothing; each leaver node's subgroup was rebuilt
    # by its joiners alone (the two pairs' subgroups differ)
    rebuilt = m["rebuilt"]
    assert all(rebuilt[f"{n}/{lr}"] == ["world"] for n in ("n1", "n3") for lr in range(2)), rebuilt
    assert all(rebuilt[f"{n}/{lr}"] == [] for n in ("n2", "n4") for lr in range(2)), rebuilt
    for s in ("s1", "s2"):
        assert rebuilt[f"{s}/0"] == rebuilt[f"{s}/1"] and len(rebuilt[f"{s}/0"]) == 2 and "world" in rebuilt[f"{s}/0"]
    assert rebuilt["s1/0"] != rebuilt["s2/0"], rebuilt
    st = job["status"]()
    roles = {n["name"]: (n["role"], n["ranks"]) for n in st.nodes}
    assert roles["s1"] == ("active", [2, 3]) and roles["s2"] == ("active", [6, 7])
    assert roles["n2"][0] == roles["n4"][0] == "left" and roles["n1"] == ("active", [0, 1])
    assert st.world_size == 8 and st.generation == 1  # one generation for both pairs


@pytest.mark.timeout(300)
def test_final_state_is_bit_identical_and_the_journal_shows_one_migration_of_both_pairs(job):
    end_padding(job["run_dir"])  # the migration is over: the rest at the job's own speed
    assert job["proc"].wait(timeout=240) == 0
    reference, got = job["reference"], final_hashes(job["run_dir"])
    assert len(reference) == NODES * RANKS_PER_NODE and len(set(reference.values())) == 1
    assert got == reference
    journal = events(job["run_dir"])
    migration = [e for e in journal if e["event"].startswith("migration_") and "sources" in e]
    assert {e["migration_id"] for e in migration} == {1}
    assert all(e["sources"] == ["n2", "n4"] and e["targets"] == ["s1", "s2"] for e in migration)
    names = [e["event"] for e in migration]
    assert names == ["migration_requested", "migration_warming", "migration_prepared", "migration_switching",
                     "migration_transferred", "migration_committed"]
    assert len([e for e in journal if e["event"] == "switch_step_chosen"]) == 1
    refused = [e for e in journal if e["event"] == "migrate_refused"]
    assert len(refused) == 3 and all(e["code"] == "bad_request" for e in refused)
    left = [e for e in journal if e["event"] == "process_exit" and e["node"] in ("n2", "n4")]
    assert sorted(e["returncode"] for e in left) == [0, 0, 0, 0] and all(e["expected"] for e in left)

"""The scale benchmark's pure parts: the demo's group layout and the summary of a migration record's ``rebuilt``."""
from benchmarks import scale
from tmd import protocol as p


def test_groups_of_rank_world_and_node_block():
    assert scale.groups_of_rank(5, 8) == [list(range(8)), [4, 5]]
    assert scale.groups_of_rank(0, 8) == [list(range(8)), [0, 1]]
    assert scale.groups_of_rank(6, 7) == [list(range(7)), [6]]  # a last, short block


def test_groups_in_job():
    assert scale.groups_in_job(8) == 5
    assert scale.groups_in_job(32) == 17
    assert scale.groups_in_job(7) == 5


def test_rebuilt_by_role_counts_parties_and_groups():
    rebuilt = {"n1/0": ["world"], "n1/1": ["world"], "n3/0": ["world"], "n3/1": ["world"],
               "n2/0": [], "n2/1": [], "s1/0": ["world", "pg1"], "s1/1": ["world", "pg1"]}
    out = scale.rebuilt_by_role(rebuilt, ("n2",), ("s1",))
    assert out["per_party"] == {p.MigrationRole.STAYER: 1, p.MigrationRole.LEAVER: 0, p.MigrationRole.JOINER: 2}
    assert out["parties"] == {p.MigrationRole.STAYER: 4, p.MigrationRole.LEAVER: 2, p.MigrationRole.JOINER: 2}
    assert out["distinct_groups"] == 2
    assert out["memberships"] == 8


def test_rebuilt_by_role_empty_record():
    out = scale.rebuilt_by_role({}, ("n2",), ("s1",))
    assert set(out["per_party"].values()) == {None}
    assert out["memberships"] == 0 and out["distinct_groups"] == 0


def test_ratio():
    assert scale.ratio(0.1, 0.15) == 1.5
    assert scale.ratio(None, 1.0) is None
    assert scale.ratio(0.0, 1.0) is None


def test_summarize_takes_medians_over_the_committed_jobs_and_keeps_every_sample():
    committed = p.MigrationState.COMMITTED
    jobs = [{"state": committed, "world": 8, "switch_stall_s": 0.03, "prepare_s": 0.1, "rebuilt": "first"},
            {"state": p.MigrationState.ABORTED, "reason": "timed out", "world": 8, "switch_stall_s": 9.0},
            {"state": committed, "world": 8, "switch_stall_s": 0.01, "prepare_s": None, "rebuilt": "third"},
            {"state": committed, "world": 8, "switch_stall_s": 0.02, "prepare_s": 0.3, "rebuilt": "fourth"}]
    out = scale.summarize(jobs)
    assert out["switch_stall_s"] == 0.02  # the aborted job's 9 s is not a switch figure
    assert out["prepare_s"] == 0.2 and out["downtime_s"] is None  # medians of what the committed jobs have
    assert out["rebuilt"] == "first" and out["jobs_committed"] == 3
    assert [s["switch_stall_s"] for s in out["samples"]] == [0.03, 9.0, 0.01, 0.02]
    assert out["samples"][1]["reason"] == "timed out"


def test_summarize_of_jobs_that_all_failed_is_the_first_ones_record():
    jobs = [{"state": None, "world": 32, "error": "tmd exited"}, {"state": None, "world": 32, "error": "again"}]
    out = scale.summarize(jobs)
    assert out["error"] == "tmd exited" and out["jobs_committed"] == 0 and out["switch_stall_s"] is None

"""The pure part of benchmarks/migration.py: repeated jobs of one switch path, reduced to the median-stall job."""
from benchmarks import migration


def test_the_median_stall_job_is_reported_with_every_sample_and_the_medians(monkeypatch):
    stalls = iter([0.089, 0.079, 0.057])
    dirs = []

    def run_live(steps, migrate_at, tiny, run_dir, **kwargs):
        dirs.append(run_dir)
        stall = next(stalls)
        return {k: 0.0 for k in migration.SAMPLED} | {"switch_step": 22, "switch_stall_s": stall,
                                                         "state": "committed", "phases_s": {"n": len(dirs)}}

    monkeypatch.setattr(migration, "run_live", run_live)
    out = migration.run_repeated(3, "tmrun/x/live", steps=40, migrate_at=15, tiny=True)
    assert dirs == ["tmrun/x/live.0", "tmrun/x/live.1", "tmrun/x/live.2"]
    assert out["switch_stall_s"] == 0.079 and out["run_dir"] == "tmrun/x/live.1" and out["phases_s"] == {"n": 2}
    assert [s["switch_stall_s"] for s in out["samples"]] == [0.089, 0.079, 0.057]
    assert out["medians"]["switch_stall_s"] == 0.079 and out["medians"]["switch_step"] == 22
    assert out["all_committed"]


def test_an_aborted_job_or_a_missing_figure_shows(monkeypatch):
    runs = iter([{"switch_stall_s": None, "state": "aborted"}, {"switch_stall_s": 0.05, "state": "committed"}])
    monkeypatch.setattr(migration, "run_live", lambda *a, **k: {k: None for k in migration.SAMPLED} | next(runs))
    out = migration.run_repeated(2, "d", steps=40, migrate_at=15, tiny=True)
    assert not out["all_committed"]
    assert out["switch_stall_s"] == 0.05  # a job without a stall sorts last
    assert "switch_stall_s" not in out["medians"]  # a median over fewer jobs than ran would mislead

"""benchmarks/checkpoint.py's summary: the stall and overhead per mode, against the step time and dcp.save's stall,
from every rank's timings (the slowest rank counts)."""
import pytest

from benchmarks import checkpoint as bench


def ranks(stall: dict[str, list[float]], step_s: float = 1.0, slow: float = 0.0) -> list[dict]:
    """Two ranks' timings: 10 steps per mode at ``step_s`` (rank 1 ``slow`` s slower), a checkpoint every 5."""
    out = []
    for r in range(2):
        timing = {"none": {"steps": [step_s + r * slow] * 10, "stalls": []}}
        for mode in bench.MODES[1:]:
            timing[mode] = {"steps": [step_s + r * slow] * 10, "stalls": [s + r * 0.01 for s in stall[mode]]}
        timing["load"] = {"s": 0.5 + r, "step": 40, "save_error": None}
        out.append(timing)
    return out


def test_the_stall_is_the_slowest_rank_s_and_compared_with_dcp_save():
    out = bench.summarise(ranks({"dcp_sync": [0.4, 0.4], "dcp_async_torchtitan": [0.2, 0.2],
                                 "trainmover": [0.05, 0.09]}), every=5)
    assert out["baseline_step_s"] == 1.0 and out["load_s"] == 1.5 and out["loaded_step"] == 40
    tm = out["modes"]["trainmover"]
    assert tm["checkpoints"] == 2 and tm["stall_s"]["all"] == pytest.approx([0.06, 0.1])
    assert tm["stall_s"]["median"] == pytest.approx(0.08)
    assert tm["stall_vs_sync"] == pytest.approx(0.08 / 0.41)
    assert tm["amortised_at_50"] == pytest.approx(0.08 / 50)
    assert out["modes"]["dcp_sync"]["stall_vs_sync"] == 1.0
    assert out["met"] == {"stall_le_0.25x_sync": True, "amortised_le_2pct": True}


def test_targets_are_missed_when_the_stall_is_not_small():
    out = bench.summarise(ranks({"dcp_sync": [0.4, 0.4], "dcp_async_torchtitan": [0.2, 0.2],
                                 "trainmover": [0.2, 0.2]}, step_s=0.5), every=5)
    assert out["met"] == {"stall_le_0.25x_sync": False, "amortised_le_2pct": True}
    out = bench.summarise(ranks({"dcp_sync": [9.0, 9.0], "dcp_async_torchtitan": [1.0, 1.0],
                                 "trainmover": [0.6, 0.6]}, step_s=0.5), every=5)
    assert out["met"] == {"stall_le_0.25x_sync": True, "amortised_le_2pct": False}


def test_interference_is_the_extra_time_of_the_steps_after_a_save():
    timing = ranks({m: [0.1, 0.1] for m in bench.MODES[1:]}, slow=0.0)
    for r in timing:
        r["trainmover"]["steps"] = [1.0] * 5 + [1.2] * 5  # the 5 steps after the first save are 0.2 s slower
    out = bench.summarise(timing, every=5)
    assert out["modes"]["trainmover"]["interference_s"] == pytest.approx(1.0)
    assert out["modes"]["dcp_sync"]["interference_s"] == 0.0

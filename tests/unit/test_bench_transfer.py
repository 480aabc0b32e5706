"""The pure parts of benchmarks/transfer.py: throughput arithmetic and the target check."""
import pytest

from benchmarks import transfer as bench


def test_gbps_is_bytes_over_the_median_time():
    assert bench.gbps(2_000_000_000, [1.0, 4.0, 0.5]) == pytest.approx(2.0)


def test_summary_ratios_and_target():
    out = bench.summarize(1_000_000_000, {"ours": [0.5, 0.5, 0.6], "bound": [0.4, 0.4, 0.4],
                                          "gloo": [1.0, 1.0, 1.0]})
    assert out["ours"]["gb_per_s"] == pytest.approx(2.0)
    assert out["ours_over_bound"] == pytest.approx(0.8) and out["met"]
    assert out["ours_over_gloo"] == pytest.approx(2.0)
    assert not bench.summarize(1, {"ours": [1.0], "bound": [0.5], "gloo": [1.0]})["met"]


def test_state_sizes_build_a_gpt_with_its_adamw_state():
    objects = bench.build_state("demo", seed=0)
    n = bench.payload_bytes(objects)
    params = sum(p.numel() * 4 for p in objects["model"].parameters())
    assert 3 * params <= n <= 3 * params + 1_000_000  # weights + AdamW's two moments (+ buffers and steps)

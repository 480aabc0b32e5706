"""benchmarks/tail.py: its sizes, its summary, and one small real run over two processes (every tensor kept, the
joiner takes the leaver's changed learning rate)."""
import pytest

from benchmarks import tail as bench


def test_sizes_are_demo_or_an_even_parameter_count():
    assert bench.parameters("demo") == 0 and bench.parameters("10") == 10
    for bad in ("3", "0", "-2", "x", ""):
        with pytest.raises(ValueError):
            bench.parameters(bad)
    objects = bench.build("10")
    assert len(list(objects["model"].parameters())) == 10
    assert bench.tail_tensors(objects) == 4 * 10  # each parameter, and AdamW's step, exp_avg, exp_avg_sq


def test_summary_is_medians_in_ms_and_the_slower_end_per_tensor():
    out = bench.summarize(100, [0.001, 0.003, 0.002], [0.004, 0.004, 0.001])
    assert out == {"leaver_cpu_ms": 2.0, "joiner_cpu_ms": 4.0, "us_per_tensor": 40.0}


@pytest.mark.timeout(120)
def test_a_small_run_keeps_every_tensor_and_reports_both_cases():
    result = bench.run(["10"], reps=2)
    size = result["sizes"]["10"]
    assert size["tensors"] == size["kept"] == 40  # nothing travelled by value: the replay's case
    for case in bench.CASES:
        assert size[case]["leaver_cpu_ms"] > 0 and size[case]["joiner_cpu_ms"] > 0

"""examples.pacing: steps padded to --min-step-time-s while --pace-file exists, never a shadow iteration."""
from __future__ import annotations

import time

import pytest

from examples import pacing


@pytest.fixture
def sleeps(monkeypatch) -> list[float]:
    slept: list[float] = []
    monkeypatch.setattr(pacing.time, "sleep", slept.append)
    return slept


def test_pads_the_rest_of_the_step_while_the_pace_file_exists(tmp_path, sleeps):
    pace = tmp_path / "job.pace"
    pace.touch()
    pacer = pacing.Pacer(0.5, str(pace))
    pacer.pad(time.perf_counter())
    assert len(sleeps) == 1 and 0.4 < sleeps[0] <= 0.5, sleeps
    pace.unlink()
    pacer.pad(time.perf_counter())
    pace.touch()  # gone once is gone for good: the job trains at its own speed to the end
    pacer.pad(time.perf_counter())
    assert len(sleeps) == 1, sleeps


def test_no_pace_file_pads_every_step_and_never_a_shadow_iteration(sleeps):
    pacer = pacing.Pacer(0.5)
    pacer.pad(time.perf_counter())
    pacer.pad(time.perf_counter(), shadow=True)
    pacer.pad(time.perf_counter() - 1.0)  # the step already took longer
    assert len(sleeps) == 1, sleeps


def test_the_arguments_build_a_pacer():
    import argparse

    parser = argparse.ArgumentParser()
    pacing.add_arguments(parser)
    pacer = pacing.Pacer.from_args(parser.parse_args(["--min-step-time-s", "0.2", "--pace-file", "/x"]))
    assert (pacer.min_step_time_s, pacer.pace_file) == (0.2, "/x")
    assert pacing.Pacer.from_args(parser.parse_args([])).min_step_time_s == 0.0

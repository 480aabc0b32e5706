"""Step padding for tests and demos: a small model made to train at a bigger model's pace, numerics unchanged.

``--min-step-time-s X`` makes every step last at least X seconds (the rank sleeps the rest after its update), so that
a migration or a fault has time to happen between two steps on a fast host. ``--pace-file PATH`` limits that to
the time PATH exists: each rank looks once per step (one ``stat``), and once PATH is gone the job trains at its own
speed. A test that needs a slow job only until its fault happened (the end-to-end tests: ``tmctl.localjob.Job``
makes the file and :meth:`~tmctl.localjob.Job.end_padding` removes it) so does not wait for a padded tail. Shadow
iterations are never padded: a joiner's warm-up is the runtime's to time. Used by examples.train_gpt,
examples.train_llama and examples.torchtitan.train.
"""
from __future__ import annotations

import argparse
import os
import time
from typing import Optional


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--min-step-time-s`` (seconds, default 0: no padding) and ``--pace-file`` to ``parser``."""
    parser.add_argument("--min-step-time-s", type=float, default=0.0,
                        help="pad each step to at least this many seconds (stands in for a bigger model; numerics "
                             "unchanged)")
    parser.add_argument("--pace-file", default=None, metavar="PATH",
                        help="pad only while PATH exists (tests remove it once their fault happened)")


class Pacer:
    """Pads steps to ``min_step_time_s`` seconds while ``pace_file`` exists (always, when it is None)."""

    def __init__(self, min_step_time_s: float, pace_file: Optional[str] = None) -> None:
        self.min_step_time_s = min_step_time_s
        self.pace_file = pace_file

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "Pacer":
        return cls(args.min_step_time_s, args.pace_file)

    def pad(self, step_started: float, shadow: bool = False) -> None:
        """Sleep until ``step_started`` (a ``time.perf_counter()`` value, seconds) plus ``min_step_time_s``, unless
        the step already took that long, this is a shadow iteration (``shadow``), or the pace file is gone."""
        pad = self.min_step_time_s - (time.perf_counter() - step_started)
        if pad <= 0 or shadow:
            return
        if self.pace_file is not None and not os.path.exists(self.pace_file):
            self.min_step_time_s = 0.0  # gone for good: no more look-ups
            return
        time.sleep(pad)

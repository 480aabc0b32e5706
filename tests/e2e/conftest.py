"""Fixtures shared by the end-to-end tests.

``start_job`` starts a job for the test (tmctl.localjob.Job): ``start_job(standbys, steps, *script_args,
tmd_args=(), **options)`` runs ``tmd local`` in the test's ``tmp_path`` (``job``, then ``job2``, ...) and returns
the Job; every job a test started is ended (tmd terminated if it still runs) when the test ends, after a failed
test's report took each job's stacks and journal.

``gpt_reference`` is the uninterrupted run a tiny-GPT test (2 x 2 by default) compares its final state with. Calling
``gpt_reference(steps, *script_args, nodes=2, ranks_per_node=2)`` returns {rank: final state sha256} of a
``tmd local`` job of that many steps with no standby and ``script_args`` passed to examples.train_gpt (--tiny).
Runs are cached for the whole session per (steps, script_args, nodes, ranks_per_node), so a test module that asks
for a run another module already made pays nothing; test modules are collected in alphabetical order, and the
first to ask pays one launch (about 15 s plus about 0.04 s per step on 2 cores). Pass only arguments that change
the numerics (the seed mode, dropout): padding such as ``--min-step-time-s`` or ``--group-size`` does not, and
belongs to the job under test, not to its reference. Each run is checked to give every rank one and the same
hash (data parallel: parameters and optimizer state are replicated), and to have nodes x ranks_per_node ranks.
Call it before starting the job under test (in the test, or in the fixture that starts the job), never while
that job runs: a cache miss would then compete with it for the machine's cores and slow its heartbeats.
"""
from __future__ import annotations

import glob
import os

import pytest

from tmctl import warm_start
from tmctl.localjob import Job, diagnose, reference_hashes


@pytest.fixture(scope="session", autouse=True)
def _warm_start():
    """Every tmd these tests start through tmctl.localjob (Job, reference_hashes, start_tmd) is forked from one warm
    image where it can be (tmctl.warm_start): about 4 s less per job here, and the same final states."""
    warm_start.enable()


@pytest.fixture
def start_job(tmp_path):
    started: list[Job] = []

    def start(standbys: int, steps: int, *script_args: str, **options) -> Job:
        job = Job(str(tmp_path / f"job{len(started) + 1 if started else ''}"), standbys, steps, *script_args,
                  **options)
        started.append(job)
        return job

    yield start
    while started:
        started.pop().close()


@pytest.fixture(scope="session")
def gpt_reference(tmp_path_factory):
    cache: dict[tuple, dict[int, str]] = {}

    def get(steps: int, *script_args: str, nodes: int = 2, ranks_per_node: int = 2) -> dict[int, str]:
        key = (steps, script_args, nodes, ranks_per_node)
        if key not in cache:
            run_dir = str(tmp_path_factory.mktemp(f"gpt-reference-{steps}"))
            hashes = reference_hashes(run_dir, steps, script_args, nodes=nodes, ranks_per_node=ranks_per_node)
            assert len(hashes) == nodes * ranks_per_node and len(set(hashes.values())) == 1, hashes
            cache[key] = hashes
        return cache[key]

    return get


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed end-to-end test's report carries each of its jobs' stacks, last events and log tails
    (tmctl.localjob.diagnose): CI keeps only what the run printed, not the run directories."""
    outcome = yield
    report = outcome.get_result()
    tmp_path = item.funcargs.get("tmp_path") if hasattr(item, "funcargs") else None
    if call.when != "call" or not report.failed or tmp_path is None:
        return
    for journal in sorted(glob.glob(os.path.join(str(tmp_path), "**", "events.jsonl"), recursive=True)):
        run_dir = os.path.dirname(journal)
        report.sections.append((f"job in {run_dir}", diagnose(run_dir)))

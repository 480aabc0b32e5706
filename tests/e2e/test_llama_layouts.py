"""The hybrid-parallel layouts of ``examples/train_llama.py`` trained without the runtime (``--plain``: a gloo
world of 4 processes, 1 thread each, started torchrun-style from the environment; forked from one process that
imported torch once, tests/support/forked.py): FSDP2 over 4, HSDP 2x2, PP 2 x FSDP2 2 (1F1B), PP 2 x DDP 2
(GPipe).

Each layout trains ``--tiny`` for a few steps; the loss must be finite and lower at the end than at the start and
every rank must write its final JSON; for PP x FSDP2 (not run under the runtime by tests/e2e/test_hybrid.py, which
compares the other layouts bit for bit) a second identical run must give the same final hash on every rank.
Also checked: HSDP replicas hold identical shards (same hash at the same shard coordinate), and a world size that
is not the product of the degrees fails with a one-line error.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest

from tests.support.forked import Launcher, torchrun, torchrun_env

WORLD = 4
STEPS = 4
LAYOUT_MODULES = ["examples.train_llama", "torch.distributed.fsdp", "torch.distributed.tensor.parallel",
                  "torch.distributed.pipelining"]  # what the launcher imports once for every rank


@pytest.fixture(scope="module")
def launcher():
    """Forks every rank from one process that imported torch and the layouts' modules once (tests.support.forked):
    the module's 6 jobs of 2-4 ranks paid 3-5 s of CPU per fresh interpreter."""
    with Launcher(LAYOUT_MODULES, torchrun_env()) as launcher:
        yield launcher


def _launch(launcher: Launcher, run_dir: str, world: int, extra: list[str]) -> list[subprocess.CompletedProcess]:
    """Run ``examples.train_llama --plain --tiny`` on ``world`` ranks (one process each, torchrun-style
    environment); returns their results (stdout and stderr: the rank's log, both streams)."""
    return torchrun(launcher, [sys.executable, "-m", "examples.train_llama", "--plain", "--tiny", "--steps", str(STEPS),
                               "--log-every", "1", "--run-dir", run_dir, *extra], world, run_dir)


def _finals(run_dir: str, world: int) -> dict[int, dict]:
    out = {}
    for rank in range(world):
        with open(os.path.join(run_dir, "final", f"rank{rank}.json")) as f:
            out[rank] = json.load(f)
    return out


def _train(launcher: Launcher, run_dir: str, extra: list[str]) -> tuple[dict[int, dict], list[float]]:
    """Train one layout; returns every rank's final JSON and rank 0's logged losses (one per step)."""
    results = _launch(launcher, run_dir, WORLD, extra)
    for rank, r in enumerate(results):
        assert r.returncode == 0, f"rank {rank} exited {r.returncode}:\n{r.stderr[-3000:]}"
    losses = [float(m) for m in re.findall(r"^step\s+\d+/\d+\s+loss (\S+)", results[0].stdout, re.MULTILINE)]
    return _finals(run_dir, WORLD), losses


# TP x FSDP2 trains under the runtime in tests/e2e/test_hybrid.py (bit for bit against a reference), and so do
# HSDP and PP x DDP; FSDP2 over 4 (one mesh dimension) trains only here
LAYOUTS = {
    "fsdp4": ["--dp-shard", "4"],
    "hsdp2x2": ["--dp-replicate", "2", "--dp-shard", "2"],
    "pp2_fsdp2_1f1b": ["--pp", "2", "--dp-shard", "2", "--pp-schedule", "1f1b"],
    "pp2_ddp2_gpipe": ["--pp", "2", "--dp-replicate", "2", "--pp-schedule", "gpipe", "--microbatches", "4"],
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layout_trains_and_is_deterministic(layout, tmp_path, launcher):
    first, losses = _train(launcher, str(tmp_path / "a"), LAYOUTS[layout])
    assert len(losses) == STEPS, losses
    assert all(math.isfinite(x) for x in losses), losses
    assert losses[-1] < losses[0], f"loss did not go down: {losses}"
    for rank, d in first.items():
        assert d["rank"] == rank and d["steps"] == STEPS and len(d["state_sha256"]) == 64
        assert d["loss"] is not None and math.isfinite(d["loss"])
    if layout == "pp2_fsdp2_1f1b":  # the others' determinism is checked under the runtime (tests/e2e/test_hybrid.py)
        second, losses2 = _train(launcher, str(tmp_path / "b"), LAYOUTS[layout])
        assert losses2 == losses
        assert {r: d["state_sha256"] for r, d in second.items()} == {r: d["state_sha256"] for r, d in first.items()}
    if layout == "fsdp4":  # every rank holds its own quarter of the parameters and optimizer state
        assert len({d["state_sha256"] for d in first.values()}) == WORLD
    if layout == "hsdp2x2":  # replicate dim outermost: rank r and r + 2 hold the same shard
        assert first[0]["state_sha256"] == first[2]["state_sha256"]
        assert first[1]["state_sha256"] == first[3]["state_sha256"]
        assert first[0]["state_sha256"] != first[1]["state_sha256"]
    if layout == "pp2_ddp2_gpipe":  # each stage's two DDP replicas are identical
        assert first[0]["state_sha256"] == first[1]["state_sha256"]
        assert first[2]["state_sha256"] == first[3]["state_sha256"]


@pytest.mark.timeout(120)
def test_world_size_not_the_product_of_the_degrees_is_a_clear_error(tmp_path, launcher):
    results = _launch(launcher, str(tmp_path), 2, ["--tp", "2", "--dp-shard", "2"])
    for r in results:
        assert r.returncode != 0
        assert "world size 2 != pp 1 x dp_replicate 1 x dp_shard 2 x tp 2 = 4" in r.stderr

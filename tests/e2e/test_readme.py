"""The README's "Using it" script runs as written: extracted from README.md, started by ``tmd local`` on 1 node x 2
ranks, it trains its 20 steps, every rank reports done, and no rank warns (``state_after_update``,
``nothing_managed``, ``unmanaged_parameters``: the script follows the README's own rules). The user guide carries
the same script, character for character."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tmctl.localjob import events

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def readme_script() -> str:
    """The first ``python`` block under the README's "## Using it" heading."""
    with open(os.path.join(REPO_ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    start = text.index("```python\n", text.index("\n## Using it\n")) + len("```python\n")
    return text[start:text.index("```\n", start)]


def test_the_user_guide_carries_the_readmes_script():
    with open(os.path.join(REPO_ROOT, "docs", "user-guide.md"), encoding="utf-8") as f:
        assert "```python\n" + readme_script() + "```\n" in f.read()


@pytest.mark.timeout(240)
def test_the_readmes_script_trains_under_the_runtime(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(readme_script())
    run_dir = str(tmp_path / "run")
    env = {**os.environ, "PYTHONPATH": REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "tmd.cli", "local", "--nodes", "1", "--ranks-per-node", "2",
                           "--standbys", "0", "--run-dir", run_dir, "--quiet", "--", sys.executable, str(script)],
                          env=env, capture_output=True, text=True, timeout=200)
    journal = events(run_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted((e["rank"], e["final_step"]) for e in journal if e["event"] == "rank_done") == [(0, 19), (1, 19)]
    assert [e for e in journal if e["event"] == "job_warning"] == []
    assert any(e["event"] == "job_finished" for e in journal)

"""The documentation site builds with ``mkdocs build --strict`` (broken links, missing pages and pages left out of
the nav fail), and the README stays the short entry point the docs link from. Skipped only where mkdocs-material is
not installed (scripts/setup.sh installs it)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _build(config_dir: str, site_dir: str) -> subprocess.CompletedProcess:
    pytest.importorskip("mkdocs", reason="mkdocs-material is not installed (pip install -e .[docs])")
    pytest.importorskip("material", reason="mkdocs-material is not installed (pip install -e .[docs])")
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f",
                           os.path.join(config_dir, "mkdocs.yml"), "-d", site_dir],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})


@pytest.mark.timeout(150)
def test_the_site_builds_strictly(tmp_path):
    built = _build(REPO_ROOT, str(tmp_path / "site"))
    assert built.returncode == 0, built.stdout + built.stderr
    for page in ("user-guide", "limits", "slurm", "operations", "security", "architecture", "benchmarks",
                 "performance-notes"):
        assert os.path.exists(tmp_path / "site" / page / "index.html"), page
    assert os.path.exists(tmp_path / "site" / "results" / "migration.png")  # the benchmarks' pictures are served


@pytest.mark.timeout(150)
def test_a_broken_link_fails_the_build(tmp_path):
    copy = tmp_path / "repo"
    shutil.copytree(os.path.join(REPO_ROOT, "docs"), copy / "docs")
    shutil.copy(os.path.join(REPO_ROOT, "mkdocs.yml"), copy / "mkdocs.yml")
    os.makedirs(copy / "scripts")
    shutil.copy(os.path.join(REPO_ROOT, "scripts", "mkdocs_hooks.py"), copy / "scripts")
    os.symlink(os.path.join(REPO_ROOT, "benchmarks"), copy / "benchmarks")
    with open(copy / "docs" / "limits.md", "a", encoding="utf-8") as f:
        f.write("\nSee [the missing page](no-such-page.md).\n")
    built = _build(str(copy), str(tmp_path / "site"))
    assert built.returncode != 0 and "no-such-page.md" in built.stdout + built.stderr


def test_the_readme_is_short_and_every_docs_page_it_links_exists():
    with open(os.path.join(REPO_ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    assert readme.count("\n") <= 250
    links = set(re.findall(r"\]\((docs/[^)#]+)", readme))
    assert {"docs/user-guide.md", "docs/slurm.md", "docs/security.md", "docs/limits.md", "docs/benchmarks.md"} <= links
    for link in links:
        assert os.path.exists(os.path.join(REPO_ROOT, link)), link


def _metrics_served() -> set[str]:
    """The metric names tmd serves: those its module's docstring tables list (one source with the code,
    tests/unit/test_metrics.py holds the code to them)."""
    from tmd import metrics
    return set(re.findall(r"``(trainmover_[a-z_]+)", metrics.__doc__))


def test_every_metric_the_docs_name_is_served():
    served = _metrics_served()
    assert {"trainmover_job_failed", "trainmover_steps_total", "trainmover_standbys"} <= served
    named: dict[str, str] = {}
    for page in sorted(os.listdir(os.path.join(REPO_ROOT, "docs"))) + ["../README.md"]:
        if page.endswith(".md") and page != "benchmarks.md":  # that one names the benchmarks' JSON keys
            with open(os.path.join(REPO_ROOT, "docs", page), encoding="utf-8") as f:
                for name in re.findall(r"\btrainmover_[a-z_]+", f.read()):
                    named.setdefault(re.sub(r"_(bucket|sum|count)$", "", name), page)
    unknown = {name: page for name, page in named.items() if name not in served}
    assert not unknown, f"metrics named in the docs that tmd does not serve: {unknown}"


def test_the_alert_rules_parse_and_use_served_metrics():
    yaml = pytest.importorskip("yaml", reason="PyYAML comes with mkdocs")
    with open(os.path.join(REPO_ROOT, "docs", "operations.md"), encoding="utf-8") as f:
        text = f.read()
    block = text[text.index("```yaml\n", text.index("## Alerts")) + 8:]
    rules = yaml.safe_load(block[:block.index("```")])["groups"][0]["rules"]
    assert [r["alert"] for r in rules][:2] == ["TrainMoverJobFailed", "TrainMoverNoProgress"]
    for rule in rules:
        assert rule["labels"]["severity"] in ("page", "ticket"), rule
        assert set(re.findall(r"\btrainmover_[a-z_]+", rule["expr"])) <= _metrics_served(), rule

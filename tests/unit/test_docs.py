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

"""tmd.protocol.env: every TM_* environment variable the code reads is listed once, and the user guide's table is
generated from that list."""
from __future__ import annotations

import os
import re

import pytest

from tmd.protocol import env

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GUIDE = os.path.join(REPO_ROOT, "docs", "user-guide.md")
# where the project's code lives: whatever these read must be in the table
SCANNED = ("tmd", "worker", "tmctl", "slurm", "examples", "benchmarks", "scripts")
NAME = re.compile(r"\bTM_[A-Z][A-Z0-9_]*[A-Z0-9]\b")


def _names_in(paths: tuple[str, ...]) -> dict[str, str]:
    """{TM_* name: first file naming it} over the text files under ``paths`` (relative to the repository)."""
    found: dict[str, str] = {}
    for top in paths:
        for root, dirs, files in os.walk(os.path.join(REPO_ROOT, top)):
            dirs[:] = [d for d in dirs if d not in ("__pycache__", "results", "peers")]
            for name in files:
                if name.endswith((".so", ".png", ".pyc", ".json")):
                    continue
                path = os.path.join(root, name)
                if path == env.__file__:
                    continue
                with open(path, encoding="utf-8", errors="replace") as f:
                    for match in NAME.findall(f.read()):
                        found.setdefault(match, os.path.relpath(path, REPO_ROOT))
    return found


def test_every_variable_the_code_reads_is_listed():
    names = _names_in(SCANNED)
    assert {"TM_ABORT_IN_FORWARD", "TM_EXIT_DRAIN_S", "TM_PRECOPY", "TM_KEYS"} <= set(names)  # the scan works
    missing = {n: where for n, where in names.items() if n not in env.BY_NAME}
    assert not missing, f"TM_* variables read but not in tmd/protocol/env.py: {missing}"


def test_every_listed_variable_is_read_somewhere():
    names = _names_in(SCANNED + ("tests",))
    stale = [v.name for v in env.VARIABLES if v.name not in names]
    assert not stale, f"listed in tmd/protocol/env.py but read nowhere: {stale}"


def test_each_variable_is_listed_once_with_a_default_and_a_meaning():
    assert len(env.BY_NAME) == len(env.VARIABLES)
    for v in env.VARIABLES:
        assert NAME.fullmatch(v.name) and v.default and v.scope and v.meaning.endswith("."), v


def test_the_user_guides_table_is_current():
    with open(GUIDE, encoding="utf-8") as f:
        text = f.read()
    assert env.spliced(text) == text, "run: python -m tmd.protocol.env --write docs/user-guide.md"
    for v in env.VARIABLES:
        assert f"| `{v.name}` | {v.default} |" in text


def test_splicing_replaces_only_between_the_markers_and_refuses_without_them():
    text = f"before\n{env.TABLE_BEGIN}\nold table\n{env.TABLE_END}\nafter\n"
    new = env.spliced(text)
    assert new.startswith(f"before\n{env.TABLE_BEGIN}\n| variable |") and new.endswith(f"{env.TABLE_END}\nafter\n")
    assert "old table" not in new and env.spliced(new) == new
    with pytest.raises(ValueError, match="markers"):
        env.spliced("no markers here")


def test_check_exits_1_on_a_stale_table(tmp_path):
    page = tmp_path / "guide.md"
    page.write_text(f"{env.TABLE_BEGIN}\n| stale |\n{env.TABLE_END}\n")
    assert env.main(["--check", str(page)]) == 1
    assert env.main(["--write", str(page)]) == 0 and env.main(["--check", str(page)]) == 0

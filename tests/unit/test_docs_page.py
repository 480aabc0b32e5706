"""benchmarks.docs_page: the benchmarks page is generated from benchmarks/results/*.json and the committed page is
current with them."""
from __future__ import annotations

import json

from benchmarks import docs_page


def test_the_committed_page_is_current_with_the_results():
    with open(docs_page.PAGE, encoding="utf-8") as f:
        committed = f.read()
    assert committed == docs_page.render(), "run: python -m benchmarks.docs_page"


def test_a_result_becomes_a_section_with_its_targets_tables_and_pictures(tmp_path):
    result = {
        "workload": {"model": "gpt", "nodes": 2},
        "runs": {"plain": {"wall_s": 1.23456, "ok": True, "final_hashes": {"0": "ab"}},
                 "kill": {"wall_s": 2.0, "ok": False, "lost_s": None}},
        "series": [1, 2, 3],
        "ratio": 40.7,
        "targets": {"ratio_min": 30},
        "met": {"ratio": True, "stall": False},
        "machine": {"date": "2026-11-28T00:00:00+00:00", "cpu_model": "X", "cpu_count": 2, "torch": "2.13",
                    "python": "3.11"},
    }
    (tmp_path / "migration.json").write_text(json.dumps(result))
    for png in ("migration-2.png", "migration-1.png", "migration-10.png", "other.png"):
        (tmp_path / png).write_bytes(b"")
    page = docs_page.render(str(tmp_path))
    assert "| [migration](#migration) | 2026-11-28T00:00:00+00:00 | `ratio` | `stall` |" in page
    assert "## migration\n" in page and "python -m benchmarks.migration" in page  # the module's docstring
    assert "| `ratio` | 40.7 |" in page and "| `ratio_min` | 30 |" in page
    assert "| | `plain` | `kill` |" in page and "| `wall_s` | 1.235 | 2 |" in page and "| `ok` | yes | no |" in page
    assert "| `lost_s` |  | — |" in page  # a field one run lacks is blank, a None a dash
    assert "final_hashes" not in page and "series" not in page  # data, not figures
    pictures = [line for line in page.splitlines() if line.startswith("![")]
    assert pictures == [f"![migration-{k}.png](../benchmarks/results/migration-{k}.png)" for k in (1, 2, 10)]


def test_check_exits_1_when_the_page_is_stale(tmp_path):
    (tmp_path / "tail.json").write_text(json.dumps({"reps": 3}))
    page = tmp_path / "benchmarks.md"
    assert docs_page.main(["--check", "--results", str(tmp_path), "--page", str(page)]) == 1
    assert docs_page.main(["--results", str(tmp_path), "--page", str(page)]) == 0
    assert docs_page.main(["--check", "--results", str(tmp_path), "--page", str(page)]) == 0
    (tmp_path / "tail.json").write_text(json.dumps({"reps": 4}))  # a new run saved: the page is stale again
    assert docs_page.main(["--check", "--results", str(tmp_path), "--page", str(page)]) == 1


def test_saving_a_result_regenerates_the_page(tmp_path, monkeypatch):
    from benchmarks import report
    results, page = tmp_path / "results", tmp_path / "docs" / "benchmarks.md"
    page.parent.mkdir()
    monkeypatch.setattr(report, "RESULTS_DIR", str(results))
    monkeypatch.setattr(docs_page, "PAGE", str(page))
    written = report.save("tail", {"reps": 7}, results_dir=str(results))
    assert written[-1] == str(page) and page.read_text() == docs_page.render(str(results))
    assert "| `reps` | 7 |" in page.read_text()
    report.save("tail", {"reps": 7}, results_dir=str(tmp_path / "elsewhere"))  # not the results dir: page untouched
    assert "| `reps` | 7 |" in page.read_text() and not (tmp_path / "elsewhere" / "benchmarks.md").exists()

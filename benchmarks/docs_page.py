"""The documentation's benchmarks page, generated from the saved results: ``docs/benchmarks.md``.

    python -m benchmarks.docs_page            # rewrite docs/benchmarks.md from benchmarks/results/*.json
    python -m benchmarks.docs_page --check    # exit 1 if the committed page is not what the results give

One section per ``benchmarks/results/<name>.json`` (alphabetical): how the benchmark measures (its module's
docstring), the machine and date of the run, its targets and whether they were met, its figures as tables, and the
timeline pictures :func:`benchmarks.report.save` kept beside it (``<name>.png``, ``<name>-<k>.png``). Nothing on
the page is written by hand; the reasoning behind the figures is in ``docs/performance-notes.md``.

The tables are read off the JSON's structure, whatever the benchmark: scalars become ``key | value`` rows (nested
dicts flattened to dotted keys), and a dict or list of like records (runs, layouts, sizes, faults; or top-level
siblings with the same fields) becomes one table with a column per record. Per-process series, hashes, raw event
lists and run directories are left out (they are in the JSON).
"""
from __future__ import annotations

import argparse
import ast
import glob
import json
import os
import re
import sys
from typing import Any, Iterator

BENCHMARKS_DIR = os.path.dirname(os.path.abspath(__file__))
RESULTS_DIR = os.path.join(BENCHMARKS_DIR, "results")
REPO_ROOT = os.path.dirname(BENCHMARKS_DIR)
PAGE = os.path.join(REPO_ROOT, "docs", "benchmarks.md")

# leaves that are data, not figures: per-process samples, hashes, journals, paths, clocks
SKIPPED_KEYS = frozenset({"series", "final_hashes", "hashes", "events", "run_dir", "t0", "machine", "targets",
                          "met", "hostname", "platform", "pids", "samples"})
MAX_LIST = 8  # a list of at most this many scalars is one cell; longer ones are left out
MAX_CELL = 160  # characters; longer strings are cut with an ellipsis


def _cell(value: Any) -> str:
    """One table cell: numbers to 4 significant digits, booleans as yes/no, None as a dash, ``|`` escaped."""
    if value is None:
        text = "—"
    elif isinstance(value, bool):
        text = "yes" if value else "no"
    elif isinstance(value, float):
        text = f"{value:.4g}"
    elif isinstance(value, list):
        text = ", ".join(_cell(v) for v in value)
    else:
        text = str(value)
    text = " ".join(text.split())
    if len(text) > MAX_CELL:
        text = text[:MAX_CELL - 1] + "…"
    return text.replace("|", "\\|").replace("<", "&lt;")


def _is_scalar_list(value: Any) -> bool:
    return isinstance(value, list) and len(value) <= MAX_LIST and all(
        v is None or isinstance(v, (str, int, float, bool)) for v in value)


def _leaves(value: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, scalar) pairs of ``value``, depth first, leaving out :data:`SKIPPED_KEYS` and long lists."""
    if isinstance(value, dict):
        for key, child in value.items():
            if str(key) in SKIPPED_KEYS:
                continue
            yield from _leaves(child, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(value, list):
        if _is_scalar_list(value):
            yield prefix, value
        elif all(isinstance(v, dict) for v in value) and len(value) <= MAX_LIST:
            for i, child in enumerate(value):
                yield from _leaves(child, f"{prefix}[{i}]")
    else:
        yield prefix, value


def _records(value: Any) -> dict[str, dict] | None:
    """``value`` as named records when it is a dict of dicts or a list of dicts (named by their ``name``, ``nodes``
    or index), else None."""
    if isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values()):
        return {str(k): v for k, v in value.items()}
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        def name(i: int, record: dict) -> str:
            for key in ("name", "nodes", "world", "size"):
                if key in record and not isinstance(record[key], (dict, list)):
                    return f"{key} {record[key]}" if key != "name" else str(record[key])
            return str(i)
        return {name(i, v): v for i, v in enumerate(value)}
    return None


def _key_value_table(rows: list[tuple[str, Any]]) -> list[str]:
    if not rows:
        return []
    return ["| key | value |", "| --- | --- |"] + [f"| `{k}` | {_cell(v)} |" for k, v in rows] + [""]


def _matrix(records: dict[str, dict]) -> list[str]:
    """One table, a column per record, a row per dotted key any record has (first seen first)."""
    columns = {name: dict(_leaves(record)) for name, record in records.items()}
    keys: list[str] = []
    for leaves in columns.values():
        keys += [k for k in leaves if k not in keys]
    if not keys:
        return []
    out = ["| | " + " | ".join(f"`{name}`" for name in columns) + " |",
           "| --- |" + " --- |" * len(columns)]
    for key in keys:
        out.append(f"| `{key}` | " + " | ".join(_cell(c.get(key)) if key in c else "" for c in columns.values())
                   + " |")
    return out + [""]


def _alike(a: dict, b: dict) -> bool:
    """Whether two records share most of their fields (siblings of one kind: the same table)."""
    ka, kb = set(a), set(b)
    return len(ka & kb) >= 0.8 * max(len(ka), len(kb), 1)


def _verdicts(value: Any, prefix: str = "") -> Iterator[tuple[str, bool]]:
    """Every target verdict in a result: booleans under a ``met`` key or named ``*_met``, by dotted key (the
    ``met.`` segment dropped)."""
    if isinstance(value, dict):
        for key, child in value.items():
            if str(key) in ("series", "final_hashes"):
                continue
            inner = prefix if key == "met" else (f"{prefix}.{key}" if prefix else str(key))
            if isinstance(child, bool) and (key == "met" or str(key).endswith("_met") or ".met" in f".{prefix}"):
                yield (inner or str(key)), child
            elif key == "met" and isinstance(child, dict):
                for k, v in _leaves(child):
                    if isinstance(v, bool):
                        yield (f"{prefix}.{k}" if prefix else k), v
            else:
                yield from _verdicts(child, inner)


def _docstring(name: str) -> str:
    """The module docstring of ``benchmarks/<name>.py`` (of ``<name>`` less ``-isolated`` for an isolated result),
    read without importing it ('' when there is none)."""
    path = os.path.join(BENCHMARKS_DIR, f"{name.removesuffix('-isolated')}.py")
    if not os.path.exists(path):
        return ""
    with open(path, encoding="utf-8") as f:
        return ast.get_docstring(ast.parse(f.read())) or ""


def _pictures(name: str, results_dir: str) -> list[str]:
    """The run pictures saved beside ``<name>.json``, in run order (``<name>.png``, then ``<name>-1.png`` ...)."""
    found = glob.glob(os.path.join(results_dir, f"{name}.png")) + glob.glob(os.path.join(results_dir, f"{name}-*.png"))
    def order(path: str) -> tuple[int, str]:
        m = re.search(r"-(\d+)\.png$", path)
        return (int(m.group(1)) if m else 0, path)
    return [os.path.basename(p) for p in sorted(found, key=order)
            if re.fullmatch(rf"{re.escape(name)}(-\d+)?\.png", os.path.basename(p))]


def section(name: str, result: dict, results_dir: str = RESULTS_DIR) -> list[str]:
    """The page's section for one benchmark's saved ``result`` (the JSON as a dict)."""
    out = [f"## {name}", ""]
    doc = _docstring(name)
    if doc:
        out += ["How it measures (the docstring of `benchmarks/%s.py`):" % name, "", "```text", doc, "```", ""]
    machine = result.get("machine") or {}
    if machine:
        out += [f"Saved {machine.get('date', 'at an unknown date')} on {machine.get('cpu_model', '?')} "
                f"({machine.get('cpu_count', '?')} CPUs), torch {machine.get('torch', '?')}, Python "
                f"{machine.get('python', '?')}; raw JSON: `benchmarks/results/{name}.json`.", ""]
    for key in ("targets", "met"):
        if isinstance(result.get(key), dict) and result[key]:
            out += [f"**{'Targets' if key == 'targets' else 'Met'}**", ""] + _key_value_table(list(_leaves(result[key])))
    scalars: list[tuple[str, Any]] = []
    groups: list[tuple[str, dict[str, dict]]] = []  # (title, records)
    for key, value in result.items():
        if key in SKIPPED_KEYS:
            continue
        records = _records(value)
        if records is not None:
            groups.append((key, records))
        elif isinstance(value, dict) and value:
            last = groups[-1] if groups else None
            if last and last[0].startswith("+") and _alike(next(iter(last[1].values())), value):
                last[1][key] = value
            else:
                groups.append(("+" + key, {key: value}))
        else:
            scalars += list(_leaves(value, key))
    if scalars:
        out += _key_value_table(scalars)
    for title, records in groups:
        if title.startswith("+") and len(records) == 1:
            out += [f"### {title[1:]}", ""] + _key_value_table(list(_leaves(next(iter(records.values())))))
        else:
            out += [f"### {' / '.join(records) if title.startswith('+') else title}", ""] + _matrix(records)
    for picture in _pictures(name, results_dir):
        out += [f"![{picture}](../benchmarks/results/{picture})", ""]
    return out


def render(results_dir: str = RESULTS_DIR) -> str:
    """The whole page, from every ``*.json`` in ``results_dir``."""
    out = ["# Benchmarks", "",
           "<!-- generated by `python -m benchmarks.docs_page` from benchmarks/results/*.json: do not edit -->", "",
           "The latest saved run of every benchmark (`python -m benchmarks.<name>` saves it), generated from "
           "`benchmarks/results/*.json`. What the figures mean and why a target is or is not met on this machine: "
           "[performance notes](performance-notes.md).", ""]
    names = sorted(os.path.splitext(os.path.basename(p))[0] for p in glob.glob(os.path.join(results_dir, "*.json")))
    results = {}
    for name in names:
        with open(os.path.join(results_dir, f"{name}.json"), encoding="utf-8") as f:
            results[name] = json.load(f)
    out += ["| benchmark | saved | targets met | targets not met |", "| --- | --- | --- | --- |"]
    for name, result in results.items():
        top = result.get("met")  # a benchmark's own summary where it has one, else every verdict in it
        met = dict(_leaves(top) if isinstance(top, dict) and top else _verdicts(result))
        yes = ", ".join(f"`{k}`" for k, v in met.items() if v is True) or "—"
        no = ", ".join(f"`{k}`" for k, v in met.items() if v is False) or "—"
        out.append(f"| [{name}](#{name}) | {_cell((result.get('machine') or {}).get('date'))} | {yes} | {no} |")
    out.append("")
    for name, result in results.items():
        out += section(name, result, results_dir)
    return "\n".join(out).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.docs_page", description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the page is not current (write nothing)")
    ap.add_argument("--results", default=RESULTS_DIR, help="the results directory (default: benchmarks/results)")
    ap.add_argument("--page", default=PAGE, help="the page to write (default: docs/benchmarks.md)")
    args = ap.parse_args(argv)
    page = render(args.results)
    if args.check:
        current = open(args.page, encoding="utf-8").read() if os.path.exists(args.page) else ""
        if current != page:
            print(f"{args.page} is not current with {args.results}: run python -m benchmarks.docs_page",
                  file=sys.stderr)
            return 1
        return 0
    with open(args.page, "w", encoding="utf-8") as f:
        f.write(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())

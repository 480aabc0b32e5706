"""Every tmd, tmctl and ``python -m`` command shown in a code block of README.md or docs/*.md parses as written
(issue 37): tmd's and tmctl's through their own typer command trees (an unknown option, a missing subcommand or
a bad value fails here), a ``python -m`` module is found and names every option it is given."""
from __future__ import annotations

import importlib.util
import pathlib
import re
import shlex

import pytest
import typer

from tmctl import cli as tmctl_cli
from tmd import cli as tmd_cli

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PROGRAMS = {"tmd": tmd_cli.app, "tmctl": tmctl_cli.app}
COMMAND = re.compile(r"^\s*((?:\.venv/bin/)?(?:tmd|tmctl)\s|(?:\.venv/bin/)?python3? -m [\w.]+)")
PLACEHOLDERS = {"...", "ADDR", "DIR", "JOBID", "NODE", "STANDBY", "N", "K", "PORT", "COMMAND"}


def code_lines(page: pathlib.Path):
    """(line number, text) of every line inside a fenced code block of ``page`` (generated pages aside)."""
    fenced = False
    for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced or line.startswith("    "):  # fenced, or an indented code block
            yield number, line


def documented_commands() -> list[tuple[str, list[str]]]:
    """Every documented command as (where, argv without the venv prefix), one per `;`/`&&`-separated part."""
    found = []
    for page in PAGES:
        if page.name == "benchmarks.md":  # generated from the benchmarks' docstrings
            continue
        for number, line in code_lines(page):
            for part in re.split(r";|&&|\|", line.split(" #")[0]):
                if not COMMAND.match(part) or "─" in part:  # a diagram's arrow is no command
                    continue
                try:
                    argv = shlex.split(part)
                except ValueError:
                    continue
                argv[0] = argv[0].removeprefix(".venv/bin/")
                found.append((f"{page.relative_to(ROOT)}:{number}", argv))
    return found


COMMANDS = documented_commands()


def test_the_pages_document_commands_of_every_kind():
    kinds = {argv[0] if argv[0] in PROGRAMS else "python -m" for _, argv in COMMANDS}
    assert kinds == {"tmd", "tmctl", "python -m"}, kinds  # the scan finds what it checks
    assert len(COMMANDS) >= 20, COMMANDS


def rest_of(ctx) -> list[str]:
    """What a group's context left for its subcommand (click keeps the subcommand's name apart)."""
    return [*getattr(ctx, "protected_args", getattr(ctx, "_protected_args", [])), *ctx.args]


def parse(app: typer.Typer, argv: list[str]) -> list[str]:
    """Parse ``argv`` (after the program's name) through ``app``'s command tree as the shell would hand it over,
    without running anything. Returns the subcommand chain; raises click's UsageError on bad input."""
    command = typer.main.get_command(app)
    chain = []
    args = [a for a in argv[:argv.index("--")] if a not in PLACEHOLDERS] if "--" in argv else \
        [a for a in argv if a not in PLACEHOLDERS]
    ctx = command.make_context(argv[0] if argv else "prog", list(args), resilient_parsing=False)
    while hasattr(command, "get_command") and rest_of(ctx):
        name, *rest = rest_of(ctx)
        sub = command.get_command(ctx, name)
        if sub is None:
            raise AssertionError(f"no subcommand {name!r}")
        chain.append(name)
        command, ctx = sub, sub.make_context(name, rest, parent=ctx, resilient_parsing=False)
    return chain


@pytest.mark.parametrize("where,argv", COMMANDS, ids=[w for w, _ in COMMANDS])
def test_a_documented_command_works_as_written(where, argv):
    if argv[0] in PROGRAMS:
        parse(PROGRAMS[argv[0]], argv[1:])
        return
    module = argv[argv.index("-m") + 1]
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin, f"{where}: no module {module}"
    source = pathlib.Path(spec.origin).read_text(encoding="utf-8")
    options = [a.split("=")[0] for a in argv[argv.index("-m") + 2:] if a.startswith("--") and a != "--"]
    if "--" in argv[argv.index("-m") + 2:]:
        options = [o for o in options if argv.index(o) < argv.index("--")] if "--" in argv else options
    missing = [o for o in options if o != "--help" and f'"{o}"' not in source and f"'{o}'" not in source]
    assert not missing, f"{where}: {module} has no option {missing}"


def test_a_mistyped_option_in_a_documented_command_would_fail():
    with pytest.raises(typer.TyperException) as refused:
        parse(tmd_cli.app, ["local", "--standby", "1", "--", "python", "-c", "pass"])
    assert "--standbys" in refused.value.format_message()  # the closest known option is suggested
    with pytest.raises(AssertionError, match="no subcommand"):
        parse(tmctl_cli.app, ["statsu"])

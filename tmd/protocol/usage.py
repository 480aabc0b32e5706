"""How the ``tmd`` and ``tmctl`` commands end on a usage error: one line on stderr, ``error: <message>``, and exit
code 2 (:attr:`ExitCode.REFUSED`), instead of typer's boxed panel; Ctrl-C is :attr:`ExitCode.INTERRUPTED` (130).
One entry wrapper for both commands, so that a typo reads the same in either."""
from __future__ import annotations

import sys
from typing import NoReturn, Optional

import typer

from tmd.protocol.vocab import ExitCode


def run_app(app: typer.Typer, argv: Optional[list[str]] = None) -> NoReturn:
    """Run ``app`` on ``argv`` (default: ``sys.argv[1:]``) and exit with the command's code (an int it returned
    or raised with ``typer.Exit``; 0 otherwise). A usage error (an unknown option, a bad value, a missing
    argument) prints ``error: ...`` in one line and exits 2."""
    try:
        code = app(args=argv, standalone_mode=False)
    except typer.Abort:
        code = ExitCode.INTERRUPTED
    except typer.TyperException as e:  # click's UsageError (exit code 2) and its other ClickExceptions
        message = " ".join((e.format_message() if hasattr(e, "format_message") else str(e)).split())
        if message:  # empty after the help that no_args_is_help printed
            print(f"error: {message}", file=sys.stderr)
        code = getattr(e, "exit_code", ExitCode.REFUSED)
    sys.exit(code if isinstance(code, int) else 0)

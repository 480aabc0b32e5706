"""The ``tmd`` command: run the coordinator.

``tmd local [OPTIONS] [-- COMMAND ...]`` runs a job on this host (the embedded default: the GPT example on 2 nodes
x 2 ranks with standby s1). COMMAND is the training script every rank and standby process runs.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Optional

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, help="TrainMover coordinator daemon (one per job).")

DEFAULT_COMMAND = [sys.executable, "-m", "examples.train_gpt"]


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def local(
    ctx: typer.Context,
    nodes: int = typer.Option(2, min=1, help="Active nodes (n1, n2, ...)."),
    ranks_per_node: int = typer.Option(2, min=1, help="Rank processes per node."),
    standbys: int = typer.Option(1, min=0, help="Standby nodes (s1, s2, ...), each with ranks-per-node processes."),
    run_dir: str = typer.Option("tmrun", envvar="TM_RUN_DIR", help="Events, logs, recordings and tmd.json."),
    record_steps: int = typer.Option(3, min=1, help="Steps recorded at job start; joiners replay them as shadow iterations."),
    heartbeat_timeout_s: float = typer.Option(5.0, help="Seconds of silence before a node is marked unhealthy."),
    port: int = typer.Option(0, help="ZeroMQ port (0: any free port)."),
    job: Optional[str] = typer.Option(None, help="Job name (default: local-<pid>)."),
    quiet: bool = typer.Option(False, help="Do not echo the ranks' output."),
) -> None:
    """Run a job locally: start tmd, the ranks and the standbys on this host. Exits with the job's code."""
    from tmd.daemon import Daemon
    from tmd.local import LocalLauncher

    command = list(ctx.args) or DEFAULT_COMMAND
    active = [f"n{i + 1}" for i in range(nodes)]
    spares = [f"s{i + 1}" for i in range(standbys)]
    daemon = Daemon(job or f"local-{os.getpid()}", run_dir, active, ranks_per_node, spares, port=port,
                    record_steps=record_steps, heartbeat_timeout_s=heartbeat_timeout_s, echo=not quiet)
    launcher = LocalLauncher(command, daemon.run_dir, daemon.address, ranks_per_node, echo=not quiet)
    daemon.launcher = launcher
    for name in active:
        launcher.start_node(name, standby=False)
    for name in spares:
        launcher.start_node(name, standby=True)
    started = time.monotonic()
    code = daemon.run()
    print(f"[tmd] job {daemon.job} ended with code {code} after {time.monotonic() - started:.1f} s", flush=True)
    raise typer.Exit(code)


@app.command()
def version() -> None:
    """Print the protocol version."""
    from tmd.protocol import PROTOCOL_VERSION

    print(f"trainmover tmd, protocol v{PROTOCOL_VERSION}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()

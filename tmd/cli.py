"""The ``tmd`` command: run the coordinator.

``tmd local [OPTIONS] [-- COMMAND ...]`` runs a job on this host (the embedded default: the GPT example on 2 nodes
x 2 ranks with standby s1). COMMAND is the training script every rank and standby process runs.
``tmd slurm [OPTIONS] -- COMMAND ...`` runs in a SLURM batch script (slurm/train.sbatch): the same, with the ranks
started by srun on the job's nodes and standbys taken from standby jobs in a reservation (see tmd/slurm.py).
``tmd standby --job JOBID`` is the body of a standby job (slurm/standby.sbatch).
``tmd resume --run-dir DIR`` restarts a local job's tmd that died (even by ``kill -9``) while its ranks train on.
"""
from __future__ import annotations

import atexit
import logging
import os
import shutil
import sys
import time
from typing import TYPE_CHECKING, NoReturn, Optional

import typer

from tmd.protocol.messages import MIN_RECORD_STEPS
from tmd.protocol.vocab import Event, ExitCode

if TYPE_CHECKING:
    from tmd.netns import Bridge

app = typer.Typer(add_completion=False, no_args_is_help=True, help="TrainMover coordinator daemon (one per job).")
# tmd's own options are parsed strictly (an unknown one is refused, naming the closest known option); everything
# after ``--`` is the job's command, unchanged.
JOB_COMMAND = {"allow_extra_args": True}

DEFAULT_COMMAND = [sys.executable, "-m", "examples.train_gpt"]
RECORD_STEPS_HELP = (f"Steps recorded at job start (at least {MIN_RECORD_STEPS}: DDP regroups its buckets in the "
                     "second); joiners replay them as shadow iterations.")
GUARDS_HELP = ("Standby nodes kept warm as particular active nodes' ranks (guards, tmd.guards): a failure of a "
               "guarded node skips the replacement's warm-up, and a migration of it to its guard skips the "
               "joiners'. A guard is no migration target for another node (0: off).")


@app.command(context_settings=JOB_COMMAND)
def local(
    ctx: typer.Context,
    nodes: int = typer.Option(2, min=1, help="Active nodes (n1, n2, ...)."),
    ranks_per_node: int = typer.Option(2, min=1, help="Rank processes per node."),
    standbys: int = typer.Option(1, min=0, help="Standby nodes (s1, s2, ...), each with ranks-per-node processes."),
    run_dir: str = typer.Option("tmrun", envvar="TM_RUN_DIR", help="Events, logs, recordings and tmd.json."),
    record_steps: int = typer.Option(3, min=MIN_RECORD_STEPS, help=RECORD_STEPS_HELP),
    snapshot_every: int = typer.Option(10, min=0, help="Buddy snapshots every this many steps where a rank's state has no replica on another node (0: off)."),
    guards: int = typer.Option(0, min=0, help=GUARDS_HELP),
    heartbeat_timeout_s: float = typer.Option(5.0, help="Seconds of silence before a node is marked unhealthy."),
    port: int = typer.Option(0, help="ZeroMQ port (0: any free port)."),
    job: Optional[str] = typer.Option(None, help="Job name (default: local-<pid>)."),
    quiet: bool = typer.Option(False, help="Do not echo the ranks' output."),
    netns_node: list[str] = typer.Option([], "--netns-node", metavar="NODE",
                                         help="Run NODE's processes in a network namespace of their own, so it can "
                                              "be cut off (a real partition; needs root). Repeatable."),
    netns_all: bool = typer.Option(False, "--netns-all",
                                   help="Run every node (active, standby, and those added later) and tmd itself "
                                        "each in a network namespace of its own, with its own address on a "
                                        "Linux bridge (tmbr<k>, 10.214.<k>.0/24; this host gets .1): as on "
                                        "separate hosts, nothing can pass over 127.0.0.1. tmctl reaches tmd "
                                        "through the bridge. Each node can still be cut off. Needs root."),
    migrate_stragglers: bool = typer.Option(False, help="Move a node with a straggler rank to a warm standby."),
    metrics_port: int = typer.Option(0, "--metrics-port", min=-1, metavar="PORT",
                                     help="Serve Prometheus metrics (/metrics) and a live status page (/) on the "
                                          "job's address at this port (0: a free port, written to tmd.json; "
                                          "-1: off). Both need the token in the keys directory's web.token."),
    isolate_nodes: bool = typer.Option(False, "--isolate-nodes",
                                       help="Pin each node's processes to CPUs of its own, as on separate machines: "
                                            "standbys and guards on their own CPUs, active nodes on the rest "
                                            "(cgroup v2 cpusets where delegated, else sched_setaffinity; "
                                            "tmd/cpusets.py). Needs 2 CPUs."),
    no_auth: bool = typer.Option(False, "--no-auth",
                                 help="Serve plain ZeroMQ, without CURVE: only to measure its cost "
                                      "(benchmarks/curve.py); anyone on this host can then command the job."),
) -> None:
    """Run a job locally: start tmd, the ranks and the standbys on this host; a crashed tmd is restarted from its
    journal (tmd.supervise) while the ranks train on. Exits with the job's code."""
    from tmd.daemon import Daemon
    from tmd.local import LocalLauncher

    run_dir = _private(run_dir, "run directory")
    command = list(ctx.args) or DEFAULT_COMMAND
    _refuse_unstartable(command, run_dir)
    active = [f"n{i + 1}" for i in range(nodes)]
    spares = [f"s{i + 1}" for i in range(standbys)]
    namespaces, bridge, specs, host = _namespaces(netns_node, netns_all, active + spares)
    isolation = _isolation(active, spares) if isolate_nodes else None
    from tmd.supervise import supervise

    name = job or f"local-{os.getpid()}"

    def build(state):  # None: the job's first tmd; a tmd.resume.JobState: a crashed tmd resumed (tmd.supervise)
        d = Daemon(name, run_dir, active, ranks_per_node, spares,
                   port=port if state is None else int(state.address.rpartition(":")[2]),
                   record_steps=record_steps, snapshot_every=snapshot_every, guards=guards,
                   heartbeat_timeout_s=heartbeat_timeout_s, echo=not quiet,
                   bind_host=host or "127.0.0.1", store_host=host or "127.0.0.1", advertise_host=host,
                   migrate_stragglers=migrate_stragglers, netns=specs, command=command, resume=state,
                   auth=not no_auth, metrics_port=None if metrics_port < 0 else metrics_port)
        if state is None:
            d.launcher = LocalLauncher(command, d.run_dir, d.address, ranks_per_node, echo=not quiet,
                                       namespaces=namespaces, host_ip=host,
                                       new_namespace=bridge.add if bridge else None, isolation=isolation)
            if isolation is not None:
                print(f"[tmd] {isolation.describe()}", flush=True)
                d.journal.record(Event.NODES_ISOLATED, **isolation.to_dict())
            for n in active:
                d.launcher.start_node(n, standby=False)
            for n in spares:
                d.launcher.start_node(n, standby=True)
        return d

    started = time.monotonic()
    code = supervise(build)
    print(f"[tmd] job {name} ended with code {code} after {time.monotonic() - started:.1f} s", flush=True)
    if bridge is not None:
        bridge.close()  # the namespaces of tmd and of every node, and the bridge (also at exit, stale at next start)
    _exit(code)


def _isolation(active: list[str], spares: list[str]):
    """The CPU sets of ``--isolate-nodes`` (tmd.cpusets), or the one-line error and exit code 2."""
    from tmd.cpusets import Isolation

    try:
        return Isolation.plan(active, spares)
    except ValueError as e:
        typer.echo(f"tmd: {e}", err=True)
        raise typer.Exit(2)


def _namespaces(netns_node: list[str], netns_all: bool,
                nodes: list[str]) -> tuple[dict, Optional["Bridge"], dict, Optional[str]]:
    """The network namespaces of ``tmd local``: (node -> NodeNamespace, the bridge of ``--netns-all`` or None,
    tmd.json's ``netns`` specs, the address tmd binds and advertises: None for 127.0.0.1). With ``--netns-all``
    this process enters tmd's namespace (before it has any other thread)."""
    if not (netns_node or netns_all):
        return {}, None, {}, None
    from tmd import netns
    hint = "--netns-all" if netns_all else "--netns-node"
    if netns_all and netns_node:
        raise typer.BadParameter("--netns-all already puts every node in a namespace of its own", param_hint=hint)
    if not netns.available():
        raise typer.BadParameter("network namespaces need root and iproute2 here", param_hint=hint)
    if not netns_all:
        namespaces = {node: netns.NodeNamespace(node, i + 1) for i, node in enumerate(netns_node)}
        host = next(iter(namespaces.values())).host_ip  # a local address of this host every namespace reaches
        return namespaces, None, {n: ns.spec() for n, ns in namespaces.items()}, host
    bridge = netns.Bridge()
    try:
        tmd_ns = bridge.add("tmd")
        namespaces = {node: bridge.add(node) for node in nodes}
        netns.enter(tmd_ns)
    except BaseException:
        bridge.close()
        raise
    specs = {netns.TMD_KEY: tmd_ns.spec(), **{n: ns.spec() for n, ns in namespaces.items()}}
    return namespaces, bridge, specs, tmd_ns.node_ip


@app.command(context_settings=JOB_COMMAND)
def slurm(
    ctx: typer.Context,
    ranks_per_node: Optional[int] = typer.Option(
        None, min=1, help="Rank processes per node (default: $SLURM_NTASKS_PER_NODE, else 1)."),
    reservation: str = typer.Option("standby", envvar="TM_RESERVATION", help="Reservation holding the standby jobs."),
    run_dir: Optional[str] = typer.Option(None, envvar="TM_RUN_DIR",
                                          help="Events, logs, recordings and tmd.json (default ./tmrun/<JOBID>)."),
    record_steps: int = typer.Option(3, min=MIN_RECORD_STEPS, help=RECORD_STEPS_HELP),
    snapshot_every: int = typer.Option(10, min=0, help="Buddy snapshots every this many steps where a rank's state has no replica on another node (0: off)."),
    guards: int = typer.Option(0, min=0, help=GUARDS_HELP),
    heartbeat_timeout_s: float = typer.Option(5.0, help="Seconds of silence before a node is marked unhealthy."),
    poll_s: float = typer.Option(1.0, min=0.1, help="Seconds between polls of node states and standby jobs."),
    slurm_timeout_s: float = typer.Option(5.0, min=0.1, help="Timeout of every SLURM client call (seconds)."),
    host: Optional[str] = typer.Option(None, envvar="TM_HOST",
                                       help="Address tmd binds and the ranks reach it and its store at (default: "
                                            "the address this host's name resolves to; never all interfaces)."),
    port: int = typer.Option(0, help="ZeroMQ port (0: any free port)."),
    metrics_port: int = typer.Option(0, "--metrics-port", min=-1, metavar="PORT",
                                     help="Serve Prometheus metrics (/metrics) and a live status page (/) on the "
                                          "job's address at this port (0: a free port, written to tmd.json; "
                                          "-1: off). Both need the token in the keys directory's web.token."),
    quiet: bool = typer.Option(False, help="Do not echo the ranks' output."),
    keep_standbys: int = typer.Option(0, min=0, metavar="N",
                                      help="Keep N standbys warm or pending: tmd submits standby jobs into the "
                                           "reservation itself (rate-limited, backing off when refused) and "
                                           "cancels them when the job ends (0: only standby jobs submitted by "
                                           "hand; tmd/standby_pool.py)."),
) -> None:
    """Run tmd for the SLURM job this batch script belongs to (see slurm/train.sbatch); a crashed tmd is restarted
    from its journal (tmd.supervise) while the ranks train on. Exits with the job's code."""
    import socket

    from tmd.daemon import Daemon
    from tmd.slurm import SlurmCluster, SlurmError, SrunLauncher, hostnames
    from tmd.standby_pool import StandbyPoolConfig
    from tmd.supervise import supervise

    job_id = os.environ.get("SLURM_JOB_ID")
    if not job_id or not os.environ.get("SLURM_JOB_NODELIST"):
        print("error: tmd slurm runs inside a SLURM batch job (sbatch slurm/train.sbatch ...): SLURM_JOB_ID and "
              "SLURM_JOB_NODELIST are not set", file=sys.stderr)
        raise typer.Exit(ExitCode.REFUSED)
    command = list(ctx.args)
    if not command:
        print("error: give the training command after --, e.g. tmd slurm -- python -m examples.train_gpt",
              file=sys.stderr)
        raise typer.Exit(ExitCode.REFUSED)
    try:
        nodes = hostnames(os.environ["SLURM_JOB_NODELIST"], slurm_timeout_s)
    except SlurmError as e:
        print(f"error: {e}", file=sys.stderr)
        raise typer.Exit(ExitCode.REFUSED)
    rpn = ranks_per_node or int((os.environ.get("SLURM_NTASKS_PER_NODE") or "1").split("(")[0].split(",")[0])
    from tmd.protocol import layout

    host = host or socket.gethostbyname(socket.gethostname())  # this host's own address, never all interfaces
    run_dir = _private(run_dir or os.path.join("tmrun", job_id), "run directory")
    _refuse_unstartable(command, run_dir)
    _private(layout.job_dir(job_id), "state directory")  # ~/.trainmover/jobs/<JOBID>: tmd.json and the keys
    pool = StandbyPoolConfig(keep=keep_standbys)
    if keep_standbys and not os.path.isfile(pool.script):
        print(f"error: --keep-standbys needs the standby job's script, {pool.script}, which is missing",
              file=sys.stderr)
        raise typer.Exit(ExitCode.REFUSED)
    clusters: list[SlurmCluster] = []

    def build(state):  # None: the job's first tmd; a tmd.resume.JobState: a crashed tmd resumed (tmd.supervise)
        d = Daemon(job_id, run_dir, nodes, rpn, [], bind_host=host, store_host=host,
                   port=port if state is None else int(state.address.rpartition(":")[2]),
                   keys_dir=os.path.join(layout.job_dir(job_id), "keys"), record_steps=record_steps,
                   snapshot_every=snapshot_every, guards=guards, heartbeat_timeout_s=heartbeat_timeout_s,
                   echo=not quiet, metrics_port=None if metrics_port < 0 else metrics_port, resume=state)
        if state is None:
            launcher = SrunLauncher(command, d.run_dir, d.address, rpn, echo=not quiet)
            d.launcher = launcher
            d.cluster = SlurmCluster(d, launcher, job_id, nodes, os.environ.get("SLURMD_NODENAME", nodes[0]),
                                     reservation, poll_s, slurm_timeout_s, command, pool)
            clusters.append(d.cluster)
            for name in nodes:
                launcher.assign(name, job_id)
                launcher.start_node(name, standby=False)
            d.cluster.start()
        return d

    started = time.monotonic()
    try:
        code = supervise(build)
    finally:
        for cluster in clusters:
            cluster.close()
    print(f"[tmd] job {job_id} ended with code {code} after {time.monotonic() - started:.1f} s", flush=True)
    _exit(code)


@app.command()
def standby(
    job: str = typer.Option(..., "--job", metavar="JOBID", help="The training job this standby job serves."),
    poll_s: float = typer.Option(2.0, min=0.1, help="Seconds between checks of the training job's state."),
) -> None:
    """Body of a standby job (slurm/standby.sbatch): hold the nodes while the training job runs; its tmd starts
    the standby workers here. Exit 0 when the training job ended, 2 on bad input."""
    from tmd.slurm import hold_standby

    raise typer.Exit(hold_standby(job, poll_s, echo=lambda line: print(line, flush=True)))


@app.command()
def resume(
    run_dir: str = typer.Option("tmrun", envvar="TM_RUN_DIR", help="The run directory of the job (tmd.json, events)."),
    record_steps: int = typer.Option(3, min=MIN_RECORD_STEPS, help="Used only when the journal does not say (older tmd)."),
    heartbeat_timeout_s: float = typer.Option(5.0, help="Seconds of silence before a node is marked unhealthy."),
    quiet: bool = typer.Option(False, help="Do not echo the ranks' output."),
) -> None:
    """Restart tmd for a local job whose tmd died while its ranks train on: bind the same address, host a new
    store, re-learn the job from the journal and the workers' re-registration, and serve it until it ends
    (see tmd/resume.py). Exits with the job's code; 2 when there is no job to resume."""
    from tmd.daemon import Daemon
    from tmd.local import LocalLauncher
    from tmd.resume import ResumeError, load, split_address

    try:
        state = load(run_dir)
    except ResumeError as e:
        print(f"error: {e}", file=sys.stderr)
        raise typer.Exit(ExitCode.REFUSED)
    host, port = split_address(state.address)
    if state.cwd and os.path.isdir(state.cwd):
        os.chdir(state.cwd)  # where the job's command (relative paths, python -m) runs: standbys start there
    started = time.monotonic()
    try:
        daemon = Daemon(state.job, state.run_dir, state.nodes, state.ranks_per_node, state.standbys,
                        bind_host=host, store_host=host, port=port,
                        record_steps=state.record_steps or record_steps, heartbeat_timeout_s=heartbeat_timeout_s,
                        snapshot_every=state.snapshot_every if state.snapshot_every is not None else 10,
                        guards=state.guards, echo=not quiet, command=state.command, netns=state.netns, resume=state,
                        metrics_port=state.web_port)
    except Exception as e:  # noqa: BLE001 - e.g. the address is taken: one line, not a traceback
        print(f"error: cannot restart tmd of job {state.job} at {state.address}: {e}", file=sys.stderr)
        raise typer.Exit(ExitCode.REFUSED)
    # The job's processes are not this tmd's children: the launcher adopts them as they re-register, and
    # starts standbys afresh with the job's command.
    daemon.launcher = LocalLauncher(list(state.command or []), daemon.run_dir, daemon.address, state.ranks_per_node,
                                    echo=not quiet)
    code = daemon.run()
    print(f"[tmd] job {daemon.job} ended with code {code} {time.monotonic() - started:.1f} s after the restart",
          flush=True)
    _exit(code)


@app.command()
def version() -> None:
    """Print the protocol version."""
    from tmd.protocol import PROTOCOL_VERSION

    print(f"trainmover tmd, protocol v{PROTOCOL_VERSION}")


def _private(path: str, what: str) -> str:
    """``path`` made (0700) or checked as a directory only this user can change (tmd.rundir.private_dir),
    resolved; else exit 2 with one line saying why."""
    from tmd.rundir import private_dir

    try:
        return private_dir(path, what)
    except OSError as e:  # tmd.rundir.UnsafePath, or e.g. no permission to create it
        print(f"error: {e}: refusing it (choose another, or fix its owner and mode)", file=sys.stderr)
        raise typer.Exit(ExitCode.REFUSED)


def unstartable(command: list[str]) -> Optional[str]:
    """Why ``command`` (the job's argv) cannot be started on this host, or None when its program is found and
    executable: an absolute or relative path must name an executable file; a bare name must be on ``$PATH``."""
    program = command[0]
    if os.sep in program:
        if not os.path.isfile(program):
            return f"the job's command {program!r} was not found"
        if not os.access(program, os.X_OK):
            return f"the job's command {program!r} is not executable"
        return None
    if shutil.which(program) is None:
        return f"the job's command {program!r} was not found on PATH"
    return None


def _refuse_unstartable(command: list[str], run_dir: str) -> None:
    """Exit 2 with one line, before any rank or standby starts, when the job's ``command`` cannot be started;
    the run directory's journal then says why (``job_refused``)."""
    reason = unstartable(command)
    if reason is None:
        return
    from tmd.journal import Journal
    from tmd.protocol.layout import RunDir

    journal = Journal(RunDir(run_dir).events)
    journal.record(Event.JOB_REFUSED, reason=reason, command=command)
    journal.close()
    print(f"error: {reason}: nothing was started (the job's command comes after --)", file=sys.stderr)
    raise typer.Exit(ExitCode.REFUSED)


def _exit(code: int) -> NoReturn:
    """End tmd once its job is over, with the job's exit code ``code``: run the atexit handlers (the network
    namespaces' cleanup), flush, and skip the interpreter's teardown, ~1.5 s of CPU with torch imported on a host
    whose cores the ranks of the next job may already need."""
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: Optional[list[str]] = None) -> None:
    """Console-script entry point (``tmd``). A usage error (an unknown option, a bad value) is one line on stderr,
    ``error: ...``, with exit 2 (:attr:`ExitCode.REFUSED`), not a rich panel."""
    try:
        code = app(args=argv, standalone_mode=False)
    except typer.Abort:
        code = ExitCode.INTERRUPTED
    except typer.TyperException as e:  # click's UsageError (exit code 2) and its other ClickExceptions
        message = " ".join((e.format_message() if hasattr(e, "format_message") else str(e)).split())
        if message:  # empty after the help that no_args_is_help printed
            print(f"error: {message}", file=sys.stderr)
        code = getattr(e, "exit_code", ExitCode.REFUSED)
    sys.exit(code or 0)


if __name__ == "__main__":
    main()

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
import inspect
import logging
import os
import shutil
import sys
import time
from typing import TYPE_CHECKING, Any, Callable, NoReturn, Optional

import typer

from tmd.config import DEFAULTS, ConfigError, JobConfig, envvar, field_help, flag, option_type
from tmd.protocol.usage import run_app
from tmd.protocol.vocab import Event, ExitCode

if TYPE_CHECKING:
    from tmd.netns import Bridge
    from tmd.tiers import Tier

app = typer.Typer(add_completion=False, no_args_is_help=True, help="TrainMover coordinator daemon (one per job).")
# tmd's own options are parsed strictly (an unknown one is refused, naming the closest known option); everything
# after ``--`` is the job's command, unchanged.
JOB_COMMAND = {"allow_extra_args": True}

DEFAULT_COMMAND = [sys.executable, "-m", "examples.train_gpt"]


# The tmd.config fields each command takes as options (see settings()).
RUN_SETTINGS = ("record_steps", "snapshot_every", "guards", "heartbeat_timeout_s", "suspect_after_s",
                "blocked_after_s", "migrate_stragglers", "port", "metrics_port", "iface", "checkpoint_dir",
                "checkpoint_every", "checkpoint_keep", "standby_wait_s")  # tmd local and tmd slurm
SLURM_SETTINGS = ("host", "reservation", "poll_s", "slurm_timeout_s", "keep_standbys")  # tmd slurm's own
# what a restarted tmd may change: not what the ranks were assigned (record_steps, snapshot_every), nor its addresses
RESUME_SETTINGS = ("heartbeat_timeout_s", "suspect_after_s", "blocked_after_s", "migrate_stragglers", "guards")


def option(name: str, resumed: bool = False) -> Any:
    """The option of tmd.config field ``name``: ``--heartbeat-timeout-s`` for ``heartbeat_timeout_s`` (a bool's
    ``--no-...`` too), with the field's help, default and environment variable. Its value is None when not given,
    so the config keeps its default (``tmd local``, ``tmd slurm``) or the journal's value (``tmd resume``:
    ``resumed``, whose help says so)."""
    decl = f"{flag(name)}/--no-{flag(name)[2:]}" if option_type(name) == Optional[bool] else flag(name)
    return typer.Option(None, decl, help=field_help(name, resumed), envvar=envvar(name), show_default=False)


def settings(*names: str, resumed: bool = False) -> Callable[[Callable], Callable]:
    """Give the decorated command one option per tmd.config field of ``names`` (:func:`option`), after its own
    options; their values reach its ``**given`` by field name (None: not given), for :func:`_config`."""
    def decorate(command: Callable) -> Callable:
        signature = inspect.signature(command)
        own = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        added = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option(name, resumed),
                                   annotation=option_type(name)) for name in names]
        command.__signature__ = signature.replace(parameters=own + added)  # what typer reads
        return command
    return decorate


def _config(base: JobConfig, given: dict, **more: Any) -> JobConfig:
    """``base`` with the settings given to a command (``given``: its ``**given``; ``more``: fields set by other
    options), or exit 2 with one ``error:`` line when a value is out of range (tmd.config.ConfigError)."""
    try:
        return base.with_options(given, **more)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        raise typer.Exit(ExitCode.REFUSED)


RESUME_FROM = typer.Option(None, "--resume-from", metavar="DIR",
                           help="Start from the newest valid checkpoint in DIR (a checkpoint dir of any job, or one "
                                "of its step-* directories); it must have this job's world size and layout.")


@app.command(context_settings=JOB_COMMAND)
@settings(*RUN_SETTINGS)
def local(
    ctx: typer.Context,
    nodes: int = typer.Option(2, min=1, help="Active nodes (n1, n2, ...)."),
    ranks_per_node: int = typer.Option(2, min=1, help="Rank processes per node."),
    standbys: int = typer.Option(1, min=0, help="Standby nodes (s1, s2, ...), each with ranks-per-node processes."),
    run_dir: str = typer.Option("tmrun", envvar="TM_RUN_DIR", help="Events, logs, recordings and tmd.json."),
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
    isolate_nodes: bool = typer.Option(False, "--isolate-nodes",
                                       help="Pin each node's processes to CPUs of its own, as on separate machines: "
                                            "standbys and guards on their own CPUs, active nodes on the rest "
                                            "(cgroup v2 cpusets where delegated, else sched_setaffinity; "
                                            "tmd/cpusets.py). Needs 2 CPUs."),
    resume_from: Optional[str] = RESUME_FROM,
    no_auth: bool = typer.Option(False, "--no-auth",
                                 help="Serve plain ZeroMQ, without CURVE: only to measure its cost "
                                      "(benchmarks/curve.py); anyone on this host can then command the job."),
    **given: Any,
) -> None:
    """Run a job locally: start tmd, the ranks and the standbys on this host; a crashed tmd is restarted from its
    journal (tmd.supervise) while the ranks train on. Exits with the job's code."""
    from tmd.daemon import Daemon
    from tmd.local import LocalLauncher

    config = _config(DEFAULTS, given, auth=False if no_auth else None)
    _use_iface(config)
    name = job or f"local-{os.getpid()}"
    active = [f"n{i + 1}" for i in range(nodes)]
    spares = [f"s{i + 1}" for i in range(standbys)]
    # before the checkpoint tier imports torch: torch starts a native thread as it loads, which would stay in the
    # host namespace, and --netns-all's netns.enter refuses a process with more than one thread
    namespaces, bridge, specs, host = _namespaces(netns_node, netns_all, active + spares)
    tier = _tier(name, nodes * ranks_per_node, config, resume_from)
    run_dir = _private(run_dir, "run directory", run_dir=True)
    command = list(ctx.args) or DEFAULT_COMMAND
    _refuse_unstartable(command, run_dir)
    isolation = _isolation(active, spares) if isolate_nodes else None
    daemons = []  # every daemon of the job: the last one's restart (tmd.tiers) relaunches the job on its port

    def launcher(previous: Optional[LocalLauncher] = None) -> LocalLauncher:  # its address is the daemon's, set
        # once that is bound; a relaunch's takes over the previous launcher's fork server, which has the image
        return LocalLauncher(command, run_dir, "", ranks_per_node, echo=not quiet, namespaces=namespaces,
                             host_ip=host, new_namespace=bridge.add if bridge else None, isolation=isolation,
                             inherited=previous.fork_server if previous is not None else None)

    # The first launcher before the daemon: its fork server imports torch (or is forked from this process where
    # that holds the image already, tmd.local.ForkServer) while tmd starts, and before tmd runs any thread. The
    # processes it forks inherit this umask, as those of the daemon do (tmd.daemon): their files are the user's only.
    os.umask(0o077)
    first = [launcher()]

    def build(state):  # None: the job's first tmd; a tmd.resume.JobState: a crashed tmd resumed (tmd.supervise)
        prev = state or (daemons[-1] if daemons else None)  # a resumed tmd, or a relaunch: the same port
        d = Daemon(name, run_dir, active, ranks_per_node, spares, config, host=host or "127.0.0.1", echo=not quiet,
                   netns=specs, command=command, resume=state, tier=tier,
                   port=None if prev is None else int(prev.address.rpartition(":")[2]))
        previous = daemons[-1].launcher if daemons else None
        daemons.append(d)
        if state is None:
            d.launcher = first.pop() if first else launcher(previous)
            d.launcher.coordinator = d.address
            if isolation is not None:
                print(f"[tmd] {isolation.describe()}", flush=True)
                d.journal.record(Event.NODES_ISOLATED, **isolation.to_dict())
            _start_nodes(d, active, spares)
        return d

    started = time.monotonic()
    code = _run_until_done(build, daemons, tier)
    print(f"[tmd] job {name} ended with code {code} after {time.monotonic() - started:.1f} s", flush=True)
    if bridge is not None:
        bridge.close()  # the namespaces of tmd and of every node, and the bridge (also at exit, stale at next start)
    _exit(code)


def _run_until_done(build: Callable, daemons: list, tier: Optional["Tier"]) -> int:
    """Run the job's tmd under tmd.supervise (``build`` as supervise takes it, appending each daemon it makes to
    ``daemons``) until the job ends; each time a daemon ended for a restart from a checkpoint (tmd.tiers: in-memory
    recovery was impossible), relaunch the job with ``build(None)`` (SLURM mode: only a rebuild inside the
    allocation, not a requeue). Returns the job's exit code."""
    from tmd.supervise import supervise

    code = supervise(build)
    while tier is not None and daemons and daemons[-1].restart is not None and (
            daemons[-1].cluster is None or daemons[-1].rebuild is not None):  # SLURM: a requeue ends this run
        tier.last_seq = daemons[-1].journal.seq  # the relaunched daemon's journal goes on after it
        tier.last_ids = (daemons[-1].migrations.next_id() - 1, daemons[-1].incidents.next_id() - 1)  # so do ids
        tier.export()  # TM_RESUME_FROM: the checkpoint every relaunched process loads
        code = supervise(build)
    return code


def _start_nodes(daemon, active: list[str], spares: list[str]) -> None:
    """Start every process of a (re)launched local job: the ``active`` nodes' ranks, then the ``spares``."""
    for n in active:
        daemon.launcher.start_node(n, standby=False)
    for n in spares:
        daemon.launcher.start_node(n, standby=True)


def _use_iface(config: JobConfig) -> None:
    """Hand the job's interface (``--iface``, checked by tmd.config) to every process tmd starts (env
    TM_IFNAME; each resolves it on its node, tmd.netif)."""
    if config.network.iface is not None:
        from tmd import netif

        os.environ[netif.ENV] = config.network.iface


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
@settings(*RUN_SETTINGS, *SLURM_SETTINGS)
def slurm(
    ctx: typer.Context,
    ranks_per_node: Optional[int] = typer.Option(
        None, min=1, help="Rank processes per node (default: $SLURM_NTASKS_PER_NODE, else 1)."),
    run_dir: Optional[str] = typer.Option(None, envvar="TM_RUN_DIR",
                                          help="Events, logs, recordings and tmd.json (default ./tmrun/<JOBID>)."),
    resume_from: Optional[str] = RESUME_FROM,
    quiet: bool = typer.Option(False, help="Do not echo the ranks' output."),
    **given: Any,
) -> None:
    """Run tmd for the SLURM job this batch script belongs to (see slurm/train.sbatch); a crashed tmd is restarted
    from its journal (tmd.supervise) while the ranks train on. Exits with the job's code."""
    import socket

    from tmd.daemon import Daemon
    from tmd.slurm import SlurmCluster, SlurmError, SrunLauncher, hostnames
    from tmd.standby_pool import StandbyPoolConfig

    config = _config(DEFAULTS, given)
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
    _use_iface(config)
    host = config.slurm.host
    if not host and config.network.iface:  # tmd binds the job's network too: the ranks reach it and its store there
        from tmd.netif import InterfaceError, resolve
        try:
            host = resolve(config.network.iface, os.environ.get("SLURMD_NODENAME") or socket.gethostname())
        except InterfaceError as e:
            print(f"error: {e}", file=sys.stderr)
            raise typer.Exit(ExitCode.REFUSED)
    try:
        nodes = hostnames(os.environ["SLURM_JOB_NODELIST"], config.slurm.slurm_timeout_s)
    except SlurmError as e:
        print(f"error: {e}", file=sys.stderr)
        raise typer.Exit(ExitCode.REFUSED)
    rpn = ranks_per_node or int((os.environ.get("SLURM_NTASKS_PER_NODE") or "1").split("(")[0].split(",")[0])
    from tmd.protocol import layout

    host = host or socket.gethostbyname(socket.gethostname())  # this host's address, never all interfaces
    run_dir = _private(run_dir or os.path.join("tmrun", job_id), "run directory", run_dir=True)
    _refuse_unstartable(command, run_dir)
    _private(layout.job_dir(job_id), "state directory")  # ~/.trainmover/jobs/<JOBID>: tmd.json and the keys
    tier = _tier(job_id, len(nodes) * rpn, config, resume_from)
    pool = StandbyPoolConfig(keep=config.slurm.keep_standbys)
    if pool.keep and not os.path.isfile(pool.script):
        print(f"error: --keep-standbys needs the standby job's script, {pool.script}, which is missing",
              file=sys.stderr)
        raise typer.Exit(ExitCode.REFUSED)
    clusters: list[SlurmCluster] = []
    daemons: list[Daemon] = []  # every daemon of the job: the last one's rebuild (tmd.tiers) relaunches the job

    def build(state):  # None: the job's first tmd, or a relaunch inside the allocation; a tmd.resume.JobState: a
        # crashed tmd resumed (tmd.supervise)
        prev = daemons[-1] if daemons and state is None else None  # a relaunch: the same port, the same cluster
        d = Daemon(job_id, run_dir, prev.rebuild.world if prev else nodes, rpn, prev.rebuild.standbys if prev else [],
                   config, host=host, echo=not quiet, resume=state, keys_dir=os.path.join(layout.job_dir(job_id), "keys"),
                   tier=tier, port=None if prev is None else int(prev.address.rpartition(":")[2]))
        daemons.append(d)
        if state is None:
            launcher = SrunLauncher(command, d.run_dir, d.address, rpn, echo=not quiet)
            d.launcher = launcher
            if prev is not None:
                d.cluster = prev.cluster
                d.cluster.relaunch(d, launcher)
                return d
            d.cluster = SlurmCluster(d, launcher, job_id, nodes, os.environ.get("SLURMD_NODENAME", nodes[0]),
                                     config.slurm.reservation, config.slurm.poll_s, config.slurm.slurm_timeout_s,
                                     command, pool)
            clusters.append(d.cluster)
            for name in nodes:
                launcher.assign(name, job_id)
                launcher.start_node(name, standby=False)
            d.cluster.start()
        return d

    started = time.monotonic()
    try:
        code = _run_until_done(build, daemons, tier)
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
@settings(*RESUME_SETTINGS, resumed=True)
def resume(
    run_dir: str = typer.Option("tmrun", envvar="TM_RUN_DIR", help="The run directory of the job (tmd.json, events)."),
    record_steps: Optional[int] = typer.Option(None, hidden=True, help="Ignored: the journal says (kept so that "
                                                                        "older command lines still parse)."),
    quiet: bool = typer.Option(False, help="Do not echo the ranks' output."),
    **given: Any,
) -> None:
    """Restart tmd for a local job whose tmd died while its ranks train on: bind the same address, host a new
    store, re-learn the job from the journal and the workers' re-registration, and serve it until it ends
    (see tmd/resume.py). The job keeps the settings it was started with (its journal's ``job_config``); an
    option given here overrides one, and the restarted tmd journals the override. Exits with the job's code; 2
    when there is no job to resume or an option is out of range."""
    from tmd.daemon import Daemon
    from tmd.local import LocalLauncher
    from tmd.resume import ResumeError, load, split_address

    try:
        state = load(run_dir)
    except ResumeError as e:
        print(f"error: {e}", file=sys.stderr)
        raise typer.Exit(ExitCode.REFUSED)
    config = _config(state.config, given)
    _use_iface(config)  # the standbys this tmd starts use the job's interface too
    if state.cwd and os.path.isdir(state.cwd):
        os.chdir(state.cwd)  # where the job's command (relative paths, python -m) runs: standbys start there
    tier = _resumed_tier(state, config)
    command = list(state.command or [])
    host, port = split_address(state.address)
    daemons: list = []

    def build(st):  # None first: the job tmd died in; None after a restart from a checkpoint: the relaunched job
        if daemons and st is None:  # relaunch every rank and standby process on the same address
            d = Daemon(state.job, state.run_dir, state.nodes, state.ranks_per_node, state.standbys, config,
                       host=host, echo=not quiet, command=command, tier=tier, port=port)
            d.launcher = LocalLauncher(command, d.run_dir, d.address, state.ranks_per_node, echo=not quiet,
                                       inherited=daemons[-1].launcher.fork_server if daemons[-1].launcher else None)
            _start_nodes(d, state.nodes, state.standbys)
        else:  # the job tmd died in (a later crash: tmd.supervise hands the launcher over)
            d = Daemon(state.job, state.run_dir, state.nodes, state.ranks_per_node, state.standbys, config,
                       echo=not quiet, command=state.command, netns=state.netns, resume=st or state, tier=tier)
            if not daemons:  # the job's processes are not this tmd's children: the launcher adopts them as they
                # re-register, and starts standbys afresh with the job's command
                d.launcher = LocalLauncher(command, d.run_dir, d.address, state.ranks_per_node, echo=not quiet)
        daemons.append(d)
        return d

    started = time.monotonic()
    try:
        code = _run_until_done(build, daemons, tier)
    except Exception as e:  # noqa: BLE001 - e.g. the address is taken: one line, not a traceback
        if daemons:
            raise
        print(f"error: cannot restart tmd of job {state.job} at {state.address}: {e}", file=sys.stderr)
        raise typer.Exit(ExitCode.REFUSED)
    print(f"[tmd] job {state.job} ended with code {code} {time.monotonic() - started:.1f} s after the restart",
          flush=True)
    _exit(code)


def _resumed_tier(state, config: JobConfig) -> Optional["Tier"]:
    """The checkpoint tier of a job whose tmd ``tmd resume`` restarts (tmd.tiers.Tier.resumed: its journalled
    ``--checkpoint-*`` settings and restarts), its settings exported to the standbys and relaunched processes this
    tmd starts; None when the job has no ``--checkpoint-dir``."""
    if config.checkpoint.checkpoint_dir is None:
        return None
    from tmd.tiers import Tier

    tier = Tier.resumed(config.checkpoint, state.job, len(state.nodes) * state.ranks_per_node, state.restarts,
                        netns=state.netns)
    tier.export()
    return tier


@app.command()
def version() -> None:
    """Print the protocol version."""
    from tmd.protocol import PROTOCOL_VERSION

    print(f"trainmover tmd, protocol v{PROTOCOL_VERSION}")


def _tier(job: str, world_size: int, config: JobConfig, resume_from: Optional[str]) -> Optional["Tier"]:
    """The job's checkpoint tier (tmd.tiers) from the config's ``checkpoint`` section and ``--resume-from``, its
    settings exported to the processes tmd starts, or None without ``--checkpoint-dir`` and ``--resume-from``;
    exit 2 with one line when the options cannot be used."""
    c = config.checkpoint
    if c.checkpoint_dir is None and resume_from is None:
        if c.checkpoint_every or c.standby_wait_s:
            print("error: --checkpoint-every and --standby-wait-s need --checkpoint-dir", file=sys.stderr)
            raise typer.Exit(ExitCode.REFUSED)
        return None
    from tmd.tiers import Tier

    tier = Tier(c, job, world_size, resume_from)
    why = tier.refusal()
    if why is not None:
        print(f"error: {why}", file=sys.stderr)
        raise typer.Exit(ExitCode.REFUSED)
    tier.export()
    return tier


def _private(path: str, what: str, run_dir: bool = False) -> str:
    """``path`` made (0700) or checked as a directory only this user can change (tmd.rundir.private_dir),
    resolved; with ``run_dir``, what tmd writes in it checked too (tmd.rundir.check_run_dir: a journal, ``logs/``
    or log that is a symlink); else exit 2 with one line saying why."""
    from tmd.rundir import check_run_dir, private_dir

    try:
        real = private_dir(path, what)
        if run_dir:
            check_run_dir(real)
        return real
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
    from tmd.journal import Journal, last_seq
    from tmd.protocol.layout import RunDir

    events = RunDir(run_dir).events
    journal = Journal(events, seq=last_seq(events))
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
    ``error: ...``, with exit 2 (:attr:`ExitCode.REFUSED`), not a rich panel (tmd.protocol.usage)."""
    run_app(app, argv)


if __name__ == "__main__":
    main()

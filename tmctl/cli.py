"""tmctl: the command line for a running TrainMover job (status, migrate, events, timeline).

Every command asks the coordinator (tmd) over ZeroMQ; see :func:`tmctl.client.find_coordinator` for how its
address is found. Exit codes (tmd.protocol.vocab.ExitCode): 0 success; 1 a migration aborted (or a standby was not ready within
--wait-standby-s); 2 the request was refused, no coordinator answered, or anything else went wrong (always one
``error: ...`` line on stderr); 4 a migration still running when --timeout-s ran out; 130 interrupted (Ctrl-C).
"""
import dataclasses
import functools
import json
import os
import sys
import time
from typing import Annotated, Any, Callable, Optional

import typer
from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.spinner import Spinner

from tmctl import ended, render
from tmctl.client import (
    Client, CoordinatorUnreachable, TmctlError, find_coordinator, find_keys, web_token_file,
)
from tmd import timeline as timelines
from tmd.protocol.usage import run_app
from tmd.protocol import (
    AddStandbyRequest,
    ErrorReply,
    EventsReply,
    EventsRequest,
    MigrateRequest,
    MigrationReply,
    MigrationRequest,
    Message,
    ProtocolError,
    StatusReply,
    StatusRequest,
)
from tmd.protocol import layout
from tmd.protocol.vocab import MIGRATION_EVENTS, ErrorCode, Event, ExitCode, MigrationState, NodeRole

DEFAULT_TIMEOUT_S = 2.0
POLL_INTERVAL_S = 0.2  # migrate: seconds between MigrationRequests
FOLLOW_INTERVAL_S = 0.5  # events --follow: seconds between EventsRequests when caught up
EVENTS_PAGE = 1000  # timeline: events asked for per EventsRequest
EXIT_ABORTED = ExitCode.FAILED  # migrate: the migration aborted (tmd's reason on stderr)
EXIT_REFUSED = ExitCode.REFUSED  # migrate: tmd refused the request (and every other error of any command)
EXIT_STILL_RUNNING = ExitCode.STILL_RUNNING  # migrate: the migration was still running when --timeout-s ran out

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Inspect a TrainMover job and live-migrate its ranks to standby nodes.",
)

CoordinatorOpt = Annotated[Optional[str], typer.Option(
    "--coordinator", metavar="ADDR", help="tmd address, e.g. tcp://host:5555 (env TM_COORDINATOR).")]
RunDirOpt = Annotated[Optional[str], typer.Option(
    "--run-dir", metavar="DIR", help="Run directory whose tmd.json names tmd (env TM_RUN_DIR; default ./tmrun).")]
JobOpt = Annotated[Optional[str], typer.Option(
    "--job", metavar="JOBID", help="Job id: read $TM_STATE_DIR/jobs/JOBID/tmd.json (default ~/.trainmover).")]
TimeoutOpt = Annotated[Optional[float], typer.Option(
    "--timeout", min=0.001, metavar="SECONDS",
    help=f"Seconds to wait for each reply (default {DEFAULT_TIMEOUT_S:g}).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")]


class _Fail(TmctlError):
    """Ends a command with ``error: <message>`` on stderr and exit code ``code``."""

    def __init__(self, message: str, code: int = ExitCode.REFUSED) -> None:
        super().__init__(message)
        self.code = code


def _error(message: str) -> None:
    typer.echo(f"error: {' '.join(message.split())}", err=True)


def _guarded(fn: Callable[..., int]) -> Callable[..., None]:
    """Run a command body that returns an exit code; turn every exception into one error line."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        try:
            code = fn(*args, **kwargs)
        except _Fail as e:
            _error(str(e))
            code = e.code
        except TmctlError as e:
            _error(str(e))
            code = ExitCode.REFUSED
        except ProtocolError as e:
            _error(f"bad reply from tmd: {e}")
            code = ExitCode.REFUSED
        except KeyboardInterrupt:
            _error("interrupted")
            code = ExitCode.INTERRUPTED
        except Exception as e:  # noqa: BLE001 - the CLI promises one line, never a traceback
            _error(f"{type(e).__name__}: {e}")
            code = ExitCode.REFUSED
        raise typer.Exit(code)

    return wrapper


@app.callback()
def _global_options(ctx: typer.Context, coordinator: CoordinatorOpt = None, run_dir: RunDirOpt = None,
                    job: JobOpt = None, timeout: TimeoutOpt = None) -> None:
    """Inspect a TrainMover job and live-migrate its ranks to standby nodes.

    The connection options may be given before the command or after it.
    """
    ctx.obj = {"coordinator": coordinator, "run_dir": run_dir, "job": job, "timeout": timeout}


def _options(ctx: typer.Context, coordinator: Optional[str], run_dir: Optional[str], job: Optional[str],
             timeout: Optional[float]) -> dict:
    """The connection options given after the command, falling back to those given before it."""
    before = ctx.obj or {}
    given = {"coordinator": coordinator, "run_dir": run_dir, "job": job, "timeout": timeout}
    return {k: v if v is not None else before.get(k) for k, v in given.items()}


def _connect(ctx: typer.Context, coordinator: Optional[str], run_dir: Optional[str], job: Optional[str],
             timeout: Optional[float]) -> Client:
    """A Client for the options given after the command, falling back to those given before it."""
    o = _options(ctx, coordinator, run_dir, job, timeout)
    address = find_coordinator(o["coordinator"], o["run_dir"], o["job"])
    return Client(address, DEFAULT_TIMEOUT_S if o["timeout"] is None else o["timeout"],
                  keys_dir=find_keys(o["run_dir"], o["job"]))


def _journal_instead(ctx: typer.Context, coordinator: Optional[str], run_dir: Optional[str], job: Optional[str],
                     error: CoordinatorUnreachable) -> str:
    """The run directory whose journal answers for a tmd that does not (the job ended, or tmd died); re-raises
    ``error`` when the options name no run directory with a journal."""
    o = _options(ctx, coordinator, run_dir, job, None)
    found = ended.find_run_dir(o["coordinator"], o["run_dir"], o["job"])
    if found is None:
        raise error
    return found


def _expect(reply: Message, cls: type) -> Any:
    """``reply`` if it is a ``cls``; an ErrorReply or any other message ends the command with exit code 2."""
    if isinstance(reply, ErrorReply):
        raise _Fail(reply.message or reply.code)
    if not isinstance(reply, cls):
        raise _Fail(f"unexpected reply from tmd: {reply.TYPE} (wanted {cls.__name__})")
    return reply


PIPED_WIDTH = 200  # columns of tmctl's tables when its output is not a terminal (rich's default, 80, elides names)


def _console() -> Console:
    """rich's console: a terminal's own width; piped or captured (a script, a log), wide enough that no column
    of a table collapses to ``…`` (unless COLUMNS says otherwise)."""
    wide = not sys.stdout.isatty() and "COLUMNS" not in os.environ
    return Console(highlight=False, width=PIPED_WIDTH if wide else None)


@app.command()
@_guarded
def status(ctx: typer.Context, json_: JsonOpt = False, coordinator: CoordinatorOpt = None,
           run_dir: RunDirOpt = None, job: JobOpt = None, timeout: TimeoutOpt = None) -> int:
    """Show the job's nodes, standbys and the current (or last) migration, and the job's settings that differ from
    the defaults (with --json: every setting, under ``config``).

    When tmd does not answer but the run directory's journal exists (the job ended, or tmd died), shows the
    last known state from the journal instead, marked as such (with --json: ``{"ended": ..., ...}``).
    """
    try:
        with _connect(ctx, coordinator, run_dir, job, timeout) as client:
            reply = _expect(client.request(StatusRequest()), StatusReply)
    except CoordinatorUnreachable as e:
        state = ended.last_known(_journal_instead(ctx, coordinator, run_dir, job, e))
        if json_:
            typer.echo(json.dumps(state))
        else:
            _console().print(render.last_known(state))
        return 0
    if json_:
        typer.echo(json.dumps(dataclasses.asdict(reply)))
        return 0
    console = _console()
    console.print(f"job [bold]{escape(reply.job)}[/]  world size {reply.world_size}  "
                  f"generation {reply.generation}  step {reply.step}")
    console.print(render.nodes_table(reply.nodes))
    standbys = [f"{n.get('name')} ({'warm' if n.get('warm') else 'cold'})"
                for n in reply.nodes if n.get("role") == NodeRole.STANDBY]
    console.print("standbys: " + escape(", ".join(standbys) if standbys else "none"))
    if reply.migration:
        console.print(render.migration_panel(reply.migration))
    else:
        console.print("no migration")
    if reply.recovery:
        console.print(render.recovery_line(reply.recovery, slurm=reply.slurm is not None))
    for line in render.slurm_lines(reply.slurm):
        console.print(line)
    for line in render.warning_lines(reply.warnings):
        console.print(line)
    for line in render.checkpoint_lines(reply.checkpoints):
        console.print(line)
    if reply.failure:
        console.print(render.failure_text(reply.failure))
    if reply.config is not None:
        console.print(render.config_line(reply.config))
    if reply.page:
        console.print(f"page: {escape(reply.page)}  (tmctl page: with its token; Prometheus: {escape(reply.page)}metrics)")
    return 0


@app.command()
@_guarded
def page(ctx: typer.Context,
         prometheus: Annotated[bool, typer.Option(
             "--prometheus", help="Print a Prometheus scrape config for the job instead.")] = False,
         coordinator: CoordinatorOpt = None, run_dir: RunDirOpt = None, job: JobOpt = None,
         timeout: TimeoutOpt = None) -> int:
    """Print the job's live status page address with its token (``http://HOST:PORT/?token=...``: open it in a
    browser; the page swaps the token for a cookie), or with --prometheus a scrape config for its metrics.

    The token is read from the job's keys directory (``web.token``), like the client key. Exit 2 when tmd does
    not answer, serves no page (``tmd ... --metrics-port -1``), or the token cannot be read.
    """
    with _connect(ctx, coordinator, run_dir, job, timeout) as client:
        reply = _expect(client.request(StatusRequest()), StatusReply)
    if not reply.page:
        raise _Fail(f"job {reply.job} serves no status page (tmd was started with --metrics-port -1)")
    o = _options(ctx, coordinator, run_dir, job, timeout)
    token_file = web_token_file(o["run_dir"], o["job"])
    try:
        with open(token_file or "") as f:
            token = f.read().strip()
    except OSError as e:
        raise _Fail(f"cannot read the job's web token ({token_file or 'no keys directory found'}): "
                    f"{e.strerror or e}; give --job/--run-dir, or TM_KEYS")
    if prometheus:
        host_port = reply.page.split("//", 1)[-1].rstrip("/")
        typer.echo(f"scrape_configs:\n  - job_name: trainmover-{reply.job}\n    authorization:\n"
                   f"      type: Bearer\n      credentials_file: {os.path.abspath(token_file)}\n"
                   f"    static_configs:\n      - targets: [\"{host_port}\"]")
    else:
        typer.echo(f"{reply.page}?token={token}")
    return 0


standby_app = typer.Typer(help="The standby pool.", no_args_is_help=True)
app.add_typer(standby_app, name="standby")


@standby_app.command("add")
@_guarded
def standby_add(
    ctx: typer.Context,
    node: Annotated[str, typer.Argument(help="Name of the new standby node.")],
    coordinator: CoordinatorOpt = None, run_dir: RunDirOpt = None, job: JobOpt = None, timeout: TimeoutOpt = None,
) -> int:
    """Add a standby node (local mode: tmd starts its processes; a recovery waiting for a standby goes on)."""
    with _connect(ctx, coordinator, run_dir, job, timeout) as client:
        _expect(client.request(AddStandbyRequest(node=node)), StatusReply)
    typer.echo(f"standby {node} added; it is warm once its processes register")
    return 0


def _print_new_phases(m: dict, shown: set, t_start: float) -> None:
    """Print the phases of ``m`` not yet in ``shown``, in order, timed from the request (seconds)."""
    phases = {k: v for k, v in (m.get("phases") or {}).items() if isinstance(v, (int, float))}
    t0 = phases.get(MigrationState.REQUESTED, min(phases.values(), default=t_start))
    reached = sorted(phases.items(), key=lambda kv: kv[1])
    state = m.get("state")
    if state and state not in phases:
        reached.append((state, time.time()))
    for name, ts in reached:
        if name not in shown:
            shown.add(name)
            typer.echo(render.phase_line(ts - t0, name))


RETRY_CODES = (ErrorCode.BUSY_STANDBY, ErrorCode.NOT_READY)  # refusals that time can cure


def node_list(option: str, value: str) -> list[str]:
    """``n1,n2`` -> ``["n1", "n2"]`` (spaces around names dropped). Raises _Fail (exit 2) for an empty name
    (``n1,,n2``, a trailing comma); tmd judges the rest (unknown, repeated, or unpaired names)."""
    names = [n.strip() for n in value.split(",")]
    if not all(names):
        raise _Fail(f"{option} {value!r}: a comma-separated list of node names, with no empty name")
    return names


def _request_migration(client: Client, sources: list[str], targets: list[str], wait_s: float) -> Message:
    """Send the MigrateRequest; while tmd answers a RETRY_CODES refusal, ask again for up to ``wait_s`` seconds.
    Raises _Fail (exit 1) with tmd's last reason when the wait runs out."""
    deadline = time.monotonic() + wait_s
    while True:
        reply = client.request(MigrateRequest(sources=sources, targets=targets))
        if not (isinstance(reply, ErrorReply) and reply.code in RETRY_CODES and wait_s > 0):
            return reply
        if time.monotonic() >= deadline:
            what = "standby" if len(targets) == 1 else "standbys"
            raise _Fail(f"timed out after {wait_s:g} s waiting for {what} '{','.join(targets)}': {reply.message}",
                        code=EXIT_ABORTED)
        time.sleep(POLL_INTERVAL_S * 2.5)  # tmd has no event to wait on for a standby to come up: ask again


@app.command()
@_guarded
def migrate(
    ctx: typer.Context,
    source: Annotated[str, typer.Option(
        "--from", metavar="NODE[,NODE...]", help="Node whose ranks move; several, comma-separated, move at once.")],
    target: Annotated[str, typer.Option(
        "--to", metavar="STANDBY[,STANDBY...]",
        help="Standby node that takes them; one per --from node, in the same order.")],
    wait: Annotated[bool, typer.Option(
        "--wait/--no-wait",
        help="Follow the migration until it commits or aborts (the default), or print its id and return at "
             "once.")] = True,
    wait_standby_s: Annotated[float, typer.Option(
        "--wait-standby-s", min=0.0, metavar="SECONDS",
        help="While tmd refuses because the standby is not warm yet (or the job not ready), ask again for up "
             "to this long (exit 1 then).")] = 0.0,
    timeout_s: Annotated[float, typer.Option(
        "--timeout-s", min=0.0, metavar="SECONDS",
        help="Stop following after this long (exit 4; the migration goes on in tmd).")] = 300.0,
    json_: JsonOpt = False,
    coordinator: CoordinatorOpt = None, run_dir: RunDirOpt = None, job: JobOpt = None,
    timeout: TimeoutOpt = None,
) -> int:
    """Move every rank of node --from to standby node --to and follow the migration until it ends.

    ``--from n1,n2 --to s1,s2`` moves several nodes in one migration (one prepare, one switch step): n1's ranks
    to s1, n2's to s2. Under SLURM, --to may also be a standby job id or ``any``.

    While it waits, a terminal shows each phase as it happens (a spinner on the current one, the seconds spent
    in each); when stdout is not a terminal, one ``[  1.23 s] state`` line per phase instead. With --json, prints
    the final migration as one JSON object instead (with --no-wait: the accepted one). If tmd stops answering
    meanwhile (the job ended, or tmd died), the run directory's journal says how the migration ended.

    Exit codes: 0 committed (or accepted, with --no-wait); 1 aborted (tmd's reason on stderr), or a standby
    was not ready within --wait-standby-s; 2 tmd refused it (a node named twice, counts that differ, an unknown
    node, a standby that is not warm, ...) or no tmd answered; 4 still running after --timeout-s; 130 interrupted.
    """
    t_start = time.time()
    sources, targets = node_list("--from", source), node_list("--to", target)
    with _connect(ctx, coordinator, run_dir, job, timeout) as client:
        m = _expect(_request_migration(client, sources, targets, wait_standby_s), MigrationReply).migration
        mid = m.get("id")
        if not isinstance(mid, int) or isinstance(mid, bool):
            raise _Fail(f"tmd accepted the migration but gave no usable id: {mid!r}")
        if not wait:
            typer.echo(json.dumps(m) if json_ else str(mid))
            return 0
        if not json_:
            typer.echo(f"migration {mid}: {render.moves(m)}")
        follow = _follow_live if not json_ and stdout_is_terminal() else _follow_lines
        try:
            m = follow(client, m, t_start, time.monotonic() + timeout_s, quiet=json_)
        except KeyboardInterrupt:
            raise _Fail(f"interrupted; migration {mid} goes on in tmd (watch it with tmctl status)", code=ExitCode.INTERRUPTED)
        except CoordinatorUnreachable as e:  # tmd stopped answering (the job ended, or tmd died): its journal
            m = _journalled_migration(_journal_instead(ctx, coordinator, run_dir, job, e), m)
            if m.get("state") not in render.FINAL_STATES:
                raise e
    if m.get("state") not in render.FINAL_STATES:
        raise _Fail(f"migration {mid} still {m.get('state')} after {timeout_s:g} s "
                    f"(it goes on in tmd; watch it with tmctl status)", code=EXIT_STILL_RUNNING)
    if json_:
        typer.echo(json.dumps(m))
    if m.get("state") == MigrationState.ABORTED:
        raise _Fail(f"migration {mid} aborted: {m.get('reason') or 'no reason given'}", code=EXIT_ABORTED)
    if not json_:
        typer.echo(render.migration_line(m))
    return 0


def _journalled_migration(run_dir: str, m: dict) -> dict:
    """Migration ``m`` as the journal of ``run_dir`` last has it: the state and fields of the last event
    journalled for its id (MIGRATION_EVENTS)."""
    states = {event: state for state, event in MIGRATION_EVENTS.items()}
    for ev in ended.read_journal(run_dir):
        if ev.get("migration_id") == m.get("id") and ev.get("event") in states:
            m = {**m, **{k: v for k, v in ev.items() if k not in ("seq", "ts", "event", "migration_id")},
                 "state": states[ev["event"]]}
    return m


def stdout_is_terminal() -> bool:
    """Whether stdout is a terminal (migrate then draws its phases live instead of printing lines)."""
    return sys.stdout.isatty()


def _next_state(client: Client, m: dict) -> dict:
    """The migration ``m`` as tmd has it now (after POLL_INTERVAL_S)."""
    time.sleep(POLL_INTERVAL_S)
    return _expect(client.request(MigrationRequest(migration_id=m.get("id"))), MigrationReply).migration


def _follow_lines(client: Client, m: dict, t_start: float, deadline: float, quiet: bool) -> dict:
    """Poll ``m`` until it is over or ``deadline`` (time.monotonic()) passes, printing one line per new phase
    (none when ``quiet``); returns the migration as last seen."""
    shown: set = set()
    while True:
        if not quiet:
            _print_new_phases(m, shown, t_start)
        if m.get("state") in render.FINAL_STATES or time.monotonic() >= deadline:
            return m
        m = _next_state(client, m)


def _follow_live(client: Client, m: dict, t_start: float, deadline: float, quiet: bool) -> dict:
    """Like :func:`_follow_lines`, drawn as a live list of phases in the terminal (render.migration_progress);
    the current phase's seconds are counted here, from when tmctl first saw it."""
    del t_start, quiet
    spinner = Spinner("dots", style="yellow")
    seen_state, seen_at = m.get("state"), time.monotonic()
    with Live(render.migration_progress(m, spinner), console=_console(), refresh_per_second=10) as live:
        while True:
            if m.get("state") != seen_state:
                seen_state, seen_at = m.get("state"), time.monotonic()
            live.update(render.migration_progress(m, spinner, time.monotonic() - seen_at))
            if m.get("state") in render.FINAL_STATES or time.monotonic() >= deadline:
                return m
            m = _next_state(client, m)


@app.command()
@_guarded
def events(
    ctx: typer.Context,
    after: Annotated[int, typer.Option("--after", metavar="N", help="Only events with seq > N.")] = 0,
    limit: Annotated[int, typer.Option("--limit", min=1, help="At most this many events per request.")] = 100,
    json_: Annotated[bool, typer.Option("--json", help="Print one JSON object per event per line.")] = False,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new events until Ctrl-C.")] = False,
    steps: Annotated[bool, typer.Option(
        "--steps", help="Also show the step_times events (one a second; tmctl timeline draws them).")] = False,
    coordinator: CoordinatorOpt = None, run_dir: RunDirOpt = None, job: JobOpt = None,
    timeout: TimeoutOpt = None,
) -> int:
    """Show tmd's event log (a table; one line per event with --follow or --json).

    When tmd does not answer but the run directory's journal exists (the job ended), reads it instead.
    """
    def shown(events: list[dict]) -> list[dict]:
        return [ev for ev in events if steps or ev.get("event") != Event.STEP_TIMES]

    client = _connect(ctx, coordinator, run_dir, job, timeout)
    try:
        batch = _expect(client.request(EventsRequest(after=after, limit=limit)), EventsReply).events
    except CoordinatorUnreachable as e:
        client.close()
        journal = ended.read_journal(_journal_instead(ctx, coordinator, run_dir, job, e))
        batch = shown([ev for ev in journal if isinstance(ev.get("seq"), int) and ev["seq"] > after])
        if json_ or follow:
            for ev in batch:
                typer.echo(json.dumps(ev) if json_ else render.event_line(ev))
        else:
            _console().print(render.events_table(batch) if batch else f"no events after {after}")
        return 0
    with client:
        if not follow and not json_:
            batch = shown(batch)
            _console().print(render.events_table(batch) if batch else f"no events after {after}")
            return 0
        try:
            while True:
                for ev in batch:
                    if isinstance(ev.get("seq"), int):
                        after = max(after, ev["seq"])
                    if steps or ev.get("event") != Event.STEP_TIMES:
                        typer.echo(json.dumps(ev) if json_ else render.event_line(ev))
                if not follow:
                    return 0
                if len(batch) < limit:
                    time.sleep(FOLLOW_INTERVAL_S)
                batch = _expect(client.request(EventsRequest(after=after, limit=limit)), EventsReply).events
        except KeyboardInterrupt:
            return 0


def _journal_events(ctx: typer.Context, coordinator: Optional[str], run_dir: Optional[str], job: Optional[str],
                    timeout: Optional[float]) -> list[dict]:
    """Every event of the job's journal, oldest first: ``--run-dir DIR``'s ``events.jsonl`` when it exists (read
    directly); otherwise tmd's, paged through EventsRequests; otherwise (tmd does not answer: the job ended) the
    run directory's journal. Raises _Fail (exit 2) when none is found."""
    o = _options(ctx, coordinator, run_dir, job, timeout)
    if o["run_dir"] and os.path.exists(layout.RunDir(o["run_dir"]).events):
        return ended.read_journal(o["run_dir"])
    try:
        with _connect(ctx, coordinator, run_dir, job, timeout) as client:
            out: list[dict] = []
            after = 0
            while True:
                batch = _expect(client.request(EventsRequest(after=after, limit=EVENTS_PAGE)), EventsReply).events
                seqs = [ev["seq"] for ev in batch if isinstance(ev, dict) and isinstance(ev.get("seq"), int)]
                out += [ev for ev in batch if isinstance(ev, dict)]
                if not seqs or max(seqs) <= after:
                    return out
                after = max(seqs)
    except CoordinatorUnreachable as e:
        return ended.read_journal(_journal_instead(ctx, coordinator, run_dir, job, e))


@app.command()
@_guarded
def timeline(
    ctx: typer.Context,
    png: Annotated[Optional[str], typer.Option(
        "--png", metavar="FILE", help="Draw the timeline into this PNG file (matplotlib).")] = None,
    minutes: Annotated[Optional[float], typer.Option(
        "--minutes", min=0.0, metavar="N", help="Only the last N minutes of the journal.")] = None,
    json_: Annotated[bool, typer.Option("--json", help="Print the timeline as one JSON object.")] = False,
    coordinator: CoordinatorOpt = None, run_dir: RunDirOpt = None, job: JobOpt = None,
    timeout: TimeoutOpt = None,
) -> int:
    """Draw the job's step times against wall time, with its migrations and failure incidents marked.

    In a terminal: a sparkline of step time (each column the slowest step of its slice of time), a line under it
    marking each migration (M), incident (R), failed node or job (x) and straggler (s), then one line per
    migration and incident (outcome, duration, seconds in each phase). With --png FILE: the same as a picture
    (each migration's and incident's phases shaded). With --json: the timeline as a JSON object
    (tmd.timeline). Reads tmd's journal, the run directory's when tmd does not answer (the job ended), or
    ``--run-dir DIR``'s ``events.jsonl`` directly. Exit 0; 2 when there is no journal, it is empty, or the PNG
    cannot be written.
    """
    events = _journal_events(ctx, coordinator, run_dir, job, timeout)
    tl = timelines.build(events)
    if tl.start is None:
        raise _Fail("the journal has no events")
    if minutes is not None:
        tl = timelines.build(events, since_ts=tl.end - minutes * 60.0)
    data = tl.to_dict()
    if png:
        from tmctl import timeline_plot  # matplotlib only when a picture is asked for

        try:
            counts = timeline_plot.draw(data, png)
        except OSError as e:
            raise _Fail(f"cannot write {png}: {e.strerror or e}")
        if not json_:
            typer.echo(f"wrote {png}: {counts['migration']} migration(s), {counts['incident']} incident(s), "
                       f"{counts['marks']} mark(s), {counts['steps']} step(s)")
    if json_:
        typer.echo(json.dumps(data))
    elif not png:
        for line in render.timeline_lines(data, _console().width):
            typer.echo(line)
    return 0


def main(argv: Optional[list[str]] = None) -> None:
    """Console-script entry point (``tmctl``). A usage error is one line on stderr, ``error: ...``, with exit 2,
    as for ``tmd`` (tmd.protocol.usage)."""
    run_app(app, argv)


if __name__ == "__main__":
    main()

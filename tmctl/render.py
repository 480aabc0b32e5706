"""Rich renderings of what tmd reports: the nodes table, a migration (panel or one line), the job's settings that
are not the defaults, events, a job's timeline (sparkline, marker line, legend) and a migration's phases as they
happen (``tmctl migrate`` in a terminal).

Inputs are the plain dicts of :mod:`tmd.protocol` replies; any field may be missing or None (shown as ``-``).
Durations are seconds, wall-clock times are epoch seconds, sizes are bytes.
"""
from __future__ import annotations

import json
import math
import re
import time
from typing import Any, Optional

from rich.markup import escape
from rich.panel import Panel
from rich.table import Table

from tmd.config import changed
from tmd.protocol.vocab import REFUSING_WARNINGS, Health, MigrationState, NodeRole
from tmd.timeline import MarkKind, SpanKind

FINAL_STATES = tuple(s for s in MigrationState if s.finished)  # a migration in one of these is over

_HEALTH_STYLE = {Health.HEALTHY: "green", Health.UNKNOWN: "yellow", Health.UNHEALTHY: "red"}
_MIGRATION_STATES = frozenset(MigrationState)
_STATE_STYLE = {MigrationState.COMMITTED: "green", MigrationState.ABORTED: "red"}


def seconds(value: Any, digits: int = 2) -> str:
    """``1.23`` for a number of seconds, ``-`` for None."""
    if value is None:
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, (int, float)) else str(value)


def _with_unit(value: Any) -> str:
    return "-" if value is None else f"{seconds(value)} s"


def size(n: Any) -> str:
    """Human-readable byte count: ``512 B``, ``1.5 MiB``; ``-`` for None."""
    if not isinstance(n, (int, float)):
        return _dash(n)
    value, unit = float(n), "B"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            break
        value /= 1024
    return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"


def ranks(values: Any) -> str:
    """``[0, 1, 2, 5]`` -> ``0-2,5``."""
    if not values:
        return "-"
    if not isinstance(values, list) or not all(isinstance(r, int) for r in values):
        return ",".join(map(str, values)) if isinstance(values, list) else str(values)
    out: list[str] = []
    nums = sorted(values)
    start = prev = nums[0]
    for r in nums[1:] + [None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ",".join(out)


# Characters that would act on the terminal rather than show: C0/C1 controls but tab and newline (ESC starts
# colour and cursor sequences), bidirectional overrides and isolates (U+202A-U+202E, U+2066-U+2069, which reorder
# what follows them), zero-width marks and the BOM. Text from ranks (errors, warnings) and the journal may hold any.
_UNPRINTABLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200b-\u200f\u202a-\u202e\u2066-\u2069\ufeff]")


def printable(text: str) -> str:
    """``text`` with every character that would act on a terminal written as its Python escape (``\\x1b``,
    ``\\u202e``); tabs and newlines stay."""
    return _UNPRINTABLE.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


def _dash(value: Any) -> str:
    return "-" if value is None else printable(str(value))


def _cell(value: Any) -> str:
    """``_dash`` escaped for rich markup (names and free text may contain brackets)."""
    return escape(_dash(value))


def nodes_table(nodes: list[dict]) -> Table:
    """One row per node; a standby's role reads ``standby (warm)`` or ``standby (cold)``, a guard's
    ``guarding 0-1 (warm)`` or ``guarding 0-1 (warming)`` (the ranks it is warm for). ``network``: the interface
    and the address its data plane uses (``tm0 10.214.0.3``), once a process of it registered."""
    table = Table(title="nodes", title_justify="left")
    for name in ("node", "role", "ranks", "health"):
        table.add_column(name, no_wrap=name in ("role", "health"))
    for name in ("hb age (s)", "step", "step time (s)"):  # hb age: seconds since the node's last heartbeat
        table.add_column(name, justify="right")
    network = any(n.get("address") for n in nodes)  # the interface and address its data plane uses (tmd.netif)
    if network:
        table.add_column("network", no_wrap=True)
    slurm = any("slurm_state" in n for n in nodes)  # SLURM mode: the node's SLURM state and the job holding it
    if slurm:
        table.add_column("slurm", no_wrap=True)
    for n in nodes:
        role = _dash(n.get("role"))
        if role == NodeRole.STANDBY:
            role += " (warm)" if n.get("warm") else " (cold)"
        elif role == NodeRole.GUARDING:  # a standby warm as these ranks in case their node fails (tmd.guards)
            role += f" {ranks(n.get('guards'))}" + (" (warm)" if n.get("warm") else " (warming)")
        health = _dash(n.get("health"))
        style = _HEALTH_STYLE.get(health, "")
        health_cell = f"[{style}]{escape(health)}[/]" if style else escape(health)
        if n.get("stragglers"):  # ranks that arrive late at collectives (tmd.health)
            health_cell += f", [yellow]straggler {ranks(n['stragglers'])}[/]"
        cells = [_cell(n.get("name")), escape(role), ranks(n.get("ranks")), health_cell,
                 seconds(n.get("heartbeat_age_s"), 1), _dash(n.get("step")), seconds(n.get("step_time_s"), 3)]
        if network:
            cells.append(escape(" ".join(x for x in (n.get("iface"), n.get("address")) if x) or "-"))
        if slurm:
            state = _dash(n.get("slurm_state")) + (f" ({n['slurm_reason']})" if n.get("slurm_reason") else "")
            cells.append(escape(state + (f", job {n['slurm_job']}" if n.get("slurm_job") else "")))
        table.add_row(*cells)
    return table


def _phases(m: dict) -> str:
    return ", ".join(f"{k} {seconds(v)} s" for k, v in (m.get("phases_s") or {}).items()) or "-"


def downtime(m: dict) -> str:
    """A migration's downtime: ``0.12 s``; ``pending (known after step N)`` for a committed migration whose
    measuring window (the switch step and the 5 after it) has not passed yet; ``-`` otherwise."""
    if m.get("downtime_s") is None and m.get("state") == MigrationState.COMMITTED:
        after = m.get("downtime_after_step")
        return "pending" + (f" (known after step {after}; see tmctl status)" if after is not None else "")
    return _with_unit(m.get("downtime_s"))


def moves(m: dict) -> str:
    """A migration's pairs: ``n2 -> s1``, or ``n1 -> s1, n2 -> s2`` for several nodes at once (from its
    ``sources`` and ``targets`` lists; ``source`` and ``target`` when it has no lists)."""
    sources, targets = m.get("sources"), m.get("targets")
    if isinstance(sources, list) and isinstance(targets, list) and sources and len(sources) == len(targets):
        return ", ".join(f"{_dash(a)} -> {_dash(b)}" for a, b in zip(sources, targets))
    return f"{_dash(m.get('source'))} -> {_dash(m.get('target'))}"


def migration_line(m: dict) -> str:
    """The migration in one plain line: id, its pairs (source -> target), state, switch step, phases, downtime,
    bytes."""
    parts = [f"migration {_dash(m.get('id'))}: {moves(m)}", _dash(m.get("state"))]
    if m.get("state") == MigrationState.ABORTED and m.get("reason"):
        parts[-1] += f" ({m['reason']})"
    if m.get("switch_step") is not None:
        parts.append(f"switch step {m['switch_step']}")
    if m.get("phases_s"):
        parts.append(f"phases: {_phases(m)}")
    parts.append(f"downtime {downtime(m)}")
    parts.append(f"moved {size(m.get('bytes_moved'))}")
    return "; ".join(parts)


def migration_panel(m: dict) -> Panel:
    """A panel titled ``migration in progress`` (or ``last migration`` once committed or aborted)."""
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    state = _dash(m.get("state"))
    style = _STATE_STYLE.get(state, "yellow")
    grid.add_row("id", _cell(m.get("id")))
    grid.add_row("move", escape(moves(m)).replace(" -> ", " → "))
    grid.add_row("state", f"[{style}]{escape(state)}[/]")
    if state == MigrationState.ABORTED:
        grid.add_row("reason", _cell(m.get("reason")))
    grid.add_row("switch step", _cell(m.get("switch_step")))
    grid.add_row("phases", escape(_phases(m)))
    grid.add_row("downtime", escape(downtime(m)))
    moved = m.get("bytes_moved")
    exact = isinstance(moved, int) and moved >= 1024
    grid.add_row("bytes moved", f"{size(moved)} ({moved} B)" if exact else size(moved))
    title = "last migration" if state in FINAL_STATES else "migration in progress"
    return Panel(grid, title=title, title_align="left", expand=False)


def phase_line(elapsed_s: float, state: str) -> str:
    """``[  1.23 s] warming``: a phase reached ``elapsed_s`` seconds after the migration was requested."""
    return f"[{elapsed_s:7.2f} s] {state}"


def clock(ts: Any) -> str:
    """Local wall-clock time ``HH:MM:SS.mmm`` of epoch seconds ``ts``."""
    if not isinstance(ts, (int, float)):
        return _dash(ts)
    return time.strftime("%H:%M:%S", time.localtime(ts)) + f".{int(ts * 1000) % 1000:03d}"


def _details(ev: dict) -> str:
    return " ".join(f"{printable(str(k))}={printable(v) if isinstance(v, str) else json.dumps(v)}"
                    for k, v in ev.items() if k not in ("seq", "ts", "event"))


def event_line(ev: dict) -> str:
    """One event as ``seq time event k=v ...`` (for ``tmctl events --follow``)."""
    return f"{_dash(ev.get('seq')):>6} {clock(ev.get('ts'))} {_dash(ev.get('event'))} {_details(ev)}".rstrip()


def events_table(events: list[dict]) -> Table:
    """Columns seq, time (local), event, details (the event's other fields as ``key=value``)."""
    table = Table(title="events", title_justify="left")
    table.add_column("seq", justify="right")
    table.add_column("time")
    table.add_column("event")
    table.add_column("details")
    for ev in events:
        table.add_row(_cell(ev.get("seq")), escape(clock(ev.get("ts"))), _cell(ev.get("event")),
                      escape(_details(ev)))
    return table


def recovery_line(r: dict, slurm: bool = False) -> str:
    """The failure recovery in progress (or the last one) in one line: id, state, lost ranks, standby use,
    resume step, phases (seconds). ``slurm``: the job runs under SLURM (how to add a standby differs)."""
    state = r.get("state")
    if r.get("waiting_standby"):
        state = ("waiting for a standby (sbatch --reservation=standby slurm/standby.sbatch JOBID)" if slurm
                 else "waiting for a standby (tmctl standby add NAME)")
    parts = [f"recovery {_dash(r.get('id'))}: {state}", f"lost ranks {r.get('lost_ranks')}",
             f"failed {', '.join(r.get('failed_nodes') or []) or '-'}"]
    if r.get("standbys"):
        parts.append("replaced by " + ", ".join(f"{a} -> {b}" for a, b in r["standbys"].items()))
    if r.get("resume_step") is not None:
        parts.append(f"resume at step {r['resume_step']}")
    if r.get("phases_s"):
        parts.append(" ".join(f"{k} {v:.3f}s" for k, v in r["phases_s"].items()))
    parts.append(f"reason: {r.get('reason')}")
    return escape("  ".join(parts))


def slurm_lines(slurm: Any) -> list[str]:
    """SLURM mode: the reservation and its standby jobs, the standby pool (``--keep-standbys``: how many are
    warm or on their way against how many it keeps, the jobs tmd submitted, why it is short and when it tries
    again, each pending job and squeue's reason) and the failed nodes tmd drained. None in local mode."""
    if not isinstance(slurm, dict):
        return []
    out = [f"slurm: reservation {_cell(slurm.get('reservation'))}: {_cell(slurm.get('standbys'))}"]
    pool = slurm.get("pool")
    if isinstance(pool, dict):
        line = (f"standby pool: {_cell(pool.get('have'))} of {_cell(pool.get('keep'))} warm or pending; "
                f"submitted: {', '.join(map(str, pool.get('submitted') or [])) or 'none'}")
        for job in pool.get("pending") or []:
            if isinstance(job, dict):
                line += f"; job {_cell(job.get('slurm_job'))} {_cell(job.get('state'))}" + (
                    f" ({_cell(job.get('reason'))})" if job.get("reason") else "")
        out.append(line)
        if pool.get("reason"):
            retry = f" (next try in {pool['retry_in_s']:g} s)" if isinstance(pool.get("retry_in_s"), (int, float)) \
                else ""
            out.append(f"[yellow]standby pool short[/]: {_cell(pool.get('reason'))}{retry}")
    if slurm.get("drained"):
        out.append(f"drained by tmd (failed): {', '.join(map(_cell, slurm['drained']))}")
    return out


def warning_lines(warnings: Any) -> list[str]:
    """One line per misuse a rank reported (rank, node, code, message); none for no warnings."""
    out = []
    for w in warnings or []:
        if isinstance(w, dict):
            out.append(f"[yellow]warning[/]: rank {_cell(w.get('rank'))} on {_cell(w.get('node'))}: "
                       f"{_cell(w.get('code'))}: {_cell(w.get('message'))}"
                       + (" (migrations and recoveries are refused)" if w.get("code") in REFUSING_WARNINGS else ""))
    return out


def config_line(config: Any) -> str:
    """The job's settings that differ from the defaults (tmd.config.changed), as ``name=value`` pairs:
    ``config: heartbeat_timeout_s=12.0 suspect_after_s=1.5``, or ``config: defaults``."""
    different = changed(config)
    if not different:
        return "config: defaults"
    return "config: " + " ".join(f"{escape(str(k))}={_cell(v)}" for k, v in different.items())
def checkpoint_lines(c: Any) -> list[str]:
    """The checkpoint tier (StatusReply.checkpoints): where and how often, the newest committed step, a failed
    save's warning, one line per restart from a checkpoint; none when checkpoints are off."""
    if not isinstance(c, dict):
        return []
    latest = "none yet" if c.get("latest") is None else f"step {_cell(c.get('latest'))}"
    out = [escape(f"checkpoints: {c.get('dir')} every {c.get('every')} steps, keep {c.get('keep')}; newest: ")
           + escape(latest)]
    if c.get("failed"):
        out.append(f"[yellow]warning[/]: checkpoint_failed: {_cell(c.get('failed'))} (training goes on; earlier "
                   f"checkpoints are kept)")
    for r in c.get("restarts") or []:
        if isinstance(r, dict):
            out.append(f"[yellow]restarted[/] from the {_cell(r.get('tier'))} tier at step {_cell(r.get('step'))} "
                       f"({_cell(r.get('work_lost_s'))} s of work lost): {_cell(r.get('reason'))}")
    return out


def failure_text(f: dict) -> str:
    """Why the job failed: rank, node, kind and error on one line, then the traceback (or log tail) if any."""
    head = (f"[red]job failed[/]: rank {_cell(f.get('rank'))} on {_cell(f.get('node'))} ({_cell(f.get('kind'))}): "
            f"{_cell(f.get('error'))}")
    tb = f.get("traceback") or f.get("log_tail")
    return head + ("\n" + escape(printable(str(tb)).rstrip("\n")) if tb else "")


def last_known(state: dict) -> str:
    """The last known state of a job whose tmd does not answer, from its journal (tmctl.ended.last_known)."""
    last = state.get("last_event") or {}
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(last["ts"])) if isinstance(last.get("ts"), (int, float)) \
        else "-"
    if state.get("ended"):
        head = (f"[bold]job {_cell(state.get('job'))} has ended[/] (exit code {_cell(state.get('exit_code'))}, "
                f"at {when})")
    else:
        head = (f"[yellow]job {_cell(state.get('job'))}: tmd does not answer and did not journal its stop[/] (it may "
                f"have died: tmd resume restarts it; last event at {when})")
    lines = [head, f"from the journal of {_cell(state.get('run_dir'))}; last step seen {_cell(state.get('step'))}"]
    if state.get("reason"):
        lines.append(f"failed: {_cell(state['reason'])}")
    if state.get("config") is not None:
        lines.append(config_line(state["config"]))
    lines += warning_lines(state.get("warnings"))
    if state.get("failure"):
        lines.append(failure_text(state["failure"]))
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------------------
# A job's timeline in a terminal (tmctl timeline): a sparkline of step time, a line marking the spans, a legend
# --------------------------------------------------------------------------------------------------------------
SPARK_BLOCKS = "▁▂▃▄▅▆▇█"  # lowest to highest step time; a column without a step is a space
SPAN_LETTERS = {SpanKind.MIGRATION: "M", SpanKind.INCIDENT: "R"}  # a span's columns on the marker line
MARK_LETTER = "x"  # a failure mark's column (node_failed, job_failed); stragglers are "s"
_MARK_LETTERS = {MarkKind.STRAGGLER: "s"}


def sparkline(steps: list, start: float, end: float, width: int) -> str:
    """``width`` characters: column i holds the largest step time (seconds) of the steps whose ts (epoch seconds)
    falls in the i-th of ``width`` equal slices of ``[start, end]``, as a block scaled from 0 to the largest step
    time; a space where no step ended. ``steps``: ``[[step, ts, seconds], ...]``."""
    bins: list[Optional[float]] = [None] * max(width, 1)
    for _, ts, value in steps:
        i = _column(ts, start, end, len(bins))
        bins[i] = value if bins[i] is None else max(bins[i], value)
    top = max((v for v in bins if v is not None), default=0.0)
    out = []
    for v in bins:
        if v is None:
            out.append(" ")
        else:
            # (0, top/8] -> the lowest block, ..., (7 top/8, top] -> the full one
            level = 0 if top <= 0 else math.ceil(v / top * len(SPARK_BLOCKS) - 1e-9) - 1
            level = min(max(level, 0), len(SPARK_BLOCKS) - 1)
            out.append(SPARK_BLOCKS[level])
    return "".join(out)


def _column(ts: float, start: float, end: float, width: int) -> int:
    if end <= start:
        return 0
    return min(max(int((ts - start) / (end - start) * width), 0), width - 1)


def span_marks(spans: list, marks: list, start: float, end: float, width: int) -> str:
    """The marker line under :func:`sparkline`: each span's columns filled with its letter (SPAN_LETTERS, a
    running span up to ``end``), each failure mark's column with MARK_LETTER (stragglers ``s``); dots elsewhere."""
    line = ["·"] * max(width, 1)
    for s in spans:
        letter = SPAN_LETTERS.get(s.get("kind"), "?")
        s_end = s.get("end") if s.get("end") is not None else end
        for i in range(_column(s["start"], start, end, len(line)), _column(s_end, start, end, len(line)) + 1):
            line[i] = letter
    for m in marks:
        line[_column(m["ts"], start, end, len(line))] = _MARK_LETTERS.get(m.get("kind"), MARK_LETTER)
    return "".join(line)


def span_line(span: dict) -> str:
    """``M migration 1: n2→s1  committed in 1.52 s  (requested 0.01 s, warming 0.80 s, ...)``."""
    end = span.get("end")
    took = f"in {end - span['start']:.2f} s" if end is not None else "so far"
    phases = ", ".join(f"{ph.get('name')} {ph['end'] - ph['start']:.2f} s" if ph.get("end") is not None
                       else f"{ph.get('name')} ..." for ph in span.get("phases") or [])
    return (f"{SPAN_LETTERS.get(span.get('kind'), '?')} {span.get('label')}  {span.get('outcome')} {took}"
            + (f"  ({phases})" if phases else ""))


def timeline_lines(tl: dict, width: int) -> list[str]:
    """A ``Timeline.to_dict()`` as plain lines for a ``width``-column terminal: a head line, the step-time
    sparkline, the marker line, the time axis, then one line per span and per mark (seconds since the start)."""
    start, end = tl.get("start"), tl.get("end")
    steps, spans, marks = tl.get("steps") or [], tl.get("spans") or [], tl.get("marks") or []
    if start is None or end is None:
        return ["the journal has no events"]
    times = sorted(s[2] for s in steps)
    head = f"job {tl.get('job') or '-'}: {len(steps)} step(s) over {end - start:.1f} s"
    if times:
        head += f"; step time max {times[-1]:.3f} s, median {times[len(times) // 2]:.3f} s"
    label = f"{times[-1]:.3f} s" if times else "-"
    pad = len(label) + 1
    cols = max(width - pad - 2, 10)
    axis_end = f"{end - start:.1f} s"
    lines = [head,
             f"{label} ┤{sparkline(steps, start, end, cols)}",
             f"{' ' * pad}└{span_marks(spans, marks, start, end, cols)}",
             f"{' ' * (pad + 1)}0 s{axis_end:>{max(cols - 3, len(axis_end))}}"]
    lines += [span_line(s) for s in spans]
    for m in marks:
        lines.append(f"{_MARK_LETTERS.get(m.get('kind'), MARK_LETTER)} {m['ts'] - start:7.2f} s  {m.get('label')}")
    if not spans and not marks:
        lines.append("no migration, incident or failure in this window")
    return lines


# --------------------------------------------------------------------------------------------------------------
# A migration's phases as they happen (tmctl migrate in a terminal)
# --------------------------------------------------------------------------------------------------------------
def reached_states(m: dict, current_s: float = 0.0) -> list[tuple[str, float, Optional[float]]]:
    """The states ``m`` went through, in order: ``(state, entered ts (epoch seconds, tmd's clock), seconds spent
    in it)``, from ``m["phases"]`` (state -> ts; marks that are not states are left out). The state it is in now
    has spent ``current_s`` (measured by the caller: tmd's clock may differ from ours); a final state (committed,
    aborted) None."""
    phases = m.get("phases") if isinstance(m.get("phases"), dict) else {}
    states = sorted(((k, float(v)) for k, v in phases.items()
                     if k in _MIGRATION_STATES and isinstance(v, (int, float)) and not isinstance(v, bool)),
                    key=lambda kv: kv[1])
    out: list[tuple[str, float, Optional[float]]] = []
    for i, (name, ts) in enumerate(states):
        if i + 1 < len(states):
            out.append((name, ts, max(states[i + 1][1] - ts, 0.0)))
        else:
            out.append((name, ts, None if MigrationState(name).finished else max(current_s, 0.0)))
    return out


def migration_progress(m: dict, spinner: Any, current_s: float = 0.0) -> Table:
    """One line per state ``m`` reached: a tick (the spinner for the state it is in now, a cross for aborted),
    the state, the seconds spent in it, and when it was entered (seconds after the request); then tmd's reason
    if it aborted. ``spinner``: a rich Spinner kept across calls (so it turns); ``current_s``: seconds spent in
    the current state so far (see :func:`reached_states`)."""
    grid = Table.grid(padding=(0, 1))
    grid.add_column(width=2)
    grid.add_column(min_width=12)
    grid.add_column(justify="right", min_width=9)
    grid.add_column(style="dim")
    states = reached_states(m, current_s)
    t0 = states[0][1] if states else 0.0
    for i, (name, ts, spent) in enumerate(states):
        state = MigrationState(name)
        if state == MigrationState.ABORTED:
            icon = "[red]✗[/]"
        elif i == len(states) - 1 and not state.finished:
            icon = spinner
        else:
            icon = "[green]✓[/]"
        grid.add_row(icon, escape(name), "" if spent is None else f"{spent:.2f} s", f"at +{ts - t0:.2f} s")
    if m.get("state") == MigrationState.ABORTED:
        grid.add_row("", f"[red]aborted[/]: {_cell(m.get('reason'))}", "", "")
    return grid

"""A job's timeline from its journal: step times, one span per migration and per failure incident, and marks.

:func:`build` turns journal entries (``{"seq", "ts", "event", ...}``, see :mod:`tmd.journal`) into a
:class:`Timeline`; ``tmctl timeline`` draws it (sparkline or PNG, :mod:`tmctl.timeline_plot`) and tmd's status
page shows its last minutes. Pure: no torch, no plotting, no I/O. Journal fields may come from the network, so a
malformed entry is skipped, never raised on.

``Timeline.to_dict()``::

    {"job": str | None, "start": ts, "end": ts,
     "steps": [[step, ts, seconds], ...],
     "spans": [{"kind": "migration" | "incident", "id": int, "label": str, "start": ts, "end": ts | None,
                "outcome": "committed" | "aborted" | "recovered" | "failed" | "superseded" | "running",
                "phases": [{"name": str, "start": ts, "end": ts | None}, ...]}, ...],
     "marks": [{"ts": ts, "kind": "node_failed" | "straggler" | "job_failed", "label": str}, ...]}

All ``ts`` are epoch seconds; step ``seconds`` is the slowest rank's step time. A span still running at the
journal's end has ``end`` None, outcome ``running``, and its last phase ends None too.

- Migration phases: the time spent in each state, named after that state (``requested`` from
  migration_requested to migration_warming, ``warming`` to migration_prepared, ... ``transferred`` to
  migration_committed), in the journal's order; the span ends at migration_committed or migration_aborted.
- Incident phases: ``halting`` from recovery_started, ``promoted`` (standby_promoted, the first one),
  ``halted`` (recovery_halted), ``recovering`` (recovery_plan); the span ends at recovery_done (``recovered``),
  recovery_failed (``failed``) or recovery_superseded (``superseded``).
"""
from __future__ import annotations

import dataclasses
import math
from enum import StrEnum
from typing import Any, Iterable, Optional

from tmd import protocol as p
from tmd.protocol.vocab import IncidentMark, IncidentState, MigrationState


class SpanKind(StrEnum):
    MIGRATION = "migration"
    INCIDENT = "incident"


class Outcome(StrEnum):
    """How a span ended (``RUNNING``: not yet, in this journal)."""

    COMMITTED = "committed"
    ABORTED = "aborted"
    RECOVERED = "recovered"
    FAILED = "failed"
    SUPERSEDED = "superseded"
    RUNNING = "running"


class MarkKind(StrEnum):
    NODE_FAILED = "node_failed"
    STRAGGLER = "straggler"
    JOB_FAILED = "job_failed"


_MIGRATION_STATE_OF: dict[str, MigrationState] = {ev: s for s, ev in p.MIGRATION_EVENTS.items()}
_MIGRATION_OUTCOME = {MigrationState.COMMITTED: Outcome.COMMITTED, MigrationState.ABORTED: Outcome.ABORTED}
_INCIDENT_PHASE = {  # event -> the phase it starts
    p.Event.RECOVERY_STARTED: IncidentState.HALTING,
    p.Event.STANDBY_PROMOTED: IncidentMark.PROMOTED,
    p.Event.RECOVERY_HALTED: IncidentMark.HALTED,
    p.Event.RECOVERY_PLAN: IncidentState.RECOVERING,
}
_INCIDENT_END = {p.Event.RECOVERY_DONE: Outcome.RECOVERED, p.Event.RECOVERY_FAILED: Outcome.FAILED,
                 p.Event.RECOVERY_SUPERSEDED: Outcome.SUPERSEDED}
_LABEL_CHARS = 120  # a label's longest text (characters); journal text can be long


@dataclasses.dataclass
class Phase:
    name: str
    start: float
    end: Optional[float] = None


@dataclasses.dataclass
class Span:
    """One migration or incident: ``start``/``end`` epoch seconds (``end`` None while running)."""

    kind: SpanKind
    id: int
    label: str
    start: float
    end: Optional[float] = None
    outcome: Outcome = Outcome.RUNNING
    phases: list[Phase] = dataclasses.field(default_factory=list)

    @property
    def duration_s(self) -> Optional[float]:
        return None if self.end is None else self.end - self.start

    def enter(self, name: str, ts: float) -> None:
        """Start phase ``name`` at ``ts`` (ending the one before). A phase already entered is not entered again."""
        if any(ph.name == name for ph in self.phases):
            return
        if self.phases and self.phases[-1].end is None:
            self.phases[-1].end = max(ts, self.phases[-1].start)
        self.phases.append(Phase(name, ts))

    def finish(self, outcome: Outcome, ts: float) -> None:
        self.end = max(ts, self.start)
        self.outcome = outcome
        if self.phases and self.phases[-1].end is None:
            self.phases[-1].end = max(self.end, self.phases[-1].start)

    def to_dict(self) -> dict:
        return {"kind": str(self.kind), "id": self.id, "label": self.label, "start": self.start, "end": self.end,
                "outcome": str(self.outcome),
                "phases": [{"name": str(ph.name), "start": ph.start, "end": ph.end} for ph in self.phases]}


@dataclasses.dataclass
class Mark:
    ts: float
    kind: MarkKind
    label: str

    def to_dict(self) -> dict:
        return {"ts": self.ts, "kind": str(self.kind), "label": self.label}


@dataclasses.dataclass
class Timeline:
    """What :func:`build` makes of a journal (see the module docstring). ``start``/``end``: the first and last
    entry's ts (or ``since_ts``), epoch seconds; both None for an empty journal."""

    start: Optional[float] = None
    end: Optional[float] = None
    job: Optional[str] = None
    steps: list[list] = dataclasses.field(default_factory=list)  # [step, ts, seconds]
    spans: list[Span] = dataclasses.field(default_factory=list)
    marks: list[Mark] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict:
        return {"job": self.job, "start": self.start, "end": self.end, "steps": [list(s) for s in self.steps],
                "spans": [s.to_dict() for s in self.spans], "marks": [m.to_dict() for m in self.marks]}

    def count(self, kind: SpanKind) -> int:
        """How many spans of ``kind``."""
        return sum(1 for s in self.spans if s.kind == kind)


# --------------------------------------------------------------------------------------------------------------
def _number(value: Any) -> Optional[float]:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _integer(value: Any) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _text(value: Any) -> str:
    text = value if isinstance(value, str) else ("-" if value is None else str(value))
    text = " ".join(text.split())
    return text if len(text) <= _LABEL_CHARS else text[: _LABEL_CHARS - 3] + "..."


def _names(value: Any) -> list[str]:
    return [_text(v) for v in value] if isinstance(value, list) else []


def _migration_label(mid: int, ev: dict) -> str:
    sources, targets = _names(ev.get("sources")), _names(ev.get("targets"))
    if sources and len(sources) == len(targets):
        moves = ", ".join(f"{a}→{b}" for a, b in zip(sources, targets))
    else:
        moves = f"{_text(ev.get('source'))}→{_text(ev.get('target'))}"
    return f"migration {mid}: {moves}"


def _incident_label(iid: int, ev: dict, failed: dict[str, dict]) -> str:
    """``incident 1: n2 lost (process_exit)``: the nodes that failed since the last incident ended (their
    node_failed: signal, else reason) and held a lost rank; tmd's reason when none is known."""
    lost = ev.get("lost_ranks")
    lost = {r for r in lost if _integer(r) is not None} if isinstance(lost, list) else set()
    nodes = [(name, f) for name, f in failed.items()
             if isinstance(f.get("ranks"), list) and lost.intersection(r for r in f["ranks"] if _integer(r) is not None)]
    if nodes:
        what = ", ".join(f"{name} lost ({_text(f.get('signal') or f.get('reason'))})" for name, f in nodes)
    else:
        what = _text(ev.get("reason"))
    return f"incident {iid}: {what}"


def _mark(name: str, ev: dict, ts: float) -> Optional[Mark]:
    if name == p.Event.NODE_FAILED:
        label = f"{_text(ev.get('node'))} failed: {_text(ev.get('reason'))}"
        silent = _number(ev.get("silent_s"))
        if ev.get("signal") is not None:
            label += f" ({_text(ev.get('signal'))}"
            label += f", silent {silent:.2f} s)" if silent is not None else ")"
        return Mark(ts, MarkKind.NODE_FAILED, label)
    if name == p.Event.STRAGGLER_DETECTED:
        return Mark(ts, MarkKind.STRAGGLER, f"straggler: rank {_text(ev.get('rank'))} on {_text(ev.get('node'))}")
    if name == p.Event.JOB_FAILED:
        return Mark(ts, MarkKind.JOB_FAILED, f"job failed: {_text(ev.get('reason'))}")
    return None


def _steps(ev: dict) -> list[list]:
    out = []
    rows = ev.get("steps")
    for row in rows if isinstance(rows, list) else []:
        if not isinstance(row, (list, tuple)) or len(row) != 3:
            continue
        step, ts, seconds = _integer(row[0]), _number(row[1]), _number(row[2])
        if step is not None and ts is not None and seconds is not None and seconds >= 0:
            out.append([step, ts, seconds])
    return out


def build(events: Iterable[Any], since_ts: Optional[float] = None) -> Timeline:
    """The timeline of ``events`` (journal entries, oldest first). With ``since_ts`` (epoch seconds): only the
    steps and marks from then on and the spans that had not ended by then; ``start`` is then the later of
    ``since_ts`` and the first entry's ts.
    Entries that are not dicts, lack a numeric ``ts``, or carry malformed fields are skipped."""
    tl = Timeline()
    migrations: dict[int, Span] = {}  # running, by migration id
    incidents: dict[int, Span] = {}  # running, by incident id
    failed: dict[str, dict] = {}  # node -> its last node_failed entry since the last incident ended
    spans: list[Span] = []
    for ev in events:
        if not isinstance(ev, dict):
            continue
        ts, name = _number(ev.get("ts")), ev.get("event")
        if ts is None or not isinstance(name, str):
            continue
        tl.start = ts if tl.start is None else min(tl.start, ts)
        tl.end = ts if tl.end is None else max(tl.end, ts)
        if name == p.Event.TMD_STARTED and tl.job is None and isinstance(ev.get("job"), str):
            tl.job = _text(ev["job"])
        elif name == p.Event.STEP_TIMES:
            for row in _steps(ev):
                tl.steps.append(row)
                tl.end = max(tl.end, row[1])
        elif name in _MIGRATION_STATE_OF:
            mid = _integer(ev.get("migration_id"))
            if mid is None:
                continue
            state = _MIGRATION_STATE_OF[name]
            span = migrations.get(mid)
            if span is None or state == MigrationState.REQUESTED:
                if span is not None:  # requested again under the same id (a resumed tmd): a new span
                    migrations.pop(mid)
                span = Span(SpanKind.MIGRATION, mid, _migration_label(mid, ev), ts)
                migrations[mid] = span
                spans.append(span)
            if state.finished:
                span.finish(_MIGRATION_OUTCOME[state], ts)
                migrations.pop(mid, None)
            else:
                span.enter(state, ts)
        elif name in _INCIDENT_PHASE or name in _INCIDENT_END:
            iid = _integer(ev.get("incident_id"))
            if iid is None:
                continue
            span = incidents.get(iid)
            if name == p.Event.RECOVERY_STARTED or span is None:
                if span is not None:
                    incidents.pop(iid)
                span = Span(SpanKind.INCIDENT, iid, _incident_label(iid, ev, failed), ts)
                incidents[iid] = span
                spans.append(span)
            if name in _INCIDENT_END:
                span.finish(_INCIDENT_END[name], ts)
                incidents.pop(iid, None)
                if name != p.Event.RECOVERY_SUPERSEDED:  # the next incident's labels name later failures only
                    failed.clear()
            else:
                span.enter(_INCIDENT_PHASE[name], ts)
        if name == p.Event.NODE_FAILED and isinstance(ev.get("node"), str):
            failed[ev["node"]] = ev
        mark = _mark(name, ev, ts)
        if mark is not None:
            tl.marks.append(mark)
    tl.spans = spans
    if since_ts is not None and _number(since_ts) is not None:
        since = float(since_ts)
        tl.steps = [s for s in tl.steps if s[1] >= since]
        tl.spans = [s for s in tl.spans if s.end is None or s.end >= since]
        tl.marks = [m for m in tl.marks if m.ts >= since]
        tl.start = since if tl.start is None else max(tl.start, since)  # a younger job starts at its first entry
        if tl.end is not None and tl.end < since:
            tl.end = since
    return tl

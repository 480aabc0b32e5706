"""The shape tmd's two kinds of episode share: a planned migration (tmd.migration) and a failure incident
(tmd.recovery).

An :class:`Episode` has an ``id``, a ``state`` (an enum of tmd.protocol.vocab whose ``.finished`` says the
episode is over), a ``reason``, the instants it went through (``phases``: mark -> epoch seconds, the marks being
states or other named instants of that kind), a ``deadline`` (``time.monotonic()``; ``inf`` when none) and
the durations derived from its marks (``phases_s()``, from the kind's table of ``SPANS``). ``to_dict()`` is
what tmctl, ``MigrationReply`` and ``StatusReply`` show: the common part (id, state, reason, phases_s) and the
kind's own fields (``details()``).

:class:`Episodes` is the ordered list of one kind's episodes: ``all`` (oldest first), ``current`` (the latest if
it is not finished: at most one episode of a kind runs at a time), ``get(id)`` and ``first_id`` (the id of the
first episode this tmd starts: a restarted tmd goes on after the ids its journal shows). The state machines
(:class:`~tmd.migration.Migrations`, :class:`~tmd.recovery.Incidents`) are such lists.
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import ClassVar, Generic, Optional, TypeVar

from tmd.protocol.vocab import StrEnum


@dataclasses.dataclass(kw_only=True)
class Episode:
    """One migration or incident. Subclasses set ``SPANS`` and give ``state`` its enum and first value."""

    SPANS: ClassVar[dict[str, tuple[str, str]]] = {}
    """Duration name -> (start mark, end mark): ``phases_s()`` reports each span whose two marks were reached."""

    id: int
    state: StrEnum  # an enum with a ``finished`` property (MigrationState, IncidentState)
    reason: str = ""
    phases: dict[str, float] = dataclasses.field(default_factory=dict)  # mark -> epoch seconds
    deadline: float = math.inf  # time.monotonic() after which the episode is overdue
    deadline_s: float = math.inf  # the length of the deadline last set (seconds), for messages

    @property
    def finished(self) -> bool:
        return self.state.finished

    def mark(self, name: str, at: Optional[float] = None) -> float:
        """Record that the episode reached ``name`` at epoch seconds ``at`` (default now); returns the time."""
        self.phases[name] = time.time() if at is None else at
        return self.phases[name]

    def set_deadline(self, seconds: float) -> None:
        """The episode must move on within ``seconds`` from now (``inf``: no deadline)."""
        self.deadline_s = seconds
        self.deadline = time.monotonic() + seconds

    def overdue(self, now_mono: float) -> bool:
        """Whether ``now_mono`` (time.monotonic()) is past the deadline."""
        return now_mono > self.deadline

    def phases_s(self) -> dict[str, float]:
        """Durations in seconds (rounded to microseconds) of the ``SPANS`` whose start and end were marked."""
        t = self.phases
        return {k: round(t[b] - t[a], 6) for k, (a, b) in self.SPANS.items() if a in t and b in t}

    def details(self) -> dict:
        """The kind's own fields of ``to_dict()`` (subclasses override)."""
        return {}

    def to_dict(self) -> dict:
        """A JSON-able summary: ``id``, ``state``, ``reason``, ``phases_s`` and the kind's ``details()``."""
        return {"id": self.id, "state": self.state, "reason": self.reason, **self.details(),
                "phases_s": self.phases_s()}


E = TypeVar("E", bound=Episode)


class Episodes(Generic[E]):
    """One kind's episodes, oldest first; at most the latest is unfinished."""

    def __init__(self, first_id: int = 1) -> None:
        self.all: list[E] = []
        self.first_id = first_id  # id of the first episode (a restarted tmd goes on after the journal's last)

    @property
    def current(self) -> Optional[E]:
        """The running episode: the latest one if it is not finished, else None."""
        return self.all[-1] if self.all and not self.all[-1].finished else None

    @property
    def latest(self) -> Optional[E]:
        """The latest episode, finished or not (None before the first)."""
        return self.all[-1] if self.all else None

    def next_id(self) -> int:
        """The id the next episode gets."""
        return self.first_id + len(self.all)

    def add(self, episode: E) -> E:
        self.all.append(episode)
        return episode

    def find(self, episode_id: int) -> Optional[E]:
        """The episode with id ``episode_id`` (a negative id: the latest), or None."""
        if episode_id < 0:
            return self.latest
        return next((e for e in self.all if e.id == episode_id), None)

    def get(self, episode_id: int) -> E:
        """Like :meth:`find`; raises KeyError when there is no such episode."""
        e = self.find(episode_id)
        if e is None:
            raise KeyError(f"no episode with id {episode_id}")
        return e

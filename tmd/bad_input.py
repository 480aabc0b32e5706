"""Refused input, aggregated: what tmd journals about messages it drops, bounded whatever a sender does.

tmd calls :meth:`BadInput.refuse` for every message it refuses (a frame that does not decode, a message from a
sender that may not send it, a worker message from an unknown process), and :meth:`BadInput.ignore` for a
well-formed report that counts for nothing (of another migration or incident, or from a process with no part in
it; journalled under its own event name). A flood of bad frames must neither fill
the journal nor push the job's real events out of ``tmctl events``, so per sender (its ZeroMQ identity) and per
second (WINDOW_S) only the first refusal is journalled as ``bad_message``; the others are counted, and the
window's count is journalled once as ``bad_messages_dropped`` (sender, count, first error) by :meth:`tick` when
the window is over. At most ``max_senders`` senders are tracked at once (an attacker can rotate identities):
refusals from further senders are counted under OTHER_SENDERS. The error text of an event is cut to ERROR_CHARS.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from tmd.journal import Journal, cut_text
from tmd.protocol.vocab import Event

WINDOW_S = 1.0  # one journalled refusal per sender per window (seconds)
MAX_SENDERS = 64  # senders tracked at once
SENDER_CHARS = 80  # characters of a sender's identity in an event
ERROR_CHARS = 1024  # characters of an error in an event
OTHER_SENDERS = "<other senders>"  # refusals from senders beyond max_senders


@dataclasses.dataclass
class _Window:
    start: float  # time.monotonic() of the journalled refusal that opened it
    dropped: int = 0  # refusals only counted since
    first_error: Optional[str] = None  # the first of those


class BadInput:
    """The aggregator of refused messages; ``total`` counts every refusal since tmd started."""

    def __init__(self, journal: Journal, max_senders: int = MAX_SENDERS, window_s: float = WINDOW_S) -> None:
        self.journal = journal
        self.max_senders = max_senders
        self.window_s = window_s
        self.total = 0
        self._windows: dict[str, _Window] = {}

    def refuse(self, sender: str, error: str, now: float) -> None:
        """Count one refused message from ``sender`` (its identity, decoded with errors replaced) because of
        ``error``, at ``now`` (time.monotonic(), seconds); journal it if it is the sender's first this window.
        Never raises."""
        self.ignore(sender, now, Event.BAD_MESSAGE, error=cut_text(str(error), ERROR_CHARS))

    def ignore(self, sender: str, now: float, event: Event, **fields) -> None:
        """Count one well-formed message from ``sender`` that counts for nothing (a report of another migration
        or incident, or from a process with no part in it), under the same bound as :meth:`refuse`: journalled
        as ``event`` with ``fields`` (and ``sender``) if it is the sender's first this window, else counted.
        Never raises."""
        self.total += 1
        sender = cut_text(str(sender), SENDER_CHARS)
        w = self._windows.get(sender)
        if w is None and len(self._windows) >= self.max_senders:
            sender = OTHER_SENDERS
            w = self._windows.get(sender)
        if w is not None and now - w.start < self.window_s:
            w.dropped += 1
            if w.first_error is None:
                w.first_error = cut_text(str(fields.get("error") or f"{event}: {fields}"), ERROR_CHARS)
            return
        if w is not None:
            self._flush(sender, w)
        self._windows[sender] = _Window(start=now)
        self.journal.record(event, sender=sender, **fields)

    def tick(self, now: float) -> None:
        """Journal the count of each window that is over (``now``: time.monotonic()) and forget its sender."""
        for sender, w in list(self._windows.items()):
            if now - w.start >= self.window_s:
                self._flush(sender, w)
                del self._windows[sender]

    def _flush(self, sender: str, w: _Window) -> None:
        if w.dropped:
            self.journal.record(Event.BAD_MESSAGES_DROPPED, sender=sender, count=w.dropped, first_error=w.first_error,
                                window_s=self.window_s)

    @property
    def senders(self) -> int:
        """Senders tracked now (at most ``max_senders`` + 1)."""
        return len(self._windows)

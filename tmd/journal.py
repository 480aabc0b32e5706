"""The events journal: every state change tmd makes, as JSON lines in ``<run_dir>/events.jsonl``.

Each event is ``{"seq": int, "ts": epoch seconds, "event": name, ...fields}``; the names are
:class:`tmd.protocol.vocab.Event` (writers and readers, ``tmd resume`` included, use those constants). The file is
appended and flushed per event so a crash loses nothing already reported; the last ``keep`` events stay in memory
for ``tmctl events``.
"""
from __future__ import annotations

import collections
import json
import os
import sys
import time
from typing import Any, Optional

from tmd.protocol.vocab import Event


class Journal:
    def __init__(self, path: Optional[str], keep: int = 10_000, echo: bool = False, seq: int = 0) -> None:
        """``path``: the JSON-lines file (None: memory only). ``echo``: also print each event to stdout.
        ``seq``: the last sequence number already in the file (a restarted tmd goes on after it)."""
        self._file = open(path, "a", buffering=1) if path else None
        self._recent: collections.deque[dict] = collections.deque(maxlen=keep)
        self._seq = seq
        self._echo = echo

    def record(self, event: Event, **fields: Any) -> dict:
        """Append one event (fields: JSON-able values; enums are written as their values) and return it."""
        self._seq += 1
        entry = {"seq": self._seq, "ts": time.time(), "event": str(event), **fields}  # as read back from the file
        self._recent.append(entry)
        line = json.dumps(entry, default=str)
        if self._file:
            self._file.write(line + "\n")
        if self._echo:
            print(f"[tmd] {event} " + " ".join(f"{k}={v}" for k, v in fields.items()), file=sys.stdout, flush=True)
        return entry

    def since(self, after: int, limit: int) -> list[dict]:
        """Events with ``seq > after``, oldest first, at most ``limit``."""
        return [e for e in self._recent if e["seq"] > after][: max(0, limit)]

    def close(self) -> None:
        if self._file:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None


def read_events(path: str) -> list[dict]:
    """The events of a journal file, oldest first. A line that does not parse (the last one, cut short when
    tmd was killed while writing it) is skipped."""
    out = []
    with open(path) as f:
        for line in f:
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(entry, dict) and "event" in entry:
                out.append(entry)
    return out

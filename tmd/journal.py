"""The events journal: every state change tmd makes, as JSON lines in ``<run_dir>/events.jsonl``.

Each event is ``{"seq": int, "ts": epoch seconds, "event": name, ...fields}``; the names are
:class:`tmd.protocol.vocab.Event` (writers and readers, ``tmd resume`` included, use those constants). The file is
appended and flushed per event so a crash loses nothing already reported; the last ``keep`` events stay in memory
for ``tmctl events``.

Recording an event never raises and is bounded, whatever its fields carry (a field may come from the network):

* text is valid UTF-8: a lone surrogate or other unencodable character is written as a backslash escape
  (``\\ud800``), in the file and in the echo on stdout (which also escapes what stdout's encoding cannot show);
* a text field longer than MAX_FIELD_CHARS (8,192 characters) keeps its head (a quarter) and its tail (the rest,
  so a traceback's last frames and its exception stay readable) around ``...[N characters cut]...``; containers
  keep at most MAX_ITEMS items and MAX_DEPTH levels; values JSON cannot carry are written as their ``str()``
  (``inf`` and ``nan`` too: an event read back or sent to tmctl is plain JSON);
* a line stays under MAX_LINE_BYTES (16 KiB): text fields are cut harder until it fits, and as a last resort
  the event keeps only its name and a ``cut`` note;
* a write error (disk full, stdout closed) is counted in :attr:`Journal.write_errors` (the first one is said once
  on stderr) and the event stays in memory.
"""
from __future__ import annotations

import collections
import json
import math
import os
import sys
import time
from typing import Any, Callable, Optional

from tmd.protocol.vocab import Event
from tmd.rundir import no_follow

MAX_FIELD_CHARS = 8192  # one text value in an event (characters)
MAX_LINE_BYTES = 16 * 1024  # one journal line (bytes, UTF-8)
MAX_ITEMS = 1024  # items kept of one list or dict in an event
MAX_DEPTH = 8  # nesting kept in an event's fields
NOT_ECHOED = frozenset({Event.STEP_TIMES})  # journalled about once a second: kept off tmd's stdout
MAX_REPLY_BYTES = 2 * 1024 * 1024  # events one ``since`` answer carries at most (bytes of their lines)


def cut_text(text: str, limit: int = MAX_FIELD_CHARS) -> str:
    """``text`` as valid UTF-8 (unencodable characters backslash-escaped) and at most about ``limit``
    characters: its head (a quarter) and tail around a note saying how many characters were cut."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    if len(text) <= limit:
        return text
    head = limit // 4
    tail = limit - head
    return f"{text[:head]}...[{len(text) - head - tail} characters cut]...{text[len(text) - tail:]}"


def bounded(value: Any, limit: int = MAX_FIELD_CHARS, depth: int = 0) -> Any:
    """A JSON-able copy of ``value`` within the journal's bounds (see the module docstring). Enums become their
    values; bytes their repr; other objects their ``str()``."""
    if value is None or isinstance(value, (bool, int, float)):
        if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
            return cut_text(f"<integer of {value.bit_length()} bits>", limit)
        if isinstance(value, float) and not math.isfinite(value):
            return repr(value)  # "inf", "nan": JSON has no such number, and tmctl's decode refuses them
        return value
    if isinstance(value, str):
        return cut_text(str.__str__(value), limit)  # a StrEnum's value, a plain str
    if depth >= MAX_DEPTH:
        return "<nested too deep>"
    if isinstance(value, dict):
        out = {}
        for i, (k, v) in enumerate(value.items()):
            if i >= MAX_ITEMS:
                out["..."] = f"{len(value) - MAX_ITEMS} more items cut"
                break
            key = k if k is None or isinstance(k, (bool, int, float)) else cut_text(str(k), 256)  # JSON-able keys
            out[key] = bounded(v, limit, depth + 1)
        return out
    if isinstance(value, (list, tuple, set, frozenset)):
        items = list(value)
        out = [bounded(v, limit, depth + 1) for v in items[:MAX_ITEMS]]
        if len(items) > MAX_ITEMS:
            out.append(f"...{len(items) - MAX_ITEMS} more items cut")
        return out
    if isinstance(value, (bytes, bytearray, memoryview)):
        return cut_text(repr(bytes(value[:limit])), limit)
    try:
        return cut_text(str(value), limit)
    except Exception:  # noqa: BLE001 - a value whose str() fails
        return f"<unprintable {type(value).__name__}>"


def _line(entry: dict) -> str:
    return json.dumps(entry, allow_nan=True, default=str)  # ASCII: non-ASCII text as \\u escapes


class Journal:
    def __init__(self, path: Optional[str], keep: int = 10_000, echo: bool = False, seq: int = 0) -> None:
        """``path``: the JSON-lines file (None: memory only). ``echo``: also print each event to stdout.
        ``seq``: the last sequence number already in the file (a restarted tmd goes on after it). The file is
        created 0600 and never opened through a symlink (OSError ELOOP)."""
        self._file = open(path, "a", buffering=1, encoding="utf-8", opener=no_follow) if path else None
        if self._file is not None and _ends_cut(path):  # a line cut short (tmd killed as it wrote): end it, or
            self._file.write("\n")  # the next event would be glued to it and lost with it
        self._recent: collections.deque[tuple[dict, int]] = collections.deque(maxlen=keep)  # (entry, line bytes)
        self._seq = seq
        self._echo = echo
        self.write_errors = 0  # lines the file or stdout did not take (disk full, closed stdout)
        self.listener_errors = 0  # exceptions raised by listeners (counted, never propagated)
        self._listeners: list[Callable[[dict], None]] = []

    @property
    def seq(self) -> int:
        """The last sequence number recorded."""
        return self._seq

    def subscribe(self, listener: Callable[[dict], None]) -> None:
        """Call ``listener(entry)`` after each event is recorded, in the recording thread (tmd's loop), with the
        entry as written. A listener must be quick; what it raises is counted in :attr:`listener_errors` (the
        first one said once on stderr), never propagated."""
        self._listeners.append(listener)

    def record(self, event: Event, **fields: Any) -> dict:
        """Append one event (fields: JSON-able values; enums are written as their values; anything else is
        bounded as the module docstring says) and return it as written. Never raises."""
        self._seq += 1
        try:
            entry, line = self._entry(event, fields)
        except Exception as e:  # noqa: BLE001 - the journal must not take the loop down
            entry = {"seq": self._seq, "ts": time.time(), "event": str(event), "cut": f"unrecordable fields: "
                                                                                    f"{type(e).__name__}"}
            line = _line(entry)
        self._recent.append((entry, len(line.encode("utf-8", "backslashreplace"))))
        if self._file:
            try:
                self._file.write(line + "\n")
            except (OSError, ValueError) as e:  # disk full, a closed file
                self._write_failed("the journal file", e)
        if self._echo and event not in NOT_ECHOED:
            self._print(entry)
        for listener in self._listeners:
            try:
                listener(entry)
            except Exception as e:  # noqa: BLE001 - metrics or the status page must not take the loop down
                self.listener_errors += 1
                if self.listener_errors == 1:
                    try:
                        print(f"tmd: a journal listener failed: {type(e).__name__}: {e} (counted from now on)",
                              file=sys.stderr, flush=True)
                    except Exception:  # noqa: BLE001
                        pass
        return entry

    def _entry(self, event: Event, fields: dict) -> tuple[dict, str]:
        head = {"seq": self._seq, "ts": time.time(), "event": str(event)}  # as read back from the file
        limit = MAX_FIELD_CHARS
        while True:
            entry = {**head, **{k: v for k, v in bounded(fields, limit).items() if k not in head}}
            line = _line(entry)
            if len(line) <= MAX_LINE_BYTES and len(line.encode("utf-8")) <= MAX_LINE_BYTES:
                return entry, line
            if limit <= 64:
                entry = {**head, "cut": f"fields of {len(line)} characters cut to fit {MAX_LINE_BYTES} bytes",
                         "fields": sorted(str(k)[:64] for k in fields)[:32]}
                return entry, _line(entry)
            limit //= 4

    def _print(self, entry: dict) -> None:
        fields = " ".join(f"{k}={v}" for k, v in entry.items() if k not in ("seq", "ts", "event"))
        text = f"[tmd] {entry['event']} {fields}\n"
        out = sys.stdout
        try:
            try:
                out.write(text)
            except UnicodeEncodeError:
                encoding = getattr(out, "encoding", None) or "ascii"
                out.write(text.encode(encoding, "backslashreplace").decode(encoding, "replace"))
            out.flush()
        except (OSError, ValueError, LookupError) as e:  # stdout closed or full; an unknown encoding
            self._write_failed("stdout", e)

    def _write_failed(self, where: str, error: BaseException) -> None:
        self.write_errors += 1
        if self.write_errors == 1:
            try:
                print(f"tmd: cannot write {where}: {error} (counted from now on, never fatal)", file=sys.stderr,
                      flush=True)
            except Exception:  # noqa: BLE001
                pass

    def since(self, after: int, limit: int) -> list[dict]:
        """Events with ``seq > after``, oldest first, at most ``limit`` and at most MAX_REPLY_BYTES of lines (a
        reply fits in one message: ask again after the last one)."""
        out, size = [], 0
        for entry, nbytes in self._recent:
            if len(out) >= limit:
                break
            if entry["seq"] <= after:
                continue
            size += nbytes
            if out and size > MAX_REPLY_BYTES:
                break
            out.append(entry)
        return out

    def close(self) -> None:
        if self._file:
            try:
                self._file.flush()
                os.fsync(self._file.fileno())
            except (OSError, ValueError) as e:
                self._write_failed("the journal file", e)
            finally:
                try:
                    self._file.close()
                except OSError:
                    pass
                self._file = None


def read_events(path: str) -> list[dict]:
    """The events of a journal file, oldest first. A line that does not parse (the last one, cut short when
    tmd was killed while writing it) is skipped."""
    out = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                entry = json.loads(line)
            except (json.JSONDecodeError, RecursionError, ValueError):
                continue
            if isinstance(entry, dict) and "event" in entry:
                out.append(entry)
    return out


def last_seq(path: str) -> int:
    """The highest sequence number in the journal file at ``path`` (0: no file, or no event in it): where a new
    job's journal goes on in a run directory used before (a refused or ended job), so that ``seq`` stays unique
    and ``tmctl events --after N`` skips nothing of it."""
    try:
        events = read_events(path)
    except FileNotFoundError:
        return 0
    return max((e["seq"] for e in events if isinstance(e.get("seq"), int) and not isinstance(e["seq"], bool)),
               default=0)


def _ends_cut(path: str) -> bool:
    """Whether the file at ``path`` is non-empty and its last line has no newline."""
    with open(path, "rb", opener=no_follow) as f:
        if f.seek(0, os.SEEK_END) == 0:
            return False
        f.seek(-1, os.SEEK_END)
        return f.read(1) != b"\n"

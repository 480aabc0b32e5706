"""tmd's web endpoint: Prometheus metrics and a live, read-only status page, on the job's address only.

:class:`WebState` holds what the server shows (the latest status dict and the recent journal entries the timeline
needs); tmd's loop thread writes it, the server's threads read it. :class:`WebServer` serves, with GET (and HEAD):

* ``/metrics``: tmd.metrics in Prometheus' text format;
* ``/``: the status page (tmd/status_page.html): the node table rendered on the server, then refreshed every 2 s
  by its inline script from the two JSON routes, which also draws the step-time timeline as inline SVG (no
  external assets: it works offline);
* ``/api/status``: the latest status as JSON (``{}`` before tmd published one);
* ``/api/timeline?minutes=N``: ``tmd.timeline.build(...).to_dict()`` of the last N minutes (default 10, at most
  KEEP_S / 60).

Any other path is 404 (to holders of the token); any other method 405 (read-only). Every route needs the job's web token
(:func:`load_or_create_token`): ``Authorization: Bearer <token>`` (Prometheus' ``authorization.credentials_file``)
or the cookie ``tm_web_<port>`` (also accepted: ``tm_web``). ``GET /?token=<token>`` sets that cookie (HttpOnly,
SameSite=Strict, Path=/) and answers 303 to ``/`` so the token leaves the address bar; the cookie's name carries
the port because browsers share cookies between the ports of one host (two jobs on one machine). A wrong or missing
token is 401 (compared with ``hmac.compare_digest``; :attr:`WebServer.refusals` counts them). Nothing is logged
per request and the token is never echoed. No request body is read.

Strangers cannot block it (issue 33): the server is asyncio (an open connection costs no thread); a connection
that has not sent its whole request head within HEADER_DEADLINE_S (2 s) is closed, and at most
PENDING_PER_ADDRESS (8) connections of one source address wait for their head at a time, a new one closing that
address's oldest. So idle connections, however many, hold nothing a token holder needs: its connection sends
the token at once and is answered. No HTTP library in reach has per-address limits; this is the standard
library's asyncio streams and header parser.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import email.utils
import hmac
import html
import http
import http.client
import http.cookies
import importlib.resources
import io
import json
import math
import os
import re
import secrets
import threading
import time
import urllib.parse
from typing import Any, Callable, Optional

from tmd import timeline
from tmd.metrics import Metrics

KEEP_S = 30 * 60.0  # journal entries older than this (seconds) are dropped from the timeline's window
MAX_EVENTS = 50_000  # journal entries kept for the timeline at most
DEFAULT_MINUTES = 10.0
REFRESH_S = 2.0  # the page's refresh period
HEADER_DEADLINE_S = 2.0  # a connection that has not sent its whole request head by then is closed
MAX_HEAD_BYTES = 16 * 1024  # a longer request head closes the connection
PENDING_PER_ADDRESS = 8  # connections of one source address still sending their head; a new one closes the oldest
PENDING_TOTAL = 256  # the same, all source addresses together
WRITE_DEADLINE_S = 10.0  # an answer not taken by the client by then is dropped with its connection
TIMELINE_CACHE_S = 1.0  # a timeline answer is reused this long while no entry arrived
COOKIE = "tm_web"
REFUSED_BODY = b"401 unauthorized: this page needs the job's web token\n"


def load_or_create_token(path: str) -> str:
    """The web token kept in ``path``: read back if the file exists (``tmd resume`` keeps it), else a new
    ``secrets.token_urlsafe(32)`` written there with mode 0600 (its directory created 0700). Raises OSError if it
    cannot be read or written, ValueError if the file holds no token."""
    try:
        with open(path, encoding="ascii") as f:
            token = f.read().strip()
        if not token:
            raise ValueError(f"{path} holds no web token")
        return token
    except FileNotFoundError:
        pass
    os.makedirs(os.path.dirname(os.path.abspath(path)), mode=0o700, exist_ok=True)
    token = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write(token)  # no newline: the file is usable as is as a credentials file (Prometheus, curl)
    return token


def default_build_timeline(events: list[dict], since_ts: Optional[float]) -> dict:
    """``tmd.timeline.build(events, since_ts=since_ts).to_dict()``."""
    return timeline.build(events, since_ts=since_ts).to_dict()


def jsonable(value: Any) -> Any:
    """``value`` with every non-finite float as None (JSON has no NaN or Infinity; browsers refuse them)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


class WebState:
    """What the server shows, written by tmd's loop thread and read by the server's threads.
    ``build_timeline(events, since_ts) -> dict`` defaults to ``tmd.timeline.build(...).to_dict()``; ``clock``
    gives epoch seconds."""

    def __init__(self, build_timeline: Optional[Callable[[list[dict], Optional[float]], dict]] = None,
                 clock: Callable[[], float] = time.time, keep_s: float = KEEP_S, max_events: int = MAX_EVENTS):
        self._lock = threading.Lock()
        self._status: dict = {}
        self._events: collections.deque[dict] = collections.deque(maxlen=max_events)
        self._added = 0  # entries added so far (a timeline cache key)
        self._cache: Optional[tuple[int, float, float, dict]] = None  # (added, minutes, made at, timeline)
        self.build_timeline = build_timeline or default_build_timeline
        self.clock, self.keep_s = clock, keep_s

    def publish_status(self, status: dict) -> None:
        """The latest status (``dataclasses.asdict`` of a StatusReply); kept as given: do not change it after."""
        with self._lock:
            self._status = status if isinstance(status, dict) else {}

    def status(self) -> dict:
        """The latest published status (``{}`` before the first)."""
        with self._lock:
            return self._status

    def add_event(self, entry: dict) -> None:
        """Keep journal entry ``entry`` for the timeline (the last KEEP_S seconds, MAX_EVENTS entries at most)."""
        if not isinstance(entry, dict):
            return
        with self._lock:
            self._events.append(entry)
            self._added += 1
            horizon = self.clock() - self.keep_s
            while self._events and self._ts(self._events[0]) < horizon:
                self._events.popleft()

    @staticmethod
    def _ts(entry: dict) -> float:
        ts = entry.get("ts")
        return float(ts) if isinstance(ts, (int, float)) and not isinstance(ts, bool) else math.inf

    def events(self) -> list[dict]:
        """The entries kept, oldest first (a copy)."""
        with self._lock:
            return list(self._events)

    def timeline(self, minutes: float = DEFAULT_MINUTES) -> dict:
        """The timeline (tmd.timeline's ``to_dict()`` shape, plus ``now``: the server's epoch seconds) of the last
        ``minutes`` minutes (clamped to [1 s, KEEP_S])."""
        minutes = min(max(float(minutes), 1 / 60), self.keep_s / 60)
        now = self.clock()
        with self._lock:
            added, cache = self._added, self._cache
            if cache is not None and cache[0] == added and cache[1] == minutes and now - cache[2] < TIMELINE_CACHE_S:
                return cache[3]
            events = list(self._events)
        result = {**self.build_timeline(events, now - minutes * 60), "now": now}
        with self._lock:
            self._cache = (added, minutes, now, result)
        return result


# ---------------------------------------------------------------------------------------------------------------
# The page
# ---------------------------------------------------------------------------------------------------------------
def page_template() -> str:
    return importlib.resources.files("tmd").joinpath("status_page.html").read_text(encoding="utf-8")


def _text(value: Any) -> str:
    """``value`` as escaped HTML text ('-' for None)."""
    if value is None:
        return "-"
    if isinstance(value, float):
        value = f"{value:.3f}"
    elif isinstance(value, (list, tuple)):
        value = ", ".join(str(v) for v in value) or "-"
    return html.escape(str(value), quote=True)


NODE_COLUMNS = ("name", "role", "health", "ranks", "guards", "step", "heartbeat_age_s", "step_time_s", "warm",
                "stragglers")


def render_nodes(status: dict) -> str:
    """The ``<tbody>`` rows of the node table (one ``<tr data-node=NAME>`` per node), escaped."""
    rows = []
    nodes = status.get("nodes") if isinstance(status, dict) else None
    for n in nodes if isinstance(nodes, list) else []:
        if not isinstance(n, dict):
            continue
        cells = "".join(f'<td class="{c}{" health-" + _text(n.get(c)) if c == "health" else ""}">'
                        f'{_text(n.get(c))}</td>' for c in NODE_COLUMNS)
        title = f' title="{_text(n.get("reason"))}"' if n.get("reason") else ""
        rows.append(f'<tr data-node="{_text(n.get("name"))}" class="role-{_text(n.get("role"))}"{title}>{cells}</tr>')
    return "\n".join(rows)


def render_episode(kind: str, episode: Any) -> str:
    """One line on the current or last migration or incident, with its phases (seconds), escaped."""
    if not isinstance(episode, dict):
        return f"no {kind} yet"
    phases = episode.get("phases_s") if isinstance(episode.get("phases_s"), dict) else {}
    parts = ", ".join(f"{_text(k)} {_text(v)} s" for k, v in phases.items())
    return (f"{kind} {_text(episode.get('id'))}: {_text(episode.get('state'))}"
            + (f" ({_text(episode.get('reason'))})" if episode.get("reason") else "")
            + (f" &mdash; {parts}" if parts else ""))


def render_checkpoints(c: Any) -> str:
    """One line on the checkpoint tier (StatusReply.checkpoints): the newest step, a failed save, the restarts."""
    if not isinstance(c, dict):
        return "checkpoints off"
    restarts = c.get("restarts") if isinstance(c.get("restarts"), list) else []
    last = restarts[-1] if restarts and isinstance(restarts[-1], dict) else None
    return (f"checkpoints: newest step {_text(c.get('latest'))}"
            + (f"; last save failed: {_text(c.get('failed'))}" if c.get("failed") else "")
            + f"; restarts {len(restarts)}"
            + (f" (last: from step {_text(last.get('step'))}, {_text(last.get('work_lost_s'))} s of work lost)"
               if last else ""))


def render_page(status: dict, minutes: float, nonce: str) -> str:
    """The status page's HTML for ``status``; ``nonce``: the inline script's CSP nonce."""
    status = status if isinstance(status, dict) else {}
    values = {
        "job": _text(status.get("job")), "world_size": _text(status.get("world_size")),
        "generation": _text(status.get("generation")), "step": _text(status.get("step")),
        "nodes": render_nodes(status), "migration": render_episode("migration", status.get("migration")),
        "recovery": render_episode("incident", status.get("recovery")),
        "checkpoints": render_checkpoints(status.get("checkpoints")),
        "failure": _text((status.get("failure") or {}).get("error")) if isinstance(status.get("failure"), dict)
        else "",
        "minutes": _text(f"{minutes:g}"), "refresh_ms": str(int(REFRESH_S * 1000)), "nonce": nonce,
    }
    return re.sub(r"\{\{(\w+)\}\}", lambda m: values.get(m.group(1), ""), page_template())  # one pass


# ---------------------------------------------------------------------------------------------------------------
# The server
# ---------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Answer:
    """One response: status ``code``, ``body``, its content type, extra headers; ``head``: send no body."""

    code: int
    body: bytes
    ctype: str = "text/plain; charset=utf-8"
    headers: dict = dataclasses.field(default_factory=dict)
    head: bool = False

    def encode(self) -> bytes:
        lines = [f"HTTP/1.0 {self.code} {http.HTTPStatus(self.code).phrase}", "Server: tmd",
                 f"Date: {email.utils.formatdate(usegmt=True)}", f"Content-Type: {self.ctype}",
                 f"Content-Length: {len(self.body)}", "Cache-Control: no-store", "X-Content-Type-Options: nosniff",
                 "Referrer-Policy: no-referrer", "Connection: close",
                 *(f"{k}: {v}" for k, v in self.headers.items())]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (b"" if self.head else self.body)


class _Pending:
    """The connections still sending their request head, oldest first, per source address and in all. Admitting
    one over a limit closes the oldest of its address (or of all): a stranger holding connections open pushes
    out only its own, and every new connection gets its HEADER_DEADLINE_S to show the token."""

    def __init__(self, per_address: int, total: int) -> None:
        self.per_address, self.total = per_address, total
        self.by_address: dict[str, collections.OrderedDict] = {}
        self.all: collections.OrderedDict = collections.OrderedDict()

    def admit(self, address: str, transport: asyncio.BaseTransport) -> None:
        """Track ``transport``, closing older connections to make room."""
        while True:
            mine = self.by_address.get(address, {})
            if len(mine) < self.per_address and len(self.all) < self.total:
                break
            oldest = next(iter(mine)) if len(mine) >= self.per_address else next(iter(self.all))
            self.leave(oldest)
            oldest.abort()
        self.by_address.setdefault(address, collections.OrderedDict())[transport] = address
        self.all[transport] = address

    def leave(self, transport: asyncio.BaseTransport) -> None:
        address = self.all.pop(transport, None)
        if address is not None:
            mine = self.by_address[address]
            mine.pop(transport, None)
            if not mine:
                del self.by_address[address]


class WebServer:
    """Serves ``metrics`` and ``state`` on ``host:port`` (``port`` 0: a free one) to holders of ``token``.
    ``host`` must be the job's address: "0.0.0.0", "::" and "" (every interface) raise ValueError.

    An asyncio server on a thread of its own: an idle connection costs no thread, so holding connections open
    blocks nobody. A connection must send its whole request head (at most MAX_HEAD_BYTES) within
    HEADER_DEADLINE_S, or it is closed; at most PENDING_PER_ADDRESS connections of one source address (and
    PENDING_TOTAL in all) may be waiting for their head, a new one closing the oldest. A request is answered on a
    worker thread (building a timeline takes milliseconds) and written within WRITE_DEADLINE_S, one request per
    connection (HTTP/1.0)."""

    def __init__(self, host: str, port: int, token: str, metrics: Metrics, state: WebState):
        if host in ("", "0.0.0.0", "::", "[::]"):
            raise ValueError(f"the web endpoint binds the job's address only, not {host!r} (every interface)")
        if not token:
            raise ValueError("the web endpoint needs a token")
        self.host, self.port, self.metrics, self.state = host.strip("[]"), port, metrics, state
        self._token = token.encode()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._server: Optional[asyncio.base_events.Server] = None
        self._thread: Optional[threading.Thread] = None
        self._pending = _Pending(PENDING_PER_ADDRESS, PENDING_TOTAL)
        self._open: set[asyncio.BaseTransport] = set()  # every connection (stop() closes them)
        self._refusals = 0
        self.evicted = 0  # connections closed without an answer: head too slow or too large, pushed out
        self._counts_lock = threading.Lock()

    @property
    def cookie(self) -> str:
        """The name of the cookie that carries the token (per port: browsers share cookies between ports)."""
        return f"{COOKIE}_{self.port}"

    @property
    def url(self) -> str:
        """``http://host:port/`` (IPv6 hosts in brackets)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"

    @property
    def refusals(self) -> int:
        """Requests refused for a wrong or missing token so far."""
        with self._counts_lock:
            return self._refusals

    def note_refusal(self) -> None:
        with self._counts_lock:
            self._refusals += 1

    @property
    def token(self) -> str:
        return self._token.decode()

    def token_matches(self, candidate: str) -> bool:
        """Whether ``candidate`` is the token (constant-time comparison)."""
        try:
            return hmac.compare_digest(candidate.encode(), self._token)
        except (UnicodeEncodeError, AttributeError):
            return False

    # --- serving ----------------------------------------------------------------------------------------------
    def start(self) -> "WebServer":
        """Bind and serve in a daemon thread; sets ``port`` to the bound one. Raises OSError if the address cannot
        be bound."""
        loop = asyncio.new_event_loop()
        try:
            self._server = loop.run_until_complete(asyncio.start_server(
                self._connection, self.host, self.port, limit=MAX_HEAD_BYTES, reuse_address=True))
        except BaseException:
            loop.close()
            raise
        self._loop = loop
        self.port = self._server.sockets[0].getsockname()[1]
        self._thread = threading.Thread(target=loop.run_forever, name="tmd-web", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving, close every connection and free the port (idempotent)."""
        loop, self._loop = self._loop, None
        if loop is None:
            return

        async def close() -> None:
            self._server.close()
            for transport in list(self._open):
                transport.abort()  # (the sockets close on the loop's next iterations)
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._server.wait_closed()

        try:
            asyncio.run_coroutine_threadsafe(close(), loop).result(timeout=5)
        except Exception:  # noqa: BLE001 - stopping goes on
            pass
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=5)
        loop.close()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        transport = writer.transport
        self._open.add(transport)
        peer = writer.get_extra_info("peername")
        self._pending.admit(peer[0] if peer else "?", transport)
        try:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEADER_DEADLINE_S)
            except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError):
                with self._counts_lock:
                    self.evicted += 1
                return
            finally:
                self._pending.leave(transport)
            answer = await asyncio.get_running_loop().run_in_executor(None, self.answer, head)
            writer.write(answer.encode())
            await asyncio.wait_for(writer.drain(), WRITE_DEADLINE_S)
        except (asyncio.TimeoutError, OSError):
            pass  # the client went away or does not read
        except asyncio.CancelledError:
            pass  # the server stops: a task that ends quietly, not one asyncio logs as cancelled in a callback
        finally:
            self._open.discard(transport)
            if transport.get_write_buffer_size():
                transport.abort()  # a client that does not read gets nothing more
            else:
                writer.close()

    # --- answering --------------------------------------------------------------------------------------------
    def answer(self, head: bytes) -> Answer:
        """The answer to the request whose head (request line and headers, CRLF CRLF included) is ``head``."""
        try:
            line, _, rest = head.partition(b"\r\n")
            method, target, version = line.decode("latin-1").split(" ")
            if not version.startswith("HTTP/"):
                raise ValueError
            headers = http.client.parse_headers(io.BytesIO(rest))
            url = urllib.parse.urlsplit(target)
            query = urllib.parse.parse_qs(url.query, max_num_fields=8)
        except (ValueError, UnicodeDecodeError, http.client.HTTPException):
            return Answer(400, b"400 bad request\n")
        head_only = method == "HEAD"
        if method not in ("GET", "HEAD"):
            return Answer(405, b"405 method not allowed: this endpoint is read-only\n",
                          headers={"Allow": "GET, HEAD"})
        try:
            answer = self._route(url.path, query, headers)
        except Exception:  # noqa: BLE001 - a bug here must not leave the connection without an answer
            answer = Answer(500, b"500 internal error\n")
        answer.head = head_only
        return answer

    def _authorized(self, headers) -> bool:
        auth = headers.get("Authorization", "")
        if auth[:7].lower() == "bearer " and self.token_matches(auth[7:].strip()):
            return True
        cookies = http.cookies.SimpleCookie()
        for raw in headers.get_all("Cookie") or []:
            try:
                cookies.load(raw)
            except http.cookies.CookieError:
                continue
        return any(name in cookies and self.token_matches(cookies[name].value) for name in (self.cookie, COOKIE))

    def _route(self, path: str, query: dict, headers) -> Answer:
        if path == "/" and "token" in query:
            if not self.token_matches(query["token"][0]):
                return self._refuse()
            cookie = f"{self.cookie}={self.token}; HttpOnly; SameSite=Strict; Path=/"
            target = "/" + (f"?minutes={urllib.parse.quote(query['minutes'][0])}" if "minutes" in query else "")
            return Answer(303, b"", "text/plain", {"Location": target, "Set-Cookie": cookie})
        if not self._authorized(headers):
            return self._refuse()
        if path not in ("/", "/metrics", "/api/status", "/api/timeline"):
            return Answer(404, b"404 not found\n")
        try:
            minutes = float(query.get("minutes", [DEFAULT_MINUTES])[0])
            if not math.isfinite(minutes) or minutes <= 0:
                raise ValueError
        except ValueError:
            return Answer(400, b"400 bad request: minutes must be a positive number\n")
        if path == "/metrics":
            body, ctype = self.metrics.exposition()
            return Answer(200, body, ctype)
        if path == "/api/status":
            return _json(self.state.status())
        if path == "/api/timeline":
            return _json(self.state.timeline(minutes))
        nonce = secrets.token_urlsafe(16)
        body = render_page(self.state.status(), minutes, nonce).encode()
        csp = (f"default-src 'none'; script-src 'nonce-{nonce}'; style-src 'nonce-{nonce}'; "
               "connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
        return Answer(200, body, "text/html; charset=utf-8", {"Content-Security-Policy": csp, "X-Frame-Options": "DENY"})

    def _refuse(self) -> Answer:
        self.note_refusal()
        return Answer(401, REFUSED_BODY, headers={"WWW-Authenticate": 'Bearer realm="tmd"'})


def _json(value: Any) -> Answer:
    return Answer(200, json.dumps(jsonable(value), default=str, allow_nan=False).encode(), "application/json")

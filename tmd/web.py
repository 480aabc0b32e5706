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
per request and the token is never echoed. No request body is read; each connection has a socket timeout and at
most MAX_CONNECTIONS are served at once (more are closed at once), so a slow client cannot hold tmd up.
"""
from __future__ import annotations

import collections
import hmac
import http.client
import html
import http.cookies
import http.server
import importlib.resources
import json
import math
import os
import re
import secrets
import socket
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
SOCKET_TIMEOUT_S = 10.0  # a connection idle this long is closed
MAX_CONNECTIONS = 32  # connections served at once; more are closed without an answer
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
class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    web: "WebServer"

    def __init__(self, *args, **kwargs):
        self.open_requests: set[socket.socket] = set()  # connections being served (stop() shuts them)
        self.open_lock = threading.Lock()
        super().__init__(*args, **kwargs)

    def process_request(self, request, client_address):
        if not self.web.slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        with self.open_lock:
            self.open_requests.add(request)
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self.open_lock:
                self.open_requests.discard(request)
            self.web.slots.release()

    def handle_error(self, request, client_address):
        pass  # a client that went away (broken pipe, timeout): nothing to say on tmd's stderr

    def close_open_requests(self) -> None:
        with self.open_lock:
            requests = list(self.open_requests)
        for request in requests:
            try:
                request.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Server
    timeout = SOCKET_TIMEOUT_S
    protocol_version = "HTTP/1.0"  # one request per connection

    def version_string(self) -> str:
        return "tmd"

    def log_message(self, format, *args):  # noqa: A002 - nothing logged per request (the token may be in it)
        pass

    def __getattr__(self, name: str):
        if name.startswith("do_"):  # every other method: read-only
            return self._not_allowed
        raise AttributeError(name)

    def _not_allowed(self) -> None:
        self.close_connection = True
        self._send(405, b"405 method not allowed: this endpoint is read-only\n", "text/plain; charset=utf-8",
                   {"Allow": "GET, HEAD"})

    def do_HEAD(self) -> None:  # noqa: N802
        self._route(head=True)

    def do_GET(self) -> None:  # noqa: N802
        self._route(head=False)

    # --- answers ----------------------------------------------------------------------------------------------
    def _send(self, code: int, body: bytes, ctype: str, headers: Optional[dict] = None, head: bool = False) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Referrer-Policy", "no-referrer")
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _json(self, value: Any, head: bool) -> None:
        body = json.dumps(jsonable(value), default=str, allow_nan=False).encode()
        self._send(200, body, "application/json", head=head)

    def _authorized(self) -> bool:
        web = self.server.web
        auth = self.headers.get("Authorization", "")
        if auth[:7].lower() == "bearer " and web.token_matches(auth[7:].strip()):
            return True
        cookies = http.cookies.SimpleCookie()
        for raw in self.headers.get_all("Cookie") or []:
            try:
                cookies.load(raw)
            except http.cookies.CookieError:
                continue
        return any(name in cookies and web.token_matches(cookies[name].value) for name in (web.cookie, COOKIE))

    def _route(self, head: bool) -> None:
        try:
            url = urllib.parse.urlsplit(self.path)
            query = urllib.parse.parse_qs(url.query, max_num_fields=8)
        except ValueError:
            return self._send(400, b"400 bad request\n", "text/plain; charset=utf-8", head=head)
        try:
            self._answer(url.path, query, head)
        except (OSError, http.client.HTTPException):
            raise  # the client went away
        except Exception:  # noqa: BLE001 - a bug here must not kill the connection without an answer
            self.close_connection = True
            self._send(500, b"500 internal error\n", "text/plain; charset=utf-8", head=head)

    def _answer(self, path: str, query: dict, head: bool) -> None:
        web = self.server.web
        if path == "/" and "token" in query:
            if not web.token_matches(query["token"][0]):
                return self._refuse(head)
            cookie = f"{web.cookie}={web.token}; HttpOnly; SameSite=Strict; Path=/"
            target = "/" + (f"?minutes={urllib.parse.quote(query['minutes'][0])}" if "minutes" in query else "")
            return self._send(303, b"", "text/plain", {"Location": target, "Set-Cookie": cookie}, head)
        if not self._authorized():
            return self._refuse(head)
        if path not in ("/", "/metrics", "/api/status", "/api/timeline"):
            return self._send(404, b"404 not found\n", "text/plain; charset=utf-8", head=head)
        try:
            minutes = float(query.get("minutes", [DEFAULT_MINUTES])[0])
            if not math.isfinite(minutes) or minutes <= 0:
                raise ValueError
        except ValueError:
            return self._send(400, b"400 bad request: minutes must be a positive number\n",
                              "text/plain; charset=utf-8", head=head)
        if path == "/metrics":
            body, ctype = web.metrics.exposition()
            self._send(200, body, ctype, head=head)
        elif path == "/api/status":
            self._json(web.state.status(), head)
        elif path == "/api/timeline":
            self._json(web.state.timeline(minutes), head)
        else:
            nonce = secrets.token_urlsafe(16)
            body = render_page(web.state.status(), minutes, nonce).encode()
            csp = (f"default-src 'none'; script-src 'nonce-{nonce}'; style-src 'nonce-{nonce}'; "
                   "connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
            self._send(200, body, "text/html; charset=utf-8", {"Content-Security-Policy": csp,
                                                               "X-Frame-Options": "DENY"}, head)

    def _refuse(self, head: bool) -> None:
        self.server.web.note_refusal()
        self._send(401, REFUSED_BODY, "text/plain; charset=utf-8", {"WWW-Authenticate": 'Bearer realm="tmd"'},
                   head)


class WebServer:
    """Serves ``metrics`` and ``state`` on ``host:port`` (``port`` 0: a free one) to holders of ``token``.
    ``host`` must be the job's address: "0.0.0.0", "::" and "" (every interface) raise ValueError."""

    def __init__(self, host: str, port: int, token: str, metrics: Metrics, state: WebState):
        if host in ("", "0.0.0.0", "::", "[::]"):
            raise ValueError(f"the web endpoint binds the job's address only, not {host!r} (every interface)")
        if not token:
            raise ValueError("the web endpoint needs a token")
        self.host, self.port, self.metrics, self.state = host.strip("[]"), port, metrics, state
        self._token = token.encode()
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)  # connections served at once
        self._server: Optional[_Server] = None
        self._thread: Optional[threading.Thread] = None
        self._refusals = 0
        self._refusals_lock = threading.Lock()

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
        with self._refusals_lock:
            return self._refusals

    def note_refusal(self) -> None:
        with self._refusals_lock:
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

    def start(self) -> "WebServer":
        """Bind and serve in a daemon thread; sets ``port`` to the bound one. Raises OSError if the address cannot
        be bound."""
        server_cls = type("_Server6", (_Server,), {"address_family": socket.AF_INET6}) if ":" in self.host \
            else _Server
        self._server = server_cls((self.host, self.port), _Handler)
        self._server.web = self
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="tmd-web", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and free the port (idempotent)."""
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        server.close_open_requests()
        if self._thread is not None:
            self._thread.join(timeout=5)

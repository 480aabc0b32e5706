"""tmd.web: the metrics and status-page server on 127.0.0.1 (port 0): token checks (bearer, cookie, the ?token=
redirect), read-only, escaping, the JSON routes, the token file, WebState's bounds, and (where Chromium is
installed) the page as a real headless browser renders it."""
import http.client
import json
import os
import socket
import stat
import subprocess
import time

import pytest

from tmd.metrics import Metrics
from tmd.protocol.vocab import Event, Health, NodeRole
from tmd import web as web_module
from tmd.web import WebServer, WebState, load_or_create_token

pytestmark = pytest.mark.timeout(60)

TOKEN = "s3cret-token_x"
CHROMIUM = "/usr/bin/chromium"


def fake_timeline(events, since_ts):
    """A timeline in tmd.timeline's to_dict() shape, with the last call's arguments."""
    fake_timeline.calls.append((len(events), since_ts))
    now = time.time()
    return {"start": since_ts, "end": now,
            "steps": [[i, now - 60 + i, 0.05 + 0.01 * (i % 3)] for i in range(50)],
            "spans": [{"kind": "migration", "id": 1, "label": "migration 1: n2 -> s1", "start": now - 40,
                       "end": now - 35, "outcome": "committed",
                       "phases": [{"name": "transfer", "start": now - 37, "end": now - 36}]},
                      {"kind": "incident", "id": 1, "label": "<img src=x onerror=alert(1)>", "start": now - 20,
                       "end": None, "outcome": "running", "phases": []}],
            "marks": [{"ts": now - 21, "kind": "node_failed", "label": "n1 failed"}]}


fake_timeline.calls = []

STATUS = {
    "job": "j<1>", "world_size": 2, "generation": 4, "step": 77,
    "nodes": [{"name": "<script>alert(1)</script>", "role": NodeRole.ACTIVE, "ranks": [0], "health": Health.HEALTHY,
               "reason": "", "processes": 1, "heartbeat_age_s": 0.2, "step": 77, "step_time_s": 0.05,
               "warm": False, "stragglers": [], "pids": {"0": 1}},
              {"name": "n2", "role": NodeRole.ACTIVE, "ranks": [1], "health": Health.UNHEALTHY,
               "reason": "gpu <hot> & \"slow\"", "processes": 1, "heartbeat_age_s": 0.3, "step": 77,
               "step_time_s": 0.06, "warm": False, "stragglers": [1], "pids": {"0": 2}},
              {"name": "s1", "role": NodeRole.STANDBY, "ranks": [], "health": Health.HEALTHY, "reason": "",
               "processes": 1, "heartbeat_age_s": 0.1, "step": None, "step_time_s": None, "warm": True,
               "stragglers": [], "pids": {"0": 3}, "guards": []},
              {"name": "s2", "role": NodeRole.GUARDING, "ranks": [], "health": Health.HEALTHY, "reason": "",
               "processes": 1, "heartbeat_age_s": 0.1, "step": None, "step_time_s": None, "warm": True,
               "stragglers": [], "pids": {"0": 4}, "guards": [0, 1]}],
    "migration": {"id": 1, "state": "committed", "reason": "", "phases_s": {"transfer": 0.3, "total": 2.0}},
    "recovery": None, "failure": None, "warnings": [],
}


@pytest.fixture
def server():
    fake_timeline.calls.clear()
    metrics = Metrics("j")
    metrics.observe({"seq": 1, "ts": time.time(), "event": Event.STEP_TIMES, "steps": [[1, time.time(), 0.05]]})
    state = WebState(build_timeline=fake_timeline)
    state.publish_status(STATUS)
    web = WebServer("127.0.0.1", 0, TOKEN, metrics, state).start()
    try:
        yield web
    finally:
        web.stop()


def request(web: WebServer, path: str, method: str = "GET", headers: dict = None, body: bytes = None):
    c = http.client.HTTPConnection(web.host, web.port, timeout=10)
    try:
        c.request(method, path, body=body, headers=headers or {})
        r = c.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        c.close()


BEARER = {"Authorization": f"Bearer {TOKEN}"}


def test_every_route_needs_the_token(server):
    for path in ("/", "/metrics", "/api/status", "/api/timeline", "/nowhere", "/?minutes=5"):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN},
                        {"Cookie": f"{server.cookie}=wrong"}, {"Cookie": "other=" + TOKEN}):
            code, hdrs, body = request(server, path, headers=headers)
            assert code == 401, (path, headers)
            assert body.count(b"\n") == 1 and TOKEN.encode() not in body
    assert request(server, "/?token=wrong")[0] == 401
    assert server.refusals == 31


def test_bearer_and_cookie_are_accepted(server):
    code, hdrs, body = request(server, "/metrics", headers=BEARER)
    assert code == 200 and hdrs["Content-Type"].startswith("text/plain")
    assert b'trainmover_steps_total{job="j"} 1.0' in body
    for cookie in (f"{server.cookie}={TOKEN}", f"tm_web={TOKEN}", f"a=b; {server.cookie}={TOKEN}"):
        code, hdrs, body = request(server, "/api/status", headers={"Cookie": cookie})
        assert code == 200 and json.loads(body)["step"] == 77
    assert request(server, "/metrics", headers={"Authorization": f"bearer  {TOKEN} "})[0] == 200
    assert server.refusals == 0


def test_the_token_in_the_address_sets_the_cookie_and_leaves_the_address(server):
    code, hdrs, body = request(server, f"/?token={TOKEN}")
    assert code == 303 and hdrs["Location"] == "/"
    cookie = hdrs["Set-Cookie"]
    assert cookie.startswith(f"{server.cookie}={TOKEN};")
    assert {a.strip() for a in cookie.split(";")[1:]} == {"HttpOnly", "SameSite=Strict", "Path=/"}
    code, hdrs, _ = request(server, f"/?token={TOKEN}&minutes=3")
    assert code == 303 and hdrs["Location"] == "/?minutes=3"
    assert request(server, "/", headers={"Cookie": cookie.split(";")[0]})[0] == 200


def test_read_only_and_404(server):
    for method in ("POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "BREW"):
        code, hdrs, _ = request(server, "/", method=method, headers=BEARER, body=b"x" * 100)
        assert code == 405 and hdrs["Allow"] == "GET, HEAD", method
    assert request(server, "/api/status", method="POST")[0] == 405
    for path in ("/nowhere", "/metrics/x", "/api", "/index.html", "/../etc/passwd"):
        assert request(server, path, headers=BEARER)[0] == 404
    code, hdrs, body = request(server, "/api/status", method="HEAD", headers=BEARER)
    assert code == 200 and body == b"" and int(hdrs["Content-Length"]) > 0


def test_the_page_is_server_rendered_and_escaped(server):
    code, hdrs, body = request(server, "/", headers=BEARER)
    page = body.decode()
    assert code == 200 and hdrs["Content-Type"] == "text/html; charset=utf-8"
    assert "default-src 'none'" in hdrs["Content-Security-Policy"]
    assert '<table id="nodes">' in page and '<svg id="timeline"' in page
    assert '<tr data-node="&lt;script&gt;alert(1)&lt;/script&gt;"' in page
    assert '<tr data-node="n2" class="role-active" title="gpu &lt;hot&gt; &amp; &quot;slow&quot;">' in page
    assert '<tr data-node="s1" class="role-standby">' in page
    assert '<td class="guards">0, 1</td>' in page.split('data-node="s2"')[1].split("</tr>")[0]  # a guard's ranks
    assert "<script>alert" not in page and "j&lt;1&gt;" in page
    assert "migration 1: committed" in page and "transfer 0.300 s" in page
    assert page.count("<script") == 1 and TOKEN not in page
    nonce = hdrs["Content-Security-Policy"].split("'nonce-")[1].split("'")[0]
    assert f'<script nonce="{nonce}">' in page


def test_the_api_routes(server):
    code, _, body = request(server, "/api/timeline?minutes=5", headers=BEARER)
    tl = json.loads(body)
    assert code == 200 and set(tl) == {"start", "end", "steps", "spans", "marks", "now"}
    assert tl["now"] == pytest.approx(time.time(), abs=5)
    assert [s["kind"] for s in tl["spans"]] == ["migration", "incident"]
    assert fake_timeline.calls[-1][1] == pytest.approx(time.time() - 300, abs=5)
    request(server, "/api/timeline", headers=BEARER)  # default: 10 minutes
    assert fake_timeline.calls[-1][1] == pytest.approx(time.time() - 600, abs=5)
    for bad in ("abc", "-1", "0", "nan", "inf"):
        assert request(server, f"/api/timeline?minutes={bad}", headers=BEARER)[0] == 400
    code, _, body = request(server, "/api/status", headers=BEARER)
    assert json.loads(body)["nodes"][0]["role"] == "active"


def test_odd_values_and_a_failing_timeline(server):
    server.state.publish_status({**STATUS, "step": float("nan"), "generation": float("inf")})
    code, _, body = request(server, "/api/status", headers=BEARER)
    assert code == 200 and json.loads(body)["step"] is None and json.loads(body)["generation"] is None
    assert request(server, "/", headers=BEARER)[0] == 200

    def broken(events, since_ts):
        raise RuntimeError("bug")
    server.state.build_timeline = broken
    assert request(server, "/api/timeline", headers=BEARER)[:1] == (500,)
    query = "&".join(f"a{i}=1" for i in range(20))
    assert request(server, f"/api/status?{query}", headers=BEARER)[0] == 400
    assert request(server, "/metrics", headers=BEARER)[0] == 200  # still serving


def test_the_real_timeline_through_the_state():
    pytest.importorskip("tmd.timeline")
    state = WebState()
    now = time.time()
    for i, (event, fields) in enumerate([
            (Event.STEP_TIMES, {"steps": [[1, now - 50, 0.05], [2, now - 49, 0.06]]}),
            (Event.MIGRATION_REQUESTED, {"migration_id": 1, "sources": ["n2"], "targets": ["s1"]}),
            (Event.MIGRATION_COMMITTED, {"migration_id": 1, "sources": ["n2"], "targets": ["s1"], "switch_step": 3,
                                         "bytes_moved": 10, "phases_s": {"total": 1.0}})]):
        state.add_event({"seq": i + 1, "ts": now - 48 + i, "event": event, **fields})
    tl = state.timeline(5)
    assert set(tl) >= {"start", "end", "steps", "spans", "marks"}
    assert [s["kind"] for s in tl["spans"]] == ["migration"]
    json.dumps(tl)


def test_state_keeps_a_bounded_window():
    clock = [1000.0]
    state = WebState(build_timeline=lambda ev, since: {"n": len(ev), "since": since}, clock=lambda: clock[0],
                     keep_s=60, max_events=5)
    for i in range(3):
        state.add_event({"seq": i, "ts": 1000.0 + i, "event": Event.STEP_TIMES, "steps": []})
    clock[0] = 1061.5  # the first two are now older than 60 s
    state.add_event({"seq": 9, "ts": 1061.5, "event": Event.JOB_FINISHED})
    assert [e["seq"] for e in state.events()] == [2, 9]
    for i in range(10):
        state.add_event({"seq": 100 + i, "ts": 1061.5, "event": Event.STEP_TIMES})
    assert len(state.events()) == 5
    state.add_event("junk")
    assert state.timeline(100) == {"n": 5, "since": 1001.5, "now": 1061.5}  # minutes clamped to keep_s
    assert state.status() == {}
    state.publish_status(["no"])
    assert state.status() == {}


def test_refuses_every_interface_and_needs_a_token():
    for host in ("0.0.0.0", "", "::"):
        with pytest.raises(ValueError):
            WebServer(host, 0, TOKEN, Metrics("j"), WebState())
    with pytest.raises(ValueError):
        WebServer("127.0.0.1", 0, "", Metrics("j"), WebState())


def test_stop_frees_the_port_and_a_slow_client_blocks_nobody():
    web = WebServer("127.0.0.1", 0, TOKEN, Metrics("j"), WebState(build_timeline=fake_timeline)).start()
    assert web.url == f"http://127.0.0.1:{web.port}/" and web.port > 0
    slow = socket.create_connection((web.host, web.port))
    slow.sendall(b"GET /metrics HTTP/1.0\r\n")  # and never finishes its request
    assert request(web, "/metrics", headers=BEARER)[0] == 200
    web.stop()
    web.stop()
    assert slow.recv(100) == b""  # its connection was closed too
    with socket.socket() as s:  # a restarted tmd (SO_REUSEADDR, as the server sets) can bind it again
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", web.port))
        s.listen()
    slow.close()


def test_idle_connections_do_not_block_a_token_holder(server, monkeypatch):
    """Issue 33's attack: 40 connections that never send a request (more than the old server's 32 slots) from this
    address; a token holder's scrape is still answered at once, and the idle ones are closed (the oldest pushed
    out by newer ones, the rest at the header deadline)."""
    monkeypatch.setattr(web_module, "HEADER_DEADLINE_S", 1.0)
    idle = [socket.create_connection((server.host, server.port)) for _ in range(40)]
    started = time.monotonic()
    assert request(server, "/metrics", headers=BEARER)[0] == 200
    assert time.monotonic() - started < 0.5
    for s in idle:
        s.settimeout(5.0)
        assert s.recv(100) == b""  # closed without an answer
        s.close()
    assert server.evicted == 40


def test_a_head_too_slow_or_too_large_is_dropped(server, monkeypatch):
    monkeypatch.setattr(web_module, "HEADER_DEADLINE_S", 0.5)
    slow = socket.create_connection((server.host, server.port))
    slow.sendall(b"GET /metrics HTTP/1.0\r\nAuthorization: Bearer ")  # the token never comes
    slow.settimeout(5.0)
    assert slow.recv(100) == b""
    big = socket.create_connection((server.host, server.port))
    big.sendall(b"GET /metrics HTTP/1.0\r\nX: " + b"y" * (web_module.MAX_HEAD_BYTES + 10) + b"\r\n\r\n")
    big.settimeout(5.0)
    assert big.recv(100) == b""
    assert request(server, "/metrics", headers=BEARER)[0] == 200
    slow.close()
    big.close()


def test_the_token_file(tmp_path):
    path = str(tmp_path / "keys" / "web.token")
    token = load_or_create_token(path)
    assert len(token) >= 40 and load_or_create_token(path) == token
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(tmp_path / "keys").st_mode) == 0o700
    open(path, "w").close()
    with pytest.raises(ValueError):
        load_or_create_token(path)


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"no Chromium at {CHROMIUM} (apt-get install chromium)")
def test_chromium_renders_the_table_and_the_timeline(server, tmp_path):
    """The page as a real browser shows it: the ?token= redirect and cookie, the node table, the SVG spans."""
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
           f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=4000", "--dump-dom",
           f"{server.url}?token={TOKEN}"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=45).stdout
    assert 'id="nodes"' in out, out[-2000:]
    for node in ("&lt;script&gt;alert(1)&lt;/script&gt;", "n2", "s1", "s2"):
        assert f'<tr data-node="{node}"' in out
    assert '<td class="guards">0, 1</td>' in out.split('data-node="s2"')[1].split("</tr>")[0]  # the script's row
    assert out.count('<rect class="span migration"') == 1 and out.count('<rect class="span incident"') == 1
    assert '<polyline class="steps"' in out and 'class="mark node_failed"' in out
    assert '<span id="notice"></span>' in out  # the script's refresh did not fail
    assert "<img" not in out and "&lt;img src=x onerror=alert(1)&gt;" in out  # the span's label, as text


def test_pending_connections_are_bounded_per_address_and_in_all():
    class Conn:
        closed = False

        def abort(self):
            self.closed = True

    pending = web_module._Pending(per_address=2, total=3)
    a1, a2, a3, b1, b2 = (Conn() for _ in range(5))
    for conn, address in ((a1, "a"), (a2, "a"), (a3, "a")):
        pending.admit(address, conn)
    assert (a1.closed, a2.closed, a3.closed) == (True, False, False)  # a's oldest made room for its newest
    pending.admit("b", b1)
    pending.admit("b", b2)  # all full: the oldest of all (a2) goes
    assert a2.closed and not (a3.closed or b1.closed or b2.closed)
    for conn in (a3, b1, b2):
        pending.leave(conn)
    assert pending.all == {} and pending.by_address == {}


def test_the_page_shows_the_checkpoint_tier_and_its_restarts():
    from tmd.web import render_checkpoints, render_page

    c = {"latest": 15, "failed": "checkpoint at step 10 not saved <x>", "restarts": [
        {"tier": "checkpoint", "step": 5, "work_lost_s": 3.25}]}
    line = render_checkpoints(c)
    assert line == ("checkpoints: newest step 15; last save failed: checkpoint at step 10 not saved &lt;x&gt;; "
                    "restarts 1 (last: from step 5, 3.250 s of work lost)")
    assert render_checkpoints(None) == "checkpoints off"
    assert line in render_page({"checkpoints": c}, 5, "n")

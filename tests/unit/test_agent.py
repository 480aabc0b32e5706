"""worker.agent.Reconnect: when a worker's agent connects again after a failed handshake (a stranger at tmd's
address while tmd is down), and when it must not (a live connection to the real tmd, or one libzmq retries itself);
then real agents against a killed tmd, two strangers at its address and tmd back."""
from __future__ import annotations

import itertools
import socket
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from tmd import protocol as p
from tmd.protocol.keys import KEYS_ENV, JobKeys
from tests.support import stand_in_tmd
from worker.agent import Agent, Reconnect

OK, GONE = zmq.EVENT_HANDSHAKE_SUCCEEDED, zmq.EVENT_DISCONNECTED
FAILED = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL


def test_a_failed_handshake_schedules_one_reconnect_after_the_delay():
    r = Reconnect(after_s=1.0)
    assert r.on_event(OK, 0.0) is False  # the job's tmd
    assert r.on_event(GONE, 5.0) is False  # tmd killed
    assert r.on_event(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, 5.5) is False  # the peer closed it: libzmq retries
    assert r.on_event(FAILED, 6.0) is True  # a stranger bound its address and this side failed the handshake
    assert r.on_event(zmq.EVENT_HANDSHAKE_FAILED_AUTH, 6.5) is False  # already scheduled
    assert not r.due(6.9) and r.due(7.0) and not r.due(7.1)  # once


def test_a_handshake_that_succeeds_first_cancels_the_reconnect_and_late_failures_are_ignored():
    r = Reconnect(after_s=1.0)
    assert r.on_event(FAILED, 0.0) is True
    assert r.on_event(OK, 0.5) is False  # the restarted tmd answered before the reconnect was due
    assert not r.due(2.0)  # the live connection is kept
    assert r.on_event(FAILED, 2.1) is False  # a late event of the stranger's connection: nothing scheduled
    assert not r.due(10.0)
    assert r.on_event(GONE, 11.0) is False and r.on_event(FAILED, 12.0) is True  # a real loss counts again


def test_how_long_tmd_has_been_unreachable_is_kept_for_a_standby_to_give_up_on():
    """A standby waits for a rank only while tmd can give it one: after STANDBY_ORPHAN_S of no tmd it exits (an
    outside test found standbys alive with parent 1 for 13 minutes after tmd was killed and never resumed)."""
    r = Reconnect(after_s=1.0)
    assert r.lost_at is not None  # not connected yet: it counts from the start
    r.on_event(OK, 1.0)
    assert r.lost_at is None
    r.on_event(GONE, 5.0)
    r.on_event(FAILED, 6.0)  # (retries failing do not move it)
    r.on_event(GONE, 7.0)
    assert r.lost_at == 5.0
    r.on_event(OK, 8.0)
    assert r.lost_at is None


# --- real sockets: tmd killed, strangers at its address, tmd back -------------------------------------------------
# A NULL-mechanism ZMTP 3.0 greeting (64 bytes), sent at once by a peer that is not this job's tmd: the agent's CURVE
# client reads it first and fails the handshake itself, after which libzmq never retries the endpoint.
NULL_GREETING = b"\xff" + b"\0" * 8 + b"\x7f" + bytes([3, 0]) + b"NULL".ljust(20, b"\0") + b"\0" * 32


def serve_tmd(keys: JobKeys, port: int, seconds: float) -> tuple[dict[bytes, list[int]], int, int]:
    """Be the job's tmd at ``port`` for ``seconds``: (identity -> the heartbeat steps received, in order; handshakes
    that succeeded; connections that closed)."""
    steps: dict[bytes, list[int]] = {}
    events: list[int] = []
    with stand_in_tmd(keys, port) as (sock, _):
        monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        end = time.monotonic() + seconds
        try:
            while time.monotonic() < end:
                if sock.poll(10):
                    identity, frame = sock.recv_multipart()
                    msg = p.decode(frame)
                    if isinstance(msg, p.Heartbeat):
                        steps.setdefault(identity, []).append(msg.step)
                while monitor.poll(0):
                    events.append(recv_monitor_message(monitor)["event"])
        finally:
            sock.disable_monitor()
            monitor.close(linger=0)
    return steps, events.count(zmq.EVENT_HANDSHAKE_SUCCEEDED), events.count(zmq.EVENT_DISCONNECTED)


def serve_stranger(port: int, seconds: float, curve: bool) -> None:
    """Someone else at ``port`` for ``seconds``: a CURVE server with a key of its own (it closes every connection
    mid-handshake: libzmq retries by itself) or a plain peer that greets with the NULL mechanism (the agent's side
    fails the handshake: libzmq gives the endpoint up)."""
    if curve:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
        sock.curve_server = True
        sock.bind(f"tcp://127.0.0.1:{port}")
        assert sock.poll(int(seconds * 1000)) == 0, "an agent talked to a stranger"
        sock.close()
        ctx.term()
        return
    listener = socket.create_server(("127.0.0.1", port))
    listener.settimeout(0.05)
    conns = []
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            conns.append(conn)
            conn.sendall(NULL_GREETING)
    finally:
        for c in conns:
            c.close()
        listener.close()


def test_after_strangers_at_its_address_each_agent_holds_one_connection_to_tmd_and_loses_no_message(tmp_path,
                                                                                                    monkeypatch):
    """tmd killed; a plain stranger, then a CURVE one, bind its address; tmd comes back. Each agent must come back
    with exactly one connection: with two, the DEALER sends every other message on the one tmd's ROUTER ignores
    (connecting again while libzmq still retries did that, and a Rejoin could be lost every time)."""
    keys = JobKeys.create(str(tmp_path / "keys"))
    monkeypatch.setenv(KEYS_ENV, keys.path)
    port = socket.create_server(("127.0.0.1", 0)).getsockname()[1]  # (closed again: free, not reused by others)
    counters = [itertools.count() for _ in range(3)]
    agents = [Agent(f"tcp://127.0.0.1:{port}", "n1", i, False, lambda m: None,
                    lambda c=c: p.Heartbeat(step=next(c), counters={}), heartbeat_interval_s=0.02).start()
              for i, c in enumerate(counters)]
    try:
        steps, handshakes, _ = serve_tmd(keys, port, 0.8)
        assert len(steps) == 3 and handshakes == 3
        serve_stranger(port, 1.4, curve=False)  # libzmq gives up: the agents' own reconnect is needed
        serve_stranger(port, 1.4, curve=True)  # libzmq retries: the agents' own reconnect used to fire here too
        time.sleep(1.2)  # nobody at the address: connections refused, libzmq retries
        steps, handshakes, closed = serve_tmd(keys, port, 2.5)
    finally:
        for a in agents:
            a.close(flush_timeout_s=0.5)
    assert handshakes == 3 and closed == 0, (handshakes, closed)
    assert len(steps) == 3
    for identity, got in steps.items():
        assert len(got) > 20, (identity, got)
        after = got[-20:]  # the last 20 heartbeats, sent after the reconnection settled
        assert after == list(range(after[0], after[0] + len(after))), (identity, got)  # none went astray

"""worker.agent.Reconnect: when a worker's agent connects again after a failed handshake (a stranger at tmd's
address while tmd is down), and when it must not (a live connection to the real tmd)."""
from __future__ import annotations

import zmq

from worker.agent import Reconnect

OK, GONE = zmq.EVENT_HANDSHAKE_SUCCEEDED, zmq.EVENT_DISCONNECTED
FAILED = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL


def test_a_failed_handshake_schedules_one_reconnect_after_the_delay():
    r = Reconnect(after_s=1.0)
    assert r.on_event(OK, 0.0) is False  # the job's tmd
    assert r.on_event(GONE, 5.0) is False  # tmd killed
    assert r.on_event(FAILED, 6.0) is True  # a stranger bound its address
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

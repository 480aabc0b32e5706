"""Helpers shared by the end-to-end tests."""
from __future__ import annotations

import contextlib
import os
import time
from typing import Iterator

import zmq

from tmd import protocol as p
from tmd.journal import read_events
from tmd.protocol.keys import Authenticator, JobKeys


def events(run_dir: str) -> list[dict]:
    """tmd's journal of ``run_dir`` (``events.jsonl``), oldest first."""
    return read_events(os.path.join(run_dir, "events.jsonl"))


def wait_until(predicate, timeout_s: float, what: str, poll_s: float = 0.1):
    """``predicate()``'s first truthy value, polled every ``poll_s`` s; AssertionError after ``timeout_s`` s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)  # polling another process's (or SLURM's) state: there is no event to wait on
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


@contextlib.contextmanager
def stand_in_tmd(keys: JobKeys, port: int = 0) -> Iterator[tuple[zmq.Socket, str]]:
    """A ROUTER that is ``keys``' tmd as far as any client can tell (CURVE server with tmd's key, tmd's ZAP
    handler), bound on 127.0.0.1 at ``port`` (0: a free port). Yields (the socket, its ``tcp://`` address); the
    socket, the handler and their context are closed on exit (close a monitor of the socket before that)."""
    ctx = zmq.Context()
    auth = Authenticator(ctx, keys)
    auth.start()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        keys.serve(sock)
        if port:
            sock.bind(f"tcp://127.0.0.1:{port}")
        else:
            port = sock.bind_to_random_port("tcp://127.0.0.1")
        yield sock, f"tcp://127.0.0.1:{port}"
    finally:
        sock.close()
        auth.stop()
        ctx.term()


class RecordingChannel:
    """A :class:`tmd.channel.WorkerChannel` for unit tests: keeps what would be sent as (identity, message) in
    ``sent``; an Assign carries ``world_size`` and ``generation`` as given."""

    def __init__(self, sent: list, world_size: int = 4, generation: int = 1) -> None:
        self.sent = sent
        self.world_size = world_size
        self.generation = generation

    def send(self, w, msg) -> None:
        self.sent.append((w.identity.decode(), msg))

    def assign(self, w, rank: int, *, migration_id: int = 0, incident_id: int = 0, guard: bool = False) -> None:
        self.send(w, p.Assign(role=p.WorkerRole.JOINER, rank=rank, world_size=self.world_size, store_host="",
                              store_port=0, generation=self.generation, record_steps=3, record_dir="",
                              migration_id=migration_id, incident_id=incident_id, guard=guard))

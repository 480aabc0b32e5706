"""Helpers only tests need (stand-ins for tmd and its channel). The job harness the tests share with the
benchmarks and the demo ships with the project: tmctl.localjob."""
from __future__ import annotations

import contextlib
from typing import Iterator

import zmq

from tmd import protocol as p
from tmd.protocol.keys import Authenticator, JobKeys


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

    def __init__(self, sent: list, world_size: int = 4, generation: int = 1, journal=None) -> None:
        self.sent = sent
        self.world_size = world_size
        self.generation = generation
        self.journal = journal  # where ignore() journals (unbounded here); None: nowhere

    def ignore(self, w, event, **fields) -> None:
        if self.journal is not None:
            self.journal.record(event, sender=w.identity.decode(), **fields)

    def send(self, w, msg) -> None:
        self.sent.append((w.identity.decode(), msg))

    def assign(self, w, rank: int, *, migration_id: int = 0, incident_id: int = 0, guard: bool = False) -> None:
        self.send(w, p.Assign(role=p.WorkerRole.JOINER, rank=rank, world_size=self.world_size, store_host="",
                              store_port=0, generation=self.generation, record_steps=3, record_dir="",
                              migration_id=migration_id, incident_id=incident_id, guard=guard))

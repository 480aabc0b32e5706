"""The job's rendezvous store on the wire: what a rank's store client (worker.store) and the store server in tmd
(tmd.store) agree on.

The store is c10d's key-value rendezvous (what gloo and NCCL set up a group through), served by tmd over ZeroMQ
CURVE with the job's keys: tmd's coordinator key pair serves it, only the worker key is admitted
(tmd.protocol.keys), so no party without the job's keys can read, write or even count its keys.

Request, one multipart ZeroMQ message from a DEALER (the ROUTER puts the connection's identity in front)::

    [request id (8 bytes, echoed)] [op] [timeout in ms, ASCII] [argument frames...]

Reply::

    [request id] [b"ok"] [result frames...]      or      [request id] [b"err"] [one line, UTF-8]

Ops and their argument / result frames (keys and values are raw bytes, counters ASCII decimal as TCPStore keeps
them):

======== ================================ ================================================================
op       arguments                        result
======== ================================ ================================================================
set      key, value                       (none)
get      key                              pairs; blocks until ``key`` exists (up to the timeout)
add      key, delta                       the new value; a missing key counts as 0
cas      key, expected, desired           the value now (c10d's compare_set: ``desired`` if it was set)
check    key...                           ``1`` when every key exists, else ``0``
wait     key...                           pairs; blocks until every key exists (up to the timeout)
del      key                              ``1`` when it existed, else ``0``
num      (none)                           the number of keys
done     prefix, members                  (none); see below
======== ================================ ================================================================

``pairs``: key, value, key, value... (flat): the keys asked for, then the other keys present under the first one's
parent (the key up to its last ``/``), while they hold at most :data:`PREFETCH_BYTES` (a ``get``'s own key always
comes first). A rank setting up a gloo group reads every peer's key one after another, all under one parent; the
client answers the reads that follow from these pairs (worker.store), so a setup costs a few round trips instead
of two per peer.

``done``: one member of the group set up under ``prefix`` will not use that setup's keys again (it released the
group). When ``members`` calls for ``prefix`` arrived, the server drops every key below ``prefix/`` (a
prefix is never reused, tmd.protocol.layout), so the keys of finished setups do not pile up against
:data:`MAX_KEYS`.

Bounds (the server refuses a request over any of them with an ``err`` reply naming it, and stores nothing): a
key at most :data:`MAX_KEY_BYTES`, a value at most :data:`MAX_VALUE_BYTES`, at most :data:`MAX_KEYS` keys and
:data:`MAX_STORED_BYTES` bytes held, at most :data:`MAX_WAITERS` blocked ``get``/``wait`` requests, at most
:data:`MAX_FRAMES` frames per request. A frame over :data:`MAX_FRAME_BYTES` disconnects the sender
(ZMQ_MAXMSGSIZE) before it is read.

Sizes measured for a gloo group set up here (torch 2.13): one key per rank holding ``154 + 8 * world`` bytes (186 at
world 4, 282 at world 16), read by every member; NCCL keeps one 128-byte unique id per communicator. So 64 KiB is
a gloo group of about 8,000 ranks. Only the standard library is imported.
"""
from __future__ import annotations

MAX_KEY_BYTES = 512
MAX_VALUE_BYTES = 64 * 1024
MAX_KEYS = 65_536
MAX_STORED_BYTES = 256 * 1024 * 1024  # keys and values held
MAX_WAITERS = 65_536  # blocked get/wait requests, all connections together
MAX_FRAMES = 1 + 2 + 1024  # request id, op, timeout and up to 1024 keys (check/wait)
MAX_FRAME_BYTES = MAX_VALUE_BYTES + 1024  # ZMQ_MAXMSGSIZE of the store's sockets
MAX_TIMEOUT_MS = 24 * 3600 * 1000  # a blocking request waits at most a day
PREFETCH_BYTES = 256 * 1024  # keys and values a get/wait answer carries beyond what was asked

OK = b"ok"
ERR = b"err"

SET, GET, ADD, CAS, CHECK, WAIT, DELETE, NUM_KEYS, DONE = (
    b"set", b"get", b"add", b"cas", b"check", b"wait", b"del", b"num", b"done")
# op -> (least, most) argument frames
ARITY = {SET: (2, 2), GET: (1, 1), ADD: (2, 2), CAS: (3, 3), CHECK: (1, MAX_FRAMES - 3),
         WAIT: (1, MAX_FRAMES - 3), DELETE: (1, 1), NUM_KEYS: (0, 0), DONE: (2, 2)}

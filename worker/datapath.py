"""The data path of a state transfer (worker.transfer owns the header, the trailer and what they mean): the bytes
of the flat buffers, moved from sender to receiver in chunks, each buffer's CRC32 computed on both ends on the way.

**Chunks.** Buffer ``b`` of ``n`` bytes travels as ``ceil(n / chunk)`` chunks of ``chunk`` bytes (the last one
shorter); chunk ``j`` (numbered over all buffers in order) never spans two buffers. The sender reads a chunk
straight from the state's tensors (a view where it lies in one tensor, else packed into a staging buffer: no
whole-state ``torch.cat``), the receiver writes it straight into its flat receive buffer. Each end updates the
buffer's running CRC32 as each chunk passes, so checksumming overlaps the movement of the next chunk.

**Over the group** (gloo across hosts, NCCL): chunk ``j`` is one message of tag ``FIRST_CHUNK_TAG + j``; the
sender checksums chunk ``j + 1`` while chunk ``j`` travels, the receiver has chunk ``j + 1`` posted while it
checksums chunk ``j``.

**Through shared memory** (sender and receiver on one host, CPU buffers): the sender offers a ring of ``slots``
slots of ``chunk`` bytes (worker.shm.Segment; the offer travels in the MAC'd header) and starts filling it; the
receiver answers with one int64 on tag :data:`REPLY_TAG` (1: taken; 0: not, and every chunk then travels over
the group). Chunk ``j`` goes into slot ``j % slots``: the sender copies it in (checksumming it back from cache,
``PIECE_BYTES`` at a time) and sets the segment's ``ready`` counter to ``j + 1``; the receiver copies it out into
its receive buffer (checksumming what it wrote) and sets ``freed`` to ``j + 1``, which lets the sender reuse the
slot. No message per chunk: each side polls the other's counter (:class:`_Poll`: yields the CPU, then sleeps),
with a memory barrier between the bytes and the counter. The group stays the control path: each side keeps a
receive posted for the other's last message ("all filled" on tag ``FIRST_CHUNK_TAG`` from the sender, "all
read" back from the receiver) and looks at it while it polls, so a peer that dies mid-transfer (gloo reports the
closed connection) or hangs past the group's timeout makes it raise, never wait forever. The sender returns once
the receiver read everything. While the receiver waits for the sender's next chunk it runs steps of its own
work (worker.transfer builds the received states then), so that work costs no transfer time.

**One ring per transfer group.** Making and populating a ring costs ~1 ms per MB, more than moving a small
state: the sender keeps its ring for the group's next message (pre-copy, gradients, tail of one migration) and
offers it again with its counters reset; the receiver keeps its mapping and uses it again when the next
(authenticated) offer names the same segment and the segment still holds the offer's nonce. Both are closed when
the group is collected (the cache holds it weakly), by :func:`forget`, or as soon as a message fails or is
refused on that end.

CRC32 is zlib's (``zlib-ng``'s SIMD implementation where the ``zlib-ng`` package is installed: the same values,
~5x faster; :data:`CRC_IMPL` says which).
"""
from __future__ import annotations

import bisect
import collections
import dataclasses
import os
import threading
import time
import weakref
from typing import Callable, Iterator, Optional, Sequence

import numpy as np
import torch

from worker import shm

try:
    from zlib_ng.zlib_ng import crc32 as _crc32

    CRC_IMPL = "zlib-ng"
except ImportError:  # the same checksum, slower
    from zlib import crc32 as _crc32

    CRC_IMPL = "zlib"

CHUNK_BYTES = 4 << 20  # bytes per chunk over the group
SHM_CHUNK_BYTES = 1 << 20  # bytes per chunk (and per slot) when a shared-memory ring is offered
SHM_MIN_BYTES = 4 << 20  # payload under which the ring is not worth making (bytes)
MIN_CHUNK_BYTES = 4096
MAX_CHUNK_BYTES = 256 << 20
MAX_CHUNKS = 1 << 20  # the most chunks a receiver plans for one transfer (a header asking more is refused)
PIECE_BYTES = 512 << 10  # copy-then-checksum step on the shared-memory path: the copy is still in cache
RING_SLOTS = 8  # slots of the shared-memory ring (the sender runs at most this many chunks ahead)
SPIN_S = 0.002  # seconds a side waiting on the ring yields the CPU between looks before it sleeps between them
SLEEP_S = 20e-6
MAX_SLEEP_S = 1e-3
MAX_RING_SLOTS = 64
REPLY_TAG = 1
FIRST_CHUNK_TAG = 2
SHM_ENV = "TM_TRANSFER_SHM"  # "0": never offer shared memory (the bytes then always travel over the group)


def crc32(data: torch.Tensor, value: int = 0) -> int:
    """CRC32 of a tensor's bytes, continuing from ``value`` (the CRC32 of the bytes before them). CUDA tensors are
    copied to host first."""
    data = data.detach()
    if data.device.type != "cpu":
        data = data.cpu()
    return _crc32(memoryview(data.contiguous().reshape(-1).view(torch.uint8).numpy()), value)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a flat uint8 tensor (a view of a contiguous ``t``, else of a contiguous copy)."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


def _array_bytes(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's bytes as a flat numpy uint8 array (a view where numpy knows the dtype and ``t`` is
    contiguous: two numpy calls instead of four tensor ops; else through :func:`as_bytes`)."""
    if t.dtype in _NUMPY_DTYPES and t.is_contiguous():
        return t.detach().numpy().reshape(-1).view(np.uint8)
    return as_bytes(t).numpy()


_NUMPY_DTYPES = {torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16, torch.int8,
                 torch.uint8, torch.bool, torch.complex64, torch.complex128}


@dataclasses.dataclass(frozen=True)
class Chunk:
    """Chunk ``index`` (tag ``FIRST_CHUNK_TAG + index``): bytes ``[start, stop)`` of buffer ``buffer``."""
    index: int
    buffer: int
    start: int
    stop: int


def plan(sizes: Sequence[int], chunk: int) -> list[Chunk]:
    """The chunks of buffers of ``sizes`` bytes each, ``chunk`` bytes at most (see the module docstring)."""
    out: list[Chunk] = []
    for b, n in enumerate(sizes):
        for start in range(0, n, chunk):
            out.append(Chunk(len(out), b, start, min(n, start + chunk)))
    return out


class Source:
    """A buffer's bytes as the sender holds them: its tensors' bytes, back to back."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self._tensors = list(tensors)
        self._parts: Optional[list[torch.Tensor]] = None
        self._arrays: Optional[list[np.ndarray]] = None
        self.offsets = [0]
        for t in self._tensors:
            self.offsets.append(self.offsets[-1] + t.numel() * t.element_size())

    @property
    def parts(self) -> list[torch.Tensor]:
        """Each tensor's bytes as a flat uint8 tensor (see :func:`as_bytes`)."""
        if self._parts is None:
            self._parts = [as_bytes(t) for t in self._tensors]
        return self._parts

    def arrays(self, start: int, stop: int):
        """Yield the range's bytes in order as numpy uint8 views of the (CPU) tensors that hold them."""
        if self._arrays is None:
            self._arrays = [_array_bytes(t) for t in self._tensors]
        i = max(0, bisect.bisect_right(self.offsets, start) - 1)
        while i < len(self._arrays) and self.offsets[i] < stop:
            lo, hi = self.offsets[i], self.offsets[i + 1]
            if hi > start:
                yield self._arrays[i][max(start, lo) - lo:min(stop, hi) - lo]
            i += 1

    @property
    def nbytes(self) -> int:
        return self.offsets[-1]

    def spans(self, start: int, stop: int):
        """Yield (tensor bytes, its part in [start, stop)) in order: the uint8 views that make up the range."""
        for i, p in enumerate(self.parts):
            lo, hi = self.offsets[i], self.offsets[i + 1]
            if hi <= start or lo >= stop or p.numel() == 0:
                continue
            yield p[max(start, lo) - lo:min(stop, hi) - lo]

    def view(self, start: int, stop: int) -> Optional[torch.Tensor]:
        """The range as one view when it lies in one tensor, else None."""
        spans = list(self.spans(start, stop))
        return spans[0] if len(spans) == 1 else None

    def copy_into(self, out: torch.Tensor, start: int, stop: int) -> None:
        """Copy the range into ``out`` (a uint8 tensor of ``stop - start`` elements)."""
        at = 0
        for s in self.spans(start, stop):
            out[at:at + s.numel()].copy_(s)
            at += s.numel()


# --- over the group ---------------------------------------------------------------------------------------------
def send_wire(pg, dst: int, sources: Sequence[Source], chunks: Sequence[Chunk], device: torch.device) -> list[int]:
    """Send ``chunks`` of ``sources`` to ``dst`` over ``pg``, the next chunk checksummed while one travels.
    ``device``: where the group's tensors live. Returns each buffer's CRC32. Raises RuntimeError if the peer dies."""
    crcs = [0] * len(sources)
    staging: list[Optional[torch.Tensor]] = [None, None]
    pending = None
    for c in chunks:
        src = sources[c.buffer]
        data = src.view(c.start, c.stop)
        if data is None or data.device != device:
            k = c.index % 2  # the staging buffer of chunk index - 2, whose send completed
            n = c.stop - c.start
            if staging[k] is None or staging[k].numel() < n:
                staging[k] = torch.empty(n if staging[k] is None else max(n, staging[k].numel()),
                                         dtype=torch.uint8, device=device)
            out = staging[k][:n]
            if data is None:
                src.copy_into(out, c.start, c.stop)
            else:
                out.copy_(data)
            data = out
        crcs[c.buffer] = crc32(data, crcs[c.buffer])
        if pending is not None:
            pending.wait()
        pending = pg.send([data], dst, FIRST_CHUNK_TAG + c.index)
    if pending is not None:
        pending.wait()
    return crcs


def recv_wire(pg, src: int, dests: Sequence[torch.Tensor], chunks: Sequence[Chunk]) -> list[int]:
    """Receive ``chunks`` from ``src`` into ``dests`` (one flat uint8 tensor per buffer), checksumming chunk ``j``
    while chunk ``j + 1`` arrives. Returns each buffer's CRC32. Raises RuntimeError if the peer dies."""
    crcs = [0] * len(dests)
    posted = {}

    def post(c: Chunk) -> None:
        posted[c.index] = pg.recv([dests[c.buffer][c.start:c.stop]], src, FIRST_CHUNK_TAG + c.index)

    if chunks:
        post(chunks[0])
    for i, c in enumerate(chunks):
        if i + 1 < len(chunks):
            post(chunks[i + 1])
        posted.pop(c.index).wait()
        crcs[c.buffer] = crc32(dests[c.buffer][c.start:c.stop], crcs[c.buffer])
    return crcs


# --- through shared memory --------------------------------------------------------------------------------------
def shm_enabled() -> bool:
    """Whether this process offers shared memory (env ``TM_TRANSFER_SHM`` is not ``0``, and the host can)."""
    return os.environ.get(SHM_ENV, "1") != "0" and shm.supported()


class _Rings:
    """Segments kept for the next message of the same transfer group, one per group, held weakly by the group: a
    segment is closed when its group is collected (or with :func:`forget`). :meth:`take` hands the kept segment
    out (it is then in use by one message: a second message at the same time makes its own), :meth:`keep`
    stores it back (closing it instead when another one was kept meanwhile)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_group: dict[int, tuple[weakref.ref, shm.Segment]] = {}

    def take(self, group) -> Optional[shm.Segment]:
        with self._lock:
            entry = self._by_group.get(id(group))
            if entry is None or entry[0]() is not group:
                return None
            del self._by_group[id(group)]
            return entry[1]

    def keep(self, group, segment: shm.Segment) -> None:
        key = id(group)

        def collected(_ref, key=key) -> None:
            with self._lock:
                entry = self._by_group.get(key)
                if entry is None or entry[0] is not _ref:
                    return
                del self._by_group[key]
            entry[1].close()

        try:
            ref = weakref.ref(group, collected)
        except TypeError:  # a group that takes no weak reference: nothing would close the segment
            segment.close()
            return
        with self._lock:
            old = self._by_group.get(key)
            if old is not None and old[0]() is group:
                extra = segment  # another message kept its segment meanwhile: that one stays
            else:
                self._by_group[key], extra = (ref, segment), None
        if extra is not None:
            extra.close()

    def forget(self, group) -> None:
        segment = self.take(group)
        if segment is not None:
            segment.close()


_SENDING = _Rings()  # the sender's rings, by transfer group
_RECEIVING = _Rings()  # the receiver's mappings of its sender's ring, by transfer group


def forget(group) -> None:
    """Close the segments kept for ``group`` on this end (both roles) now, instead of when ``group`` is
    collected."""
    _SENDING.forget(group)
    _RECEIVING.forget(group)


def offer_ring(sizes: Sequence[int], device: torch.device, devices: Sequence[str],
               group=None) -> tuple[int, Optional[shm.Segment], Optional[dict]]:
    """The chunk size for buffers of ``sizes`` bytes and, where shared memory applies, a ring of ``RING_SLOTS``
    slots of it and its offer: (chunk, segment, offer), or (CHUNK_BYTES, None, None) where it does not (disabled,
    a CUDA group or buffer, under ``SHM_MIN_BYTES`` to move (a small message, e.g. a pre-copy's tail, is faster
    over the wire than through a ring), or the segment cannot be made). With ``group``, the ring kept for that
    group by the previous message (:func:`done_sending`) is offered again, its counters reset: making and
    populating a ring costs ~8 ms per 8 MB, paid once per group instead of once per message."""
    if sum(sizes) < SHM_MIN_BYTES or device.type != "cpu" or any(d != "cpu" for d in devices) \
            or not shm_enabled():
        return CHUNK_BYTES, None, None
    segment = _SENDING.take(group) if group is not None else None
    if segment is not None and (segment.nslots, segment.slot_bytes) == (RING_SLOTS, SHM_CHUNK_BYTES):
        segment.reset()
        return SHM_CHUNK_BYTES, segment, segment.offer
    if segment is not None:  # made for other settings
        segment.close()
    chunks = plan(sizes, SHM_CHUNK_BYTES)
    slots = RING_SLOTS if group is not None else min(RING_SLOTS, len(chunks))
    slot = SHM_CHUNK_BYTES if group is not None else max(c.stop - c.start for c in chunks)
    try:
        segment, offer = shm.Segment.create(slots, slot)
    except (OSError, ValueError):
        return CHUNK_BYTES, None, None
    return SHM_CHUNK_BYTES, segment, offer


def done_sending(group, segment: Optional[shm.Segment], ok: bool) -> None:
    """The sender is done with ``segment`` (None: there was none): keep it for ``group``'s next message when the
    message went through (``ok``) and there is a group, else close it."""
    if segment is None:
        return
    if ok and group is not None:
        _SENDING.keep(group, segment)
    else:
        segment.close()


def check_offer(offer, chunks: Sequence[Chunk]) -> bool:
    """Whether ``offer`` (a parsed, authenticated header's value) is well-formed for ``chunks``: types, bounds,
    slot size. Nothing is opened here."""
    if offer is None:
        return True
    fields = {"host": str, "pid": int, "fd": int, "nonce": str, "slots": int, "slot_bytes": int}
    if type(offer) is not dict or set(offer) != set(fields) \
            or not all(type(offer[k]) is t for k, t in fields.items()):
        return False
    if not (0 < len(offer["host"]) <= 64 and offer["pid"] > 0 and offer["fd"] >= 0
            and 1 <= offer["slots"] <= MAX_RING_SLOTS and 0 < offer["slot_bytes"] <= MAX_CHUNK_BYTES
            and len(offer["nonce"]) == 2 * shm.NONCE_BYTES):
        return False
    try:
        bytes.fromhex(offer["nonce"])
    except ValueError:
        return False
    return all(c.stop - c.start <= offer["slot_bytes"] for c in chunks)


def accept(pg, src: int, offer: Optional[dict]) -> Optional[shm.Segment]:
    """Receiver: map the offered segment (None: none offered, or not this host's) and tell the sender which path
    the bytes take (only when one was offered). The mapping kept for ``pg`` by the previous message
    (:func:`done_receiving`) is used again when the offer names the same segment (same offer, and the segment
    still holds the offer's nonce); any other kept mapping is closed. Raises RuntimeError if the peer dies."""
    if offer is None:
        return None
    segment = _RECEIVING.take(pg)
    if segment is not None and not segment.matches(offer):
        segment.close()
        segment = None
    if segment is None:
        segment = shm.Segment.open(offer)
    try:
        pg.send([torch.tensor([int(segment is not None)], dtype=torch.int64)], src, REPLY_TAG).wait()
    except BaseException:
        if segment is not None:
            segment.close()
        raise
    return segment


def done_receiving(pg, segment: Optional[shm.Segment], ok: bool) -> None:
    """The receiver is done with ``segment`` (None: there was none): keep the mapping for ``pg``'s next message
    when the data path went through (``ok``), else close it."""
    if segment is None:
        return
    if ok:
        _RECEIVING.keep(pg, segment)
    else:
        segment.close()


def fill_slot(src: Source, slot: np.ndarray, start: int, stop: int, crc: int) -> int:
    """Copy bytes ``[start, stop)`` of ``src`` into ``slot`` (a numpy uint8 array of at least ``stop - start``
    bytes) and return ``crc`` continued over them, read back from the slot ``PIECE_BYTES`` at a time while they
    are in cache (small tensors are checksummed together, once a piece's worth was copied)."""
    at = done = 0
    for s in src.arrays(start, stop):
        n, lo = s.shape[0], 0
        while lo < n:
            take = min(n - lo, PIECE_BYTES - (at - done))
            np.copyto(slot[at:at + take], s[lo:lo + take])
            at += take
            lo += take
            if at - done >= PIECE_BYTES:
                crc = _crc32(slot[done:at], crc)
                done = at
    if at > done:
        crc = _crc32(slot[done:at], crc)
    return crc


def drain_slot(slot: np.ndarray, dest: np.ndarray, crc: int) -> int:
    """Copy ``slot``'s first ``len(dest)`` bytes into ``dest`` and return ``crc`` continued over what was written
    there, ``PIECE_BYTES`` at a time while it is in cache."""
    n = dest.shape[0]
    for lo in range(0, n, PIECE_BYTES):
        out = dest[lo:lo + PIECE_BYTES]
        np.copyto(out, slot[lo:lo + out.shape[0]])
        crc = _crc32(out, crc)
    return crc


def _fence() -> None:
    """A full memory barrier (a lock's atomic operations, twice): the slot's bytes are visible to the other process
    before the counter that announces them, and read only after it."""
    _FENCE.acquire()
    _FENCE.release()
    _FENCE.acquire()
    _FENCE.release()


_FENCE = threading.Lock()


class _Poll:
    """Waits on a counter in the segment without a message per chunk: spins (yielding the CPU) for ``SPIN_S``
    seconds, then sleeps between looks, from ``SLEEP_S`` doubling up to ``MAX_SLEEP_S`` (a slow peer costs
    little CPU). ``watch()`` is called between looks: it raises when the peer failed (a pending receive on the
    group completed with an error)."""

    def __init__(self, watch: Callable[[], None]) -> None:
        self.watch = watch

    def until(self, ok: Callable[[], bool]) -> None:
        if ok():
            return
        began = time.perf_counter()
        looks = 0
        nap = SLEEP_S
        while not ok():
            looks += 1
            if looks % 64 == 0 or nap > SLEEP_S:
                self.watch()
            if time.perf_counter() - began < SPIN_S:
                os.sched_yield()
            else:
                time.sleep(nap)
                nap = min(2 * nap, MAX_SLEEP_S)


class _Watch:
    """A pending receive waited for on a thread of its own (a gloo receive reports nothing before ``wait()``):
    :attr:`done` once it completed, :meth:`raise_failure` raises what it failed with (the peer died, the group
    timed out), :meth:`wait` waits for it."""

    def __init__(self, work) -> None:
        self.done = False
        self.error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._wait, args=(work,), daemon=True, name="tm-transfer-watch")
        self._thread.start()

    def _wait(self, work) -> None:
        try:
            work.wait()
        except BaseException as e:  # noqa: BLE001 - raised on the waiting thread by raise_failure / wait
            self.error = e
        self.done = True

    def raise_failure(self) -> None:
        if self.error is not None:
            raise self.error

    def wait(self) -> None:
        self._thread.join()
        self.raise_failure()


def _failed(watch: Optional[_Watch]) -> None:
    """Raise if ``watch`` failed: the peer died or the group timed out."""
    if watch is not None:
        watch.raise_failure()


def send_shm(pg, dst: int, segment: shm.Segment, sources: Sequence[Source], chunks: Sequence[Chunk],
             on_filled: Optional[Callable[[list[int]], None]] = None) -> Optional[list[int]]:
    """Send ``chunks`` of ``sources`` (CPU tensors) through ``segment``'s ring, filling it while the receiver's
    answer to the offer is on its way. ``on_filled(crcs)`` is called once every chunk is in the ring, before the
    receiver has read the last ones (worker.transfer sends its trailer then). Returns each buffer's CRC32, or None
    when the receiver did not take the segment (send over the group then; ``on_filled`` was not called). Returns
    once the receiver has read every chunk. Raises RuntimeError if the peer dies."""
    crcs = [0] * len(sources)
    nslots = segment.nslots
    reply = torch.full((1,), -1, dtype=torch.int64)
    reply_watch = _Watch(pg.recv([reply], dst, REPLY_TAG))
    done = torch.zeros(1, dtype=torch.int64)
    state: dict = {"taken": None, "done": None}

    def answer(block: bool = False) -> Optional[bool]:
        if state["taken"] is None and (block or reply_watch.done):
            reply_watch.wait()  # raises if the receiver died
            state["taken"] = int(reply.item()) == 1
            if state["taken"]:  # its "all read" message: failing early means the receiver died
                state["done"] = _Watch(pg.recv([done], dst, FIRST_CHUNK_TAG))
        return state["taken"]

    def watch() -> None:
        answer()
        _failed(state["done"])

    poll = _Poll(watch)
    freed, ready, ring = segment.freed, segment.ready, segment.ring
    for c in chunks:
        if c.index - int(freed[0]) >= nslots:
            poll.until(lambda: c.index - int(freed[0]) < nslots or answer() is False)
        if state["taken"] is False:
            return None
        crcs[c.buffer] = fill_slot(sources[c.buffer], ring[c.index % nslots], c.start, c.stop, crcs[c.buffer])
        _fence()
        ready[0] = c.index + 1
    if not answer(block=True):
        return None
    filled = torch.tensor([len(chunks)], dtype=torch.int64)
    sent = pg.send([filled], dst, FIRST_CHUNK_TAG)  # "all filled": the receiver watches for it (or its failure)
    if on_filled is not None:
        on_filled(crcs)
    state["done"].wait()
    sent.wait()
    return crcs


def recv_shm(pg, src: int, segment: shm.Segment, dests: Sequence[torch.Tensor], chunks: Sequence[Chunk],
             idle: Optional[Iterator[None]] = None) -> list[int]:
    """Receive ``chunks`` through ``segment``'s ring into ``dests`` (flat uint8 CPU tensors, one per buffer), then
    tell the sender all was read. ``idle``: steps of other work (each ``next()`` runs one; short, ~1 ms), run
    while the next chunk is not in the ring yet, the rest once the sender was told; what a step raises is
    raised here. Returns each buffer's CRC32 of the bytes written there. Raises RuntimeError if the peer dies."""
    crcs = [0] * len(dests)
    nslots = segment.nslots
    # the sender's "all filled" message: a receive failing before it came is the sender's death
    watch = _Watch(pg.recv([torch.zeros(1, dtype=torch.int64)], src, FIRST_CHUNK_TAG))
    poll = _Poll(lambda: _failed(watch))
    ready, freed, ring = segment.ready, segment.freed, segment.ring
    arrays = [d.numpy() for d in dests]
    for c in chunks:
        _failed(watch)
        while idle is not None and int(ready[0]) <= c.index:
            if next(idle, _NO_STEP) is _NO_STEP:
                idle = None
        if int(ready[0]) <= c.index:
            poll.until(lambda: int(ready[0]) > c.index)
        _fence()
        crcs[c.buffer] = drain_slot(ring[c.index % nslots], arrays[c.buffer][c.start:c.stop], crcs[c.buffer])
        _fence()
        freed[0] = c.index + 1
    sent = pg.send([torch.tensor([len(chunks)], dtype=torch.int64)], src, FIRST_CHUNK_TAG)  # "all read"
    if idle is not None:
        collections.deque(idle, maxlen=0)  # the steps left, while the sender goes on to its trailer
    sent.wait()
    watch.wait()
    return crcs


_NO_STEP = object()


def nbytes_of(chunks: Sequence[Chunk]) -> int:
    """Bytes that ``chunks`` move."""
    return sum(c.stop - c.start for c in chunks)



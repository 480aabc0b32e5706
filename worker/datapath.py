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
the receiver read everything; the segment is closed on both ends before either returns or raises.

CRC32 is zlib's (``zlib-ng``'s SIMD implementation where the ``zlib-ng`` package is installed: the same values,
~5x faster; :data:`CRC_IMPL` says which).
"""
from __future__ import annotations

import dataclasses
import os
import threading
import time
from typing import Callable, Optional, Sequence

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
        self.parts = [as_bytes(t) for t in tensors]
        self.offsets = [0]
        for p in self.parts:
            self.offsets.append(self.offsets[-1] + p.numel())

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


def offer_ring(sizes: Sequence[int], device: torch.device,
               devices: Sequence[str]) -> tuple[int, Optional[shm.Segment], Optional[dict]]:
    """The chunk size for buffers of ``sizes`` bytes and, where shared memory applies, a ring of ``RING_SLOTS``
    slots of it and its offer: (chunk, segment, offer), or (CHUNK_BYTES, None, None) where it does not (disabled,
    a CUDA group or buffer, under ``SHM_MIN_BYTES`` to move (a small message, e.g. a pre-copy's tail, is faster
    over the wire than through a ring made for it), or the segment cannot be made)."""
    if sum(sizes) < SHM_MIN_BYTES or device.type != "cpu" or any(d != "cpu" for d in devices) \
            or not shm_enabled():
        return CHUNK_BYTES, None, None
    chunks = plan(sizes, SHM_CHUNK_BYTES)
    slot = max(c.stop - c.start for c in chunks)
    try:
        segment, offer = shm.Segment.create(min(RING_SLOTS, len(chunks)), slot)
    except (OSError, ValueError):
        return CHUNK_BYTES, None, None
    return SHM_CHUNK_BYTES, segment, offer


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
    """Receiver: open the offered segment (None: none offered, or not this host's) and tell the sender which path
    the bytes take (only when one was offered). Raises RuntimeError if the peer dies."""
    if offer is None:
        return None
    segment = shm.Segment.open(offer)
    try:
        pg.send([torch.tensor([int(segment is not None)], dtype=torch.int64)], src, REPLY_TAG).wait()
    except BaseException:
        if segment is not None:
            segment.close()
        raise
    return segment


def fill_slot(src: Source, slot: torch.Tensor, start: int, stop: int, crc: int) -> int:
    """Copy bytes ``[start, stop)`` of ``src`` into ``slot`` and return ``crc`` continued over them (read back
    from the slot while in cache)."""
    at = 0
    for s in src.spans(start, stop):
        for lo in range(0, s.numel(), PIECE_BYTES):
            piece = s[lo:lo + PIECE_BYTES]
            out = slot[at:at + piece.numel()]
            out.copy_(piece)
            crc = crc32(out, crc)
            at += piece.numel()
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


def send_shm(pg, dst: int, segment: shm.Segment, sources: Sequence[Source],
             chunks: Sequence[Chunk]) -> Optional[list[int]]:
    """Send ``chunks`` through ``segment``'s ring, filling it while the receiver's answer to the offer is on its
    way. Returns each buffer's CRC32, or None when the receiver did not take the segment (send over the group
    then). Returns once the receiver has read every chunk. Raises RuntimeError if the peer dies."""
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
    freed = segment.freed
    for c in chunks:
        poll.until(lambda: c.index - int(freed.item()) < nslots or answer() is False)
        if state["taken"] is False:
            return None
        crcs[c.buffer] = fill_slot(sources[c.buffer], segment.slots[c.index % nslots], c.start, c.stop,
                                   crcs[c.buffer])
        _fence()
        segment.ready.fill_(c.index + 1)
    if not answer(block=True):
        return None
    filled = torch.tensor([len(chunks)], dtype=torch.int64)
    sent = pg.send([filled], dst, FIRST_CHUNK_TAG)  # "all filled": the receiver watches for it (or its failure)
    state["done"].wait()
    sent.wait()
    return crcs


def recv_shm(pg, src: int, segment: shm.Segment, dests: Sequence[torch.Tensor], chunks: Sequence[Chunk]) -> list[int]:
    """Receive ``chunks`` through ``segment``'s ring into ``dests`` (flat uint8 tensors, one per buffer), then
    tell the sender all was read. Returns each buffer's CRC32 of the bytes written there. Raises RuntimeError if
    the peer dies."""
    crcs = [0] * len(dests)
    nslots = segment.nslots
    # the sender's "all filled" message: a receive failing before it came is the sender's death
    watch = _Watch(pg.recv([torch.zeros(1, dtype=torch.int64)], src, FIRST_CHUNK_TAG))
    poll = _Poll(lambda: _failed(watch))
    ready = segment.ready
    for c in chunks:
        _failed(watch)
        poll.until(lambda: int(ready.item()) > c.index)
        _fence()
        slot = segment.slots[c.index % nslots]
        dest = dests[c.buffer]
        crc = crcs[c.buffer]
        for lo in range(c.start, c.stop, PIECE_BYTES):
            hi = min(c.stop, lo + PIECE_BYTES)
            out = dest[lo:hi]
            out.copy_(slot[lo - c.start:hi - c.start])
            crc = crc32(out, crc)
        crcs[c.buffer] = crc
        _fence()
        segment.freed.fill_(c.index + 1)
    pg.send([torch.tensor([len(chunks)], dtype=torch.int64)], src, FIRST_CHUNK_TAG).wait()  # "all read"
    watch.wait()
    return crcs


def nbytes_of(chunks: Sequence[Chunk]) -> int:
    """Bytes that ``chunks`` move."""
    return sum(c.stop - c.start for c in chunks)



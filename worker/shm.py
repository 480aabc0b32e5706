"""Shared-memory segments for a same-host state transfer (worker.datapath): an anonymous memory file (Linux
``memfd_create``) that the sender creates and the receiver opens through ``/proc/<sender pid>/fd/<fd>``.

The segment has no name in any file system, so nothing can leak: its memory is freed when the last process that
maps or holds it closes it (or dies). It is readable only by the sender's user (mode 0600, and ``/proc/<pid>/fd``
needs the same user). The receiver takes it only if the offer comes from this host (same ``boot_id``), the path is
a regular file of exactly the offered size, and the segment's first :data:`NONCE_BYTES` bytes equal the offer's
random nonce (so a pid or fd that names another file, in another pid namespace, is never used); otherwise it
answers that it cannot, and the bytes travel over the group instead.

Layout: ``NONCE_BYTES`` of nonce, the two ring counters (int64 at :data:`READY_AT` and :data:`FREED_AT`), padded to
:data:`PREAMBLE_BYTES`, then ``slots`` slots of ``slot_bytes`` each.

A segment may carry many messages in turn (worker.datapath keeps one per transfer group): the sender resets the
counters with :meth:`Segment.reset` before it offers the segment again, and the receiver, which keeps its mapping,
checks the nonce in the segment again (:meth:`Segment.matches`) before it reuses it.
"""
from __future__ import annotations

import hmac
import mmap
import os
import secrets
import stat
from typing import Optional

import numpy as np
import torch

NONCE_BYTES = 32
PREAMBLE_BYTES = 4096  # the nonce and the counters, padded to a page: slots start page-aligned
READY_AT = 1024  # int64: chunks the sender put in the ring (it writes, the receiver reads)
FREED_AT = 2048  # int64: chunks the receiver took out of the ring (it writes, the sender reads)
MAX_SEGMENT_BYTES = 1 << 30  # the largest segment a receiver maps (bytes)
_BOOT_ID = "/proc/sys/kernel/random/boot_id"


def host_id() -> Optional[str]:
    """This host's boot id (``/proc/sys/kernel/random/boot_id``), None where there is none (not Linux)."""
    try:
        with open(_BOOT_ID) as f:
            return f.read().strip()
    except OSError:
        return None


def supported() -> bool:
    """Whether this host can make segments (Linux with ``memfd_create`` and a boot id)."""
    return hasattr(os, "memfd_create") and host_id() is not None


class Segment:
    """A mapped segment: ``slots`` (a uint8 tensor of shape [slots, slot_bytes] over the shared memory), ``ring``
    (the same bytes as a numpy array: the data path copies with it, a call costing ~1 us instead of a tensor op's
    ~5 us), the counters ``ready`` and ``freed`` (int64 numpy arrays of one element). Close it with :meth:`close`
    (idempotent); until then it holds the mapping and, on the creating side, the file."""

    def __init__(self, mapping: mmap.mmap, fd: Optional[int], slots: int, slot_bytes: int,
                 offer: Optional[dict] = None) -> None:
        self._mapping: Optional[mmap.mmap] = mapping
        self._fd = fd
        self.fd = fd
        self.slot_bytes = slot_bytes
        self.nslots = slots
        self.offer = offer  # the offer that names it (the creator's, or the one it was opened with)
        whole = torch.frombuffer(mapping, dtype=torch.uint8)
        self.slots: Optional[torch.Tensor] = whole[PREAMBLE_BYTES:].view(slots, slot_bytes)
        self.ring: Optional[np.ndarray] = self.slots.numpy()
        # two counters on their own cache lines: chunks the sender filled, chunks the receiver read
        counters = whole[:PREAMBLE_BYTES].numpy()
        self.ready: Optional[np.ndarray] = counters[READY_AT:READY_AT + 8].view(np.int64)
        self.freed: Optional[np.ndarray] = counters[FREED_AT:FREED_AT + 8].view(np.int64)
        self._nonce: Optional[np.ndarray] = counters[:NONCE_BYTES]

    @staticmethod
    def size(slots: int, slot_bytes: int) -> int:
        """The segment's size in bytes for ``slots`` slots of ``slot_bytes``."""
        return PREAMBLE_BYTES + slots * slot_bytes

    @classmethod
    def create(cls, slots: int, slot_bytes: int) -> tuple["Segment", dict]:
        """A new segment and its offer (``{"host", "pid", "fd", "nonce", "slots", "slot_bytes"}``: JSON data for
        the peer's :meth:`open`). Its pages are allocated now (``MAP_POPULATE``), not during the transfer. Raises
        OSError where it cannot be made."""
        fd = os.memfd_create("tm-transfer", getattr(os, "MFD_CLOEXEC", 0))
        try:
            os.fchmod(fd, 0o600)
            size = cls.size(slots, slot_bytes)
            os.ftruncate(fd, size)
            mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
            nonce = secrets.token_bytes(NONCE_BYTES)
            mapping[:NONCE_BYTES] = nonce
        except BaseException:
            os.close(fd)
            raise
        offer = {"host": host_id(), "pid": os.getpid(), "fd": fd, "nonce": nonce.hex(), "slots": slots,
                 "slot_bytes": slot_bytes}
        return cls(mapping, fd, slots, slot_bytes, offer), offer

    @classmethod
    def open(cls, offer: dict) -> Optional["Segment"]:
        """The peer's segment named by ``offer`` (checked by the caller for types and bounds), mapped;
        None when it is not on this host or is not that segment (see the module docstring). Never raises for
        such a mismatch; nothing is opened that is not a regular file of the offered size."""
        if offer["host"] != host_id():
            return None
        size = cls.size(offer["slots"], offer["slot_bytes"])
        if size > MAX_SEGMENT_BYTES:
            return None
        path = f"/proc/{offer['pid']}/fd/{offer['fd']}"
        try:
            st = os.stat(path)  # follows the link without opening: a FIFO or a device is never opened
            if not stat.S_ISREG(st.st_mode) or st.st_size != size:
                return None
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode) or os.fstat(fd).st_size != size:
                return None
            mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        except OSError:
            return None
        finally:
            os.close(fd)  # the mapping keeps the memory
        if not hmac.compare_digest(mapping[:NONCE_BYTES], bytes.fromhex(offer["nonce"])):
            mapping.close()
            return None
        return cls(mapping, None, offer["slots"], offer["slot_bytes"], dict(offer))

    def matches(self, offer: dict) -> bool:
        """Whether ``offer`` (checked by the caller for types and bounds) names this mapped segment: the same
        offer it was opened with, and the segment still starts with the offer's nonce."""
        return self._mapping is not None and self.offer == offer \
            and hmac.compare_digest(self._nonce.tobytes(), bytes.fromhex(offer["nonce"]))

    def reset(self) -> None:
        """Set both ring counters to 0 (the sender, before it offers the segment for another message: the
        receiver of the previous one has stopped touching it)."""
        self.ready[0] = 0
        self.freed[0] = 0

    def release_file(self) -> None:
        """Close the creating side's file descriptor (the peer opened it, or never will); the mapping stays."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def close(self) -> None:
        """Drop the mapping and the file: the memory is freed once the peer closed its side too."""
        self.release_file()
        self.slots = self.ring = self.ready = self.freed = self._nonce = None
        if self._mapping is not None:
            try:
                self._mapping.close()
            except BufferError:  # a tensor over the mapping is still alive: it unmaps when collected
                pass
            self._mapping = None

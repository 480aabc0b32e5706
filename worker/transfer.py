"""State transfer: the leaver sends its joiner every tensor of the managed state, peer to peer, checksummed.

Wire layout over a 2-rank process group (leaver = rank 0, joiner = rank 1; gloo here, NCCL on GPU clusters):
1. ``int64[1]``: the header's length in bytes;
2. ``uint8[len]``: the header, a pickle of {"skeleton": the state with every tensor replaced by a reference,
   "buffers": [{"key", "dtype", "numel", "crc32"}]};
3. one flat buffer per (object, dtype, device): the tensors of that object and dtype, concatenated.

Packing per (object, dtype) keeps the message count small (a handful of sends instead of one per tensor) and
lets the joiner's optimizer keep views into its receive buffer (no second copy). The joiner verifies every
buffer's CRC32 before anything is loaded; a mismatch raises :class:`ChecksumError` and nothing is loaded.
Peers are the same job's ranks, so the header is a pickle (as in torch.distributed's object collectives).
"""
from __future__ import annotations

import dataclasses
import pickle
import time
import zlib
from typing import Any, Optional

import torch


class ChecksumError(RuntimeError):
    """A received buffer's CRC32 differs from the sender's: the state is refused."""


@dataclasses.dataclass(frozen=True)
class _Ref:
    """Stands for a tensor in the header: the ``index``-th tensor of flat buffer ``group``."""

    group: tuple  # (object name, dtype, device)
    index: int


def crc32(t: torch.Tensor) -> int:
    """CRC32 of a tensor's bytes. CUDA tensors are copied to host first (a GPU hash would avoid the copy)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return zlib.crc32(memoryview(t.contiguous().view(torch.uint8).numpy()))


def _split(state: Any, key: str, groups: dict, order: list) -> Any:
    """Replace tensors in a nested state by placeholders, grouping them per (key, dtype, device)."""
    if isinstance(state, torch.Tensor):
        gkey = (key, state.dtype, str(state.device))
        if gkey not in groups:
            groups[gkey] = []
            order.append(gkey)
        groups[gkey].append(state.detach())
        return _Ref(gkey, len(groups[gkey]) - 1)
    if isinstance(state, dict):
        return type(state)((k, _split(v, key, groups, order)) for k, v in state.items())
    if isinstance(state, (list, tuple)):
        return type(state)(_split(v, key, groups, order) for v in state)
    return state


def _layout(objects: dict[str, Any]) -> tuple[dict, list, list[list[torch.Tensor]]]:
    groups: dict = {}
    order: list = []
    skeleton = {name: _split(obj.state_dict(), name, groups, order) for name, obj in objects.items()}
    return skeleton, order, [groups[k] for k in order]


def plan_buffers(objects: dict[str, Any]) -> list[dict]:
    """The flat buffers a transfer of ``objects`` needs: [{"key", "dtype", "numel", "device"}]."""
    _, order, tensors = _layout(objects)
    return [{"key": k[0], "dtype": k[1], "device": k[2], "numel": sum(t.numel() for t in ts)}
            for k, ts in zip(order, tensors)]


def pretouch(plan: list[dict]) -> list[torch.Tensor]:
    """Allocate and touch receive buffers for ``plan`` so page faults happen before the switch step."""
    return [torch.zeros(b["numel"], dtype=b["dtype"], device=b["device"]) for b in plan]


def _wire_device(pg) -> torch.device:
    """Where this group's tensors must live: the current CUDA device for NCCL, the CPU for gloo."""
    return torch.device("cuda", torch.cuda.current_device()) if pg.name() == "nccl" else torch.device("cpu")


def send_state(pg, objects: dict[str, Any], extra: dict, dst: int = 1) -> tuple[int, float]:
    """Send ``objects``' state_dicts and ``extra`` (picklable) to rank ``dst`` of ``pg``.

    Returns (bytes_moved, seconds). Raises RuntimeError if the peer dies mid-transfer (gloo reports the closed
    socket); the caller's own state is untouched either way.
    """
    start = time.perf_counter()
    skeleton, order, tensors = _layout(objects)
    flats = [torch.cat([t.reshape(-1) for t in ts]) if len(ts) > 1 else ts[0].reshape(-1).clone() for ts in tensors]
    header = pickle.dumps({
        "skeleton": skeleton,
        "extra": extra,
        "buffers": [{"key": k[0], "dtype": k[1], "device": k[2], "numel": f.numel(), "crc32": crc32(f),
                     "shapes": [tuple(t.shape) for t in ts]} for k, f, ts in zip(order, flats, tensors)],
    })
    wire = _wire_device(pg)
    head = torch.frombuffer(bytearray(header), dtype=torch.uint8).to(wire)
    pg.send([torch.tensor([head.numel()], dtype=torch.int64, device=wire)], dst, 0).wait()
    pg.send([head], dst, 1).wait()
    moved = head.numel() + 8
    for i, flat in enumerate(flats):
        pg.send([flat], dst, 2 + i).wait()
        moved += flat.numel() * flat.element_size()
    return moved, time.perf_counter() - start


def recv_state(pg, src: int = 0, buffers: Optional[list[torch.Tensor]] = None) -> tuple[dict, dict, int, float]:
    """Receive what :func:`send_state` sent. ``buffers``: pre-touched receive buffers (used where dtype and size
    match). Returns (states by object name, extra, bytes_moved, seconds). Raises ChecksumError on a corrupt
    buffer and RuntimeError if the peer dies mid-transfer; nothing is loaded anywhere in either case."""
    wire = _wire_device(pg)
    length = torch.zeros(1, dtype=torch.int64, device=wire)
    pg.recv([length], src, 0).wait()  # waits for the sender to reach its switch step: not transfer time
    start = time.perf_counter()
    head = torch.empty(int(length.item()), dtype=torch.uint8, device=wire)
    pg.recv([head], src, 1).wait()
    header = pickle.loads(head.cpu().numpy().tobytes())
    moved = head.numel() + 8
    pool = list(buffers or [])
    flats: dict = {}
    received = []
    for i, b in enumerate(header["buffers"]):
        # the sender's cuda:<i> is this process's own CUDA device; CPU state stays on the CPU
        device = torch.device("cpu") if b["device"] == "cpu" else wire
        flat = next((t for t in pool if t.dtype == b["dtype"] and t.numel() == b["numel"]
                     and t.device == device), None)
        if flat is not None:
            pool.remove(flat)
        else:
            flat = torch.empty(b["numel"], dtype=b["dtype"], device=device)
        pg.recv([flat], src, 2 + i).wait()
        moved += flat.numel() * flat.element_size()
        received.append((b, flat))
    # Verify only once everything arrived, so the sender is never left blocked in a send nobody receives.
    for b, flat in received:
        got = crc32(flat)
        if got != b["crc32"]:
            raise ChecksumError(f"state buffer {b['key']}/{b['dtype']} failed its checksum "
                                f"(crc32 {got:#010x}, sender {b['crc32']:#010x}); state refused")
        views, offset = [], 0
        for shape in b["shapes"]:
            n = 1
            for d in shape:
                n *= d
            views.append(flat[offset:offset + n].view(shape))
            offset += n
        flats[(b["key"], b["dtype"], b["device"])] = views

    def build(node: Any) -> Any:
        if isinstance(node, _Ref):
            return flats[node.group][node.index]
        if isinstance(node, dict):
            return type(node)((k, build(v)) for k, v in node.items())
        if isinstance(node, (list, tuple)):
            return type(node)(build(v) for v in node)
        return node

    states = {name: build(sk) for name, sk in header["skeleton"].items()}
    return states, header["extra"], moved, time.perf_counter() - start


def load_state(objects: dict[str, Any], states: dict[str, Any]) -> None:
    """Load received states into the managed objects. Raises KeyError if the sets of objects differ."""
    if set(objects) != set(states):
        raise KeyError(f"managed objects differ: local {sorted(objects)}, received {sorted(states)}")
    for name, obj in objects.items():
        obj.load_state_dict(states[name])

"""State transfer: the leaver sends its joiner every tensor of the managed state, peer to peer, checksummed and
authenticated. The receiver executes nothing it receives: the header is data (JSON), never pickle.

Wire layout over a 2-rank process group (sender = rank 0, receiver = rank 1; gloo here, NCCL on GPU clusters):
1. ``int64[1]`` (tag 0): the length in bytes of message 2 (at most ``MAC_BYTES + MAX_HEADER_BYTES``);
2. ``uint8[len]`` (tag 1): the header's HMAC-SHA256 with the job secret (32 bytes,
   tmd.protocol.keys.JobKeys.mac), then the header: ASCII JSON ``{"format": 2, "skeleton": {object name: value},
   "extra": value, "buffers": [{"key", "dtype", "device", "numel", "shapes"}], "data": {"chunk": bytes, "shm":
   offer or null}}``;
3. the bytes of one flat buffer per (object, dtype, device) (the tensors of that object and dtype, back to back),
   in chunks of ``chunk`` bytes, over the group or, when the header offers a shared-memory ring and the receiver
   is on the same host, through it (worker.datapath: the chunk messages, the ring and its control messages);
4. ``uint8[MAC_BYTES + 4 * buffers]`` (tag 1): the trailer: HMAC-SHA256 of ``b"trailer"`` + the header's MAC +
   the CRC32s, then each buffer's CRC32 (little-endian uint32) of the bytes the sender sent. The receiver posts
   its receive for it before the data, the sender sends it as soon as its last chunk left (on the shared-memory
   path: once the ring was filled, while the receiver still empties it), so no round trip follows the data.

The sender does not wait for its header to arrive: it readies its data path (and starts filling the ring) while
the receiver parses the header.

**Sharded state.** A DTensor (FSDP2 and tensor-parallel parameters, their optimizer state) travels as its local
shard only: the sender takes its local shard (worker.dtensor, no collective) and its skeleton entry is ``{"s": {"r": [buffer,
index], "shape": global shape, "placements": ["S(0)", "R", ...] (``str`` of each placement), "mesh": mesh
shape}}``; the receiver hands it back as a :class:`ReceivedShard`. :func:`load_state` wraps each received shard
into a DTensor on the joiner's own mesh and placements (those of the DTensor the joiner holds at the same key, or
for optimizer state not created yet, those of the parameter it belongs to) with ``DTensor.from_local``, after
checking that global shape, placements, mesh shape and local shape all match. Nothing in send, receive or load
issues a collective: the 2-rank transfer group is the only thing that talks, so the leaver and joiner move state
while the other ranks train (a pre-copy) or wait at their switch step.

A value is encoded by :func:`encode` (a small tagged encoding that round-trips exactly what state_dicts and the
callers' ``extra`` hold: None, bool, int, float with inf/nan, str, bytes, dict / OrderedDict / Counter with any
such keys, list, tuple, tensors) and nothing else. A tensor of a managed object is a reference into a flat buffer; a tensor
of ``extra`` (the RNG state) travels inline in the header. Dtypes come from a fixed list of torch dtype names;
devices are ``cpu`` or ``cuda[:i]``.

The receiver checks the MAC before it parses a byte of the header, then the header's structure (the shared-memory
offer included: only a regular file of this host with the offer's random nonce is ever mapped, see worker.shm),
every buffer's numel against the shapes it lists, every tensor reference of the skeleton against those shapes
(in the same single pass that builds the received states as views of the receive buffers: before any data over
the group; while the receiver waits for the sender's next chunk on the shared-memory path, so that it costs no
transfer time there), and once every buffer arrived the trailer's MAC (bound to this header's) and each buffer's
CRC32 against the trailer's, computed as the bytes arrived (so a forged buffer is refused too). The CRC32s travel
after the bytes so that checksumming overlaps the movement on both ends. Any failure raises :class:`TransferRefused` (a RuntimeError; a
checksum failure is its subclass :class:`ChecksumError`) and nothing is loaded anywhere. The job secret is read
from env ``TM_KEYS`` (worker.job_keys) unless keys are passed; without ``TM_KEYS`` (tmd without authentication)
the MAC is keyed with a public all-zero key: the header is then checked but not authenticated.

Packing per (object, dtype) keeps the message count small (a few chunks instead of one message per tensor) and
lets the joiner's optimizer keep views into its receive buffer (no second copy). The sender never concatenates the
whole state: chunks are read straight from its tensors (worker.datapath).
"""
from __future__ import annotations

import base64
import collections
import dataclasses
import hashlib
import hmac
import json
import math
import re
import struct
import time
from typing import Any, Callable, Optional

import torch

from tmd.protocol.keys import JobKeys
from worker import datapath, job_keys
from worker.dtensor import DTensor, dtensor_layout, is_dtensor, local_shard

FORMAT = 2  # the header's format version (2: chunked buffers, their CRC32s in the trailer)
MAC_BYTES = 32  # HMAC-SHA256
MAX_HEADER_BYTES = 64 * 1024 * 1024  # the header's bound (bytes); a real one is ~kB to a few MB
MAX_DEPTH = 64  # nesting bound of a header value (a state_dict is ~4 deep)
_UNAUTHENTICATED = b"\0" * 32  # the MAC key without job keys: public, so the header is checked, not authenticated

# The dtypes a tensor may have, by torch name (the ones this torch lacks are left out).
_DTYPE_NAMES = ("float64", "float32", "float16", "bfloat16", "complex128", "complex64", "int64", "int32", "int16",
                "int8", "uint64", "uint32", "uint16", "uint8", "bool", "float8_e4m3fn", "float8_e5m2",
                "float8_e4m3fnuz", "float8_e5m2fnuz")
DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in _DTYPE_NAMES
                                  if isinstance(getattr(torch, name, None), torch.dtype)}
_DEVICE = re.compile(r"cpu|cuda(:[0-9]{1,4})?")
_BUFFER_FIELDS = {"key", "dtype", "device", "numel", "shapes"}
_HEADER_FIELDS = {"format", "skeleton", "extra", "buffers", "data"}
_SHARD_FIELDS = {"r", "shape", "placements", "mesh"}
MAPPINGS = (dict, collections.OrderedDict, collections.Counter)  # the mapping types a state keeps as they are
MAX_PLACEMENT_CHARS = 64  # bound of one placement's name in a shard entry (``_S(0, 2)`` is 8)


class TransferRefused(RuntimeError):
    """A received state was refused: its header is not authenticated by the job secret, malformed, out of
    bounds, or a buffer failed its checksum. Nothing was loaded."""


class ChecksumError(TransferRefused):
    """A received buffer's CRC32 differs from the sender's: the state is refused."""


@dataclasses.dataclass(frozen=True)
class ReceivedShard:
    """The local shard of a DTensor as received: ``local`` (a plain tensor of the sender's local shape), the
    DTensor's global ``shape``, its ``placements`` (``str`` of each: ``S(0)``, ``R``, ``P(sum)``, ``_S(0, 2)``)
    and its ``mesh`` shape. :func:`load_state` turns it back into a DTensor on the joiner's own mesh."""
    local: torch.Tensor
    shape: tuple[int, ...]
    placements: tuple[str, ...]
    mesh: tuple[int, ...]

    def describe(self) -> str:
        """``global [16, 8] as ['S(0)'] on mesh [4], local [4, 8]``"""
        return _describe(self.shape, self.placements, self.mesh, self.local.shape)


def _describe(shape, placements, mesh, local_shape) -> str:
    return f"global {list(shape)} as {list(placements)} on mesh {list(mesh)}, local {list(local_shape)}"


def crc32(t: torch.Tensor) -> int:
    """CRC32 of a tensor's bytes (worker.datapath.crc32). CUDA tensors are copied to host first."""
    return datapath.crc32(t)


# --- the value encoding ------------------------------------------------------------------------------------------
def dtype_name(dtype: torch.dtype) -> str:
    """``dtype``'s name on the wire (``float32``). Raises TypeError for a dtype that cannot be sent."""
    name = _DTYPE_NAMES_BY_DTYPE.get(dtype)
    if name is None:
        raise TypeError(f"tensors of dtype {dtype} cannot be sent")
    return name


_DTYPE_NAMES_BY_DTYPE = {dtype: name for name, dtype in DTYPES.items()}


def _device_name(device: torch.device) -> str:
    name = _DEVICE_NAMES.get(device)
    if name is None:
        name = str(device)
        if not _DEVICE.fullmatch(name):
            raise TypeError(f"tensors on device {name} cannot be sent (only cpu and cuda)")
        _DEVICE_NAMES[device] = name
    return name


_DEVICE_NAMES: dict[torch.device, str] = {}


def encode(value: Any, tensor: Callable[[torch.Tensor], Any], depth: int = 0) -> Any:
    """``value`` as JSON-ready data: None, bool, int, str and finite floats as themselves; every other value as a
    one-key tagged object: ``{"f": IEEE-754 bits as hex}`` (inf, nan), ``{"b": base64}`` (bytes), ``{"d":
    [[key, value], ...]}`` (dict), ``{"o": [[key, value], ...], "m": metadata}`` (OrderedDict, with its
    ``_metadata`` as state_dicts carry it), ``{"c": [[key, value], ...]}`` (collections.Counter: MultiStepLR's
    ``milestones``), ``{"l": [...]}`` (list), ``{"t": [...]}`` (tuple); a tensor is what ``tensor(t)`` returns.
    Raises TypeError for any other type (subclasses included, but for tensors)."""
    if depth > MAX_DEPTH:
        raise TypeError(f"state nested deeper than {MAX_DEPTH} levels cannot be sent")
    kind = type(value)
    if value is None or kind in (bool, int, str):
        return value
    if kind is float:
        return value if math.isfinite(value) else {"f": struct.pack(">d", value).hex()}
    if isinstance(value, torch.Tensor) or kind is ReceivedShard:  # a received shard is sent on as it came
        return tensor(value)
    if kind is bytes:
        return {"b": base64.b64encode(value).decode("ascii")}
    if kind in (list, tuple):
        return {"l" if kind is list else "t": [encode(v, tensor, depth + 1) for v in value]}
    if kind in (dict, collections.OrderedDict, collections.Counter):
        items = [[encode(k, tensor, depth + 1), encode(v, tensor, depth + 1)] for k, v in value.items()]
        if kind is not collections.OrderedDict:
            return {"d" if kind is dict else "c": items}
        out: dict[str, Any] = {"o": items}
        metadata = getattr(value, "_metadata", None)
        if metadata is not None:
            out["m"] = encode(metadata, tensor, depth + 1)
        return out
    raise TypeError(f"a value of type {kind.__module__}.{kind.__qualname__} cannot be sent in a state "
                    "(only None, bool, int, float, str, bytes, dict, OrderedDict, Counter, list, tuple and tensors)")


def decode(node: Any, tensor: Callable[[str, Any], torch.Tensor], depth: int = 0) -> Any:
    """The value :func:`encode` made ``node`` from. ``tensor(tag, payload)`` builds a tensor from a tagged object
    whose tag is not one of encode's own (it raises TransferRefused for a tag it does not take). Raises
    TransferRefused for anything encode does not produce."""
    if depth > MAX_DEPTH:
        raise TransferRefused(f"header value nested deeper than {MAX_DEPTH} levels")
    if node is None or type(node) in (bool, int, str, float):
        return node
    if type(node) is not dict or not node or len(node) > 2 or (len(node) == 2 and set(node) != {"o", "m"}):
        raise TransferRefused(f"header holds a value encode never makes: {_short(node)}")
    tag = "o" if "o" in node else next(iter(node))
    payload = node[tag]
    if tag == "f":
        if type(payload) is not str or not re.fullmatch(r"[0-9a-f]{16}", payload):
            raise TransferRefused(f"bad float in header: {_short(payload)}")
        return struct.unpack(">d", bytes.fromhex(payload))[0]
    if tag == "b":
        if type(payload) is not str:
            raise TransferRefused(f"bad bytes in header: {_short(payload)}")
        try:
            return base64.b64decode(payload, validate=True)
        except ValueError as e:
            raise TransferRefused(f"bad bytes in header: {e}") from None
    if tag in ("l", "t"):
        if type(payload) is not list:
            raise TransferRefused(f"bad sequence in header: {_short(payload)}")
        items = [decode(v, tensor, depth + 1) for v in payload]
        return items if tag == "l" else tuple(items)
    if tag in ("d", "o", "c"):
        if type(payload) is not list:
            raise TransferRefused(f"bad mapping in header: {_short(payload)}")
        out: dict = {} if tag == "d" else collections.OrderedDict() if tag == "o" else collections.Counter()
        for item in payload:
            if type(item) is not list or len(item) != 2:
                raise TransferRefused(f"bad mapping item in header: {_short(item)}")
            key = decode(item[0], _no_tensor, depth + 1)
            try:
                hash(key)
            except TypeError:  # an unhashable key (a list): encode never makes one
                raise TransferRefused(f"bad mapping key in header: {_short(item[0])}") from None
            out[key] = decode(item[1], tensor, depth + 1)
        if "m" in node:
            out._metadata = decode(node["m"], _no_tensor, depth + 1)  # type: ignore[attr-defined]
        return out
    return tensor(tag, payload)


def _no_tensor(tag: str, payload: Any) -> torch.Tensor:
    raise TransferRefused(f"unknown value tag {_short(tag)} in header")


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


def _inline(t: torch.Tensor) -> dict:
    """A tensor of ``extra`` (the RNG state: a few kB) carried inside the header. Raises TypeError for a DTensor
    (sharded state belongs in a managed object)."""
    if is_dtensor(t):
        raise TypeError("a DTensor cannot be sent in a transfer's extra values (manage its object instead)")
    data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return {"T": {"dtype": dtype_name(t.dtype), "device": _device_name(t.device), "shape": list(t.shape),
                  "data": base64.b64encode(data).decode("ascii")}}


def _from_inline(tag: str, payload: Any, wire: torch.device) -> torch.Tensor:
    if tag != "T":
        raise TransferRefused(f"unknown value tag {_short(tag)} in the header's extra")
    if type(payload) is not dict or set(payload) != {"dtype", "device", "shape", "data"}:
        raise TransferRefused(f"bad inline tensor in header: {_short(payload)}")
    dtype, device = _wire_dtype(payload["dtype"]), _check_device(payload["device"])
    shape = _check_shape(payload["shape"])
    if type(payload["data"]) is not str:
        raise TransferRefused("bad inline tensor data in header")
    try:
        raw = bytearray(base64.b64decode(payload["data"], validate=True))
    except ValueError as e:
        raise TransferRefused(f"bad inline tensor data in header: {e}") from None
    itemsize = torch.empty((), dtype=dtype).element_size()
    if len(raw) != math.prod(shape) * itemsize:
        raise TransferRefused(f"inline tensor of shape {shape} and dtype {payload['dtype']} carries {len(raw)} "
                              "bytes")
    flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    t = flat.view(dtype).reshape(shape)
    return t if device == "cpu" else t.to(wire)


def _wire_dtype(name: Any) -> torch.dtype:
    if type(name) is not str or name not in DTYPES:
        raise TransferRefused(f"unknown dtype {_short(name)} in header")
    return DTYPES[name]


def _check_device(name: Any) -> str:
    if type(name) is not str or not _DEVICE.fullmatch(name):
        raise TransferRefused(f"bad device {_short(name)} in header")
    return name


def _check_shape(shape: Any) -> list[int]:
    if type(shape) is not list or len(shape) > MAX_DEPTH or not all(type(d) is int and d >= 0 for d in shape):
        raise TransferRefused(f"bad shape {_short(shape)} in header")
    return shape


# --- layout -----------------------------------------------------------------------------------------------------
def _layout(objects: dict[str, Any]) -> tuple[dict, list[tuple[str, str, str]], list[list[torch.Tensor]]]:
    """The encoded skeleton of ``objects``' state_dicts (tensors as ``{"r": [buffer, index]}``, DTensors as their
    local shard's reference with their layout, ``{"s": {"r", "shape", "placements", "mesh"}}``), the flat
    buffers' (object name, dtype name, device) in order, and each buffer's tensors (local shards for DTensors)."""
    groups: dict[tuple[str, str, str], int] = {}
    order: list[tuple[str, str, str]] = []
    tensors: list[list[torch.Tensor]] = []
    skeleton = {}
    for name, obj in objects.items():
        def ref(t: torch.Tensor, name: str = name) -> dict:
            layout = None
            if is_dtensor(t):
                layout = dtensor_layout(t)
                t = local_shard(t)
            elif isinstance(t, ReceivedShard):  # a buddy snapshot's shard, kept as received (worker.snapshot)
                layout = (t.shape, t.placements, t.mesh)
                t = t.local
            gkey = (name, dtype_name(t.dtype), _device_name(t.device))
            if gkey not in groups:
                groups[gkey] = len(order)
                order.append(gkey)
                tensors.append([])
            g = groups[gkey]
            tensors[g].append(t.detach())
            r = [g, len(tensors[g]) - 1]
            if layout is None:
                return {"r": r}
            shape, placements, mesh = layout
            return {"s": {"r": r, "shape": list(shape), "placements": list(placements), "mesh": list(mesh)}}

        skeleton[name] = encode(obj.state_dict(), ref)
    return skeleton, order, tensors


def plan_buffers(objects: dict[str, Any]) -> list[dict]:
    """The flat buffers a transfer of ``objects`` needs: [{"key", "dtype" (torch.dtype), "numel", "device"}].
    Raises TypeError for a state that cannot be sent (see :func:`encode`)."""
    _, order, tensors = _layout(objects)
    return [{"key": k[0], "dtype": DTYPES[k[1]], "device": k[2], "numel": sum(t.numel() for t in ts)}
            for k, ts in zip(order, tensors)]


def pretouch(plan: list[dict]) -> list[torch.Tensor]:
    """Allocate and touch receive buffers for ``plan`` so page faults happen before the switch step."""
    return [torch.zeros(b["numel"], dtype=b["dtype"], device=b["device"]) for b in plan]


def _wire_device(pg) -> torch.device:
    """Where this group's tensors must live: the current CUDA device for NCCL, the CPU for gloo."""
    return torch.device("cuda", torch.cuda.current_device()) if pg.name() == "nccl" else torch.device("cpu")


def _mac_key(keys: Optional[JobKeys]) -> Optional[JobKeys]:
    return keys if keys is not None else job_keys.current()


def _mac(keys: Optional[JobKeys], data: bytes) -> bytes:
    return keys.mac(data) if keys is not None else hmac.new(_UNAUTHENTICATED, data, hashlib.sha256).digest()


# --- the two ends -----------------------------------------------------------------------------------------------
def send_state(pg, objects: dict[str, Any], extra: dict, dst: int = 1,
               keys: Optional[JobKeys] = None, on_packed: Optional[Callable[[], None]] = None) -> tuple[int, float]:
    """Send ``objects``' state_dicts and ``extra`` (any value :func:`encode` takes; its tensors travel inline) to
    rank ``dst`` of ``pg``. ``keys``: the job's keys whose secret authenticates the header (default: env
    ``TM_KEYS``, see worker.job_keys). ``on_packed()`` is called once the objects' tensors are no longer read
    (copied into the send buffers, or sent): from then on the caller may change them (worker.precopy sends a
    live state this way).

    Returns (bytes_moved, seconds). Raises TypeError for a state that cannot be sent (nothing is sent then),
    TransferRefused for a header over ``MAX_HEADER_BYTES``, KeysUnavailable when ``TM_KEYS`` cannot be read,
    RuntimeError if the peer dies mid-transfer (gloo reports the closed socket); the caller's own state is
    untouched either way.
    """
    start = time.perf_counter()
    keys = _mac_key(keys)
    skeleton, order, tensors = _layout(objects)
    buffers = [{"key": k[0], "dtype": k[1], "device": k[2], "numel": sum(t.numel() for t in ts),
                "shapes": [list(t.shape) for t in ts]} for k, ts in zip(order, tensors)]
    if on_packed is not None:  # the caller changes its tensors once on_packed returns: send a packed copy
        tensors = [[torch.cat([t.reshape(-1) for t in ts]) if len(ts) > 1 else ts[0].reshape(-1).clone()]
                   if ts else ts for ts in tensors]
    encoded_extra = encode(extra, _inline)  # TypeError here: nothing made, nothing sent
    wire = _wire_device(pg)
    sizes = [b["numel"] * DTYPES[b["dtype"]].itemsize for b in buffers]
    chunk, segment, offer = datapath.offer_ring(sizes, wire, [k[2] for k in order], group=pg)
    chunks = datapath.plan(sizes, chunk)
    ok = False
    try:
        header = json.dumps({
            "format": FORMAT,
            "skeleton": skeleton,
            "extra": encoded_extra,
            "buffers": buffers,
            "data": {"chunk": chunk, "shm": offer},
        }, separators=(",", ":"), allow_nan=False).encode("ascii")
        if len(header) > MAX_HEADER_BYTES:
            raise TransferRefused(f"state header of {len(header)} bytes exceeds {MAX_HEADER_BYTES} bytes")
        if on_packed is not None:
            on_packed()
        mac = _mac(keys, header)
        head = torch.frombuffer(bytearray(mac + header), dtype=torch.uint8).to(wire)
        length = torch.tensor([head.numel()], dtype=torch.int64, device=wire)
        # Not waited for here: the receiver parses the header while this side readies the data path.
        head_sent = [pg.send([length], dst, 0), pg.send([head], dst, 1)]
        sources = [datapath.Source(ts) for ts in tensors]
        tail: list = []  # the trailer's bytes and its send

        def send_trailer(crcs: list[int]) -> None:  # the receiver posted its receive for it before the data
            data = _trailer(keys, mac, crcs)
            tail.extend((data, pg.send([torch.frombuffer(bytearray(data), dtype=torch.uint8).to(wire)], dst, 1)))

        crcs = None
        if segment is not None:  # the trailer goes out once the ring was filled, while the receiver empties it
            crcs = datapath.send_shm(pg, dst, segment, sources, chunks, on_filled=send_trailer)
        if crcs is None:  # no ring offered, or the receiver did not take it
            send_trailer(datapath.send_wire(pg, dst, sources, chunks, wire))
        for work in head_sent + tail[1:]:
            work.wait()
        ok = True
    finally:  # the ring is kept for this group's next message, unless this one failed
        datapath.done_sending(pg, segment, ok)
    return head.numel() + 8 + datapath.nbytes_of(chunks) + len(tail[0]), time.perf_counter() - start


def _trailer(keys: Optional[JobKeys], header_mac: bytes, crcs: list[int]) -> bytes:
    """The trailer (see the module docstring): the MAC of ``b"trailer" + header_mac + crcs``, then the crcs as
    little-endian uint32 each."""
    body = struct.pack(f"<{len(crcs)}I", *crcs)
    return _mac(keys, b"trailer" + header_mac + body) + body


def _parse_header(message: bytes, keys: Optional[JobKeys]) -> dict:
    """The header in ``message`` (MAC, then JSON), checked: authenticated first, then its structure and bounds.
    Raises TransferRefused."""
    mac, header = message[:MAC_BYTES], message[MAC_BYTES:]
    if not hmac.compare_digest(_mac(keys, header), mac):
        raise TransferRefused("state header refused: its MAC does not match this job's secret (a peer outside "
                              "the job, or a corrupted header)")
    try:
        parsed = json.loads(header.decode("ascii"), parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise TransferRefused(f"state header is not valid JSON: {_short(str(e))}") from None
    if type(parsed) is not dict or set(parsed) != _HEADER_FIELDS or parsed["format"] != FORMAT:
        raise TransferRefused(f"state header has an unknown layout: {_short(parsed)}")
    if type(parsed["skeleton"]) is not dict or type(parsed["buffers"]) is not list:
        raise TransferRefused("state header has an unknown layout")
    data = parsed["data"]
    if type(data) is not dict or set(data) != {"chunk", "shm"} or type(data["chunk"]) is not int \
            or not datapath.MIN_CHUNK_BYTES <= data["chunk"] <= datapath.MAX_CHUNK_BYTES:
        raise TransferRefused(f"bad data entry {_short(data)} in state header")
    groups = set()
    for b in parsed["buffers"]:
        if type(b) is not dict or set(b) != _BUFFER_FIELDS or type(b["key"]) is not str:
            raise TransferRefused(f"bad buffer entry in state header: {_short(b)}")
        b["dtype"] = _wire_dtype(b["dtype"])
        _check_device(b["device"])
        if type(b["numel"]) is not int or b["numel"] < 0 or type(b["shapes"]) is not list:
            raise TransferRefused(f"bad buffer entry in state header: {_short(b)}")
        b["shapes"] = [_check_shape(s) for s in b["shapes"]]
        total = sum(math.prod(s) for s in b["shapes"])
        if total != b["numel"]:
            raise TransferRefused(f"buffer {b['key']}/{b['dtype']}: numel {b['numel']} differs from its shapes' "
                                  f"{total}")
        group = (b["key"], b["dtype"], b["device"])
        if group in groups:
            raise TransferRefused(f"buffer {group} listed twice in state header")
        groups.add(group)
    return parsed


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def recv_state(pg, src: int = 0, buffers: Optional[list[torch.Tensor]] = None,
               keys: Optional[JobKeys] = None) -> tuple[dict, dict, int, float]:
    """Receive what :func:`send_state` sent. ``buffers``: pre-touched receive buffers (used where dtype and size
    match). ``keys``: the job's keys (default: env ``TM_KEYS``, see worker.job_keys). Returns (states by object
    name, extra, bytes_moved, seconds); a sender's DTensor is a :class:`ReceivedShard` in the states (load them
    with :func:`load_state`, which makes DTensors of them again). Raises TransferRefused for a header that is not
    authenticated, malformed or out of bounds, ChecksumError (a TransferRefused) on a corrupt buffer,
    KeysUnavailable when ``TM_KEYS`` cannot be read, RuntimeError if the peer dies mid-transfer; nothing is loaded
    anywhere in any case."""
    keys = _mac_key(keys)
    wire = _wire_device(pg)
    length = torch.zeros(1, dtype=torch.int64, device=wire)
    pg.recv([length], src, 0).wait()  # waits for the sender to reach its switch step: not transfer time
    start = time.perf_counter()
    n = int(length.item())
    if not MAC_BYTES < n <= MAC_BYTES + MAX_HEADER_BYTES:
        raise TransferRefused(f"state header of {n - MAC_BYTES} bytes refused (at most {MAX_HEADER_BYTES})")
    head = torch.empty(n, dtype=torch.uint8, device=wire)
    pg.recv([head], src, 1).wait()
    message = head.cpu().numpy().tobytes()
    header = _parse_header(message, keys)
    sizes, chunk = [b["numel"] * b["dtype"].itemsize for b in header["buffers"]], header["data"]["chunk"]
    if sum(-(-n // chunk) for n in sizes) > datapath.MAX_CHUNKS:  # before planning them: bounded work
        raise TransferRefused(f"state of {sum(sizes)} bytes in chunks of {chunk} bytes refused "
                              f"(more than {datapath.MAX_CHUNKS} chunks)")
    chunks = datapath.plan(sizes, chunk)
    if not datapath.check_offer(header["data"]["shm"], chunks):
        raise TransferRefused(f"bad shared-memory offer {_short(header['data']['shm'])} in state header")
    shapes = [b["shapes"] for b in header["buffers"]]
    pool = list(buffers or [])
    received = []
    for b in header["buffers"]:
        # the sender's cuda:<i> is this process's own CUDA device; CPU state stays on the CPU
        device = torch.device("cpu") if b["device"] == "cpu" else wire
        at = next((j for j, t in enumerate(pool) if t.dtype == b["dtype"] and t.numel() == b["numel"]
                   and t.device == device), None)
        if at is not None:
            flat = pool.pop(at)  # by position: list.remove would compare tensors elementwise
        else:
            flat = torch.empty(b["numel"], dtype=b["dtype"], device=device)
        received.append((b, flat))
    views: list[list[torch.Tensor]] = [[] for _ in received]
    states: dict[str, Any] = {}

    def ref(tag: str, payload: Any) -> Any:
        buffer, index = _reference(tag, payload, shapes)
        if tag == "r":
            return views[buffer][index]
        return ReceivedShard(views[buffer][index], tuple(payload["shape"]), tuple(payload["placements"]),
                             tuple(payload["mesh"]))

    def build():
        """Each tensor's view of its buffer (the bytes fill them later), then the states: one decode pass that
        also checks every value (tensor references against the listed shapes). A step per buffer and per object,
        so that the shared-memory path runs them while it waits for the sender."""
        for i, (b, flat) in enumerate(received):
            views[i] = _views(flat, b["shapes"])
            yield
        for name, node in header["skeleton"].items():
            states[name] = decode(node, ref)
            yield

    extra = decode(header["extra"], lambda tag, payload: _from_inline(tag, payload, wire))
    steps = build()
    tail = torch.empty(MAC_BYTES + 4 * len(received), dtype=torch.uint8, device=wire)
    dests = [datapath.as_bytes(flat) for _, flat in received]
    segment = datapath.accept(pg, src, header["data"]["shm"])
    ok = False
    try:
        try:
            if segment is None:  # over the group: a malformed header is refused before a byte of data arrives
                collections.deque(steps, maxlen=0)
            # the trailer's receive, posted before the data: the sender sends it once the last chunk is on its way
            tail_received = pg.recv([tail], src, 1)
            if segment is not None:  # the states are built while the receiver waits on the ring
                crcs = datapath.recv_shm(pg, src, segment, dests, chunks, idle=steps)
            else:
                crcs = datapath.recv_wire(pg, src, dests, chunks)
        except ValueError as e:
            raise TransferRefused(f"state refused: {e}") from None
        tail_received.wait()
        moved = head.numel() + 8 + datapath.nbytes_of(chunks) + tail.numel()
        # Verify only once everything arrived, so the sender is never left blocked in a send nobody receives.
        tail_bytes = tail.cpu().numpy().tobytes()
        body = tail_bytes[MAC_BYTES:]
        if not hmac.compare_digest(_mac(keys, b"trailer" + message[:MAC_BYTES] + body), tail_bytes[:MAC_BYTES]):
            raise TransferRefused("state trailer refused: its MAC does not match this job's secret and this "
                                  "header")
        for (b, _), got, sent in zip(received, crcs, struct.unpack(f"<{len(received)}I", body)):
            if got != sent:
                raise ChecksumError(f"state buffer {b['key']}/{b['dtype']} failed its checksum "
                                    f"(crc32 {got:#010x}, sender {sent:#010x}); state refused")
        ok = True
    finally:  # the mapping is kept for this group's next message, unless this one failed or was refused
        datapath.done_receiving(pg, segment, ok)
    return states, extra, moved, time.perf_counter() - start


def _views(flat: torch.Tensor, shapes: list[list[int]]) -> list[torch.Tensor]:
    """The tensors of ``shapes`` (each of its listed numel), back to back in the flat buffer ``flat``, as views."""
    counts = [math.prod(shape) for shape in shapes]
    parts = flat[:sum(counts)].split(counts) if counts else ()
    return [part.view(shape) for part, shape in zip(parts, shapes)]


def _reference(tag: str, payload: Any, shapes: list[list]) -> tuple[int, int]:
    """The (buffer, index) a skeleton's tensor reference names, checked against the header's ``shapes`` (per
    buffer): ``{"r": [buffer, index]}``, or a shard's ``{"s": {"r": [buffer, index], "shape", "placements",
    "mesh"}}`` (its global shape of the local shape's rank, never smaller than the local one). Raises
    TransferRefused."""
    if tag == "s":
        if type(payload) is not dict or set(payload) != _SHARD_FIELDS:
            raise TransferRefused(f"bad shard reference {_short({tag: payload})} in state header")
        buffer, index = _reference("r", payload["r"], shapes)
        shape, mesh = _check_shape(payload["shape"]), _check_shape(payload["mesh"])
        placements = payload["placements"]
        if type(placements) is not list or len(placements) != len(mesh) \
                or not all(type(p) is str and 0 < len(p) <= MAX_PLACEMENT_CHARS for p in placements):
            raise TransferRefused(f"bad shard placements {_short(placements)} in state header")
        local = shapes[buffer][index]
        if len(local) != len(shape) or any(n > g for n, g in zip(local, shape)):
            raise TransferRefused(f"shard of local shape {local} does not fit its global shape {shape}")
        return buffer, index
    if tag != "r" or type(payload) is not list or len(payload) != 2 \
            or not all(type(i) is int and i >= 0 for i in payload) \
            or payload[0] >= len(shapes) or payload[1] >= len(shapes[payload[0]]):
        raise TransferRefused(f"bad tensor reference {_short({tag: payload})} in state header")
    return payload[0], payload[1]


def load_state(objects: dict[str, Any], states: dict[str, Any]) -> None:
    """Load received states (:func:`recv_state`) into the managed objects: every :class:`ReceivedShard` becomes a
    DTensor on this rank's own mesh and placements first (see :func:`place_shards`), then each object's
    ``load_state_dict``. Everything is checked before the first object is loaded: raises KeyError if the sets of
    objects differ or a module's state_dict keys differ, TransferRefused (naming the object and key) where a
    shard does not match this rank's DTensor or an optimizer's parameter groups differ; nothing is loaded then.
    Issues no collective."""
    if set(objects) != set(states):
        raise KeyError(f"managed objects differ: local {sorted(objects)}, received {sorted(states)}")
    placed = {name: place_shards(name, obj, states[name]) for name, obj in objects.items()}
    for name, obj in objects.items():
        obj.load_state_dict(placed[name])


def place_shards(name: str, obj: Any, state: Any) -> Any:
    """``state`` (received for the managed object ``name``) with every :class:`ReceivedShard` wrapped into a DTensor
    like the one ``obj`` holds at the same key (``DTensor.from_local`` with this rank's mesh, placements, global
    shape and stride; the local shard is moved to that DTensor's device if it arrived elsewhere). An optimizer's
    state not created yet on this rank takes the layout of the parameter it belongs to. Also checks a module's
    state_dict keys and an optimizer's parameter groups against ``obj``'s own. Raises KeyError / TransferRefused
    (see :func:`load_state`); issues no collective and changes nothing in ``obj``."""
    own = obj.state_dict()
    params: list = []
    if isinstance(obj, torch.nn.Module) and isinstance(state, dict):
        missing, unexpected = set(own) - set(state), set(state) - set(own)
        if missing or unexpected:
            raise KeyError(f"{name}: state_dict keys differ between leaver and joiner: only the leaver's has "
                           f"{_keys(unexpected)}, only the joiner's has {_keys(missing)}")
    if isinstance(obj, torch.optim.Optimizer) and isinstance(state, dict):
        groups = state.get("param_groups")
        sizes = [len(g["params"]) for g in obj.param_groups]
        theirs = [len(g.get("params", ())) if isinstance(g, dict) else -1 for g in groups] \
            if isinstance(groups, list) else None
        if theirs != sizes:
            raise TransferRefused(f"{name}: optimizer parameter groups differ between leaver (sizes {theirs}) and "
                                  f"joiner (sizes {sizes})")
        params = [p for g in obj.param_groups for p in g["params"]]
    return _place(state, own, (), name, params)


def _keys(keys: set) -> str:
    shown = sorted(map(str, keys))
    return "[" + ", ".join(shown[:5]) + (f" and {len(shown) - 5} more" if len(shown) > 5 else "") + "]"


def _place(node: Any, own: Any, path: tuple, name: str, params: list) -> Any:
    if isinstance(node, ReceivedShard):
        return _wrap(node, _template(own, path, params), path, name)
    if is_dtensor(node):  # a DTensor of this rank's own (its snapshot, worker.snapshot): checked like a shard
        shape, placements, mesh = dtensor_layout(node)
        return _wrap(ReceivedShard(local_shard(node), shape, placements, mesh), _template(own, path, params),
                     path, name)
    if isinstance(node, torch.Tensor):
        if is_dtensor(own):
            mine = _describe(*dtensor_layout(own), local_shard(own).shape)
            raise TransferRefused(f"{name}: {_path(path)} arrived as a plain tensor of shape {list(node.shape)}, "
                                  f"this rank holds a DTensor ({mine}); state refused")
        return node
    if isinstance(node, dict):
        out = type(node)() if type(node) in MAPPINGS else {}
        for k, v in node.items():
            out[k] = _place(v, own.get(k) if isinstance(own, dict) else None, path + (k,), name, params)
        metadata = getattr(node, "_metadata", None)
        if metadata is not None:
            out._metadata = metadata  # type: ignore[attr-defined]
        return out
    if isinstance(node, (list, tuple)):
        items = [_place(v, own[i] if isinstance(own, (list, tuple)) and i < len(own) else None, path + (i,), name,
                        params) for i, v in enumerate(node)]
        return items if isinstance(node, list) else tuple(items)
    return node


def _template(own: Any, path: tuple, params: list) -> Any:
    """The DTensor whose mesh and placements a received shard at ``path`` takes: this rank's own value there, or
    for an optimizer's ``state/<index>/<key>`` the parameter ``index``; None when there is none."""
    if is_dtensor(own):
        return own
    if params and len(path) == 3 and path[0] == "state" and type(path[1]) is int and 0 <= path[1] < len(params) \
            and is_dtensor(params[path[1]]):
        return params[path[1]]
    return None


def _wrap(shard: ReceivedShard, template: Any, path: tuple, name: str) -> torch.Tensor:
    if template is None:
        raise TransferRefused(f"{name}: {_path(path)} arrived as a DTensor shard ({shard.describe()}) but this rank "
                              "holds no DTensor there to take its mesh and placements from")
    mine = local_shard(template)
    layout = dtensor_layout(template)
    if (shard.shape, shard.placements, shard.mesh, tuple(shard.local.shape)) != layout + (tuple(mine.shape),):
        raise TransferRefused(f"{name}: {_path(path)} differs between leaver ({shard.describe()}) and joiner "
                              f"({_describe(*layout, mine.shape)}); state refused")
    local = shard.local if shard.local.device == mine.device else shard.local.to(mine.device)
    return DTensor.from_local(local, template.device_mesh, template.placements, run_check=False,
                              shape=template.shape, stride=template.stride())


def _path(path: tuple) -> str:
    return "/".join(map(str, path)) or "its state"

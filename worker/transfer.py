"""State transfer: the leaver sends its joiner every tensor of the managed state, peer to peer, checksummed and
authenticated. The receiver executes nothing it receives: the header is data (JSON), never pickle.

Wire layout over a 2-rank process group (sender = rank 0, receiver = rank 1; gloo here, NCCL on GPU clusters):
1. ``int64[1]``: the length in bytes of message 2 (at most ``MAC_BYTES + MAX_HEADER_BYTES``);
2. ``uint8[len]``: the header's HMAC-SHA256 with the job secret (32 bytes, tmd.protocol.keys.JobKeys.mac), then
   the header: ASCII JSON ``{"format": 1, "skeleton": {object name: value}, "extra": value, "buffers": [{"key",
   "dtype", "device", "numel", "crc32", "shapes"}]}``;
3. one flat buffer per (object, dtype, device): the tensors of that object and dtype, concatenated.

A value is encoded by :func:`encode` (a small tagged encoding that round-trips exactly what state_dicts and the
callers' ``extra`` hold: None, bool, int, float with inf/nan, str, bytes, dict / OrderedDict with any such keys,
list, tuple, tensors) and nothing else. A tensor of a managed object is a reference into a flat buffer; a tensor
of ``extra`` (the RNG state) travels inline in the header. Dtypes come from a fixed list of torch dtype names;
devices are ``cpu`` or ``cuda[:i]``.

The receiver checks the MAC before it parses a byte of the header, then the header's structure, every buffer's
numel against the shapes it lists, and once every buffer arrived each buffer's CRC32 (listed in the MAC'd
header, so a forged buffer is refused too). Any failure raises :class:`TransferRefused` (a RuntimeError; a
checksum failure is its subclass :class:`ChecksumError`) and nothing is loaded anywhere. The job secret is read
from env ``TM_KEYS`` (worker.job_keys) unless keys are passed; without ``TM_KEYS`` (tmd without authentication)
the MAC is keyed with a public all-zero key: the header is then checked but not authenticated.

Packing per (object, dtype) keeps the message count small (a handful of sends instead of one per tensor) and
lets the joiner's optimizer keep views into its receive buffer (no second copy).
"""
from __future__ import annotations

import base64
import collections
import hashlib
import hmac
import json
import math
import re
import struct
import time
import zlib
from typing import Any, Callable, Optional

import torch

from tmd.protocol.keys import JobKeys
from worker import job_keys

FORMAT = 1  # the header's format version
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
_BUFFER_FIELDS = {"key", "dtype", "device", "numel", "crc32", "shapes"}
_HEADER_FIELDS = {"format", "skeleton", "extra", "buffers"}


class TransferRefused(RuntimeError):
    """A received state was refused: its header is not authenticated by the job secret, malformed, out of
    bounds, or a buffer failed its checksum. Nothing was loaded."""


class ChecksumError(TransferRefused):
    """A received buffer's CRC32 differs from the sender's: the state is refused."""


def crc32(t: torch.Tensor) -> int:
    """CRC32 of a tensor's bytes. CUDA tensors are copied to host first (a GPU hash would avoid the copy)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return zlib.crc32(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()))


# --- the value encoding ------------------------------------------------------------------------------------------
def dtype_name(dtype: torch.dtype) -> str:
    """``dtype``'s name on the wire (``float32``). Raises TypeError for a dtype that cannot be sent."""
    name = str(dtype).removeprefix("torch.")
    if DTYPES.get(name) != dtype:
        raise TypeError(f"tensors of dtype {dtype} cannot be sent")
    return name


def _device_name(device: torch.device) -> str:
    name = str(device)
    if not _DEVICE.fullmatch(name):
        raise TypeError(f"tensors on device {name} cannot be sent (only cpu and cuda)")
    return name


def encode(value: Any, tensor: Callable[[torch.Tensor], Any], depth: int = 0) -> Any:
    """``value`` as JSON-ready data: None, bool, int, str and finite floats as themselves; every other value as a
    one-key tagged object: ``{"f": IEEE-754 bits as hex}`` (inf, nan), ``{"b": base64}`` (bytes), ``{"d":
    [[key, value], ...]}`` (dict), ``{"o": [[key, value], ...], "m": metadata}`` (OrderedDict, with its
    ``_metadata`` as state_dicts carry it), ``{"l": [...]}`` (list), ``{"t": [...]}`` (tuple); a tensor is what
    ``tensor(t)`` returns. Raises TypeError for any other type (subclasses included, but for tensors)."""
    if depth > MAX_DEPTH:
        raise TypeError(f"state nested deeper than {MAX_DEPTH} levels cannot be sent")
    kind = type(value)
    if value is None or kind in (bool, int, str):
        return value
    if kind is float:
        return value if math.isfinite(value) else {"f": struct.pack(">d", value).hex()}
    if isinstance(value, torch.Tensor):
        return tensor(value)
    if kind is bytes:
        return {"b": base64.b64encode(value).decode("ascii")}
    if kind in (list, tuple):
        return {"l" if kind is list else "t": [encode(v, tensor, depth + 1) for v in value]}
    if kind in (dict, collections.OrderedDict):
        items = [[encode(k, tensor, depth + 1), encode(v, tensor, depth + 1)] for k, v in value.items()]
        if kind is dict:
            return {"d": items}
        out: dict[str, Any] = {"o": items}
        metadata = getattr(value, "_metadata", None)
        if metadata is not None:
            out["m"] = encode(metadata, tensor, depth + 1)
        return out
    raise TypeError(f"a value of type {kind.__module__}.{kind.__qualname__} cannot be sent in a state "
                    "(only None, bool, int, float, str, bytes, dict, OrderedDict, list, tuple and tensors)")


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
    if tag in ("d", "o"):
        if type(payload) is not list:
            raise TransferRefused(f"bad mapping in header: {_short(payload)}")
        out: dict = {} if tag == "d" else collections.OrderedDict()
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
    """A tensor of ``extra`` (the RNG state: a few kB) carried inside the header."""
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
    """The encoded skeleton of ``objects``' state_dicts (tensors as ``{"r": [buffer, index]}``), the flat buffers'
    (object name, dtype name, device) in order, and each buffer's tensors."""
    groups: dict[tuple[str, str, str], int] = {}
    order: list[tuple[str, str, str]] = []
    tensors: list[list[torch.Tensor]] = []
    skeleton = {}
    for name, obj in objects.items():
        def ref(t: torch.Tensor, name: str = name) -> dict:
            gkey = (name, dtype_name(t.dtype), _device_name(t.device))
            if gkey not in groups:
                groups[gkey] = len(order)
                order.append(gkey)
                tensors.append([])
            g = groups[gkey]
            tensors[g].append(t.detach())
            return {"r": [g, len(tensors[g]) - 1]}

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
               keys: Optional[JobKeys] = None) -> tuple[int, float]:
    """Send ``objects``' state_dicts and ``extra`` (any value :func:`encode` takes; its tensors travel inline) to
    rank ``dst`` of ``pg``. ``keys``: the job's keys whose secret authenticates the header (default: env
    ``TM_KEYS``, see worker.job_keys).

    Returns (bytes_moved, seconds). Raises TypeError for a state that cannot be sent (nothing is sent then),
    TransferRefused for a header over ``MAX_HEADER_BYTES``, KeysUnavailable when ``TM_KEYS`` cannot be read,
    RuntimeError if the peer dies mid-transfer (gloo reports the closed socket); the caller's own state is
    untouched either way.
    """
    start = time.perf_counter()
    keys = _mac_key(keys)
    skeleton, order, tensors = _layout(objects)
    flats = [torch.cat([t.reshape(-1) for t in ts]) if len(ts) > 1 else ts[0].reshape(-1).clone() for ts in tensors]
    header = json.dumps({
        "format": FORMAT,
        "skeleton": skeleton,
        "extra": encode(extra, _inline),
        "buffers": [{"key": k[0], "dtype": k[1], "device": k[2], "numel": f.numel(), "crc32": crc32(f),
                     "shapes": [list(t.shape) for t in ts]} for k, f, ts in zip(order, flats, tensors)],
    }, separators=(",", ":"), allow_nan=False).encode("ascii")
    if len(header) > MAX_HEADER_BYTES:
        raise TransferRefused(f"state header of {len(header)} bytes exceeds {MAX_HEADER_BYTES} bytes")
    wire = _wire_device(pg)
    head = torch.frombuffer(bytearray(_mac(keys, header) + header), dtype=torch.uint8).to(wire)
    pg.send([torch.tensor([head.numel()], dtype=torch.int64, device=wire)], dst, 0).wait()
    pg.send([head], dst, 1).wait()
    moved = head.numel() + 8
    for i, flat in enumerate(flats):
        pg.send([flat], dst, 2 + i).wait()
        moved += flat.numel() * flat.element_size()
    return moved, time.perf_counter() - start


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
    groups = set()
    for b in parsed["buffers"]:
        if type(b) is not dict or set(b) != _BUFFER_FIELDS or type(b["key"]) is not str:
            raise TransferRefused(f"bad buffer entry in state header: {_short(b)}")
        b["dtype"] = _wire_dtype(b["dtype"])
        _check_device(b["device"])
        if type(b["numel"]) is not int or b["numel"] < 0 or type(b["crc32"]) is not int \
                or not 0 <= b["crc32"] < 1 << 32 or type(b["shapes"]) is not list:
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
    name, extra, bytes_moved, seconds). Raises TransferRefused for a header that is not authenticated, malformed
    or out of bounds, ChecksumError (a TransferRefused) on a corrupt buffer, KeysUnavailable when ``TM_KEYS``
    cannot be read, RuntimeError if the peer dies mid-transfer; nothing is loaded anywhere in any case."""
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
    header = _parse_header(head.cpu().numpy().tobytes(), keys)
    shapes = [b["shapes"] for b in header["buffers"]]
    # Every value is checked before a buffer is received (tensor references against the listed shapes): a
    # malformed header is refused here, not after the receiver allocated and waited for its buffers.
    for node in header["skeleton"].values():
        decode(node, lambda tag, payload: _reference(tag, payload, shapes) and None)
    extra = decode(header["extra"], lambda tag, payload: _from_inline(tag, payload, wire))
    moved = head.numel() + 8
    pool = list(buffers or [])
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
    views: list[list[torch.Tensor]] = []
    for b, flat in received:
        got = crc32(flat)
        if got != b["crc32"]:
            raise ChecksumError(f"state buffer {b['key']}/{b['dtype']} failed its checksum "
                                f"(crc32 {got:#010x}, sender {b['crc32']:#010x}); state refused")
        parts, offset = [], 0
        for shape in b["shapes"]:
            count = math.prod(shape)
            parts.append(flat[offset:offset + count].view(shape))
            offset += count
        views.append(parts)

    def ref(tag: str, payload: Any) -> torch.Tensor:
        buffer, index = _reference(tag, payload, shapes)
        return views[buffer][index]

    states = {name: decode(node, ref) for name, node in header["skeleton"].items()}
    return states, extra, moved, time.perf_counter() - start


def _reference(tag: str, payload: Any, shapes: list[list]) -> tuple[int, int]:
    """The (buffer, index) a skeleton's tensor reference ``{"r": [buffer, index]}`` names, checked against the
    header's ``shapes`` (per buffer). Raises TransferRefused."""
    if tag != "r" or type(payload) is not list or len(payload) != 2 \
            or not all(type(i) is int and i >= 0 for i in payload) \
            or payload[0] >= len(shapes) or payload[1] >= len(shapes[payload[0]]):
        raise TransferRefused(f"bad tensor reference {_short({tag: payload})} in state header")
    return payload[0], payload[1]


def load_state(objects: dict[str, Any], states: dict[str, Any]) -> None:
    """Load received states into the managed objects. Raises KeyError if the sets of objects differ."""
    if set(objects) != set(states):
        raise KeyError(f"managed objects differ: local {sorted(objects)}, received {sorted(states)}")
    for name, obj in objects.items():
        obj.load_state_dict(states[name])

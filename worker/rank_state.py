"""Each rank's own state, kept by every rank, and a fingerprint of the replicated state.

**Rank state**: what differs between data-parallel replicas and cannot come from a replica after a failure: the
CPU RNG state, the CUDA RNG states (where CUDA is initialised) and the ``state_dict`` of every ``rank_local=True``
managed object. :func:`serialize` writes it with ``torch.save`` into bytes; :func:`deserialize` reads bytes back
only with ``torch.load(weights_only=True)`` (tensors, plain containers and numbers; never a plain pickle of
received bytes), so rank-local objects must have plain-data state_dicts.

**Fingerprint** (:func:`fingerprint`): sha256 over every tensor of the replicated managed state (dtype, shape and a
fixed strided sample of at most :data:`SAMPLE` elements), the non-tensor leaves (an optimizer's step count,
hyper-parameters) and the parameters of the managed optimizers (so a model left unmanaged is still covered). Equal
replicas give equal fingerprints; one flipped sampled element changes it. 32 bytes. A DTensor (FSDP2, tensor
parallel) enters as its local shard, tagged with its global shape, placements and mesh shape: the fingerprint issues
no collective, and ranks holding the same shard of the same layout (replicas along a replicated mesh dimension) get
equal fingerprints.

**Exchange** (:func:`all_gather_bytes`): every rank's bytes to every rank, over a process group, as two small
collectives: the sizes (``int64[1]`` each), then the payloads padded to the largest (``uint8``). Through the mover
a failure latches like any other collective. Each rank keeps every rank's payload of its latest committed step:
``world_size`` x (a few KB) of host memory.
"""
from __future__ import annotations

import copy
import hashlib
import io
from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist

from worker.backend import inner_kind
from worker import transfer
from worker.dtensor import dtensor_layout, is_dtensor, local_shard

SAMPLE = 64  # at most this many elements of each tensor enter the fingerprint
FINGERPRINT_BYTES = 32


def rng_states() -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The CPU RNG state (uint8 tensor) and the CUDA RNG states (one uint8 tensor per device; empty without
    initialised CUDA)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    return torch.get_rng_state(), list(cuda)


def same(a: Any, b: Any) -> bool:
    """Whether two plain-data values (tensors, containers, numbers, strings: what a rank-local state_dict holds)
    are equal: tensors by dtype, shape and every element, containers item by item."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and a.device == b.device and torch.equal(a, b))
    if isinstance(a, dict) or isinstance(b, dict):
        return isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys() and all(
            same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def capture(local_objects: dict[str, Any]) -> dict[str, Any]:
    """This rank's state now: ``{"cpu_rng": uint8 tensor, "cuda_rng": [uint8 tensor per device] (empty without
    initialised CUDA), "local": {name: state_dict}}`` for the ``rank_local`` managed objects, each state_dict
    deep-copied (later changes to the objects do not reach it)."""
    cpu, cuda = rng_states()
    return {"cpu_rng": cpu, "cuda_rng": cuda,
            "local": {name: copy.deepcopy(obj.state_dict()) for name, obj in local_objects.items()}}


def encode(state: dict[str, Any]) -> bytes:
    """A :func:`capture`'d state as bytes (``torch.save``)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def serialize(local_objects: dict[str, Any]) -> bytes:
    """This rank's state as bytes: :func:`encode` of :func:`capture`."""
    return encode(capture(local_objects))


def deserialize(data: bytes) -> dict[str, Any]:
    """The state :func:`serialize` wrote. Raises ``pickle.UnpicklingError`` for anything ``weights_only``
    loading refuses (e.g. a rank-local state_dict holding arbitrary objects)."""
    return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")


PLAIN_RULE = ("plain data: tensors, None, bool, int, float, str, bytes, and list / tuple / dict / OrderedDict / "
              "Counter of them")
_SCALARS = (type(None), bool, int, float, str, bytes)


def _unplain(value: Any, path: str, depth: int = 0) -> Optional[tuple[str, type]]:
    """(path, type) of the first value in ``value`` that is not plain data (:data:`PLAIN_RULE`), or None."""
    if isinstance(value, torch.Tensor) or type(value) in _SCALARS:
        return None
    if depth > transfer.MAX_DEPTH:
        return path, type(value)
    if type(value) in transfer.MAPPINGS:
        for k, v in value.items():
            bad = _unplain(k, f"{path} key {k!r}", depth + 1) if not isinstance(k, torch.Tensor) else \
                (f"{path} key", type(k))
            bad = bad or _unplain(v, f"{path}/{k}", depth + 1)
            if bad:
                return bad
        return None
    if type(value) in (list, tuple):
        for i, v in enumerate(value):
            bad = _unplain(v, f"{path}/{i}", depth + 1)
            if bad:
                return bad
        return None
    return path, type(value)


def check_plain(states: dict[str, Any], rank_local: bool) -> Optional[str]:
    """A one-line error naming the first managed object (``states``: its state_dict by name) whose state_dict holds
    a value that is not plain data (:data:`PLAIN_RULE`: what worker.transfer sends in a migration or recovery and,
    for a ``rank_local`` object, what :func:`deserialize` loads with ``torch.load(weights_only=True)``), or None.
    A rank-local state is also put through :func:`encode` and :func:`deserialize` (a tensor subclass, say)."""
    for name, state in states.items():
        why = None
        bad = _unplain(state, "")
        if bad is not None:
            path, kind = bad
            where = f" at {path.lstrip('/')}" if path.strip("/") else ""
            why = f"it holds a {kind.__module__}.{kind.__qualname__}{where}"
        elif rank_local:
            try:
                deserialize(encode({"local": {name: state}}))
            except Exception as e:  # noqa: BLE001 - what a replacement's load would raise
                why = f"torch.load(weights_only=True) refuses its saved bytes ({type(e).__name__})"
        if why is not None:
            return (f"{'rank-local' if rank_local else 'replicated'} managed object {name!r} cannot be moved by a "
                    f"migration or recovery: {why}; a managed state_dict must be {PLAIN_RULE} (convert it in "
                    "state_dict(), e.g. float(x) or list(d))")
    return None


def restore(state: dict[str, Any], local_objects: dict[str, Any]) -> None:
    """Load a deserialised rank state: the rank-local objects' state_dicts, then the RNG states (last: a
    ``load_state_dict`` may draw from the RNG, e.g. a loader rebuilding its DataLoader iterator, which draws its
    ``_base_seed``; the migration path and a survivor set the RNG after loading too). Raises KeyError when the sets
    of rank-local objects differ."""
    if set(state["local"]) != set(local_objects):
        raise KeyError(f"rank-local objects differ: local {sorted(local_objects)}, received {sorted(state['local'])}")
    for name, obj in local_objects.items():
        obj.load_state_dict(state["local"][name])
    torch.set_rng_state(state["cpu_rng"])
    if state["cuda_rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda_rng"])


def _leaves(node: Any, path: str, out: list) -> None:
    if isinstance(node, torch.Tensor):
        out.append((path, node))
    elif isinstance(node, dict):
        for k in sorted(node, key=repr):
            _leaves(node[k], f"{path}/{k!r}", out)
    elif isinstance(node, (list, tuple)):
        for i, v in enumerate(node):
            _leaves(v, f"{path}/{i}", out)
    else:
        out.append((path, node))


def fingerprint(replicated: dict[str, Any], optimizers: Iterable[torch.optim.Optimizer] = ()) -> bytes:
    """sha256 (32 bytes) of the replicated managed state (see the module docstring). Samples are gathered into one
    host copy (one device sync for CUDA state)."""
    leaves: list = []
    for name in sorted(replicated):
        _leaves(replicated[name].state_dict(), name, leaves)
    for i, opt in enumerate(optimizers):
        for j, group in enumerate(opt.param_groups):
            for k, param in enumerate(group["params"]):
                leaves.append((f"params/{i}/{j}/{k}", param))
    h = hashlib.sha256()
    samples = []
    for path, value in leaves:
        if isinstance(value, torch.Tensor):
            if is_dtensor(value):  # its local shard only: never a DTensor op (they may communicate)
                shape, placements, mesh = dtensor_layout(value)
                value = local_shard(value)
                path = f"{path}:DT{shape}{placements}{mesh}"
            t = value.detach().reshape(-1)
            h.update(f"{path}:{t.dtype}:{tuple(value.shape)};".encode())
            if t.numel():
                stride = max(1, t.numel() // SAMPLE)
                samples.append(t[::stride][:SAMPLE].to(torch.float64 if t.is_floating_point() else torch.int64))
        else:
            h.update(f"{path}={value!r};".encode())
    if samples:
        flat = torch.cat([s.to(samples[0].device, torch.float64) for s in samples]).cpu()
        h.update(flat.numpy().tobytes())
    return h.digest()


def all_gather_bytes(data: bytes, group: Optional[dist.ProcessGroup] = None) -> list[bytes]:
    """Every rank's ``data``, in rank order, gathered over ``group`` (default: the default group) in two
    collectives (sizes, then uint8 payloads padded to the largest). Tensors live on the CPU (gloo) or the current
    CUDA device (an NCCL inner backend, worker.backend.inner_kind). Raises what the collectives raise; through the mover a failed collective instead latches
    and returns untouched outputs, so the caller must check the latch before trusting the result."""
    world = dist.get_world_size(group)
    device = torch.device("cuda", torch.cuda.current_device()) if inner_kind() == "nccl" else torch.device("cpu")
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    lengths = [int(s.item()) for s in sizes]
    longest = max(lengths + [1])
    mine = torch.zeros(longest, dtype=torch.uint8)
    # Live, ``longest`` covers this rank's own size. Replayed (a joiner's shadow iterations) the sizes are the
    # recording's, and this rank's payload, thrown away anyway, may be longer: only what fits is copied.
    n = min(len(data), longest)
    if n:
        mine[:n] = torch.frombuffer(bytearray(data[:n]), dtype=torch.uint8)
    outs = [torch.zeros(longest, dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(outs, mine.to(device), group=group)
    return [bytes(o[:n].cpu().numpy().tobytes()) for o, n in zip(outs, lengths)]

"""A DTensor's local shard: the one rule for reading sharded state without communicating.

A DTensor (``torch.distributed.tensor.DTensor``: FSDP2 and tensor-parallel parameters, their optimizer state,
sharded buffers) is a wrapper whose ops may issue collectives (a comparison, a copy, ``full_tensor()``). The
runtime never runs one: whatever it copies, compares, hashes, sends or measures, it does on the rank's local
shard, which :func:`local_shard` takes without a collective, whatever the placements. Callers: worker.transfer
(a shard travels with :func:`dtensor_layout`), worker.precopy (version counters and addresses), worker.snapshot
(host copies and their size), worker.rank_state (the fingerprint), worker.misuse (storage pointers) and
worker.step_ledger (the begin-of-step copy of every buffer).
"""
from __future__ import annotations

from typing import Any

import torch

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch built without distributed support: no DTensors exist
    DTensor = None


def is_dtensor(value: Any) -> bool:
    """Whether ``value`` is a DTensor (``torch.distributed.tensor.DTensor``)."""
    return DTensor is not None and isinstance(value, DTensor)


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """``t``'s local shard if it is a DTensor, else ``t`` itself. The shard is detached: a plain tensor (shape: the
    local shape) sharing the DTensor's storage and version counter, so an in-place change to either shows in the
    other and in ``_version``. Issues no collective."""
    if is_dtensor(t):
        return t._local_tensor.detach()
    return t


def dtensor_layout(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[str, ...], tuple[int, ...]]:
    """A DTensor's (global shape, placements as ``str`` each, mesh shape): what its local shard alone does not
    say. Issues no collective."""
    return tuple(t.shape), tuple(str(p) for p in t.placements), tuple(t.device_mesh.shape)

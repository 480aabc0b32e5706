"""A bit-exact fingerprint of the training state, used to check that migration is lossless.

``final_state_hash(model, optimizer)`` is a sha256 over

* every tensor of ``model.state_dict()`` (a DDP / DataParallel wrapper is
  unwrapped first, so the keys are the same with or without DDP), and
* every tensor and scalar of ``optimizer.state_dict()`` (per-parameter state
  such as AdamW's ``step``/``exp_avg``/``exp_avg_sq``, and the hyper-parameters
  in ``param_groups``),

visited in sorted key order. Each tensor contributes its key path, dtype, shape
and raw bytes; each scalar its key path, type name and ``repr``. Two processes
that hold bit-identical state get the same hex digest.

A ``DTensor`` (FSDP2 or tensor-parallel shard) contributes its LOCAL shard only
(``to_local()``: the local shape and bytes, no communication), so each rank
hashes what it holds; plain tensors hash exactly as before.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch.distributed.tensor import DTensor

__all__ = ["final_state_hash", "state_hash", "tensor_bytes"]


def tensor_bytes(t: torch.Tensor) -> bytes:
    """Raw little-endian storage bytes of ``t`` (any dtype/shape, 0-dim included), in C order, on CPU."""
    t = t.detach().to("cpu").contiguous()
    if t.dim() == 0:
        t = t.reshape(1)
    if t.numel() == 0:
        return b""
    return t.view(torch.uint8).numpy().tobytes()


def _sort_key(k: Any) -> tuple[str, Any]:
    # Keys of one dict are homogeneous in practice (str for modules, int for optimizer
    # state), but sort by (type name, value) so mixed keys never raise.
    return (type(k).__name__, k if isinstance(k, (int, float, str)) else repr(k))


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (no communication), else ``t`` itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def _feed(h: "hashlib._Hash", path: str, obj: Any) -> None:
    if isinstance(obj, torch.Tensor):
        obj = _local(obj)
        h.update(f"T|{path}|{obj.dtype}|{tuple(obj.shape)}|".encode())
        h.update(tensor_bytes(obj))
    elif isinstance(obj, dict):
        h.update(f"D|{path}|{len(obj)}|".encode())
        for k in sorted(obj, key=_sort_key):
            _feed(h, f"{path}/{k}", obj[k])
    elif isinstance(obj, (list, tuple)):
        h.update(f"L|{path}|{len(obj)}|".encode())
        for i, v in enumerate(obj):
            _feed(h, f"{path}[{i}]", v)
    else:  # int, float, bool, str, None, ...
        h.update(f"S|{path}|{type(obj).__name__}|{obj!r}|".encode())


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def state_hash(obj: Any) -> str:
    """sha256 hex digest of an arbitrary nest of dicts/lists/tensors/scalars."""
    h = hashlib.sha256()
    _feed(h, "", obj)
    return h.hexdigest()


def final_state_hash(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> str:
    """sha256 hex digest (64 chars) of the model's and the optimizer's state dicts."""
    state: dict[str, Any] = {"model": _unwrap(model).state_dict()}
    if optimizer is not None:
        state["optimizer"] = optimizer.state_dict()
    return state_hash(state)

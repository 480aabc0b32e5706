"""Misuse found before it can diverge: replicated state the runtime does not manage.

A migration or recovery moves only managed state. A job that manages nothing replicated, or whose DDP
(``torch.nn.parallel.DistributedDataParallel``) or FSDP2 (``torch.distributed.fsdp.FSDPModule``) modules hold
parameters outside every managed replicated object, would train on with a joiner's fresh parameters. :func:`check`
finds both, once, at the first step boundary (when such modules exist): one scan of the garbage collector's
objects, parameters compared with the managed objects' state_dict tensors by storage data pointer.

:func:`check_all` also finds a DDP module with a communication hook registered with a state (PowerSGD's
``PowerSGDState``: its error feedback, its iteration count): that state is in no state_dict, so a joiner or a
replacement starts it afresh and the trajectory diverges silently from an uninterrupted run. Warned
(``stateful_comm_hook``), not refused: the job trains on, and migrations and recoveries are allowed.
"""
from __future__ import annotations

import gc
import warnings
from typing import Any, Iterable, Optional

import torch

from tmd import protocol as p
from worker.dtensor import local_shard


def _data_ptrs(states: Iterable[Any], out: set) -> set:
    for node in states:
        if isinstance(node, torch.Tensor):
            try:
                out.add(node.untyped_storage().data_ptr())
            except RuntimeError:  # a tensor without storage (meta, some wrappers)
                pass
        elif isinstance(node, dict):
            _data_ptrs(node.values(), out)
        elif isinstance(node, (list, tuple)):
            _data_ptrs(node, out)
    return out


def _local_state(node: Any) -> Any:
    if isinstance(node, torch.Tensor):
        return local_shard(node)
    if isinstance(node, dict):
        return {k: _local_state(v) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return [_local_state(v) for v in node]
    return node


def data_parallel_modules() -> list[torch.nn.Module]:
    """The DDP and FSDP2 modules alive in this process (one gc scan)."""
    kinds: tuple = (torch.nn.parallel.DistributedDataParallel,)
    try:
        from torch.distributed.fsdp import FSDPModule

        kinds += (FSDPModule,)
    except ImportError:  # an older torch without FSDP2
        pass
    found, memo = [], {}  # memo: type -> is a DDP/FSDP module (types are far fewer than objects)
    with warnings.catch_warnings():  # isinstance on some of torch's lazy module objects warns of deprecations
        warnings.simplefilter("ignore")
        for o in gc.get_objects():
            t = type(o)
            hit = memo.get(t)
            if hit is None:
                hit = memo[t] = isinstance(t, type) and issubclass(t, kinds)
            if hit:
                found.append(o)
    return found


def check(replicated: dict[str, Any]) -> Optional[tuple[p.WarningCode, str]]:
    """``(code, message)`` for the misuse found, or None. ``replicated``: the managed objects with
    ``rank_local=False``. NOTHING_MANAGED when there are none; UNMANAGED_PARAMETERS when a DDP/FSDP module has a
    parameter whose storage is in no managed object's state_dict."""
    found = check_all(replicated)
    return found[0] if found and found[0][0] in p.REFUSING_WARNINGS else None


def check_all(replicated: dict[str, Any]) -> list[tuple[p.WarningCode, str]]:
    """Every misuse found, the refusing one (:func:`check`'s) first, then a DDP module's stateful communication
    hook (STATEFUL_COMM_HOOK, see the module docstring). One scan of the garbage collector's objects."""
    if not replicated:
        return [(p.WarningCode.NOTHING_MANAGED,
                 "session.manage() was never called with replicated state (model, optimizer): a migration or "
                 "recovery would start the new rank from fresh state; manage them (rank_local=False)")]
    modules = data_parallel_modules()
    return [x for x in (_unmanaged(replicated, modules), stateful_comm_hook(modules)) if x is not None]


def stateful_comm_hook(modules: Iterable[Any]) -> Optional[tuple[p.WarningCode, str]]:
    """STATEFUL_COMM_HOOK for the first DDP module of ``modules`` whose communication hook was registered with a
    state (``register_comm_hook(state, hook)``, state not None), or None."""
    for module in modules:
        for hook, state in getattr(module, "_comm_hooks", None) or ():
            if state is not None:
                name = getattr(hook, "__qualname__", type(hook).__name__)
                return (p.WarningCode.STATEFUL_COMM_HOOK,
                        f"{type(module).__name__}'s communication hook {name} has a state ({type(state).__name__}) "
                        "that is in no state_dict: a migration or recovery does not move it, so the new ranks start "
                        "it afresh (PowerSGD's error feedback and iteration count) and training diverges silently "
                        "from an uninterrupted run; use a stateless hook (fp16_compress_hook) or none")
    return None


def _unmanaged(replicated: dict[str, Any], modules: list[Any]) -> Optional[tuple[p.WarningCode, str]]:
    # An optimizer's state_dict does not carry its parameters: managing only the optimizer does not move them.
    managed = _data_ptrs((_local_state(obj.state_dict()) for obj in replicated.values()), set())
    for module in modules:
        missing = [name for name, param in module.named_parameters()
                   if local_shard(param).untyped_storage().data_ptr() not in managed]
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            return (p.WarningCode.UNMANAGED_PARAMETERS,
                    f"{type(module).__name__} has {len(missing)} parameter(s) in no managed object ({shown}): "
                    "a migration or recovery would not move them; pass the module to session.manage()")
    return None

"""A joiner's DDP regrouping without an iteration's compute: what the forward pass of a process's second iteration
would do first, DDP's one-time regrouping of its gradient buckets (torch's ``Reducer::rebuild_buckets``), replayed
from the job's recording (worker.sandbox), so that a failure's replacement or a migration's joiner runs fewer
shadow iterations (worker.session ``_no_shadow_iteration_needed``, ``_one_shadow_iteration_enough``).
"""
from __future__ import annotations

import logging
import weakref
from typing import Any, Optional

import torch

log = logging.getLogger("worker.ddp_regroup")

# Every DistributedDataParallel built in this process since track_ddp_modules() (weak: a dropped model goes)
_ddp_modules: weakref.WeakSet = weakref.WeakSet()
_ddp_hook: Any = None  # the handle of track_ddp_modules' hook, once registered


def _note_ddp(parent: torch.nn.Module, name: str, child: Any) -> None:
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(parent, DistributedDataParallel):
        _ddp_modules.add(parent)


def track_ddp_modules() -> None:
    """From now on, keep every DistributedDataParallel this process builds in a weak set (torch's global
    module-registration hook, ``torch.nn.modules.module.register_module_module_registration_hook``: DDP's
    ``__init__`` assigns its ``module``), so that :func:`regroup_ddp_buckets` finds them without a scan of every
    object (``gc.get_objects()``: ~0.1 s for the demo GPT's ~290,000 objects on this 2-core machine, on a
    failure's critical path for a replacement). Called by a joiner before its script builds anything; once."""
    global _ddp_hook
    if _ddp_hook is None:
        _ddp_hook = torch.nn.modules.module.register_module_module_registration_hook(_note_ddp)


# The collectives of DDP's regrouping (torch's ``Reducer::sync_bucket_indices``, reducer.cpp): two broadcasts from rank
# 0 on the DDP's process group, the bucket indices with their count (int32, [parameters + 1]), then the bucket
# sizes (int32, [buckets]).
REGROUP_OPS = 2


def ddp_to_regroup() -> tuple[bool, Optional[Any]]:
    """What :func:`regroup_ddp_buckets` would regroup: ``(True, None)`` when no DistributedDataParallel built since
    :func:`track_ddp_modules` has a regrouping ahead (none built, or each regrouped already or searching for
    unused parameters, which never regroups), ``(True, ddp)`` for the one that has, with the plain C++ reducer (no
    static graph, no Join), and ``(False, None)`` otherwise (several, whose order in the recording is the
    script's, or one of another kind): the joiner then lets its iterations do it."""
    pending = [o for o in _ddp_modules if not getattr(o, "_has_rebuilt_buckets", True)
               and not o.find_unused_parameters]
    if not pending:
        return True, None
    ddp = pending[0]
    if len(pending) > 1 or ddp.static_graph or getattr(ddp, "_use_python_reducer", False) or \
            getattr(ddp, "_delay_all_reduce_all_params", False) or ddp._join_config.enable:
        return False, None
    return True, ddp


def regroup_ddp_buckets(before_first: bool = False) -> bool:
    """A joiner after its first shadow iteration: do what the forward of its second iteration would do
    first, DDP's one-time regrouping of its gradient buckets (torch's ``Reducer::rebuild_buckets``: the bucket
    assignment of the first backward pass's gradient order, broadcast from rank 0; replayed here from the
    recording like any shadow collective), without that iteration's compute (one step of the failure's
    critical path). Returns True when it regrouped the DistributedDataParallel :func:`ddp_to_regroup` names.
    Returns False otherwise (none, or one it cannot regroup; a regrouping whose broadcast is not the next recorded
    op, which the replay refuses without consuming it): a second iteration, if the caller runs one, does it the
    usual way.

    ``before_first``: a failure's replacement that runs no shadow iteration at all (its replay moved to the
    recorded step 1 first). No backward pass gave the gradients' order, so every parameter is pushed in index
    order (``Reducer._push_all_rebuilt_params``, what a static graph does): that order only shapes rank 0's
    proposal, and every rank adopts the assignment rank 0 broadcast, here the recorded one. A refusal then raises
    RuntimeError instead (the pushed order cannot be taken back, so no iteration may follow)."""
    _, ddp = ddp_to_regroup()
    if ddp is None:
        return False
    if before_first:
        ddp.reducer._push_all_rebuilt_params()
    try:
        rebuilt = ddp.reducer._rebuild_buckets()
    except RuntimeError as e:  # the replay refused it (the script's own collective comes first): no harm done
        if before_first:
            raise
        log.info("DDP buckets not regrouped after the first shadow iteration (%s): running a second one", e)
        return False
    if rebuilt:
        ddp._has_rebuilt_buckets = True
    return rebuilt

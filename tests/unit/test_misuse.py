"""worker.misuse: a DDP model's communication hook registered with a state (PowerSGD's) is warned about, not refused
(outside review s23: silent divergence after a migration and a kill); a stateless hook is not."""
from __future__ import annotations

import torch

from tmd import protocol as p
from worker import misuse


def _with_hook(state):
    """A module standing for a DDP model (``_comm_hooks``: DDP's list of (hook, state) from ``register_comm_hook``)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    module = torch.nn.Linear(3, 2)
    hook = powerSGD_hook.powerSGD_hook if state is not None else default_hooks.fp16_compress_hook
    module._comm_hooks = [(hook, state)]
    return module


def test_a_stateful_comm_hook_is_warned_about_and_refuses_nothing(monkeypatch):
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=2)
    model = _with_hook(state)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monkeypatch.setattr(misuse, "data_parallel_modules", lambda: [model])
    (code, message), = misuse.check_all({"model": model, "optimizer": opt})
    assert code == p.WarningCode.STATEFUL_COMM_HOOK and code not in p.REFUSING_WARNINGS
    assert "communication hook powerSGD_hook has a state (PowerSGDState)" in message
    assert misuse.check({"model": model, "optimizer": opt}) is None  # nothing refusing
    # with unmanaged parameters too: the refusing warning comes first
    codes = [c for c, _ in misuse.check_all({"optimizer": opt})]
    assert codes == [p.WarningCode.UNMANAGED_PARAMETERS, p.WarningCode.STATEFUL_COMM_HOOK]
    assert misuse.check({"optimizer": opt})[0] == p.WarningCode.UNMANAGED_PARAMETERS


def test_a_stateless_comm_hook_or_none_is_no_misuse(monkeypatch):
    model = _with_hook(None)
    plain = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(list(model.parameters()) + list(plain.parameters()), lr=0.1)
    monkeypatch.setattr(misuse, "data_parallel_modules", lambda: [model, plain])
    assert misuse.check_all({"model": model, "plain": plain, "optimizer": opt}) == []

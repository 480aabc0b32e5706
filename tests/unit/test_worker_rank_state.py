"""worker.rank_state: the rank-state round trip (weights_only loading) and the replicated-state fingerprint;
worker.misuse on a process without DDP modules; both on DTensor (sharded) state, issuing no collective."""
from __future__ import annotations

import pickle

import pytest
import torch

from tests.unit.test_transfer import sharded
from tmd import protocol as p
from worker import misuse, rank_state


class Sampler:
    def __init__(self) -> None:
        self.next_step = 0

    def state_dict(self) -> dict:
        return {"next_step": self.next_step, "order": torch.arange(5)}

    def load_state_dict(self, state: dict) -> None:
        self.next_step = state["next_step"]


def test_rank_state_round_trip_restores_rng_and_rank_local_objects():
    torch.manual_seed(7)
    torch.rand(3)
    sampler = Sampler()
    sampler.next_step = 12
    data = rank_state.serialize({"data": sampler})
    expected = torch.rand(4)  # what the RNG draws next
    other = Sampler()
    torch.manual_seed(123)
    rank_state.restore(rank_state.deserialize(data), {"data": other})
    assert other.next_step == 12
    assert torch.equal(torch.rand(4), expected)
    with pytest.raises(KeyError):
        rank_state.restore(rank_state.deserialize(data), {"sampler": Sampler()})


class EagerLoader:
    """A rank-local loader whose load_state_dict rebuilds its DataLoader iterator at once: ``iter(DataLoader)``
    draws its ``_base_seed`` from the global RNG."""

    def __init__(self) -> None:
        self.pos = 0
        self.dl = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(8.0)), batch_size=2,
                                              shuffle=True)
        self.it = iter(self.dl)

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.pos = state["pos"]
        self.it = iter(self.dl)  # draws from the global RNG


def test_restore_sets_the_rng_after_loading_rank_local_objects():
    # The RNG restored first, then a loader's load_state_dict drawing from it: the replacement would end one draw
    # ahead of the rank it replaces (outside review). The RNG is restored last, as the migration path does.
    torch.manual_seed(5)
    loader = EagerLoader()
    loader.pos = 3
    data = rank_state.serialize({"data": loader})
    expected = torch.rand(4)
    other = EagerLoader()
    torch.manual_seed(99)
    rank_state.restore(rank_state.deserialize(data), {"data": other})
    assert other.pos == 3
    assert torch.equal(torch.rand(4), expected)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_deserialize_refuses_arbitrary_objects():
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    with pytest.raises(pickle.UnpicklingError):
        rank_state.deserialize(pickle.dumps({"cpu_rng": Evil()}))


def _model_and_optimizer(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(300, 20)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 300)).sum().backward()
    opt.step()
    return model, opt


def test_fingerprint_is_equal_for_replicas_and_changes_with_one_element():
    model, opt = _model_and_optimizer()
    model2, opt2 = _model_and_optimizer()
    fp = rank_state.fingerprint({"model": model, "optimizer": opt}, [opt])
    assert len(fp) == rank_state.FINGERPRINT_BYTES
    assert fp == rank_state.fingerprint({"model": model2, "optimizer": opt2}, [opt2])
    with torch.no_grad():
        model2.weight.view(-1)[0] += 1.0  # element 0 is always sampled
    assert fp != rank_state.fingerprint({"model": model2, "optimizer": opt2}, [opt2])
    # the optimizer's parameters count even when the model itself is not managed
    assert rank_state.fingerprint({"optimizer": opt}, [opt]) != rank_state.fingerprint({"optimizer": opt2}, [opt2])
    opt2.state[model2.bias]["step"] += 1  # the step count
    assert rank_state.fingerprint({"optimizer": opt}, [opt]) != rank_state.fingerprint({"optimizer": opt2}, [opt2])


def test_misuse_nothing_managed(monkeypatch):
    assert misuse.check({})[0] == p.WarningCode.NOTHING_MANAGED
    # (no data-parallel module: the DDP models other tests leave alive in this process, their gradient hooks held
    # by autograd, are not this job's)
    monkeypatch.setattr(misuse, "data_parallel_modules", lambda: [])
    model, opt = _model_and_optimizer()
    assert misuse.check({"model": model, "optimizer": opt}) is None


def test_misuse_unmanaged_parameters_of_a_data_parallel_module(monkeypatch):
    model, opt = _model_and_optimizer()
    monkeypatch.setattr(misuse, "data_parallel_modules", lambda: [model])
    assert misuse.check({"model": model, "optimizer": opt}) is None
    code, message = misuse.check({"optimizer": opt})  # the optimizer's state_dict does not carry the parameters
    assert code == p.WarningCode.UNMANAGED_PARAMETERS and "weight" in message


def _fingerprint(objs) -> bytes:
    from torch.distributed.tensor.debug import CommDebugMode

    with CommDebugMode() as comm:
        fp = rank_state.fingerprint(objs, [objs["optimizer"]])
    assert comm.get_total_counts() == 0  # a DTensor op on a sharded tensor could communicate: none may
    return fp


def test_fingerprint_of_sharded_state_hashes_local_shards_without_collectives(mesh):
    from torch.distributed.tensor import Replicate

    fp = _fingerprint(sharded(mesh, 1))
    assert fp == _fingerprint(sharded(mesh, 1))
    changed = sharded(mesh, 1)
    with torch.no_grad():
        changed["model"].weight.to_local().view(-1)[0] += 1.0
    assert fp != _fingerprint(changed)
    changed = sharded(mesh, 1)
    with torch.no_grad():
        changed["optimizer"].state[changed["model"].weight]["exp_avg"].to_local().view(-1)[0] += 1.0
    assert fp != _fingerprint(changed)
    # the same local bytes under another layout: the layout is part of the fingerprint
    replicated = sharded(mesh, 1, step=False, placements=[Replicate()])
    plain = sharded(mesh, 1, step=False)
    assert _fingerprint(replicated) != _fingerprint(plain)


def test_misuse_finds_sharded_parameters_by_their_local_shard(mesh, monkeypatch):
    objs = sharded(mesh, 1)
    monkeypatch.setattr(misuse, "data_parallel_modules", lambda: [objs["model"]])
    assert misuse.check(objs) is None
    code, message = misuse.check({"optimizer": objs["optimizer"]})
    assert code == p.WarningCode.UNMANAGED_PARAMETERS and "weight" in message


def test_check_plain_takes_plain_data_and_a_counter_and_names_the_rest():
    import collections
    import numpy as np
    from worker import rank_state as rs
    plain = {"a": [1, 2.5, None, True, "s", b"b", (torch.zeros(2),)], "c": collections.Counter({3: 2}),
             "o": collections.OrderedDict(x=1), ("k", 1): {}}
    assert rs.check_plain({"x": plain}, rank_local=True) is None
    assert type(rs.deserialize(rs.encode({"c": plain["c"]}))["c"]) is collections.Counter
    error = rs.check_plain({"ok": plain, "sampler": {"seen": [np.float64(1)]}}, rank_local=True)
    assert error.startswith("rank-local managed object 'sampler'") and "numpy.float64 at seen/0" in error
    assert "plain data" in error

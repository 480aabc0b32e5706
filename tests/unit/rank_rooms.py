"""A rank's step rooms as worker.session composes them (worker.step_ledger, worker.step_exchange,
worker.void_passes, worker.recovery, and the worker.step_hooks pipeline between them), without processes: a real
:class:`worker.session.Session` over a stub agent, whose failures are recorded and raise :class:`Failed`
instead of ending the process, and whose groups are stubs that build nothing."""
from __future__ import annotations

import pytest
import torch

from tmd import protocol as p
from worker import rank_state
from worker.control import Control
from worker.reports import Reporter
from worker.session import Session
from worker.snapshot import Snapshots
from worker.step_exchange import NO_FINGERPRINT, pack, unpack

NODE_OF = {0: "n1", 1: "n1", 2: "n2", 3: "n2"}


class Groups:
    """What the rooms need of a GroupManager: no failure latched, a store, generations that build nothing."""

    timeout_s, host = 5.0, "h"

    def __init__(self):
        self.installed = []

    def failure(self):
        return None

    def connect_store(self):
        return object()

    def build_all(self, generation, store):
        return {}

    def install(self, built, generation):
        self.installed.append(built)


class Failed(Exception):
    pass


class _Agent:
    def close(self):
        pass


class Rank:
    """One rank: ``session`` (its ``_begin_step`` and ``manage`` are the production ones), its rooms ``ledger``,
    ``exchange``, ``stopper``, ``recovery``, ``hooks``, the ``control``, the reports ``sent`` and the
    ``failures`` (kind, error) the job failed with."""

    def __init__(self, control: Control, rank: int, every: int = 0):
        self.control = control
        self.sent, self.failures = [], []
        self.session = Session(_Agent(), control, Reporter(self.sent.append, lambda: control.rank),
                               NODE_OF.get(rank, "n9"), 0, "/r")
        s = self.session
        self.ledger, self.exchange, self.stopper = s._ledger, s._exchange, s._stopper
        self.recovery, self.hooks = s._recovery, s._hooks
        self.exchange.fail = self._fail
        self.exchange.node = NODE_OF.get(rank, "n9")
        self.exchange.snapshots = Snapshots(every, rank, control.groups)

    def _fail(self, kind, error):
        self.failures.append((kind, error))
        raise Failed(error)

    def manage(self, objects, rank_local=False):
        self.session.manage(rank_local=rank_local, **objects)

    def begin_step(self):
        self.session._begin_step()


def make(rank=0, every=0, stage=None, role=p.WorkerRole.ACTIVE, incident_id=0, groups=None):
    """Rank ``rank`` of 4 (nodes :data:`NODE_OF`) with snapshots every ``every`` steps (0: off)."""
    control = Control()
    control.start(p.Assign(role=role, rank=rank, world_size=4, store_host="h", store_port=1,
                           generation=0, record_steps=3, record_dir="/r", migration_id=0, incident_id=incident_id))
    control.attach(groups if groups is not None else Groups())
    if stage is not None:
        control.enter(stage)
    return Rank(control, rank, every)


def blob(fp, node, held=(), want=False, state=b"", nonce="00"):
    return pack(fp, {"node": node, "nonce": nonce, "held": list(held), "want": want}, state)


def fp(tag):
    return bytes([tag]) * rank_state.FINGERPRINT_BYTES


# --- the exchange in a step ---------------------------------------------------------------------------------------
class World:
    """Stands in for the world's all-gather: every rank's blob, this rank's own at its index."""

    def __init__(self, rec, peers, monkeypatch):
        self.rec, self.peers, self.calls = rec, peers, []
        monkeypatch.setattr(rank_state, "all_gather_bytes", self.gather)

    def gather(self, data):
        self.calls.append(unpack(data))
        out = list(self.peers)
        out[self.rec.control.rank] = data
        return out


def trained(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    return model, opt, sched


def one_step(rec, model, opt, sched, step):
    rec.control.set_step(step)
    rec.begin_step()
    model(torch.ones(4, 3)).sum().backward()
    opt.step()
    sched.step()
    opt.zero_grad()


class Loader:
    """A rank-local data loader whose position moves with every batch it serves (a count and a tensor cursor)."""

    def __init__(self):
        self.served, self.cursor = 0, torch.zeros(2, dtype=torch.int64)

    def batch(self, step):
        self.served += 1
        self.cursor += torch.tensor([1, step])  # in place: a state_dict sharing it would see this change
        return torch.full((4, 3), float(step + 1))

    def state_dict(self):
        return {"served": self.served, "cursor": self.cursor}

    def load_state_dict(self, state):
        self.served, self.cursor = state["served"], state["cursor"]


def with_loader(monkeypatch):
    """Rank 0 of 4 managing a linear model and its SGD (replicated) and a :class:`Loader` (rank-local, ``data``)."""
    rec = make(rank=0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = Loader()
    rec.manage({"model": model, "optimizer": opt}, rank_local=False)
    rec.manage({"data": loader}, rank_local=True)
    World(rec, [None] + [blob(NO_FINGERPRINT, n) for n in ("n1", "n2", "n2")], monkeypatch)
    return rec, model, opt, loader


def loader_steps(rec, model, opt, loader, steps):
    """Train ``steps`` committed steps (0, 1, ...) of a :func:`with_loader` rank, each drawing its batch."""
    for step in range(steps):
        rec.control.set_step(step)
        rec.begin_step()
        model(loader.batch(step)).sum().backward()
        opt.step()
        opt.zero_grad()


class WithUnused(torch.nn.Module):
    """A 3 -> 8 -> 1 MLP (``net``) and a layer the forward never uses: DDP needs ``find_unused_parameters``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        self.unused = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@pytest.fixture
def world_of_one():
    """A gloo world of one rank (this process) for a test's DDP models."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def fsdp_rank(monkeypatch, every):
    """Rank 0 with snapshots every ``every`` steps, each rank its own replica class (FSDP: no rank has a replica),
    managing :func:`trained`'s model and optimizer; snapshot rounds send and receive nothing."""
    rec = make(rank=0, every=every)
    model, opt, sched = trained()
    rec.manage({"model": model, "optimizer": opt}, rank_local=False)
    rec.exchange.classes = {r: [r] for r in range(4)}
    rec.exchange.snapshots.configure(NODE_OF, rec.exchange.classes)
    monkeypatch.setattr(rec.exchange.snapshots, "_send", lambda snap, name: None)
    monkeypatch.setattr(rec.exchange.snapshots, "_receive", lambda step, name: None)
    return rec, model, opt, sched

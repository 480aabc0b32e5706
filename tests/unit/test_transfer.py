"""State transfer over a real 2-rank gloo group (both ends in one process, on two threads)."""
import concurrent.futures as cf
import datetime
import itertools

import pytest
import torch
import torch.distributed as dist

from worker import transfer

pytestmark = pytest.mark.timeout(60)
_prefix = itertools.count()


def pair():
    """Two connected ends (rank 0, rank 1) of a fresh gloo group."""
    store = dist.HashStore()
    prefix = f"t{next(_prefix)}"
    timeout = datetime.timedelta(seconds=20)
    with cf.ThreadPoolExecutor(2) as ex:
        a, b = ex.map(lambda r: dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), r, 2, timeout), [0, 1])
    return a, b


class Stream:
    def __init__(self):
        self.next_step = 0

    def state_dict(self):
        return {"next_step": self.next_step}

    def load_state_dict(self, sd):
        self.next_step = sd["next_step"]


def trained(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    model.register_buffer("counter", torch.tensor(seed, dtype=torch.int64))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.randn(3, 8)).sum().backward()
        opt.step()
    data = Stream()
    data.next_step = 10 + seed
    return {"model": model, "optimizer": opt, "data": data}


def flat_state(objs):
    out = []
    def walk(x):
        if isinstance(x, torch.Tensor):
            out.append(x.clone())
        elif isinstance(x, dict):
            for k in sorted(x, key=str):
                walk(x[k])
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
        else:
            out.append(x)
    for name in sorted(objs):
        walk(objs[name].state_dict())
    return out


def same(a, b):
    return len(a) == len(b) and all(
        (torch.equal(x, y) and x.dtype == y.dtype) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b))


def test_round_trip_is_bit_identical_and_uses_pretouched_buffers():
    src, dst = trained(1), trained(2)
    assert not same(flat_state(src), flat_state(dst))
    a, b = pair()
    buffers = transfer.pretouch(transfer.plan_buffers(dst))
    with cf.ThreadPoolExecutor(2) as ex:
        sent = ex.submit(transfer.send_state, a, src, {"step": 7})
        states, extra, moved, _ = transfer.recv_state(b, 0, buffers)
        sent_bytes, _ = sent.result()
    assert extra == {"step": 7} and moved == sent_bytes
    state_bytes = sum(t.numel() * t.element_size() for t in flat_state(src) if isinstance(t, torch.Tensor))
    assert state_bytes <= moved < state_bytes + 64 * 1024
    transfer.load_state(dst, states)
    assert same(flat_state(src), flat_state(dst))
    # the optimizer keeps views into the pre-touched receive buffer: no second copy
    exp_avg = next(iter(dst["optimizer"].state.values()))["exp_avg"]
    assert any(exp_avg.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr() for buf in buffers)


class CorruptingWire:
    """Flips one bit of the first state buffer on its way (a send with tag 2): corruption in flight."""

    def __init__(self, pg):
        self.pg = pg

    def __getattr__(self, name):
        return getattr(self.pg, name)

    def send(self, tensors, dst, tag):
        if tag == 2:
            t = tensors[0].clone()
            t.view(torch.uint8)[0] ^= 1
            tensors = [t]
        return self.pg.send(tensors, dst, tag)


def test_corrupt_buffer_is_refused_and_nothing_is_loaded():
    src, dst = trained(1), trained(2)
    before = flat_state(dst)
    a, b = pair()
    with cf.ThreadPoolExecutor(1) as ex:
        sent = ex.submit(transfer.send_state, CorruptingWire(a), src, {})
        with pytest.raises(transfer.ChecksumError, match="failed its checksum"):
            transfer.recv_state(b, 0)
        sent.result()
    assert same(before, flat_state(dst))


def test_peer_dying_mid_transfer_raises_instead_of_hanging():
    a, b = pair()
    with cf.ThreadPoolExecutor(1) as ex:
        fut = ex.submit(transfer.recv_state, b, 0)
        # the sender sends only the length, then its group goes away (the process died)
        a.send([torch.tensor([1 << 20], dtype=torch.int64)], 1, 0).wait()
        del a
        import gc; gc.collect()
        with pytest.raises(Exception):
            fut.result(timeout=30)


def test_load_state_refuses_other_objects():
    with pytest.raises(KeyError, match="managed objects differ"):
        transfer.load_state(trained(1), {"model": {}})

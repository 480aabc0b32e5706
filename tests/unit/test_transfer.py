"""State transfer over a real 2-rank gloo group (both ends in one process, on two threads)."""
import concurrent.futures as cf
import datetime
import hashlib
import hmac
import itertools
import json

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


# --- sharded state (DTensors) -------------------------------------------------------------------------------------
# One process stands for rank 1 of a 4-rank world on torch's fake process group: its collectives do nothing, and
# CommDebugMode counts every one issued (none may be, in send, receive or load).
@pytest.fixture(scope="module")
def mesh():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    try:
        yield init_device_mesh("cpu", (4,))
    finally:
        dist.destroy_process_group()


def dtensor(mesh, local, placements=None, shape=None):
    from torch.distributed.tensor import DTensor, Shard

    placements = placements or [Shard(0)]
    if shape is None:
        shape = (local.shape[0] * 4, *local.shape[1:]) if placements[0] == Shard(0) else tuple(local.shape)
    stride = torch.empty(shape).stride()
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape), stride=stride)


class Sharded(torch.nn.Module):
    """A module whose parameters are DTensors (as after fully_shard / parallelize_module), with an optimizer."""

    def __init__(self, mesh, seed, placements=None, rows=2):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.weight = torch.nn.Parameter(dtensor(mesh, torch.randn(rows, 3, generator=g), placements))
        self.register_buffer("plain", torch.randn(5, generator=g))


def sharded(mesh, seed, step=True, **kw):
    model = Sharded(mesh, seed, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    if step:  # optimizer state as a step makes it, without running DTensor ops here
        g = torch.Generator().manual_seed(seed + 100)
        local = model.weight.to_local()
        opt.state[model.weight] = {
            "step": torch.tensor(float(seed)),
            "exp_avg": dtensor(mesh, torch.randn(local.shape, generator=g), list(model.weight.placements),
                               model.weight.shape),
            "exp_avg_sq": dtensor(mesh, torch.rand(local.shape, generator=g), list(model.weight.placements),
                                  model.weight.shape)}
    return {"model": model, "optimizer": opt}


def local_state(objs):
    """flat_state with every DTensor as its local shard (what must move byte for byte)."""
    return [t.to_local() if transfer.is_dtensor(t) else t for t in flat_state(objs)]


def move(src, dst, load=True):
    """Send ``src`` to ``dst`` over a gloo pair; returns (states, collectives issued by send + receive + load)."""
    from torch.distributed.tensor.debug import CommDebugMode

    a, b = pair()
    with CommDebugMode() as comm, cf.ThreadPoolExecutor(1) as ex:
        sent = ex.submit(transfer.send_state, a, src, {"step": 3})
        states, _, _, _ = transfer.recv_state(b, 0, transfer.pretouch(transfer.plan_buffers(dst)))
        sent.result()
        if load:
            transfer.load_state(dst, states)
    # the sender's work ran on another thread: encode it here too, under the mode
    with CommDebugMode() as comm_send:
        transfer.plan_buffers(src)
    return states, comm.get_total_counts() + comm_send.get_total_counts()


def test_dtensors_travel_as_local_shards_with_their_layout(mesh):
    from torch.distributed.tensor import Replicate

    src = sharded(mesh, 1)
    plan = transfer.plan_buffers(src)
    assert sum(b["numel"] for b in plan if b["key"] == "model") == 2 * 3 + 5  # the local shard, not 8 x 3
    states, issued = move(src, sharded(mesh, 2), load=False)
    assert issued == 0
    shard = states["model"]["weight"]
    assert isinstance(shard, transfer.ReceivedShard)
    assert (shard.shape, shard.placements, shard.mesh, tuple(shard.local.shape)) == ((8, 3), ("S(0)",), (4,), (2, 3))
    assert torch.equal(shard.local, src["model"].weight.to_local())
    assert not isinstance(states["model"]["plain"], transfer.ReceivedShard)
    assert isinstance(states["optimizer"]["state"][0]["exp_avg"], transfer.ReceivedShard)
    replicated = transfer.dtensor_layout(dtensor(mesh, torch.zeros(2, 3), [Replicate()]))
    assert replicated == ((2, 3), ("R",), (4,))


def test_sharded_state_loads_bit_identically_without_collectives(mesh):
    src, dst = sharded(mesh, 1), sharded(mesh, 2)
    assert not same(local_state(src), local_state(dst))
    _, issued = move(src, dst)
    assert issued == 0
    assert same(local_state(src), local_state(dst))
    weight = dst["model"].weight
    assert transfer.is_dtensor(weight) and weight.device_mesh is src["model"].weight.device_mesh
    exp_avg = dst["optimizer"].state[weight]["exp_avg"]
    assert transfer.is_dtensor(exp_avg) and exp_avg.placements == weight.placements and exp_avg.shape == (8, 3)


def test_a_joiner_whose_optimizer_never_stepped_takes_the_parameters_layout(mesh):
    src, dst = sharded(mesh, 1), sharded(mesh, 2, step=False)
    assert not dst["optimizer"].state
    _, issued = move(src, dst)
    assert issued == 0
    assert same(local_state(src), local_state(dst))
    exp_avg = dst["optimizer"].state[dst["model"].weight]["exp_avg"]
    assert transfer.is_dtensor(exp_avg) and exp_avg.placements == dst["model"].weight.placements


@pytest.mark.parametrize("other, match", [
    ("placements", r"model: weight differs between leaver \(global \[8, 3\] as \['S\(0\)'\].*as \['R'\]"),
    ("shape", r"model: weight differs .* local \[2, 3\]\) and joiner \(global \[12, 3\]"),
])
def test_a_shard_of_another_layout_is_refused_and_nothing_loads(mesh, other, match):
    from torch.distributed.tensor import Replicate

    kw = dict(placements=[Replicate()], rows=8) if other == "placements" else dict(rows=3)
    src = sharded(mesh, 1)
    dst = {"model": Sharded(mesh, 2), "optimizer": sharded(mesh, 3, **kw)["optimizer"]}
    before = local_state(dst)
    with pytest.raises(transfer.TransferRefused, match="optimizer: state/0/exp_avg differs"):
        move(src, dst)  # the model alone would load: the optimizer's mismatch stops it first
    assert same(before, local_state(dst))
    dst = sharded(mesh, 3, **kw)
    before = local_state(dst)
    with pytest.raises(transfer.TransferRefused, match=match):
        move(src, dst)
    assert same(before, local_state(dst))


def test_a_shard_of_another_local_shape_is_refused(mesh):
    # same global shape and placements, another local shape: a shard of another coordinate (uneven sharding)
    src = {"model": Sharded(mesh, 1)}
    dst = {"model": Sharded(mesh, 2)}
    with torch.no_grad():
        dst["model"].weight = torch.nn.Parameter(dtensor(mesh, torch.zeros(1, 3), shape=(8, 3)))
    with pytest.raises(transfer.TransferRefused,
                       match=r"local \[2, 3\]\) and joiner \(global \[8, 3\] .* local \[1, 3\]"):
        move(src, dst)
    assert torch.equal(dst["model"].weight.to_local(), torch.zeros(1, 3))


def test_shards_and_plain_tensors_do_not_stand_in_for_each_other(mesh):
    src = {"model": Sharded(mesh, 1)}
    src["model"].register_buffer("plain", None)  # state_dict: weight only
    dst = {"model": torch.nn.Module()}
    dst["model"].weight = torch.nn.Parameter(torch.zeros(8, 3))
    with pytest.raises(transfer.TransferRefused, match="model: weight arrived as a DTensor shard .* holds no DTensor"):
        move(src, dst)
    assert not dst["model"].weight.any()
    with pytest.raises(transfer.TransferRefused, match="model: weight arrived as a plain tensor .* holds a DTensor"):
        move(dst, src)


def test_differing_keys_raise_key_error_before_anything_loads(mesh):
    src, dst = sharded(mesh, 1), sharded(mesh, 2)
    dst["model"].register_buffer("extra", torch.zeros(1))
    before = local_state(dst)
    with pytest.raises(KeyError, match=r"model: state_dict keys differ between leaver and joiner: "
                                        r"only the leaver.s has \[\], only the joiner.s has \[extra\]"):
        move(src, dst)
    assert same(before, local_state(dst))


def test_a_dtensor_cannot_travel_in_extra(mesh, monkeypatch):
    monkeypatch.delenv("TM_KEYS", raising=False)
    with pytest.raises(TypeError, match="DTensor"):
        transfer.send_state(None, {}, {"x": dtensor(mesh, torch.zeros(2))})  # refused before anything is sent


def sent_header(objects) -> tuple[dict, list]:
    """The header a real sender makes for ``objects`` (parsed JSON) and the buffers it sends."""
    captured = {}

    class Capture:
        def name(self):
            return "gloo"

        def send(self, tensors, dst, tag):
            captured[tag] = tensors[0].clone()
            return type("Done", (), {"wait": lambda self: True})()

    transfer.send_state(Capture(), objects, {})
    message = captured[1].numpy().tobytes()
    return json.loads(message[transfer.MAC_BYTES:]), [captured[t] for t in sorted(captured) if t >= 2]


@pytest.mark.parametrize("edit, match", [
    (lambda s: s.pop("mesh"), "bad shard reference"),
    (lambda s: s.update(placements=["S(0)", "R"]), "bad shard placements"),
    (lambda s: s.update(placements=["x" * 65]), "bad shard placements"),
    (lambda s: s.update(placements=[0]), "bad shard placements"),
    (lambda s: s.update(shape=[1, 3]), "does not fit its global shape"),
    (lambda s: s.update(shape=[24]), "does not fit its global shape"),
    (lambda s: s.update(r=[0, 9]), "bad tensor reference"),
    (lambda s: s.update(shape=[-1, 3]), "bad shape"),
])
def test_malformed_shard_entries_are_refused_before_any_buffer(mesh, monkeypatch, edit, match):
    monkeypatch.delenv("TM_KEYS", raising=False)  # the public MAC key: a forged header needs no secret
    header, _ = sent_header({"model": Sharded(mesh, 1)})
    items = header["skeleton"]["model"]["o"]
    shard = next(v for k, v in items if k == "weight")["s"]
    edit(shard)
    data = json.dumps(header).encode()
    message = hmac.new(b"\0" * 32, data, hashlib.sha256).digest() + data
    a, b = pair()
    with cf.ThreadPoolExecutor(1) as ex:
        def send():  # the length and the header only: the receiver must refuse before it waits for a buffer
            a.send([torch.tensor([len(message)], dtype=torch.int64)], 1, 0).wait()
            a.send([torch.frombuffer(bytearray(message), dtype=torch.uint8)], 1, 1).wait()
        sent = ex.submit(send)
        with pytest.raises(transfer.TransferRefused, match=match):
            transfer.recv_state(b, 0)
        sent.result(timeout=20)

"""State transfer over a real 2-rank gloo group (both ends in one process, on two threads)."""
import collections
import concurrent.futures as cf
import datetime
import gc
import hashlib
import hmac
import itertools
import json
import os
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from worker import datapath, transfer

pytestmark = pytest.mark.timeout(60)
_prefix = itertools.count()


def pair(timeout_s: float = 20.0):
    """Two connected ends (rank 0, rank 1) of a fresh gloo group whose ops time out after ``timeout_s`` seconds."""
    store = dist.HashStore()
    prefix = f"t{next(_prefix)}"
    timeout = datetime.timedelta(seconds=timeout_s)
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


def test_corrupt_buffer_is_refused_and_nothing_is_loaded(monkeypatch):
    monkeypatch.setenv(datapath.SHM_ENV, "0")  # over the group, where CorruptingWire sits
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
# One process stands for rank 1 of a 4-rank world on torch's fake process group (the ``mesh`` fixture,
# tests/unit/conftest.py): its collectives do nothing, and CommDebugMode counts every one issued (none may be, in
# send, receive or load).
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
            captured.setdefault(tag, tensors[0].clone())  # tag 1: the header (the trailer comes later)
            return type("Done", (), {"wait": lambda self: True})()

    with mock.patch.dict(os.environ, {datapath.SHM_ENV: "0"}):  # a capture answers no shared-memory offer
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


# --- the data path: chunks over the group, or a shared-memory ring on one host ---------------------------------------
def big(seed, width=64):
    """Objects whose buffers span several small chunks, with chunks that cross tensor boundaries."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    return {"model": model, "optimizer": opt}


def segments_open() -> int:
    """This process's shared-memory segments (worker.shm): open file descriptors plus mappings."""
    fds = sum(os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:tm-transfer") for fd in os.listdir("/proc/self/fd")
              if os.path.exists(f"/proc/self/fd/{fd}"))
    with open("/proc/self/maps") as f:
        return fds + sum("memfd:tm-transfer" in line for line in f)


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(datapath, "CHUNK_BYTES", 4096)
    monkeypatch.setattr(datapath, "SHM_CHUNK_BYTES", 4096)
    monkeypatch.setattr(datapath, "PIECE_BYTES", 1000)
    monkeypatch.setattr(datapath, "SHM_MIN_BYTES", 0)  # these states are small: take the ring anyway


def paths_taken(monkeypatch) -> list[str]:
    taken = []
    for name in ("recv_shm", "recv_wire"):
        real = getattr(datapath, name)
        monkeypatch.setattr(datapath, name,
                            lambda *a, _real=real, _name=name, **k: taken.append(_name) or _real(*a, **k))
    return taken


@pytest.mark.parametrize("shm", ["1", "0"])
def test_chunked_round_trip_is_bit_identical_on_both_paths(monkeypatch, small_chunks, shm):
    monkeypatch.setenv(datapath.SHM_ENV, shm)
    taken = paths_taken(monkeypatch)
    src, dst = big(1), big(2)
    a, b = pair()
    buffers = transfer.pretouch(transfer.plan_buffers(dst))
    with cf.ThreadPoolExecutor(1) as ex:
        sent = ex.submit(transfer.send_state, a, src, {"step": 3})
        states, extra, moved, _ = transfer.recv_state(b, 0, buffers)
        assert sent.result()[0] == moved
    assert taken == (["recv_shm"] if shm == "1" else ["recv_wire"])
    assert len(datapath.plan([f.numel() * f.element_size() for f in buffers], 4096)) > 8
    transfer.load_state(dst, states)
    assert same(flat_state(src), flat_state(dst)) and extra == {"step": 3}
    if shm == "1":  # the ring and its mapping are kept for the group's next message
        assert segments_open() > 0
    del a, b
    gc.collect()
    assert segments_open() == 0  # the ring is gone on both ends with the group


def test_the_ring_is_made_once_per_group_and_reused_by_every_message(monkeypatch, small_chunks):
    """Every message of a group after the first goes through the same ring (no segment made or opened again);
    the receiver checks the ring's nonce again each time."""
    from worker import shm

    monkeypatch.setenv(datapath.SHM_ENV, "1")
    made = []
    for name in ("create", "open"):
        real = getattr(shm.Segment, name)
        monkeypatch.setattr(shm.Segment, name, classmethod(
            lambda cls, *a, _real=real, _name=name: made.append(_name) or _real.__func__(cls, *a)))
    matched = []
    real_matches = shm.Segment.matches
    monkeypatch.setattr(shm.Segment, "matches", lambda self, offer: matched.append(1) or real_matches(self, offer))
    taken = paths_taken(monkeypatch)
    a, b = pair()
    for step in range(3):
        src, dst = big(10 + step), big(2)
        with cf.ThreadPoolExecutor(1) as ex:
            sent = ex.submit(transfer.send_state, a, src, {"step": step})
            states, extra, moved, _ = transfer.recv_state(b, 0)
            assert sent.result()[0] == moved
        transfer.load_state(dst, states)
        assert same(flat_state(src), flat_state(dst)) and extra == {"step": step}
    assert taken == ["recv_shm"] * 3 and made == ["create", "open"] and len(matched) == 2
    datapath.forget(a)
    datapath.forget(b)
    assert segments_open() == 0


def test_a_kept_mapping_of_another_segment_is_not_reused(monkeypatch, small_chunks):
    """The sender's ring was replaced (its previous message failed): the receiver drops the mapping it kept and
    maps the new one named by the header."""
    monkeypatch.setenv(datapath.SHM_ENV, "1")
    a, b = pair()
    for step in range(2):
        if step == 1:
            datapath.forget(a)  # the sender closed its ring: the next message makes a new one
        with cf.ThreadPoolExecutor(1) as ex:
            sent = ex.submit(transfer.send_state, a, big(1), {"step": step})
            _, extra, moved, _ = transfer.recv_state(b, 0)
            assert sent.result()[0] == moved and extra == {"step": step}
    del a, b
    gc.collect()
    assert segments_open() == 0


def test_a_small_state_goes_over_the_group_even_with_shared_memory_on(monkeypatch):
    monkeypatch.setenv(datapath.SHM_ENV, "1")
    taken = paths_taken(monkeypatch)
    src = trained(1)  # a few kB: under SHM_MIN_BYTES (a pre-copy's tail is this size)
    a, b = pair()
    with cf.ThreadPoolExecutor(1) as ex:
        sent = ex.submit(transfer.send_state, a, src, {"step": 1})
        states, _, moved, _ = transfer.recv_state(b, 0)
        assert sent.result()[0] == moved
    assert taken == ["recv_wire"] and segments_open() == 0


def test_a_corrupt_chunk_in_shared_memory_is_refused_and_the_segment_closed(monkeypatch, small_chunks):
    real = datapath.fill_slot

    def corrupting(src, slot, start, stop, crc):
        crc = real(src, slot, start, stop, crc)
        if start == 4096:  # the second chunk of a buffer, after its checksum was taken: corruption in the ring
            slot[7] ^= 4
        return crc

    monkeypatch.setattr(datapath, "fill_slot", corrupting)
    taken = paths_taken(monkeypatch)
    src, dst = big(1), big(2)
    before = flat_state(dst)
    a, b = pair()
    with cf.ThreadPoolExecutor(1) as ex:
        sent = ex.submit(transfer.send_state, a, src, {})
        with pytest.raises(transfer.ChecksumError, match="failed its checksum"):
            transfer.recv_state(b, 0)
        sent.result(timeout=20)
    assert taken == ["recv_shm"] and same(before, flat_state(dst))
    del a  # the sender keeps its ring for the group's next message; the refusing receiver kept no mapping
    gc.collect()
    assert segments_open() == 0


def test_a_forged_trailer_is_refused(monkeypatch):
    class ForgingTrailer(CorruptingWire):
        headers = 0

        def send(self, tensors, dst, tag):
            if tag == 1:
                self.headers += 1
                if self.headers == 2:  # the trailer: change a checksum, keep the (now wrong) MAC
                    t = tensors[0].clone()
                    t[-1] ^= 1
                    tensors = [t]
            return self.pg.send(tensors, dst, tag)

    a, b = pair()
    with cf.ThreadPoolExecutor(1) as ex:
        sent = ex.submit(transfer.send_state, ForgingTrailer(a), trained(1), {})
        with pytest.raises(transfer.TransferRefused, match="trailer refused"):
            transfer.recv_state(b, 0)
        sent.result(timeout=20)


@pytest.mark.parametrize("shm", ["1", "0"])
def test_a_sender_dying_mid_data_makes_the_receiver_raise(monkeypatch, small_chunks, shm):
    """The sender fails after its second chunk (its process is gone: the group closes); the receiver raises
    instead of waiting for the rest, loads nothing and keeps no segment."""
    monkeypatch.setenv(datapath.SHM_ENV, shm)

    class Dying(CorruptingWire):
        def send(self, tensors, dst, tag):
            if tag == datapath.FIRST_CHUNK_TAG + 2:
                raise RuntimeError("sender died")
            return self.pg.send(tensors, dst, tag)

    real = datapath.fill_slot

    def dying_fill(src, slot, start, stop, crc):
        if start == 2 * 4096:
            raise RuntimeError("sender died")
        return real(src, slot, start, stop, crc)

    monkeypatch.setattr(datapath, "fill_slot", dying_fill)
    src = big(1)
    # the receiver raises once the sender's group is gone (here at once), else at the group's timeout: where
    # something in a long pytest run still holds the sender's group, that took 20 s
    a, b = pair(timeout_s=5.0)
    with cf.ThreadPoolExecutor(1) as ex:
        fut = ex.submit(transfer.recv_state, b, 0)
        try:
            transfer.send_state(Dying(a), src, {})
            raise AssertionError("the sender did not fail")
        except RuntimeError as e:  # not pytest.raises: its traceback would keep the sender's group alive
            assert "sender died" in str(e)
        del a
        import gc; gc.collect()
        with pytest.raises(Exception):
            fut.result(timeout=30)
    assert segments_open() == 0


def test_a_receiver_dying_mid_data_makes_the_sender_raise(monkeypatch, small_chunks):
    """On the shared-memory path the sender waits for free slots: a receiver gone raises there."""
    monkeypatch.setattr(datapath, "RING_SLOTS", 2)

    class Failed:
        def is_completed(self):
            return True

        def wait(self):
            raise RuntimeError("receiver died")

    class Dying(CorruptingWire):
        def recv(self, tensors, src, tag):  # the receiver's watch on the sender fails: it stops mid-ring
            return Failed() if tag == datapath.FIRST_CHUNK_TAG else self.pg.recv(tensors, src, tag)

    src = big(1)
    a, b = pair()
    with cf.ThreadPoolExecutor(1) as ex:
        fut = ex.submit(transfer.send_state, a, src, {})
        try:
            transfer.recv_state(Dying(b), 0)
            raise AssertionError("the receiver did not fail")
        except RuntimeError as e:  # not pytest.raises: its traceback would keep the receiver's group alive
            assert "receiver died" in str(e)
        del b
        import gc; gc.collect()
        with pytest.raises(Exception):
            fut.result(timeout=30)
    assert segments_open() == 0


def test_a_segment_of_another_host_or_nonce_is_not_opened():
    from worker import shm

    segment, offer = shm.Segment.create(2, 4096)
    try:
        assert shm.Segment.open(dict(offer, host="another-host")) is None
        assert shm.Segment.open(dict(offer, nonce="00" * shm.NONCE_BYTES)) is None
        assert shm.Segment.open(dict(offer, slot_bytes=8192)) is None  # not the offered size
        assert shm.Segment.open(dict(offer, fd=0)) is None  # stdin: not a regular file of that size
        other = shm.Segment.open(offer)
        assert other is not None
        segment.slots[1, 5] = 42
        assert int(other.slots[1, 5]) == 42
        other.close()
    finally:
        segment.close()
    assert segments_open() == 0


def test_a_receiver_that_cannot_map_the_ring_gets_the_bytes_over_the_group(monkeypatch, small_chunks):
    """An offer the receiver cannot take (another host, another pid namespace): it says so and the sender, which
    filled the ring meanwhile, sends every chunk over the group instead."""
    from worker import shm

    monkeypatch.setattr(shm.Segment, "open", classmethod(lambda cls, offer: None))
    taken = paths_taken(monkeypatch)
    src, dst = big(1), big(2)
    a, b = pair()
    with cf.ThreadPoolExecutor(1) as ex:
        sent = ex.submit(transfer.send_state, a, src, {"step": 1})
        states, extra, moved, _ = transfer.recv_state(b, 0)
        assert sent.result()[0] == moved
    assert taken == ["recv_wire"]
    transfer.load_state(dst, states)
    assert same(flat_state(src), flat_state(dst))
    del a, b
    gc.collect()
    assert segments_open() == 0


def multistep(seed, steps):
    """An SGD optimizer and its MultiStepLR (whose state_dict holds a collections.Counter), ``steps`` steps in."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[2, 2, 5], gamma=0.5)
    for _ in range(steps):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        sched.step()
    return {"model": model, "optimizer": opt, "scheduler": sched}


def test_a_counter_travels_as_a_counter():
    """MultiStepLR keeps its milestones in a collections.Counter: it is sent and loaded back as a Counter with the
    same counts (a dict would lose Counter's 0 for a missing key)."""
    src, dst = multistep(1, 4), multistep(2, 0)
    a, b = pair()
    with cf.ThreadPoolExecutor(2) as ex:
        sent = ex.submit(transfer.send_state, a, src, {"c": collections.Counter({"x": 2})})
        states, extra, _, _ = transfer.recv_state(b, 0)
        sent.result()
    assert type(extra["c"]) is collections.Counter and extra["c"] == {"x": 2}
    transfer.load_state(dst, states)
    milestones = dst["scheduler"].state_dict()["milestones"]
    assert type(milestones) is collections.Counter and milestones == collections.Counter([2, 2, 5])
    assert same(flat_state(src), flat_state(dst))
    assert dst["scheduler"].last_epoch == 4 and dst["optimizer"].param_groups[0]["lr"] == 0.1 * 0.5 ** 2


@pytest.mark.parametrize("node", [{"c": "x"}, {"c": [[1]]}, {"c": [[{"l": [1]}, 2]]}, {"c": [[1, 2]], "m": {}}])
def test_a_malformed_counter_is_refused(node):
    with pytest.raises(transfer.TransferRefused):
        transfer.decode(node, transfer._no_tensor)


def test_every_builtin_optimizer_and_scheduler_state_round_trips_through_the_encoding():
    """A survey: the state_dicts of torch.optim's optimizers (after a step), its LR schedulers, GradScaler and
    SWALR encode, survive JSON and decode to the same values and container types (MultiStepLR and SequentialLR
    hold a collections.Counter)."""
    import inspect
    model = torch.nn.Linear(4, 2)
    objs = {}
    for name, cls in vars(torch.optim).items():
        if inspect.isclass(cls) and issubclass(cls, torch.optim.Optimizer) and name not in ("Optimizer", "LBFGS",
                                                                                          "SparseAdam"):
            opt = cls([model.weight]) if name == "Muon" else cls(model.parameters(), lr=0.01)
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
            objs[name] = opt
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    S = torch.optim.lr_scheduler
    objs.update(LambdaLR=S.LambdaLR(opt, lambda e: 0.9 ** e), StepLR=S.StepLR(opt, 2),
                MultiStepLR=S.MultiStepLR(opt, [2, 4]), CyclicLR=S.CyclicLR(opt, 0.01, 0.1),
                OneCycleLR=S.OneCycleLR(opt, 0.1, total_steps=100), Plateau=S.ReduceLROnPlateau(opt),
                CosineWarm=S.CosineAnnealingWarmRestarts(opt, 5), LinearLR=S.LinearLR(opt),
                Sequential=S.SequentialLR(opt, [S.ConstantLR(opt), S.MultiStepLR(opt, [3])], milestones=[2]),
                Chained=S.ChainedScheduler([S.ConstantLR(opt), S.ExponentialLR(opt, 0.9)]),
                GradScaler=torch.amp.GradScaler("cpu"), SWALR=torch.optim.swa_utils.SWALR(opt, swa_lr=0.05))

    def kinds(x):
        if isinstance(x, dict):
            return (type(x), [(k, kinds(v)) for k, v in x.items()])
        if isinstance(x, (list, tuple)):
            return (type(x), [kinds(v) for v in x])
        return (type(x), x.tolist() if isinstance(x, torch.Tensor) else x)

    tensors: list = []

    def ref(t):
        tensors.append(t)
        return {"r": len(tensors) - 1}

    for name, obj in objs.items():
        sd = obj.state_dict()
        back = transfer.decode(json.loads(json.dumps(transfer.encode(sd, ref))), lambda tag, i: tensors[i])
        assert repr(kinds(back)) == repr(kinds(sd)), name

"""The data plane executes nothing it receives (issue 10, item 3): a state-transfer peer that sends a malicious
header is refused before anything is parsed or allocated, nothing it sent runs, and the receiver's state is
untouched; real optimizer state still round-trips bit-identically. Also the job's secret store namespace (the
store itself: tests/unit/test_store.py).

Every transfer runs over a real 2-rank gloo group (both ends in one process, on two threads); the malicious peer
is rank 0 of that group, sending raw messages on the transfer's wire layout."""
import collections
import concurrent.futures as cf
import datetime
import itertools
import json
import math
import os
import pickle
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from tests.unit.test_transfer import flat_state, same, trained
from tmd.protocol.keys import KEYS_ENV, JobKeys, KeysUnavailable
from worker import backend, datapath, job_keys, transfer

pytestmark = pytest.mark.timeout(90)
_prefix = itertools.count()


@pytest.fixture(scope="module")
def other_keys(tmp_path_factory) -> JobKeys:
    """Another job's keys: a well-formed secret that is not this job's."""
    return JobKeys.create(str(tmp_path_factory.mktemp("other") / "keys"))


@pytest.fixture(autouse=True)
def no_env_keys(monkeypatch):
    monkeypatch.delenv(KEYS_ENV, raising=False)


def pair(timeout_s: float = 20.0):
    """Two connected ends (rank 0, rank 1) of a fresh gloo group."""
    store = dist.HashStore()
    prefix = f"s{next(_prefix)}"
    timeout = datetime.timedelta(seconds=timeout_s)
    with cf.ThreadPoolExecutor(2) as ex:
        a, b = ex.map(lambda r: dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), r, 2, timeout), [0, 1])
    return a, b


def send_raw(pg, message: bytes, length: int = None) -> None:
    """A malicious peer: the wire's length message, then ``message`` as the header message."""
    pg.send([torch.tensor([len(message) if length is None else length], dtype=torch.int64)], 1, 0).wait()
    if message:
        pg.send([torch.frombuffer(bytearray(message), dtype=torch.uint8)], 1, 1).wait()


def refused(raw: bytes = b"", keys=None, length: int = None, match: str = "") -> transfer.TransferRefused:
    """Send ``raw`` from a malicious rank 0, receive it on rank 1 with ``keys``; the receiver must refuse it.
    Returns the refusal."""
    a, b = pair()
    with cf.ThreadPoolExecutor(1) as ex:
        sent = ex.submit(send_raw, a, raw, length)
        with pytest.raises(transfer.TransferRefused, match=match) as e:
            transfer.recv_state(b, 0, keys=keys)
        sent.result(timeout=20)
    return e.value


def header_of(objects, extra, keys) -> tuple[dict, bytes]:
    """The header a real sender makes for ``objects`` (parsed JSON) and its MAC'd message."""
    captured = {}

    class Capture:
        def name(self):
            return "gloo"

        def send(self, tensors, dst, tag):
            captured.setdefault(tag, tensors[0].clone())  # tag 1: the header (the trailer comes later)
            return type("Done", (), {"wait": lambda self: True})()

    with mock.patch.dict(os.environ, {datapath.SHM_ENV: "0"}):  # a capture answers no shared-memory offer
        transfer.send_state(Capture(), objects, extra, keys=keys)
    message = captured[1].numpy().tobytes()
    return json.loads(message[transfer.MAC_BYTES:]), message


def signed(header: dict, keys: JobKeys) -> bytes:
    """``header`` MAC'd with ``keys``: what a member of the job (or a holder of its secret) can send."""
    data = json.dumps(header).encode()
    return keys.mac(data) + data


# --- round trip ---------------------------------------------------------------------------------------------------
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(6, 8)
        self.bn = torch.nn.BatchNorm1d(8)
        self.out = torch.nn.Linear(8, 3, dtype=torch.float64)

    def forward(self, x):
        return self.out(self.bn(self.lin(x)).double())


def training_objects(seed: int) -> dict:
    torch.manual_seed(seed)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.8, 0.95))
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.5, total_iters=2)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=5)
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [warm, cosine], milestones=[2])
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(sgd)  # holds best = inf
    for _ in range(seed + 1):
        model(torch.randn(4, 6)).sum().backward()
        opt.step()
        sgd.step()
        sched.step()
    return {"model": model, "optimizer": opt, "sgd": sgd, "scheduler": sched, "plateau": plateau}


def exact(a, b) -> bool:
    """Equal values of equal types all the way down (tuples stay tuples, int keys ints, nan is nan, -0.0 keeps its
    sign, tensors equal in dtype, shape and bits)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
            a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(type(k) is type(j) for k, j in zip(a, b)) \
            and all(exact(a[k], b[k]) for k in a) and exact(getattr(a, "_metadata", None), getattr(b, "_metadata", None))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(exact(x, y) for x, y in zip(a, b))
    return a == b


def test_real_optimizer_state_round_trips_bit_identically(keys):
    src, dst = training_objects(2), training_objects(0)
    assert not exact(src["optimizer"].state_dict(), dst["optimizer"].state_dict())
    extra = {"step": 7, "rng": torch.get_rng_state(), "rank_state": b"\x00\x80torch.save bytes\xff", "none": None,
             "nested": {1: (1.5, float("inf"), -float("inf"), float("nan"), -0.0, True, "s\ud800é"),
                        (2, "k"): [b"", 10 ** 30, -(2 ** 63)], None: collections.OrderedDict(a=1)},
             "empty": torch.zeros(0, 3, dtype=torch.bfloat16), "scalar": torch.tensor(3, dtype=torch.int16)}
    a, b = pair()
    with cf.ThreadPoolExecutor(1) as ex:
        sent = ex.submit(transfer.send_state, a, src, extra, 1, keys)
        states, got, moved, _ = transfer.recv_state(b, 0, transfer.pretouch(transfer.plan_buffers(dst)), keys=keys)
        assert sent.result()[0] == moved
    assert exact(extra, got)
    for name, obj in src.items():
        assert exact(obj.state_dict(), states[name]), name
    # int-keyed optimizer state, tuples and the model's OrderedDict with its _metadata survive as they were
    assert all(type(k) is int for k in states["optimizer"]["state"])
    assert type(states["optimizer"]["param_groups"][0]["betas"]) is tuple
    assert type(states["model"]) is collections.OrderedDict and states["model"]._metadata
    assert states["plateau"]["best"] == float("inf")
    transfer.load_state(dst, states)
    for name in src:
        assert exact(src[name].state_dict(), dst[name].state_dict()), name
    assert same(flat_state(src), flat_state(dst))


def test_values_the_encoding_does_not_take_are_refused_by_the_sender(keys):
    class Thing:
        pass

    for bad in (Thing(), collections.defaultdict(int), {1, 2}, torch.float32, 1j, bytearray(b"x")):
        with pytest.raises(TypeError, match="cannot be sent"):
            transfer.send_state(None, {}, {"x": bad}, keys=keys)  # refused before anything is sent


# --- malicious headers ----------------------------------------------------------------------------------------------
class Exploit:
    """Unpickling this creates ``path``: the marker that code from the network ran."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


@pytest.mark.parametrize("how", ["old wire format", "bogus MAC", "valid MAC"])
def test_pickle_payload_is_never_unpickled(keys, tmp_path, how):
    marker = tmp_path / "pwned"
    payload = pickle.dumps({"skeleton": {"model": Exploit(marker)}, "extra": Exploit(marker), "buffers": []})
    assert not marker.exists()
    message = {"old wire format": payload, "bogus MAC": os.urandom(32) + payload,
               "valid MAC": keys.mac(payload) + payload}[how]
    dst = training_objects(0)
    before = {name: obj.state_dict() for name, obj in dst.items()}
    refusal = refused(message, keys, match="MAC" if how != "valid MAC" else "not valid JSON")
    assert "pwned" not in str(refusal)
    assert not marker.exists(), "the receiver ran code it received"
    pickle.loads(payload)  # the payload is live: unpickling it does create the marker
    assert marker.exists()
    for name, obj in dst.items():
        assert exact(before[name], obj.state_dict())


def test_random_bytes_are_refused(keys):
    refused(os.urandom(4096), keys, match="MAC does not match")


def test_valid_json_with_a_forged_mac_is_refused(keys, other_keys):
    header, _ = header_of(trained(1), {"step": 1}, keys)
    refused(signed(header, other_keys), keys, match="MAC does not match")  # another job's secret
    data = json.dumps(header).encode()
    refused(b"\0" * 32 + data, keys, match="MAC does not match")  # a guess
    refused(transfer.hmac.new(b"\0" * 32, data, "sha256").digest() + data, keys,  # the key-less MAC
            match="MAC does not match")


def test_another_jobs_sender_is_refused_with_its_state(keys, other_keys):
    """A real sender holding another job's keys (or none) is refused, and the receiver's objects keep theirs."""
    for sender_keys in (other_keys, None):
        src, dst = trained(1), trained(2)
        before = flat_state(dst)
        a, b = pair(timeout_s=3)  # the refused sender waits in a send nobody receives until then
        with cf.ThreadPoolExecutor(1) as ex:
            ex.submit(transfer.send_state, a, src, {"step": 3}, 1, sender_keys)
            with pytest.raises(transfer.TransferRefused, match="MAC"):
                transfer.recv_state(b, 0, keys=keys)
        assert same(before, flat_state(dst))


@pytest.mark.parametrize("length", [1 << 40, transfer.MAC_BYTES + transfer.MAX_HEADER_BYTES + 1, 0, 5, -1])
def test_header_length_out_of_bounds_is_refused_before_allocating(keys, length):
    refused(b"", keys, length=length, match="state header of")


def tampered(keys, change) -> bytes:
    header, _ = header_of(training_objects(1), {"step": 1, "rng": torch.get_rng_state()}, keys)
    change(header)
    return signed(header, keys)


def _set(path, value):
    def change(header):
        node = header
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value
    return change


@pytest.mark.parametrize("change,match", [
    (_set(("buffers", 0, "numel"), 1 << 40), "differs from its shapes"),
    (_set(("buffers", 0, "shapes"), [[1 << 30, 1 << 30]]), "differs from its shapes"),
    (_set(("buffers", 0, "shapes", 0), [-1]), "bad shape"),
    (_set(("buffers", 0, "numel"), -4), "bad buffer entry"),
    (_set(("buffers", 0, "dtype"), "object"), "unknown dtype"),
    (_set(("buffers", 0, "dtype"), "torch.float32"), "unknown dtype"),
    (_set(("buffers", 0, "device"), "meta"), "bad device"),
    (_set(("buffers", 0, "device"), "cuda:0/../x"), "bad device"),
    (_set(("buffers", 0, "crc32"), 1), "bad buffer entry"),  # checksums travel in the trailer
    (_set(("data", "chunk"), 1), "bad data entry"),
    (lambda h: h["buffers"][0].update(numel=1 << 50, shapes=[[1 << 50]]), "more than"),  # no plan of 2^40 chunks
    (_set(("data", "chunk"), 1 << 40), "bad data entry"),
    (_set(("data", "extra_field"), 1), "bad data entry"),
    (_set(("data", "shm"), {"host": "x"}), "bad shared-memory offer"),
    (_set(("data", "shm"), {"host": "x", "pid": 1, "fd": 3, "nonce": "zz" * 32, "slots": 1,
                            "slot_bytes": 1 << 20}), "bad shared-memory offer"),
    (_set(("data", "shm"), {"host": "x", "pid": 1, "fd": 3, "nonce": "00" * 32, "slots": 1000,
                            "slot_bytes": 1 << 20}), "bad shared-memory offer"),
    (_set(("buffers", 0, "extra_field"), 1), "bad buffer entry"),
    (_set(("format",), transfer.FORMAT + 1), "unknown layout"),
    (_set(("format",), 1), "unknown layout"),  # the previous wire format (CRC32s in the header)
    (_set(("pickle",), "x"), "unknown layout"),
    (_set(("extra",), {"__reduce__": ["os.system", "touch x"]}), "unknown value tag"),
    (_set(("extra",), ["a raw list"]), "encode never makes"),
    (_set(("extra",), {"d": [[{"l": []}, 1]]}), "bad mapping key"),
    (_set(("extra",), {"r": [0, 0]}), "unknown value tag"),
    (_set(("extra",), {"T": {"dtype": "float32", "device": "cpu", "shape": [1000], "data": ""}}), "carries 0 bytes"),
    (_set(("extra",), {"T": {"dtype": "object", "device": "cpu", "shape": [], "data": ""}}), "unknown dtype"),
    (_set(("extra",), {"f": "not hex"}), "bad float"),
    (_set(("skeleton", "model"), {"r": [99, 0]}), "bad tensor reference"),
    (_set(("skeleton", "model"), {"r": [0, 10 ** 6]}), "bad tensor reference"),
    (_set(("skeleton", "model"), {"T": {"dtype": "uint8", "device": "cpu", "shape": [0], "data": ""}}),
     "bad tensor reference"),
])
def test_authenticated_but_malformed_header_is_refused(keys, change, match):
    """Even a holder of the job secret (a member gone wrong) cannot make the receiver allocate what the shapes do
    not account for, use an unknown dtype or device, or build anything but plain data."""
    dst = training_objects(0)
    before = {name: obj.state_dict() for name, obj in dst.items()}
    refused(tampered(keys, change), keys, match=match)
    for name, obj in dst.items():
        assert exact(before[name], obj.state_dict())


def test_deep_nesting_is_refused(keys):
    deep = {"l": []}
    for _ in range(200):
        deep = {"l": [deep]}
    refused(tampered(keys, _set(("extra",), deep)), keys, match="nested deeper")
    data = b'{"format":1,"skeleton":' + b"[" * 100000 + b"]" * 100000 + b',"extra":null,"buffers":[]}'
    refused(keys.mac(data) + data, keys, match="not valid JSON|unknown layout")


def test_forged_buffer_is_caught_by_the_authenticated_checksum(keys, monkeypatch):
    from tests.unit.test_transfer import CorruptingWire

    monkeypatch.setenv(datapath.SHM_ENV, "0")  # the bytes travel over the group, where CorruptingWire sits

    src, dst = trained(1), trained(2)
    before = flat_state(dst)
    a, b = pair()
    with cf.ThreadPoolExecutor(1) as ex:
        sent = ex.submit(transfer.send_state, CorruptingWire(a), src, {}, 1, keys)
        with pytest.raises(transfer.ChecksumError, match="failed its checksum"):
            transfer.recv_state(b, 0, keys=keys)
        sent.result()
    assert issubclass(transfer.ChecksumError, transfer.TransferRefused)
    assert issubclass(transfer.TransferRefused, RuntimeError)
    assert same(before, flat_state(dst))


# --- keys from the environment ------------------------------------------------------------------------------------
def test_keys_come_from_tm_keys(keys, other_keys, monkeypatch):
    src = trained(1)
    monkeypatch.setenv(KEYS_ENV, keys.path)
    assert job_keys.current().secret == keys.secret
    a, b = pair()
    with cf.ThreadPoolExecutor(1) as ex:
        sent = ex.submit(transfer.send_state, a, src, {"step": 1})  # env keys
        states, extra, _, _ = transfer.recv_state(b, 0, keys=keys)
        sent.result()
    assert extra == {"step": 1}
    a, b = pair(timeout_s=3)
    with cf.ThreadPoolExecutor(1) as ex:
        ex.submit(transfer.send_state, a, src, {"step": 1}, 1, other_keys)
        with pytest.raises(transfer.TransferRefused, match="MAC"):
            transfer.recv_state(b, 0)  # env keys
    monkeypatch.setenv(KEYS_ENV, "/nonexistent/keys")
    with pytest.raises(KeysUnavailable):
        transfer.recv_state(b, 0)  # never a silent downgrade to no keys


# --- the job's secret store namespace -----------------------------------------------------------------------------
def test_group_store_keys_live_below_the_jobs_secret_namespace(keys, monkeypatch):
    assert backend.store_prefix("tm/g1/world") == "tm/g1/world"  # no TM_KEYS: no namespace
    monkeypatch.setenv(KEYS_ENV, keys.path)
    namespace = keys.store_namespace
    assert namespace.startswith("tm-") and namespace[3:] not in keys.path
    assert backend.store_prefix("tm/g1/world") == f"{namespace}/tm/g1/world"
    store = dist.HashStore()
    timeout = datetime.timedelta(seconds=20)
    with cf.ThreadPoolExecutor(2) as ex:
        built = ex.submit(backend.build_gloo, store, "tm/g1/world", 0, 2, 20.0, "127.0.0.1")
        # a peer that rendezvouses under the namespaced prefix meets it: that is where the keys are
        peer = dist.ProcessGroupGloo(dist.PrefixStore(f"{namespace}/tm/g1/world", store), 1, 2, timeout)
        pg = built.result()
    t = torch.ones(2)
    work = [pg.allreduce([t]), peer.allreduce([torch.ones(2)])]
    for w in work:
        w.wait()
    assert t.tolist() == [2.0, 2.0]

"""The job's rendezvous store (issue 33): tmd.store's server and its bounds, worker.store's c10d client over CURVE.

Server and clients run in this process (the server on its own thread, as in tmd); gloo groups set up through the
store have their ranks on threads. The attack by another local user on a real job is tests/e2e/test_security.py.
"""
import datetime
import itertools
import os
import socket
import threading
import time

import pytest
import torch
import torch.distributed as dist
import zmq
import zmq.auth

from tmd.protocol import store as ps
from tmd.protocol.keys import JobKeys, KeysUnavailable
from tmd.protocol.vocab import Sender
from tmd.store import StoreError, StoreServer, StoreState
from worker import backend
from worker.store import JobStore

pytestmark = pytest.mark.timeout(60)
_prefix = itertools.count()


@pytest.fixture(scope="module")
def worker_keys(keys) -> JobKeys:
    """What a rank holds (TM_KEYS): the worker key pair, tmd's public key, the job secret."""
    return JobKeys.load(keys.worker_keys(), parties=(Sender.WORKER,))


@pytest.fixture
def server(keys):
    srv = StoreServer("127.0.0.1", keys)
    yield srv
    srv.stop()


@pytest.fixture
def store(server, worker_keys) -> JobStore:
    return JobStore("127.0.0.1", server.port, 5.0, worker_keys)


# --- the state and its bounds ------------------------------------------------------------------------------------
def test_bounds_refuse_and_store_nothing():
    st = StoreState(max_keys=3, max_value_bytes=8, max_stored_bytes=20, max_waiters=1)
    with pytest.raises(StoreError, match="at most 8 bytes, not 9"):
        st.put(b"k", b"x" * 9)
    with pytest.raises(StoreError, match="1 to 512 bytes"):
        st.put(b"k" * 513, b"")
    st.put(b"a", b"12345678")  # 9 bytes held
    st.put(b"b", b"1234567")  # 17
    with pytest.raises(StoreError, match="maximum of 20 bytes"):
        st.put(b"c", b"123")  # would be 21
    st.put(b"c", b"1")  # 19
    with pytest.raises(StoreError, match="maximum of 3 keys"):
        st.put(b"d", b"")
    st.put(b"a", b"")  # replacing a key is no new key (and frees its bytes)
    assert (len(st.data), st.stored_bytes) == (3, 11)
    assert st.block(b"id", b"r1", ps.GET, [b"x"], 1000, 0.0) is not None
    with pytest.raises(StoreError, match="1 store requests are blocked already"):
        st.block(b"id", b"r2", ps.GET, [b"y"], 1000, 0.0)
    assert st.expired(0.5) == [] and len(st.expired(1.0)) == 1 and st.waiters == 0


def test_add_and_compare_set_are_c10d_s():
    st = StoreState()
    assert st.add(b"n", b"3")[0] == b"3" and st.add(b"n", b"-5")[0] == b"-2"
    with pytest.raises(StoreError, match="not an integer"):
        st.add(b"n", b"x")
    assert st.compare_set(b"c", b"e", b"d")[0] == b"e" and b"c" not in st.data  # missing, expected not empty
    assert st.compare_set(b"c", b"", b"d")[0] == b"d"  # missing, expected empty: set
    assert st.compare_set(b"c", b"x", b"y")[0] == b"d"  # mismatch: the value now
    assert st.compare_set(b"c", b"d", b"y")[0] == b"y"


def test_a_setup_s_keys_go_once_every_member_released_it():
    st = StoreState()
    for key in (b"ns/tm/snap/1/0-1/0/0", b"ns/tm/snap/1/0-1/0/1", b"ns/tm/snap/1/0-10/0/0", b"ns/other"):
        st.put(key, b"v")
    st.release(b"ns/tm/snap/1/0-1", b"2")
    assert len(st.data) == 4 and st.done == {b"ns/tm/snap/1/0-1": 1}
    st.release(b"ns/tm/snap/1/0-1", b"2")
    assert sorted(st.data) == [b"ns/other", b"ns/tm/snap/1/0-10/0/0"] and st.done == {}  # not a sibling prefix's


def test_a_read_brings_the_keys_that_follow_it():
    st = StoreState()
    for r in (0, 1, 2, 3):
        st.put(f"p/0/{r}".encode(), bytes([r]))
    st.put(b"q/0", b"other parent")
    assert st.read([b"p/0/1"]) == [b"p/0/1", b"\x01", b"p/0/2", b"\x02", b"p/0/3", b"\x03"]


# --- the store served over CURVE ------------------------------------------------------------------------------------
def test_c10d_operations(store):
    store.set("a", b"1")
    assert store.get("a") == b"1"
    assert store.add("n", 4) == 4 and store.add("n", 1) == 5 and store.get("n") == b"5"
    assert store.compare_set("c", b"", b"v") == b"v" and store.compare_set("c", b"q", b"w") == b"v"
    assert store.check(["a", "n"]) and not store.check(["a", "missing"])
    store.wait(["a", "c"])
    assert store.num_keys() == 3
    assert store.delete_key("c") and not store.delete_key("c")
    assert store.num_keys() == 2
    started = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="timed out waiting for missing"):
        store.wait(["missing"], datetime.timedelta(seconds=0.3))
    assert 0.25 < time.monotonic() - started < 3.0
    assert store.get("a") == b"1"  # the connection goes on after a timeout


def test_a_get_blocks_until_another_connection_sets_the_key(server, worker_keys, store):
    other = JobStore("127.0.0.1", server.port, 5.0, worker_keys)
    got = []
    reader = threading.Thread(target=lambda: got.append(store.get("later")))
    reader.start()
    time.sleep(0.1)
    other.set("later", "here")
    other.num_keys()  # (the pipelined set is answered before this)
    reader.join(5.0)
    assert got == [b"here"]


def test_refusals_say_why_and_store_nothing(keys, worker_keys):
    srv = StoreServer("127.0.0.1", keys, state=StoreState(max_keys=2))
    try:
        st = JobStore("127.0.0.1", srv.port, 5.0, worker_keys)
        with pytest.raises(dist.DistStoreError, match=f"at most {ps.MAX_VALUE_BYTES} bytes"):
            st.set("big", b"x" * (ps.MAX_VALUE_BYTES + 1))
        st.set("k1", "v")
        st.set("k2", "v")
        st.set("k3", "v")  # pipelined: refused by the store, said at the next request
        with pytest.raises(dist.DistStoreError, match="an earlier set was refused: .*maximum of 2 keys"):
            st.num_keys()
        assert st.num_keys() == 2 and srv.refused == 1
    finally:
        srv.stop()


def test_a_blocked_get_holds_only_its_own_thread(store):
    blocked = threading.Thread(target=lambda: pytest.raises(dist.DistStoreError, store.wait, ["never"],
                                                            datetime.timedelta(seconds=1)), daemon=True)
    blocked.start()
    time.sleep(0.1)
    started = time.monotonic()
    store.set("x", "1")
    assert store.get("x") == b"1" and time.monotonic() - started < 1.0
    blocked.join(5.0)


def test_gloo_groups_set_up_through_it_and_their_keys_go_when_released(server, store):
    """Three gloo ranks (threads) meet in the store, all-reduce, release their groups: the setup's keys go."""
    prefix = f"test/g{next(_prefix)}"
    built = {}

    def rank(r):
        built[r] = backend.build_inner(store, prefix, r, 3, 20.0, "127.0.0.1")

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    [t.start() for t in threads]
    [t.join(20.0) for t in threads]
    assert len(server.state.data) == 3  # one key per rank
    tensors = [torch.full((2,), float(r)) for r in range(3)]
    for w in [built[r].allreduce([tensors[r]]) for r in range(3)]:
        w.wait()
    assert all(t.tolist() == [3.0, 3.0] for t in tensors)
    for r in range(3):
        backend.release_in_background(built[r])
    store.num_keys()  # (the releases were sent before it on this thread)
    assert server.state.data == {} and server.state.done == {}
    backend.wait_for_background(10.0)


def _dealer(server, public: bytes, secret: bytes, server_key: bytes) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = public, secret, server_key
    sock.connect(f"tcp://127.0.0.1:{server.port}")
    return sock


def test_strangers_and_other_roles_get_nothing(server, keys, tmp_path):
    """A made-up key, tmctl's key, a plain socket: no answer, nothing stored; then the real worker key works."""
    stranger = zmq.auth.create_certificates(str(tmp_path), "stranger")[1]
    pairs = [zmq.auth.load_certificate(stranger),
             zmq.auth.load_certificate(os.path.join(keys.path, "client.key_secret")),
             zmq.auth.load_certificate(os.path.join(keys.path, "hook.key_secret"))]
    socks = [_dealer(server, pub, sec, keys.public(Sender.COORDINATOR)) for pub, sec in pairs]
    plain = zmq.Context.instance().socket(zmq.DEALER)
    plain.setsockopt(zmq.LINGER, 0)
    plain.connect(f"tcp://127.0.0.1:{server.port}")
    socks.append(plain)
    for sock in socks:
        sock.send_multipart([b"12345678", ps.SET, b"1000", b"planted", b"x"])
        sock.send_multipart([b"12345679", ps.NUM_KEYS, b"1000"])
    poller = zmq.Poller()
    for sock in socks:
        poller.register(sock, zmq.POLLIN)
    assert poller.poll(1500) == []
    assert server.served == 0 and server.state.data == {}
    worker = _dealer(server, *zmq.auth.load_certificate(os.path.join(keys.path, "worker.key_secret")),
                     keys.public(Sender.COORDINATOR))
    worker.send_multipart([b"12345679", ps.NUM_KEYS, b"1000"])
    assert worker.poll(5000) and worker.recv_multipart() == [b"12345679", ps.OK, b"0"]
    for sock in (*socks, worker):
        sock.close()


def test_an_oversized_frame_is_dropped_unread(server, keys, store):
    sock = _dealer(server, *zmq.auth.load_certificate(os.path.join(keys.path, "worker.key_secret")),
                   keys.public(Sender.COORDINATOR))
    sock.send_multipart([b"12345678", ps.SET, b"1000", b"huge", b"x" * (8 << 20)])
    assert not sock.poll(1500)  # disconnected by ZMQ_MAXMSGSIZE before the store read it
    sock.close()
    assert server.state.data == {} and store.num_keys() == 0



@pytest.mark.parametrize("request_frames, says", [
    ([ps.WAIT, b"100", *(b"k%d" % i for i in range(1030))], b"a store request may name at most 1024 keys, not 1030"),
    ([ps.DELETE, b"1000", b""], b"a store key must be 1 to 512 bytes, not 0"),
    ([ps.GET, b"-5", b"k"], b"store b'get': its timeout must be 0 to 86400000 ms, not -5"),
    ([ps.GET, b"soon", b"k"], b"store b'get': its timeout (ms) is missing or not an integer"),
    ([ps.NUM_KEYS], b"store b'num': its timeout (ms) is missing or not an integer"),
    ([ps.GET, b"1000", b"k", b"l"], b"malformed store request b'get' with 2 arguments"),
])
def test_every_refused_request_is_answered_with_the_bound_it_breaks(server, keys, request_frames, says):
    """A wait for 1030 keys (over the 1024 a request may name) got no answer at all; an empty key was deleted
    (``ok 0``) where done refuses it; a negative timeout was called a malformed request "with 1 arguments"."""
    sock = _dealer(server, *zmq.auth.load_certificate(os.path.join(keys.path, "worker.key_secret")),
                   keys.public(Sender.COORDINATOR))
    sock.send_multipart([b"12345678", *request_frames])
    assert sock.poll(5000), "no answer"
    assert sock.recv_multipart() == [b"12345678", ps.ERR, says]
    sock.close()
    assert server.refused == 1 and server.state.data == {} and server.state.waiters == 0


def test_a_client_without_the_worker_key_fails_at_once(server, keys, tmp_path):
    tmctl_keys = JobKeys.load(keys.path, parties=(Sender.CLIENT,))
    with pytest.raises(KeysUnavailable, match="no worker secret key"):
        JobStore("127.0.0.1", server.port, 5.0, tmctl_keys)


def _primary_ip():
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))
            ip = s.getsockname()[0]
        return None if ip.startswith("127.") else ip
    except OSError:
        return None


def _can_bind(host):
    try:
        with socket.socket() as s:
            s.bind((host, 0))
        return True
    except OSError:
        return False


def test_the_store_listens_on_its_one_address_only(keys):
    host = "127.0.0.2" if _can_bind("127.0.0.2") else "127.0.0.1"
    others = [h for h in ("127.0.0.1", _primary_ip()) if h and h != host]
    if not others:
        pytest.skip("no second local address to try")
    srv = StoreServer(host, keys)
    try:
        for other in others:
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection((other, srv.port), timeout=5).close()
    finally:
        srv.stop()


def test_the_store_refuses_an_address_of_another_host(keys):
    with pytest.raises(zmq.ZMQError):
        StoreServer("192.0.2.123", keys)  # TEST-NET-1: not an address of this host

"""Attacks on a running job's control plane (issue 10): strangers, forged workers, other users and a fuzz of
tmd's socket have no effect on the job.

One local job (2 nodes x 2 ranks, standby s1, a tiny GPT) serves the module's tests, in order:

1. attacks while it trains:
   - unauthenticated senders (a plain ZeroMQ DEALER, and a CURVE client with a key of its own) send a migrate
     request, forged worker messages under a worker's old predictable identity (``n2/0``) and an add-standby
     request: none gets a reply, none reaches the journal;
   - the job's own client key sending worker messages (Done, a collective failure report) is refused by role;
   - a process with the job's worker key that claims to be a registered worker is refused, and the real one
     goes on;
   - a process of another uid (nobody) can read neither the run directory nor the keys, and cannot command the
     job;
   - the same uid nobody cannot use the job's rendezvous store (issue 33): c10d's TCPStore client, a plain ZeroMQ
     socket and a CURVE client with a key of its own (pinning tmd's real public key) get no answer, 24 values of
     8 MiB over each (and 8 over raw TCP) leave tmd's RSS flat and store nothing; and it cannot block the status page:
     while it keeps 40 idle connections open (topping them up as tmd closes them), the token holder's scrapes of
     ``/metrics`` are answered at once;
2. a bounded fuzz: ~2,400 bad frames reach tmd from authenticated senders (the job's client and worker keys) and
   unauthenticated ones (a plain DEALER; a CURVE client with a key of its own): random bytes, truncated messages,
   deep nesting, huge numbers, lone surrogates, wrong field types, unknown kinds, three 50 MB frames, and rapid
   connect/disconnect. Asserted: tmd stays up and nothing in it crashed, steps keep advancing, ``tmctl status``
   answers, tmd's RSS grows by less than 20 MB and the journal stays bounded. Fixed seed;
3. the job ends with exit code 0, no migration, failure or recovery in its journal, and every rank's final state
   bit-identical to an uninterrupted run.

The rogue-coordinator attack is in tests/e2e/test_tmd_restart.py (it needs tmd down).
"""
from __future__ import annotations

import http.client
import json
import os
import random
import subprocess
import sys
import time

import psutil
import pytest
import zmq

from tmctl.localjob import (end_job, end_padding, events, final_hashes, job_client, pace_args, start_tmd, tmd_command,
                            tmd_log, wait_until)
from tmd import protocol as p
from tmd.protocol.keys import JobKeys
from tmd.protocol.vocab import Event, Sender

STEPS = 400  # the uninterrupted run is shared (tests/e2e/conftest.py) with test_migration and test_tmd_restart
# Pads every step (numerics unchanged) so that the job outlives the attacks and the fuzz even on a quiet machine:
# 400 x 0.1 s = 40 s, against about 17 s for all of them from step 5 on a quiet machine (a natural step, 0.05-0.06 s
# on 2 cores), and more on a loaded one.
ARGS = ("--min-step-time-s", "0.1")
NOBODY = 65534
SEED = 20261123
BIG_FRAME_BYTES = 50 * 1024 * 1024
RSS_GROWTH_BYTES = 20 * 1024 * 1024


def dealer(address: str, identity: bytes | None = None, keys: JobKeys | None = None,
           party: p.Sender | None = None, stranger: bool = False) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if identity:
        sock.setsockopt(zmq.IDENTITY, identity)
    if stranger:  # a CURVE client with a key pair of its own, pinning tmd's real public key
        public, secret = zmq.curve_keypair()
        sock.curve_publickey, sock.curve_secretkey = public, secret
        sock.curve_serverkey = keys.public(p.Sender.COORDINATOR)
    elif keys is not None:
        keys.connect_as(sock, party)
    sock.connect(address)
    return sock


FORGED = [
    p.MigrateRequest(sources=["n2"], targets=["s1"]),
    p.AddStandbyRequest(node="s9"),
    p.EventsRequest(after=0, limit=10),
    p.Done(rank=2, final_step=5, left=False),
    p.RecoveryReport(incident_id=0, rank=2, phase=p.RecoveryPhase.COLLECTIVE_FAILED, ok=False, error="forged",
                     committed_step=-1, bytes_moved=0, seconds=0.0),
    p.Heartbeat(step=1, counters={"xid": 79}),
]


def as_nobody(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *argv],
                          capture_output=True, text=True, timeout=60, cwd="/", env={**os.environ, **(env or {})})


def _message_bodies() -> list[dict]:
    """One valid body per message type (what the wrong-type and truncation generators start from)."""
    samples = [
        p.Register(node="n1", local_rank=0, pid=1, host="h", standby=False),
        p.Heartbeat(step=1, counters={"ops_issued": 1, "busy_s": 0.5, "gpu": {"temperature_c": 40, "xids": []}}),
        p.StepReport(rank=0, step=1, step_time_s=0.1, shadow=False),
        p.PhaseDone(migration_id=1, rank=0, phase=p.MigrationPhase.PREPARED, ok=True, error="", step=0,
                    bytes_moved=0, seconds=0.0, groups=["world"]),
        p.RecoveryReport(incident_id=1, rank=0, phase=p.RecoveryPhase.HALTED, ok=True, error="", committed_step=0,
                         bytes_moved=0, seconds=0.0),
        p.Done(rank=0, final_step=1, left=False),
        p.RankWarning(rank=0, code=list(p.WarningCode)[0], message="m"),
        p.StatusRequest(), p.MigrateRequest(sources=["n1"], targets=["s1"]), p.MigrationRequest(migration_id=-1),
        p.AddStandbyRequest(node="s9"), p.EventsRequest(after=0, limit=5),
        p.NodeNotice(node="n1", job_id="1", hook=p.HookKind.EPILOG, detail=""),
        p.Halt(incident_id=1, reason="r", failed_ranks=[1]), p.Release(reason="r", exit_code=0),
    ]
    return [json.loads(p.encode(m)) for m in samples]


WRONG_VALUES = [None, True, -1, 10 ** 30, 1.5, "x", "\ud800", [], [1, "a"], {}, {"a": [{}]}, "a" * 300]


def bad_frames(rng: random.Random) -> list[bytes]:
    """~2,400 frames, none of them a valid message (each category at least 200)."""
    bodies = _message_bodies()
    frames: list[bytes] = []
    for _ in range(300):  # random bytes
        frames.append(rng.randbytes(rng.randint(0, 2000)))
    for _ in range(300):  # truncated valid messages
        good = json.dumps(rng.choice(bodies)).encode()
        frames.append(good[:rng.randrange(len(good))])
    for _ in range(200):  # deep nesting
        depth = rng.choice([17, 100, 1000, 10_000, 100_000])
        open_, close = rng.choice([(b"[", b"]"), (b'{"a":', b"}")])
        frames.append(open_ * depth + (b"1" + close * depth if rng.random() < 0.5 else b""))
    for _ in range(300):  # huge numbers
        body = dict(rng.choice(bodies))
        field = rng.choice([k for k in body if k not in ("v", "type")] or ["v"])
        raw = rng.choice([b"9" * rng.randint(20, 6000), b"-" + b"9" * 25, b"1e999", b"-1e999", b"NaN", b"Infinity"])
        frames.append(json.dumps({**body, field: "@@"}).encode().replace(b'"@@"', raw))
    for _ in range(300):  # lone surrogates, in names and free text, escaped and raw (CESU-8)
        body = dict(rng.choice(bodies))
        field = rng.choice([k for k in body if k not in ("v", "type")] or ["type"])
        raw = rng.choice([b'"\\ud800"', b'"n\\udfff1"', b'"\xed\xa0\x80"', b'"\xff"', b'"a\\ud83d"'])
        frames.append(json.dumps({**body, field: "@@"}).encode().replace(b'"@@"', raw))
    for _ in range(600):  # wrong field types (never a valid message: the value is wrong for the field)
        body = dict(rng.choice(bodies))
        fields = [k for k in body if k not in ("v", "type")]
        if not fields:
            body["extra"] = 1
        for field in rng.sample(fields, min(len(fields), rng.randint(1, 3))):
            body[field] = rng.choice([v for v in WRONG_VALUES if type(v) is not type(body[field])])
        frames.append(json.dumps(body).encode("utf-8", "surrogatepass"))
    for _ in range(200):  # unknown kinds, other versions
        body = dict(rng.choice(bodies))
        if rng.random() < 0.5:
            body["type"] = rng.choice(["Reboot", "Exec", "", "status_request", "Message", "__init__", 7, None])
        else:
            body["v"] = rng.choice([0, 2, "1", None, 1.0000001])
        frames.append(json.dumps(body).encode())
    for _ in range(200):  # valid JSON, not an object; strings where a body belongs
        frames.append(json.dumps(rng.choice([[], [1], "StatusRequest", 1, None, True, 3.5])).encode())
    rng.shuffle(frames)
    return frames


def fuzz_dealer(ctx: zmq.Context, address: str, keys: JobKeys, how: str, rng: random.Random) -> zmq.Socket:
    """A DEALER to tmd: ``client``/``worker`` authenticated with the job's keys, ``plain`` without CURVE, ``stranger``
    a CURVE client with a key pair of its own (pinning tmd's real public key)."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 100_000)
    if how == "client":
        keys.connect_as(sock, Sender.CLIENT)
    elif how == "worker":
        keys.connect_as(sock, Sender.WORKER)
        sock.setsockopt(zmq.IDENTITY, f"n{rng.randint(1, 2)}/{rng.randint(0, 1)}/{rng.getrandbits(64):016x}".encode())
    elif how == "stranger":
        public, secret = zmq.curve_keypair()
        sock.curve_secretkey, sock.curve_publickey = secret, public
        sock.curve_serverkey = keys.public(Sender.COORDINATOR)
    sock.connect(address)
    return sock


def answers_status(sock: zmq.Socket, timeout_s: float = 30.0) -> bool:
    """Send a StatusRequest on ``sock`` (frames on one connection are handled in order: an answer means every
    frame sent before it was handled) and wait for its StatusReply, skipping other replies."""
    sock.send(p.encode(p.StatusRequest()))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not sock.poll(int(max(0.0, deadline - time.monotonic()) * 1000)):
            return False
        if isinstance(p.decode(sock.recv()), p.StatusReply):
            return True
    return False


@pytest.fixture(scope="module")
def job(tmp_path_factory, gpt_reference):
    """The attacked job: {"proc", "run_dir", "client", "status", "reference"}, training with a warm s1."""
    reference = gpt_reference(STEPS)  # before the job: never alongside it
    run_dir = str(tmp_path_factory.mktemp("security") / "job")
    proc = start_tmd(tmd_command(run_dir, 1, STEPS, True, True, ARGS + pace_args(run_dir)), tmd_log(run_dir))
    try:
        client = job_client(run_dir, proc)
        status = lambda: client.request(p.StatusRequest())  # noqa: E731
        wait_until(lambda: status().step > 5 and any(n["warm"] for n in status().nodes), 120, "training, warm s1")
        yield {"proc": proc, "run_dir": run_dir, "client": client, "status": status, "reference": reference}
    finally:
        end_job(proc)


@pytest.mark.timeout(240)  # includes the module's job start (and the shared reference, unless cached)
def test_attacks_have_no_effect_on_the_job(job):
    run_dir, status = job["run_dir"], job["status"]
    address = job["client"].address
    keys = JobKeys.load(os.path.join(run_dir, "keys"))

    # 1. strangers: nothing they send is answered or acted on
    for sock in (dealer(address, b"n2/0"), dealer(address, b"n2/0", keys, stranger=True)):
        for msg in FORGED:
            try:
                sock.send(p.encode(msg), zmq.NOBLOCK)
            except zmq.Again:  # its handshake failed: no connection left to queue for (a blocking send hangs)
                pass
        assert sock.poll(1500) == 0, "a stranger got a reply"
        sock.close()
    # 2. the job's client key may send requests only
    sock = dealer(address, b"n2/0", keys, p.Sender.CLIENT)
    for msg in FORGED[3:]:
        sock.send(p.encode(msg))
    sock.send(p.encode(p.StatusRequest()))  # answered once the forged ones were handled (one connection: FIFO)
    replies = []
    while not replies or not isinstance(replies[-1], p.StatusReply):
        assert sock.poll(20_000), replies
        replies.append(p.decode(sock.recv()))
    # each worker message refused in one line, to the client that waits for an answer; acted on: none
    assert [(r.code, r.message) for r in replies[:-1]] == [
        (p.ErrorCode.BAD_REQUEST, f"{m.TYPE} is a worker message; this connection is authenticated as a client")
        for m in FORGED[3:]]
    sock.close()
    # 3. the job's worker key claiming a registered worker's place
    sock = dealer(address, b"n2/0/forged", keys, p.Sender.WORKER)
    sock.send(p.encode(p.Register(node="n2", local_rank=0, pid=4242, host="elsewhere", standby=False)))
    assert sock.poll(20_000)
    reply = p.decode(sock.recv())
    assert isinstance(reply, p.Release) and reply.exit_code == p.ExitCode.REFUSED
    sock.send(p.encode(p.Done(rank=2, final_step=5, left=False)))  # still nobody: refused
    sock.close()
    # 4. another user: cannot read the run directory or the keys, cannot talk to the job
    r = as_nobody(sys.executable, "-m", "tmctl.cli", "status", "--run-dir", run_dir, "--timeout", "1")
    assert r.returncode == 2 and "Permission denied" in r.stderr, r
    r = as_nobody("cat", os.path.join(run_dir, "keys", "client.key_secret"))
    assert r.returncode != 0 and "Permission denied" in r.stderr, r
    r = as_nobody(sys.executable, "-m", "tmctl.cli", "migrate", "--from", "n2", "--to", "s1",
                  "--coordinator", address, "--timeout", "1", env={"TM_KEYS": ""})
    assert r.returncode == 2 and "authentication failed" in r.stderr, r
    r = as_nobody(sys.executable, "-m", "tmctl.cli", "status", "--coordinator", address, "--timeout", "1",
                  env={"TM_KEYS": os.path.join(run_dir, "keys")})
    assert r.returncode == 2 and "cannot read the job's keys" in r.stderr, r

    st = status()
    assert all(n["health"] == p.Health.HEALTHY for n in st.nodes if n["role"] == p.NodeRole.ACTIVE)
    assert st.migration is None
    assert job["proc"].poll() is None, "the job ended during the attacks: raise ARGS' padding"


# Run as uid nobody: the store attacks of issue 33, then idle connections held to the status page for HOLD_S s.
NOBODY_ATTACKS = """
import datetime, json, socket, sys, time
import zmq
host, store_port, tmd_public, web_port, hold_s = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), \
    float(sys.argv[5])
out = {}
try:  # c10d's TCPStore client, which reached the old store
    import torch.distributed as dist
    dist.TCPStore(host, store_port, is_master=False, timeout=datetime.timedelta(seconds=3)).set("planted", "x")
    out["tcpstore"] = "set"
except Exception as e:
    out["tcpstore"] = type(e).__name__
ctx = zmq.Context()
socks = {"plain": ctx.socket(zmq.DEALER), "curve": ctx.socket(zmq.DEALER)}
public, secret = zmq.curve_keypair()
socks["curve"].curve_publickey, socks["curve"].curve_secretkey = public, secret
socks["curve"].curve_serverkey = tmd_public.encode()
big = b"x" * (8 << 20)
for name, sock in socks.items():
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{host}:{store_port}")
    frames = [[b"r" * 8, b"num", b"1000"], [b"s" * 8, b"set", b"1000", b"planted", b"x"],
              *([b"b" * 8, b"set", b"1000", b"big%d" % i, big] for i in range(24))]
    for frame in frames:
        try:
            sock.send_multipart(frame, zmq.NOBLOCK)
        except zmq.Again:
            pass
poller = zmq.Poller()
for sock in socks.values():
    poller.register(sock, zmq.POLLIN)
out["replies"] = len(poller.poll(3000))
out["raw_refused"] = 0
for i in range(8):  # raw TCP, no ZeroMQ greeting
    try:
        with socket.create_connection((host, store_port), timeout=1) as c:
            c.sendall(big)
    except OSError:
        out["raw_refused"] += 1
print(json.dumps(out), flush=True)
held, closed = [], 0
deadline = time.monotonic() + hold_s
while time.monotonic() < deadline:
    alive = []
    for c in held:
        try:
            if c.recv(1, socket.MSG_DONTWAIT) == b"":
                closed += 1
                c.close()
                continue
        except BlockingIOError:
            pass
        except OSError:  # reset by tmd
            closed += 1
            c.close()
            continue
        alive.append(c)
    held = alive + [socket.create_connection((host, web_port)) for _ in range(40 - len(alive))]
    time.sleep(0.1)
print(json.dumps({"held": len(held), "closed_by_tmd": closed}), flush=True)
"""
HOLD_S = 4.0


@pytest.mark.timeout(120)
def test_another_user_can_neither_use_the_store_nor_block_the_page(job):
    """Issue 33, items 2 and 4, as uid nobody against the running job."""
    import urllib.parse
    import urllib.request

    from worker.store import JobStore

    run_dir, proc = job["run_dir"], job["proc"]
    keys = JobKeys.load(os.path.join(run_dir, "keys"))
    started = next(e for e in events(run_dir) if e["event"] == Event.TMD_STARTED)
    with open(os.path.join(run_dir, "tmd.json")) as f:
        web = json.load(f)["web"]
    with open(web["token_file"]) as f:
        token = f.read().strip()
    url = urllib.parse.urlsplit(web["url"])
    tmd = psutil.Process(proc.pid)
    rss_before = tmd.memory_info().rss
    attacker = subprocess.Popen(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", sys.executable, "-c", NOBODY_ATTACKS,
         url.hostname, str(started["store_port"]), keys.public(Sender.COORDINATOR).decode(), str(url.port),
         str(HOLD_S)], stdout=subprocess.PIPE, text=True, cwd="/")
    try:
        store_attacks = json.loads(attacker.stdout.readline())
        scrapes = []
        while attacker.poll() is None and len(scrapes) < 8:  # while nobody holds its 40 connections
            time.sleep(0.4)
            t0 = time.monotonic()
            # the scraper is another host than nobody's (as Prometheus would be): its own loopback address, so
            # the page's per-address limit on unauthenticated connections counts nobody's 40, not this one
            scrape = http.client.HTTPConnection(url.hostname, url.port, timeout=10, source_address=("127.0.0.2", 0))
            try:
                scrape.request("GET", url.path + "metrics", headers={"Authorization": f"Bearer {token}"})
                r = scrape.getresponse()
                scrapes.append((r.status, time.monotonic() - t0, b"trainmover_" in r.read()))
            finally:
                scrape.close()
        web_attack = json.loads(attacker.stdout.readline())
        assert attacker.wait(30) == 0
    finally:
        if attacker.poll() is None:
            attacker.kill()
    # the store: nothing answered, nothing stored, tmd's memory flat
    assert store_attacks["tcpstore"] != "set" and store_attacks["replies"] == 0, store_attacks
    assert store_attacks["raw_refused"] >= 6, store_attacks  # the greeting is refused: most sends fail
    grown = tmd.memory_info().rss - rss_before
    assert grown < RSS_GROWTH_BYTES, f"tmd's RSS grew by {grown / 2**20:.1f} MiB"
    store = JobStore(url.hostname, started["store_port"], 10.0,
                     JobKeys.load(os.path.join(run_dir, "keys", "worker"), parties=(Sender.WORKER,)))
    assert not store.check(["planted"]) and not any(store.check([f"big{i}"]) for i in range(24))
    # the page: every scrape answered at once while nobody held 40 idle connections, which tmd kept closing
    assert len(scrapes) >= 5 and all(code == 200 and took < 2.0 and ok for code, took, ok in scrapes), scrapes
    assert web_attack["held"] == 40 and web_attack["closed_by_tmd"] >= 40, web_attack
    print(f"[nobody] store: {store_attacks}; tmd RSS +{grown / 2**20:.1f} MiB; page: {web_attack}, scrapes "
          f"{[round(t, 3) for _, t, _ in scrapes]} s", flush=True)
    assert proc.poll() is None, "the job ended during the attacks: raise ARGS' padding"


@pytest.mark.timeout(180)
def test_fuzzing_tmd_leaves_the_job_untouched(job):
    run_dir, proc, status = job["run_dir"], job["proc"], job["status"]
    address = job["client"].address
    keys = JobKeys.load(os.path.join(run_dir, "keys"))
    tmd = psutil.Process(proc.pid)
    rss_before = tmd.memory_info().rss
    step_before = status().step
    bad_before = [e["event"] for e in events(run_dir)].count(Event.BAD_MESSAGE)  # the attacks' own
    rng = random.Random(SEED)
    frames = bad_frames(rng)
    ctx = zmq.Context()
    hows = ["client", "worker", "plain", "stranger"]
    started = time.monotonic()
    socks = {how: fuzz_dealer(ctx, address, keys, how, rng) for how in hows}
    unsent = 0  # an unauthenticated socket's handshake fails: it has no peer to queue for, at some point
    for i, frame in enumerate(frames):
        how = hows[i % len(hows)]
        try:
            if i % 97 == 0:  # sometimes two frames in one message
                socks[how].send_multipart([frame, frame[:10]], zmq.NOBLOCK)
            else:
                socks[how].send(frame, zmq.NOBLOCK)
        except zmq.Again:
            assert how in ("plain", "stranger")
            unsent += 1
    for _ in range(3):  # over ZMQ_MAXMSGSIZE: the connection is dropped before tmd holds the frame
        big = fuzz_dealer(ctx, address, keys, "client", rng)
        big.send(b"[" + b"1," * (BIG_FRAME_BYTES // 2 - 1) + b"1]", zmq.NOBLOCK)
        time.sleep(0.3)
        big.close()
    for i in range(200):  # rapid connect/disconnect, some sending a frame first
        s = fuzz_dealer(ctx, address, keys, hows[i % len(hows)], rng)
        if i % 3 == 0:
            try:
                s.send(rng.randbytes(64), zmq.NOBLOCK)
            except zmq.Again:
                pass
        s.close()
    # Every authenticated connection's frames were handled once tmd answers on it; the others were refused
    # by ZeroMQ (no handshake), so tmd never saw them.
    assert answers_status(socks["client"]), "tmd did not answer the fuzzing client"
    fresh = fuzz_dealer(ctx, address, keys, "client", rng)
    assert answers_status(fresh), "tmd did not answer a new client"
    fuzz_s = time.monotonic() - started
    for s in [*socks.values(), fresh]:
        s.close()
    ctx.term()

    assert proc.poll() is None, "tmd exited"
    wait_until(lambda: status().step > step_before + 20, 60, "steps to keep advancing")
    r = subprocess.run([sys.executable, "-m", "tmctl.cli", "status", "--run-dir", run_dir],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    grown = tmd.memory_info().rss - rss_before
    assert grown < RSS_GROWTH_BYTES, f"tmd's RSS grew by {grown / 2**20:.1f} MiB"
    journal = events(run_dir)
    names = [e["event"] for e in journal]
    assert Event.TMD_CRASHED not in names and Event.INTERNAL_ERROR not in names, \
        [e for e in journal if e["event"] in (Event.TMD_CRASHED, Event.INTERNAL_ERROR)]
    bad = names.count(Event.BAD_MESSAGE) - bad_before
    dropped = sum(e["count"] for e in journal if e["event"] == Event.BAD_MESSAGES_DROPPED)
    assert 0 < bad < 200 and bad + dropped >= 1000, (bad, dropped)  # aggregated, and most frames counted
    assert os.path.getsize(os.path.join(run_dir, "events.jsonl")) < 4 * 1024 * 1024
    print(f"[fuzz] {len(frames)} frames ({unsent} not queued) in {fuzz_s:.1f} s; bad_message {bad}, "
          f"dropped {dropped}; RSS +{grown / 2**20:.1f} MiB", flush=True)
    assert proc.poll() is None, "the job ended during the fuzz: raise ARGS' padding"


@pytest.mark.timeout(240)
def test_the_job_ends_untouched_and_bit_identical(job):
    run_dir = job["run_dir"]
    end_padding(run_dir)  # the attacks are over: the rest at the job's own speed
    assert job["proc"].wait(timeout=180) == 0
    ev = events(run_dir)
    names = [e["event"] for e in ev]
    for harmful in (Event.MIGRATION_REQUESTED, Event.NODE_FAILED, Event.RECOVERY_STARTED, Event.COLLECTIVE_FAILED,
                    Event.JOB_FAILED, Event.STANDBY_ADDED, Event.GPU_UNHEALTHY, Event.EVACUATION_STARTED,
                    Event.RANK_LEFT, Event.TMD_CRASHED, Event.INTERNAL_ERROR):
        assert harmful not in names, (harmful, [e for e in ev if e["event"] == harmful])
    assert names.count(Event.RANK_DONE) == 4
    refused = [e for e in ev if e["event"] == Event.REGISTER_REFUSED]
    assert len(refused) == 1 and refused[0]["node"] == "n2", refused
    assert any(e["event"] in (Event.BAD_MESSAGE, Event.BAD_MESSAGES_DROPPED) for e in ev)
    assert all(not str(e.get("sender", "")).startswith("n2/0") or e["event"] != Event.WORKER_REGISTERED for e in ev)

    assert final_hashes(run_dir) == job["reference"] and len(job["reference"]) == 4
    with open(os.path.join(run_dir, "tmd.json")) as f:
        assert json.load(f)["keys"] == os.path.join(run_dir, "keys")

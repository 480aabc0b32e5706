"""A bounded fuzz of a live job's tmd (issue 10): whatever arrives on its socket, tmd stays up and bounded.

One local job (2 nodes x 2 ranks, the tiny GPT) trains while ~2,400 bad frames reach tmd from authenticated
senders (the job's client and worker keys) and unauthenticated ones (a plain DEALER; a CURVE client with a key
of its own): random bytes, truncated messages, deep nesting, huge numbers, lone surrogates, wrong field types,
unknown kinds, three 50 MB frames, and rapid connect/disconnect. Asserted: tmd stays up and nothing in it
crashed, steps keep advancing, ``tmctl status`` answers, tmd's RSS grows by less than 20 MB, the journal stays
bounded, and the final state is bit-identical to an uninterrupted run of the same seed. Fixed seed.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time

import psutil
import pytest
import zmq

from tests.support import events, wait_until
from tests.support.job import final_hashes, job_client, tmd_command, wait_for_address
from tmd import protocol as p
from tmd.protocol.keys import JobKeys
from tmd.protocol.vocab import Event, Sender

SEED = 20261123
STEPS = 400
ARGS = ("--min-step-time-s", "0.04")  # the job outlives the fuzz; does not change the numerics
BIG_FRAME_BYTES = 50 * 1024 * 1024
RSS_GROWTH_BYTES = 20 * 1024 * 1024


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


def dealer(ctx: zmq.Context, address: str, keys: JobKeys, how: str, rng: random.Random) -> zmq.Socket:
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


@pytest.mark.timeout(240)
def test_fuzzing_tmd_leaves_the_job_untouched(tmp_path, gpt_reference):
    reference = gpt_reference(STEPS)  # before the job: never alongside it
    run_dir = str(tmp_path)
    proc = subprocess.Popen(tmd_command(run_dir, 0, STEPS, True, True, ARGS), stdout=subprocess.DEVNULL)
    try:
        client = job_client(run_dir, proc)
        status = lambda: client.request(p.StatusRequest())  # noqa: E731
        wait_until(lambda: status().step > 20, 120, "training to start")
        address = wait_for_address(run_dir, proc)
        keys = JobKeys.load(os.path.join(run_dir, "keys"))
        tmd = psutil.Process(proc.pid)
        rss_before = tmd.memory_info().rss
        step_before = status().step
        rng = random.Random(SEED)
        frames = bad_frames(rng)
        ctx = zmq.Context()
        hows = ["client", "worker", "plain", "stranger"]
        started = time.monotonic()
        socks = {how: dealer(ctx, address, keys, how, rng) for how in hows}
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
            big = dealer(ctx, address, keys, "client", rng)
            big.send(b"[" + b"1," * (BIG_FRAME_BYTES // 2 - 1) + b"1]", zmq.NOBLOCK)
            time.sleep(0.3)
            big.close()
        for i in range(200):  # rapid connect/disconnect, some sending a frame first
            s = dealer(ctx, address, keys, hows[i % len(hows)], rng)
            if i % 3 == 0:
                try:
                    s.send(rng.randbytes(64), zmq.NOBLOCK)
                except zmq.Again:
                    pass
            s.close()
        # Every authenticated connection's frames were handled once tmd answers on it; the others were refused
        # by ZeroMQ (no handshake), so tmd never saw them.
        assert answers_status(socks["client"]), "tmd did not answer the fuzzing client"
        fresh = dealer(ctx, address, keys, "client", rng)
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
        bad = names.count(Event.BAD_MESSAGE)
        dropped = sum(e["count"] for e in journal if e["event"] == Event.BAD_MESSAGES_DROPPED)
        assert 0 < bad < 200 and bad + dropped >= 1000, (bad, dropped)  # aggregated, and most frames counted
        assert os.path.getsize(os.path.join(run_dir, "events.jsonl")) < 4 * 1024 * 1024
        print(f"[fuzz] {len(frames)} frames ({unsent} not queued) in {fuzz_s:.1f} s; bad_message {bad}, "
              f"dropped {dropped}; "
              f"RSS +{grown / 2**20:.1f} MiB", flush=True)
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=30)
    assert final_hashes(run_dir) == reference and len(reference) == 4
